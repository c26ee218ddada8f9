"""Output directories and the end-of-sweep summary (Hydra resolver and callback).

Imported by train.py before Hydra composes anything, so that `${ddpscale_dir:...}` in
conf/config.yaml resolves. Neither touches torch.
"""

from __future__ import annotations

import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("ddpscale")


def claim_dir(base: str) -> str:
    """A directory nobody else uses: `base`, else `base_1`, `base_2`, ... (atomic mkdir).

    Two sweeps started in the same second get different directories. Under torchrun or
    SLURM only global rank 0 claims one; the other ranks get a throwaway directory and
    adopt rank 0's once the process group is up.
    """
    from ddpscale.distributed import SPAWN, detect_launcher, launched_placement

    launcher = detect_launcher()
    if launcher != SPAWN and not launched_placement(launcher).is_main:
        rank = launched_placement(launcher).rank
        return tempfile.mkdtemp(prefix=f"ddpscale-rank{rank}-")
    path = Path(base)
    for i in range(10_000):
        candidate = path if i == 0 else path.with_name(f"{path.name}_{i}")
        try:
            candidate.mkdir(parents=True, exist_ok=False)
            return str(candidate)
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a fresh directory next to {base}")


def register_resolvers() -> None:
    """Register `${ddpscale_dir:...}` (cached, so one config resolves it once)."""
    if not OmegaConf.has_resolver("ddpscale_dir"):
        OmegaConf.register_new_resolver("ddpscale_dir", claim_dir, use_cache=True)


def sweep_statuses(sweep_dir: Path) -> list[dict[str, Any]]:
    """status, error and overrides of every run.json below a sweep directory."""
    rows = []
    for path in sorted(sweep_dir.rglob("run.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            record = {"status": "unreadable", "error": str(err)}
        rows.append({"dir": str(path.parent), "status": record.get("status"),
                     "error": record.get("error"), "overrides": record.get("overrides", [])})
    return rows


class SweepSummary(Callback):
    """At the end of a multirun: list the jobs that did not complete; exit 1 if any.

    Runs are counted from their run.json, which only the process holding global rank 0
    writes; a job of this process that left none (on a node other than 0 of a
    multi-node run) is counted from what it returned.
    """

    def __init__(self) -> None:
        self.unrecorded: list[dict[str, Any]] = []

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        out_dir = Path(job_return.hydra_cfg.hydra.runtime.output_dir)
        if (out_dir / "run.json").exists():
            return
        if job_return.status == JobStatus.COMPLETED:
            outcome = job_return.return_value  # launch.Outcome
            status, error = getattr(outcome, "status", "completed"), getattr(outcome, "error", None)
        else:
            status, error = "failed", str(job_return._return_value)  # the exception it raised
        self.unrecorded.append({"dir": str(out_dir), "status": status, "error": error,
                                "overrides": list(job_return.overrides or [])})

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = sweep_statuses(sweep_dir) + self.unrecorded
        bad = [r for r in rows if r["status"] != "completed"]
        log.info("sweep %s: %d run(s), %d completed", sweep_dir, len(rows), len(rows) - len(bad))
        for r in bad:
            log.error("  %s  %s  %s: %s", r["status"], " ".join(r["overrides"]), r["dir"], r["error"])
        if bad:
            log.error("%d of %d run(s) did not complete; the others' results are intact",
                      len(bad), len(rows))
            sys.exit(1)
