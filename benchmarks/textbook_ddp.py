"""The textbook DDP recipe, written by hand, as the baseline ddpscale is measured against.

mp.spawn -> init_process_group(env://) -> torchvision FashionMNIST with
Compose([ToTensor(), Normalize]) -> DistributedSampler + DataLoader -> DDP(model) -> SGD
-> the plain loop, with set_epoch every epoch. Torch's default thread count unless
--threads is given (the textbook never sets it). The model is ddpscale's CNN with its
default config, so both sides train the identical network.

    python benchmarks/textbook_ddp.py --root DIR --world-size 2 --batch-size 128 \
        --train-size 5120 --epochs 2 [--threads 1]

DIR must hold FashionMNIST/raw/ with the four files, all plain or all .gz (download=True
extracts .gz files without a network; bench_training.py hands it plain ones).
Global rank 0 prints one `RESULT {json}` line per epoch: images/sec over that epoch,
summed over ranks, timed like ddpscale times it (a barrier, then the clock).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import datasets, transforms

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from ddpscale.config import CNNConfig, DataConfig  # noqa: E402
from ddpscale.placement import exit_finished_worker  # noqa: E402
from ddpscale.models import CNN  # noqa: E402

from bench_args import at_least  # noqa: E402  (benchmarks/, this script's own folder)

MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST, as in conf/data/fashion_mnist.yaml


def worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)  # env://
    torch.manual_seed(0)

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MEAN,), (STD,))])
    train_set = datasets.FashionMNIST(args.root, train=True, download=False, transform=transform)
    train_set = Subset(train_set, range(args.train_size))
    sampler = DistributedSampler(train_set)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, num_workers=0)

    model = DDP(CNN(CNNConfig(), DataConfig()))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch)
        model.train()
        dist.barrier()
        start, seen = time.perf_counter(), 0
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            seen += len(y)
        seconds = time.perf_counter() - start
        rate = torch.tensor([seen / seconds])
        dist.all_reduce(rate)  # summed over ranks, as ddpscale reports it
        if rank == 0:
            print("RESULT " + json.dumps({
                "epoch": epoch, "images_per_sec": rate.item(), "epoch_time_s": seconds,
                "threads": torch.get_num_threads(), "loss": loss.item(),
            }), flush=True)
    dist.destroy_process_group()
    # Not part of the recipe: leave without C++ teardown, which aborts about one exit in
    # 60 (see ddpscale.placement) and would fail a benchmark run that is already timed.
    exit_finished_worker()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True)
    parser.add_argument("--world-size", type=at_least(1), default=2)
    parser.add_argument("--batch-size", type=at_least(1), default=128)
    parser.add_argument("--train-size", type=at_least(1), default=60000)
    parser.add_argument("--epochs", type=at_least(1), default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--threads", type=at_least(1), default=None, help="default: torch's own")
    args = parser.parse_args()

    datasets.FashionMNIST(args.root, train=True, download=True)  # extracts .gz files once
    with socket.socket() as s:  # a free port (other jobs may share this machine)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    mp.spawn(worker, args=(args.world_size, args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
