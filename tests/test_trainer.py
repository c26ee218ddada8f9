"""The training loop's own promises, checked inside real 2-rank gloo groups: every epoch
reshuffles, the epoch lasts as long as the slowest rank, the schedule is stepped, the
sync probe leaves training as it was, and the precision and memory-format knobs act."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from conftest import spawn
from ddpscale.config import CNNConfig, ConfigError, DataConfig, DistributedConfig, SGDConfig, WideResNetConfig
from ddpscale.data import build_data
from ddpscale.distributed import host_store, process_group, wrap_ddp
from ddpscale.placement import Placement, Rendezvous, WorkerContext
from ddpscale.models import CNN, WideResNet
from ddpscale.optim import SCHEDULES, build_scheduler
from ddpscale.results import Reporter
from ddpscale.trainer import Trainer, WrongLogits, build_precision

CPU = torch.device("cpu")
LAST_RANK_LINGERS_S = 0.5
FETCH_S = 0.1  # what each batch takes to arrive, as from a slow DataLoader


class _Watched:
    """A rank's training batches, recording the epochs it is set to and how long the
    trainer took to draw them; each batch arrives FETCH_S late, and the last rank
    optionally lingers after its last batch."""

    def __init__(self, batches, linger_s: float):
        self.batches, self.linger_s = batches, linger_s
        self.epochs: list[int] = []
        self.draw_s: list[float] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)
        self.batches.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batches)

    def sizes(self) -> list[int]:
        return self.batches.sizes()

    def __iter__(self):
        start = time.perf_counter()
        for batch in self.batches:
            time.sleep(FETCH_S)
            yield batch
        self.draw_s.append(time.perf_counter() - start)
        time.sleep(self.linger_s)  # after the last step's all-reduce: nobody waits for it


def _train_twice(rank: int, world: int, port: int, out: str) -> None:
    """Train without and then with the sync probe, in one process group (its start costs seconds)."""
    torch.set_num_threads(1)
    placement = Placement(rank, rank, world, world, 0)
    ctx = WorkerContext(placement, CPU, "gloo", "spawn")
    with process_group(placement, "gloo", Rendezvous("127.0.0.1", port, 60)):
        runs = {probe_steps: _train(rank, world, ctx, probe_steps) for probe_steps in (0, 2)}
        if rank == 0:
            with open(out, "w") as f:
                json.dump(runs, f)


def _train(rank: int, world: int, ctx: WorkerContext, probe_steps: int) -> dict:
    """Two epochs from seed 0; what rank 0 saw of them."""
    data_cfg = DataConfig(name="synthetic", train_size=128, val_size=32, batch_size=16,
                          mean=0.0, std=1.0, noise=2.0, image_size=12)
    torch.manual_seed(0)
    data = build_data(data_cfg, rank, world, 0, CPU)
    # BatchNorm buffers and dropout: what a probe could disturb
    model = wrap_ddp(WideResNet(WideResNetConfig(depth=10, width=1, dropout=0.3), data_cfg), ctx,
                     DistributedConfig())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    epochs = 2
    scheduler = build_scheduler(optimizer, SGDConfig(lr=0.05), total_steps=epochs * len(data.train))
    data.train = watched = _Watched(data.train, LAST_RANK_LINGERS_S if rank == world - 1 else 0.0)
    trainer = Trainer(model, optimizer, data, ctx, Reporter(False, None, {}, epochs),
                      scheduler=scheduler, sync_probe_steps=probe_steps)
    history = trainer.fit(epochs)
    checksum = trainer.replica_checksum()
    return {"epochs": watched.epochs, "draw_s": watched.draw_s,
            "epoch_time_s": [s.epoch_time_s for s in history],
            "step_time_p50_s": [s.step_time_p50_s for s in history],
            "losses": [(s.train_loss, s.val_loss) for s in history],
            "sync_shares": [s.grad_sync_share for s in history],
            "lr": optimizer.param_groups[0]["lr"], "scheduler_steps": scheduler.last_epoch,
            "steps": epochs * len(watched), "checksum": checksum}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    """Rank 0's view of the run without the sync probe (0) and with 2 probe steps (2)."""
    out = tmp_path_factory.mktemp("trainer") / "runs.json"
    store = host_store("127.0.0.1", None, 2, 60)  # as the launcher does: the parent hosts it
    spawn(_train_twice, (2, store.port, str(out)), 2)
    return {int(probe): run for probe, run in json.loads(out.read_text()).items()}


def test_every_epoch_reshuffles(runs):
    assert runs[0]["epochs"] == [1, 2]


def test_an_epoch_lasts_as_long_as_the_slowest_rank(runs):
    # rank 0 drew its batches in draw_s; the last rank took as long and then lingered
    for draw, epoch_time in zip(runs[0]["draw_s"], runs[0]["epoch_time_s"]):
        assert epoch_time >= draw + 0.8 * LAST_RANK_LINGERS_S


def test_a_step_time_includes_the_wait_for_its_batch(runs):
    # a step cannot start before its batch arrives: a DataLoader that sets the pace shows in
    # the step times, which add up to the epoch, on the CPU as with CUDA's events
    for p50, epoch_time in zip(runs[0]["step_time_p50_s"], runs[0]["epoch_time_s"]):
        assert FETCH_S <= p50 < epoch_time


def test_the_cosine_schedule_is_stepped_once_per_optimizer_step_down_to_zero(runs):
    assert runs[0]["scheduler_steps"] == runs[0]["steps"]
    assert runs[0]["lr"] == pytest.approx(0.0, abs=1e-12)


def _learning_rates(cfg: SGDConfig, total_steps: int, steps_per_epoch: int) -> list[float]:
    """The rate each optimizer step trains with, then the rate after the last step."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    scheduler = build_scheduler(optimizer, cfg, total_steps, steps_per_epoch)
    rates = []
    for _ in range(total_steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates + [optimizer.param_groups[0]["lr"]]


@pytest.mark.parametrize("schedule", ["cosine", "constant"])
def test_a_warm_up_climbs_linearly_to_the_rate_then_the_schedule_runs_over_the_steps_left(schedule):
    # 2 epochs of 4 steps, half an epoch of warm-up: 2 steps climbing, then 6 of the schedule
    rates = _learning_rates(SGDConfig(lr=0.4, schedule=schedule, warmup_epochs=0.5), 8, 4)
    assert rates[:2] == pytest.approx([0.2, 0.4])
    if schedule == "constant":
        assert rates[2:] == pytest.approx([0.4] * 7)
    else:  # cos from 0 to pi over the 6 steps left: 0.4, 0.3732, 0.3, 0.2, 0.1, 0.0268, then 0
        assert rates[2:] == pytest.approx([0.4, 0.37320508, 0.3, 0.2, 0.1, 0.02679492, 0.0], abs=1e-7)


@pytest.mark.parametrize("answer", [float("nan"), -0.5, None])
def test_a_schedule_of_ones_own_that_returns_no_share_of_the_rate_is_refused(answer):
    SCHEDULES["broken"] = lambda progress: answer
    try:
        with pytest.raises(ConfigError, match=f"optim.schedule=broken's function returned {answer!r} for "
                                              "progress 0.0; it must return a finite number >= 0"):
            _learning_rates(SGDConfig(lr=0.4, schedule="broken"), 4, 2)
    finally:
        del SCHEDULES["broken"]


def test_a_schedule_of_ones_own_runs_after_the_warm_up():
    SCHEDULES["halving"] = lambda progress: 0.5 ** (4 * progress)
    try:
        rates = _learning_rates(SGDConfig(lr=0.4, schedule="halving", warmup_epochs=1), 6, 2)
    finally:
        del SCHEDULES["halving"]
    assert rates == pytest.approx([0.2, 0.4, 0.4, 0.2, 0.1, 0.05, 0.025])


def test_without_a_warm_up_the_cosine_schedule_starts_at_the_rate():
    rates = _learning_rates(SGDConfig(lr=0.4), 4, 2)
    assert rates == pytest.approx([0.4, 0.34142136, 0.2, 0.05857864, 0.0], abs=1e-7)


def test_the_sync_probe_leaves_training_exactly_as_it_was(runs):
    # gradients, dropout draws and BatchNorm statistics of the probe's steps are discarded
    assert None not in runs[2]["sync_shares"] and runs[0]["sync_shares"] == [None, None], "the probe ran"
    assert runs[2]["losses"] == runs[0]["losses"]
    assert runs[2]["checksum"] == runs[0]["checksum"]


def _lone_trainer(**knobs) -> Trainer:
    data_cfg = DataConfig(name="synthetic", channels=3, image_size=12)
    ctx = WorkerContext(Placement(0, 0, 1, 1, 0), CPU, "gloo", "spawn")
    model = CNN(CNNConfig(), data_cfg)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), None, ctx, None, **knobs)


@pytest.mark.parametrize("classes,wrap,says", [
    (11, lambda logits: logits, "logits of shape (4, 10)"),
    (10, lambda logits: (logits, None), "a tuple, not a tensor"),
    (10, lambda logits: logits[:, :, None], "logits of shape (4, 10, 1)"),
])
def test_a_model_output_that_is_not_a_score_per_class_is_refused_before_the_loss(classes, wrap, says):
    trainer = _lone_trainer(num_classes=classes)
    forward = trainer.model.forward
    trainer.model.forward = lambda x: wrap(forward(x))
    with pytest.raises(WrongLogits, match=rf"the model returned {re.escape(says)} for a batch of 4; "
                                          rf"the loss needs logits of shape \(4, {classes}\)"):
        trainer._forward_backward(torch.randn(4, 3, 12, 12), torch.tensor([0, 1, 2, 3]), sync=True)


def test_bf16_runs_the_forward_pass_in_bf16_and_keeps_fp32_gradients():
    trainer = _lone_trainer(precision=build_precision("bf16", CPU))
    x, y = torch.randn(4, 3, 12, 12), torch.tensor([0, 1, 2, 3])
    logits, loss = trainer._forward_backward(x, y, sync=True)
    assert logits.dtype == torch.bfloat16
    assert all(p.grad.dtype == torch.float32 for p in trainer.model.parameters())


@pytest.mark.parametrize("channels_last", [True, False])
def test_channels_last_hands_the_model_nhwc_batches(channels_last):
    # three channels: with one, an NCHW tensor is channels_last-contiguous as well
    trainer = _lone_trainer(channels_last=channels_last)
    x, _ = trainer._to_device(torch.randn(4, 3, 12, 12), torch.zeros(4, dtype=torch.long))
    assert x.is_contiguous(memory_format=torch.channels_last) == channels_last


def _ddp_knobs(rank: int, world: int, port: int, out: str) -> None:
    placement = Placement(rank, rank, world, world, 0)
    ctx = WorkerContext(placement, CPU, "gloo", "spawn")
    with process_group(placement, "gloo", Rendezvous("127.0.0.1", port, 60)):
        data_cfg = DataConfig(name="synthetic", image_size=12)
        ddp = wrap_ddp(CNN(CNNConfig(), data_cfg), ctx, DistributedConfig(
            bucket_cap_mb=1, gradient_as_bucket_view=False, static_graph=True, comm_hook="bf16"))
        with open(out, "w") as f:
            json.dump([ddp.bucket_bytes_cap, ddp.gradient_as_bucket_view, ddp.static_graph,
                       ddp.grad_allreduce], f)


def test_the_ddp_knobs_reach_ddp(tmp_path):
    out = tmp_path / "knobs.json"
    store = host_store("127.0.0.1", None, 1, 60)
    spawn(_ddp_knobs, (1, store.port, str(out)), 1)
    assert json.loads(out.read_text()) == [2**20, False, True, "bf16"]
