"""ddpscale entry point: one Hydra job -> N data-parallel workers -> results.csv.

    python train.py distributed.num_gpus=2 optim.lr=0.05
    python train.py distributed.num_gpus=1,2,4 optim.lr=0.01,0.1 -m
"""

from __future__ import annotations

import gc

# Start-up makes about 300,000 long-lived objects (torch, Hydra, the composed config), and
# every full collection on the way rescans all of them: about 0.4 s of every worker's start
# and 0.1 s of the job process's. Collection resumes, with these objects frozen out of it,
# once the run starts (ddpscale.launch.resume_collector).
gc.disable()

import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


def _stop_quietly(signum, frame):
    """Ctrl-C while no run is in progress (the imports, Hydra composing the config,
    between a sweep's runs) ends the process with one line, not a KeyboardInterrupt
    traceback. Not through an exception: torch's C import swallows one and carries on."""
    if __name__ == "__main__":  # a spawned worker re-importing this file leaves silently
        print("interrupted; no run was in progress", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signum)


# While a run is in progress, run_job stops it. SIGHUP (the terminal closed) too, unless it
# is ignored (nohup), which the job and its workers keep.
_HANGUP = getattr(signal, "SIGHUP", None)
if _HANGUP is not None and signal.getsignal(_HANGUP) is signal.SIG_IGN:
    _HANGUP = None
signal.signal(signal.SIGINT, _stop_quietly)
if _HANGUP is not None:
    signal.signal(_HANGUP, _stop_quietly)

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.types import RunMode  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))  # run from a checkout, too

import ddpscale.config  # noqa: E402,F401  (importing it registers the schema)
from ddpscale.launch import run_job  # noqa: E402
from ddpscale.placement import (  # noqa: E402
    SPAWN, detect_launcher, exit_finished_worker, launch_environment_problem,
)
from ddpscale.sweep import command_line_problem, register_resolvers  # noqa: E402

# The workers' body, by name: run_job imports it (and torch, 1.5 s) once a run starts, so that
# a config it refuses is answered without torch.
WORKER = "ddpscale.worker:train"

if __name__ != "__main__":  # a spawned worker: its run's own handling from here on
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if _HANGUP is not None:
        signal.signal(_HANGUP, signal.SIG_DFL)

register_resolvers(sys.argv[1:])  # --cfg only prints: it creates no output directory
# Before Hydra reads the environment for the output directory, or answers with a usage dump.
_problem = launch_environment_problem() or command_line_problem(sys.argv[1:])
if _problem:
    print(f"error: {_problem}", file=sys.stderr)
    sys.exit(2)


@hydra.main(version_base=None, config_path=str(Path(__file__).resolve().parent / "conf"),
            config_name="config")
def main(cfg: DictConfig):
    """Validate the composed config, run the workers, report how it ended."""
    hydra_cfg = HydraConfig.get()
    outcome = run_job(cfg, WORKER, Path(hydra_cfg.runtime.output_dir), list(hydra_cfg.overrides.task))
    if not outcome.ok and hydra_cfg.mode == RunMode.RUN:
        sys.exit(outcome.exit_code)
    return outcome  # in a sweep, a failed run is counted at the end, not fatal


if __name__ == "__main__":
    main()  # a failed run leaves through sys.exit inside, with its exit code
    if detect_launcher() != SPAWN:
        exit_finished_worker()  # under torchrun/srun this process was a worker; see its docstring
