"""Data sets and how each worker reads its shard.

Two read paths give the same shards for a seed, because both draw indices from
`DistributedSampler`:

- `memory` (default): the split is decoded once into one tensor, normalised in bulk and
  kept on the training device; a batch is one `index_select`. On small images this is
  what keeps the model, not Python, the bottleneck.
- `dataloader`: the textbook recipe, a `DataLoader` with per-sample PIL -> ToTensor ->
  Normalize, for comparison and for data sets that do not fit in memory.

Validation is sharded without padding (rank r takes examples r, r + W, ...), so summing
the per-rank counts counts every validation image exactly once.
"""

from __future__ import annotations

import functools
import gzip
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddpscale.config import ConfigError, DataConfig, Registry, registered
from ddpscale.distributed import die_with_parent

log = logging.getLogger("ddpscale")

# data option -> (torchvision class name, file stem per split)
_IDX_DATASETS = {
    "fashion_mnist": "FashionMNIST",
    "mnist": "MNIST",
}
_SPLIT_FILES = {True: ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
                False: ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
_SYNTHETIC_DEFAULT_SIZE = {True: 8192, False: 2048}  # examples when train/val_size is null
_SYNTHETIC_BLOCK = 256  # synthetic examples drawn from one seed
# The checkout's data folder (this file is src/ddpscale/data.py in it): the default data.root,
# data, counts from the directory train.py is run in, so run from elsewhere it misses this one.
CHECKOUT_DATA = Path(__file__).resolve().parents[2] / "data"


@dataclass
class Split:
    """One split held in memory: uint8 or float images (N, C, H, W) and int64 labels."""

    images: torch.Tensor
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.labels)

    def head(self, n: int | None) -> "Split":
        """The first n examples (all when n is None)."""
        return self if n is None else Split(self.images[:n], self.labels[:n])


# --------------------------------------------------------------------------- sources


def prepare(cfg: DataConfig, world_size: int) -> None:
    """Make sure the data is on disk (download once, here) and fits the config, before
    any worker starts: a mismatch then fails with the key's name, not inside a worker."""
    if cfg.name == "synthetic":
        train_count = cfg.train_size or _SYNTHETIC_DEFAULT_SIZE[True]
    elif cfg.name not in _IDX_DATASETS:  # a data set of the user's (DATASETS)
        train_count = _check_plugged_in(cfg)
    else:
        _refuse_generator_keys(cfg)
        folder = _raw_folder(cfg)
        if _missing_files(folder):
            _refuse_misplaced_root(cfg, folder)
            if not cfg.download:
                raise ConfigError(_missing_message(cfg, folder, "data.download=false"))
            _download(cfg, folder)
        train_count = _check_idx(cfg, folder)
    _check_batches(cfg, world_size, train_count)


def _refuse_misplaced_root(cfg: DataConfig, folder: Path) -> None:
    """data.root given as the folder that holds the files (or the one above it), a level off
    from the DIR of DIR/<DatasetName>/raw/: name the root to give, rather than download a
    second copy below it or, offline, say only that no data was found."""
    root = Path(cfg.root).expanduser()
    holder = next((d for d in (root, root / "raw") if not _missing_files(d)), None)
    if holder is None:
        return
    dataset_dir, raw = folder.parent.name, folder.name
    other = {d: option for option, d in _IDX_DATASETS.items()}.get(holder.parent.name)
    if holder.name == raw and holder.parent.name == dataset_dir:
        fix = f"data.root={holder.parent.parent}"
    elif holder.name == raw and other:  # MNIST and Fashion-MNIST files have the same names
        fix = (f"data={other} data.root={holder.parent.parent} to train on these, or data.root=DIR "
               f"with DIR/{dataset_dir}/{raw}/ holding {cfg.name}'s files")
    else:
        fix = f"move them into {folder}, or into DIR/{dataset_dir}/{raw}/ and give data.root=DIR"
    raise ConfigError(
        f"data={cfg.name}: the data files are in {holder}, but data.root names the folder that holds "
        f"{dataset_dir}/{raw}/ (it looked in {folder}). Fix: {fix}"
    )


def _refuse_generator_keys(cfg: DataConfig) -> None:
    """data.noise and data.seed shape generated data; on a data set read from files they
    would be recorded in every row while changing nothing."""
    for key, fix in (("noise", "data=synthetic generates noisy data"),
                     ("seed", "train.seed varies the shuffling and the initial weights")):
        value = getattr(cfg, key)
        if value:
            raise ConfigError(
                f"data.{key}={value} changes nothing for data={cfg.name}, which is read from files: "
                f"data.{key} shapes generated data only; leave it out ({fix})"
            )


def _check_idx(cfg: DataConfig, folder: Path) -> int:
    """Check the files' image shape and labels against the config; the training examples used."""
    paths = {stem: _find(folder, stem) for split in _SPLIT_FILES.values() for stem in split}
    shapes = {stem: _check_complete(path) for stem, path in paths.items()}  # each header read once
    for images, labels in _SPLIT_FILES.values():
        _check_pair(paths[images], shapes[images], paths[labels], shapes[labels])
        if shapes[images][0] == 0:  # a run would train or judge on nothing and report 0 for it
            raise ConfigError(f"{paths[images]} holds no examples; the file is damaged or belongs to "
                              "another data set: replace it")
    (train_images, train_labels), (val_images, val_labels) = _SPLIT_FILES[True], _SPLIT_FILES[False]
    shape = shapes[train_images]
    if shape[1:] != (cfg.image_size, cfg.image_size) or cfg.channels != 1:
        raise ConfigError(
            f"data={cfg.name} has 1x{shape[1]}x{shape[2]} images but the config "
            f"says data.channels={cfg.channels}, data.image_size={cfg.image_size}; "
            "leave those keys at the data option's values"
        )
    classes = int(_read_idx(paths[train_labels]).max()) + 1
    if classes != cfg.num_classes:  # more would train outputs no label ever asks for
        raise ConfigError(
            f"data={cfg.name} has {classes} classes but data.num_classes={cfg.num_classes}; "
            "leave data.num_classes at the data option's value"
        )
    val_y = _read_idx(paths[val_labels])
    if int(val_y.max()) >= cfg.num_classes:
        raise ConfigError(
            f"{paths[val_labels]} has labels beyond the {cfg.num_classes} classes of the training "
            "labels; the file is damaged or belongs to another data set: replace it"
        )
    for train, key in ((True, "train_size"), (False, "val_size")):
        available = shapes[train_images if train else val_images][0]
        wanted = getattr(cfg, key)
        if wanted is not None and wanted > available:
            split = "training" if train else "validation"
            raise ConfigError(
                f"data.{key}={wanted} is more than data={cfg.name} has ({available} {split} "
                f"examples); lower data.{key}, or set data.{key}=null to use them all"
            )
    return cfg.train_size or shape[0]


def _check_plugged_in(cfg: DataConfig) -> int:
    """The checks _check_idx makes, on a registered loader's splits; the training examples used."""
    for train, key in ((True, "train_size"), (False, "val_size")):
        split = _loader(cfg)(cfg, train)
        wanted, name = getattr(cfg, key), "training" if train else "validation"
        _check_tensors(cfg, split, name)
        _check_layout(cfg, split.images, name)
        if int(split.labels.max()) >= cfg.num_classes:
            raise ConfigError(
                f"data={cfg.name} has labels up to {int(split.labels.max())} but data.num_classes="
                f"{cfg.num_classes}; set data.num_classes in its conf/data/{cfg.name}.yaml")
        if wanted is not None and wanted > len(split):
            raise ConfigError(
                f"data.{key}={wanted} is more than data={cfg.name} has ({len(split)} {name} "
                f"examples); lower data.{key}, or set data.{key}=null to use them all")
        if train:
            train_count = wanted or len(split)
    return train_count


def _check_layout(cfg: DataConfig, images: torch.Tensor, name: str) -> None:
    """Images of (N, channels, image_size, image_size), or a ConfigError with the fix: images
    without a channel axis or with it last (numpy's and PIL's layout) were told to change
    data.channels and data.image_size, which were right."""
    shape, size = tuple(images.shape[1:]), cfg.image_size
    if shape == (cfg.channels, size, size):
        return
    what = f"data={cfg.name}'s {name} images are {'x'.join(map(str, shape))}"
    wanted = "(N, channels, height, width)"
    if cfg.channels == 1 and shape == (size, size):
        raise ConfigError(f"{what}, without a channel axis; its loader must return them as {wanted}: "
                          "images.unsqueeze(1)")
    if shape == (size, size, cfg.channels):
        raise ConfigError(f"{what}, channels last; its loader must return them as {wanted}: "
                          "images.permute(0, 3, 1, 2)")
    raise ConfigError(f"{what} but the config says data.channels={cfg.channels}, data.image_size={size}, "
                      f"images of {cfg.channels}x{size}x{size}; set those keys in its conf/data/{cfg.name}.yaml")


def _check_tensors(cfg: DataConfig, split: Split, name: str) -> None:
    """A plug-in's split as Split says (a worker failed on each of these with torch's words,
    and nan images trained to a loss of nan that blamed optim.lr)."""
    what = f"data={cfg.name}'s {name} split"
    _check_kind(cfg, split, name)
    images, labels = split.images, split.labels
    if labels.dim() != 1:  # a column of labels failed in a worker, inside the loss
        raise ConfigError(f"{what} has labels of shape {tuple(labels.shape)}; its loader must return one "
                          "label per image, a tensor of shape (N,): labels.flatten()")
    if len(images) != len(labels):
        raise ConfigError(f"{what} has {len(images)} images but {len(labels)} labels; its loader "
                          "must return one label per image")
    if not len(labels):  # trained or judged nothing, and results.csv said loss 0 and accuracy 0
        raise ConfigError(f"{what} has no examples; a run trains on the training split and judges each "
                          "epoch on the validation split, so its loader must return at least one example for each")
    if images.dtype not in (torch.uint8, torch.float32):
        raise ConfigError(f"{what} has {images.dtype} images; its loader must return uint8 (0-255) "
                          "or float32 images")
    if labels.dtype != torch.int64:
        raise ConfigError(f"{what} has {labels.dtype} labels; its loader must return int64 labels "
                          "(labels.long())")
    if int(labels.min()) < 0:
        raise ConfigError(f"{what} has a label {int(labels.min())}; labels run from 0 to "
                          "data.num_classes - 1")
    if images.is_floating_point() and not bool(torch.isfinite(images).all()):
        raise ConfigError(f"{what} has images holding nan or inf values; its loader must return "
                          "finite ones")


def _check_kind(cfg: DataConfig, split: object, name: str) -> None:
    """A Split of two tensors, or a ConfigError naming what the loader returned."""
    if not isinstance(split, Split) or not all(isinstance(t, torch.Tensor) for t in (split.images, split.labels)):
        got = (f"a {type(split).__name__}" if not isinstance(split, Split) else
               f"Split({type(split.images).__name__}, {type(split.labels).__name__})")
        raise ConfigError(f"data={cfg.name}'s loader returned {got} for the {name} split; it must return "
                          "ddpscale.data.Split(images, labels), two torch tensors (torch.as_tensor(...))")


def _check_batches(cfg: DataConfig, world_size: int, train_count: int) -> None:
    per_worker = train_count // world_size
    if cfg.drop_last and per_worker < cfg.batch_size:
        raise ConfigError(
            f"data.batch_size={cfg.batch_size} is more than each of the {world_size} worker(s) gets "
            f"({per_worker} of {train_count} training examples), and data.drop_last=true drops "
            "that partial batch, so an epoch would train no step; "
            + (f"lower data.batch_size to {per_worker} or less, raise data.train_size" if per_worker else
               f"raise data.train_size to {world_size} or more (one example per worker at least), "
               "run fewer workers")
            + " or set data.drop_last=false"
        )
    shard = -(-train_count // world_size)  # DistributedSampler's padded share
    if not cfg.drop_last and shard < cfg.batch_size:
        log.info("notice: data.batch_size=%d is more than each of the %d worker(s) gets (%d of %d "
                 "training examples): every step trains on a batch of %d, but results.csv will say "
                 "batch_size=%d (global_batch_size=%d); set data.batch_size=%d to record the batch "
                 "the run trains with", cfg.batch_size, world_size, shard, train_count, shard,
                 cfg.batch_size, cfg.batch_size * world_size, shard)


def load_split(cfg: DataConfig, train: bool) -> Split:
    """The first train_size / val_size examples of a split, as tensors."""
    split = _loader(cfg)(cfg, train)
    # checked whole in the job process (_check_plugged_in); a loader may still answer otherwise here
    _check_kind(cfg, split, "training" if train else "validation")
    return split.head(cfg.train_size if train else cfg.val_size)


def _loader(cfg: DataConfig) -> Callable[[DataConfig, bool], Split]:
    return registered(DATASETS, "data", cfg.name, "ddpscale.data.DATASETS")


def _raw_folder(cfg: DataConfig) -> Path:
    return Path(cfg.root).expanduser() / _IDX_DATASETS[cfg.name] / "raw"


def _find(folder: Path, stem: str) -> Path | None:
    candidates = (folder / stem, folder / f"{stem}.gz")
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    for candidate in candidates:  # a directory in its place read as no data, then a download failed
        if candidate.exists():
            raise ConfigError(f"{candidate} is not a file, but the data file {stem} belongs there; "
                              "remove it and run again")
    return None


def _missing_files(folder: Path) -> list[str]:
    stems = [stem for split in _SPLIT_FILES.values() for stem in split]
    return [stem for stem in stems if _find(folder, stem) is None]


def _missing_message(cfg: DataConfig, folder: Path, why: str) -> str:
    fixes = [f"data.root={root}, the checkout's data folder, which holds them (a relative "
             "data.root counts from the directory train.py is run in)"
             for root in _checkout_root(folder)]
    fixes += [] if cfg.download else ["data.download=true to fetch it"]
    fixes += [f"data.root=DIR with DIR/{folder.parent.name}/raw/ holding the files",
              "data=synthetic to train on generated data"]
    return (
        f"data={cfg.name}: no data in {folder.resolve()} (looked for "
        f"{', '.join(_missing_files(folder))}, plain or .gz) and {why}. Fix: {', or '.join(fixes)}"
    )


def _checkout_root(folder: Path) -> list[Path]:
    """[the checkout's data folder] when it holds the files `folder` lacks, else []."""
    raw = CHECKOUT_DATA / folder.parent.name / folder.name
    if raw.resolve() == folder.resolve() or not raw.is_dir() or _missing_files(raw):
        return []
    return [CHECKOUT_DATA]


def _download(cfg: DataConfig, folder: Path) -> None:
    import torchvision.datasets as tvd

    dataset_class = getattr(tvd, _IDX_DATASETS[cfg.name])
    root = folder.parent.parent
    created = [d for d in (folder, *folder.parents) if not d.exists()]  # torchvision makes them all
    log.info("downloading %s into %s", cfg.name, root)
    try:
        for train in (True, False):
            dataset_class(str(root), train=train, download=True)
    except Exception as err:
        for directory in created:  # deepest first: leave no empty folders behind; files stay
            if directory.is_dir() and not any(directory.iterdir()):
                directory.rmdir()
        raise ConfigError(_missing_message(cfg, folder, f"the download failed ({err})")) from err


def _check_pair(images: Path, image_shape: tuple[int, ...], labels: Path,
                label_shape: tuple[int, ...]) -> None:
    """An images file of (N, H, W) beside a labels file of (N,): swapped or misnamed files
    fail here, naming them, rather than inside a worker."""
    if len(image_shape) != 3 or len(label_shape) != 1 or image_shape[0] != label_shape[0]:
        raise ConfigError(
            f"{images} holds an array of shape {image_shape} and {labels} one of shape "
            f"{label_shape}; an images file holds (N, height, width) and its labels file (N,): "
            "the files are swapped, misnamed or from another data set: replace them"
        )


def _idx_shape(path: Path) -> tuple[int, ...]:
    """The shape in an IDX file's header, without reading the rest."""
    with (gzip.open(path) if path.suffix == ".gz" else path.open("rb")) as f:
        magic = f.read(4)
        if magic[:3] != b"\x00\x00\x08":  # two zero bytes, then 08: unsigned bytes, as read here
            raise ValueError(f"its header starts {magic.hex(' ')}, not 00 00 08 as an IDX file of bytes does")
        ndim = magic[3]
        header = f.read(4 * ndim)
    return tuple(int.from_bytes(header[4 * i: 4 * i + 4], "big") for i in range(ndim))


def _check_complete(path: Path) -> tuple[int, ...]:
    """An IDX file as long as its header says, without reading it all (a gzip file's last
    4 bytes hold its unpacked size): a cut-off download fails here, naming the file. Returns
    the shape its header gives."""
    try:
        shape = _idx_shape(path)
        expected = 4 + 4 * len(shape) + math.prod(shape)
        if path.suffix == ".gz":
            with path.open("rb") as f:
                f.seek(-4, os.SEEK_END)
                size = int.from_bytes(f.read(4), "little")
            complete = size == expected % 2**32
        else:
            complete = path.stat().st_size == expected
    except (OSError, EOFError, IndexError, ValueError) as err:  # gzip.BadGzipFile is an OSError
        raise ConfigError(_damaged_message(path, err)) from err
    if not complete:
        dims = "x".join(map(str, shape))
        raise ConfigError(_damaged_message(path, f"its length is not the {dims} its header says"))
    return shape


def _damaged_message(path: Path, why: object) -> str:
    return (f"the data file {path} is damaged or cut off ({why}); delete it and run again to "
            "download it afresh (data.download=true), or copy it again")


def _read_idx(path: Path) -> np.ndarray:
    """Read an IDX file (the MNIST format), gzipped or not."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        ndim = raw[3]
        shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
        return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)
    except (OSError, EOFError, IndexError, ValueError) as err:  # gzip.BadGzipFile is an OSError
        raise ConfigError(_damaged_message(path, err)) from err


def _idx_split(cfg: DataConfig, train: bool) -> Split:
    folder = _raw_folder(cfg)
    paths = [_find(folder, stem) for stem in _SPLIT_FILES[train]]
    if None in paths:
        raise ConfigError(_missing_message(cfg, folder, "it was not prepared"))
    images, labels = (_read_idx(p) for p in paths)  # checked by prepare
    return Split(torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.astype(np.int64)))


def _synthetic(cfg: DataConfig, train: bool) -> Split:
    """Class prototypes (smooth random patterns) plus Gaussian noise, the same on every rank.

    Examples are drawn in blocks of a fixed size, each block from a seed of its own, so the
    first N examples are the same whatever the split's size: train_size and val_size take
    the first N, as of a data set read from files. (Drawn in one go, every image depended on
    the size asked for: val_size=300 and 301 shared no image, a data-size sweep no example.)
    """
    n = (cfg.train_size if train else cfg.val_size) or _SYNTHETIC_DEFAULT_SIZE[train]
    g = torch.Generator().manual_seed(cfg.seed)
    coarse = torch.randn(cfg.num_classes, cfg.channels, 7, 7, generator=g)
    prototypes = torch.nn.functional.interpolate(
        coarse, size=(cfg.image_size, cfg.image_size), mode="bilinear", align_corners=False
    )
    labels = torch.empty(n, dtype=torch.int64)
    images = torch.empty(n, cfg.channels, cfg.image_size, cfg.image_size)
    for block, start in enumerate(range(0, n, _SYNTHETIC_BLOCK)):
        # train and val differ, prototypes do not; 32-bit seeds, all a CPU generator keeps
        seed = np.random.SeedSequence([cfg.seed, int(train), block]).generate_state(1)[0]
        g.manual_seed(int(seed))
        end = min(start + _SYNTHETIC_BLOCK, n)  # each block drawn whole: torch draws a shorter tensor differently
        y = torch.randint(cfg.num_classes, (_SYNTHETIC_BLOCK,), generator=g)[:end - start]
        noise = torch.randn(_SYNTHETIC_BLOCK, *images.shape[1:], generator=g)[:end - start]
        labels[start:end] = y
        torch.add(prototypes[y], noise, alpha=cfg.noise, out=images[start:end])
    return Split(images, labels)


# data option -> loader (config, training split?) -> the whole split in memory. A data set
# of your own is one more entry (and a conf/data/<name>.yaml); prepare() counts its examples.
DATASETS: dict[str, Callable[[DataConfig, bool], Split]] = Registry("data set", {
    "fashion_mnist": _idx_split,
    "mnist": _idx_split,
    "synthetic": _synthetic,
})


def normalised(split: Split, cfg: DataConfig) -> torch.Tensor:
    """Images as float32 in one bulk operation: uint8 -> [0, 1] -> (x - mean) / std."""
    images = split.images
    if images.dtype == torch.uint8:
        images = images.float().div_(255.0)
    return images.sub(cfg.mean).div_(cfg.std)


# --------------------------------------------------------------------------- batches


def batch_sizes(examples: int, batch_size: int, drop_last: bool) -> list[int]:
    """The sizes of the batches a shard of `examples` is cut into: full ones, then the
    partial rest unless it is dropped."""
    full, rest = divmod(examples, batch_size)
    return [batch_size] * full + ([rest] if rest and not drop_last else [])


class MemoryBatches:
    """Batches drawn by index from tensors on the device, with DistributedSampler semantics."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, sampler: DistributedSampler, batch_size: int):
        self.x, self.y, self.sampler, self.batch_size = x, y, sampler, batch_size

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def indices(self) -> torch.Tensor:
        """This rank's example indices for the current epoch, in order."""
        return torch.tensor(list(self.sampler), dtype=torch.long)

    def __len__(self) -> int:
        return len(self.sizes())

    def sizes(self) -> list[int]:
        """Examples in each of an epoch's batches, in order."""
        return batch_sizes(len(self.sampler), self.batch_size, self.sampler.drop_last)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        idx = self.indices().to(self.x.device, non_blocking=True)
        stop = len(self) * self.batch_size if self.sampler.drop_last else len(idx)
        for start in range(0, stop, self.batch_size):
            batch = idx[start:start + self.batch_size]
            yield self.x.index_select(0, batch), self.y.index_select(0, batch)


# How the DataLoader starts its processes. A trainer started by torch.multiprocessing.spawn
# inherits "spawn" as its default, so each DataLoader process would start a fresh
# interpreter and import torch (seconds, inside epoch 1), where a trainer under torchrun
# or SLURM forks them in a tenth of a second. Fork on Linux makes every launcher alike,
# and its queues' semaphores need no resource tracker, which warned of "leaked
# semaphore objects" whenever a stopped run ended a trainer with its queues open.
_LOADER_START = "fork" if sys.platform.startswith("linux") else None


def _end_with_trainer(trainer_pid: int, _worker_id: int) -> None:
    """A DataLoader worker dies with the training process that started it. Otherwise, when
    a run is stopped, it lingers up to 10 s until its own check notices the parent is gone."""
    die_with_parent(trainer_pid)


class LoaderBatches:
    """The textbook path: DataLoader + DistributedSampler + per-sample transforms."""

    def __init__(self, dataset: Dataset, sampler: DistributedSampler, cfg: DataConfig, pin: bool):
        self.sampler = sampler
        self.loader = DataLoader(
            dataset,
            batch_size=cfg.batch_size,
            sampler=sampler,
            num_workers=cfg.num_workers,
            pin_memory=pin,
            drop_last=cfg.drop_last,
            persistent_workers=cfg.num_workers > 0,
            # Its own generator: starting an epoch would otherwise draw from the global
            # RNG and shift every dropout mask, so the two read paths would diverge.
            generator=torch.Generator().manual_seed(sampler.seed),
            worker_init_fn=functools.partial(_end_with_trainer, os.getpid()),
            multiprocessing_context=_LOADER_START if cfg.num_workers > 0 else None,
        )

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def indices(self) -> torch.Tensor:
        return torch.tensor(list(self.sampler), dtype=torch.long)

    def sizes(self) -> list[int]:
        """Examples in each of an epoch's batches, in order."""
        return batch_sizes(len(self.sampler), self.loader.batch_size, self.loader.drop_last)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        return iter(self.loader)


class ImageDataset(Dataset):
    """uint8 images served one at a time through PIL and torchvision transforms,
    exactly as torchvision's MNIST-style data sets do."""

    def __init__(self, split: Split, cfg: DataConfig):
        import torchvision.transforms as T

        self.split, self.mean, self.std = split, cfg.mean, cfg.std
        self.transform = T.Compose([T.ToTensor(), T.Normalize((cfg.mean,) * cfg.channels, (cfg.std,) * cfg.channels)])

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int):
        from PIL import Image

        image = self.split.images[i]
        if image.dtype != torch.uint8:  # synthetic data: float already, as `normalised` takes it
            return (image - self.mean) / self.std, int(self.split.labels[i])
        if image.shape[0] == 1:
            pil = Image.fromarray(image[0].numpy(), mode="L")
        elif image.shape[0] == 3:
            pil = Image.fromarray(image.permute(1, 2, 0).numpy(), mode="RGB")
        else:  # PIL has no mode for it: the same arithmetic on the tensor
            return (image.float().div(255.0) - self.mean) / self.std, int(self.split.labels[i])
        return self.transform(pil), int(self.split.labels[i])


@dataclass
class DataBundle:
    """What the training loop reads: training batches and this rank's validation shard."""

    train: MemoryBatches | LoaderBatches
    val_x: torch.Tensor
    val_y: torch.Tensor
    train_size: int
    val_size: int


def build_data(cfg: DataConfig, rank: int, world_size: int, seed: int, device: torch.device) -> DataBundle:
    """Load both splits and shard them for this rank."""
    train, val = load_split(cfg, train=True), load_split(cfg, train=False)
    sampler = DistributedSampler(
        range(len(train)), num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
        drop_last=cfg.drop_last,
    )
    if cfg.loader == "memory":
        batches = MemoryBatches(
            normalised(train, cfg).to(device), train.labels.to(device), sampler, cfg.batch_size
        )
    else:
        batches = LoaderBatches(ImageDataset(train, cfg), sampler, cfg, pin=device.type == "cuda")
    # Validation: no padding, every example on exactly one rank.
    shard = slice(rank, None, world_size)
    val_x = normalised(Split(val.images[shard], val.labels[shard]), cfg).to(device)
    return DataBundle(batches, val_x, val.labels[shard].to(device), len(train), len(val))
