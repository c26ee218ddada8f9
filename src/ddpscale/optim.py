"""Optimizer registry: `optim=<name>` -> a builder taking parameters and the optim config."""

from __future__ import annotations

import math
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


def warmup_steps(cfg: OptimConfig, total_steps: int, steps_per_epoch: int) -> int:
    """Optimizer steps of linear warm-up: cfg.warmup_epochs of them, leaving at least one."""
    return min(round(cfg.warmup_epochs * steps_per_epoch), max(0, total_steps - 1))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int,
                    steps_per_epoch: int = 1) -> torch.optim.lr_scheduler.LambdaLR:
    """Per-step learning-rate schedule: a linear warm-up over `cfg.warmup_epochs`, then
    cosine from cfg.lr to 0, or constant, over the steps left."""
    if cfg.schedule not in ("cosine", "constant"):
        raise ConfigError(f"optim.schedule={cfg.schedule!r} is unknown; valid: cosine, constant")
    warmup = warmup_steps(cfg, total_steps, steps_per_epoch)
    decay_steps = max(1, total_steps - warmup)

    def factor(step: int) -> float:
        """The share of cfg.lr that optimizer step `step` (from 0) trains with."""
        if step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "constant":
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * min(step - warmup, decay_steps) / decay_steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
