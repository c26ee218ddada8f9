"""train.py with one extra model whose forward raises on one rank: a real bug in user code.

Spawned workers import this file as their main module, so the extra model exists in
them too. It shows how a model plugs into the registry, and lets tests crash one worker
of a real run. Environment: CRASH_RANK (default 1), CRASH_EPOCH (default 1; after the
first step of that epoch), CRASH_HOW=raise|sigkill|exit0|os_exit0|stubborn (exit0: sys.exit(0),
a worker that leaves early saying nothing is wrong; os_exit0: os._exit(0), the same without
the SystemExit exception that ddpscale can catch; stubborn: ignore SIGINT and SIGTERM and
hang in forward, writing its pid to CRASH_PID_FILE: a worker slow to stop).
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.distributed as dist  # noqa: E402

import train  # noqa: E402
from ddpscale.models import CNN, MODELS  # noqa: E402


class CrashingCNN(CNN):
    """The default CNN, except that it fails on CRASH_RANK in CRASH_EPOCH."""

    steps = 0

    def forward(self, x):
        CrashingCNN.steps += 1 if self.training else 0
        rank, epoch = int(os.environ.get("CRASH_RANK", "1")), int(os.environ.get("CRASH_EPOCH", "1"))
        steps_per_epoch = int(os.environ.get("CRASH_STEPS_PER_EPOCH", "1"))
        if dist.get_rank() == rank and CrashingCNN.steps > (epoch - 1) * steps_per_epoch + 1:
            how = os.environ.get("CRASH_HOW", "raise")
            if how == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "exit0":
                sys.exit(0)
            if how == "os_exit0":
                os._exit(0)
            if how == "stubborn":
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                Path(os.environ["CRASH_PID_FILE"]).write_text(str(os.getpid()))
                time.sleep(3600)
            raise RuntimeError(f"injected failure on rank {rank}")
        return super().forward(x)


MODELS["crashing_cnn"] = CrashingCNN

if __name__ == "__main__":
    train.main()
