"""Training speed: ddpscale against the textbook DDP loop, the machine's limit, a bare script.

    .venv/bin/python benchmarks/bench_training.py                 # about 20 minutes on 2 cores
    .venv/bin/python benchmarks/bench_training.py --quick         # smoke run, about two minutes
    .venv/bin/python benchmarks/bench_training.py --json out.json # also save the figures

Every figure is measured in this run, on this machine, each in its own process:

1. throughput: `python train.py ...` exactly as a user runs it (images/sec of epoch 2 from
   its results.csv) against benchmarks/textbook_ddp.py (the hand-written DataLoader +
   DistributedSampler + ToTensor/Normalize recipe), same CNN, batch size, world size and
   training images; both report epoch 2 (epoch 1 is warm-up), summed over ranks.
2. weak scaling, one thread per worker: 1 worker; 2 ddpscale workers (shared-memory
   all-reduce, the default, and gloo's); 2 textbook workers; and the machine's limit:
   2 processes training the same way (ddpscale's in-memory batches and loop body, same
   model, same shards, the process set up by ddpscale's own worker setup: threads and
   allocator) at the same time with no process group and no DDP, summed; and that limit
   made lock-step, its processes meeting after every backward and exchanging nothing:
   the most any synchronous training keeps of the limit in a separate run. Separate runs
   differ by 5-10% in this VM's speed alone, so the same comparison also runs inside
   one pair of processes: ddpscale's DDP model (its wrap_ddp, buckets and default
   all-reduce) trains in short blocks, rotating synced blocks (ddpscale's step), unsynced
   ones (the same step under no_sync: the limit) and lock-step ones (no_sync, but the
   processes meet after every backward, where DDP's all-reduce waits, exchanging
   nothing). Neighbouring blocks share the machine's speed of the moment; lock-step is
   the most any synchronous data-parallel training reaches here (every step lasts as
   long as the slower worker's), so it separates what lock-step costs on this machine
   from what ddpscale's gradient synchronisation adds. The limit's own step times give
   the same bound a third way: each step made as long as the slower process's.
3. start to first training step: a bare script (import torch, read the data, build the
   model, one step) against a one-step `train.py` run; ddpscale's first step is bounded
   by the moment its results.csv row appears (the row follows the step, the reductions
   and an evaluation of 64 images), so its overhead is if anything overstated.

Each worker does --steps steps of --batch-size per epoch (train_size = steps x batch x
world size), so every configuration runs equally long per worker. The throughput cases
run --repeats times, interleaved, and the best is kept (all values are printed); the
headline cases (limit, ddpscale 2 workers, lock-step limit) run twice per repeat, A-B-C
first and C-B-A last, and the verdict is the median of the ratios of neighbouring runs
(ddpscale against each of the others), which cancels the slow drift of a shared VM's
speed that a ratio of two bests does not. The interleaved
case runs --rounds rounds of --block-steps-step blocks per repeat, and its ratios pool
every round of every repeat (images/sec over all blocks of a kind). Beside both
weak-scaling verdicts the report prints a 90% bootstrap interval (resampling the pairs,
or the rounds): whether this run's own noise could have turned the verdict. The start-up
cases run --startup-repeats times and the median is kept. Other load on the
machine lowers every figure, and the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()
sys.path.insert(0, str(REPO / "src"))  # ddpscale, here and in the spawned workers
sys.path.insert(0, str(THIS.parent))  # bench_args, also where this file is imported by path
from bench_args import at_least, output_file, seconds  # noqa: E402
TEXTBOOK = THIS.parent / "textbook_ddp.py"
PY = sys.executable
MEAN, STD = 0.2860, 0.3530  # conf/data/fashion_mnist.yaml
LR = 0.05  # conf/optim/sgd.yaml
RAW_STEMS = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]  # each plain or .gz, as train.py reads them
TRAIN_IMAGES, VAL_IMAGES = 60_000, 10_000  # Fashion-MNIST's splits
TARGETS = {"vs_textbook": 1.25, "vs_limit": 0.95, "startup_s": 3.0}
MODES = ("synced", "unsynced", "lockstep")  # the interleaved case's kinds of block
INTERVAL_LEVEL = 0.9  # of the bootstrap intervals printed beside the weak-scaling ratios


@dataclass
class Case:
    """One throughput configuration and what it measured."""

    key: str
    label: str
    world: int  # worker processes
    threads: str  # per worker, as configured
    command: list[str] = field(default_factory=list)
    images_per_sec: list[float] = field(default_factory=list)
    repeat: list[int] = field(default_factory=list)  # the repeat of each images_per_sec value
    extra: dict = field(default_factory=dict)

    @property
    def best(self) -> float:
        return max(self.images_per_sec) if self.images_per_sec else float("nan")


# --------------------------------------------------------------------------- running


def run(cmd: list[str], timeout: float, cwd: Path = REPO) -> tuple[str, float, float]:
    """Run a command in its own session; (stdout, start time, end time); raise on failure."""
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the workers it spawned, too
        proc.communicate()
        raise RuntimeError(f"timed out after {timeout:.0f}s: {' '.join(cmd)}")
    except BaseException:  # Ctrl-C: its own session does not see the SIGINT, so end it here
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    end = time.time()
    if proc.returncode != 0:
        tail = "\n".join((out + err).strip().splitlines()[-25:])
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd)}\n{tail}")
    return out, start, end


def results_rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "results.csv", newline="") as f:
        return list(csv.DictReader(f))


def tagged(out: str) -> list[dict]:
    return [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]


def ddpscale_cmd(world: int, train_size: int, val_size: int, epochs: int, batch: int,
                 run_dir: Path, data_root: str | None, threads: int | None = None,
                 extra: tuple[str, ...] = ()) -> list[str]:
    cmd = [PY, "train.py", f"distributed.num_gpus={world}", f"data.batch_size={batch}",
           f"data.train_size={train_size}", f"data.val_size={val_size}",
           f"train.epochs={epochs}", "train.sync_probe_steps=0", *extra]
    if threads:
        cmd.append(f"train.threads={threads}")
    if data_root:
        cmd.append(f"data.root={data_root}")
    return cmd + [f"hydra.run.dir={run_dir}"]


class Bench:
    """Holds the settings and the temp directory; one method per kind of measurement."""

    def __init__(self, args: argparse.Namespace, tmp: Path):
        self.args, self.tmp = args, tmp
        self.raw = find_raw(args.data_root)
        # train.py resolves data.root against the repository when run from it
        self.ddp_root = None if self.raw.parent.parent == REPO / "data" else str(self.raw.parent.parent)
        self.tv_root = tmp / "torchvision"  # torchvision extracts its own copy here
        (self.tv_root / "FashionMNIST" / "raw").mkdir(parents=True)
        for stem in RAW_STEMS:  # extracted, as torchvision looks for them: it then reads
            # them as they are, where a mix of plain and .gz files would send it downloading
            (self.tv_root / "FashionMNIST" / "raw" / stem).write_bytes(raw_bytes(self.raw, stem))
        self.count = 0

    def size(self, world: int) -> int:
        return self.args.steps * self.args.batch_size * world

    def fresh_dir(self, name: str) -> Path:
        self.count += 1
        return self.tmp / f"{self.count:03d}-{name}"

    def ddpscale(self, case: Case, threads: int | None = None, *extra: str) -> None:
        run_dir = self.fresh_dir(case.key)
        case.command = ddpscale_cmd(case.world, self.size(case.world), self.args.val_size, 2,
                                    self.args.batch_size, run_dir, self.ddp_root, threads, extra)
        run(case.command, self.args.timeout)
        row = next(r for r in results_rows(run_dir) if r["epoch"] == "2")
        case.images_per_sec.append(float(row["images_per_sec"]))
        case.extra.setdefault("step_time_p50_s", []).append(float(row["step_time_p50_s"]))

    def textbook(self, case: Case, threads: int | None = None) -> None:
        case.command = [PY, str(TEXTBOOK), "--root", str(self.tv_root), "--world-size", str(case.world),
                        "--batch-size", str(self.args.batch_size), "--train-size",
                        str(self.size(case.world)), "--epochs", "2", "--lr", str(LR)]
        if threads:
            case.command += ["--threads", str(threads)]
        out, _, _ = run(case.command, self.args.timeout)
        row = next(r for r in tagged(out) if r["epoch"] == 2)
        case.images_per_sec.append(row["images_per_sec"])
        case.extra["threads_seen"] = row["threads"]

    def nosync(self, case: Case, *extra: str) -> None:
        case.command = [PY, str(THIS), "--worker", "nosync", "--procs", str(case.world),
                        "--steps", str(self.args.steps), "--batch-size", str(self.args.batch_size),
                        "--data-root", str(self.raw.parent.parent), *extra]
        out, _, _ = run(case.command, self.args.timeout)
        row = next(r for r in tagged(out) if r["epoch"] == 2)
        case.images_per_sec.append(row["images_per_sec"])
        case.extra["ddpscale_threads_at_2_workers"] = row["ddpscale_threads_at_2_workers"]
        case.extra.setdefault("lockstep_bound", []).append(row["lockstep_bound"])

    def interleaved(self, case: Case) -> None:
        case.command = [PY, str(THIS), "--worker", "interleaved", "--procs", str(case.world),
                        "--block-steps", str(self.args.block_steps), "--rounds", str(self.args.rounds),
                        "--batch-size", str(self.args.batch_size), "--data-root", str(self.raw.parent.parent)]
        out, _, _ = run(case.command, self.args.timeout)
        rounds = tagged(out)
        case.extra.setdefault("rounds", []).extend(rounds)
        case.images_per_sec.append(_pooled(rounds, "synced"))

    def startup_bare(self) -> tuple[float, float, list[str]]:
        cmd = [PY, str(THIS), "--worker", "bare", "--batch-size", str(self.args.batch_size),
               "--data-root", str(self.raw.parent.parent)]
        out, start, end = run(cmd, self.args.timeout)
        first = next(r for r in tagged(out))["first_step_done"]
        return first - start, end - start, cmd

    def startup_ddpscale(self, world: int) -> tuple[float, float, list[str]]:
        run_dir = self.fresh_dir(f"startup-ws{world}")
        cmd = ddpscale_cmd(world, self.args.batch_size * world, 64, 1, self.args.batch_size,
                           run_dir, self.ddp_root)
        _, start, end = run(cmd, self.args.timeout)
        written = (run_dir / "results.csv").stat().st_mtime
        return written - start, end - start, cmd


def find_raw(data_root: str | None) -> Path:
    """FashionMNIST/raw under --data-root, or the default roots; an absolute path, as the
    runs it is handed to work in the checkout, not in the caller's directory."""
    candidates = ([Path(os.path.abspath(Path(data_root).expanduser()))] if data_root
                  else [REPO / "data", REPO.parent / "shared" / "data"])
    folders = [root / "FashionMNIST" / "raw" for root in candidates]
    for raw in folders:
        if all(raw_file(raw, stem) for stem in RAW_STEMS):
            return raw
    raise SystemExit(f"no Fashion-MNIST data in {' or '.join(str(f) for f in folders)} (looked for "
                     f"{', '.join(RAW_STEMS)}, plain or .gz); pass --data-root DIR, with the four "
                     "files in DIR/FashionMNIST/raw")


def raw_file(raw: Path, stem: str) -> Path | None:
    """The data file `stem` in `raw`: plain, else gzipped (train.py's order); None if neither."""
    return next((p for p in (raw / stem, raw / f"{stem}.gz") if p.is_file()), None)


def raw_bytes(raw: Path, stem: str) -> bytes:
    """The contents of the data file `stem` in `raw`, decompressed if it is gzipped."""
    import gzip

    path = raw_file(raw, stem)
    return gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()


# --------------------------------------------------------------------------- the benchmark


def benchmark(args: argparse.Namespace) -> dict:
    machine = describe_machine()
    print_header(args, machine)
    with tempfile.TemporaryDirectory(prefix="bench-training-") as tmp:
        bench = Bench(args, Path(tmp))
        # ddp2 runs next to limit2 (their paired ratio is the headline figure) and next
        # to lock2, the limit's processes meeting after every backward: the most any
        # synchronous training reaches in a separate run.
        cases = {c.key: c for c in [
            Case("ddp2", "ddpscale, 2 workers", 2, "cores//2 (ddpscale's rule)"),
            Case("limit2", "limit: 2 procs, no sync", 2, "1"),
            Case("lock2", "limit made lock-step", 2, "1"),
            Case("il2", "interleaved: synced blocks", 2, "1"),
            Case("ddp2_gloo", "ddpscale, 2 workers, gloo sync", 2, "cores//2 (comm_hook=none)"),
            Case("tb2", "textbook, 2 workers", 2, "torch default"),
            Case("tb2_1t", "textbook, 2 workers, 1 thread", 2, "1"),
            Case("solo1", "1 proc, no sync", 1, "1"),
            Case("ddp1_1t", "ddpscale, 1 worker, 1 thread", 1, "1 (train.threads=1)"),
        ] + ([] if args.quick else [
            Case("ddp1", "ddpscale, 1 worker", 1, "cores (ddpscale's rule)"),
            Case("tb1", "textbook, 1 worker", 1, "torch default"),
        ])}
        plan = {
            "ddp2": lambda c: bench.ddpscale(c), "tb2": lambda c: bench.textbook(c),
            "ddp2_gloo": lambda c: bench.ddpscale(c, None, "distributed.comm_hook=none"),
            "tb2_1t": lambda c: bench.textbook(c, threads=1), "limit2": bench.nosync,
            "lock2": lambda c: bench.nosync(c, "--meet"),
            "il2": bench.interleaved,
            "solo1": bench.nosync, "ddp1_1t": lambda c: bench.ddpscale(c, threads=1),
            "ddp1": lambda c: bench.ddpscale(c), "tb1": lambda c: bench.textbook(c),
        }
        # Interleaved, so drift in the load hits every case; the headline cases run twice
        # per repeat in A-B-C ... C-B-A order, so a steady drift cancels in their ratios.
        head = ["limit2", "ddp2", "lock2"]
        order = [*head, *[k for k in cases if k not in head], *reversed(head)]
        for rep in range(args.repeats):
            for key in order:
                case = cases[key]
                t0 = time.time()
                plan[key](case)
                case.repeat.append(rep)
                print(f"  [{rep + 1}/{args.repeats}] {case.label:<32} {case.images_per_sec[-1]:8.0f} img/s"
                      f"  ({time.time() - t0:.0f}s)", flush=True)
        startup = {"bare": [], "ddp1": [], "ddp2": []}
        commands = {}
        for rep in range(args.startup_repeats):
            for key, fn in [("bare", bench.startup_bare), ("ddp1", lambda: bench.startup_ddpscale(1)),
                            ("ddp2", lambda: bench.startup_ddpscale(2))]:
                if key == "ddp2" and args.quick:
                    continue
                first, wall, commands[key] = fn()
                startup[key].append({"first_step_s": first, "wall_s": wall})
                print(f"  [{rep + 1}/{args.startup_repeats}] start-up {key:<5} first step {first:5.2f}s"
                      f"  wall {wall:5.2f}s", flush=True)
    figures = summarise(cases, {k: v for k, v in startup.items() if v})
    report = {"machine": machine, "settings": settings(args),
              "cases": {k: asdict(c) for k, c in cases.items()},
              "startup": {k: v for k, v in startup.items() if v},
              "startup_commands": {k: " ".join(v) for k, v in commands.items()},
              "figures": figures}
    report["machine"]["loadavg_end"] = os.getloadavg()
    print_report(report, cases)
    return report


def _pair_ratios(a: Case, b: Case) -> list[float]:
    """a's throughput / b's throughput measured next to it, in the same repeat.

    Cases that ran equally often in a repeat pair up in order (the A-B ... B-A pairs);
    otherwise a's mean in the repeat is compared with b's."""
    ratios = []
    for rep in sorted(set(a.repeat) & set(b.repeat)):
        xs = [v for v, r in zip(a.images_per_sec, a.repeat) if r == rep]
        ys = [v for v, r in zip(b.images_per_sec, b.repeat) if r == rep]
        if len(xs) != len(ys):
            xs, ys = [statistics.mean(xs)], [statistics.mean(ys)]
        ratios += [x / y for x, y in zip(xs, ys)]
    return ratios


def _paired(a: Case, b: Case) -> float:
    """Median of the paired ratios (`_pair_ratios`)."""
    return statistics.median(_pair_ratios(a, b))


def _pooled(rounds: list[dict], mode: str) -> float:
    """Images/sec of a mode over all rounds: equal images per block, so the harmonic mean."""
    return len(rounds) / sum(1 / r[mode] for r in rounds)


def cut_points(values: list[float], n: int) -> list[float]:
    """The n - 1 cut points dividing `values` into n equal groups (n=4: quartiles), each
    within the values measured: statistics.quantiles' default method extrapolates past
    the ends of a small sample (a p90 above the slowest of 5 rounds, a p10 below zero)."""
    return statistics.quantiles(values, n=n, method="inclusive") if len(values) > 1 else values * (n - 1)


def _interval(samples: list, statistic, level: float = INTERVAL_LEVEL,
              resamples: int = 2000) -> tuple[float, float]:
    """Bootstrap percentile interval of statistic(samples): the range the figure would
    take if this run were repeated on a machine as uneven as it was during the run.
    Seeded, so the same figures always give the same interval."""
    rng = random.Random(0)
    values = sorted(statistic(rng.choices(samples, k=len(samples))) for _ in range(resamples))
    tail = round((1 - level) / 2 * resamples)
    return values[tail], values[resamples - 1 - tail]


def _synced_vs_unsynced(rounds: list[dict]) -> float:
    return _pooled(rounds, "synced") / _pooled(rounds, "unsynced")


def summarise(cases: dict[str, Case], startup: dict[str, list[dict]]) -> dict:
    best = {k: c.best for k, c in cases.items()}
    f = {
        "ddpscale_vs_textbook_ws2": best["ddp2"] / best["tb2"],
        "ddpscale_ws2_vs_limit": best["ddp2"] / best["limit2"],
        "textbook_1thread_ws2_vs_limit": best["tb2_1t"] / best["limit2"],
        "limit_vs_twice_one_proc": best["limit2"] / (2 * best["solo1"]),
        "ddpscale_weak_scaling_efficiency": best["ddp2"] / (2 * best["ddp1_1t"]),
    }
    if "ddp1" in best and "tb1" in best:
        f["ddpscale_vs_textbook_ws1"] = best["ddp1"] / best["tb1"]
    # Ratios of the two cases measured in the same repeat, a few seconds apart: slow drift
    # of the machine's speed cancels out, which the ratio of two bests does not do.
    pairs = _pair_ratios(cases["ddp2"], cases["limit2"])
    f["ddpscale_ws2_vs_limit_paired"] = statistics.median(pairs)
    f["ddpscale_ws2_vs_limit_paired_interval"] = _interval(pairs, statistics.median)
    f["textbook_1thread_ws2_vs_limit_paired"] = _paired(cases["tb2_1t"], cases["limit2"])
    f["ddpscale_gloo_ws2_vs_limit_paired"] = _paired(cases["ddp2_gloo"], cases["limit2"])
    # The limit made lock-step in a separate run: what synchronous training as such keeps
    # of the limit here, and what ddpscale keeps of that.
    f["lockstep_ws2_vs_limit_paired"] = _paired(cases["lock2"], cases["limit2"])
    pairs = _pair_ratios(cases["ddp2"], cases["lock2"])
    f["ddpscale_ws2_vs_lockstep_paired"] = statistics.median(pairs)
    f["ddpscale_ws2_vs_lockstep_paired_interval"] = _interval(pairs, statistics.median)
    # The same comparison inside one pair of processes, pooled over every round.
    rounds = cases["il2"].extra["rounds"]
    pooled = {m: _pooled(rounds, m) for m in MODES}
    f["interleaved_rounds"] = len(rounds)
    f["interleaved_images_per_sec"] = pooled
    f["interleaved_synced_vs_unsynced"] = _synced_vs_unsynced(rounds)
    f["interleaved_synced_vs_unsynced_interval"] = _interval(rounds, _synced_vs_unsynced)
    f["interleaved_lockstep_vs_unsynced"] = pooled["lockstep"] / pooled["unsynced"]
    f["interleaved_synced_vs_lockstep"] = pooled["synced"] / pooled["lockstep"]
    f["interleaved_synced_vs_unsynced_rounds"] = cut_points([r["synced"] / r["unsynced"] for r in rounds], 4)
    median = {k: statistics.median(r["first_step_s"] for r in v) for k, v in startup.items()}
    f["first_step_s"] = median
    f["startup_overhead_s"] = {k: median[k] - median["bare"] for k in median if k != "bare"}
    f["limit_lockstep_bound"] = statistics.median(cases["limit2"].extra["lockstep_bound"])
    f["targets"] = {
        "ddpscale >= 1.25x textbook (ws2)": f["ddpscale_vs_textbook_ws2"] >= TARGETS["vs_textbook"],
        "ddpscale ws2 >= 0.95x limit (separate runs, median of paired ratios)":
            f["ddpscale_ws2_vs_limit_paired"] >= TARGETS["vs_limit"],
        "ddpscale ws2 >= 0.95x limit (interleaved blocks, pooled)":
            f["interleaved_synced_vs_unsynced"] >= TARGETS["vs_limit"],
        "start-up <= bare + 3 s (1 worker)": f["startup_overhead_s"]["ddp1"] <= TARGETS["startup_s"],
    }
    return f


# --------------------------------------------------------------------------- output


def describe_machine() -> dict:
    model = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as fh:
            model = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = {}
    for pkg in ("torch", "torchvision", "hydra-core"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {"cpu": model, "logical_cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "python": platform.python_version(), "versions": versions,
            "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
            "loadavg_start": os.getloadavg()}


def settings(args: argparse.Namespace) -> dict:
    return {"batch_size": args.batch_size, "steps_per_worker_epoch": args.steps,
            "repeats": args.repeats, "startup_repeats": args.startup_repeats,
            "val_size": args.val_size, "quick": args.quick,
            "interleaved_block_steps": args.block_steps, "interleaved_rounds": args.rounds}


def print_header(args: argparse.Namespace, m: dict) -> None:
    print(f"machine : {m['cpu']}, {m['logical_cores']} logical cores ({m['usable_cores']} usable), "
          f"python {m['python']}, torch {m['versions']['torch']}, torchvision {m['versions']['torchvision']}")
    print(f"load    : {m['loadavg_start'][0]:.2f} (1-min average at start)"
          + (f", OMP_NUM_THREADS={m['omp_num_threads_env']}" if m["omp_num_threads_env"] else ""))
    if m["loadavg_start"][0] > 0.5 * (m["usable_cores"] or 1):
        print("warning : other work is running on this machine; every figure below is lowered and noisy")
    print(f"settings: default CNN, batch {args.batch_size} per worker, {args.steps} steps per worker "
          f"per epoch, epoch 2 timed (epoch 1 warm-up), best of {args.repeats} (of {2 * args.repeats} for "
          f"the limit, lock-step and ddpscale 2 workers, run twice a repeat); start-up median of "
          f"{args.startup_repeats}\n", flush=True)


def print_report(report: dict, cases: dict[str, Case]) -> None:
    f = report["figures"]

    def row(key: str) -> str:
        c = cases[key]
        values = ", ".join(f"{v:.0f}" for v in c.images_per_sec)
        return f"  {c.label:<32} {c.world:>2}  {c.threads:<27} {c.best:8.0f}   [{values}]"

    head = f"  {'':<32} {'ws':>2}  {'threads per worker':<27} {'img/s':>8}   [all repeats]"
    print("\n1. ddpscale vs the textbook DDP loop (same CNN, batch, world size, images)")
    print(head)
    for key in ("ddp2", "tb2", "ddp1", "tb1"):
        if key in cases:
            print(row(key))
    print(f"  ratio ddpscale / textbook, 2 workers: {f['ddpscale_vs_textbook_ws2']:.2f}x"
          f"   (target >= {TARGETS['vs_textbook']})")
    if "ddpscale_vs_textbook_ws1" in f:
        print(f"  ratio ddpscale / textbook, 1 worker : {f['ddpscale_vs_textbook_ws1']:.2f}x")

    print("\n2. weak scaling, one thread per worker")
    print(head)
    for key in ("solo1", "ddp1_1t", "limit2", "lock2", "ddp2", "ddp2_gloo", "tb2_1t"):
        print(row(key))
    print(f"  ddpscale's threads per worker at 2 workers: "
          f"{cases['limit2'].extra.get('ddpscale_threads_at_2_workers')}"
          "   (train.threads unset: the usable cores // workers)")
    print(f"  ddpscale 2 workers / limit        : {f['ddpscale_ws2_vs_limit']:.3f}   (best / best)")
    print(f"  same, median of paired repeats    : {f['ddpscale_ws2_vs_limit_paired']:.3f}"
          f"   (target >= {TARGETS['vs_limit']}; {_interval_text(f['ddpscale_ws2_vs_limit_paired_interval'])})")
    print(f"  same with gloo's all-reduce, paired: {f['ddpscale_gloo_ws2_vs_limit_paired']:.3f}"
          "   (distributed.comm_hook=none instead of shared memory)")
    low, high = f["ddpscale_ws2_vs_lockstep_paired_interval"]
    print(f"  limit made lock-step / limit, paired: {f['lockstep_ws2_vs_limit_paired']:.3f}"
          "   (meeting after every backward, exchanging nothing: the most synchronous training keeps)")
    print(f"  ddpscale / limit made lock-step   : {f['ddpscale_ws2_vs_lockstep_paired']:.3f}"
          f"   (paired; {INTERVAL_LEVEL:.0%} bootstrap interval {low:.3f}-{high:.3f})")
    il, q = f["interleaved_images_per_sec"], f["interleaved_synced_vs_unsynced_rounds"]
    print(f"  interleaved in one pair of processes, {f['interleaved_rounds']} rounds of 3 blocks of "
          f"{report['settings']['interleaved_block_steps']} steps; pooled img/s: synced {il['synced']:.0f}, "
          f"unsynced {il['unsynced']:.0f}, lock-step {il['lockstep']:.0f}")
    print(f"  synced / unsynced (the limit)     : {f['interleaved_synced_vs_unsynced']:.3f}"
          f"   (target >= {TARGETS['vs_limit']}; rounds' quartiles {q[0]:.2f} / {q[1]:.2f} / {q[2]:.2f})")
    print(f"  {'':<34}   ({_interval_text(f['interleaved_synced_vs_unsynced_interval'])})")
    print(f"  lock-step / unsynced              : {f['interleaved_lockstep_vs_unsynced']:.3f}"
          "   (what waiting for the slower worker each step costs here)")
    print(f"  synced / lock-step                : {f['interleaved_synced_vs_lockstep']:.3f}"
          "   (what ddpscale's gradient exchange adds to that)")
    print(f"  limit's own steps made lock-step  : {f['limit_lockstep_bound']:.3f}"
          "   (each step as long as the slower process's; median over the limit's runs)")
    print(f"  textbook 2 workers / limit        : {f['textbook_1thread_ws2_vs_limit']:.3f}"
          "   (the issue statement put the textbook loop at about 0.84 of this limit on a 2-core machine)")
    print(f"  same, median of paired repeats    : {f['textbook_1thread_ws2_vs_limit_paired']:.3f}")
    print(f"  limit / (2 x one process)         : {f['limit_vs_twice_one_proc']:.3f}"
          "   (how much two processes slow each other here; 1: not at all)")
    print(f"  ddpscale 2 workers / (2 x 1 worker): {f['ddpscale_weak_scaling_efficiency']:.3f}")

    print("\n3. start to first training step (seconds from process start; median)")
    for key, label in (("bare", "bare script"), ("ddp1", "ddpscale, 1 worker"), ("ddp2", "ddpscale, 2 workers")):
        if key in report["startup"]:
            walls = statistics.median(r["wall_s"] for r in report["startup"][key])
            extra = "" if key == "bare" else f"   overhead {f['startup_overhead_s'][key]:+.2f}s"
            print(f"  {label:<22} first step {f['first_step_s'][key]:5.2f}s   whole run {walls:5.2f}s{extra}")
    print(f"  target: overhead <= {TARGETS['startup_s']:.0f}s (1 worker, the default job)")

    print("\ntargets: " + "; ".join(f"{k}: {'met' if ok else 'MISSED'}" for k, ok in f["targets"].items()))
    print(f"load    : {report['machine']['loadavg_end'][0]:.2f} (1-min average at end)")
    print("\ncommands (one repeat):")
    for c in cases.values():
        print(f"  {c.label}: {' '.join(c.command)}")
    for key, cmd in report["startup_commands"].items():
        print(f"  start-up {key}: {cmd}")


def _interval_text(interval: tuple[float, float]) -> str:
    """A bootstrap interval, and whether it settles the 0.95 verdict."""
    low, high = interval
    target = TARGETS["vs_limit"]
    verdict = ("this run cannot tell met from missed" if low < target <= high
               else "met beyond this run's noise" if low >= target else "missed beyond this run's noise")
    return f"{INTERVAL_LEVEL:.0%} bootstrap interval {low:.3f}-{high:.3f}: {verdict}"


# --------------------------------------------------------------------------- worker modes


def spawn_collect(fn, args: tuple, nprocs: int, queue, count: int) -> list:
    """Start `nprocs` spawned workers fn(rank, *args) and return the `count` items they
    put on `queue` (a SimpleQueue), read while they run.

    Reading only after mp.spawn returns deadlocks once the items outgrow the pipe
    (64 KiB): a worker's put blocks until someone reads, and the parent waits for the
    worker. A worker that fails ends the others and raises, as mp.spawn does."""
    import torch.multiprocessing as mp

    from ddpscale.workers import end_processes

    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    items: list = []
    done = False
    try:
        while len(items) < count:
            if not queue.empty():
                items.append(queue.get())
            elif done:
                raise RuntimeError(f"the workers exited having sent {len(items)} of {count} results")
            else:
                done = context.join(timeout=0.1)  # raises if a worker failed
        while not done:
            done = context.join()
    finally:
        end_processes(context)
    return items


def nosync_main(args: argparse.Namespace) -> None:
    """--procs processes training ddpscale's way at the same time, no process group."""
    import torch.multiprocessing as mp

    import torch

    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(args.procs), ctx.SimpleQueue()
    flags = torch.zeros(args.procs, dtype=torch.int64).share_memory_() if args.meet else None
    rows = spawn_collect(nosync_worker, (args, barrier, queue, flags), args.procs, queue, args.procs * 2)
    from ddpscale.distributed import cpu_threads

    for epoch in (1, 2):
        ranks = [(r["start"], r["ends"]) for r in rows if r["epoch"] == epoch]
        print("RESULT " + json.dumps({"epoch": epoch, "images_per_sec": overlap_rate(ranks, args.batch_size),
                                      "lockstep_bound": lockstep_bound(ranks),
                                      "ddpscale_threads_at_2_workers": cpu_threads(2)}), flush=True)


def nosync_worker(rank: int, args: argparse.Namespace, barrier, queue, flags=None) -> None:
    """ddpscale's in-memory batches and loop body, minus DDP: this process's own shard.
    With `flags` (--meet), the processes meet after every backward, as in `Meeting`."""
    import torch

    batches, model = _worker_setup(rank, args, args.steps)
    meet = Meeting(flags, rank) if flags is not None else None
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for epoch in (1, 2):
        batches.set_epoch(epoch)
        model.train()
        totals = torch.zeros(3, dtype=torch.float64)
        barrier.wait()  # start together, as the DDP ranks do after their barrier
        start, ends = time.perf_counter(), []
        for x, y in batches:
            _train_step(model, optimizer, x, y, totals, meet)
            ends.append(time.perf_counter())
        queue.put({"epoch": epoch, "rank": rank, "start": start, "ends": ends})
    _exit_worker()


def overlap_rate(ranks: list[tuple[float, list[float]]], batch: int) -> float:
    """Images/sec summed over processes, counted only while all of them ran.

    Each process gives its start and the end of every step (perf_counter: the same
    monotonic clock in every process here). Free-running processes finish at different
    times, and one left running alone has the machine to itself, which would flatter a
    sum of whole-run rates (two such processes then seemed faster than twice one); so
    the window runs from the last start to the first finish, and a step that straddles
    either edge counts for the share of it inside the window."""
    begin = max(start for start, _ in ranks)
    close = min(ends[-1] for _, ends in ranks)
    steps = 0.0
    for start, ends in ranks:
        bounds = [start, *ends]
        for lo, hi in zip(bounds, bounds[1:]):
            inside = min(hi, close) - max(lo, begin)
            if inside > 0:
                steps += inside / (hi - lo)
    return steps * batch / (close - begin)


def lockstep_bound(ranks: list[tuple[float, list[float]]]) -> float:
    """The share of free-running throughput these very steps would keep in lock-step.

    Step k of every process made to last as long as the slowest one's step k: the mean
    time of the processes' own steps over the time of those lock-step ones. Synchronous
    training cannot do better with the same step times, so 1 minus this is what the
    machine's uneven speed alone costs it; 1.0 for one process."""
    durations = [step_durations(start, ends) for start, ends in ranks]
    n = min(len(d) for d in durations)
    own = sum(sum(d[:n]) for d in durations) / len(durations)
    return own / sum(max(d[k] for d in durations) for k in range(n))


def step_durations(start: float, ends: list[float]) -> list[float]:
    """Seconds of each step of a process that started at `start` and ended steps at `ends`."""
    return [b - a for a, b in zip([start, *ends], ends)]


class Meeting:
    """A meeting of all processes with nothing exchanged: each raises its flag in a shared
    tensor to the meeting's number and waits, yielding its core, until every flag has."""

    def __init__(self, flags, rank: int):
        self.flags, self.rank, self.count = flags, rank, int(flags[rank])

    def __call__(self) -> None:
        self.count += 1
        self.flags[self.rank] = self.count
        while int(self.flags.min()) < self.count:
            os.sched_yield()


def interleaved_main(args: argparse.Namespace) -> None:
    """DDP processes rotating synced, unsynced and lock-step blocks; prints each round."""
    import torch
    import torch.multiprocessing as mp

    from ddpscale.distributed import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    flags = torch.zeros(args.procs, dtype=torch.int64).share_memory_()
    # per rank: [(round, mode, start, ends), ...]
    blocks = spawn_collect(interleaved_worker, (args, free_port(), queue, flags), args.procs, queue, args.procs)
    for rnd in range(args.rounds):
        rate = {m: overlap_rate([(start, ends) for b in blocks for r, mode, start, ends in b
                                 if r == rnd and mode == m], args.batch_size)
                for m in MODES}  # images/sec of each block, summed over ranks
        print("RESULT " + json.dumps({"round": rnd, **rate}), flush=True)


def interleaved_worker(rank: int, args: argparse.Namespace, port: int, queue, flags) -> None:
    """ddpscale's DDP model (wrap_ddp: its buckets and its default gradient all-reduce)
    trained in blocks of --block-steps steps: synced (as in a ddpscale run), unsynced
    (under no_sync: the limit, the same processes doing the same work without gradient
    sync) and lock-step (under no_sync, meeting after each backward as in `Meeting`).
    Each round runs the three in a rotated order; each block starts at a barrier outside
    its clock and is counted as in `overlap_rate`. Neighbouring blocks share the VM's
    speed of the moment, which separate runs do not. Replicas drift apart in the
    unsynced blocks; the work is the same."""
    import torch
    import torch.distributed as dist

    from ddpscale.config import DistributedConfig
    from ddpscale.distributed import process_group, wrap_ddp
    from ddpscale.placement import Placement, Rendezvous, WorkerContext

    placement = Placement(rank=rank, local_rank=rank, world_size=args.procs,
                          local_world_size=args.procs, node_id=0)
    batches, model = _worker_setup(rank, args, len(MODES) * args.block_steps)
    meet = Meeting(flags, rank)
    with process_group(placement, "gloo", Rendezvous("127.0.0.1", port, 120), hosts_store=rank == 0):
        ctx = WorkerContext(placement, torch.device("cpu"), "gloo", "spawn")
        ddp = wrap_ddp(model, ctx, DistributedConfig(num_gpus=args.procs))
        optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=0.9)
        totals = torch.zeros(3, dtype=torch.float64)
        blocks = []
        for rnd in range(-1, args.rounds):  # round -1: warm-up, untimed
            batches.set_epoch(rnd + 1)
            it = iter(batches)
            shift = rnd % len(MODES)
            for mode in MODES[shift:] + MODES[:shift]:
                dist.barrier()
                start, ends = time.perf_counter(), []
                with nullcontext() if mode == "synced" else ddp.no_sync():
                    for _ in range(args.block_steps):
                        _train_step(ddp, optimizer, *next(it), totals, meet if mode == "lockstep" else None)
                        ends.append(time.perf_counter())
                if rnd >= 0:
                    blocks.append((rnd, mode, start, ends))
        queue.put(blocks)
    _exit_worker()


def _exit_worker() -> None:
    """Leave as ddpscale's workers do: a normal exit aborts about once in 60 in C++
    teardown (ddpscale.placement.exit_finished_worker), which would fail the run."""
    from ddpscale.placement import exit_finished_worker

    exit_finished_worker()


def _worker_setup(rank: int, args: argparse.Namespace, steps: int):
    """A process set up as ddpscale's CPU worker with train.threads=1 (threads and
    allocator), in-memory batches of this rank's shard of steps x batch x procs images,
    and the default CNN."""
    import torch
    from torch.utils.data import DistributedSampler

    from ddpscale.config import CNNConfig, DataConfig, TrainConfig
    from ddpscale.data import MemoryBatches, load_split, normalised
    from ddpscale.distributed import configure_cpu_worker
    from ddpscale.models import CNN

    configure_cpu_worker(args.procs, threads=1, malloc_cache=TrainConfig().malloc_cache)
    data = DataConfig(name="fashion_mnist", root=args.data_root, batch_size=args.batch_size,
                      train_size=steps * args.batch_size * args.procs, mean=MEAN, std=STD)
    torch.manual_seed(0)
    split = load_split(data, train=True)
    sampler = DistributedSampler(range(len(split)), num_replicas=args.procs, rank=rank, seed=0)
    batches = MemoryBatches(normalised(split, data), split.labels, sampler, args.batch_size)
    model = CNN(CNNConfig(), data)
    model.train()
    return batches, model


def _train_step(model, optimizer, x, y, totals, after_backward=None) -> None:
    """ddpscale's trainer's step: forward, loss, backward, optimizer step and its own
    per-step bookkeeping into `totals` (loss sum, correct, count)."""
    import torch

    from ddpscale.trainer import batch_totals

    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits, y)
    loss.backward()
    if after_backward is not None:
        after_backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        totals += batch_totals(loss.detach().double() * len(y), logits, y)


def bare_main(args: argparse.Namespace) -> None:
    """The least a training script must do before its first step; prints when it is done."""
    import torch
    from torch import nn

    x, y = bare_batch(Path(args.data_root) / "FashionMNIST" / "raw", args.batch_size)
    model = nn.Sequential(  # ddpscale's default CNN, layer for layer
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Dropout(0.25), nn.Flatten(), nn.Linear(64 * 12 * 12, 128), nn.ReLU(), nn.Dropout(0.5),
        nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    print("RESULT " + json.dumps({"first_step_done": time.time(), "loss": loss.item()}), flush=True)


def bare_batch(raw: Path, batch: int):
    """The bare script's training set: both files read whole, the first `batch` images made
    float and normalised, as ddpscale's one-step run (data.train_size=batch) prepares its
    own. Normalising all 60,000 (0.3-0.7 s here) made the baseline do work ddpscale's run
    skips, understating its overhead."""
    import numpy as np
    import torch

    images = np.frombuffer(raw_bytes(raw, RAW_STEMS[0]), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    labels = np.frombuffer(raw_bytes(raw, RAW_STEMS[1]), np.uint8, offset=8)
    x = torch.from_numpy(images[:batch].copy()).float().div_(255).sub_(MEAN).div_(STD)
    return x, torch.from_numpy(labels[:batch].astype(np.int64))


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=at_least(1), default=128, help="per worker (default 128)")
    p.add_argument("--steps", type=at_least(1), default=None, help="steps per worker per epoch (default 60; quick 4)")
    p.add_argument("--repeats", type=at_least(1), default=None, help="throughput repeats, best kept (default 3; quick 1)")
    p.add_argument("--startup-repeats", type=at_least(1), default=None,
                   help="start-up repeats, median kept (default 3; quick 1)")
    p.add_argument("--val-size", type=at_least(1), default=512, help="validation images of the ddpscale runs (untimed)")
    p.add_argument("--data-root", default=None, help="DIR with FashionMNIST/raw/ holding the four files, plain or .gz "
                   "(default: data/, then ../shared/data)")
    p.add_argument("--quick", action="store_true", help="smoke run: fewer steps, one repeat, no 1-worker default-thread cases")
    p.add_argument("--json", type=output_file, default=None, help="also write every figure to this JSON file")
    p.add_argument("--timeout", type=seconds, default=300, help="seconds allowed per subprocess")
    p.add_argument("--worker", choices=["nosync", "interleaved", "bare"], help=argparse.SUPPRESS)
    p.add_argument("--block-steps", type=at_least(1), default=None, help="steps per interleaved block (default 5; quick 2)")
    p.add_argument("--rounds", type=at_least(1), default=None, help="interleaved rounds per repeat (default 16; quick 2)")
    p.add_argument("--procs", type=at_least(1), default=1, help=argparse.SUPPRESS)
    p.add_argument("--meet", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # Only an absent option takes the default: 0 is refused above, not read as "unset".
    for key, normal, quick in [("steps", 60, 4), ("block_steps", 5, 2), ("rounds", 16, 2),
                               ("repeats", 3, 1), ("startup_repeats", 3, 1)]:
        if getattr(args, key) is None:
            setattr(args, key, quick if args.quick else normal)
    if args.worker is None:  # else train.py refused these after the first case had run, naming its own keys
        refuse_beyond_data(p, "--steps", args.steps, args.batch_size)
        refuse_beyond_data(p, "--block-steps", args.block_steps, args.batch_size, blocks=len(MODES))
        if args.val_size > VAL_IMAGES:
            p.error(f"argument --val-size: {args.val_size:,} is more than Fashion-MNIST's {VAL_IMAGES:,} "
                    f"validation images; give --val-size {VAL_IMAGES} or less")
    return args


def refuse_beyond_data(p: argparse.ArgumentParser, flag: str, steps: int, batch: int, blocks: int = 1,
                       extra_steps: int = 0) -> None:
    """Exit as argparse does when 2 processes of `blocks` x `flag` (+ `extra_steps`) steps of
    --batch-size would need more than Fashion-MNIST's training images: their shards would
    run out, each process training fewer steps than asked (or stopping mid-block)."""
    steps_per_process = blocks * steps + extra_steps
    if 2 * steps_per_process * batch > TRAIN_IMAGES:
        what = (f"{flag} {steps}" if blocks == 1 else f"{blocks} blocks of {flag} {steps}") + (
            f" + {extra_steps} warm-up" if extra_steps else "")
        most = (TRAIN_IMAGES // (2 * batch) - extra_steps) // blocks
        p.error(f"{what} steps x --batch-size {batch} x 2 processes is {2 * steps_per_process * batch:,} "
                f"training images, more than Fashion-MNIST's {TRAIN_IMAGES:,}; lower {flag} or --batch-size ("
                + (f"{flag} {most} at most at --batch-size {batch})" if most >= 1 else
                   f"--batch-size {TRAIN_IMAGES // (2 * (blocks + extra_steps))} at most)"))


def report_and_save(figures: dict, report, path: Path | None) -> None:
    """The end of each benchmark script: print the figures, and write them as JSON if asked."""
    report(figures)
    if path:
        path.write_text(json.dumps(figures, indent=2, default=str))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker == "nosync":
        nosync_main(args)
        return 0
    if args.worker == "interleaved":
        interleaved_main(args)
        return 0
    if args.worker == "bare":
        bare_main(args)
        return 0
    report = benchmark(args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
        print(f"\nfigures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
