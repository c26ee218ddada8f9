"""Gradient all-reduce through shared memory, for CPU workers on one machine.

With gloo, DDP sends every gradient bucket through TCP over loopback: on a small CPU
box that is several milliseconds per step of kernel copies and thread wake-ups, paid
while the other workers wait. Workers on one host can instead meet in a shared-memory
segment: each copies its bucket into its own slot, raises a flag, waits for the other
flags and sums the slots itself (gloo's own intra-node SHM all-reduce, DeepSpeed's and
vLLM's CPU all-reduce work the same way). The process group still carries everything
else (barriers, metrics, broadcasts); this replaces only DDP's bucket all-reduce, as a
DDP communication hook.

Protocol, per chunk of at most `chunk_bytes`: rank r copies its chunk, already divided
by the world size as DDP's own hook does, into slot[seq % 2][r], then stores seq in
its flag; when every flag is >= seq it sums the slots in rank order (the same order on
every rank, so every replica gets bit-identical gradients). Two slot sets alternate:
a rank can overwrite slot set s only at chunk seq + 2, after every rank has announced
seq + 1, i.e. after every rank has finished reading seq. The flag store must become
visible after the data stores, which x86-64's store ordering guarantees; elsewhere
`distributed.comm_hook=auto` keeps DDP's all-reduce over the process group.
"""

import errno
import mmap
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

FLAG_STRIDE = 64  # bytes: one cache line per rank's flag, so ranks never share a line
MAX_CHUNK_BYTES = 16 << 20  # per rank and slot set: the segment is 4x this at 2 ranks
SHM_DIR = Path("/dev/shm")


class SegmentUnavailable(OSError):
    """Rank 0 could not make the segment (no room, or /dev/shm refused it); raised on every rank alike."""


def supported() -> bool:
    """Whether this machine can run the protocol (Linux, x86-64 store ordering, /dev/shm)."""
    return (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
            and SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK | os.X_OK))


class SharedMemoryAllreduce:
    """Averages DDP buckets across the ranks of one host through a shared segment."""

    def __init__(self, rank: int, world_size: int, timeout_s: float,
                 chunk_bytes: int = MAX_CHUNK_BYTES):
        if world_size < 2:
            raise ValueError(f"a shared-memory all-reduce needs 2 or more ranks, not {world_size}")
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.seq = 0
        self.waited_s = 0.0  # time spent waiting for slower ranks (benchmarks/step_phases.py)
        # Every rank's process id, to tell a slow rank from a dead one while waiting: a
        # rank killed outright (SIGKILL, out of memory) raises no flag and posts nothing.
        self.pids: list[Any] = [None] * world_size
        dist.all_gather_object(self.pids, os.getpid())
        flag_bytes = FLAG_STRIDE * world_size
        shared: list[Any] = [None, None]  # the segment's path, or (errno, why there is none)
        if rank == 0:
            try:
                shared[0] = _create_segment(flag_bytes, 2 * world_size * chunk_bytes)
            except OSError as err:
                size_mib = (flag_bytes + 2 * world_size * chunk_bytes) / 2**20
                shared[1] = (err.errno or errno.EIO,
                             f"no {size_mib:.2f} MiB segment in {SHM_DIR}: {err.strerror or err}")
        dist.broadcast_object_list(shared, src=0)  # rank 0 says where, or why it could not
        if shared[0] is None:
            raise SegmentUnavailable(*shared[1])
        self.path = shared[0]  # unlinked once every rank has mapped it
        fd = os.open(self.path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, flag_bytes + 2 * world_size * chunk_bytes)
        finally:
            os.close(fd)
        dist.barrier()  # everyone has it mapped: the name can go, the memory stays
        if rank == 0:
            os.unlink(self.path)
        self.flags = np.frombuffer(self._map, dtype=np.int64, count=flag_bytes // 8)[::FLAG_STRIDE // 8]
        self.slots = torch.frombuffer(self._map, dtype=torch.uint8, offset=flag_bytes,
                                      count=2 * world_size * chunk_bytes).view(2, world_size, chunk_bytes)

    def average_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Replace `tensor` (contiguous) by its mean over all ranks, in place."""
        flat = tensor.view(-1)
        per_chunk = self.slots.shape[2] // tensor.element_size()
        for start in range(0, flat.numel(), per_chunk):
            part = flat[start:start + per_chunk]
            self.seq += 1
            views = [slot.view(tensor.dtype)[:part.numel()] for slot in self.slots[self.seq % 2]]
            torch.div(part, self.world_size, out=views[self.rank])
            self.flags[self.rank] = self.seq  # after the data: see the module docstring
            self._wait_for_all(self.seq)
            torch.add(views[0], views[1], out=part)
            for view in views[2:]:
                part.add_(view)
        return tensor

    def _wait_for_all(self, seq: int) -> None:
        if self.flags.min() >= seq:
            return
        start = time.perf_counter()
        polls = 0
        while self.flags.min() < seq:
            # Yield rather than spin hard: with more workers than cores, the rank we
            # wait for may need this very core.
            os.sched_yield()
            polls += 1
            if polls % 256 == 0:
                waited = time.perf_counter() - start
                gone = waited > 0.01 and [r for r in range(self.world_size)
                                          if self.flags[r] < seq and not _alive(self.pids[r])]
                if gone:
                    raise RuntimeError(
                        f"rank {self.rank}: rank(s) {gone} exited during the shared-memory all-reduce "
                        "(distributed.comm_hook=shm) without saying why: killed outright (SIGKILL, "
                        "or the out-of-memory killer; see dmesg)"
                    )
                if waited > self.timeout_s:
                    late = [r for r in range(self.world_size) if self.flags[r] < seq]
                    raise TimeoutError(
                        f"rank {self.rank}: no gradients from rank(s) {late} within "
                        f"distributed.timeout_s={self.timeout_s:g} in the shared-memory all-reduce "
                        "(distributed.comm_hook=shm); a worker has stopped or hangs"
                    )
                if waited > 0.01:  # a long wait (a slow peer): stop burning this core
                    time.sleep(0.0005)
        self.waited_s += time.perf_counter() - start


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # unreadable: assume alive, and let the timeout decide
        return True


def chunk_bytes_for(gradient_bytes: int) -> int:
    """Chunk size for a model: its whole gradient in one chunk (one wait per bucket)
    when that fits in MAX_CHUNK_BYTES, rounded up to whole pages."""
    return min(MAX_CHUNK_BYTES, max(4096, -(-gradient_bytes // 4096) * 4096))


def _create_segment(flag_bytes: int, data_bytes: int) -> str:
    """A zeroed file in /dev/shm with its pages reserved (ENOSPC now, not SIGBUS later);
    raises OSError when /dev/shm has no room or refuses the file."""
    fd, path = tempfile.mkstemp(prefix="ddpscale-grads-", dir=SHM_DIR)
    try:
        os.posix_fallocate(fd, 0, flag_bytes + data_bytes)
        return path
    except OSError:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


# No `from __future__ import annotations` in this module: DDP checks the hook's
# annotations against the real dist.GradBucket and torch.futures.Future classes.
def allreduce_hook(state: SharedMemoryAllreduce, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's mean over ranks, computed synchronously."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(state.average_(bucket.buffer()))
    return future
