"""ddpscale entry point: one Hydra job -> N data-parallel workers -> results.csv.

    python train.py distributed.num_gpus=2 optim.lr=0.05
    python train.py distributed.num_gpus=1,2,4 optim.lr=0.01,0.1 -m
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))  # run from a checkout, too

from ddpscale.config import Config  # noqa: E402  (importing it registers the schema)
from ddpscale.data import build_data  # noqa: E402
from ddpscale.distributed import (  # noqa: E402
    SPAWN, WorkerContext, detect_launcher, device_names, exit_finished_worker, wrap_ddp,
)
from ddpscale.launch import run_job  # noqa: E402
from ddpscale.models import build_model  # noqa: E402
from ddpscale.optim import build_optimizer, build_scheduler  # noqa: E402
from ddpscale.results import Reporter, settings_row  # noqa: E402
from ddpscale.sweep import register_resolvers  # noqa: E402
from ddpscale.trainer import Trainer, build_precision  # noqa: E402

register_resolvers()


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
    steps = cfg.train.epochs * math.ceil(len(data.train) / cfg.train.grad_accum_steps)
    trainer = Trainer(
        model=ddp_model,
        optimizer=optimizer,
        scheduler=build_scheduler(optimizer, cfg.optim, total_steps=steps),
        data=data,
        ctx=ctx,
        reporter=Reporter(ctx.is_main, out_dir, settings_row(cfg, ctx), cfg.train.epochs,
                          show_progress=cfg.train.progress),
        precision=build_precision(cfg.train.precision, ctx.device),
        grad_accum_steps=cfg.train.grad_accum_steps,
        channels_last=cfg.train.channels_last,
        sync_probe_steps=cfg.train.sync_probe_steps,
    )
    trainer.fit(cfg.train.epochs)
    checksums = [None] * ctx.world_size
    dist.all_gather_object(checksums, trainer.replica_checksum())
    return {"replica_checksums": checksums, "replicas_identical": len(set(checksums)) == 1,
            "devices": device_names(ctx.device), "grad_allreduce": ddp_model.grad_allreduce}


@hydra.main(version_base=None, config_path=str(Path(__file__).resolve().parent / "conf"),
            config_name="config")
def main(cfg: DictConfig):
    """Validate the composed config, run the workers, report how it ended."""
    hydra_cfg = HydraConfig.get()
    outcome = run_job(cfg, train, Path(hydra_cfg.runtime.output_dir), list(hydra_cfg.overrides.task))
    if not outcome.ok and hydra_cfg.mode == RunMode.RUN:
        sys.exit(outcome.exit_code)
    return outcome  # in a sweep, a failed run is counted at the end, not fatal


if __name__ == "__main__":
    main()  # a failed run leaves through sys.exit inside, with its exit code
    if detect_launcher() != SPAWN:
        exit_finished_worker()  # under torchrun/srun this process was a worker; see its docstring
