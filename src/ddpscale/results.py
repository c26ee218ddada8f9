"""What a run leaves behind: results.csv (rank 0, one row per epoch) and run.json.

`Reporter` is the one mechanism for rank-0 side effects: the progress bar, log lines and
results rows go through it, and on every other rank it does nothing.
"""

from __future__ import annotations

import ast
import contextlib
import csv
import importlib.util
import json
import logging
import os
import platform
import socket
import subprocess
import sys
import threading
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator

log = logging.getLogger("ddpscale")

RESULTS_FILE, RUN_FILE = "results.csv", "run.json"
_HERE = Path(__file__).resolve().parent  # inside the checkout, when ddpscale runs from one

# DESIGN.md's contract: these columns exist in this order; more may follow, none renamed.
REQUIRED_COLUMNS = [
    "model", "dataset", "optimizer", "num_nodes", "num_gpus", "world_size", "backend", "device",
    "batch_size", "global_batch_size", "lr", "seed", "epochs",
    "epoch", "train_loss", "train_acc", "val_loss", "val_acc",
    "epoch_time_s", "elapsed_s", "images_per_sec",
]
EXTRA_COLUMNS = [
    "warmup", "step_time_p50_s", "step_time_p90_s", "grad_sync_share", "eval_time_s",
    "train_count", "val_count", "launcher", "precision", "data_loader", "grad_accum_steps",
    "comm_hook", "channels_last", "compile", "bucket_cap_mb", "gradient_as_bucket_view",
    "static_graph",
]
COLUMNS = REQUIRED_COLUMNS + EXTRA_COLUMNS


def earlier_run(directory: Path) -> list[str]:
    """The files that show another run owns `directory`: results, or the run.json of a run
    still running or finished. A run that failed or was interrupted before any epoch
    ended leaves only its record (a typo's, say), which the next run may replace."""
    directory = Path(directory)
    present = [name for name in (RESULTS_FILE, RUN_FILE) if (directory / name).exists()]
    if present == [RUN_FILE] and RunRecord(directory).read().get("status") in ("failed", "interrupted"):
        return []
    return present


def taken_message(where: str, found: list[str], fix: str) -> str:
    """Why a run refused to start in a directory that holds another run, and the fix."""
    return (f"{where} already holds run files ({', '.join(found)}); ddpscale never appends to "
            f"or overwrites one, so nothing was started. Fix: {fix}")


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class ResultsWriter:
    """Appends one row per epoch and flushes it to disk, so a crash keeps finished epochs."""

    def __init__(self, path: Path):
        self.path = path

    def append(self, row: dict[str, Any]) -> None:
        new = not self.path.exists() or self.path.stat().st_size == 0
        with _naming(self.path), self.path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="raise")
            if new:
                writer.writeheader()
            writer.writerow({k: _cell(row.get(k)) for k in COLUMNS})
            f.flush()
            os.fsync(f.fileno())


@contextlib.contextmanager
def _naming(path: Path) -> Iterator[None]:
    """An OSError while writing `path` names it: a full disk said only "[Errno 28] No space
    left on device", not which file of which run. The name goes where Python's own errors
    put it (`filename`), so a message built from `strerror` does not repeat it."""
    try:
        yield
    except OSError as err:
        if err.filename is not None:
            raise
        raise OSError(err.errno, err.strerror, str(path)) from err


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


class RunRecord:
    """run.json: status, error, times, overrides, resolved config, versions, devices, commit."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / RUN_FILE

    def start(self, **fields: Any) -> None:
        """Write a fresh record with status `running`."""
        self._write({
            "status": "running", "error": None, "start_time": now_iso(), "end_time": None,
            "hostname": socket.gethostname(), "pid": os.getpid(), "git_commit": git_commit(),
            "git_dirty": git_dirty(), "versions": versions(), **fields,
        })

    def update(self, **fields: Any) -> None:
        """Merge fields into the record."""
        self._write({**self.read(), **fields})

    def finish(self, status: str, error: str | None = None, **fields: Any) -> None:
        """Mark the run completed, failed or interrupted (with any last fields)."""
        self.update(**fields, status=status, error=error, end_time=now_iso())

    def read(self) -> dict[str, Any]:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def _write(self, record: dict[str, Any]) -> None:
        # Write-then-rename: a reader never sees half a file, even if we die mid-write.
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        try:
            with _naming(self.path):
                tmp.write_text(json.dumps(record, indent=2, default=str) + "\n")
                os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)  # a full disk left an empty run.tmpNNNN behind
            raise


def versions() -> dict[str, str | None]:
    """Versions of the libraries that shape the results (read from metadata: no imports)."""
    from importlib import metadata

    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "torchvision", "hydra-core", "omegaconf", "numpy", "ddpscale"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    found["cuda"] = _torch_cuda()
    return found


def _torch_cuda() -> str | None:
    """torch.version.cuda, the CUDA that torch was built for. A job refused for its config
    records it without importing torch (1.5 s): torch/version.py is plain assignments."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.version.cuda
    try:
        spec = importlib.util.find_spec("torch")  # finds the package without running it
        source = Path(spec.submodule_search_locations[0], "version.py").read_text()
    except (ImportError, AttributeError, TypeError, IndexError, OSError):  # no torch where it is looked for
        return None
    for node in ast.parse(source).body:  # cuda: Optional[str] = '13.0'
        target = node.target if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [None])[0]
        if isinstance(target, ast.Name) and target.id == "cuda":
            return ast.literal_eval(node.value)
    return None


def git_commit(directory: Path = _HERE) -> str | None:
    """The commit of the ddpscale checkout, when it is one."""
    out = _git(directory, "rev-parse", "HEAD")
    return out.strip() or None if out is not None else None


def git_dirty(directory: Path = _HERE) -> bool | None:
    """Whether the checkout's tracked files differ from its commit (code edited and not
    committed): git_commit alone would then name code that is not what ran. Untracked files
    (data/, outputs/) do not count. None outside a git checkout."""
    out = _git(directory, "status", "--porcelain", "--untracked-files=no")
    return None if out is None else bool(out.strip())


def _git(directory: Path, *args: str) -> str | None:
    """git's output in `directory`, or None when git is missing or fails there."""
    try:
        out = subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def settings_row(cfg: Any, ctx: Any) -> dict[str, Any]:
    """The run's settings, repeated on every results row (cfg: Config, ctx: WorkerContext)."""
    p = ctx.placement
    return {
        "model": cfg.model.name, "dataset": cfg.data.name, "optimizer": cfg.optim.name,
        "num_nodes": p.num_nodes, "num_gpus": p.local_world_size, "world_size": p.world_size,
        "backend": ctx.backend, "device": ctx.device.type, "batch_size": cfg.data.batch_size,
        "global_batch_size": cfg.data.batch_size * p.world_size, "lr": cfg.optim.lr,
        "seed": cfg.train.seed, "epochs": cfg.train.epochs, "launcher": ctx.launcher,
        "precision": cfg.train.precision, "data_loader": cfg.data.loader,
        "grad_accum_steps": cfg.train.grad_accum_steps, "comm_hook": cfg.distributed.comm_hook,
        "channels_last": cfg.train.channels_last, "compile": cfg.train.compile,
        "bucket_cap_mb": float(cfg.distributed.bucket_cap_mb),
        "gradient_as_bucket_view": cfg.distributed.gradient_as_bucket_view,
        "static_graph": cfg.distributed.static_graph,
    }


class Reporter:
    """Rank-0 output: progress bar, log lines, results rows. Silent on other ranks."""

    def __init__(self, is_main: bool, out_dir: Path | None, settings: dict[str, Any],
                 epochs: int, show_progress: bool = True):
        self.is_main, self.settings, self.epochs = is_main, settings, epochs
        self.show_progress = show_progress and is_main
        self.writer = ResultsWriter(Path(out_dir) / RESULTS_FILE) if is_main and out_dir else None

    def info(self, msg: str, *args: Any) -> None:
        if self.is_main:
            log.info(msg, *args)

    def progress(self, iterable: Iterable, total: int, desc: str) -> Iterable:
        if not self.show_progress:
            return iterable
        from tqdm import tqdm

        # tqdm's default lock includes a multiprocessing one, a named semaphore that a
        # worker ended by SIGTERM (an interrupted run) never releases: "leaked semaphore
        # objects" at exit. Only this process draws bars, so a thread lock is enough.
        tqdm.set_lock(threading.RLock())
        # disable=None: a bar on a terminal, nothing in log files and CI output
        return tqdm(iterable, total=total, desc=desc, unit="batch", leave=False, disable=None)

    def epoch(self, stats: Any, elapsed_s: float) -> None:
        """Log and append one epoch's row (stats is a trainer.EpochStats)."""
        if not self.is_main:
            return
        row = {**self.settings, **asdict(stats), "elapsed_s": elapsed_s, "warmup": stats.epoch == 1}
        if self.writer:
            self.writer.append(row)
        share = "" if stats.grad_sync_share is None else f"  sync {stats.grad_sync_share:.0%}"
        log.info(
            "epoch %d/%d  train_loss %.4f  train_acc %.4f  val_loss %.4f  val_acc %.4f  "
            "%.1fs  %.0f img/s%s",
            stats.epoch, self.epochs, stats.train_loss, stats.train_acc, stats.val_loss,
            stats.val_acc, stats.epoch_time_s, stats.images_per_sec, share,
        )
