"""Optimizer registry: `optim=<name>` -> a builder taking parameters and the optim config."""

from __future__ import annotations

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


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """Per-step learning-rate schedule: cosine from cfg.lr to 0, or constant."""
    if cfg.schedule == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    if cfg.schedule == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total_steps))
    raise ConfigError(f"optim.schedule={cfg.schedule!r} is unknown; valid: cosine, constant")
