"""Start the workers and run each one: the part of a job that needs torch.

ddpscale.launch checks the config and records the run without torch (1.5 s to import), so
that a refused config is answered at once; it imports this module only once a run starts.
Under spawn the Hydra job process never touches CUDA: it downloads the data once, hosts
the rendezvous store on node 0, starts `num_gpus` workers and waits. Under torchrun or
SLURM this process is itself a worker and runs the body in place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pkgutil
import signal
import socket
import tempfile
import textwrap
import traceback
from dataclasses import dataclass
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddpscale import data as data_lib
from ddpscale import distributed as ddist
from ddpscale.config import Config, ConfigError, disagreement, registered, shared_settings, validate_for_device
from ddpscale.launch import JOB_SIGNALS, Interrupted, WorkerFn, resume_collector, world
from ddpscale.placement import (
    SLURM, SPAWN, TORCHRUN, Placement, Rendezvous, WorkerContext, exit_finished_worker, slurm_rendezvous,
    slurm_task_cpus, spawn_placement,
)
from ddpscale.results import RunRecord

log = logging.getLogger("ddpscale")


@dataclass(frozen=True)
class Plan:
    """Everything a spawned worker needs: plain, picklable, resolved once."""

    cfg: Config
    out_dir: str
    device: str
    backend: str
    launcher: str
    rendezvous: Rendezvous | None


def start(cfg: Config, worker: WorkerFn | str, out_dir: Path, launcher: str, placement: Placement | None,
          holds_rank0: bool, record: RunRecord | None) -> dict:
    """Check what needs torch (the registries, the devices), then run the workers; their summary.
    `worker` may be given by name ("module:function"), imported only here."""
    worker = pkgutil.resolve_name(worker) if isinstance(worker, str) else worker
    _check_registered(cfg)
    device, backend = ddist.resolve_device(cfg.distributed, notice=log.info if holds_rank0 else _quiet)
    validate_for_device(cfg, device)
    if holds_rank0:
        _notices(cfg, device, launcher)
    d = cfg.distributed
    comm_hook = ddist.resolve_comm_hook(d.comm_hook, device, world(cfg), d.num_nodes)
    if record:
        record.update(grad_allreduce=comm_hook, usable_cores=ddist.usable_cores())
    if launcher == SPAWN:
        data_lib.prepare(cfg.data, world(cfg))
        return _spawn(cfg, worker, out_dir, device, backend)
    return _in_place(cfg, worker, out_dir, device, backend, launcher, placement)


def _check_registered(cfg: Config) -> None:
    """The workers look the model, optimizer, schedule and data set up by name: an unknown
    one fails here, with the registry a plug-in of one's own goes into."""
    from ddpscale.models import MODELS
    from ddpscale.optim import OPTIMIZERS, SCHEDULES

    registered(MODELS, "model", cfg.model.name, "ddpscale.models.MODELS")
    registered(OPTIMIZERS, "optim", cfg.optim.name, "ddpscale.optim.OPTIMIZERS")
    registered(SCHEDULES, "optim.schedule", cfg.optim.schedule, "ddpscale.optim.SCHEDULES")
    registered(data_lib.DATASETS, "data", cfg.data.name, "ddpscale.data.DATASETS")


def _notices(cfg: Config, device: str, launcher: str) -> None:
    """Settings that run, but cannot do what they seem to: say so once, and go on."""
    d, cores, threads = cfg.distributed, ddist.usable_cores(), cfg.train.threads
    share = ddist.cpu_threads(d.num_gpus)  # each worker's threads under train.threads=null
    # DataLoader processes take CPU beside their worker's threads: decoding, transforms, collating
    loaders = cfg.data.num_workers if cfg.data.loader == "dataloader" else 0
    busy = (threads or share) + loaders  # what each worker keeps running
    if launcher == SPAWN and device == "cpu" and d.num_gpus > cores:
        log.info("notice: %d CPU workers share %d core(s) here; past %d worker(s) more cannot "
                 "raise throughput, so a scaling study on this machine should stop at "
                 "distributed.num_gpus=%d", d.num_gpus, cores, cores, cores)
    elif launcher == SPAWN and device == "cpu" and loaders and busy * d.num_gpus > cores:
        fix = (f"train.threads={share - loaders} leaves a core to each DataLoader process" if share > loaders
               else f"data.num_workers=0 loads the batches in the workers themselves, with {share} thread(s) each")
        log.info("notice: %d worker(s) x (%d thread(s) + data.num_workers=%d DataLoader process(es)) is %d on "
                 "%d core(s): they take turns, which slows every step; %s",
                 d.num_gpus, threads or share, loaders, busy * d.num_gpus, cores, fix)
    elif launcher == SPAWN and device == "cpu" and threads and threads * d.num_gpus > cores:
        log.info("notice: train.threads=%d x %d worker(s) is %d threads on %d core(s): they take "
                 "turns, which slows every step; train.threads=null gives each worker %d",
                 threads, d.num_gpus, threads * d.num_gpus, cores, share)
    if cfg.data.loader == "memory" and cfg.data.num_workers > 0:
        log.info("notice: data.num_workers=%d is unused with data.loader=memory (batches come from "
                 "tensors already in memory); data.loader=dataloader uses DataLoader processes",
                 cfg.data.num_workers)
    if cfg.data.name == "synthetic" and cfg.data.download:
        log.info("notice: data.download=true does nothing with data=synthetic (generated in memory, "
                 "nothing to download); data=fashion_mnist or data=mnist reads files, which it fetches")
    if d.comm_hook == "shm" and world(cfg) == 1:
        log.info("notice: distributed.comm_hook=shm has no other worker to all-reduce with; this "
                 "1-worker run uses none (run.json's grad_allreduce says so)")


def _shared_machine_notice(placed: dict[int, tuple[str, int]], workers_each: int, who: str = "node") -> None:
    """Nodes started on one machine (the README's loopback try; under torchrun, its agents)
    each give their CPU workers the whole machine's cores: two nodes of one worker on a
    2-core VM ran 4 threads, and trained 2.1-4.7x slower than with one thread each (in four
    pairs of runs), without a word. `placed`: each node's (or rank's) host and CPU threads."""
    here = placed.get(0, ("", 0))[0]
    sharing = [n for n, (host, _) in sorted(placed.items()) if host == here]
    threads, cores = sum(placed[n][1] for n in sharing), ddist.usable_cores()
    workers = len(sharing) * workers_each
    share = ddist.cpu_threads(workers)
    # more workers than cores: one thread each, as they have, is all there is to give
    if len(sharing) > 1 and threads > max(cores, workers):
        log.info("notice: %ss %s run on this one machine (%s): %d CPU threads in all on %d core(s), "
                 "which take turns and slow every step; give every %s train.threads=%d (the cores "
                 "// the %d workers here)", who, ", ".join(map(str, sharing)), here, threads, cores,
                 who, share, workers)


def _quiet(*_args: Any) -> None:
    """Notices come from the process holding global rank 0 only."""


# --------------------------------------------------------------------------- spawn


def _spawn(cfg: Config, worker: WorkerFn, out_dir: Path, device: str, backend: str) -> dict:
    d = cfg.distributed
    addr = d.master_addr or "127.0.0.1"
    ddist.check_master_addr(addr, hosts_store=d.node_id == 0, single_node=d.num_nodes == 1)
    # Node 0 hosts the store itself, on a port the OS picks when none is given: nobody can
    # take the port between choosing it and the workers using it.
    store = ddist.host_store(addr, d.master_port, world(cfg), d.timeout_s) if d.node_id == 0 else None
    port = store.port if store is not None else d.master_port
    if d.num_nodes > 1:
        threads = d.num_gpus * ddist.cpu_threads(d.num_gpus, cfg.train.threads) if device == "cpu" else 0
        nodes = ddist.check_nodes_agree(store, addr, port, d, shared_settings(cfg), threads)
        if d.node_id == 0:
            _shared_machine_notice(nodes, d.num_gpus)
    plan = Plan(cfg, str(out_dir), device, backend, SPAWN, Rendezvous(addr, port, d.timeout_s))
    log.info("starting %d worker(s) on node %d/%d (%s, %s), rendezvous %s:%d",
             d.num_gpus, d.node_id, d.num_nodes, device, backend, addr, port)
    fd, name = tempfile.mkstemp(prefix="ddpscale-summary-", suffix=".pt")
    os.close(fd)  # only its name goes to rank 0; an open descriptor per job ran a long sweep out of them
    summary_file = Path(name)
    context = None
    try:
        with JOB_SIGNALS.held(), _sigint_blocked():
            context = mp.start_processes(_spawn_entry, args=(plan, worker, str(summary_file), os.getpid()),
                                         nprocs=d.num_gpus, join=False, start_method="spawn")
        # Short waits keep this process responsive to signals; when one worker dies,
        # join() gives the others a second to end on their own (one blocked in gloo
        # does; one waiting in the shared-memory all-reduce cannot tell), terminates
        # them and raises with the cause.
        try:
            while not context.join(timeout=0.5, grace_period=1):
                pass
        except mp.ProcessRaisedException as err:
            checked = _worker_config_error(err)
            if checked:  # one of ddpscale's checks, met in a worker: as it ends a job under torchrun
                raise ConfigError(checked) from None
            raise
        if summary_file.stat().st_size:
            return torch.load(summary_file)
        if d.node_id == 0:  # its local rank 0 is global rank 0, which saves the summary last
            raise RuntimeError(
                "worker 0 exited with code 0 before its run finished: code in it called "
                "os._exit(0), or that worker alone was sent SIGINT")
        return {}
    finally:
        JOB_SIGNALS.wind_up()  # a signal now must not cut short the ending of the workers
        if context is not None:
            end_processes(context)
        summary_file.unlink(missing_ok=True)
        del store


def _spawn_entry(local_rank: int, plan: Plan, worker: WorkerFn, summary_file: str,
                 parent_pid: int) -> None:
    """First function of every spawned worker."""
    # A Ctrl-C during the worker's start-up waited, blocked; here it raises KeyboardInterrupt,
    # which torch's spawn wrapper takes quietly (the job process stops the run).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    ddist.die_with_parent(parent_pid)
    placement = spawn_placement(local_rank, plan.cfg.distributed)
    summary = _run_worker(placement, plan, worker, hosts_store=False)
    if placement.is_main:
        torch.save(summary, summary_file)
    exit_finished_worker()


@contextlib.contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Block SIGINT in this thread, so that the processes it starts meanwhile inherit the mask:
    a Ctrl-C while a spawned interpreter starts up would kill it with "Fatal Python error:
    init_import_site" and a traceback. A worker unblocks it in `_spawn_entry`."""
    resource_tracker.ensure_running()  # its first start unblocks SIGINT: not inside the block
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def end_processes(context: mp.ProcessContext) -> None:
    """Terminate any process of an mp.start_processes context still alive (SIGTERM, then
    SIGKILL), reap them all, and delete the traceback files of failed ones: torch has a
    failed process pickle its traceback to a temp file, reads it and never deletes it."""
    for p in context.processes:
        if p.is_alive():
            p.terminate()
    for p in context.processes:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()
    for path in context.error_files:
        Path(path).unlink(missing_ok=True)


# --------------------------------------------------------------------------- torchrun / slurm


def _in_place(cfg, worker, out_dir, device, backend, launcher, placement) -> dict:
    # torchrun's agent hosts the store (env://); under SLURM global rank 0 hosts it.
    rendezvous = None if launcher == TORCHRUN else slurm_rendezvous(cfg.distributed)
    if rendezvous is not None:
        ddist.check_master_addr(rendezvous.addr, hosts_store=placement.is_main)
    plan = Plan(cfg, str(out_dir), device, backend, launcher, rendezvous)
    return _run_worker(placement, plan, worker, hosts_store=placement.is_main)


# --------------------------------------------------------------------------- every worker


def _run_worker(placement: Placement, plan: Plan, worker: WorkerFn, hosts_store: bool) -> dict:
    """Set up this worker's device, threads and process group, then run the body."""
    resume_collector()  # a spawned worker: it ran train.py's start-up again
    _configure_worker_logging(placement, plan)
    threads = 0  # CPU threads
    if plan.device == "cuda":
        torch.cuda.set_device(placement.local_rank)
        device = torch.device("cuda", placement.local_rank)
    else:
        device = torch.device("cpu")
        task_cpus = slurm_task_cpus() if plan.launcher == SLURM else None
        threads = ddist.configure_cpu_worker(placement.local_world_size, plan.cfg.train.threads,
                                             plan.cfg.train.malloc_cache, task_cpus)
    ctx = WorkerContext(placement, device, plan.backend, plan.launcher)
    with ddist.process_group(placement, plan.backend, plan.rendezvous, hosts_store=hosts_store,
                             launched=plan.launcher != SPAWN):
        out_dir = _agree_on_output_dir(Path(plan.out_dir), placement)
        if plan.launcher != SPAWN:  # spawned workers share their job's config, checked across nodes
            _agree_on_settings(plan.cfg, placement, threads, plan.launcher)
        try:
            if plan.launcher != SPAWN:
                _prepare_data_once(plan.cfg, placement)
            return _body(worker, ctx, plan.cfg, out_dir)
        except (Exception, Interrupted) as err:
            if plan.launcher == SPAWN and placement.num_nodes == 1:
                raise  # the job process sees every worker and names the first to fail
            # torchrun, SLURM, or spawn on several nodes: each job process sees only its own
            # node's workers, and node 0's would record a symptom of another node's failure
            _raise_first_stop(err, str(out_dir), placement, plan.launcher)
            raise


def _body(worker: WorkerFn, ctx: WorkerContext, cfg: Config, out_dir: Path) -> dict:
    """The worker's training body; a sys.exit in it (a model's or a plugin's code) is a failure
    of this rank. It left the process with that code, often 0, saying nothing, and the other
    ranks then blamed it on the out-of-memory killer or a closed connection."""
    try:
        return worker(ctx, cfg, out_dir)
    except SystemExit as exit_:
        raise RuntimeError(f"rank {ctx.rank}: the training code called sys.exit({exit_.code!r}) "
                           "before the run finished") from None


def _raise_first_stop(err: BaseException, run: str, placement: Placement, launcher: str) -> None:
    """Under torchrun/SLURM, or spawned on several nodes: post why this rank stopped; on
    global rank 0, raise the first rank's stop instead of its own when that came first.
    When a rank fails, torchrun SIGTERMs the others and gloo breaks their connections:
    symptoms, which run.json must not report as the cause (nor a Ctrl-C on another node as
    a failure)."""
    if isinstance(err, Interrupted):
        stop = {"kind": "interrupted", "signum": err.signum}
    else:
        stop = {"kind": "failed", "error": failure_message(err), "traceback": traceback_text(err)}
    first = ddist.first_stop(run, placement.rank, stop)
    if not placement.is_main or first is None or first["rank"] == placement.rank:
        return
    if isinstance(err, ConfigError) or (isinstance(err, Interrupted) and first["kind"] == "interrupted"):
        return  # every rank's own: exit 2 for a config error; a Ctrl-C reached this rank too
    if first["kind"] == "failed":
        failure = ddist.PeerFailure(first["rank"], first["error"], first["traceback"])
        if launcher == SPAWN:  # the job process gets this worker's traceback text only
            # indented, so that _raised_line still finds this exception's line, not rank N's
            peer = textwrap.indent(first["traceback"].rstrip(), "    ")
            failure.__notes__ = [f"rank {first['rank']}'s traceback:\n{peer}"]
        raise failure from err
    raise Interrupted(first["signum"], first["rank"]) from err


def _agree_on_output_dir(out_dir: Path, placement: Placement) -> Path:
    """Every rank adopts global rank 0's output directory (Hydra gave each its own)."""
    shared = [str(out_dir)]
    dist.broadcast_object_list(shared, src=0)
    return Path(shared[0])


def _agree_on_settings(cfg: Config, placement: Placement, threads: int, launcher: str) -> None:
    """Under torchrun/SLURM every rank composed its own config: one given another optim.lr
    trained on silently (replicas apart, results.csv saying rank 0's), and one given other
    epochs or batches left the rest waiting in a collective for distributed.timeout_s.
    Under torchrun, rank 0 also notes agents started on one machine that oversubscribe it
    (under SLURM a task bound to its own cores uses them all, which a sum would misread)."""
    gathered: list[Any] = [None] * placement.world_size
    dist.all_gather_object(gathered, (shared_settings(cfg), socket.gethostname(), threads))
    differ = disagreement({f"rank {r}": settings for r, (settings, _, _) in enumerate(gathered)})
    if differ:
        raise ConfigError(f"the ranks were given different settings: {differ}; give every rank "
                          "the same overrides")
    if placement.is_main and launcher == TORCHRUN:
        _shared_machine_notice({r: (host, count) for r, (_, host, count) in enumerate(gathered)}, 1, "rank")


def _prepare_data_once(cfg: Config, placement: Placement) -> None:
    """Under torchrun/SLURM: local rank 0 of each node downloads, the others wait."""
    if placement.local_rank == 0:
        data_lib.prepare(cfg.data, placement.world_size)  # an error here ends this rank, and the launcher the rest
    dist.barrier()


def _configure_worker_logging(placement: Placement, plan: Plan) -> None:
    """Spawned workers start with no logging; rank 0 logs to the console and train.log."""
    root = logging.getLogger()
    if plan.launcher != SPAWN:
        return  # Hydra already configured this process
    root.setLevel(logging.INFO)
    fmt = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    console = logging.StreamHandler()
    console.setFormatter(fmt)
    root.addHandler(console)
    if placement.is_main:
        file_handler = logging.FileHandler(Path(plan.out_dir) / "train.log")
        file_handler.setFormatter(fmt)
        root.addHandler(file_handler)


def failure_message(err: BaseException) -> str:
    """One line that says which worker failed and why."""
    if isinstance(err, mp.ProcessRaisedException):
        line = _raised_line(str(err))
        peer = f"{ddist.PeerFailure.__module__}.{ddist.PeerFailure.__qualname__}: "
        if line.startswith(peer):  # a rank on another node failed first: "rank 1 raised ..."
            return line[len(peer):]
        return f"worker {err.error_index} raised {line}"
    if isinstance(err, mp.ProcessExitedException):
        return f"worker {err.error_index} died: {err}"
    if isinstance(err, ddist.PeerFailure):
        return str(err)
    return f"{type(err).__name__}: {err}"


def _worker_config_error(err: mp.ProcessRaisedException) -> str | None:
    """The message of a ConfigError that a spawned worker raised (a plug-in's data checked
    there, say), which arrives as the worker's formatted traceback; None for any other error."""
    name = f"{ConfigError.__module__}.{ConfigError.__qualname__}: "
    line = _raised_line(str(err))
    return line[len(name):] if line.startswith(name) else None


def _raised_line(text: str) -> str:
    """The exception line of a worker's formatted traceback ("RuntimeError: ..."): the first
    unindented line after its last "Traceback" header, not the text's last line, which for
    a message of several lines (DDP's) was only its final remark."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    headers = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    after = lines[headers[-1] + 1:] if headers else []
    return next((line.strip() for line in after if not line[0].isspace()), lines[-1].strip())


def traceback_text(err: BaseException) -> str:
    if isinstance(err, mp.ProcessRaisedException):
        return str(err)
    if isinstance(err, ddist.PeerFailure):
        own = "".join(traceback.format_exception(err.__cause__)) if err.__cause__ else ""
        return (f"{err.traceback_text}\n(rank {err.rank}'s traceback; global rank 0 then "
                f"stopped with:)\n{own}")
    return "".join(traceback.format_exception(err))
