"""Optimizer and schedule registries: `optim=<name>` -> a builder taking parameters and the
optim config; `optim.schedule=<name>` -> the share of optim.lr along the run."""

from __future__ import annotations

import math
import numbers
from typing import Callable, Iterable

import torch

from ddpscale.config import AdamWConfig, ConfigError, OptimConfig, Registry, SGDConfig, built, registered


def _sgd(params: Iterable[torch.nn.Parameter], cfg: SGDConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov, weight_decay=cfg.weight_decay
    )


def _adamw(params: Iterable[torch.nn.Parameter], cfg: AdamWConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay
    )


OPTIMIZERS: dict[str, Callable] = Registry("optimizer", {"sgd": _sgd, "adamw": _adamw})


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer named by `cfg.name` over `params`."""
    optimizer = registered(OPTIMIZERS, "optim", cfg.name, "ddpscale.optim.OPTIMIZERS")(params, cfg)
    return built(optimizer, torch.optim.Optimizer, "a torch.optim.Optimizer", "optim", cfg.name,
                 "a builder(params, optim_cfg) that returns the optimizer over params")


def _cosine(progress: float) -> float:
    return 0.5 * (1 + math.cos(math.pi * progress))


def _constant(progress: float) -> float:
    return 1.0


# optim.schedule=<name> -> the share of optim.lr to train with, given the share of the
# steps after the warm-up done (0 at the first such step, 1 after the last).
SCHEDULES: dict[str, Callable[[float], float]] = Registry("schedule", {"cosine": _cosine, "constant": _constant})


def warmup_steps(cfg: OptimConfig, total_steps: int, steps_per_epoch: int) -> int:
    """Optimizer steps of linear warm-up: cfg.warmup_epochs of them, leaving at least one."""
    return min(round(cfg.warmup_epochs * steps_per_epoch), max(0, total_steps - 1))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int,
                    steps_per_epoch: int = 1) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-step learning-rate schedule: a linear warm-up over `cfg.warmup_epochs`, then
    SCHEDULES[cfg.schedule] (cosine from cfg.lr to 0, constant, or one of your own) over
    the steps left."""
    schedule = registered(SCHEDULES, "optim.schedule", cfg.schedule, "ddpscale.optim.SCHEDULES")
    for progress in (0.0, 0.5, 1.0):  # a plug-in's answer, checked before it sets a rate
        share = schedule(progress)
        if not isinstance(share, numbers.Real) or not math.isfinite(share) or share < 0:
            raise ConfigError(f"optim.schedule={cfg.schedule}'s function returned {share!r} for progress "
                              f"{progress}; it must return a finite number >= 0, the share of optim.lr")
    warmup = warmup_steps(cfg, total_steps, steps_per_epoch)
    decay_steps = max(1, total_steps - warmup)

    def factor(step: int) -> float:
        """The share of cfg.lr that optimizer step `step` (from 0) trains with."""
        if step < warmup:
            return (step + 1) / warmup
        return schedule(min(step - warmup, decay_steps) / decay_steps)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
