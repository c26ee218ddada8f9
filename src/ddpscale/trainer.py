"""The training loop: forward, loss, backward, step; metrics reduced across ranks.

It receives built objects and never reads the config. Timing discipline: ranks meet at
a barrier before the clock starts, CUDA is synchronised before the clock is read,
evaluation and the sync probe are outside the timed region, and epoch 1 is marked as
warm-up (it includes allocator and cuDNN start-up costs).
"""

from __future__ import annotations

import hashlib
import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpscale.data import DataBundle
from ddpscale.placement import WorkerContext
from ddpscale.results import Reporter


@dataclass
class Precision:
    """Autocast dtype (None: fp32) and gradient scaler (fp16 on CUDA only)."""

    dtype: torch.dtype | None = None
    scaler: torch.amp.GradScaler | None = None

    def autocast(self, device_type: str):
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(device_type, dtype=self.dtype)


def build_precision(name: str, device: torch.device) -> Precision:
    """fp32, bf16 autocast, or fp16 autocast with a gradient scaler (CUDA)."""
    if name == "bf16":
        return Precision(torch.bfloat16)
    if name == "fp16":
        return Precision(torch.float16, torch.amp.GradScaler(device.type))
    return Precision()


@dataclass
class EpochStats:
    """One epoch's reduced metrics, as they go into results.csv."""

    epoch: int
    train_loss: float
    train_acc: float
    val_loss: float
    val_acc: float
    epoch_time_s: float
    images_per_sec: float
    step_time_p50_s: float
    step_time_p90_s: float
    grad_sync_share: float | None
    eval_time_s: float
    train_count: int
    val_count: int


class Diverged(RuntimeError):
    """Training left weights that are not finite; no later epoch can recover."""

    def __init__(self, epoch: int, train_loss: float, fix: str = ""):
        super().__init__(f"training diverged in epoch {epoch}: the weights are no longer finite "
                         f"(train_loss {train_loss:g}){fix}")
        self.epoch, self.train_loss = epoch, train_loss


class WrongLogits(ValueError):
    """The model's output is not one score per class for each example: the loss would fail
    deep inside torch ("Target 3 is out of bounds"), or take the wrong tensor of a tuple."""

    def __init__(self, got: str, batch: int, classes: int, fix: str = ""):
        super().__init__(f"the model returned {got} for a batch of {batch}; the loss needs logits "
                         f"of shape ({batch}, {classes}), one score per class{fix}")
        self.got, self.batch, self.classes = got, batch, classes


def check_logits(logits: object, batch: int, classes: int) -> None:
    """Raise WrongLogits unless `logits` is a (batch, classes) tensor. Only the shape is read,
    so it costs no sync, and every rank runs the same model on as many examples: all of them
    raise at the same step, and none is left waiting in a collective."""
    if not isinstance(logits, torch.Tensor):
        raise WrongLogits(f"a {type(logits).__name__}, not a tensor", batch, classes)
    if tuple(logits.shape) != (batch, classes):
        raise WrongLogits(f"logits of shape {tuple(logits.shape)}", batch, classes)


class UnusedParameters(ValueError):
    """Parameters that got no gradient in the first step: DDP all-reduces every parameter that
    requires one, so it waited for these, stepped on gradients it had not averaged, and failed
    at the next step, advising a find_unused_parameters that ddpscale does not expose."""

    def __init__(self, names: list[str]):
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        super().__init__(f"the model's parameters {shown} got no gradient in the first step, and DDP "
                         "needs one for every parameter that requires it; use them in forward, or "
                         "freeze them (requires_grad_(False)) or leave them out of the model")


def sync_share(with_sync: float, without: float, micro_batches: int = 1) -> float:
    """Share of an optimizer step's time spent on gradient sync, from the time of one
    micro-batch's forward/backward with and without the all-reduce: a step runs
    `micro_batches` of them and all-reduces once."""
    extra = max(0.0, with_sync - without)
    return extra / (micro_batches * without + extra) if extra else 0.0


@dataclass
class Trainer:
    """Runs epochs of DDP training on one rank; rank 0 reports through `reporter`."""

    model: DDP
    optimizer: torch.optim.Optimizer
    data: DataBundle
    ctx: WorkerContext
    reporter: Reporter
    precision: Precision = field(default_factory=Precision)
    grad_accum_steps: int = 1
    channels_last: bool = False
    sync_probe_steps: int = 0
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    num_classes: int | None = None
    """Classes of the data set: the model's output is checked against it (None: unchecked)."""
    loss_fn: nn.Module = field(default_factory=nn.CrossEntropyLoss)
    _graph_recorded: bool = field(default=False, init=False)
    _used_checked: bool = field(default=False, init=False)

    def fit(self, epochs: int) -> list[EpochStats]:
        """Train for `epochs`, evaluating and reporting after each one; raise `Diverged`
        after reporting an epoch that left weights that are not finite."""
        history, elapsed = [], 0.0
        for epoch in range(1, epochs + 1):
            stats = self.train_epoch(epoch)
            elapsed += stats.epoch_time_s
            history.append(stats)
            self.reporter.epoch(stats, elapsed)
            if not self._weights_finite():
                raise Diverged(epoch, stats.train_loss)
        return history

    # ------------------------------------------------------------------ one epoch

    def train_epoch(self, epoch: int) -> EpochStats:
        """Train one epoch, then probe sync cost and evaluate (both untimed)."""
        # Every rank reshuffles with the same seed + epoch and takes a disjoint slice;
        # without set_epoch each epoch would replay the same order.
        self.data.train.set_epoch(epoch)
        self.model.train()
        device = self.ctx.device
        totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
        clock = _StepClock(device)
        first_batch = None
        sizes = self.data.train.sizes()  # examples per batch: the epoch's last may be short
        n_batches = len(sizes)

        self._synchronize()
        dist.barrier()  # the clock starts when every rank is ready
        start = time.perf_counter()
        clock.mark()
        batches = self.reporter.progress(self.data.train, total=n_batches, desc=f"epoch {epoch}")
        for step, (x, y) in enumerate(batches):
            x, y = self._to_device(x, y)
            if first_batch is None:
                first_batch = (x, y)
            group_start = step - step % self.grad_accum_steps
            group = sizes[group_start:group_start + self.grad_accum_steps]  # the epoch's last may be short
            boundary = step + 1 == group_start + len(group)
            # each example weighs alike in the step's mean, as in one batch of them all, also
            # when the epoch's last micro-batch is short
            logits, loss = self._forward_backward(x, y, sync=boundary, share=len(y) / sum(group))
            if boundary:
                self._optimizer_step()
            with torch.no_grad():
                totals += batch_totals(loss.detach().double() * len(y), logits, y)
            clock.mark()  # a step runs from the previous one's end: waiting for its batch is part of it
        self._synchronize()
        local_time = time.perf_counter() - start
        step_times = clock.durations()

        # Reduce before reporting: the epoch lasts as long as the slowest rank, images/sec
        # is the sum of every rank's rate, and loss/accuracy cover every rank's examples.
        timing = torch.tensor([local_time, totals[2].item() / max(local_time, 1e-9)], device=device)
        epoch_time = timing[:1].clone()
        dist.all_reduce(epoch_time, op=dist.ReduceOp.MAX)
        rate = timing[1:].clone()
        dist.reduce(rate, dst=0, op=dist.ReduceOp.SUM)
        dist.all_reduce(totals)

        share = self.probe_sync_share(first_batch) if first_batch is not None else None
        eval_start = time.perf_counter()
        val_loss, val_acc, val_count = self.evaluate()
        loss_sum, correct, count = totals.tolist()
        return EpochStats(
            epoch=epoch,
            train_loss=loss_sum / max(count, 1),
            train_acc=correct / max(count, 1),
            val_loss=val_loss,
            val_acc=val_acc,
            epoch_time_s=epoch_time.item(),
            images_per_sec=rate.item(),
            step_time_p50_s=_quantile(step_times, 0.5),
            step_time_p90_s=_quantile(step_times, 0.9),
            grad_sync_share=share,
            eval_time_s=time.perf_counter() - eval_start,
            train_count=int(count),
            val_count=val_count,
        )

    def _to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.to(self.ctx.device, non_blocking=True)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return x, y.to(self.ctx.device, non_blocking=True)

    def _forward_backward(self, x, y, sync: bool, share: float = 1.0):
        # no_sync on accumulation steps: gradients pile up locally and the all-reduce runs
        # once, on the boundary step, over the accumulated sum; each micro-batch adds its
        # `share` of the step's examples times its mean loss, so they add up to the step's mean.
        if not self._graph_recorded and getattr(self.model, "static_graph", False):
            # DDP records a static graph on the first backward, which must all-reduce
            # (under no_sync it fails an internal assert). Averaging a part of the sum
            # early leaves the step's mean gradient unchanged: the rest is added locally
            # and the boundary step averages again.
            sync = True
        self._graph_recorded = self._graph_recorded or sync
        with (nullcontext() if sync else self.model.no_sync()):
            with self.precision.autocast(self.ctx.device.type):
                logits = self.model(x)
                if self.num_classes is not None:
                    check_logits(logits, len(y), self.num_classes)
                loss = self.loss_fn(logits, y)
            scaled = loss * share
            if self.precision.scaler is not None:
                scaled = self.precision.scaler.scale(scaled)
            scaled.backward()
        if not self._used_checked:  # every rank alike: the replicas are one model
            self._used_checked = True
            module = getattr(self.model, "module", self.model)  # DDP's, or a bare model of its own
            unused = [name for name, p in module.named_parameters() if p.requires_grad and p.grad is None]
            if unused:
                raise UnusedParameters(unused)
        return logits, loss

    def _optimizer_step(self) -> None:
        if self.precision.scaler is not None:
            self.precision.scaler.step(self.optimizer)
            self.precision.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    def _synchronize(self) -> None:
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)

    # ------------------------------------------------------------------ measurement

    def probe_sync_share(self, batch) -> float | None:
        """Share of a step spent on gradient sync: time steps with and without all-reduce.

        The probe runs forward/backward on one batch `sync_probe_steps` times each way and
        discards the gradients, the RNG draws and any BatchNorm statistics it touched, so
        training is the same with or without it.
        """
        if self.sync_probe_steps <= 0:
            return None
        if self.ctx.world_size == 1:
            return 0.0  # nothing to synchronise; the probe would time DDP's bucket copy
        x, y = batch
        buffers = [b.detach().clone() for b in self.model.module.buffers()]
        devices = [self.ctx.device] if self.ctx.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            timings = {}
            for sync in (True, False, True, False):  # interleaved, to share any drift
                for _ in range(self.sync_probe_steps):
                    self._synchronize()
                    dist.barrier()
                    t0 = time.perf_counter()
                    self._forward_backward(x, y, sync=sync)
                    self._synchronize()
                    timings.setdefault(sync, []).append(time.perf_counter() - t0)
                    self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for b, saved in zip(self.model.module.buffers(), buffers):
                b.copy_(saved)
        with_sync, without = statistics.median(timings[True]), statistics.median(timings[False])
        share = torch.tensor([sync_share(with_sync, without, self.grad_accum_steps)],
                             device=self.ctx.device)
        dist.all_reduce(share)  # the mean over ranks
        return share.item() / self.ctx.world_size

    @torch.no_grad()
    def evaluate(self, chunk: int = 1000) -> tuple[float, float, int]:
        """Loss, accuracy and count over the whole validation set (each example once)."""
        model = self.model.module
        # BatchNorm statistics drift apart in the last forward of each rank; evaluate with
        # rank 0's so every shard is judged by the same model.
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)
        model.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)
        x_all, y_all = self.data.val_x, self.data.val_y
        for start in range(0, len(y_all), chunk):
            x, y = self._to_device(x_all[start:start + chunk], y_all[start:start + chunk])
            with self.precision.autocast(self.ctx.device.type):
                logits = model(x)
            loss = nn.functional.cross_entropy(logits.float(), y, reduction="sum")
            totals += batch_totals(loss, logits, y)
        dist.all_reduce(totals)  # sum the counts, never average per-rank averages
        loss_sum, correct, count = totals.tolist()
        return loss_sum / max(count, 1), correct / max(count, 1), int(count)

    def _weights_finite(self) -> bool:
        """Whether every rank's weights are finite: once one is nan or inf, every later step
        is nan too, so the rest of the run would only spend time (a loss of nan or inf alone
        can pass: fp16's gradient scaler skips such a step)."""
        checks = [p.isfinite().all() for p in self.model.module.parameters()]
        finite = torch.stack(checks).all().float().reshape(1)  # on the device: one sync, not one per tensor
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # every rank stops together
        return bool(finite.item())

    def replica_checksum(self) -> str:
        """SHA-1 of this rank's parameters and buffers; equal on every rank when in sync."""
        digest = hashlib.sha1()
        for tensor in self.model.module.state_dict().values():
            digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()


def batch_totals(loss_sum: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One batch's (loss sum, correct, count) as float64 on the batch's device."""
    return torch.stack([loss_sum.double(), (logits.argmax(1) == y).sum().double(),
                        torch.tensor(float(len(y)), dtype=torch.float64, device=y.device)])


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class _StepClock:
    """Step boundaries: CUDA events on CUDA (step times without a synchronisation per
    step), the clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def durations(self) -> list[float]:
        """Seconds between consecutive marks (call after synchronising)."""
        pairs = zip(self.marks, self.marks[1:])
        return [a.elapsed_time(b) / 1000 if self.cuda else b - a for a, b in pairs]
