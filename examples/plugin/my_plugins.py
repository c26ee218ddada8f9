"""A model, a data set, an optimizer and a learning-rate schedule of your own: a registry
entry each, a YAML option for the first three, and a schema for the model's and the data
set's keys of their own.

Kept in a module of its own (not in the script) so that every process that needs the
entries imports it: spawned workers re-run the script's imports, and the tasks of
hydra/launcher=slurm import this module when they unpickle the config, which names its
schema classes (train_plugins.py puts this folder on PYTHONPATH for them).
"""

from dataclasses import dataclass

import torch
from hydra.core.config_store import ConfigStore
from torch import nn

from ddpscale.config import DataConfig, ModelConfig, OptimConfig
from ddpscale.data import DATASETS, Split
from ddpscale.models import MODELS
from ddpscale.optim import OPTIMIZERS, SCHEDULES


@dataclass
class MLPConfig(ModelConfig):
    """A multilayer perceptron on the flattened image."""

    name: str = "mlp"
    hidden: int = 256
    """Width of each hidden layer."""
    layers: int = 2
    """Hidden layers (>= 1)."""


def mlp(cfg: MLPConfig, data: DataConfig) -> nn.Module:
    width = data.channels * data.image_size ** 2
    body = []
    for _ in range(cfg.layers):
        body += [nn.Linear(width, cfg.hidden), nn.ReLU()]
        width = cfg.hidden
    return nn.Sequential(nn.Flatten(), *body, nn.Linear(width, data.num_classes))


@dataclass
class StripesConfig(DataConfig):
    """DataConfig's keys plus the stripes' own. (A schema of its own also makes the tasks
    of hydra/launcher=slurm import this module: the pickled config names the class.)"""

    frequency: float = 0.8
    """Radians per pixel across the stripes."""


def stripes(cfg: StripesConfig, train: bool) -> Split:
    """Horizontal or vertical stripes at a random phase, with noise: a two-class set."""
    n = (cfg.train_size if train else cfg.val_size) or (4096 if train else 1024)
    g = torch.Generator().manual_seed(cfg.seed + (0 if train else 1))  # the same on every rank
    labels = torch.randint(2, (n,), generator=g)
    phase = torch.rand(n, 1, generator=g) * 6.28
    axis = torch.arange(cfg.image_size, dtype=torch.float32)
    wave = torch.sin(axis * cfg.frequency + phase)  # (n, size)
    images = torch.where(labels[:, None, None] == 0, wave[:, :, None], wave[:, None, :])
    images = images.expand(n, cfg.image_size, cfg.image_size).unsqueeze(1).repeat(1, cfg.channels, 1, 1)
    return Split(images + cfg.noise * torch.randn(images.shape, generator=g), labels)


def rmsprop(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """RMSprop with torch's defaults but for the keys every optimizer has: its YAML option
    starts from /schema/optim/optim, with no schema class of its own."""
    return torch.optim.RMSprop(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def linear(progress: float) -> float:
    """A learning rate falling in a straight line from optim.lr to 0 (progress: the share
    of the steps after the warm-up done)."""
    return 1.0 - progress


ConfigStore.instance().store(group="schema/model", name="mlp", node=MLPConfig)
ConfigStore.instance().store(group="schema/data", name="stripes", node=StripesConfig)
MODELS["mlp"] = mlp
DATASETS["stripes"] = stripes
OPTIMIZERS["rmsprop"] = rmsprop
SCHEDULES["linear"] = linear
