"""One worker's run, the body train.py hands to the launcher.

It lives in the package, not in train.py, so that spawned workers can import it by name
wherever the job process runs: under submitit, `__main__` is submitit's own module and a
function defined in train.py could not be found there. train.py names it
("ddpscale.worker:train") rather than importing it: it imports torch, which the job
process loads only once a run starts (ddpscale.launch).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from ddpscale.config import Config
from ddpscale.data import build_data
from ddpscale.distributed import device_names, wrap_ddp
from ddpscale.models import build_model
from ddpscale.optim import build_optimizer, build_scheduler, warmup_steps
from ddpscale.placement import WorkerContext
from ddpscale.results import Reporter, settings_row
from ddpscale.trainer import Diverged, Trainer, WrongLogits, build_precision


def train(ctx: WorkerContext, cfg: Config, out_dir: Path) -> dict:
    """One worker's run: build everything from the config, train, check the replicas agree."""
    torch.manual_seed(cfg.train.seed)  # the same initial weights and dropout on every rank
    data = build_data(cfg.data, ctx.rank, ctx.world_size, cfg.train.seed, ctx.device)
    model = build_model(cfg.model, cfg.data).to(ctx.device)
    if cfg.train.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if cfg.train.compile:
        model = torch.compile(model)
    ddp_model = wrap_ddp(model, ctx, cfg.distributed)
    optimizer = build_optimizer(ddp_model.parameters(), cfg.optim)
    steps_per_epoch = math.ceil(len(data.train) / cfg.train.grad_accum_steps)  # optimizer steps
    total_steps = cfg.train.epochs * steps_per_epoch
    trainer = Trainer(
        model=ddp_model,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg.optim, total_steps, steps_per_epoch),
        data=data,
        ctx=ctx,
        reporter=Reporter(ctx.is_main, out_dir, settings_row(cfg, ctx), cfg.train.epochs,
                          show_progress=cfg.train.progress),
        precision=build_precision(cfg.train.precision, ctx.device),
        grad_accum_steps=cfg.train.grad_accum_steps,
        channels_last=cfg.train.channels_last,
        sync_probe_steps=cfg.train.sync_probe_steps,
        num_classes=cfg.data.num_classes,
    )
    if cfg.optim.warmup_epochs:
        warmup = warmup_steps(cfg.optim, total_steps, steps_per_epoch)
        trainer.reporter.info("learning rate: linear warm-up to %g over %d optimizer steps (optim.warmup_epochs=%g), "
                              "then %s over %d", cfg.optim.lr, warmup, cfg.optim.warmup_epochs,
                              cfg.optim.schedule, total_steps - warmup)
    try:
        trainer.fit(cfg.train.epochs)
    except Diverged as err:  # the trainer never reads the config: the fix is named here
        raise Diverged(err.epoch, err.train_loss, _divergence_fix(cfg)) from None
    except WrongLogits as err:
        raise WrongLogits(err.got, err.batch, err.classes, (
            f"; model={cfg.model.name} must return one tensor with data.num_classes={cfg.data.num_classes} "
            f"outputs per example (data={cfg.data.name}): size its last layer from the data config "
            "its builder receives")) from None
    gathered = [None] * ctx.world_size  # every rank's (checksum, torch threads)
    dist.all_gather_object(gathered, (trainer.replica_checksum(), torch.get_num_threads()))
    checksums = [checksum for checksum, _ in gathered]
    return {"replica_checksums": checksums, "replicas_identical": len(set(checksums)) == 1,
            "threads_per_worker": [threads for _, threads in gathered],
            "devices": device_names(ctx.device), "grad_allreduce": ddp_model.grad_allreduce}


def _divergence_fix(cfg: Config) -> str:
    """What to try after training diverged: a smaller learning rate, the usual cause, then
    the places a learning rate cannot help (a forward pass making nan, half precision)."""
    precision = "" if cfg.train.precision == "fp32" else f", or train.precision=fp32 (it is {cfg.train.precision})"
    return (f"; usually the steps are too large: try a smaller optim.lr (it is {cfg.optim.lr:g}); if that "
            f"diverges too, look for a nan or inf made in model={cfg.model.name}'s forward (a log or a "
            f"division by 0){precision}")
