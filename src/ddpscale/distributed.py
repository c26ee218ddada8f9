"""The distributed plumbing that needs torch: devices, the process group, DDP, the stores.

No other module calls `init_process_group`. Which launcher started this process and where
it sits in the world (rank, local rank, world size) is ddpscale.placement's: the Hydra job
process reads those without importing torch. Three launchers:

- spawn: the Hydra job process starts `num_gpus` workers with `torch.multiprocessing.spawn`
  and hosts the rendezvous store (node 0), so the port it picked cannot be taken by
  someone else between picking and using it;
- torchrun: every process is already a worker; RANK, LOCAL_RANK, WORLD_SIZE, ... are set;
- slurm: every task is a worker (srun or submitit); SLURM_PROCID, SLURM_LOCALID, ...
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import sys
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator, Mapping

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpscale import shm_allreduce
from ddpscale.config import ConfigError, DistributedConfig, disagreement
from ddpscale.placement import STOP_SIGNALS, Placement, Rendezvous, WorkerContext

log = logging.getLogger("ddpscale")


# --------------------------------------------------------------------------- device


def resolve_device(d: DistributedConfig, notice=log.info) -> tuple[str, str]:
    """(device type, backend) for this config; raise ConfigError before any worker starts."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if d.device == "cuda" and gpus < d.num_gpus:
        fix = f"use distributed.num_gpus<={gpus} or distributed.device=cpu" if gpus else (
            "use distributed.device=cpu (or auto)")
        raise ConfigError(
            f"distributed.num_gpus={d.num_gpus} with distributed.device=cuda but "
            f"{gpus} CUDA devices are visible; {fix}"
        )
    if d.device == "auto":
        device = "cuda" if gpus >= d.num_gpus else "cpu"
        if device == "cpu":
            why = "no CUDA device is visible" if not gpus else f"only {gpus} CUDA devices"
            notice(
                f"notice: {why}; running {d.num_gpus} CPU worker process(es) per node "
                "with gloo (distributed.device=auto)"
            )
    else:
        device = d.device
    if d.backend == "nccl" and device != "cuda":
        raise ConfigError(
            "distributed.backend=nccl needs CUDA devices but this run uses the CPU; "
            "use distributed.backend=gloo (or auto)"
        )
    backend = d.backend if d.backend != "auto" else ("nccl" if device == "cuda" else "gloo")
    return device, backend


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed blocks for reuse; True when it took effect.

    By default glibc serves blocks above a threshold with mmap and gives freed memory back
    to the system, so every training step maps its activation tensors afresh and touches
    each new page (about 16,000 page faults per step for the CNN at batch 128, a fifth of
    its step time on a 2-core VM). With no mmap threshold and no trimming, a step reuses
    the previous step's memory; the process keeps its peak footprint until it exits.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...): leave it alone
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from <malloc.h>
    limit = 1 << 30
    # Older glibc refuses mmap thresholds above 32 MiB on 64-bit machines.
    mmap_ok = mallopt(m_mmap_threshold, limit) or mallopt(m_mmap_threshold, 32 << 20)
    return bool(mmap_ok and mallopt(m_trim_threshold, limit))


def configure_cpu_worker(local_world_size: int, threads: int | None, malloc_cache: bool,
                         task_cpus: int | None = None) -> int:
    """Threads and allocator of a CPU worker process; returns its thread count."""
    count = cpu_threads(local_world_size, threads, task_cpus)
    torch.set_num_threads(count)
    if malloc_cache:
        keep_freed_memory()
    return count


def cpu_threads(local_world_size: int, requested: int | None = None, task_cpus: int | None = None) -> int:
    """This worker's share of the cores it may run on (never oversubscribes).

    task_cpus: the CPUs SLURM gave this worker's own task (SLURM_CPUS_PER_TASK). Where
    SLURM binds each task to its cores, the cores this process may run on are already its
    own share, not the node's, and are not divided again.
    """
    if requested:
        return requested
    cores = usable_cores()
    if task_cpus and cores <= task_cpus:
        return cores
    return max(1, cores // local_world_size)


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()) or 1


def device_names(device: torch.device) -> list[str]:
    """Names of the devices this run trains on, for run.json."""
    if device.type == "cuda":
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "cpu"
    return [f"{model} ({os.cpu_count()} logical cores)"]


def resolve_comm_hook(name: str, device: str, world_size: int, num_nodes: int) -> str:
    """The gradient all-reduce a run uses: none (DDP's, over the process group), shm, bf16, fp16.

    auto picks shared memory for CPU workers that all sit on one machine, where it
    replaces loopback TCP, and DDP's own all-reduce everywhere else. Raises ConfigError
    for an explicit shm that cannot work here.
    """
    shm_possible = device == "cpu" and num_nodes == 1
    if name == "shm" and not shm_possible:
        where = "CUDA workers" if device != "cpu" else f"{num_nodes} nodes"
        raise ConfigError(
            f"distributed.comm_hook=shm needs CPU workers on one node, but this run has {where}; "
            "use distributed.comm_hook=auto (or none)"
        )
    if name == "shm" and not shm_allreduce.supported():
        raise ConfigError(
            "distributed.comm_hook=shm needs Linux on x86-64 with a writable /dev/shm; "
            "use distributed.comm_hook=auto (or none)"
        )
    if name == "auto":
        name = "shm" if shm_possible and shm_allreduce.supported() else "none"
    return "none" if name == "shm" and world_size == 1 else name


def wrap_ddp(model: torch.nn.Module, ctx: WorkerContext, d: DistributedConfig) -> DDP:
    """DDP around the model; it broadcasts rank 0's weights so replicas start identical.

    The gradient all-reduce it registered, after any fallback, is in its `grad_allreduce`
    attribute (none, shm, bf16 or fp16), for run.json.
    """
    ddp = DDP(
        model,
        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
        bucket_cap_mb=d.bucket_cap_mb,
        gradient_as_bucket_view=d.gradient_as_bucket_view,
        static_graph=d.static_graph,
    )
    hook = resolve_comm_hook(d.comm_hook, ctx.device.type, ctx.world_size, ctx.placement.num_nodes)
    if hook == "shm":
        try:
            grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
            state = shm_allreduce.SharedMemoryAllreduce(
                ctx.rank, ctx.world_size, d.timeout_s, shm_allreduce.chunk_bytes_for(grad_bytes))
        except shm_allreduce.SegmentUnavailable as err:  # every rank learns it from rank 0
            if d.comm_hook == "shm":
                raise
            if ctx.is_main:
                log.warning("warning: %s; gradients go through %s instead", err, ctx.backend)
            hook = "none"
        else:
            ddp.register_comm_hook(state, shm_allreduce.allreduce_hook)
    elif hook != "none":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hooks = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}
        ddp.register_comm_hook(None, hooks[hook])
    ddp.grad_allreduce = hook
    return ddp


# --------------------------------------------------------------------------- rendezvous


def check_master_addr(addr: str, hosts_store: bool, single_node: bool = False) -> None:
    """Fail at once, naming the key, on a rendezvous host that does not resolve here (it
    would otherwise wait out distributed.timeout_s, 5 minutes); where this process hosts
    the store, warn when the host is not this machine's, or fail when the run has one
    node: then only this machine ever talks to the store, and it would wait out the
    timeout twice trying to reach it there."""
    here = socket.gethostname()
    try:
        found = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        reason = err.strerror if isinstance(err, socket.gaierror) else str(err)
        raise ConfigError(
            f"distributed.master_addr={addr!r} does not resolve on {here} ({reason}); set it to "
            "node 0's host name or IP address, the same on every node"
        ) from err
    if hosts_store and not any(_can_bind(family, sockaddr[0]) for family, *_, sockaddr in found):
        ips = ", ".join(sorted({sockaddr[0] for *_, sockaddr in found}))
        if single_node:
            raise ConfigError(
                f"distributed.master_addr={addr!r} ({ips}) is not an address of this machine "
                f"({here}), and this one-node run hosts its rendezvous here; leave "
                "distributed.master_addr unset (127.0.0.1) or name this machine"
            )
        # Not an error with more nodes: behind NAT node 0 can be reached at an address
        # it does not own.
        log.warning("warning: distributed.master_addr=%r (%s) is not an address of this machine "
                    "(%s), which hosts the rendezvous as node 0; the other nodes will wait "
                    "distributed.timeout_s for it unless that address leads here", addr, ips, here)


def _can_bind(family: int, ip: str) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((ip, 0))
            return True
        except OSError:
            return False


def host_store(addr: str, port: int | None, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Start the rendezvous store in the job process of node 0; port None picks a free one."""
    try:
        return dist.TCPStore(
            addr if addr not in ("localhost",) else "127.0.0.1",
            port or 0,
            world_size=None,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except Exception as err:  # the port is taken or the address is not ours
        where = f"{addr}:{port}" if port else f"{addr} (a free port)"
        raise ConfigError(
            f"cannot listen for the rendezvous on {where}: {str(err).splitlines()[0]}; "
            "check that distributed.master_addr names this machine (node 0), and choose another "
            "distributed.master_port (or unset it on one node)"
        ) from err


_READ = "ddpscale/settings/read"  # how many nodes have read the others' settings (check_nodes_agree)


def check_nodes_agree(store: dist.TCPStore | None, addr: str, port: int, d: DistributedConfig,
                      settings: Mapping[str, object], threads: int = 0) -> dict[int, tuple[str, int]]:
    """Before a node starts its workers, meet the other nodes' job processes at node 0's store
    and compare their `settings` (config.shared_settings). A node given another
    distributed.num_gpus counts another world size and other rank numbers: the workers'
    rendezvous then waited out distributed.timeout_s (5 minutes) and blamed master_addr. One
    given another optim.lr trained on silently, and one given other epochs or batches left
    the others waiting in a collective. Polls, so a Ctrl-C is taken at once. `store` is node
    0's own, new for this job (None elsewhere: join it). Returns each node's host name and
    the CPU threads its workers use in all (`threads`; 0 on CUDA), by node."""
    deadline = time.monotonic() + d.timeout_s
    where = f"distributed.master_addr:master_port = {addr}:{port}"
    keys = [f"ddpscale/settings/node{n}" for n in range(d.num_nodes)]
    hosts = [f"ddpscale/host/node{n}" for n in range(d.num_nodes)]
    if store is None:
        store = _join_this_jobs_store(addr, port, d, deadline, where)
    try:
        store.set(hosts[d.node_id], json.dumps([socket.gethostname(), threads]))  # before its settings
        store.set(keys[d.node_id], json.dumps(dict(settings), sort_keys=True))
        if not store.check(keys):
            log.info("node %d: waiting for the other node(s) at %s:%d (distributed.timeout_s=%g)",
                     d.node_id, addr, port, d.timeout_s)
        while not store.check(keys):
            if time.monotonic() > deadline:
                missing = [n for n, key in enumerate(keys) if not store.check([key])]
                raise RuntimeError(f"node(s) {missing} did not reach the rendezvous at {where} within "
                                   f"distributed.timeout_s={d.timeout_s:g}; {_rendezvous_advice(d.num_nodes)}")
            time.sleep(0.1)
        given = {f"node {n}": json.loads(store.get(key)) for n, key in enumerate(keys)}
        read = store.add(_READ, 1)
        differ = disagreement(given)
        if differ:
            while d.node_id == 0 and read < d.num_nodes and time.monotonic() < deadline:
                time.sleep(0.05)  # node 0's store goes with this process: let the others read first
                read = store.add(_READ, 0)
            gpus = disagreement({who: {"distributed.num_gpus": s["distributed.num_gpus"]}
                                 for who, s in given.items()})
            if gpus:  # the first thing to fix: it decides the world size and every rank number
                raise ConfigError(f"the nodes were given different {gpus}; give "
                                  "every node the same value: each starts that many workers")
            raise ConfigError(f"the nodes were given different settings: {differ}; give every node the "
                              "same overrides (only distributed.node_id differs)")
        return {n: tuple(json.loads(store.get(key))) for n, key in enumerate(hosts) if store.check([key])}
    except dist.DistNetworkError as err:  # only a joining node's store can go away
        raise RuntimeError(
            f"node 0 left the rendezvous at {where} before every node had arrived "
            "(it was stopped or failed: see its output)") from err


def _join_this_jobs_store(addr: str, port: int, d: DistributedConfig, deadline: float,
                          where: str) -> dist.TCPStore:
    """Connect to node 0's store for this job. In a sweep with a fixed master_port, node 0
    may still be closing the previous job's store: every node has read that one, so wait for
    the new one. A plain socket probes first: each failed TCPStore connection printed some
    20 lines of C++ stack."""
    said = False
    while time.monotonic() < deadline:
        try:
            socket.create_connection((addr, port), timeout=1).close()
            store = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=5),
                                  wait_for_workers=False)
            if store.add(_READ, 0) < d.num_nodes:
                return store
        except (OSError, RuntimeError):  # node 0 not listening yet, or its store closing
            pass
        if not said:
            log.info("node %d: waiting for node 0 at %s:%d (distributed.timeout_s=%g)",
                     d.node_id, addr, port, d.timeout_s)
            said = True
        time.sleep(0.1)
    raise RuntimeError(f"node {d.node_id}: no rendezvous at {where} within distributed.timeout_s="
                       f"{d.timeout_s:g}; {_rendezvous_advice(d.num_nodes)}")


def _rendezvous_advice(num_nodes: int) -> str:
    return (f"check that all {num_nodes} node(s) were started with the same master_addr/master_port "
            "and that node 0 is reachable from the others")


class PeerFailure(RuntimeError):
    """Another rank failed first; this rank's own error was a consequence (gloo's
    "Connection closed by peer" once that rank exited, say)."""

    def __init__(self, rank: int, error: str, traceback_text: str):
        super().__init__(f"rank {rank} raised {error}")
        self.rank, self.traceback_text = rank, traceback_text


def first_stop(run: str, rank: int, stop: dict) -> dict | None:
    """Post why this rank stopped (`stop`: kind "failed" with error and traceback, or
    "interrupted" with signum) as the first stop of run `run` unless another rank's came
    first, and return the first (with its "rank"); None when the store is gone.

    Under torchrun or SLURM each rank is its own process and only rank 0 writes run.json:
    without this it records its own symptom (gloo's "Connection closed by peer", or
    torchrun's SIGTERM) instead of the cause. `run` keys the entry: torchrun's store
    outlives the process groups of a sweep's jobs."""
    try:
        store = dist.distributed_c10d._get_default_store()  # torch has no public accessor
        mine = json.dumps({**stop, "rank": rank})
        return json.loads(store.compare_set(f"ddpscale/first_stop/{run}", "", mine))
    except Exception:  # noqa: BLE001 - the store went with the process hosting it
        return None


@contextmanager
def _stop_signals_end_at_once() -> Iterator[None]:
    """Give the stop signals their default action (end the process) for the block.

    Joining the group blocks in C++ (gloo connects to every rank) until all ranks arrive or
    distributed.timeout_s passes, and a Python signal handler runs only once that returns.
    Under torchrun a rank whose peer had already exited (rank 0 refusing a used run directory,
    say) thus deferred torchrun's SIGTERM, and ended by SIGKILL 30 s later."""
    saved = {s: signal.signal(s, signal.SIG_DFL) for s in STOP_SIGNALS
             if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@contextmanager
def process_group(
    placement: Placement, backend: str, rendezvous: Rendezvous | None, hosts_store: bool = False,
    launched: bool = False,
) -> Iterator[None]:
    """Join the process group for the body of the block; always destroy it afterwards.

    `launched`: this process is a torchrun/SLURM rank, whose stop signals have handlers (a
    spawned worker's SIGTERM from its job process keeps the default action)."""
    timeout = timedelta(seconds=rendezvous.timeout_s if rendezvous else 300)
    where = f"{rendezvous.addr}:{rendezvous.port}" if rendezvous else "env://"
    try:
        with _stop_signals_end_at_once() if launched else contextlib.nullcontext():
            _join(placement, backend, rendezvous, hosts_store, timeout)
    except Exception as err:
        raise RuntimeError(
            f"rank {placement.rank}: rendezvous at distributed.master_addr:master_port = {where} "
            f"failed within distributed.timeout_s={timeout.total_seconds():g}: "
            f"{str(err).splitlines()[0] if str(err) else type(err).__name__}; "
            f"{_rendezvous_advice(placement.num_nodes)}"
        ) from err
    try:
        yield
        # Leave together: a rank that hosts the store must not exit while others still
        # talk to it.
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _join(placement: Placement, backend: str, rendezvous: Rendezvous | None, hosts_store: bool,
          timeout: timedelta) -> None:
    """init_process_group, then a barrier: every rank has arrived."""
    if rendezvous is None:  # torchrun: its agent already set MASTER_ADDR/PORT
        dist.init_process_group(backend, timeout=timeout)
    else:
        connect = timeout
        if not hosts_store:
            connect = timedelta(seconds=max(1.0, _wait_until_listening(rendezvous, timeout)))
        store = dist.TCPStore(
            rendezvous.addr,
            rendezvous.port,
            world_size=placement.world_size if hosts_store else None,
            is_master=hosts_store,
            timeout=connect,
            wait_for_workers=False,
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=placement.rank,
            world_size=placement.world_size,
            timeout=timeout,
        )
    # Everyone must have arrived before training starts; with a store-based init a
    # missing node is only noticed here, so give it the same deadline.
    dist.barrier()


def _wait_until_listening(rendezvous: Rendezvous, timeout: timedelta) -> float:
    """Wait with a plain socket for the store this worker does not host (global rank 0's
    under SLURM; a spawned worker's job process hosts its own, or meets node 0's first); the
    seconds of `timeout` left. A TCPStore client waited out the timeout, then tried once more
    after a random delay of up to as long again (a SLURM task whose rank 0 never started
    failed after some 60 s at distributed.timeout_s=30), printing 20 lines of C++ stack at
    each try."""
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        try:
            socket.create_connection((rendezvous.addr, rendezvous.port), timeout=1).close()
            return deadline - time.monotonic()
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("nothing listened there: global rank 0 hosts the store (was its task started, "
                       "or did it fail first? see its output)")


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so no worker is orphaned.

    A parent that died before this call (a worker takes seconds to import torch and
    unpickle its plan) no longer triggers the signal: this process was already handed
    to another parent, so it leaves at once instead of waiting out the rendezvous."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent_pid:
        os._exit(1)


def free_port(addr: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (only for tests and torchrun hints)."""
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]
