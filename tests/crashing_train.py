"""train.py with one extra model whose forward raises on one rank: a real bug in user code.

Spawned workers import this file as their main module, so the extra model exists in
them too. It shows how a model plugs into the registry, and lets tests crash one worker
of a real run. Environment: CRASH_RANK (default 1), CRASH_EPOCH (default 1; after the
first step of that epoch), CRASH_HOW=raise|multiline|sigkill|exit0|os_exit0|hang|stubborn
(multiline: raise with a message of two lines; exit0: sys.exit(0), a worker that leaves
early saying nothing is wrong; os_exit0: os._exit(0), the same without the SystemExit
exception that ddpscale can catch; hang: sleep in forward, a worker stuck for good that
still ends on a signal; stubborn: ignore SIGINT and SIGTERM and hang in forward, writing
its pid to CRASH_PID_FILE: a worker slow to stop). A run or sweep that returns with Python's
cycle collector still off exits 3: train.py turns it off for start-up only.
"""

import gc
import os
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(TESTS), str(TESTS.parent), str(TESTS.parent / "src")]  # crashing_model, train.py, ddpscale
# hydra/launcher=slurm_local's tasks unpickle the config store, whose schema names crashing_model
os.environ["PYTHONPATH"] = os.pathsep.join(
    filter(None, [str(TESTS), str(TESTS.parent), str(TESTS.parent / "src"), os.environ.get("PYTHONPATH")]))

import crashing_model  # noqa: E402,F401  (registers the model and its schema)
import train  # noqa: E402

if __name__ == "__main__":
    train.main()
    if not gc.isenabled():
        print("the cycle collector is still off after the run", file=sys.stderr)
        sys.exit(3)
