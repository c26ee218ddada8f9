"""The model of tests/crashing_train.py: the default CNN, failing on purpose on one rank.

A module of its own, with a schema class of its own, as a plug-in should be: the tasks of
hydra/launcher=slurm_local unpickle the job's config store, whose CrashingCNNConfig names
this module, so they import it and find the model (`model=crashing_cnn`). Spawned workers
re-run crashing_train.py's imports. `model.name=crashing_cnn` works too, but not under
slurm_local. `model.name=short_cnn` and `unused_layer_cnn` are slips a plug-in makes: a CNN
with one class too few, one with a layer it never calls. `model.name=collecting_cnn` fails
if Python's cycle collector is off while it trains. `data.name=tuple_in_workers` is the
synthetic data set, but its loader returns a tuple in a worker (once the process group is
up), where the job process had found it sound: a ConfigError raised in a worker.
"""

import dataclasses
import gc
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from hydra.core.config_store import ConfigStore
from torch import nn

from ddpscale.config import CNNConfig, DataConfig
from ddpscale.data import DATASETS
from ddpscale.models import CNN, MODELS


@dataclass
class CrashingCNNConfig(CNNConfig):
    name: str = "crashing_cnn"


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
            if how == "hang":
                time.sleep(3600)
            if how == "stubborn":
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                Path(os.environ["CRASH_PID_FILE"]).write_text(str(os.getpid()))
                time.sleep(3600)
            if how == "multiline":  # as DDP's errors are, a remark on the last line
                raise RuntimeError(f"injected failure on rank {rank}\nsee the lines above")
            raise RuntimeError(f"injected failure on rank {rank}")
        return super().forward(x)


def cnn_short_of_a_class(cfg: CNNConfig, data: DataConfig) -> CNN:
    """A plug-in author's slip: the CNN built for one class fewer than the data set has
    (`model.name=short_cnn`)."""
    return CNN(cfg, dataclasses.replace(data, num_classes=data.num_classes - 1))


class CNNWithAnUnusedLayer(CNN):
    """Another slip: a layer built and never called (`model.name=unused_layer_cnn`)."""

    def __init__(self, cfg: CNNConfig, data: DataConfig):
        super().__init__(cfg, data)
        self.spare = nn.Linear(4, 4)


class CollectorCheckingCNN(CNN):
    """The default CNN, failing if the cycle collector is off while it trains: train.py turns
    it off for start-up, and a worker that never turned it back on would keep every reference
    cycle of a long run (`model.name=collecting_cnn`)."""

    def forward(self, x):
        if self.training and not gc.isenabled():
            raise RuntimeError(f"rank {dist.get_rank()}: the cycle collector is off while training")
        return super().forward(x)


def synthetic_but_a_tuple_in_workers(cfg: DataConfig, train: bool):
    """`data.name=tuple_in_workers`: see the module's docstring."""
    split = DATASETS["synthetic"](cfg, train)
    return (split.images, split.labels) if dist.is_initialized() else split


MODELS["crashing_cnn"] = CrashingCNN
MODELS["collecting_cnn"] = CollectorCheckingCNN
MODELS["unused_layer_cnn"] = CNNWithAnUnusedLayer
MODELS["short_cnn"] = cnn_short_of_a_class
DATASETS["tuple_in_workers"] = synthetic_but_a_tuple_in_workers
ConfigStore.instance().store(group="model", name="crashing_cnn", node=CrashingCNNConfig)
