"""The gradient all-reduce alone: ddpscale's shared-memory one against gloo's, 2 CPU processes.

    .venv/bin/python benchmarks/bench_allreduce.py              # about 10 s on 2 cores
    .venv/bin/python benchmarks/bench_allreduce.py --rounds 5   # smoke run

Two processes in a real gloo process group average one gradient-sized tensor, over and
over, both ways in alternation:

- shm: ddpscale's `distributed.comm_hook=shm` (the default for CPU workers on one
  machine): each rank copies its tensor, divided by the world size, into the shared
  segment, raises its flag, waits for the other's and sums the two slots;
- gloo: DDP's own all-reduce (`distributed.comm_hook=none`): divide, then gloo's
  all_reduce over loopback TCP.

Both ranks meet at a barrier outside the clock before every all-reduce, so the time is
the exchange itself, never a wait for a late peer; a round counts as long as the
slower rank took. The tensor is as large as the default CNN's gradient (one DDP bucket;
--numel changes it). "cold" rounds first stream each rank through 64 MiB so that the
tensor is no longer in cache, as after a backward pass; "warm" rounds repeat at once.
Every result is checked against the exact mean.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_training as bt  # noqa: E402  (it puts src/ on sys.path: ddpscale, here and in the workers)
from bench_args import at_least, output_file  # noqa: E402

METHODS = ("shm", "gloo")
EVICT_BYTES = 64 << 20


def cnn_gradient_numel() -> int:
    """Parameters of the default CNN on Fashion-MNIST: its gradient, one DDP bucket."""
    from ddpscale.config import CNNConfig, DataConfig
    from ddpscale.models import CNN

    return sum(p.numel() for p in CNN(CNNConfig(), DataConfig(name="fashion_mnist")).parameters())


def worker(rank: int, args: argparse.Namespace, port: int, queue) -> None:
    """Rank `rank`: times --rounds all-reduces of each method, cold and warm, in turn."""
    import torch
    import torch.distributed as dist

    from ddpscale.distributed import configure_cpu_worker, process_group
    from ddpscale.placement import Placement, Rendezvous
    from ddpscale.shm_allreduce import SharedMemoryAllreduce, chunk_bytes_for

    world = 2
    configure_cpu_worker(world, threads=1, malloc_cache=True)
    placement = Placement(rank=rank, local_rank=rank, world_size=world, local_world_size=world, node_id=0)
    with process_group(placement, "gloo", Rendezvous("127.0.0.1", port, 60), hosts_store=rank == 0):
        shm = SharedMemoryAllreduce(rank, world, timeout_s=60, chunk_bytes=chunk_bytes_for(4 * args.numel))
        ops = {"shm": shm.average_,
               "gloo": lambda t: dist.all_reduce(t.div_(world))}
        grad = torch.empty(args.numel)
        evict = torch.empty(EVICT_BYTES // 4)
        times: dict[str, list[float]] = {f"{m} {c}": [] for m in METHODS for c in ("cold", "warm")}
        wrong = 0
        for rnd in range(-1, args.rounds):  # round -1: warm-up, untimed
            for method in METHODS if rnd % 2 else METHODS[::-1]:
                for cache in ("cold", "warm"):
                    grad.fill_(rank + 1.0)
                    if cache == "cold":
                        evict.fill_(float(rnd))
                    dist.barrier()
                    start = time.perf_counter()
                    ops[method](grad)
                    elapsed = time.perf_counter() - start
                    wrong += int(not bool((grad == (1.0 + world) / 2).all()))
                    if rnd >= 0:
                        times[f"{method} {cache}"].append(elapsed)
        queue.put((rank, times, wrong))
    bt._exit_worker()


def measure(args: argparse.Namespace) -> dict:
    import torch.multiprocessing as mp

    from ddpscale.distributed import free_port

    queue = mp.get_context("spawn").SimpleQueue()
    ranks = sorted(bt.spawn_collect(worker, (args, free_port(), queue), 2, queue, 2), key=lambda r: r[0])
    wrong = sum(r[2] for r in ranks)
    if wrong:
        raise SystemExit(f"{wrong} all-reduce results differed from the exact mean")
    figures = {kind: round_figures([max(a, b) for a, b in zip(ranks[0][1][kind], ranks[1][1][kind])])
               for kind in ranks[0][1]}  # each round as long as the slower rank took
    return {"numel": args.numel, "megabytes": 4 * args.numel / 1e6, "rounds": args.rounds, "figures": figures}


def round_figures(seconds: list[float]) -> dict:
    """Median and 90th percentile (ms) of the rounds' times."""
    return {"median_ms": 1e3 * statistics.median(seconds), "p90_ms": 1e3 * bt.cut_points(seconds, 10)[-1]}


def report(r: dict) -> None:
    f = r["figures"]
    print(f"all-reduce of {r['numel']:,} floats ({r['megabytes']:.1f} MB), 2 processes, "
          f"{r['rounds']} rounds each way, both ranks ready\n")
    for cache in ("cold", "warm"):
        shm, gloo = f[f"shm {cache}"], f[f"gloo {cache}"]
        print(f"  {cache}: shm median {shm['median_ms']:5.2f} ms (p90 {shm['p90_ms']:5.2f})   "
              f"gloo median {gloo['median_ms']:5.2f} ms (p90 {gloo['p90_ms']:5.2f})   "
              f"gloo / shm {gloo['median_ms'] / shm['median_ms']:.1f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=at_least(1), default=100, help="timed all-reduces per method and cache state (default 100)")
    p.add_argument("--numel", type=at_least(1), default=None, help="floats per all-reduce (default: the CNN's gradient)")
    p.add_argument("--json", type=output_file, default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    if args.numel is None:
        args.numel = cnn_gradient_numel()
    bt.report_and_save(measure(args), report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
