"""Shared helpers: run the real entry point, compose the real configs, find the data."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

# The tests stop the runs they start with Ctrl-C and hangups. A test runner that ignores
# those signals (started under nohup, or as a shell's background job) would hand the
# ignoring on to every run, which then outlived them and failed those tests; a handler that
# does nothing keeps this process ignoring them, and its children start with the default.
for _stop in (signal.SIGINT, signal.SIGHUP):
    if signal.getsignal(_stop) is signal.SIG_IGN:
        signal.signal(_stop, lambda signum, frame: None)

# A small, quick synthetic run on 2 CPU workers; tests add their own overrides.
QUICK = [
    "data=synthetic", "data.train_size=512", "data.val_size=256", "data.batch_size=32", "data.noise=2.0",
    "train.epochs=2", "train.sync_probe_steps=1", "distributed.timeout_s=60",
]


def fashion_mnist_root() -> Path | None:
    """A directory holding FashionMNIST/raw/ with the four files, if this machine has one."""
    for root in (os.environ.get("DDPSCALE_DATA"), REPO / "data", REPO.parent / "shared" / "data"):
        if root and all(
            (Path(root) / "FashionMNIST" / "raw" / f"{stem}.gz").exists()
            or (Path(root) / "FashionMNIST" / "raw" / stem).exists()
            for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                         "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
        ):
            return Path(root)
    return None


def spawn(fn, args: tuple, nprocs: int) -> None:
    """torch.multiprocessing.spawn whose workers leave as the launcher's do.

    A worker ending the normal way aborts about once in 60 exits in a library's C++
    teardown (see ddpscale.placement.exit_finished_worker) and failed this suite at
    random; leaving this way, 150 two-worker runs of test_ddp.shards had none.
    """
    import torch.multiprocessing as mp

    mp.spawn(_run_then_exit, args=(fn, *args), nprocs=nprocs)


def _run_then_exit(rank: int, fn, *args) -> None:
    from ddpscale.placement import exit_finished_worker

    fn(rank, *args)
    exit_finished_worker()


def run_train(*overrides: str, timeout: float = 240, script: str = "train.py",
              env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `python train.py OVERRIDES` from the repository root, as a user would."""
    return subprocess.run(
        [sys.executable, str(REPO / script), *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def read_rows(run_dir: Path) -> list[dict[str, str]]:
    with (Path(run_dir) / "results.csv").open() as f:
        return list(csv.DictReader(f))


def read_run(run_dir: Path) -> dict:
    return json.loads((Path(run_dir) / "run.json").read_text())


def output(proc: subprocess.CompletedProcess) -> str:
    return proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def fmnist_root() -> Path:
    root = fashion_mnist_root()
    if root is None:
        pytest.skip("Fashion-MNIST not found under data/ or ../shared/data (CI provides it)")
    return root


def descendants(pid: int) -> set[int]:
    """Every process below `pid`: its children, theirs, and so on (Linux's /proc)."""
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for c in map(int, children):
            found.add(c)
            todo.append(c)
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of `pids` still running (neither gone nor a zombie)."""
    running = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            continue
        if state != "Z":
            running.add(pid)
    return running


@pytest.fixture(autouse=True)
def no_process_outlives_its_test():
    """A test that fails before it stops what it started (a run of 200 epochs, a hung worker,
    a node whose communicate() timed out) left it running: it loaded the cores under every
    later test, whose time limits then failed too. Those are killed when the test ends.
    multiprocessing's resource tracker is kept: one serves every spawn of this process."""
    before = descendants(os.getpid())
    yield
    for pid in alive(descendants(os.getpid()) - before):
        with contextlib.suppress(OSError):
            if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
