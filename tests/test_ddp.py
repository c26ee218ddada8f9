"""Real 2-process gloo groups on the CPU: sharding, reductions, identical replicas."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import QUICK, fashion_mnist_root, output, read_rows, read_run, run_train, spawn
from ddpscale.config import ConfigError, DataConfig
from ddpscale.data import DATASETS, Split, build_data, load_split, prepare
from ddpscale.distributed import host_store, process_group
from ddpscale.placement import Placement, Rendezvous

# results.csv's required columns in DESIGN.md's order (a contract: more may follow, none renamed)
DESIGN_COLUMNS = [
    "model", "dataset", "optimizer", "num_nodes", "num_gpus", "world_size", "backend", "device",
    "batch_size", "global_batch_size", "lr", "seed", "epochs",
    "epoch", "train_loss", "train_acc", "val_loss", "val_acc",
    "epoch_time_s", "elapsed_s", "images_per_sec",
]


# (loader, train_size, drop_last): every case the shard tests below read
SHARD_CASES = [("memory", 100, False), ("memory", 103, False), ("memory", 103, True),
               ("dataloader", 103, False), ("dataloader", 103, True)]


def _shards(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    placement = Placement(rank, rank, world, world, 0)
    with process_group(placement, "gloo", Rendezvous("127.0.0.1", port, 30)):
        mine = {}
        for loader, train_size, drop_last in SHARD_CASES:
            cfg = DataConfig(name="synthetic", train_size=train_size, val_size=37, batch_size=8,
                             loader=loader, mean=0.0, std=1.0, noise=1.0, seed=3, drop_last=drop_last)
            mine[f"{loader} {train_size} {drop_last}"] = _rank_shards(cfg, rank, world)
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(gathered, f)


def _rank_shards(data_cfg: DataConfig, rank: int, world: int) -> dict:
    """This rank's training indices, batch sizes and validation size, epochs 1 and 2."""
    bundle = build_data(data_cfg, rank, world, seed=0, device=torch.device("cpu"))
    mine = {"val_size": len(bundle.val_y)}
    for epoch in (1, 2):
        bundle.train.set_epoch(epoch)
        idx = bundle.train.indices()
        batches = [y for _, y in bundle.train]
        labels = torch.cat(batches)
        mine[epoch] = idx.tolist()
        mine[f"batch_sizes_{epoch}"] = [len(y) for y in batches]
        mine[f"sizes_foretold_{epoch}"] = bundle.train.sizes() == mine[f"batch_sizes_{epoch}"]
        # The batches really follow the sampler's indices (all of them, or the full batches').
        every = bundle.train.y if hasattr(bundle.train, "y") else bundle.train.loader.dataset.split.labels
        mine[f"labels_follow_indices_{epoch}"] = bool(torch.equal(labels, every[idx[:len(labels)]]))
    return mine


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict[str, list[dict]]:
    """Each case's shards on 2 ranks, from one process group: a group's start costs seconds."""
    out, world = tmp_path_factory.mktemp("shards") / "shards.json", 2
    store = host_store("127.0.0.1", None, world, 30)  # as the launcher does: the parent hosts it
    spawn(_shards, (world, store.port, str(out)), world)
    gathered = json.loads(out.read_text())
    return {case: [{k if not k.isdigit() else int(k): v for k, v in r[case].items()} for r in gathered]
            for case in gathered[0]}


def shards(sharded, loader: str, train_size: int = 103, drop_last: bool = False) -> list[dict]:
    return sharded[f"{loader} {train_size} {drop_last}"]


@pytest.mark.parametrize("train_size", [100, 103])
def test_training_shards_are_disjoint_cover_the_data_and_reshuffle(sharded, train_size):
    ranks = shards(sharded, "memory", train_size=train_size)
    for epoch in (1, 2):
        per_rank = [r[epoch] for r in ranks]
        assert len({len(s) for s in per_rank}) == 1, "every rank takes as many steps"
        union = [i for s in per_rank for i in s]
        assert set(union) == set(range(train_size)), "together the shards cover the data"
        padding = -train_size % 2
        assert len(union) - len(set(union)) == padding, "overlap only by DistributedSampler's padding"
        assert all(r[f"labels_follow_indices_{epoch}"] for r in ranks)
    assert ranks[0][1] != ranks[0][2], "set_epoch reshuffles"


def test_validation_shards_count_every_example_once(sharded):
    ranks = shards(sharded, "memory")
    assert sum(r["val_size"] for r in ranks) == 37


@pytest.mark.parametrize("drop_last", [False, True])
def test_memory_and_dataloader_paths_give_the_same_shards(sharded, drop_last):
    memory = shards(sharded, "memory", drop_last=drop_last)
    loader = shards(sharded, "dataloader", drop_last=drop_last)
    for epoch in (1, 2):
        assert [r[epoch] for r in memory] == [r[epoch] for r in loader]
        assert [r[f"batch_sizes_{epoch}"] for r in memory] == [r[f"batch_sizes_{epoch}"] for r in loader]
        assert all(r[f"labels_follow_indices_{epoch}"] for r in memory + loader)
        assert all(r[f"sizes_foretold_{epoch}"] for r in memory + loader)  # what accumulation weighs by


def test_drop_last_drops_the_tail_instead_of_padding_and_each_partial_batch(sharded):
    # 103 examples on 2 ranks: 51 each, no example twice; 6 full batches of 8, the 3 left dropped
    ranks = shards(sharded, "memory", drop_last=True)
    for epoch in (1, 2):
        per_rank = [r[epoch] for r in ranks]
        assert [len(s) for s in per_rank] == [51, 51]
        assert len(set(per_rank[0] + per_rank[1])) == 102
        assert all(r[f"batch_sizes_{epoch}"] == [8] * 6 for r in ranks)
    padded = shards(sharded, "memory")
    assert all(r["batch_sizes_1"] == [8] * 6 + [4] for r in padded)  # 52 each, the last batch partial


@pytest.mark.parametrize("name", ["synthetic", "fashion_mnist"])
def test_memory_and_dataloader_paths_serve_the_same_normalised_images(name):
    # Float (synthetic) images and uint8 ones, with a mean and std of the user's own.
    root = fashion_mnist_root()
    if name == "fashion_mnist" and root is None:
        pytest.skip("Fashion-MNIST is not on this machine")
    batches = {}
    for loader in ("memory", "dataloader"):
        cfg = DataConfig(name=name, root=str(root), train_size=40, val_size=8, batch_size=8,
                         loader=loader, mean=0.5, std=2.0, noise=1.0, seed=3)
        bundle = build_data(cfg, rank=0, world_size=1, seed=0, device=torch.device("cpu"))
        bundle.train.set_epoch(1)
        batches[loader] = next(iter(bundle.train))
    (x_mem, y_mem), (x_dl, y_dl) = batches["memory"], batches["dataloader"]
    assert torch.equal(y_mem, y_dl)
    torch.testing.assert_close(x_mem, x_dl, rtol=0, atol=1e-6)


@pytest.mark.parametrize("key,train", [("train_size", True), ("val_size", False)])
def test_a_smaller_synthetic_split_is_the_first_examples_of_a_larger_one(key, train):
    # data.train_size/val_size take the first N examples, as of a data set read from files: a
    # data-size sweep trains on nested sets, and val_size=300 and 301 judge by the same 300
    # (each drew every image afresh; 3x9x9 images are no multiple of torch's 16-value blocks)
    def split(n):
        return load_split(DataConfig(name="synthetic", channels=3, image_size=9, noise=1.0, seed=3,
                                     **{key: n}), train)

    small, large = split(301), split(1000)
    assert torch.equal(small.labels, large.labels[:301])
    assert torch.equal(small.images, large.images[:301])
    other = load_split(DataConfig(name="synthetic", channels=3, image_size=9, noise=1.0, seed=3,
                                  train_size=301, val_size=301), not train)
    assert not torch.equal(small.images, other.images), "training and validation examples differ"


def _images_and_labels(n_images=16, n_labels=16, images=torch.float32, labels=torch.int64, low=0, nan=False):
    def loader(cfg, train):
        x = torch.zeros(n_images, 1, 8, 8, dtype=images)
        if nan:
            x[3] = float("nan")
        return Split(x, torch.full((n_labels,), low, dtype=labels))
    return loader


@pytest.mark.parametrize("loader,message", [
    # each failed inside a worker with torch's words, or (nan) trained to nan and blamed optim.lr
    (_images_and_labels(n_labels=8), "data=mine's training split has 16 images but 8 labels"),
    (_images_and_labels(images=torch.float64), "has torch.float64 images; its loader must return uint8"),
    (_images_and_labels(labels=torch.int32), "has torch.int32 labels; its loader must return int64 labels"),
    (_images_and_labels(low=-1), "has a label -1; labels run from 0 to data.num_classes - 1"),
    (_images_and_labels(nan=True), "has images holding nan or inf values"),
    # an empty split trained or judged nothing and reported a loss and an accuracy of 0
    (_images_and_labels(n_images=0, n_labels=0), "data=mine's training split has no examples"),
    (lambda cfg, train: _images_and_labels(n_images=16 if train else 0, n_labels=16 if train else 0)(cfg, train),
     "data=mine's validation split has no examples"),
    # images without a channel axis, or with it last (numpy's and PIL's layout): the message
    # said to set data.channels and data.image_size, which were right
    (lambda cfg, train: Split(torch.zeros(16, 8, 8), torch.zeros(16, dtype=torch.int64)),
     r"data=mine's training images are 8x8, without a channel axis; its loader must return them as "
     r"\(N, channels, height, width\): images.unsqueeze\(1\)"),
    (lambda cfg, train: Split(torch.zeros(16, 8, 8, 1), torch.zeros(16, dtype=torch.int64)),
     r"data=mine's training images are 8x8x1, channels last; its loader must return them as "
     r"\(N, channels, height, width\): images.permute\(0, 3, 1, 2\)"),
    (lambda cfg, train: Split(torch.zeros(16, 1, 9, 9), torch.zeros(16, dtype=torch.int64)),
     r"data=mine's training images are 1x9x9 but the config says data.channels=1, data.image_size=8"),
    # a column of labels failed in a worker: "0D or 1D target tensor expected, multi-target not supported"
    (lambda cfg, train: Split(torch.zeros(16, 1, 8, 8), torch.zeros(16, 1, dtype=torch.int64)),
     r"data=mine's training split has labels of shape \(16, 1\); its loader must return one label per "
     r"image, a tensor of shape \(N,\): labels.flatten\(\)"),
    (lambda cfg, train: (torch.zeros(16, 1, 8, 8), torch.zeros(16, dtype=torch.int64)),
     "data=mine's loader returned a tuple for the training split; it must return ddpscale.data.Split"),
    (lambda cfg, train: Split(torch.zeros(16, 1, 8, 8).numpy(), torch.zeros(16, dtype=torch.int64)),
     r"data=mine's loader returned Split\(ndarray, Tensor\) for the training split"),
])
def test_a_plugged_in_data_set_of_the_wrong_kind_is_named_before_any_worker(monkeypatch, loader, message):
    monkeypatch.setitem(DATASETS, "mine", loader)
    cfg = DataConfig(name="mine", channels=1, image_size=8, num_classes=2, batch_size=4)
    with pytest.raises(ConfigError, match=message):
        prepare(cfg, world_size=1)


def _idx_file(path, array: np.ndarray) -> None:
    """An IDX file of unsigned bytes, as MNIST's are."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_a_data_file_of_no_examples_is_named_before_any_worker(tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for stem, n in (("train", 16), ("t10k", 0)):
        _idx_file(raw / f"{stem}-images-idx3-ubyte", np.zeros((n, 28, 28)))
        _idx_file(raw / f"{stem}-labels-idx1-ubyte", np.arange(n) % 10)
    cfg = DataConfig(name="fashion_mnist", root=str(tmp_path), download=False, batch_size=4)
    with pytest.raises(ConfigError, match="t10k-images-idx3-ubyte holds no examples"):
        prepare(cfg, world_size=2)


@pytest.mark.parametrize("channels", [3, 4])
def test_a_plugged_in_uint8_data_set_of_several_channels_serves_alike_on_both_paths(monkeypatch, channels):
    def colour(cfg, train):
        g = torch.Generator().manual_seed(0 if train else 1)
        n = 40 if train else 8
        return Split(torch.randint(256, (n, channels, 12, 12), dtype=torch.uint8, generator=g),
                     torch.randint(3, (n,), generator=g))

    monkeypatch.setitem(DATASETS, "colour", colour)
    cfg = DataConfig(name="colour", channels=channels, image_size=12, num_classes=3, mean=0.5, std=0.25,
                     batch_size=8)
    prepare(cfg, world_size=2)  # shape, classes and sizes fit the config
    batches = []
    for loader in ("memory", "dataloader"):
        cfg.loader = loader
        bundle = build_data(cfg, rank=0, world_size=1, seed=0, device=torch.device("cpu"))
        bundle.train.set_epoch(1)
        batches.append(next(iter(bundle.train)))
    torch.testing.assert_close(batches[0][0], batches[1][0], rtol=0, atol=1e-6)
    with pytest.raises(ConfigError, match="data.num_classes=2"):
        prepare(DataConfig(name="colour", channels=channels, image_size=12, num_classes=2), 2)


@pytest.mark.slow
def test_two_worker_run_writes_results_and_keeps_replicas_identical(tmp_path):
    proc = run_train(*QUICK, "distributed.num_gpus=2", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, output(proc)
    rows = read_rows(tmp_path)
    assert list(rows[0])[: len(DESIGN_COLUMNS)] == DESIGN_COLUMNS
    assert [int(r["epoch"]) for r in rows] == [1, 2]
    last = rows[-1]
    assert (last["world_size"], last["num_gpus"], last["num_nodes"]) == ("2", "2", "1")
    assert (last["batch_size"], last["global_batch_size"]) == ("32", "64")
    assert (last["backend"], last["device"], last["launcher"]) == ("gloo", "cpu", "spawn")
    assert all(int(r["val_count"]) == 256 for r in rows), "each validation image counted once"
    assert all(int(r["train_count"]) == 512 for r in rows)
    assert float(rows[1]["elapsed_s"]) == pytest.approx(
        float(rows[0]["epoch_time_s"]) + float(rows[1]["epoch_time_s"]), rel=1e-4)
    for r in rows:  # summed over workers: each rank's rate is at least its count over the epoch
        assert float(r["images_per_sec"]) >= 0.99 * int(r["train_count"]) / float(r["epoch_time_s"])
    assert float(last["val_acc"]) > 0.3, "synthetic classes are learnable (chance is 0.1)"
    run = read_run(tmp_path)
    assert run["status"] == "completed" and run["error"] is None
    assert len(run["replica_checksums"]) == 2 and run["replicas_identical"]
    assert run["config"]["distributed"]["num_gpus"] == 2
    assert "distributed.num_gpus=2" in run["overrides"]


@pytest.mark.slow
def test_memory_and_dataloader_paths_train_the_same(tmp_path):
    """Same seed, same shards, same normalisation: the two read paths agree."""
    root = fashion_mnist_root()
    data = [f"data.root={root}", "data.train_size=1024", "data.val_size=512"] if root else ["data=synthetic"]
    common = [*data, "data.batch_size=64", "train.epochs=1", "distributed.num_gpus=2",
              "train.sync_probe_steps=0"]
    accs = {}
    for loader in ("memory", "dataloader"):
        proc = run_train(*common, f"data.loader={loader}", f"hydra.run.dir={tmp_path / loader}")
        assert proc.returncode == 0, output(proc)
        row = read_rows(tmp_path / loader)[-1]
        assert row["data_loader"] == loader
        accs[loader] = (float(row["val_acc"]), float(row["train_loss"]))
    assert accs["memory"][0] == pytest.approx(accs["dataloader"][0], abs=0.01)
    assert accs["memory"][1] == pytest.approx(accs["dataloader"][1], rel=0.01)
