"""Hydra submitit launchers whose SLURM shape follows each job's `distributed` group.

hydra-submitit-launcher submits a whole sweep with one set of executor parameters, so
`distributed.num_gpus=1,2,4` would get the same `tasks_per_node` for every job. These
launchers group the jobs by (num_nodes, num_gpus) and give each group
`nodes=num_nodes`, `tasks_per_node=num_gpus` and, unless `gpus_per_node` is set,
`gpus_per_node=num_gpus`: one task per GPU, each task one DDP worker. On a cluster every
group is submitted before any result is awaited; the local executor runs the jobs one
after another, as Hydra's basic launcher does, since they share this machine's cores.
(Hydra only loads launchers from the `hydra_plugins` package, hence the location.)
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher
from omegaconf import OmegaConf

from ddpscale.launch import catch_stop_signals, restore_signals, resume_collector
from ddpscale.sweep import SWEEP_JOBS, count_submitted_job

log = logging.getLogger(__name__)


class _ShapedLauncher(BaseSubmititLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        resume_collector()  # the sweep process runs no job itself, and waits on them for hours
        assert self.config is not None and self.hydra_context is not None
        for key, instead in (("nodes", "distributed.num_nodes"), ("tasks_per_node", "distributed.num_gpus")):
            value = self.params.get(key, 1)
            if value != 1:  # _executor sets both from each job's shape: the value would be dropped
                self._refuse(f"hydra.launcher.{key}={value} is not read: ddpscale shapes each job from "
                             f"{instead} (one task per worker); use {instead}={value} instead")
        groups: dict[tuple[int, int], list[tuple[int, list[str]]]] = defaultdict(list)
        in_order = []
        for offset, overrides in enumerate(job_overrides):
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            shape = (int(cfg.distributed.num_nodes), int(cfg.distributed.num_gpus))
            for key, value, what in (("num_nodes", shape[0], "nodes"), ("num_gpus", shape[1], "worker processes per node")):
                if value < 1:  # the job's shape comes before the job's own checks
                    self._refuse(f"distributed.{key}={value} must be >= 1 ({what}), in job "
                                 f"#{initial_job_idx + offset}")
            groups[shape].append((initial_job_idx + offset, list(overrides)))
            in_order.append((initial_job_idx + offset, list(overrides), shape))

        if self._EXECUTOR == "local" and any(nodes > 1 for nodes, _ in groups):
            nodes = max(nodes for nodes, _ in groups)
            self._refuse(f"hydra/launcher=slurm_local runs every job on this machine, but a job asks "
                         f"for distributed.num_nodes={nodes}; use distributed.num_nodes=1 here, or "
                         "hydra/launcher=slurm on a cluster")
        if self._EXECUTOR == "slurm" and shutil.which("sbatch") is None:
            self._refuse("hydra/launcher=slurm submits each job with sbatch, which this machine "
                         "does not have; run the sweep on a SLURM login node, or use "
                         "hydra/launcher=slurm_local here")
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        log.info("Submitit '%s' sweep output dir : %s", self._EXECUTOR, sweep_dir)
        if self._EXECUTOR == "local":
            try:
                return self._one_after_another(in_order)
            finally:
                _remove_unsubstituted_folder(Path(self.params["submitit_folder"]))
        submitted = []
        for (nodes, gpus), jobs in groups.items():
            executor = self._executor(nodes, gpus)
            for idx, overrides in jobs:
                log.info("\t#%d : %s  (%d node(s) x %d task(s))", idx,
                         " ".join(filter_overrides(overrides)), nodes, gpus)
            job_params = [(overrides, "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state())
                          for idx, overrides in jobs]
            submitted += zip([idx for idx, _ in jobs], executor.map_array(self, *zip(*job_params)))
        return [_result(job, idx) for idx, job in submitted]

    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        """One task of a job (in its own process). A local task inherits SIGINT ignored from
        its controller (see sigint_ignored); taken back, Ctrl-C stops its run, which records
        SIGINT, rather than the SIGTERM the controller would pass on a moment later."""
        if self._EXECUTOR == "local":
            signal.signal(signal.SIGINT, signal.default_int_handler)
        # submitit writes its own lines ("Job completed successfully") to this task's log in
        # .submitit/ through a handler of its own. Passed on to the root logger as well, whose
        # handlers Hydra points at that same log and at train.log, each stood twice in the
        # task's log, and every task of the job added its copy to train.log, which they share
        logging.getLogger("submitit").propagate = False
        return super().__call__(*args, **kwargs)

    def _refuse(self, problem: str) -> None:
        """End a sweep refused before any job started: one line, exit 2 like a config error
        (Hydra would print its own traceback for an exception), nothing left behind."""
        print(f"error: {problem} (nothing was started)", file=sys.stderr)
        self._take_back_multirun_yaml()
        sys.exit(2)

    def _take_back_multirun_yaml(self) -> None:
        """Hydra wrote multirun.yaml (and SweepSummary the job list) into the sweep directory
        before launching; a sweep refused before any job leaves nothing behind (a directory
        claimed for it goes too)."""
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        written = {"multirun.yaml", SWEEP_JOBS}
        if sweep_dir.is_dir() and {p.name for p in sweep_dir.iterdir()} <= written:
            for name in written:
                (sweep_dir / name).unlink(missing_ok=True)
            raw = OmegaConf.to_container(self.config.hydra.sweep, resolve=False)["dir"]
            if "${ddpscale_dir:" in str(raw):
                sweep_dir.rmdir()
                # and multirun/<date>, multirun when it alone filled them (relative: below the cwd)
                for folder in list(sweep_dir.parents)[: len(sweep_dir.parts) - 1]:
                    if folder.is_absolute() or any(folder.iterdir()):
                        break
                    folder.rmdir()

    def _one_after_another(self, jobs: list[tuple[int, list[str], tuple[int, int]]]) -> list[JobReturn]:
        """Run local jobs one at a time: run together, they would share the cores, and
        every throughput of the sweep would be measured under the others' load. Ctrl-C,
        SIGTERM or SIGHUP stops the running job (its run.json says interrupted) and the sweep."""
        results = []
        with _StopSignals() as stop:
            for idx, overrides, (nodes, gpus) in jobs:
                log.info("\t#%d : %s  (%d node(s) x %d task(s))", idx,
                         " ".join(filter_overrides(overrides)), nodes, gpus)
                executor = self._executor(nodes, gpus)
                with stop.sigint_ignored():
                    # submitit's local controller inherits this: Ctrl-C must reach the tasks
                    # (they stop and record the run), not their controller, which would
                    # SIGKILL them a second later, perhaps before run.json says why
                    job = executor.submit(self, overrides, "hydra.sweep.dir", idx,
                                          f"job_id_for_{idx}", Singleton.get_state())
                try:
                    _end_stragglers(job, idx)
                    results.append(_result(job, idx))
                except _Stopped as stopped:
                    # Ctrl-C reached the tasks too (they stop and record SIGINT); SIGTERM only
                    # for what they did not get: a signal to this process alone, or a task slow to stop
                    if stopped.signum != signal.SIGINT or not _ends_within(job, CTRL_C_GRACE_S):
                        _terminate(job)  # the controller passes it on to the tasks and waits for them
                        _ends_within(job, 30)  # the job records its end, then exits
                    name = signal.Signals(stopped.signum).name
                    print(f"sweep stopped by {name}: job #{idx} was interrupted and no later job "
                          "was started", file=sys.stderr)
                    sys.exit(128 + stopped.signum)
        return results

    def _executor(self, nodes: int, gpus: int) -> Any:
        import submitit

        params = dict(self.params)
        init = {"folder": params.pop("submitit_folder")}
        if "max_num_timeout" in params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = params.pop("max_num_timeout")
        params.update(nodes=nodes, tasks_per_node=gpus)
        if params.get("gpus_per_node") is None:
            params["gpus_per_node"] = gpus if self._EXECUTOR == "slurm" else 0
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in params.items()})
        return executor


CTRL_C_GRACE_S = 5  # how long tasks that got Ctrl-C have to stop by themselves before SIGTERM
STRAGGLER_GRACE_S = 10  # after task 0 has its result, how long the other tasks have to end


def _end_stragglers(job: Any, idx: int) -> None:
    """Wait for a local job, ending its other tasks once task 0 (global rank 0, which records
    the run) has its result and they have not ended within STRAGGLER_GRACE_S. submitit's
    controller waits for every task: one hung in its forward, after rank 0 had recorded
    the failure, held the sweep for hydra.launcher.timeout_min (30 minutes). On SLURM,
    `srun --kill-on-bad-exit=1` does this; under spawn, the job process."""
    first_done, ended = None, False
    while not job.done():
        if first_done is None and job.task(0).paths.result_pickle.exists():
            first_done = time.monotonic()
        if not ended and first_done is not None and time.monotonic() - first_done > STRAGGLER_GRACE_S:
            log.error("job #%d: task 0 ended %d s ago and other tasks are still running; "
                      "ending them (SIGTERM)", idx, STRAGGLER_GRACE_S)
            _terminate(job)
            ended = True
        time.sleep(0.2)


def _ends_within(job: Any, seconds: float) -> bool:
    """Whether a local job ends within `seconds`."""
    deadline = time.monotonic() + seconds
    while not job.done() and time.monotonic() < deadline:
        time.sleep(0.2)
    return job.done()


def _terminate(job: Any) -> None:
    """SIGTERM to a local job's controller, which passes it on to the tasks. A hangup of the
    whole terminal may have ended the controller already (its tasks stop on their own)."""
    try:
        os.kill(int(job.job_id), signal.SIGTERM)
    except ProcessLookupError:
        pass


def _remove_unsubstituted_folder(folder: Path) -> None:
    """submitit's local controller makes its folder as written, `.submitit/%j` itself
    (Controller.start_tasks), while each job's files go where the job id is put in for %j:
    remove that empty leftover, unless something was put in it since."""
    from submitit.core.utils import JobPaths

    folder = folder.expanduser().absolute()
    if folder != JobPaths.get_first_id_independent_folder(folder):  # it holds %j, %t, ...
        try:
            folder.rmdir()
        except OSError:  # not there, or not empty: not a leftover
            pass


def _result(job: Any, idx: int) -> JobReturn:
    """Task 0's JobReturn (it holds global rank 0, which records the run). A task that
    died without a result (SIGKILL, out of memory, a node lost) makes submitit raise for
    the whole job; that job counts as failed and the sweep goes on to the next, as it
    does for a job that records its own failure."""
    from submitit.core.utils import UncompletedJobError

    try:
        job_return = job.results()[0]
        count_submitted_job(job_return)  # its on_job_end ran in task 0's process, not here
        return job_return
    except UncompletedJobError as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        log.error("job #%d failed: a task ended without a result (%s); see its run.json and "
                  "the logs in %s", idx, reason, job.paths.folder)
        try:  # what task 0 returned counts the job when its run.json does not (one it refused)
            count_submitted_job(job.task(0).result())
        except UncompletedJobError:
            pass  # task 0 left no result either: its run.json, if any, says what happened
        return JobReturn(overrides=None, status=JobStatus.COMPLETED, _return_value=None)


class _Stopped(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _StopSignals:
    """The first SIGINT/SIGTERM/SIGHUP raises `_Stopped`; later ones, while the job winds up, do
    nothing. A SIGHUP ignored at the start (nohup) stays ignored."""

    def __enter__(self) -> "_StopSignals":
        self.stopped = False
        self.saved = catch_stop_signals(self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        restore_signals(self.saved)

    @contextmanager
    def sigint_ignored(self) -> Iterator[None]:
        """SIGINT ignored in this block and in the processes started in it."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, self._handler)

    def _handler(self, signum: int, _frame: Any) -> None:
        if not self.stopped:
            self.stopped = True
            raise _Stopped(signum)


class DDPSlurmLauncher(_ShapedLauncher):
    """SLURM: one task per worker, shaped by distributed.num_nodes x distributed.num_gpus."""

    _EXECUTOR = "slurm"


class DDPLocalLauncher(_ShapedLauncher):
    """The same, as local processes (submitit's local executor): for trying it out and tests."""

    _EXECUTOR = "local"
