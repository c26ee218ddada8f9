"""Performance knobs, each in a real 2-worker run on the CPU; real Fashion-MNIST."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import QUICK, REPO, output, read_rows, read_run, run_train, spawn
from ddpscale.config import CNNConfig, DataConfig
from ddpscale.data import build_data, load_split
from ddpscale.distributed import cpu_threads, host_store, process_group, wrap_ddp
from ddpscale.config import DistributedConfig
from ddpscale.models import CNN
from ddpscale.placement import Placement, Rendezvous, WorkerContext
from ddpscale.results import Reporter
from ddpscale.trainer import Trainer, sync_share

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("knobs,columns", [
    (["train.precision=bf16"], {"precision": "bf16"}),
    (["train.channels_last=true"], {"precision": "fp32", "channels_last": "True"}),
    (["distributed.bucket_cap_mb=1", "distributed.gradient_as_bucket_view=false",
      "distributed.static_graph=true"],
     {"bucket_cap_mb": "1", "gradient_as_bucket_view": "False", "static_graph": "True"}),
    (["train.grad_accum_steps=2"], {"grad_accum_steps": "2"}),
    (["distributed.comm_hook=bf16"], {"comm_hook": "bf16"}),
    (["data.loader=dataloader", "data.num_workers=1"], {"data_loader": "dataloader"}),
    (["model=wide_resnet", "model.depth=10", "model.width=1", "train.precision=bf16",
      "train.channels_last=true"], {"model": "wide_resnet", "channels_last": "True"}),
    (["train.compile=true", "train.epochs=1"], {"model": "cnn", "compile": "True"}),
])
def test_each_knob_trains_on_the_cpu(tmp_path, knobs, columns):
    proc = run_train(*QUICK, "distributed.num_gpus=2", f"hydra.run.dir={tmp_path}", *knobs,
                     timeout=400)
    assert proc.returncode == 0, output(proc)
    rows = read_rows(tmp_path)
    assert {key: rows[-1][key] for key in columns} == columns  # the row names its knobs
    assert all(0 <= float(r["val_acc"]) <= 1 and float(r["train_loss"]) > 0 for r in rows)
    assert read_run(tmp_path)["replicas_identical"]


def test_fp16_on_the_cpu_is_refused_with_the_fix(tmp_path):
    proc = run_train(*QUICK, "train.precision=fp16", "distributed.device=cpu",
                     f"hydra.run.dir={tmp_path}", timeout=60)
    assert proc.returncode == 2
    assert "train.precision=fp16 needs CUDA; use train.precision=bf16" in output(proc)


@pytest.mark.parametrize("workers", [1, 2])
def test_results_carry_step_times_warmup_and_sync_share(tmp_path, workers):
    # one worker is given a thread count of its own; two share this process's cores
    threads = ["train.threads=1"] if workers == 1 else []
    proc = run_train(*QUICK, f"distributed.num_gpus={workers}", "train.sync_probe_steps=2", *threads,
                     f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, output(proc)
    assert read_run(tmp_path)["threads_per_worker"] == ([1] if workers == 1 else [cpu_threads(2)] * 2)
    rows = read_rows(tmp_path)
    assert [r["warmup"] for r in rows] == ["True", "False"]
    for r in rows:
        assert 0 < float(r["step_time_p50_s"]) <= float(r["step_time_p90_s"])
        assert 0 <= float(r["grad_sync_share"]) < 1
        if workers == 1:
            assert float(r["grad_sync_share"]) == 0  # one worker has nothing to synchronise
        assert float(r["eval_time_s"]) > 0


def test_the_sync_share_counts_one_allreduce_per_accumulated_step():
    # a micro-batch takes 1.0 s alone and 1.2 s with the all-reduce: 0.2 s of a 1.2 s step,
    # but of a 4.2 s step when four micro-batches share one all-reduce
    assert sync_share(1.2, 1.0) == pytest.approx(0.2 / 1.2)
    assert sync_share(1.2, 1.0, micro_batches=4) == pytest.approx(0.2 / 4.2)
    assert sync_share(0.9, 1.0, micro_batches=4) == 0.0  # noise, not a negative share


def _accumulation_run(tmp_path, train_size: int, *knobs: str) -> dict[str, str]:
    """The last row of a 2-worker epoch over the first train_size examples, dropout off."""
    proc = run_train(*QUICK, "distributed.num_gpus=2", "model.dropout=0", "train.epochs=1",
                     f"data.train_size={train_size}", *knobs, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, output(proc)
    return read_rows(tmp_path)[-1]


@pytest.fixture(scope="module")
def full_batch_run(tmp_path_factory):
    """The full-batch run of a training-set size, made once: two cases compare with one."""
    made = {}

    def run(train_size: int) -> dict[str, str]:
        if train_size not in made:
            made[train_size] = _accumulation_run(tmp_path_factory.mktemp("full"), train_size,
                                                 "data.batch_size=32", "train.sync_probe_steps=0")
        return made[train_size]
    return run


@pytest.mark.parametrize("train_size,static_graph", [(512, False), (480, False), (482, False), (512, True)])
def test_accumulating_two_half_batches_matches_one_full_batch(tmp_path, full_batch_run, train_size, static_graph):
    """no_sync accumulation: same data, same order, same gradients (dropout off). At 480
    images each rank has 15 half batches: the last optimizer step has one micro-batch of
    16, as the full-batch run's last batch has 16 images, and must weigh it as a whole step.
    At 482 the last step's micro-batches hold 16 and 1 images, the full-batch run's last
    batch those 17: each image weighs 1/17 in both (halving each micro-batch's mean gave
    the one image half the step). With a static graph DDP must all-reduce its first backward, a no_sync step."""
    a = full_batch_run(train_size)
    b = _accumulation_run(tmp_path, train_size, "data.batch_size=16", "train.grad_accum_steps=2",
                          f"distributed.static_graph={str(static_graph).lower()}",
                          # the probe's no_sync steps come after the graph is recorded
                          f"train.sync_probe_steps={2 if static_graph else 0}")
    # float order apart, the same weights: the 16 + 1 split moved val_loss by 9e-4
    assert float(a["val_loss"]) == pytest.approx(float(b["val_loss"]), rel=1e-4)
    assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), rel=1e-4)


def _count_allreduces(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    placement = Placement(rank, rank, world, world, 0)
    ctx = WorkerContext(placement, torch.device("cpu"), "gloo", "spawn")
    with process_group(placement, "gloo", Rendezvous("127.0.0.1", port, 30)):
        data_cfg = DataConfig(name="synthetic", train_size=256, val_size=64, batch_size=16,
                              mean=0.0, std=1.0, noise=2.0)
        counts = {}
        for accum in (1, 2, 4):
            torch.manual_seed(0)
            # DDP's own all-reduce, so that the counting hook below is the only hook
            model = wrap_ddp(CNN(CNNConfig(), data_cfg), ctx,
                             DistributedConfig(bucket_cap_mb=100, comm_hook="none"))
            calls = []

            def counting_hook(state, bucket, calls=calls):
                calls.append(bucket.index())
                return allreduce_hook(state, bucket)

            model.register_comm_hook(None, counting_hook)
            trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                              build_data(data_cfg, rank, world, 0, ctx.device), ctx,
                              Reporter(False, None, {}, 1), grad_accum_steps=accum)
            trainer.train_epoch(1)
            counts[accum] = len(calls)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(counts, f)


@pytest.fixture(scope="module")
def allreduces(tmp_path_factory) -> dict[int, int]:
    """Each grad_accum_steps' all-reduce count, from one 2-rank group (its start costs seconds)."""
    out = tmp_path_factory.mktemp("allreduces") / "calls.json"
    store = host_store("127.0.0.1", None, 2, 30)  # as the launcher does: the parent hosts it
    spawn(_count_allreduces, (2, store.port, str(out)), 2)
    return {int(accum): calls for accum, calls in json.loads(out.read_text()).items()}


@pytest.mark.parametrize("accum,expected", [(1, 8), (2, 4), (4, 2)])
def test_accumulation_steps_skip_the_allreduce(allreduces, accum, expected):
    assert allreduces[accum] == expected  # 8 batches per rank, one bucket


def test_fashion_mnist_loads_and_trains_on_a_subset(tmp_path, fmnist_root):
    cfg = DataConfig(name="fashion_mnist", root=str(fmnist_root), download=False,
                     train_size=2048, val_size=512, mean=0.2860, std=0.3530)
    train, val = load_split(cfg, train=True), load_split(cfg, train=False)
    assert train.images.shape == (2048, 1, 28, 28) and train.images.dtype == torch.uint8
    assert val.images.shape == (512, 1, 28, 28)
    assert set(train.labels.tolist()) == set(range(10))
    bundle = build_data(cfg, 0, 1, 0, torch.device("cpu"))
    x = bundle.train.x
    assert abs(x.mean().item()) < 0.1 and abs(x.std().item() - 1) < 0.1, "normalised"

    proc = run_train(f"data.root={fmnist_root}", "data.train_size=4096", "data.val_size=1000",
                     "train.epochs=1", "distributed.num_gpus=2", "train.sync_probe_steps=0",
                     f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, output(proc)
    row = read_rows(tmp_path)[-1]
    assert row["dataset"] == "fashion_mnist" and int(row["val_count"]) == 1000
    assert float(row["val_acc"]) > 0.6


# A fresh interpreter set up as a CPU worker, then CNN steps at batch 128: how many pages
# does a step fault in once the process has reached its peak footprint (median of steps
# 3-9; the count of one step varies with how huge pages happen to line up)? Without the
# cache, glibc's mmap threshold is pinned at its starting 128 KiB: left alone, glibc
# raises it when a big mmapped block is freed, and whether a step then still faults
# depends on where blocks happen to lie (one CI run in many saw 0 faults).
_PAGE_FAULTS = """
import ctypes, resource, sys, torch
sys.path.insert(0, {src!r})
from ddpscale.config import CNNConfig, DataConfig
from ddpscale.distributed import configure_cpu_worker
from ddpscale.models import CNN
from ddpscale.placement import Placement, Rendezvous, WorkerContext
if not {cache}:
    assert ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD, fixed
configure_cpu_worker(1, threads=1, malloc_cache={cache})
model = CNN(CNNConfig(), DataConfig())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(128, 1, 28, 28), torch.randint(10, (128,))
faults = []
for step in range(10):
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
print(sorted(faults[3:])[3])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_malloc_cache_stops_steps_from_faulting_in_fresh_memory():
    faults = {}
    for cache in (True, False):
        code = _PAGE_FAULTS.format(src=str(REPO / "src"), cache=cache)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        faults[cache] = int(proc.stdout.split()[-1])
    assert faults[False] > 2000, faults  # big blocks mmapped: fresh pages every step (4k-19k)
    assert faults[True] * 10 < faults[False], faults  # cached: typically 0


def test_a_warm_up_is_counted_in_optimizer_steps_of_each_worker(tmp_path):
    # 512 examples over 2 workers in batches of 32: 8 batches each, 4 optimizer steps an
    # epoch when 2 are accumulated; half an epoch of warm-up is 2 of the run's 8 steps
    proc = run_train(*QUICK, "distributed.num_gpus=2", "train.grad_accum_steps=2", "optim.warmup_epochs=0.5",
                     f"hydra.run.dir={tmp_path}", timeout=400)
    assert proc.returncode == 0, output(proc)
    assert ("learning rate: linear warm-up to 0.05 over 2 optimizer steps (optim.warmup_epochs=0.5), "
            "then cosine over 6") in (tmp_path / "train.log").read_text()
    assert read_run(tmp_path)["config"]["optim"]["warmup_epochs"] == 0.5
    assert all(float(r["train_loss"]) > 0 for r in read_rows(tmp_path))
