"""How unevenly this machine runs training steps: the ceiling of synchronous training.

    .venv/bin/python benchmarks/step_jitter.py            # about a minute on 2 cores
    .venv/bin/python benchmarks/step_jitter.py --steps 5  # smoke run

A synchronous data-parallel step lasts as long as the slower worker's, so a machine
whose cores wander in speed independently costs every such run a share of its
throughput before any gradient is exchanged. This measures that share:

1. one process alone (ddpscale's CPU worker set-up, 1 thread): the spread of its CNN
   training steps, and of a plain matrix-multiply loop of about the same length per
   step, which shows how much of the wander is the machine's own;
2. two such processes training at the same time, free-running: each one's spread, the
   correlation of their step times (5-step blocks), and the lock-step bound of
   bench_training.py (each step made as long as the slower process's), i.e. the most
   synchronous training reaches here with these step times.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_training as bt  # noqa: E402
from bench_args import at_least, output_file  # noqa: E402

WARMUP_STEPS = 5
BLOCK = 5  # steps per block for the correlation


def spread(durations: list[float]) -> dict:
    """Mean (ms), standard deviation as a share of the mean, p10 and p90 (ms)."""
    deciles = bt.cut_points(durations, 10)
    return {"mean_ms": 1e3 * statistics.mean(durations),
            "stdev_share": statistics.pstdev(durations) / statistics.mean(durations),
            "p10_ms": 1e3 * deciles[0], "p90_ms": 1e3 * deciles[-1]}


def block_correlation(a: list[float], b: list[float], block: int = BLOCK) -> float | None:
    """Pearson correlation of two processes' step times summed over blocks of `block` steps."""
    n = min(len(a), len(b)) // block
    xs = [sum(a[i * block:(i + 1) * block]) for i in range(n)]
    ys = [sum(b[i * block:(i + 1) * block]) for i in range(n)]
    if n < 3 or statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
        return None
    return statistics.correlation(xs, ys)


def train_steps(rank: int, args: argparse.Namespace, barrier=None) -> tuple[float, list[float]]:
    """Warm up, meet the others (if any), then time --steps training steps: (start, ends)."""
    import torch

    batches, model = bt._worker_setup(rank, args, WARMUP_STEPS + args.steps)
    optimizer = torch.optim.SGD(model.parameters(), lr=bt.LR, momentum=0.9)
    totals = torch.zeros(3, dtype=torch.float64)
    it = iter(batches)
    for _ in range(WARMUP_STEPS):
        bt._train_step(model, optimizer, *next(it), totals)
    if barrier is not None:
        barrier.wait()
    start, ends = time.perf_counter(), []
    for x, y in it:
        bt._train_step(model, optimizer, x, y, totals)
        ends.append(time.perf_counter())
    return start, ends


def matmul_steps(steps: int, step_s: float) -> list[float]:
    """Durations of a 1-thread 512 x 512 matrix-multiply loop sized to about step_s each."""
    import torch

    a, b = torch.randn(512, 512), torch.randn(512, 512)
    t0 = time.perf_counter()
    for _ in range(10):
        torch.mm(a, b)
    reps = max(1, round(step_s / ((time.perf_counter() - t0) / 10)))
    durations = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        durations.append(time.perf_counter() - t0)
    return durations


def _pair_worker(rank: int, args: argparse.Namespace, barrier, queue) -> None:
    queue.put((rank, train_steps(rank, args, barrier)))
    bt._exit_worker()


def measure(args: argparse.Namespace) -> dict:
    import torch.multiprocessing as mp

    alone = bt.step_durations(*train_steps(0, argparse.Namespace(**vars(args), procs=1)))
    mm = matmul_steps(args.steps, statistics.mean(alone))

    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.SimpleQueue()
    ranks = dict(bt.spawn_collect(_pair_worker, (argparse.Namespace(**vars(args), procs=2), barrier, queue),
                                  2, queue, 2))
    pair = [ranks[0], ranks[1]]
    d0, d1 = (bt.step_durations(*r) for r in pair)
    return {"steps": args.steps, "batch_size": args.batch_size,
            "alone": {"cnn": spread(alone), "matmul": spread(mm)},
            "pair": {"rank0": spread(d0), "rank1": spread(d1), "block_correlation": block_correlation(d0, d1),
                     "lockstep_bound": bt.lockstep_bound(pair)}}


def report(r: dict) -> None:
    def line(label: str, s: dict) -> str:
        return (f"  {label:<34} mean {s['mean_ms']:6.1f} ms   spread {100 * s['stdev_share']:4.1f}%"
                f"   p10 {s['p10_ms']:6.1f}   p90 {s['p90_ms']:6.1f}")

    print(f"steps of batch {r['batch_size']}, {r['steps']} timed per process, 1 thread each\n")
    print("1. one process alone")
    print(line("CNN training step", r["alone"]["cnn"]))
    print(line("matrix-multiply loop, same length", r["alone"]["matmul"]))
    print("2. two processes at the same time, free-running")
    print(line("CNN training step, process 0", r["pair"]["rank0"]))
    print(line("CNN training step, process 1", r["pair"]["rank1"]))
    corr = r["pair"]["block_correlation"]
    print(f"  correlation of their {BLOCK}-step block times: {'n/a' if corr is None else f'{corr:.2f}'}"
          "   (1: they wander together, 0: independently)")
    print(f"  lock-step bound: {r['pair']['lockstep_bound']:.3f}"
          "   (the share of their throughput left if each step waited for the slower one)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=at_least(1), default=60, help="timed steps per process (default 60)")
    p.add_argument("--batch-size", type=at_least(1), default=128, help="per process (default 128)")
    p.add_argument("--data-root", default=None, help="DIR with FashionMNIST/raw/ holding the four files, plain or .gz "
                   "(default: data/, then ../shared/data)")
    p.add_argument("--json", type=output_file, default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    bt.refuse_beyond_data(p, "--steps", args.steps, args.batch_size, extra_steps=WARMUP_STEPS)
    args.data_root = str(bt.find_raw(args.data_root).parent.parent)
    bt.report_and_save(measure(args), report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
