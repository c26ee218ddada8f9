"""Where a synchronous step's time goes here: waiting, running in phase, the exchange.

    .venv/bin/python benchmarks/step_phases.py             # about 2 minutes on 2 cores
    .venv/bin/python benchmarks/step_phases.py --rounds 2  # smoke run

bench_training.py finds that 2 synchronous workers keep 0.93-0.96 of what 2 free-running
processes train here. This splits that loss, step by step. One pair of processes trains
ddpscale's DDP model with its default shared-memory all-reduce in short blocks, rotating
four kinds, and times every step and the part of it spent waiting for the other process:

- unsynced: under no_sync, no meeting: free-running work;
- lock-step: under no_sync, both meet after each backward, where DDP's all-reduce waits;
- staggered: under no_sync, a meeting every step too, but rank 0 meets after its backward
  and the others after their forward, so the processes run about half a step out of
  phase while still waiting for each other once a step;
- synced: ddpscale's step (the all-reduce waits inside backward).

Work is a step's time less its wait. Lock-step's wait is what waiting for the slower
process costs; lock-step's work against unsynced work is what running every phase at the
same moment as the other process costs (both then want the shared cache and memory at
once), which staggered work, out of phase, shows without; synced work against lock-step
work is the work of ddpscale's gradient exchange itself. The first step of each block
starts at a barrier, in phase whatever the kind, and is left out.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_training as bt  # noqa: E402
from bench_args import at_least, output_file  # noqa: E402

KINDS = ("unsynced", "lockstep", "staggered", "synced")
LABELS = {"unsynced": "unsynced", "lockstep": "lock-step", "staggered": "staggered", "synced": "synced"}


class TimedMeeting(bt.Meeting):
    """bench_training's Meeting, adding up the time spent waiting in it."""

    waited_s = 0.0

    def __call__(self) -> None:
        start = time.perf_counter()
        super().__call__()
        self.waited_s += time.perf_counter() - start


def summarise(steps: list[tuple[str, float, float]]) -> dict:
    """Per kind, mean step, wait and work (ms) over (kind, step_s, wait_s) records; and the
    shares of unsynced work that waiting, running in phase and the exchange cost."""
    kinds = {}
    for kind in KINDS:
        rows = [(step, wait) for k, step, wait in steps if k == kind]
        if rows:
            step_ms = 1e3 * statistics.mean(s for s, _ in rows)
            wait_ms = 1e3 * statistics.mean(w for _, w in rows)
            kinds[kind] = {"steps": len(rows), "step_ms": step_ms, "wait_ms": wait_ms,
                           "work_ms": step_ms - wait_ms}
    work = {k: v["work_ms"] for k, v in kinds.items()}
    base = work["unsynced"]
    return {"kinds": kinds, "costs": {
        "waiting": kinds["lockstep"]["wait_ms"] / base,
        "in_phase": work["lockstep"] / base - 1,
        "staggered": work["staggered"] / base - 1,
        "exchange": (work["synced"] - work["lockstep"]) / base,
        "exchange_ms": work["synced"] - work["lockstep"],
        "synced_keeps": base / kinds["synced"]["step_ms"],
    }}


def _worker(rank: int, args: argparse.Namespace, port: int, queue, flags) -> None:
    import torch
    import torch.distributed as dist

    from ddpscale import shm_allreduce
    from ddpscale.config import DistributedConfig
    from ddpscale.distributed import process_group, wrap_ddp
    from ddpscale.placement import Placement, Rendezvous, WorkerContext

    placement = Placement(rank=rank, local_rank=rank, world_size=args.procs,
                          local_world_size=args.procs, node_id=0)
    batches, model = bt._worker_setup(rank, args, len(KINDS) * args.block_steps)
    meet = TimedMeeting(flags, rank)
    with process_group(placement, "gloo", Rendezvous("127.0.0.1", port, 120), hosts_store=rank == 0):
        ctx = WorkerContext(placement, torch.device("cpu"), "gloo", "spawn")
        ddp = wrap_ddp(model, ctx, DistributedConfig(num_gpus=args.procs, comm_hook="none"))
        # what comm_hook=auto registers on CPU, kept at hand to read its waits
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        exchange = shm_allreduce.SharedMemoryAllreduce(rank, args.procs, 120,
                                                       shm_allreduce.chunk_bytes_for(grad_bytes))
        ddp.register_comm_hook(exchange, shm_allreduce.allreduce_hook)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=bt.LR, momentum=0.9)
        meet_early = rank != 0  # staggered: who meets after forward instead of backward
        records = []
        for rnd in range(-1, args.rounds):  # round -1: warm-up, not recorded
            batches.set_epoch(rnd + 1)
            it = iter(batches)
            shift = rnd % len(KINDS)
            for kind in KINDS[shift:] + KINDS[:shift]:
                dist.barrier()
                for i in range(args.block_steps):
                    x, y = next(it)
                    waited = meet.waited_s + exchange.waited_s
                    start = time.perf_counter()
                    with nullcontext() if kind == "synced" else ddp.no_sync():
                        loss = torch.nn.functional.cross_entropy(ddp(x), y)
                        if kind == "staggered" and meet_early:
                            meet()
                        loss.backward()
                        if kind == "lockstep" or (kind == "staggered" and not meet_early):
                            meet()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    if rnd >= 0 and i > 0:
                        records.append((kind, time.perf_counter() - start,
                                        meet.waited_s + exchange.waited_s - waited))
        queue.put(records)
    bt._exit_worker()


def measure(args: argparse.Namespace) -> dict:
    import torch
    import torch.multiprocessing as mp

    from ddpscale.distributed import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    flags = torch.zeros(args.procs, dtype=torch.int64).share_memory_()
    per_rank = bt.spawn_collect(_worker, (args, free_port(), queue, flags), args.procs, queue, args.procs)
    return {"rounds": args.rounds, "block_steps": args.block_steps, "batch_size": args.batch_size,
            **summarise([r for records in per_rank for r in records])}


def report(r: dict) -> None:
    print(f"2 processes, 1 thread each, batch {r['batch_size']}; {r['rounds']} rounds of 4 blocks of "
          f"{r['block_steps']} steps (the first of each block left out); means over both processes\n")
    print(f"  {'':<10} {'step ms':>8} {'wait ms':>8} {'work ms':>8}   steps")
    for kind, k in r["kinds"].items():
        print(f"  {LABELS[kind]:<10} {k['step_ms']:8.1f} {k['wait_ms']:8.1f} {k['work_ms']:8.1f}   {k['steps']}")
    c = r["costs"]
    print("\nwhat synchronous training costs here, as a share of a free-running step's work:")
    print(f"  waiting for the slower process  {100 * c['waiting']:+5.1f}%   (lock-step's wait)")
    print(f"  running in phase with the other {100 * c['in_phase']:+5.1f}%   (lock-step's work against unsynced;"
          f" out of phase, staggered: {100 * c['staggered']:+.1f}%)")
    print(f"  ddpscale's gradient exchange    {100 * c['exchange']:+5.1f}%   (synced work against lock-step:"
          f" {c['exchange_ms']:+.2f} ms)")
    print(f"  in all, a synced step keeps {c['synced_keeps']:.3f} of a free-running step's throughput"
          "   (bench_training.py's target: 0.95)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=at_least(1), default=40, help="rounds of the four kinds of block (default 40)")
    p.add_argument("--block-steps", type=at_least(2, "the first step of each block is left out"), default=5, help="steps per block (default 5)")
    p.add_argument("--batch-size", type=at_least(1), default=128, help="per process (default 128)")
    p.add_argument("--data-root", default=None, help="DIR with FashionMNIST/raw/ holding the four files, plain or .gz "
                   "(default: data/, then ../shared/data)")
    p.add_argument("--json", type=output_file, default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    bt.refuse_beyond_data(p, "--block-steps", args.block_steps, args.batch_size, blocks=len(KINDS))
    args.data_root = str(bt.find_raw(args.data_root).parent.parent)
    args.procs = 2
    bt.report_and_save(measure(args), report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
