"""From a composed config to a recorded outcome: check, record, run the workers, say how it ended.

Whichever process holds global rank 0 keeps `run.json` up to date. The config is typed and
checked, and a refused one recorded, before anything imports torch (1.5 s): the workers'
side, ddpscale.workers, is imported only once a run starts (`_workers`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

from omegaconf import DictConfig, OmegaConf

from ddpscale.config import Config, ConfigError, as_dict, to_config, validate
from ddpscale.placement import (
    SPAWN, STOP_SIGNALS, Placement, WorkerContext, detect_launcher, holds_global_rank0, launched_placement,
    launched_rendezvous,
)
from ddpscale.results import RunRecord, earlier_run, taken_message

log = logging.getLogger("ddpscale")

# worker body: (context, config, output directory) -> summary dict for run.json (rank 0); run_job
# also takes it by name, "module:function" (train.py's: importing it imports torch)
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


# One per process: a sweep runs its jobs one after another. ddpscale.workers holds signals
# with it while starting the workers, and winds it up as they end.
JOB_SIGNALS = _StopSignals()


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


def run_job(raw_cfg: Any, worker: WorkerFn | str, out_dir: Path, overrides: list[str]) -> Outcome:
    """Run one training job to its end and return its outcome; never hangs.

    SIGINT/SIGTERM/SIGHUP at any point, from the first line to the last record, stop the run
    and mark it interrupted; one arriving while the run is being wound up (workers
    ending, run.json being written) waits until that is done, and then ends the process."""
    with JOB_SIGNALS:
        outcome = _run_job(raw_cfg, worker, out_dir, overrides)
    resume_collector()  # a run refused before it needed torch: start-up ended with it
    signum = JOB_SIGNALS.received
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


def _run_job(raw_cfg: Any, worker: WorkerFn | str, out_dir: Path, overrides: list[str]) -> Outcome:
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
        JOB_SIGNALS.wind_up()
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
        JOB_SIGNALS.wind_up()
        log.error("error: %s", err)
        return _finish(record, Outcome("failed", str(err), exit_code=2))
    except Interrupted as err:  # from here on, later signals wait (JOB_SIGNALS)
        kept = f"; finished epochs are kept in {out_dir}" if (out_dir / "results.csv").exists() else ""
        log.error("run interrupted (%s)%s", err, kept)
        return _finish(record, Outcome("interrupted", str(err), exit_code=128 + err.signum))
    except Exception as err:  # a worker failed: record why, let the sweep go on
        JOB_SIGNALS.wind_up()
        workers = _workers()  # it knows the workers' exceptions (torch's), which such an error may be
        message = workers.failure_message(err)
        log.error("run failed: %s", message)
        return _finish(record, Outcome("failed", message, exit_code=1), traceback=workers.traceback_text(err))


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
                     output_dir=str(out_dir), world_size=world(cfg))
    validate(cfg)
    return _workers().start(cfg, worker, out_dir, launcher, placement, holds_rank0, record)


def _workers() -> ModuleType:
    """ddpscale.workers, imported where a run starts: with it torch (1.5 s), which a config
    refused by the checks above never needs. A stop signal meanwhile stops the run once the
    import is done (torch's C import swallows a KeyboardInterrupt raised inside it). Start-up
    ends here: the collector resumes, with torch frozen out of it as train.py's imports are."""
    with JOB_SIGNALS.held():
        from ddpscale import workers
    resume_collector()  # the job process, or under torchrun/SLURM the worker itself
    return workers


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


def world(cfg: Config) -> int:
    """The run's number of workers: per node x nodes."""
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
