"""Output directories and the end-of-sweep summary (Hydra resolver and callbacks).

Imported by train.py before Hydra composes anything, so that `${ddpscale_dir:...}` in
conf/config.yaml resolves. Neither touches torch.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from ddpscale.choices import CONF_DIR
from ddpscale.config import unknown_override_keys
from ddpscale.results import RESULTS_FILE, RUN_FILE, earlier_run, taken_message

log = logging.getLogger("ddpscale")


def claim_dir(base: str, create: bool = True) -> str:
    """A directory nobody else uses: `base`, else `base_1`, `base_2`, ... (atomic mkdir).

    Two sweeps started in the same second get different directories. Under torchrun or
    SLURM only global rank 0 claims one; the other ranks get a throwaway directory and
    adopt rank 0's once the process group is up. With `create` false, only the name.
    """
    from ddpscale.placement import SPAWN, detect_launcher, launched_placement

    launcher = detect_launcher()
    if launcher != SPAWN and not launched_placement(launcher).is_main:
        rank = launched_placement(launcher).rank
        return tempfile.mkdtemp(prefix=f"ddpscale-rank{rank}-")
    path = Path(base)
    for i in range(10_000):
        candidate = path if i == 0 else path.with_name(f"{path.name}_{i}")
        if not create:
            if not candidate.exists():
                return str(candidate)
            continue
        try:
            candidate.mkdir(parents=True, exist_ok=False)
            return str(candidate)
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a fresh directory next to {base}")


def register_resolvers(argv: list[str] | None = None) -> None:
    """Register `${ddpscale_dir:...}` (cached, so one config resolves it once) and
    `${ddpscale_groups:}` (the config groups --help lists).

    Given the command line, a command that only prints the config (`--cfg hydra
    --resolve` resolves the output directories too) is shown their names but creates none.
    """
    if not OmegaConf.has_resolver("ddpscale_dir"):
        create = _prints_only(argv or []) is None
        OmegaConf.register_new_resolver(
            "ddpscale_dir", lambda base: claim_dir(base, create), use_cache=True)
    if not OmegaConf.has_resolver("ddpscale_groups"):
        OmegaConf.register_new_resolver("ddpscale_groups", user_config_groups)


def user_config_groups(searchpath: Any = ()) -> str:
    """The config groups users choose from, with their options, as Hydra's --help lists them
    ($APP_CONFIG_GROUPS), less ddpscale's schema/* groups: what conf/'s options build on.
    Hydra's list left out the options of a hydra.searchpath given on the command line
    (examples/plugin's model=mlp)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    if not GlobalHydra.instance().is_initialized():  # a config composed without @hydra.main
        return ""
    loader = GlobalHydra.instance().hydra.config_loader
    overrides = [f"hydra.searchpath=[{','.join(searchpath)}]"] if searchpath else []

    def listed(group: str, kind: ObjectType) -> list[str]:
        return sorted(loader.get_group_options(group, kind, config_name=None, overrides=overrides))

    def groups(parent: str) -> list[str]:
        found = []
        for name in listed(parent, ObjectType.GROUP):
            group = f"{parent}/{name}" if parent else name
            if group in ("hydra", "schema"):
                continue
            if listed(group, ObjectType.CONFIG):
                found.append(group)
            found += groups(group)
        return found

    return "".join(f"{group}: {', '.join(listed(group, ObjectType.CONFIG))}\n" for group in groups(""))


def _prints_only(argv: list[str]) -> str | None:
    """The --cfg of a command line (job, hydra, all), read as Hydra reads it (-chydra, --cf)."""
    parsed = _hydra_args(argv)
    return parsed[0].cfg if parsed else None


def command_line_problem(argv: list[str]) -> str | None:
    """What is wrong with a command line that Hydra would answer with a usage dump and
    "unrecognized arguments", a traceback, or advice that fails next (an override of a key
    no option has: "use +key=..."), as one line naming the fix."""
    parsed = _hydra_args(argv)
    if parsed is None:
        return None  # --help, --version or a bad option: Hydra answers it itself
    args, unknown = parsed
    stray = [word for word in unknown if not word.startswith("-")]
    if stray and len(stray) == len(unknown):  # an unknown flag among them: Hydra names it
        return (f"{' '.join(stray)}: a flag (-m, --cfg ...) stands between these overrides and the "
                "others, and Hydra reads the overrides as one run of words: put every flag before "
                "all of them or after all of them (python train.py -m a=1 b=2, or a=1 b=2 -m)")
    if args.cfg and args.multirun:
        return (f"--cfg {args.cfg} shows one job's config and Hydra cannot combine it with -m; "
                "drop -m (and any comma-separated sweep values) to see the composed config")
    # Another primary config: Hydra answers. A spawned worker's command line was its job's, checked there.
    other = args.config_name or args.config_path or args.config_dir or multiprocessing.parent_process()
    conf_dir = None if other else CONF_DIR
    return "; ".join(unknown_override_keys(args.overrides, conf_dir)) or None


def _hydra_args(argv: list[str]) -> tuple[Any, list[str]] | None:
    """The command line parsed by the parser @hydra.main uses: (flags, words it did not take)."""
    from hydra._internal.utils import get_args_parser

    quiet = io.StringIO()  # --version, --help or a bad option: Hydra prints it, once
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
            return get_args_parser().parse_known_args(argv)
    except SystemExit:
        return None


def sweep_statuses(sweep_dir: Path, since: float = 0.0) -> tuple[list[dict[str, Any]], int]:
    """status, error and overrides of every run.json below a sweep directory written at
    or after `since` (seconds since the epoch), and how many older ones were passed over."""
    rows, older = [], 0
    for path in sorted(sweep_dir.rglob("run.json")):
        try:
            if path.stat().st_mtime < since:
                older += 1
                continue
            record = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            record = {"status": "unreadable", "error": str(err)}
        rows.append({"dir": str(path.parent), "status": record.get("status"),
                     "error": record.get("error"), "overrides": record.get("overrides", [])})
    return rows, older


class FreshOutputDir(Callback):
    """Refuse to start in an explicit hydra.run.dir or hydra.sweep.dir that already holds
    a run, before Hydra writes anything there: a second run would append its rows to the
    first's results.csv and replace its .hydra/ files. The default directories are
    claimed fresh (`claim_dir`) and need no check. Exits 2 with the fix."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        refuse_a_grid_without_multirun(config)
        refuse_a_launcher_without_multirun(config)
        refuse_an_uncreatable_dir(config, "run")
        refuse_a_used_dir(config, "run")

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        refuse_a_sweep_in_every_worker(config)
        refuse_a_shared_subdir(config)
        refuse_an_uncreatable_dir(config, "sweep")
        refuse_a_used_dir(config, "sweep")


def refuse_a_grid_without_multirun(config: DictConfig) -> None:
    """Exit 2 for a config that holds a sweep grid (an experiment's hydra.sweeper.params)
    run without -m: Hydra would quietly run one job with none of the grid's values."""
    grid = _grid(config)
    if grid:
        print("error: this config holds a sweep grid (hydra.sweeper.params: "
              f"{', '.join(grid)}), which only -m runs; add -m, or leave out the experiment for a "
              "single run (nothing was started)", file=sys.stderr)
        sys.exit(2)


def refuse_a_launcher_without_multirun(config: DictConfig) -> None:
    """Exit 2 for hydra/launcher=slurm (or slurm_local) without -m: Hydra uses a launcher only
    for a sweep, so the run trained here, on a login node, saying nothing."""
    target = str(OmegaConf.select(config, "hydra.launcher._target_") or "")
    if "ddpscale_launcher" in target:
        name = "slurm_local" if target.endswith("DDPLocalLauncher") else "slurm"
        print(f"error: hydra/launcher={name} submits the jobs of a sweep, which only -m runs; add -m "
              "(one run is a sweep of one job), or leave out hydra/launcher to run here (nothing "
              "was started)", file=sys.stderr)
        sys.exit(2)


def _grid(config: DictConfig) -> list[str]:
    """An experiment's sweep grid (hydra.sweeper.params) as override lines, key=values."""
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    return [f"{key}={value}" for key, value in params.items()]


def refuse_a_sweep_in_every_worker(config: DictConfig) -> None:
    """Exit 2 for `-m` in a process that torchrun or srun started as one worker: every
    worker would run the whole sweep on its own, and a job that fails on one rank leaves
    the others waiting for it in the next job."""
    from ddpscale.placement import SPAWN, detect_launcher, launched_placement

    launcher = detect_launcher()
    target = str(OmegaConf.select(config, "hydra.launcher._target_", default=""))
    if launcher == SPAWN or not target.endswith("BasicLauncher"):
        return  # the sweep runs here and starts the workers, or submitit starts each job's tasks
    if not launched_placement(launcher).is_main:
        time.sleep(2)  # said once, by global rank 0: torchrun would stop it once one rank exits
        sys.exit(2)
    starter = "torchrun" if launcher == "torchrun" else "srun"
    print(f"error: -m under {starter}: each process {starter} starts is one worker of one run, and "
          "would run the whole sweep by itself; sweep from one plain process instead "
          "(python train.py ... -m starts every job's workers; hydra/launcher=slurm submits "
          f"each job to SLURM), or start {starter} once per run (nothing was started)",
          file=sys.stderr)
    sys.exit(2)


def refuse_a_shared_subdir(config: DictConfig) -> None:
    """Exit 2 if hydra.sweep.subdir is one fixed name and the sweep has several jobs: each
    job would write into the first's directory (Hydra replaces its .hydra/ files before
    any check of ours could run; launch then refuses every job after the first)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    subdir = OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir")
    if subdir is None or "${" in str(subdir):
        return
    lines = [*config.hydra.overrides.task, *_grid(config)]
    swept = [o for o in OverridesParser.create().parse_overrides(lines) if o.is_sweep_override()]
    if math.prod(_values(o) for o in swept) > 1:
        print(f"error: hydra.sweep.subdir={subdir} names one directory for every job of this sweep "
              f"({', '.join(o.input_line for o in swept)}); leave it unset (${{hydra.job.num}}: "
              "0, 1, ...) or put ${hydra.job.num} in it (nothing was started)", file=sys.stderr)
        sys.exit(2)


def _values(override: Any) -> int:
    """How many values a sweep override takes (2 stands for a glob: its options are unknown here)."""
    try:
        return len(list(override.sweep_string_iterator()))
    except Exception:  # noqa: BLE001 - hydra raises its own exception type for glob()
        return 2


def refuse_an_uncreatable_dir(config: DictConfig, mode: str) -> None:
    """Exit 2 if hydra.<mode>.dir cannot be made a directory (a file in the way, no
    permission): Hydra's own mkdir ends in a traceback."""
    try:
        directory = Path(str(OmegaConf.select(config, f"hydra.{mode}.dir")))
        directory.mkdir(parents=True, exist_ok=True)
    except (OSError, InterpolationResolutionError) as err:
        while not isinstance(err, OSError) and (err.__cause__ or err.__context__):
            err = err.__cause__ or err.__context__  # the mkdir's own error, under omegaconf's
        print(f"error: hydra.{mode}.dir cannot be created: {err}; give hydra.{mode}.dir a directory "
              "you can write to, or run from one (nothing was started)", file=sys.stderr)
        sys.exit(2)


def refuse_a_used_dir(config: DictConfig, mode: str) -> None:
    """Exit 2 if hydra.<mode>.dir was given explicitly and holds run files (any depth for a sweep)."""
    from ddpscale.launch import node_id
    from ddpscale.placement import holds_global_rank0

    raw = OmegaConf.to_container(config.hydra[mode], resolve=False)["dir"]
    if "${ddpscale_dir:" in str(raw) or not holds_global_rank0(node_id(config)):
        return  # a fresh directory by construction, or a process that writes no run files
    directory = Path(str(OmegaConf.select(config, f"hydra.{mode}.dir")))
    if mode == "run":
        found = earlier_run(directory)
    else:
        runs = {p.parent for name in (RESULTS_FILE, RUN_FILE) for p in directory.rglob(name)}
        found = [str((run / name).relative_to(directory)) for run in sorted(runs) for name in earlier_run(run)]
    if found:
        shown = found[:3] + ([f"{len(found) - 3} more"] if len(found) > 3 else [])
        default = "outputs" if mode == "run" else "multirun"
        print("error: " + taken_message(
            f"hydra.{mode}.dir={directory}", shown,
            f"give hydra.{mode}.dir a new directory, or leave it unset for a fresh "
            f"{default}/<date>/<time>"), file=sys.stderr)
        sys.exit(2)


SWEEP_JOBS = "sweep_jobs.json"  # multirun_analysis reads it by this name


def write_sweep_jobs(config: DictConfig) -> None:
    """<sweep dir>/sweep_jobs.json: every job's overrides, as the basic sweeper splits the grid.
    A sweep stopped early (Ctrl-C, a hangup, a crash) leaves no trace of the jobs it never
    started; with this list the analysis names them (each run.json holds its job's overrides)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not str(OmegaConf.select(config, "hydra.sweeper._target_", default="")).endswith("BasicSweeper"):
        return
    try:
        lines = [*_grid(config), *config.hydra.overrides.task]  # in BasicSweeper.sweep's order
        batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(lines), None)
        jobs = [list(job) for batch in batches for job in batch]
        (Path(str(config.hydra.sweep.dir)) / SWEEP_JOBS).write_text(json.dumps({"jobs": jobs}, indent=1))
    except Exception as err:  # noqa: BLE001 - a glob() over options, a full disk: the sweep runs anyway
        log.info("notice: %s not written (%s); an analysis cannot name jobs this sweep never runs",
                 SWEEP_JOBS, err)


# The jobs that hydra/launcher=slurm or slurm_local ran, as task 0 returned them: their
# on_job_end ran in that task's process, so the sweep's SweepSummary never saw them.
_SUBMITTED: list[JobReturn] = []


def count_submitted_job(job_return: JobReturn) -> None:
    """Hand a job that a submitit launcher ran elsewhere (task 0's JobReturn) to SweepSummary."""
    _SUBMITTED.append(job_return)


def _unrecorded(job_return: JobReturn) -> dict[str, Any] | None:
    """A job's row for the summary when its run.json does not count it, else None."""
    out_dir = Path(job_return.hydra_cfg.hydra.runtime.output_dir)
    outcome = job_return.return_value if job_return.status == JobStatus.COMPLETED else None
    if (out_dir / RUN_FILE).exists() and getattr(outcome, "recorded", True):
        return None  # counted from its run.json (unless that is another job's: recorded=False)
    if outcome is not None:  # launch.Outcome
        status, error = getattr(outcome, "status", "completed"), getattr(outcome, "error", None)
    else:
        # the exception it raised (the public return_value would re-raise it)
        status, error = "failed", str(job_return._return_value)
    return {"dir": str(out_dir), "status": status, "error": error,
            "overrides": list(job_return.overrides or [])}


class SweepSummary(Callback):
    """At the end of a multirun: list the jobs that did not complete; exit 1 if any.

    Runs are counted from their run.json, which only the process holding global rank 0
    writes; a job that left none, or only another job's (two jobs given one directory),
    is counted from what it returned: here, or under the submitit launchers from what
    their task 0 returned (count_submitted_job).
    """

    def __init__(self) -> None:
        self.unrecorded: list[dict[str, Any]] = []

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _SUBMITTED.clear()  # an earlier sweep in this process that stopped before its end
        write_sweep_jobs(config)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        row = _unrecorded(job_return)
        if row is not None:
            self.unrecorded.append(row)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        # A sweep directory may hold an earlier sweep's failed runs (it may be reused then):
        # this sweep's run.json files are those written since Hydra wrote its multirun.yaml,
        # both stamped by the same file system's clock.
        marker = sweep_dir / "multirun.yaml"
        rows, older = sweep_statuses(sweep_dir, since=marker.stat().st_mtime if marker.exists() else 0.0)
        rows += self.unrecorded + [row for row in map(_unrecorded, _SUBMITTED) if row is not None]
        _SUBMITTED.clear()
        bad = [r for r in rows if r["status"] != "completed"]
        log.info("sweep %s: %d run(s), %d completed%s", sweep_dir, len(rows), len(rows) - len(bad),
                 f" ({older} older run(s) in this directory not counted)" if older else "")
        for r in bad:
            log.error("  %s  %s  %s: %s", r["status"], " ".join(r["overrides"]), r["dir"], r["error"])
        if bad:
            log.error("%d of %d run(s) did not complete; the others' results are intact",
                      len(bad), len(rows))
            sys.exit(1)
