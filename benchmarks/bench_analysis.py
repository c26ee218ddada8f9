"""How long multirun_analysis takes on a large sweep.

Writes a synthetic sweep of --runs run directories (default 10,000; results.csv with
--epochs rows, run.json and a .hydra folder each, laid out like a Hydra multirun,
with a few failed, running and truncated runs mixed in), then times:

  1. collect: find and read every run (multirun_analysis.collect)
  2. tables:  per-run metrics, seed aggregation, scaling and accuracy tables
  3. the full command in a fresh interpreter, plots and report included

    .venv/bin/python benchmarks/bench_analysis.py                 # temp dir, removed after
    .venv/bin/python benchmarks/bench_analysis.py --dir /tmp/big  # new or empty; kept for a look at the report
"""

from __future__ import annotations

import argparse
import csv
import io
import copy
import functools
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))  # ddpscale's config schema
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_args

from bench_args import at_least, new_directory  # noqa: E402
from multirun_analysis.schema import EXTRA_NUMERIC, EXTRA_SETTINGS, REQUIRED  # noqa: E402

# The columns train.py writes: the contract's, then the optional ones the analysis reads.
COLUMNS = [*REQUIRED, "warmup", *EXTRA_NUMERIC, *EXTRA_SETTINGS]
LAYOUTS = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8)]  # (nodes, GPUs per node): world size 1..16
BATCHES = [32, 64, 128, 256, 512]
LRS = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
OPTIMIZERS = ["sgd", "adamw"]
TRAIN_IMAGES = 60_000


def _at(seconds: int) -> str:
    start = datetime(2026, 12, 2, 11, tzinfo=timezone.utc)
    return (start + timedelta(seconds=seconds)).isoformat()


def write_sweep(root: Path, runs: int, epochs: int) -> None:
    """A Hydra-like multirun: root/<date>/<time>/<job>/ with results.csv, run.json, .hydra/."""
    rng = random.Random(0)
    grid = itertools.cycle(itertools.product(LAYOUTS, BATCHES, LRS, OPTIMIZERS))
    seeds: dict = {}
    for job in range(runs):
        setting = next(grid)
        seed = seeds[setting] = seeds.get(setting, -1) + 1  # repeats of a setting differ by seed
        (nodes, gpus), batch, lr, optimizer = setting
        directory = root / "2026-12-02" / f"11-{job // 1000:02d}-00" / str(job)
        (directory / ".hydra").mkdir(parents=True)
        (directory / ".hydra" / "overrides.yaml").write_text(f"- distributed.num_gpus={gpus}\n")
        fate = rng.random()
        status = "failed" if fate < 0.01 else "running" if fate < 0.015 else "completed"
        done = rng.randint(0, epochs - 1) if status != "completed" else epochs
        text = _results(nodes, gpus, batch, lr, optimizer, seed, epochs, done, rng)
        if 0.015 <= fate < 0.02:
            text = text[: -rng.randint(5, 60)]  # killed mid-write
        (directory / "results.csv").write_text(text)
        (directory / "run.json").write_text(
            json.dumps(
                {
                    "status": status,
                    "error": "RuntimeError: NCCL watchdog timeout" if status == "failed" else None,
                    # one job after another on each of 8 hosts, 9 minutes each
                    "start_time": _at(job // 8 * 540),
                    "end_time": None if status == "running" else _at(job // 8 * 540 + 539),
                    "overrides": [
                        f"distributed.num_gpus={gpus}",
                        f"data.batch_size={batch}",
                        f"optim.lr={lr}",
                    ],
                    "config": _config(nodes, gpus, batch, lr, optimizer, seed, epochs, job),
                    "versions": {"torch": "2.5.0"},
                    "devices": ["NVIDIA H100"] * gpus,
                    "git_commit": "abc123",
                    "hostname": f"node{job % 8}",
                    "launcher": "torchrun",
                    "world_size": nodes * gpus,
                    "output_dir": str(directory),
                }
            )
        )


def _config(nodes, gpus, batch, lr, optimizer, seed, epochs, job) -> dict:
    """A resolved config as train.py writes it into run.json, every key present (the
    analysis reads them all to find the keys that tell runs apart)."""
    cfg = copy.deepcopy(_default_config(optimizer))
    cfg["data"].update(name="fashion_mnist", batch_size=batch)
    cfg["optim"]["lr"] = lr
    cfg["distributed"].update(num_gpus=gpus, num_nodes=nodes, master_port=29500 + job % 7)
    cfg["train"].update(epochs=epochs, seed=seed)
    return cfg


@functools.cache
def _default_config(optimizer: str) -> dict:
    from ddpscale.config import AdamWConfig, CNNConfig, Config, DataConfig, DistributedConfig, SGDConfig, as_dict

    optim = SGDConfig() if optimizer == "sgd" else AdamWConfig()
    return as_dict(Config(model=CNNConfig(), data=DataConfig(name="fashion_mnist"), optim=optim,
                          distributed=DistributedConfig()))


def _results(nodes, gpus, batch, lr, optimizer, seed, epochs, done, rng) -> str:
    world = nodes * gpus
    per_worker = 2000 * batch / (batch + 64)
    sync = min(0.6, 0.04 * (world - 1) ** 0.8 * (1.5 if nodes > 1 else 1.0) * 64 / batch)
    throughput = world * per_worker * (1 - sync)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(COLUMNS)
    elapsed = 0.0
    for epoch in range(1, done + 1):
        ips = throughput * (0.6 if epoch == 1 else rng.uniform(0.97, 1.03))
        epoch_time = TRAIN_IMAGES / ips
        elapsed += epoch_time
        acc = min(
            0.93, 0.93 - 0.5 * (1 - min(1.0, lr * 20)) ** 2 - 0.02 * (world * batch / 1024) ** 0.5
        ) * (1 - 0.5**epoch)
        row = {
            "model": "cnn", "dataset": "fashion_mnist", "optimizer": optimizer,
            "num_nodes": nodes, "num_gpus": gpus, "world_size": world, "backend": "nccl",
            "device": "cuda", "batch_size": batch, "global_batch_size": batch * world, "lr": lr,
            "seed": seed, "epochs": epochs, "epoch": epoch, "train_loss": 1 - acc,
            "train_acc": acc + 0.01, "val_loss": 1.05 - acc,
            "val_acc": round(acc + rng.uniform(-0.005, 0.005), 4),
            "epoch_time_s": round(epoch_time, 4), "elapsed_s": round(elapsed, 4),
            "images_per_sec": round(ips, 2), "warmup": epoch == 1, "step_time_p50_s": 0.05,
            "step_time_p90_s": 0.06, "grad_sync_share": round(sync, 4), "eval_time_s": 1.5,
            "precision": "fp32", "data_loader": "memory", "launcher": "torchrun",
            "comm_hook": "auto", "grad_accum_steps": 1,
        }
        writer.writerow([row[c] for c in COLUMNS])  # a column added to the schema fails here
    return out.getvalue()


def timed(label: str, fn):
    start = time.perf_counter()
    result = fn()
    print(f"{label:<46} {time.perf_counter() - start:7.2f} s", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=at_least(1), default=10_000, help="run directories to write (default 10,000)")
    parser.add_argument("--epochs", type=at_least(1), default=5, help="epochs per completed run (default 5)")
    parser.add_argument(
        "--dir",
        type=new_directory,
        default=None,
        help="write the sweep (and DIR/analysis) here and keep it; DIR must be new or empty",
    )
    args = parser.parse_args()

    from multirun_analysis.collect import collect
    from multirun_analysis.runs import summarise_runs
    from multirun_analysis.tables import accuracy_table, configurations, scaling_table

    with tempfile.TemporaryDirectory() as scratch:
        root = args.dir or Path(scratch) / "sweep"
        kept = "" if args.dir else " (temporary, removed at exit; --dir DIR keeps it)"
        print(f"sweep: {args.runs:,} runs x {args.epochs} epochs in {root}{kept} ({os.cpu_count()} CPUs)")
        # always written afresh: --dir refuses a directory with an earlier sweep in it,
        # whose runs would be timed under this run's count
        timed("write the sweep", lambda: write_sweep(root, args.runs, args.epochs))
        collected = timed("collect (find and read every run)", lambda: collect([root]))

        def tables():
            runs = summarise_runs(collected.epochs, collected.runs, 0.9)
            configs = configurations(runs)
            return runs, configs, scaling_table(configs), accuracy_table(configs, 0.9)

        if collected.epochs.empty:
            sys.exit("no epoch rows were read: the generated files no longer match the schema")
        runs, configs, scaling, accuracy = timed("tables (runs, seeds, scaling, accuracy)", tables)
        print(
            f"  -> {len(collected.epochs):,} epoch rows, {len(runs):,} runs "
            f"({int(runs.included.sum()):,} analysed), {len(configs):,} configurations, "
            f"{scaling.group.nunique()} scaling groups"
        )
        out = root / "analysis" if args.dir else Path(scratch) / "analysis"
        command = [sys.executable, "-m", "multirun_analysis", str(root), "--out", str(out)]
        result = timed(
            "full command, fresh interpreter (plots, report)",
            lambda: subprocess.run(command, cwd=REPO, capture_output=True, text=True),
        )
        if result.returncode != 0:
            sys.exit(f"the command failed:\n{result.stderr}")
        print("  -> " + result.stdout.strip().replace("\n", "\n  -> "))
        if not args.dir:
            print("  (the report and the sweep are in a temporary directory, removed at exit: "
                  "--dir DIR keeps them)")


if __name__ == "__main__":
    main()
