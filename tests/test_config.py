"""Config composition with Hydra's compose API, and every bad input's message."""

from __future__ import annotations

import dataclasses
import gzip
import re
import subprocess
import sys
import time

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigAttributeError, ValidationError

from conftest import QUICK, REPO, output, read_run, run_train
from ddpscale.config import (
    AdamWConfig, CNNConfig, Config, ConfigError, DataConfig, ModelConfig, SGDConfig, WideResNetConfig,
    register_configs, to_config, validate,
)
from ddpscale.sweep import command_line_problem, register_resolvers

register_resolvers()


def composed(*overrides: str) -> Config:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return to_config(compose("config", overrides=list(overrides)))


def test_defaults_are_cnn_fashion_mnist_sgd_one_worker():
    cfg = composed()
    assert isinstance(cfg.model, CNNConfig) and isinstance(cfg.optim, SGDConfig)
    assert (cfg.data.name, cfg.distributed.num_gpus, cfg.train.epochs) == ("fashion_mnist", 1, 3)
    validate(cfg)


@pytest.mark.parametrize("group,option,schema", [
    ("model", "cnn", CNNConfig), ("model", "wide_resnet", WideResNetConfig),
    ("optim", "sgd", SGDConfig), ("optim", "adamw", AdamWConfig),
])
def test_every_group_option_composes_to_its_schema(group, option, schema):
    cfg = composed(f"{group}={option}")
    assert isinstance(getattr(cfg, group), schema)
    validate(cfg)


@pytest.mark.parametrize("option", ["fashion_mnist", "mnist", "synthetic"])
def test_every_data_option_composes(option):
    cfg = composed(f"data={option}")
    assert cfg.data.name == option
    validate(cfg)


@pytest.mark.parametrize("override,path,expected", [
    ("data.root=/somewhere", "data.root", "/somewhere"),
    ("data.download=false", "data.download", False),
    ("data.batch_size=128", "data.batch_size", 128),
    ("data.train_size=1000", "data.train_size", 1000),
    ("data.val_size=200", "data.val_size", 200),
    ("data.num_workers=2", "data.num_workers", 2),
    ("optim.lr=0.05", "optim.lr", 0.05),
    ("optim.momentum=0.5", "optim.momentum", 0.5),
    ("optim.weight_decay=0.0005", "optim.weight_decay", 0.0005),
    ("distributed.num_gpus=4", "distributed.num_gpus", 4),
    ("distributed.num_nodes=2", "distributed.num_nodes", 2),
    ("distributed.node_id=1", "distributed.node_id", 1),
    ("distributed.master_addr=10.0.0.1", "distributed.master_addr", "10.0.0.1"),
    ("distributed.master_port=29500", "distributed.master_port", 29500),
    ("distributed.backend=gloo", "distributed.backend", "gloo"),
    ("distributed.device=cpu", "distributed.device", "cpu"),
    ("train.epochs=7", "train.epochs", 7),
    ("train.seed=42", "train.seed", 42),
    ("data.drop_last=true", "data.drop_last", True),
    ("optim.schedule=constant", "optim.schedule", "constant"),
    ("optim.warmup_epochs=0.5", "optim.warmup_epochs", 0.5),
    ("train.progress=false", "train.progress", False),
])
def test_every_documented_key_lands_where_it_should(override, path, expected):
    cfg = composed(override)
    group, key = path.split(".")
    assert getattr(getattr(cfg, group), key) == expected


def test_model_options_read_shape_from_data():
    cfg = composed("model=wide_resnet", "model.depth=10", "model.width=2", "data=synthetic",
                   "data.channels=3", "data.image_size=32", "data.num_classes=5")
    import torch

    from ddpscale.models import build_model

    net = build_model(cfg.model, cfg.data)
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 5)


@pytest.mark.parametrize("group,returns,says", [
    ("model", lambda cfg, data: CNNConfig, "model=mine's builder returned the class CNNConfig, not an nn.Module; "
                                           "it must be a builder(model_cfg, data_cfg) that returns the model"),
    ("model", lambda cfg, data: None, "model=mine's builder returned None, not an nn.Module"),
    ("optim", lambda params, cfg: list(params), "optim=mine's builder returned a list, not a torch.optim.Optimizer; "
                                                "it must be a builder(params, optim_cfg) that returns the optimizer"),
])
def test_a_plugged_in_builder_returning_the_wrong_thing_is_named(monkeypatch, group, returns, says):
    # A model builder that returned its class failed in .to(device) with "'torch.device' object
    # has no attribute '_apply'"; a list for an optimizer, at the first step.
    import torch

    from ddpscale.models import MODELS, build_model
    from ddpscale.optim import OPTIMIZERS, build_optimizer

    cfg = composed("data=synthetic")
    monkeypatch.setitem(MODELS if group == "model" else OPTIMIZERS, "mine", returns)
    with pytest.raises(TypeError, match=re.escape(says)):
        if group == "model":
            build_model(dataclasses.replace(cfg.model, name="mine"), cfg.data)
        else:
            build_optimizer([torch.nn.Parameter(torch.zeros(1))], dataclasses.replace(cfg.optim, name="mine"))


@pytest.mark.parametrize("overrides,error", [
    # Hydra's message repeats the override; what is wrong with it is in its cause
    (["optim.lrr=0.1"], "Key 'lrr' not in 'SGDConfig'"),
    (["distributed.num_gpus=two"], "Value 'two' of type 'str' could not be converted to Integer"),
    (["model=resnet9000"], "Could not find 'model/resnet9000'\n\nAvailable options in 'model':\n\tcnn\n\twide_resnet"),
    (["train.epochs=1.5"], "Value '1.5' of type 'float' could not be converted to Integer"),
])
def test_typos_and_wrong_types_fail_at_compose_time(overrides, error):
    with pytest.raises((ConfigCompositionException, ValidationError, ConfigAttributeError)) as failed:
        composed(*overrides)
    assert re.search(error, f"{failed.value}\n{failed.value.__cause__}"), failed.value


@pytest.mark.parametrize("overrides,error", [
    (["+trian.epochs=1"], "trian is not a config key \\(did you mean train\\?"),
    (["+train.epoch=2"], "train.epoch is not a config key \\(did you mean train.epochs\\?"),
    (["+optim.momentun=0.5"], "optim.momentun is not a config key \\(did you mean optim.momentum\\?"),
    (["+model.foo=2"], "model.foo is not a config key \\(valid here: name, conv1_channels"),
    # Hydra answers optim.beta1=0.9 (with the default optim=sgd) with "use +optim.beta1=0.9";
    # that was refused next as "not a config key", naming sgd's keys and not adamw
    (["+optim.beta1=0.9"], "optim.beta1 is a key of optim=adamw, not of this run's optim option "
                           "\\(SGDConfig\\); choose optim=adamw, or drop the \\+optim.beta1... override"),
    (["optim=adamw", "+optim.momentum=0.5"], "optim.momentum is a key of optim=sgd, not of this run's optim option"),
    (["+model.depth=16"], "model.depth is a key of model=wide_resnet, not of this run's model option \\(CNNConfig"),
])
def test_keys_added_with_plus_must_be_in_the_schema(overrides, error):
    """Hydra lets `+key=value` add any key; one the schema lacks would be read by nothing."""
    with pytest.raises(ConfigError, match=error):
        composed(*overrides)


@pytest.mark.parametrize("overrides,error", [
    (["distributed.num_gpus=0"], "distributed.num_gpus=0 must be >= 1"),
    (["distributed.num_gpus=-1"], "distributed.num_gpus=-1 must be >= 1"),
    (["data.batch_size=0"], "data.batch_size=0 must be >= 1"),
    (["optim.lr=0"], "optim.lr=0.0 must be > 0"),
    (["optim.lr=-0.1"], "optim.lr=-0.1 must be > 0"),
    (["optim.lr=inf"], "optim.lr=inf must be a finite number"),
    (["data.mean=nan"], "data.mean=nan must be a finite number"),
    (["distributed.timeout_s=inf"], "distributed.timeout_s=inf must be a finite number"),
    (["distributed.timeout_s=0.1"], "distributed.timeout_s=0.1 must be >= 1 \\(seconds"),
    (["optim.lr=1e308"], "optim.lr=1e\\+308 is beyond what a float32 tensor holds"),
    (["optim.weight_decay=-1e39"], "optim.weight_decay=-1e\\+39 is beyond what a float32 tensor holds"),
    (["data.std=1e-320"], "data.std=1e-320 is too small for a float32 tensor.*at least 1.18e-38 in size"),
    (["optim.weight_decay=-1e-39"], "optim.weight_decay=-1e-39 is too small for a float32 tensor"),
    (["train.epochs=0"], "train.epochs=0 must be >= 1"),
    (["distributed.num_nodes=2", "distributed.node_id=2"], "node_id=2 but distributed.num_nodes=2; use a "
                                                            "node_id in 0..1"),
    (["distributed.num_nodes=2", "distributed.node_id=1"], "needs distributed.master_addr: set it to the host "
                                                            "name or IP of node 0"),
    (["distributed.num_nodes=2", "distributed.master_addr=h"], "needs distributed.master_port: pick a free port "
                                                                "on node 0"),
    (["model=wide_resnet", "model.depth=12"], "model.depth=12 must be 6n\\+4"),
    (["model=wide_resnet", "data.image_size=0"], "data.image_size=0 must be >= 1"),
    (["model=wide_resnet", "data=synthetic", "data.image_size=4"],
     "model=wide_resnet needs images of at least 5x5 pixels, data.image_size=4"),
    (["train.seed=18446744073709551616"], "train.seed=18446744073709551616 must be in 0..4294967295"),
    (["train.seed=4294967296"], "train.seed=4294967296 must be in 0..4294967295: torch's CPU generator keeps "
                                "only the low 32 bits"),
    (["train.seed=-1"], "train.seed=-1 must be in 0..4294967295"),
    (["data=synthetic", "data.seed=18446744073709551615"], "data.seed=18446744073709551615 must be in "
                                                            "0..4294967295"),
    (["data.loader=fast"], "data.loader='fast' is not one of memory, dataloader"),
    (["distributed.comm_hook=int8"], "distributed.comm_hook='int8' is not one of auto, none, shm, bf16, fp16"),
    (["optim=adamw", "optim.beta2=1.0"], "optim.beta2=1.0 must be in \\[0, 1\\)"),
    (["train.grad_accum_steps=0"], "train.grad_accum_steps=0 must be >= 1"),
    (["optim.warmup_epochs=-1"], "optim.warmup_epochs=-1.0 must be >= 0 \\(0: no warm-up\\)"),
    (["optim.warmup_epochs=3", "train.epochs=3"], "optim.warmup_epochs=3 must be less than train.epochs=3: "
                                                  "the learning rate would still be climbing"),
    (["~distributed"], "the distributed group has no option; choose one \\(distributed=<option>"),
    (["model.name=???"], "model.name has no value; give it one"),
    (["distributed.timeout_s=1e30"], "distributed.timeout_s=1e\\+30 must be at most 604800 \\(a week"),
    (["distributed.bucket_cap_mb=1e30"], "distributed.bucket_cap_mb=1e\\+30 must be at most 1e\\+06"),
    (["train.sync_probe_steps=-1"], "train.sync_probe_steps=-1 must be >= 0"),
    (["train.sync_probe_steps=1000000000"], "train.sync_probe_steps=1000000000 must be at most 1000 \\(each epoch runs 4 x"),
    (["train.threads=0"], "train.threads=0 must be >= 1"),
    (["train.threads=2147483648"], "train.threads=2147483648 must be at most 4096"),
    (["optim.name=adamw"], "optim.name=adamw keeps the keys of another optim option; choose the option "
                           "with optim=adamw"),
    (["optim=adamw", "optim.name=sgd"], "choose the option with optim=sgd"),
    (["model.name=wide_resnet"], "choose the option with model=wide_resnet"),
])
def test_bad_values_name_the_key(overrides, error):
    with pytest.raises(ConfigError, match=error):
        validate(composed(*overrides))


@dataclasses.dataclass
class _OtherSchema(ModelConfig):
    name: str = "cnn"
    width: int = 3


@dataclasses.dataclass
class _DerivedCNNConfig(CNNConfig):
    conv1_channels: int = 8


@pytest.mark.parametrize("replacement", [_OtherSchema, _DerivedCNNConfig])
def test_a_schema_stored_under_a_built_in_name_is_refused_naming_it(replacement):
    # ConfigStore.store replaces an entry silently: model=cnn then ran on the plug-in's
    # keys (or, derived from CNNConfig, on its defaults) and results.csv said model=cnn.
    ConfigStore.instance().store(group="schema/model", name="cnn", node=replacement)
    try:
        with pytest.raises(ConfigError, match=(
                "model=cnn builds on schema/model/cnn in Hydra's ConfigStore, which now holds "
                f"{__name__}.{replacement.__qualname__}, not ddpscale's CNNConfig: a plug-in stored its "
                "schema under the built-in's name; store it as schema/model/<a name of its own>")):
            validate(composed())
        validate(composed("model=wide_resnet"))  # a run that does not use it is left alone
    finally:
        register_configs()
    validate(composed())


# The same inputs through the real command line: a clear message, non-zero, in seconds,
# and no worker started.
# Each keeps a run.json saying what failed, but for these: refused before the job by Hydra
# (a wrong type or name) or by ddpscale (a sweep's setting without -m), or a node other than 0's.
KEEP_NO_RUN_JSON = {"distributed.num_gpus=two", "model=resnet9000", "optim.lrr=0.1", "distributed.node_id=1",
                    "distributed.node_id=3", "+experiment=scaling_study", "hydra/launcher=slurm",
                    "hydra/launcher=slurm_local"}


@pytest.mark.parametrize("overrides,message", [
    (["distributed.num_gpus=0"], "distributed.num_gpus=0 must be >= 1"),
    (["distributed.num_gpus=-1"], "distributed.num_gpus=-1 must be >= 1"),
    (["distributed.num_gpus=two"], "Value 'two' of type 'str' could not be converted to Integer\n"
                                   "    full_key: distributed.num_gpus"),
    (["data.batch_size=0"], "data.batch_size=0 must be >= 1"),
    (["optim.lr=0"], "optim.lr=0.0 must be > 0"),
    (["train.epochs=0"], "train.epochs=0 must be >= 1"),
    (["model=resnet9000"], "Could not find 'model/resnet9000'\n\nAvailable options in 'model':\n\tcnn\n"
                           "\twide_resnet"),
    (["optim.schedule=linear"], "optim.schedule='linear' is unknown; valid: cosine, constant; one of your own "
                                "goes into ddpscale.optim.SCHEDULES"),
    # Hydra's own answer, "To append to your config use +optim.lrr=0.1", was refused next
    (["optim.lrr=0.1"], "error: optim.lrr is not a config key (did you mean optim.lr? keys of the optim "
                        "options: name, lr,"),
    (["+trian.epochs=1"], "trian is not a config key (did you mean train?"),
    (["optim.name=adamw"], "choose the option with optim=adamw"),
    (["data.batch_size=???"], "data.batch_size has no value; give it one (data.batch_size=...)"),
    (["distributed.num_nodes=2", "distributed.node_id=3"], "distributed.node_id=3 but distributed.num_nodes=2; "
                                                            "use a node_id in 0..1"),
    (["distributed.num_nodes=2", "distributed.node_id=1"], "distributed.num_nodes=2 needs distributed.master_addr: "
                                                            "set it to the host name or IP of node 0 on every node"),
    # an unknown host fails here, not after distributed.timeout_s (60 s in QUICK, 300 by default)
    *[(["distributed.num_nodes=2", f"distributed.node_id={n}", "distributed.master_addr=badhost.invalid",
        "distributed.master_port=29999"], "distributed.master_addr='badhost.invalid' does not resolve")
      for n in (0, 1)],
    (["distributed.backend=nccl", "distributed.device=cpu"], "distributed.backend=nccl needs CUDA devices but "
                                                              "this run uses the CPU; use distributed.backend=gloo"),
    (["distributed.device=cuda"], "CUDA devices are visible; use distributed.device=cpu (or auto)"),
    (["distributed.num_gpus=2", "data.batch_size=512", "data.drop_last=true"],
     "data.batch_size=512 is more than each of the 2 worker(s) gets (256 of 512 training examples), "
     "and data.drop_last=true drops that partial batch, so an epoch would train no step; lower "
     "data.batch_size to 256 or less, raise data.train_size or set data.drop_last=false"),
    # no batch size is small enough: one example for two workers
    (["distributed.num_gpus=2", "data.train_size=1", "data.batch_size=1", "data.drop_last=true"],
     "data.batch_size=1 is more than each of the 2 worker(s) gets (0 of 1 training examples), and "
     "data.drop_last=true drops that partial batch, so an epoch would train no step; raise data.train_size "
     "to 2 or more (one example per worker at least), run fewer workers or set data.drop_last=false"),
    (["distributed.comm_hook=shm", "distributed.num_nodes=2", "distributed.master_addr=127.0.0.1",
      "distributed.master_port=29999"], "distributed.comm_hook=shm needs CPU workers on one node, but this run "
                                        "has 2 nodes; use distributed.comm_hook=auto (or none)"),
    # without -m, Hydra would run one job with none of the experiment's grid values
    (["+experiment=scaling_study"], "this config holds a sweep grid (hydra.sweeper.params: "
                                    "distributed.num_gpus=1,2,4, data.batch_size=64,256"),
    # without -m, Hydra uses no launcher: the run trained here (on a login node), saying nothing
    (["hydra/launcher=slurm"], "hydra/launcher=slurm submits the jobs of a sweep, which only -m runs; add -m"),
    (["hydra/launcher=slurm_local"], "hydra/launcher=slurm_local submits the jobs of a sweep, which only -m runs; "
                                     "add -m"),
])
def test_bad_input_on_the_command_line_fails_fast(tmp_path, overrides, message):
    start = time.monotonic()
    proc = run_train(*QUICK, f"hydra.run.dir={tmp_path}/run", *overrides, timeout=60)
    assert proc.returncode != 0
    assert message in output(proc)
    assert "starting" not in output(proc)  # no worker was started
    assert time.monotonic() - start < 30
    recorded = not KEEP_NO_RUN_JSON.intersection(overrides)
    assert (tmp_path / "run" / "run.json").exists() == recorded
    if recorded:
        run = read_run(tmp_path / "run")
        assert run["status"] == "failed" and message in run["error"]
        assert run["overrides"][-len(overrides):] == overrides and run["config"]["train"]  # what was asked


@pytest.mark.parametrize("override,message", [
    ("train.epochs=-1", "train.epochs=-1 must be >= 1 (passes over the data)"),  # validate
    ("data.batch_size=???", "data.batch_size has no value; give it one (data.batch_size=...)"),  # to_config
])
def test_a_refused_config_is_answered_without_importing_torch(tmp_path, override, message):
    # The job imported torch (1.5 s of the 2.2 s it took to answer) before Hydra composed the
    # config, only to refuse it with checks that need none.
    proc = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "train.py"), override,
                           f"hydra.run.dir={tmp_path}"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"error: {message}" in output(proc), output(proc)[-2000:]
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "hydra" in imported and "torch" not in imported
    run = read_run(tmp_path)
    assert (run["status"], run["overrides"]) == ("failed", [override]) and run["error"].startswith(message)
    import torch  # here, not in the job: run.json still names the CUDA torch was built for

    assert run["config"]["train"]["seed"] == 0 and run["versions"]["cuda"] == torch.version.cuda


def test_missing_data_says_where_it_looked_and_how_to_fix(tmp_path):
    proc = run_train(f"data.root={tmp_path}/nothing", "data.download=false",
                     f"hydra.run.dir={tmp_path}/run", timeout=60)
    assert proc.returncode != 0
    text = output(proc)
    assert f"{tmp_path}/nothing/FashionMNIST/raw" in text
    assert "data.download=true" in text and "data=synthetic" in text


def test_a_failed_download_says_why_and_leaves_no_empty_folders(tmp_path):
    refused = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused
    proc = run_train(f"data.root={tmp_path}/data/deeper", f"hydra.run.dir={tmp_path}/run", timeout=120,
                     env={"http_proxy": refused, "https_proxy": refused, "no_proxy": ""})
    assert proc.returncode == 2, output(proc)
    assert "the download failed" in output(proc) and "data=synthetic" in output(proc)
    assert not (tmp_path / "data").exists()  # a retry downloads again rather than finding a shell


@pytest.mark.parametrize("overrides,message", [
    (["data.num_classes=5"], "data=fashion_mnist has 10 classes but data.num_classes=5"),
    (["data.num_classes=20"], "data=fashion_mnist has 10 classes but data.num_classes=20"),
    (["data.image_size=32"], "data=fashion_mnist has 1x28x28 images but the config says"),
    (["data.noise=2"], "data.noise=2.0 changes nothing for data=fashion_mnist, which is read from files"),
    (["data.seed=7"], "data.seed=7 changes nothing for data=fashion_mnist, which is read from files"),
    (["data.train_size=60001"], "data.train_size=60001 is more than data=fashion_mnist has "
                                "(60000 training examples); lower data.train_size, or set data.train_size=null"),
    (["data.val_size=20000"], "data.val_size=20000 is more than data=fashion_mnist has "
                              "(10000 validation examples); lower data.val_size, or set data.val_size=null"),
])
def test_data_that_does_not_fit_the_config_fails_before_any_worker(tmp_path, fmnist_root, overrides, message):
    proc = run_train(f"data.root={fmnist_root}", *overrides, f"hydra.run.dir={tmp_path}", timeout=60)
    assert proc.returncode == 2, output(proc)  # a config error, not a worker's failure
    assert message in output(proc) and "starting" not in output(proc)


@pytest.mark.parametrize("name,cut_to", [("train-images-idx3-ubyte.gz", 1_000_000),
                                         ("t10k-labels-idx1-ubyte", 9000)])
def test_a_cut_off_data_file_is_named_before_any_worker(tmp_path, fmnist_root, name, cut_to):
    # An interrupted download or copy, gzipped or not: without the check the worker died
    # of "EOFError: Compressed file ended before the end-of-stream marker was reached".
    raw = tmp_path / "data" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for source in (fmnist_root / "FashionMNIST" / "raw").glob("*.gz"):
        data = source.read_bytes()
        if source.name == f"{name}.gz":  # the same file unpacked, as some mirrors serve it
            data = gzip.decompress(data)
        target = raw / (name if source.name.startswith(name) else source.name)
        target.write_bytes(data[:cut_to] if target.name == name else data)
    proc = run_train(f"data.root={tmp_path}/data", f"hydra.run.dir={tmp_path}/run", timeout=60)
    assert proc.returncode == 2, output(proc)
    assert f"the data file {raw / name} is damaged or cut off" in output(proc)
    assert "starting" not in output(proc)


def _label_200(data: bytes) -> bytes:
    raw = bytearray(gzip.decompress(data))
    raw[-1] = 200
    return gzip.compress(bytes(raw))


def _header(first: bytes):
    def change(data: bytes) -> bytes:
        return gzip.compress(first + gzip.decompress(data)[len(first):])
    return change


@pytest.mark.parametrize("change,message", [
    # swapped names: a worker died of "IndexError: tuple index out of range"
    ({"train-images-idx3-ubyte.gz": "train-labels-idx1-ubyte.gz",
      "train-labels-idx1-ubyte.gz": "train-images-idx3-ubyte.gz"}, "holds an array of shape (60000,) and"),
    # a label beyond the classes: a worker died after a whole epoch, "Target 200 is out of bounds"
    ({"t10k-labels-idx1-ubyte.gz": _label_200}, "t10k-labels-idx1-ubyte.gz has labels beyond the 10 classes"),
    # not IDX bytes: it trained on them, exit 0
    ({"train-images-idx3-ubyte.gz": _header(b"\xff\xff\x0d")}, "train-images-idx3-ubyte.gz is damaged or cut off "
     "(its header starts ff ff 0d 03, not 00 00 08 as an IDX file of bytes does)"),
    ({"train-labels-idx1-ubyte.gz": _header(b"\x00\x00\x09")}, "its header starts 00 00 09 01"),
    # a directory in its place: "no data ... and the download failed"
    ({"t10k-labels-idx1-ubyte.gz": "mkdir"}, "t10k-labels-idx1-ubyte.gz is not a file, but the data file "
     "t10k-labels-idx1-ubyte belongs there; remove it and run again"),
])
def test_data_files_of_the_wrong_kind_are_named_before_any_worker(tmp_path, fmnist_root, change, message):
    raw = tmp_path / "data" / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    source = fmnist_root / "FashionMNIST" / "raw"
    for path in source.glob("*.gz"):
        how = change.get(path.name, path.name)
        if callable(how):
            (raw / path.name).write_bytes(how(path.read_bytes()))
        elif how == "mkdir":
            (raw / path.name).mkdir()
        else:
            (raw / how).write_bytes(path.read_bytes())
    proc = run_train(f"data.root={tmp_path}/data", "data.download=false", f"hydra.run.dir={tmp_path}/run",
                     timeout=60)
    assert proc.returncode == 2, output(proc)
    assert message in output(proc) and "starting" not in output(proc)


def test_a_home_relative_data_root_means_the_home_directory(tmp_path):
    proc = run_train("data.root='~/nothing'", "data.download=false", f"hydra.run.dir={tmp_path}/run",
                     env={"HOME": str(tmp_path)}, timeout=60)
    assert proc.returncode != 0
    assert f"{tmp_path}/nothing/FashionMNIST/raw" in output(proc)  # not <cwd>/~/nothing


@pytest.mark.parametrize("argv", [
    ["-m", "train.seed=1", "optim.lr=2"], ["train.seed=1", "optim.lr=2", "-m"],
    ["--multirun", "hydra/launcher=slurm", "train.seed=1"], ["--info"], ["-cn", "config", "train.seed=1"],
    ["--config-dir", "X", "train.seed=1", "-m"], ["~key", "+key=v", "-m"],
    ["'data.root=x y'", "data.root=\"z w\""], ["--cfg", "job", "train.seed=1"], ["train.seed=1", "--cfg", "job"],
    ["--help"],
    ["train.seed=1", "--multirnu", "optim.lr=2"],  # an unknown flag: Hydra names it, ddpscale does not guess
])
def test_command_lines_hydra_reads_are_left_to_it(argv):
    assert command_line_problem(argv) is None


@pytest.mark.parametrize("argv,message", [
    (["trian.epochs=1"], "trian is not a config key (did you mean train? valid here: model, data, optim, "
                         "distributed, train); fix the name in the trian.epochs=1 override or drop it"),
    (["-m", "optim.lrr=0.1,0.2"], "optim.lrr is not a config key (did you mean optim.lr? keys of the optim "
                                  "options: name, lr, weight_decay, schedule, warmup_epochs, beta1, beta2, eps, "
                                  "momentum, nesterov); fix the name in the optim.lrr=0.1,0.2 override or drop it"),
    (["model.depht=16", "model=wide_resnet"], "model.depht is not a config key (did you mean model.depth? keys of "
                                              "the model options: name, conv1_channels, conv2_channels, hidden, "
                                              "dropout, depth, width); fix the name in the model.depht=16 override "
                                              "or drop it"),
    (["train.epoch=2"], "train.epoch is not a config key (did you mean train.epochs? valid here: epochs, seed,"),
])
def test_an_override_of_a_key_no_option_has_names_the_closest_key(argv, message):
    # Hydra answered "To append to your config use +optim.lrr=0.1", which ddpscale refuses next
    problem = command_line_problem(argv)
    assert problem is None if message is None else problem.startswith(message), problem


@pytest.mark.parametrize("argv,message", [
    (["optim.beta1=0.8"], "optim.beta1 is a key of optim=adamw, not of optim=sgd (the default optim, from "
                          "conf/config.yaml); add optim=adamw, or drop optim.beta1=0.8"),
    (["optim=adamw", "optim.momentum=0.5"], "optim.momentum is a key of optim=sgd, not of optim=adamw (the optim "
                                            "chosen here); choose optim=sgd in place of optim=adamw, or drop"),
    (["model=cnn", "model.depth=22"], "model.depth is a key of model=wide_resnet, not of model=cnn (the model "
                                      "chosen here); choose model=wide_resnet in place of model=cnn, or drop"),
    # scaling_study's defaults list sets model: cnn
    (["+experiment=scaling_study", "model.width=2", "-m"], "model.width is a key of model=wide_resnet, not of "
                                                           "model=cnn (the model this command line composes"),
    # Hydra composes every job of a sweep with every fixed override: it refused the sweep with
    # "To append to your config use +optim.beta1=0.8", running none of its jobs
    (["optim=sgd,adamw", "optim.beta1=0.8", "-m"], "optim.beta1 is a key of optim=adamw, not of optim=sgd "
                                                    "(swept here), and Hydra gives an override to every job of a "
                                                    "sweep, so it cannot compose the optim=sgd jobs; sweep optim=adamw "
                                                    "with optim.beta1=0.8 in one command and optim=sgd without it"),
])
def test_an_override_of_a_key_only_another_option_has_names_that_option(argv, message):
    # Hydra answered "To append to your config use +optim.beta1=0.8", which ddpscale refuses next
    problem = command_line_problem(argv)
    assert problem is not None and problem.startswith(message), problem


@pytest.mark.parametrize("argv", [
    ["optim=adamw", "optim.beta1=0.8"], ["model=wide_resnet", "model.depth=22", "model.width=2"],
    ["optim=adamw", "optim.beta1=0.8,0.9", "-m"],
    ["+experiment=scaling_study", "model=wide_resnet", "model.width=2", "-m"],
    ["optim.momentum=0.5", "data=synthetic", "data.seed=3"],
])
def test_an_override_of_a_key_the_chosen_options_have_passes(argv):
    assert command_line_problem(argv) is None


def test_a_key_of_another_option_is_refused_before_hydra_composes(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "optim.beta1=0.8"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, output(proc)
    assert "add optim=adamw, or drop optim.beta1=0.8" in proc.stderr
    assert "To append" not in output(proc) and not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [["--cfg", "job", "optim.lr=0.05"], ["optim.lr=0.05", "--cfg", "job"]])
def test_cfg_job_shows_the_composed_config(argv):
    proc = run_train(*argv, timeout=60)  # flags before or after all the overrides
    assert proc.returncode == 0, output(proc)
    assert "lr: 0.05" in proc.stdout and "num_gpus: 1" in proc.stdout


@pytest.mark.parametrize("argv,message", [
    # argparse printed its usage and "unrecognized arguments: distributed.num_gpus=1,2"
    (["+experiment=scaling_study", "-m", "distributed.num_gpus=1,2"],
     "distributed.num_gpus=1,2: a flag (-m, --cfg ...) stands between these overrides and the others"),
    # Hydra's traceback: "Only one of --run, --multirun, --cfg, ... can be specified"
    (["+experiment=scaling_study", "-m", "--cfg", "job"], "--cfg job shows one job's config and Hydra "
                                                          "cannot combine it with -m; drop -m"),
])
def test_a_command_line_hydra_cannot_read_gets_one_line_naming_the_fix(tmp_path, argv, message):
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, output(proc)
    assert f"error: {message}" in proc.stderr
    assert "usage" not in output(proc) and "Traceback" not in output(proc)
    assert not list(tmp_path.iterdir()), "nothing started"


def test_help_lists_the_groups_users_choose_from_and_the_config(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, output(proc)
    groups = proc.stdout.split("== Configuration groups ==")[1].split("== Config ==")[0]
    listed = [line.split(":")[0] for line in groups.splitlines()[2:] if line.strip()]
    assert listed == ["data", "distributed", "experiment", "model", "optim"], groups  # no schema/*
    assert "optim: adamw, sgd" in groups and "num_gpus: 1" in proc.stdout.split("== Config ==")[1]


@pytest.mark.parametrize("cfg", [["--cfg", "hydra"], ["-chydra"], ["--cf", "all"]])
def test_printing_the_resolved_hydra_config_creates_no_directories(tmp_path, cfg):
    # resolving hydra.run.dir and hydra.sweep.dir claims them; a print must not leave them
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *cfg, "--resolve"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, output(proc)
    assert "dir: outputs/" in proc.stdout and "dir: multirun/" in proc.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name,given,fix", [
    ("fashion_mnist", "data/FashionMNIST/raw", "Fix: data.root={tmp}/data"),
    ("fashion_mnist", "data/FashionMNIST", "Fix: data.root={tmp}/data"),
    ("fashion_mnist", "flat", "Fix: move them into {tmp}/flat/FashionMNIST/raw"),
    # the two data sets' files have the same names
    ("mnist", "data/FashionMNIST/raw", "Fix: data=fashion_mnist data.root={tmp}/data to train on these"),
])
def test_a_data_root_one_level_off_names_the_right_one_instead_of_downloading(tmp_path, fmnist_root, name,
                                                                                given, fix):
    # data.root pointed at the folder of the files themselves: with data.download=true (the
    # default) a second copy was downloaded into <root>/FashionMNIST/raw, offline the run failed
    # saying only that it found no data
    from ddpscale.data import prepare

    files = sorted((fmnist_root / "FashionMNIST" / "raw").glob("*-ubyte*"))
    target = tmp_path / ("flat" if given == "flat" else "data/FashionMNIST/raw")
    target.mkdir(parents=True)
    for f in files:
        (target / f.name).symlink_to(f)
    cfg = DataConfig(name=name, root=str(tmp_path / given), download=True)
    with pytest.raises(ConfigError, match=re.escape(fix.format(tmp=tmp_path))):
        prepare(cfg, world_size=1)
    assert [p.name for p in (tmp_path / given).iterdir() if p.is_dir()] in ([], ["raw"])  # nothing downloaded


def test_missing_data_names_the_checkouts_data_folder_when_it_holds_them(tmp_path, monkeypatch):
    # train.py run from another directory with the default data.root=data: the message named
    # <cwd>/data and a generic 'data.root=DIR', not the checkout's folder that has the files
    import ddpscale.data as data

    checkout = tmp_path / "checkout" / "data"
    (checkout / "FashionMNIST" / "raw").mkdir(parents=True)
    for stem in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (checkout / "FashionMNIST" / "raw" / f"{stem}.gz").write_bytes(b"")
    monkeypatch.setattr(data, "CHECKOUT_DATA", checkout)
    elsewhere = DataConfig(name="fashion_mnist", root=str(tmp_path / "elsewhere" / "data"), download=False)
    with pytest.raises(ConfigError, match=re.escape(f"Fix: data.root={checkout}, the checkout's data folder")):
        data.prepare(elsewhere, world_size=1)
    with pytest.raises(ConfigError) as other:  # MNIST's files are not in the checkout
        data.prepare(dataclasses.replace(elsewhere, name="mnist"), world_size=1)
    assert "checkout" not in str(other.value)
