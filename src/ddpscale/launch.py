"""From a composed config to finished workers: validate, prepare, start, record the outcome.

Under spawn the Hydra job process never touches CUDA: it validates, downloads the data
once, hosts the rendezvous store on node 0, starts `num_gpus` workers and waits. Under
torchrun or SLURM this process is itself a worker and runs the body in place. Whichever
process holds global rank 0 keeps `run.json` up to date.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import signal
import tempfile
import textwrap
import traceback
from dataclasses import dataclass
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig, OmegaConf

from ddpscale import data as data_lib
from ddpscale import distributed as ddist
from ddpscale.config import (
    Config, ConfigError, as_dict, disagreement, registered, shared_settings, to_config, validate,
    validate_for_device,
)
from ddpscale.placement import (
    SLURM, SPAWN, STOP_SIGNALS, TORCHRUN, Placement, Rendezvous, WorkerContext, detect_launcher,
    exit_finished_worker, holds_global_rank0, launched_placement, launched_rendezvous, slurm_rendezvous,
    slurm_task_cpus, spawn_placement,
)
from ddpscale.results import RunRecord, earlier_run, taken_message

log = logging.getLogger("ddpscale")

# worker body: (context, config, output directory) -> summary dict for run.json (rank 0)
WorkerFn = Callable[[WorkerContext, Config, Path], dict[str, Any]]


def catch_stop_signals(handler: Callable[[int, Any], None]) -> dict[int, Any]:
    """Install `handler` for every stop signal not ignored now; the handlers it replaced, to
    give back to `restore_signals` (the job here, the local sweep in the slurm launcher).

    The stop signals (STOP_SIGNALS) are Ctrl-C, kill, and SIGHUP (the terminal closed
    or the SSH connection dropped), which would otherwise end the job process at once and
    leave run.json saying "running". One ignored when the job starts (SIGHUP under nohup)
    stays ignored, in the job and in its workers."""
    return {s: signal.signal(s, handler) for s in STOP_SIGNALS
            if signal.getsignal(s) is not signal.SIG_IGN}


def restore_signals(saved: dict[int, Any]) -> None:
    for s, previous in saved.items():
        signal.signal(s, previous)


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP reached the run. A BaseException, like KeyboardInterrupt, so that
    no `except Exception` on the way (a download's retry, say) mistakes it for a failure."""

    def __init__(self, signum: int, rank: int | None = None):
        where = "" if rank is None else f" on rank {rank}"
        super().__init__(f"stopped by {signal.Signals(signum).name}{where}")
        self.signum = signum


@dataclass(frozen=True)
class Outcome:
    """How a run ended; the Hydra job returns it so the sweep summary can count it."""

    status: str  # completed | failed | interrupted
    error: str | None = None
    exit_code: int = 0
    recorded: bool = True  # False: refused before writing run.json (the directory's is another run's)

    @property
    def ok(self) -> bool:
        return self.status == "completed"


@dataclass(frozen=True)
class Plan:
    """Everything a spawned worker needs: plain, picklable, resolved once."""

    cfg: Config
    out_dir: str
    device: str
    backend: str
    launcher: str
    rendezvous: Rendezvous | None


def run_job(raw_cfg: Any, worker: WorkerFn, out_dir: Path, overrides: list[str]) -> Outcome:
    """Run one training job to its end and return its outcome; never hangs.

    SIGINT/SIGTERM/SIGHUP at any point, from the first line to the last record, stop the run
    and mark it interrupted; one arriving while the run is being wound up (workers
    ending, run.json being written) waits until that is done, and then ends the process."""
    with _STOP_SIGNALS:
        outcome = _run_job(raw_cfg, worker, out_dir, overrides)
    signum = _STOP_SIGNALS.received
    if signum is not None:  # interrupted, or a signal came while winding up: stop the sweep too
        raise SystemExit(128 + signum)
    return outcome


def resume_collector() -> None:
    """Turn Python's cycle collector back on where train.py turned it off for start-up,
    freezing what start-up made (modules, functions, the config) out of later collections.
    Once per process: a sweep's later jobs find it on and leave it so (freezing again would
    keep an earlier job's uncollected cycles for good)."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


def _run_job(raw_cfg: Any, worker: WorkerFn, out_dir: Path, overrides: list[str]) -> Outcome:
    resume_collector()  # the job process, or under torchrun/SLURM the worker itself
    launcher = detect_launcher()
    record = None
    try:
        placement = None if launcher == SPAWN else launched_placement(launcher)
        holds_rank0 = holds_global_rank0(node_id(raw_cfg))
        found = earlier_run(out_dir) if holds_rank0 else []
        if found:  # two jobs given one directory (sweep.FreshOutputDir catches a reused one sooner)
            message = taken_message(str(out_dir), found, "give every job its own directory "
                                    "(hydra.run.dir, or a hydra.sweep.subdir with ${hydra.job.num})")
            log.error("error: %s", message)
            return Outcome("failed", message, exit_code=2, recorded=False)
        record = RunRecord(out_dir) if holds_rank0 else None
        if record and record.path.exists():  # a run that ended before any epoch left it
            earlier = record.read()
            ended = {"failed": "failed"}.get(earlier.get("status"), "was stopped")
            log.info("this directory held a run that %s before any epoch ended (%s); the lines "
                     "above in train.log are that run's, and its run.json is replaced", ended,
                     earlier.get("error") or "no error recorded")
        try:
            summary = _start(raw_cfg, worker, out_dir, overrides, launcher, placement, holds_rank0, record)
        finally:
            if placement and not placement.is_main and out_dir.name.startswith("ddpscale-rank"):
                shutil.rmtree(out_dir, ignore_errors=True)  # a non-zero rank's scratch directory
        _STOP_SIGNALS.wind_up()
        if record:
            record.update(**summary)
        if record and summary.get("replicas_identical") is False:
            log.warning("warning: the replicas ended with different weights (run.json's replica_checksums): "
                        "the ranks did not train one model, and results.csv describes rank 0's")
        outcome = _finish(record, Outcome("completed"))
        if record and outcome.ok:
            log.info("run completed: results.csv and run.json are in %s", out_dir)
        return outcome
    except ConfigError as err:
        _STOP_SIGNALS.wind_up()
        log.error("error: %s", err)
        return _finish(record, Outcome("failed", str(err), exit_code=2))
    except Interrupted as err:  # from here on, later signals wait (_STOP_SIGNALS)
        kept = f"; finished epochs are kept in {out_dir}" if (out_dir / "results.csv").exists() else ""
        log.error("run interrupted (%s)%s", err, kept)
        return _finish(record, Outcome("interrupted", str(err), exit_code=128 + err.signum))
    except Exception as err:  # a worker failed: record why, let the sweep go on
        _STOP_SIGNALS.wind_up()
        message = _failure_message(err)
        log.error("run failed: %s", message)
        return _finish(record, Outcome("failed", message, exit_code=1), traceback=_traceback_text(err))


def _start(raw_cfg, worker, out_dir, overrides, launcher, placement, holds_rank0, record) -> dict:
    """Type and check the config, record the run's start, run the workers; their summary."""
    try:
        cfg = _typed_config(raw_cfg, launcher, placement)
    except ConfigError:
        if record:  # what was asked for, though it cannot run: the analysis lists it
            record.start(overrides=overrides, config=_as_given(raw_cfg), launcher=launcher,
                         output_dir=str(out_dir))
        raise
    if record:
        record.start(overrides=overrides, config=as_dict(cfg), launcher=launcher,
                     output_dir=str(out_dir), world_size=_world(cfg))
    validate(cfg)
    _check_registered(cfg)
    device, backend = ddist.resolve_device(cfg.distributed, notice=log.info if holds_rank0 else _quiet)
    validate_for_device(cfg, device)
    if holds_rank0:
        _notices(cfg, device, launcher)
    d = cfg.distributed
    comm_hook = ddist.resolve_comm_hook(d.comm_hook, device, _world(cfg), d.num_nodes)
    if record:
        record.update(grad_allreduce=comm_hook, usable_cores=ddist.usable_cores())
    if launcher == SPAWN:
        data_lib.prepare(cfg.data, _world(cfg))
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
    if launcher == SPAWN and device == "cpu" and d.num_gpus > cores:
        log.info("notice: %d CPU workers share %d core(s) here; past %d worker(s) more cannot "
                 "raise throughput, so a scaling study on this machine should stop at "
                 "distributed.num_gpus=%d", d.num_gpus, cores, cores, cores)
    elif launcher == SPAWN and device == "cpu" and threads and threads * d.num_gpus > cores:
        log.info("notice: train.threads=%d x %d worker(s) is %d threads on %d core(s): they take "
                 "turns, which slows every step; train.threads=null gives each worker %d",
                 threads, d.num_gpus, threads * d.num_gpus, cores, max(1, cores // d.num_gpus))
    if cfg.data.loader == "memory" and cfg.data.num_workers > 0:
        log.info("notice: data.num_workers=%d is unused with data.loader=memory (batches come from "
                 "tensors already in memory); data.loader=dataloader uses DataLoader processes",
                 cfg.data.num_workers)
    if d.comm_hook == "shm" and _world(cfg) == 1:
        log.info("notice: distributed.comm_hook=shm has no other worker to all-reduce with; this "
                 "1-worker run uses none (run.json's grad_allreduce says so)")


def _quiet(*_args: Any) -> None:
    """Notices come from the process holding global rank 0 only."""


def _finish(record: RunRecord | None, outcome: Outcome, **fields: Any) -> Outcome:
    """Write how the run ended into run.json; when that fails (disk full, no file
    descriptors left), say so and count the run as failed from the outcome itself."""
    if record:
        try:
            record.finish(outcome.status, outcome.error, **fields)
        except OSError as err:
            why = f"its end could not be written to {record.path} ({err.strerror}), which still says running"
            log.error("error: the run %s, but %s", outcome.status, why)
            return Outcome("failed", f"{outcome.error}; {why}" if outcome.error else why,
                           exit_code=outcome.exit_code or 1, recorded=False)
    return outcome


def node_id(raw_cfg: Any) -> int:
    """distributed.node_id of a config not yet checked (0 when it has none to read: the
    checks that follow say what is wrong with it)."""
    try:
        return int(raw_cfg.distributed.node_id)
    except Exception:  # missing, deleted (~distributed) or not a number
        return 0


def _world(cfg: Config) -> int:
    return cfg.distributed.num_nodes * cfg.distributed.num_gpus


def _typed_config(raw_cfg: Any, launcher: str, placement: Placement | None) -> Config:
    """Typed config with absolute data.root; under torchrun/SLURM the world comes from them."""
    cfg = to_config(raw_cfg)
    cfg.data.root = _original_path(os.path.expanduser(cfg.data.root))  # ~ first: then it is absolute
    if placement is not None:
        d = cfg.distributed
        launched = (placement.local_world_size, placement.num_nodes, placement.node_id)
        if (d.num_gpus, d.num_nodes) != launched[:2] and placement.is_main:
            log.info("notice: the launcher's world (%d process(es) per node x %d node(s)) "
                     "replaces distributed.num_gpus/num_nodes", launched[0], launched[1])
        d.num_gpus, d.num_nodes, d.node_id = launched
        rendezvous = launched_rendezvous(launcher, d)
        d.master_addr, d.master_port = rendezvous.addr, rendezvous.port
    return cfg


def _as_given(raw_cfg: Any) -> Any:
    """The composed config as plain data, unknown keys included, for run.json."""
    if not isinstance(raw_cfg, DictConfig):
        return None
    try:
        return OmegaConf.to_container(raw_cfg, resolve=True)
    except Exception:  # an interpolation that does not resolve: keep it as written
        return OmegaConf.to_container(raw_cfg, resolve=False)


def _original_path(path: str) -> str:
    try:
        from hydra.utils import to_absolute_path

        return to_absolute_path(path)
    except ValueError:  # outside a Hydra job
        return os.path.abspath(path)


# --------------------------------------------------------------------------- spawn


def _spawn(cfg: Config, worker: WorkerFn, out_dir: Path, device: str, backend: str) -> dict:
    d = cfg.distributed
    addr = d.master_addr or "127.0.0.1"
    ddist.check_master_addr(addr, hosts_store=d.node_id == 0, single_node=d.num_nodes == 1)
    # Node 0 hosts the store itself, on a port the OS picks when none is given: nobody can
    # take the port between choosing it and the workers using it.
    store = ddist.host_store(addr, d.master_port, _world(cfg), d.timeout_s) if d.node_id == 0 else None
    port = store.port if store is not None else d.master_port
    if d.num_nodes > 1:
        ddist.check_nodes_agree(store, addr, port, d, shared_settings(cfg))
    plan = Plan(cfg, str(out_dir), device, backend, SPAWN, Rendezvous(addr, port, d.timeout_s))
    log.info("starting %d worker(s) on node %d/%d (%s, %s), rendezvous %s:%d",
             d.num_gpus, d.node_id, d.num_nodes, device, backend, addr, port)
    fd, name = tempfile.mkstemp(prefix="ddpscale-summary-", suffix=".pt")
    os.close(fd)  # only its name goes to rank 0; an open descriptor per job ran a long sweep out of them
    summary_file = Path(name)
    context = None
    try:
        with _STOP_SIGNALS.held(), _sigint_blocked():
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
        _STOP_SIGNALS.wind_up()  # a signal now must not cut short the ending of the workers
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


class _StopSignals:
    """While a job runs, the first SIGINT/SIGTERM/SIGHUP raises `Interrupted`. Once the job is being
    wound up (after that signal, or after the workers ended), further signals are only
    remembered: a second Ctrl-C must not leave workers running or run.json saying
    "running", and `run_job` exits with the signal's code once the record is written."""

    def __enter__(self) -> None:
        self.received: int | None = None
        self.winding_up = False
        self.holding = False
        self.saved = catch_stop_signals(self._handler)

    def __exit__(self, *exc) -> None:
        restore_signals(self.saved)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A signal that arrives meanwhile stops the job on leaving. Raised inside
        mp.start_processes, between starting a worker and handing it its work, it left that
        worker dying of EOFError with a traceback (blocking SIGINT cannot prevent it: another
        thread, such as the store's, takes the signal for Python)."""
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.received is not None and not self.winding_up:
            self.winding_up = True
            raise Interrupted(self.received)

    def wind_up(self) -> None:
        """From now on a signal no longer interrupts what this process is doing."""
        self.winding_up = True

    def _handler(self, signum: int, _frame: Any) -> None:
        first = self.received is None
        self.received = signum if first else self.received
        if self.holding and first:
            return  # raised on leaving held()
        if self.winding_up or not first:
            log.warning("%s: already stopping; ending the workers and recording the run first",
                        signal.Signals(signum).name)
            return
        self.winding_up = True
        raise Interrupted(signum)


_STOP_SIGNALS = _StopSignals()


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
    if plan.device == "cuda":
        torch.cuda.set_device(placement.local_rank)
        device = torch.device("cuda", placement.local_rank)
    else:
        device = torch.device("cpu")
        task_cpus = slurm_task_cpus() if plan.launcher == SLURM else None
        ddist.configure_cpu_worker(placement.local_world_size, plan.cfg.train.threads,
                                   plan.cfg.train.malloc_cache, task_cpus)
    ctx = WorkerContext(placement, device, plan.backend, plan.launcher)
    with ddist.process_group(placement, plan.backend, plan.rendezvous, hosts_store=hosts_store,
                             launched=plan.launcher != SPAWN):
        out_dir = _agree_on_output_dir(Path(plan.out_dir), placement)
        if plan.launcher != SPAWN:  # spawned workers share their job's config, checked across nodes
            _agree_on_settings(plan.cfg, placement)
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
        stop = {"kind": "failed", "error": _failure_message(err), "traceback": _traceback_text(err)}
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


def _agree_on_settings(cfg: Config, placement: Placement) -> None:
    """Under torchrun/SLURM every rank composed its own config: one given another optim.lr
    trained on silently (replicas apart, results.csv saying rank 0's), and one given other
    epochs or batches left the rest waiting in a collective for distributed.timeout_s."""
    gathered: list[Any] = [None] * placement.world_size
    dist.all_gather_object(gathered, shared_settings(cfg))
    differ = disagreement({f"rank {r}": settings for r, settings in enumerate(gathered)})
    if differ:
        raise ConfigError(f"the ranks were given different settings: {differ}; give every rank "
                          "the same overrides")


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


def _failure_message(err: BaseException) -> str:
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


def _traceback_text(err: BaseException) -> str:
    if isinstance(err, mp.ProcessRaisedException):
        return str(err)
    if isinstance(err, ddist.PeerFailure):
        own = "".join(traceback.format_exception(err.__cause__)) if err.__cause__ else ""
        return (f"{err.traceback_text}\n(rank {err.rank}'s traceback; global rank 0 then "
                f"stopped with:)\n{own}")
    return "".join(traceback.format_exception(err))
