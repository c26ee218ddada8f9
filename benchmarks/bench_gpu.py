"""One GPU: how long a full Fashion-MNIST epoch takes, and whether CUDA training is right.

    .venv/bin/python benchmarks/bench_gpu.py                  # on a CUDA machine, a few minutes
    .venv/bin/python benchmarks/bench_gpu.py --json gpu.json  # also save the figures
    .venv/bin/python benchmarks/bench_gpu.py --device cpu --train-size 2048 --val-size 512 \
        --cases fp32,dataloader                               # the same plumbing without a GPU

Every case is `python train.py distributed.num_gpus=1 ...` as a user runs it, on the whole
training set (60,000 images; --train-size for fewer) with the in-memory data path, which
keeps the data set on the GPU; each run's results.csv gives its epoch times. Epoch 1 is
warm-up (CUDA context, cuDNN's algorithm search, torch.compile), so the figure is the
fastest later epoch, with the median of the later epochs beside it. The aim on an H200
is a full epoch in under 1 second.

The checks (exit 1 when one fails): every case ran (a failed case is reported and the
others still run: one compile error does not cost a GPU session's figures), trained on the
device asked for (results.csv's `device`), ended with a finite loss and learned (final
val_acc above --min-acc); and the in-memory path and the DataLoader path, same seed and settings, agree in final val_acc
within --acc-tolerance (they draw the same shards in the same order).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_args import at_least, fraction, output_file, seconds  # noqa: E402
from bench_training import PY, results_rows, run  # noqa: E402

# name: (what it shows, train.py overrides); "fp32" and "dataloader" differ only in the path
CASES = {
    "fp32": ("the issue's settings: fp32, batch 128", []),
    "bf16": ("bf16 autocast, channels_last, batch 128", ["train.precision=bf16", "train.channels_last=true"]),
    "bf16-512": ("bf16 autocast, channels_last, batch 512",
                 ["train.precision=bf16", "train.channels_last=true", "data.batch_size=512"]),
    "fp16": ("fp16 autocast with the gradient scaler, batch 128 (CUDA only)", ["train.precision=fp16"]),
    "compile": ("torch.compile, bf16, channels_last, batch 512",
                ["train.compile=true", "train.precision=bf16", "train.channels_last=true", "data.batch_size=512"]),
    "dataloader": ("the DataLoader path (4 loader processes), fp32, batch 128",
                   ["data.loader=dataloader", "data.num_workers=4"]),
}
CUDA_ONLY = {"fp16"}
TARGET_EPOCH_S = 1.0


def case_names(text: str) -> list[str]:
    """A comma-separated list of CASES' names."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown case {', '.join(unknown) or repr(text)}; "
                                         f"choose from {', '.join(CASES)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="distributed.device (default cuda)")
    p.add_argument("--cases", type=case_names, default=None,
                   help=f"comma-separated, from {', '.join(CASES)} (default: all the device runs; fp16 needs CUDA)")
    p.add_argument("--epochs", type=at_least(2, "epoch 1 is warm-up"), default=4)
    p.add_argument("--train-size", type=at_least(1), default=None, help="training images (default: all 60,000)")
    p.add_argument("--val-size", type=at_least(1), default=None, help="validation images (default: all 10,000)")
    p.add_argument("--min-acc", type=fraction, default=0.8, help="final val_acc every run must pass (default 0.8)")
    p.add_argument("--acc-tolerance", type=fraction, default=0.01,
                   help="most the two data paths' final val_acc may differ (default 0.01)")
    p.add_argument("--data-root", default=None, help="DIR with FashionMNIST/raw/ (default: train.py's data.root)")
    p.add_argument("--json", type=output_file, default=None, help="also write the figures to this JSON file")
    p.add_argument("--timeout", type=seconds, default=600, help="seconds allowed per run")
    args = p.parse_args(argv)
    if args.cases is None:  # every case, less those the device cannot run: --device cpu alone works
        args.cases = [name for name in CASES if args.device == "cuda" or name not in CUDA_ONLY]
    if args.device == "cpu" and CUDA_ONLY & set(args.cases):
        p.error(f"--cases {','.join(sorted(CUDA_ONLY & set(args.cases)))} needs --device cuda")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: no CUDA device is visible here; on a machine without a GPU, "
                    "--device cpu runs the same cases but fp16 (a smaller --train-size keeps it short)")
    if args.data_root:
        args.data_root = str(Path(args.data_root).expanduser().resolve())
    return args


def train_cmd(args: argparse.Namespace, overrides: list[str], run_dir: Path) -> list[str]:
    cmd = [PY, "train.py", "distributed.num_gpus=1", f"distributed.device={args.device}",
           "data.batch_size=128", f"train.epochs={args.epochs}", "train.sync_probe_steps=0",
           "train.progress=false"]
    for key, value in [("data.train_size", args.train_size), ("data.val_size", args.val_size),
                       ("data.root", args.data_root)]:
        if value is not None:
            cmd.append(f"{key}={value}")
    return cmd + overrides + [f"hydra.run.dir={run_dir}"]


def measure(name: str, rows: list[dict]) -> dict:
    """One run's figures from its results.csv rows."""
    later = [r for r in rows if int(r["epoch"]) > 1]
    fastest = min(later, key=lambda r: float(r["epoch_time_s"]))
    last = rows[-1]
    return {"case": name, "device": last["device"], "train_count": int(last["train_count"]),
            "best_epoch_s": float(fastest["epoch_time_s"]),
            "median_epoch_s": statistics.median(float(r["epoch_time_s"]) for r in later),
            "images_per_sec": float(fastest["images_per_sec"]),
            "first_epoch_s": float(rows[0]["epoch_time_s"]),
            "final_train_loss": float(last["train_loss"]), "final_val_acc": float(last["val_acc"])}


def checks(args: argparse.Namespace, results: dict[str, dict]) -> list[tuple[str, bool]]:
    """(what was checked, whether it held), for the figures of every case that ran."""
    out = []
    for name, r in results.items():
        out.append((f"{name}: trained on {args.device} (results.csv says {r['device']})", r["device"] == args.device))
        out.append((f"{name}: final train_loss {r['final_train_loss']:.4f} is finite",
                    math.isfinite(r["final_train_loss"])))
        out.append((f"{name}: final val_acc {r['final_val_acc']:.4f} > {args.min_acc}", r["final_val_acc"] > args.min_acc))
    if "fp32" in results and "dataloader" in results:
        gap = abs(results["fp32"]["final_val_acc"] - results["dataloader"]["final_val_acc"])
        out.append((f"in-memory and DataLoader paths agree: final val_acc {results['fp32']['final_val_acc']:.4f} "
                    f"and {results['dataloader']['final_val_acc']:.4f}, within {args.acc_tolerance}",
                    gap <= args.acc_tolerance))
    return out


def fastest_full_epoch(results: dict[str, dict]) -> dict | None:
    """The case with the fastest epoch over all 60,000 training images, and whether it beat
    the aim; None when no case trained on the whole set (--train-size)."""
    full = [r for r in results.values() if r["train_count"] >= 60000]
    if not full:
        return None
    best = min(full, key=lambda r: r["best_epoch_s"])
    return {"case": best["case"], "epoch_s": best["best_epoch_s"], "aim_s": TARGET_EPOCH_S,
            "aim_met": best["best_epoch_s"] < TARGET_EPOCH_S}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    repo = Path(__file__).resolve().parents[1]
    results, failed = {}, {}
    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        for i, name in enumerate(args.cases):
            label, overrides = CASES[name]
            run_dir = Path(tmp) / f"{i:02d}-{name}"
            try:
                out, start, end = run(train_cmd(args, overrides, run_dir), args.timeout, cwd=repo)
                results[name] = measure(name, results_rows(run_dir)) | {"label": label, "wall_s": end - start}
            except (RuntimeError, OSError, ValueError) as err:
                # a failed case (a compile error, a timeout) is one failed check: the cases
                # measured so far, and those after it, keep their figures
                failed[name] = str(err)
                print(f"  {name:<11} {label:<58} FAILED: {err}", flush=True)
                continue
            r = results[name]
            print(f"  {name:<11} {label:<58} best epoch {r['best_epoch_s']:6.3f}s  median {r['median_epoch_s']:6.3f}s"
                  f"  {r['images_per_sec']:9.0f} img/s  epoch 1 {r['first_epoch_s']:6.2f}s"
                  f"  val_acc {r['final_val_acc']:.4f}", flush=True)
    verdicts = [(f"{name}: ran ({error.splitlines()[0]})", False) for name, error in failed.items()]
    verdicts += checks(args, results)
    for what, held in verdicts:
        print(f"  [{'ok' if held else 'FAILED'}] {what}")
    fastest = fastest_full_epoch(results)
    if fastest:
        print(f"fastest full epoch: {fastest['epoch_s']:.3f}s ({fastest['case']}: "
              f"{results[fastest['case']]['label']}); aim < {TARGET_EPOCH_S:g}s: "
              f"{'met' if fastest['aim_met'] else 'not met'}")
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)}, "results": results,
                                         "failed": failed, "checks": verdicts, "fastest_full_epoch": fastest}, indent=2, default=str))
    return 0 if all(held for _, held in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
