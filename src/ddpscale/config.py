"""The config schema: one dataclass per group, registered with Hydra's ConfigStore.

Every `conf/<group>/*.yaml` starts from its schema in the defaults list, so an unknown
key or a value of the wrong type fails when Hydra composes the config. Checks that a
type cannot express (ranges, combinations) live in `validate`, which runs in the job
process before any worker starts. Every error names the key and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from hydra.core.config_store import ConfigStore
from hydra.plugins.config_source import ConfigLoadError
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from ddpscale.choices import keys_of_other_options, options_with_key


class ConfigError(ValueError):
    """A user-facing configuration error; the message names the key and the fix."""


# --------------------------------------------------------------------------- model


@dataclass
class ModelConfig:
    """Fields every model option has."""

    name: str = MISSING
    """Architecture, one of the `model=` options: cnn, wide_resnet."""


@dataclass
class CNNConfig(ModelConfig):
    """The classic two-convolution MNIST network (pytorch/examples' mnist)."""

    name: str = "cnn"
    conv1_channels: int = 32
    """Output channels of the first 3x3 convolution."""
    conv2_channels: int = 64
    """Output channels of the second 3x3 convolution."""
    hidden: int = 128
    """Width of the fully connected hidden layer."""
    dropout: float = 0.25
    """Dropout after the convolutions; twice this (at most 0.9) after the hidden layer. In [0, 1)."""


@dataclass
class WideResNetConfig(ModelConfig):
    """Wide residual network WRN-depth-width (Zagoruyko and Komodakis, 2016)."""

    name: str = "wide_resnet"
    depth: int = 16
    """Total depth; must be 6n + 4 (10, 16, 22, 28, ...)."""
    width: int = 4
    """Widening factor k: the three stages have 16k, 32k, 64k channels."""
    dropout: float = 0.0
    """Dropout between the convolutions of each block. In [0, 1)."""


# --------------------------------------------------------------------------- data


@dataclass
class DataConfig:
    """A data set and how each worker reads it."""

    name: str = MISSING
    """Data set, one of the `data=` options: fashion_mnist, mnist, synthetic."""
    root: str = "data"
    """Directory holding `<DatasetName>/raw/`; relative paths are taken from where you run."""
    download: bool = True
    """Download the data set into `root` when it is missing (needs internet)."""
    batch_size: int = 64
    """Examples per step on each worker; the global batch is batch_size x world size."""
    num_workers: int = 0
    """DataLoader worker processes per training process (data.loader=dataloader only)."""
    train_size: Optional[int] = None
    """Use only the first N training examples (null: all)."""
    val_size: Optional[int] = None
    """Use only the first N validation examples (null: all)."""
    loader: str = "memory"
    """memory: decode once into tensors and draw batches by index (on the GPU with CUDA);
    dataloader: the textbook torch DataLoader with per-sample transforms."""
    drop_last: bool = False
    """Drop the tail of each rank's shard that does not fill a batch, and the examples left
    over when the training set does not split evenly across ranks (false: DistributedSampler
    pads the shards to equal length with repeats, and every example is seen)."""
    channels: int = 1
    """Image channels (models read it from here)."""
    image_size: int = 28
    """Image height and width in pixels."""
    num_classes: int = 10
    """Number of classes."""
    mean: float = 0.5
    """Normalisation mean applied to pixels scaled to [0, 1]."""
    std: float = 0.5
    """Normalisation standard deviation."""
    noise: float = 0.0
    """Generated data only (synthetic, or a data set of your own): standard deviation of the
    noise added to each class prototype; refused for data sets read from files."""
    seed: int = 0
    """Generated data only: seed of the generated data set (the same on every rank; 0..2**32-1);
    refused for data sets read from files (train.seed varies shuffling and initial weights)."""


# --------------------------------------------------------------------------- optim


@dataclass
class OptimConfig:
    """Fields every optimizer has."""

    name: str = MISSING
    """Optimizer, one of the `optim=` options: sgd, adamw."""
    lr: float = 0.01
    """Learning rate (> 0); the key users sweep."""
    weight_decay: float = 0.0
    """L2 penalty (sgd) or decoupled weight decay (adamw); >= 0."""
    schedule: str = "cosine"
    """Learning-rate schedule over the whole run, stepped per optimizer step: cosine
    (from lr down to 0), constant, or one of your own in ddpscale.optim.SCHEDULES."""
    warmup_epochs: float = 0.0
    """Epochs (fractions allowed) of linear warm-up at the start, from lr / steps up to lr
    over that many optimizer steps; the schedule then runs over the steps left. The
    usual companion of a learning rate scaled with the global batch size. 0: none."""


@dataclass
class SGDConfig(OptimConfig):
    """Stochastic gradient descent with momentum."""

    name: str = "sgd"
    momentum: float = 0.9
    """Momentum factor in [0, 1)."""
    nesterov: bool = False
    """Nesterov momentum (needs momentum > 0)."""


@dataclass
class AdamWConfig(OptimConfig):
    """Adam with decoupled weight decay."""

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    beta1: float = 0.9
    """Decay of the first moment estimate, in [0, 1)."""
    beta2: float = 0.999
    """Decay of the second moment estimate, in [0, 1)."""
    eps: float = 1e-8
    """Added to the denominator for numerical stability."""


# --------------------------------------------------------------------------- distributed


@dataclass
class DistributedConfig:
    """How many workers, where they run and how they meet."""

    num_gpus: int = 1
    """Worker processes per node: one per GPU, or CPU processes where there is no GPU."""
    num_nodes: int = 1
    """Nodes taking part; world size = num_nodes x num_gpus."""
    node_id: int = 0
    """This node's index in [0, num_nodes); node 0 hosts global rank 0."""
    master_addr: Optional[str] = None
    """Host of node 0 (needed with num_nodes > 1; 127.0.0.1 on one node)."""
    master_port: Optional[int] = None
    """Rendezvous port on master_addr; a free one is picked when unset on one node."""
    backend: str = "auto"
    """auto (nccl on CUDA, gloo on CPU), nccl or gloo."""
    device: str = "auto"
    """auto (CUDA when there are num_gpus GPUs, else CPU), cuda or cpu."""
    timeout_s: float = 300.0
    """Seconds to wait for all workers at the rendezvous and in each collective."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size in MiB."""
    gradient_as_bucket_view: bool = True
    """Let gradients alias DDP's communication buckets (saves a copy and memory)."""
    static_graph: bool = False
    """Tell DDP the graph is the same every step (lets it skip some bookkeeping)."""
    comm_hook: str = "auto"
    """How DDP all-reduces gradients. auto: shm for CPU workers on one node, else none;
    none: DDP's own all-reduce over the process group (gloo or NCCL); shm: through a
    shared-memory segment (CPU, one node, Linux x86-64; bit-identical to none at 2
    workers); bf16 or fp16: DDP's compress hooks (half the bytes, gradients rounded to
    16 bits in transit)."""


# --------------------------------------------------------------------------- train


@dataclass
class TrainConfig:
    """The training loop."""

    epochs: int = 3
    """Passes over the training set (>= 1)."""
    seed: int = 0
    """Seed of weights, shuffling and dropout; the same on every rank (0..2**32-1)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step; DDP skips the all-reduce (no_sync) on all but the last."""
    precision: str = "fp32"
    """fp32, bf16 (autocast, CPU or CUDA) or fp16 (autocast with a gradient scaler, CUDA only)."""
    channels_last: bool = False
    """Store activations in NHWC order (faster convolutions on recent GPUs)."""
    compile: bool = False
    """Compile the model with torch.compile before wrapping it in DDP."""
    sync_probe_steps: int = 3
    """Steps per epoch timed with and without gradient sync to estimate the sync share (0: off)."""
    progress: bool = True
    """Show a progress bar (global rank 0 only)."""
    threads: Optional[int] = None
    """CPU threads per worker (null: the cores this process may use // num_gpus)."""
    malloc_cache: bool = True
    """CPU workers: keep freed memory for reuse (glibc malloc without mmap for big blocks
    and without trimming), so a step does not page-fault its activations in afresh;
    false: the C library's defaults."""


# --------------------------------------------------------------------------- top level


@dataclass
class Config:
    """A whole run: one option of each group plus the training loop."""

    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    optim: OptimConfig = MISSING
    distributed: DistributedConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)


# The built-in options' schemas, by group and name. validate() also holds a config to
# them: `optim.name=adamw` left on the SGD schema would reach the optimizer's builder
# without beta1, beta2 or eps.
_BUILT_IN_SCHEMAS = {
    ("model", "cnn"): CNNConfig, ("model", "wide_resnet"): WideResNetConfig,
    ("optim", "sgd"): SGDConfig, ("optim", "adamw"): AdamWConfig,
}


def register_configs() -> None:
    """Register the schemas so `conf/` can build on them (idempotent)."""
    cs = ConfigStore.instance()
    # Kept under schema/ so that `model=...` errors list only the real options.
    cs.store(group="schema", name="config", node=Config)
    for (group, name), schema in _BUILT_IN_SCHEMAS.items():
        cs.store(group=f"schema/{group}", name=name, node=schema)
    # The fields every option of a group has: what a plug-in without keys of its own starts
    # from (/schema/model/model@_here_, ...; README: Extending).
    cs.store(group="schema/model", name="model", node=ModelConfig)
    cs.store(group="schema/data", name="data", node=DataConfig)
    cs.store(group="schema/optim", name="optim", node=OptimConfig)
    cs.store(group="schema/distributed", name="distributed", node=DistributedConfig)


register_configs()


def to_config(cfg: DictConfig | Config) -> Config:
    """Turn a composed DictConfig into typed dataclasses (resolving interpolations).

    Raises ConfigError for a key the schema does not have: Hydra lets `+key=value` add
    one, and OmegaConf would drop it or keep it unread, so a typo would change nothing.
    """
    if isinstance(cfg, Config):
        return cfg
    unknown = unknown_keys(cfg)
    if unknown:
        raise ConfigError("; ".join(unknown))
    try:
        return OmegaConf.to_object(cfg)
    except MissingMandatoryValue as err:  # `~distributed`, `model.name=???`
        key = err.full_key
        if "." not in key:
            raise ConfigError(f"the {key} group has no option; choose one ({key}=<option>, see conf/{key}/) "
                              f"or drop the ~{key} override") from None
        raise ConfigError(f"{key} has no value; give it one ({key}=...), or leave it at its "
                          f"{key.split('.')[0]} option's value") from None


def unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """One message per key below `node` that its schema lacks, with the closest real key."""
    schema = OmegaConf.get_type(node)
    known = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else None
    problems = []
    for key in node.keys():
        path = f"{prefix}{key}"
        if known is not None and key not in known:
            others = options_with_key(prefix.rstrip("."), key)
            problems.append(_key_of_another_option(path, others, schema, f"+{path}...") if others
                            else _not_a_key(path, known, f"+{path}..."))
            continue
        child = None if OmegaConf.is_missing(node, key) else node[key]
        if isinstance(child, DictConfig):
            problems += unknown_keys(child, f"{path}.")
    return problems


def _key_of_another_option(path: str, options: list[str], schema: Any, override: str) -> str:
    """`path` is a key of other options of its group (optim.beta1, adamw's, added to sgd's
    config: Hydra's advice for `optim.beta1=0.9` with optim=sgd), not of the one chosen."""
    group = path.rpartition(".")[0]
    named = " or ".join(f"{group}={o}" for o in options)
    return (f"{path} is a key of {named}, not of this run's {group} option ({schema.__name__}); "
            f"choose {named}, or drop the {override} override")


def unknown_override_keys(overrides: list[str], conf_dir: Path | None = None) -> list[str]:
    """One message per `group.key=value` override whose key no option of the group has, or
    (given the primary config's directory, `conf_dir`) no option this command line chooses.

    Hydra refuses such an override with "To append to your config use +group.key=...",
    which ddpscale then refuses too; this names the closest real key instead, or the option
    that has it. An option's keys are those of its schema, stored under schema/<group>
    (README: Extending).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import OverrideParseException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException:
        return []  # Hydra names what it cannot read
    cs = ConfigStore.instance()
    schema = cs.load("schema/config.yaml").node
    top, groups = list(schema.keys()), set(cs.list("schema"))
    hints = typing.get_type_hints(Config)
    problems, of_some_options = [], []
    for override in parsed:
        path = override.key_or_group.split(".")
        if (override.type != OverrideType.CHANGE or override.package is not None or len(path) == 1
                or "/" in path[0] or path[0] == "hydra"):  # a group's option, or Hydra's own key
            continue
        if path[0] not in top:
            problems.append(_not_a_key(path[0], top, override.input_line))
        else:
            keys = [] if OmegaConf.is_missing(schema, path[0]) else list(schema[path[0]].keys())
            for option in cs.list(f"schema/{path[0]}") if path[0] in groups else []:
                keys += [k for k in cs.load(f"schema/{path[0]}/{option}").node.keys() if k not in keys]
            if path[1] not in keys:
                valid = f"keys of the {path[0]} options" if path[0] in groups else "valid here"
                problems.append(_not_a_key(f"{path[0]}.{path[1]}", keys, override.input_line, valid))
            elif path[0] in groups and path[1] not in _field_names(hints[path[0]]):
                of_some_options.append(override)
    return problems + keys_of_other_options(parsed, of_some_options, conf_dir)


def _field_names(schema: type) -> list[str]:
    return [f.name for f in dataclasses.fields(schema)]


def _not_a_key(path: str, known: list[str], override: str, valid: str = "valid here") -> str:
    """`path` is not a config key: the closest of `known` (the keys beside it), and the fix."""
    parent, _, key = path.rpartition(".")
    near = difflib.get_close_matches(key, known, n=1)
    hint = f"did you mean {parent + '.' if parent else ''}{near[0]}? " if near else ""
    return (f"{path} is not a config key ({hint}{valid}: {', '.join(known)}); "
            f"fix the name in the {override} override or drop it")


def as_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict of a config, for run.json and logs."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


# Keys each node (or rank) may set for itself: where it finds the data and the rendezvous,
# its own resources and patience, its console. Every other key shapes the run they share.
NODE_LOCAL_KEYS = frozenset({
    "distributed.node_id", "distributed.master_addr", "distributed.master_port",
    "distributed.timeout_s", "data.root", "data.download", "data.num_workers",
    "train.threads", "train.malloc_cache", "train.progress",
})


def shared_settings(cfg: Config) -> dict[str, Any]:
    """Every key that all nodes and ranks of a run must be given alike, flat ("optim.lr")."""
    def flat(node: dict, prefix: str = "") -> dict[str, Any]:
        out = {}
        for key, value in node.items():
            out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
        return out

    return {k: v for k, v in flat(as_dict(cfg)).items() if k not in NODE_LOCAL_KEYS}


def disagreement(settings: Mapping[str, Mapping[str, Any]], most: int = 4) -> str | None:
    """The keys on which `settings` (by whom: "node 1", "rank 3") differ, each with every
    value ("optim.lr (node 0: 0.05, node 1: 0.02)"), or None when they all agree."""
    keys = sorted({k for s in settings.values() for k in s})
    differ = [k for k in keys if len({repr(s.get(k)) for s in settings.values()}) > 1]
    if not differ:
        return None
    said = [f"{k} (" + ", ".join(f"{who}: {s.get(k)}" for who, s in settings.items()) + ")" for k in differ[:most]]
    more = f" and {len(differ) - most} more" if len(differ) > most else ""
    return ", ".join(said) + more


# --------------------------------------------------------------------------- validation

_CHOICES = {
    "data.loader": ("memory", "dataloader"),
    "distributed.backend": ("auto", "nccl", "gloo"),
    "distributed.device": ("auto", "cuda", "cpu"),
    "distributed.comm_hook": ("auto", "none", "shm", "bf16", "fp16"),
    "train.precision": ("fp32", "bf16", "fp16"),
}


def validate(cfg: Config) -> None:
    """Check ranges and combinations that types cannot express; raise ConfigError."""
    d, data, optim, train = cfg.distributed, cfg.data, cfg.optim, cfg.train
    _finite(cfg)
    _schema_fits_name(cfg)
    _at_least("distributed.num_gpus", d.num_gpus, 1, "worker processes per node")
    _at_least("distributed.num_nodes", d.num_nodes, 1, "nodes")
    if not 0 <= d.node_id < d.num_nodes:
        raise ConfigError(
            f"distributed.node_id={d.node_id} but distributed.num_nodes={d.num_nodes}; "
            f"use a node_id in 0..{d.num_nodes - 1}"
        )
    if d.num_nodes > 1 and not d.master_addr:
        raise ConfigError(
            f"distributed.num_nodes={d.num_nodes} needs distributed.master_addr: "
            "set it to the host name or IP of node 0 on every node"
        )
    if d.num_nodes > 1 and d.master_port is None:
        raise ConfigError(
            f"distributed.num_nodes={d.num_nodes} needs distributed.master_port: "
            "pick a free port on node 0 and pass the same value on every node, e.g. 29500"
        )
    if d.master_port is not None and not 1 <= d.master_port <= 65535:
        raise ConfigError(f"distributed.master_port={d.master_port} must be in 1..65535")
    _at_least("distributed.timeout_s", d.timeout_s, 1, "seconds: workers take seconds to start and "
              "meet, and a shorter wait failed blaming master_addr/master_port; the default is 300")
    _at_most("distributed.timeout_s", d.timeout_s, 7 * 24 * 3600, "a week; the rendezvous cannot count further")
    _positive("distributed.bucket_cap_mb", d.bucket_cap_mb)
    _at_most("distributed.bucket_cap_mb", d.bucket_cap_mb, 1e6, "a terabyte; DDP counts bucket bytes in 64 bits")

    _at_least("data.batch_size", data.batch_size, 1, "examples per worker and step")
    _at_least("data.num_workers", data.num_workers, 0, "DataLoader processes")
    for key in ("train_size", "val_size"):
        value = getattr(data, key)
        if value is not None:
            _at_least(f"data.{key}", value, 1, "examples, or null for all")
    _at_least("data.channels", data.channels, 1, "image channels")
    _at_least("data.num_classes", data.num_classes, 2, "classes")
    _positive("data.std", data.std)
    if data.noise < 0:
        raise ConfigError(f"data.noise={data.noise} must be >= 0")

    _positive("optim.lr", optim.lr)
    if optim.warmup_epochs < 0:
        raise ConfigError(f"optim.warmup_epochs={optim.warmup_epochs} must be >= 0 (0: no warm-up)")
    if optim.warmup_epochs >= train.epochs > 0:
        raise ConfigError(
            f"optim.warmup_epochs={optim.warmup_epochs:g} must be less than train.epochs={train.epochs}: "
            "the learning rate would still be climbing to optim.lr when the run ends; "
            "shorten the warm-up or raise train.epochs"
        )
    if optim.weight_decay < 0:
        raise ConfigError(f"optim.weight_decay={optim.weight_decay} must be >= 0")
    if isinstance(optim, SGDConfig):
        _fraction("optim.momentum", optim.momentum)
        if optim.nesterov and optim.momentum == 0:
            raise ConfigError("optim.nesterov=true needs optim.momentum > 0")
    if isinstance(optim, AdamWConfig):
        _fraction("optim.beta1", optim.beta1)
        _fraction("optim.beta2", optim.beta2)
        _positive("optim.eps", optim.eps)

    _at_least("train.epochs", train.epochs, 1, "passes over the data")
    _at_least("data.image_size", data.image_size, 1, "pixels per side")
    for key, seed in (("train.seed", train.seed), ("data.seed", data.seed)):
        if not 0 <= seed < 2**32:  # a CPU generator keeps the low 32 bits: seeds 2**32 apart were one run
            raise ConfigError(f"{key}={seed} must be in 0..{2**32 - 1}: torch's CPU generator keeps only "
                              "the low 32 bits of a seed, so seeds 2**32 apart would give the same run")
    _at_least("train.grad_accum_steps", train.grad_accum_steps, 1, "micro-batches per step")
    _at_least("train.sync_probe_steps", train.sync_probe_steps, 0, "probe steps (0: off)")
    _at_most("train.sync_probe_steps", train.sync_probe_steps, 1000,
             "each epoch runs 4 x this many extra forward and backward passes; the default 3 suffices")
    if train.threads is not None:
        _at_least("train.threads", train.threads, 1, "CPU threads per worker, or null")
        _at_most("train.threads", train.threads, 4096, "CPU threads per worker; null: this machine's share")

    _validate_model(cfg.model, data)
    for key, allowed in _CHOICES.items():
        group, name = key.split(".")
        value = getattr(getattr(cfg, group), name)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")


def _schema_fits_name(cfg: Config) -> None:
    for (group, name), schema in _BUILT_IN_SCHEMAS.items():
        node = getattr(cfg, group)
        if node.name != name:
            continue
        stored = _stored_schema(group, name)
        if stored is not schema:  # ConfigStore.store replaces an entry without a word
            held = "nothing" if stored is None else f"{stored.__module__}.{stored.__qualname__}"
            raise ConfigError(
                f"{group}={name} builds on schema/{group}/{name} in Hydra's ConfigStore, which now holds "
                f"{held}, not ddpscale's {schema.__name__}: a plug-in stored its schema under the "
                f"built-in's name; store it as schema/{group}/<a name of its own>, with a {group} "
                "option of that name (README: Extending)"
            )
        if not isinstance(node, schema):
            raise ConfigError(
                f"{group}.name={name} keeps the keys of another {group} option; choose the option "
                f"with {group}={name} (the config group), not by setting {group}.name"
            )


def _stored_schema(group: str, name: str) -> type | None:
    """The dataclass Hydra's ConfigStore holds as schema/<group>/<name>, or None."""
    try:
        return OmegaConf.get_type(ConfigStore.instance().load(f"schema/{group}/{name}.yaml").node)
    except ConfigLoadError:  # taken out of the store
        return None


def validate_for_device(cfg: Config, device: str) -> None:
    """Checks that depend on the device the run resolved to (cuda or cpu)."""
    if cfg.train.precision == "fp16" and device != "cuda":
        raise ConfigError("train.precision=fp16 needs CUDA; use train.precision=bf16 on the CPU")


def _validate_model(model: ModelConfig, data: DataConfig) -> None:
    if isinstance(model, CNNConfig):
        _fraction("model.dropout", model.dropout)
        for key in ("conv1_channels", "conv2_channels", "hidden"):
            _at_least(f"model.{key}", getattr(model, key), 1, "units")
        if data.image_size < 6:
            raise ConfigError(
                f"model=cnn needs images of at least 6x6 pixels, data.image_size={data.image_size}"
            )
    if isinstance(model, WideResNetConfig):
        _fraction("model.dropout", model.dropout)
        _at_least("model.width", model.width, 1, "widening factor")
        if model.depth < 10 or (model.depth - 4) % 6:
            raise ConfigError(
                f"model.depth={model.depth} must be 6n+4 with n >= 1 (10, 16, 22, 28, 40)"
            )
        if data.image_size < 5:  # its two stride-2 stages leave a 1x1 map, where BatchNorm
            raise ConfigError(   # fails on a batch of one, such as an epoch's last
                f"model=wide_resnet needs images of at least 5x5 pixels, data.image_size={data.image_size}"
            )


class Registry(dict):
    """A {name: builder} registry that keeps each name to its first builder: a plug-in that
    registered "cnn" replaced ddpscale's CNN, and results.csv said model=cnn of its MLP."""

    def __init__(self, what: str, entries: Mapping[str, Any]):
        super().__init__(entries)
        self.what = what

    def __setitem__(self, name: str, builder: Any) -> None:
        taken = self.get(name)
        if taken is not None and taken is not builder:
            raise ValueError(f"{self.what} {name!r} is already registered ({taken.__module__}."
                             f"{taken.__qualname__}); register yours under a name of its own")
        super().__setitem__(name, builder)


def registered(registry: Mapping[str, Any], key: str, name: str, where: str) -> Any:
    """registry[name] for the `key=name` option (model=cnn), or a ConfigError that names the
    options and the registry `where` a plug-in of one's own goes into."""
    if name not in registry:
        raise ConfigError(f"{key}={name!r} is unknown; valid: {', '.join(registry)}; one of "
                          f"your own goes into {where} (README: Extending)")
    return registry[name]


def built(thing: Any, kind: type, a_kind: str, key: str, name: str, wanted: str) -> Any:
    """`thing`, which the builder registered for `key=name` returned, when it is `a_kind`; a
    TypeError otherwise that says what it is and what it must be: a plug-in that returned
    its class, None or a tuple failed later in torch ("'torch.device' object has no
    attribute '_apply'")."""
    if not isinstance(thing, kind):
        got = (f"the class {thing.__name__}" if isinstance(thing, type) else "None" if thing is None
               else f"a {type(thing).__name__}")
        raise TypeError(f"{key}={name}'s builder returned {got}, not {a_kind}; it must be {wanted}")
    return thing


def _at_most(key: str, value: float, high: float, what: str) -> None:
    if value > high:
        shown = f"{value:g}" if isinstance(value, float) else value  # an int in full
        raise ConfigError(f"{key}={shown} must be at most {high:g} ({what})")


def _at_least(key: str, value: float, low: float, what: str) -> None:
    if value < low:
        raise ConfigError(f"{key}={value} must be >= {low} ({what})")


_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32


def _finite(node: Any, prefix: str = "") -> None:
    """Every float key finite and within float32 (the command line accepts inf and nan):
    optim.lr=inf would train to a nan loss, distributed.timeout_s=inf would crash the
    rendezvous, optim.lr=1e308 failed inside a worker without naming the key, and
    data.std=1e-320 is 0 in float32: the normalisation divided by it and trained to nan."""
    for f in dataclasses.fields(node):
        value, key = getattr(node, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _finite(value, f"{key}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} must be a finite number")
        elif isinstance(value, float) and abs(value) > _FLOAT32_MAX:
            raise ConfigError(f"{key}={value:g} is beyond what a float32 tensor holds "
                              f"(at most {_FLOAT32_MAX:.3g} in size)")
        elif isinstance(value, float) and 0 < abs(value) < _FLOAT32_TINY:
            raise ConfigError(f"{key}={value!r} is too small for a float32 tensor, which holds it as 0 or "
                              f"without precision; give at least {_FLOAT32_TINY:.3g} in size (or 0 where 0 is allowed)")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{key}={value} must be > 0")


def _fraction(key: str, value: float) -> None:
    if not 0 <= value < 1:
        raise ConfigError(f"{key}={value} must be in [0, 1)")
