"""A model and a data set of one's own (examples/plugin), as the README's Extending says."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from conftest import QUICK, REPO, output, read_rows, read_run, run_train
from ddpscale.config import DataConfig, ModelConfig, OptimConfig, to_config
from ddpscale.data import DATASETS
from ddpscale.models import MODELS
from ddpscale.optim import OPTIMIZERS, SCHEDULES

pytestmark = pytest.mark.slow
SCRIPT = "examples/plugin/train_plugins.py"
EXTENDING = (REPO / "README.md").read_text().split("## Extending")[1].split("\n## ")[0]
PLUGINS = ["data=stripes", "data.train_size=512", "data.val_size=128", "data.noise=1.0"]


@pytest.mark.parametrize("launcher,model", [("spawn", "mlp"), ("slurm_local", "cnn")])
def test_a_plugged_in_model_and_data_set_train_with_two_workers(tmp_path, launcher, model):
    # slurm_local's tasks unpickle the job: from another working directory, and with only a
    # data set of the plug-in's (its schema class must bring the module in)
    where = ([f"hydra.run.dir={tmp_path}/run"] if launcher == "spawn" else
             ["hydra/launcher=slurm_local", f"hydra.sweep.dir={tmp_path}", "hydra.sweep.subdir=run", "-m"])
    proc = subprocess.run(
        [sys.executable, str(REPO / SCRIPT), *QUICK, *PLUGINS, f"model={model}", "distributed.num_gpus=2",
         *where], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, output(proc)
    rows = read_rows(tmp_path / "run")
    assert (rows[-1]["model"], rows[-1]["dataset"], rows[-1]["world_size"]) == (model, "stripes", "2")
    assert float(rows[-1]["val_acc"]) > 0.6  # two classes: it learns them
    run = read_run(tmp_path / "run")
    assert run["replicas_identical"] and run["config"]["data"]["frequency"] == 0.8


@pytest.mark.parametrize("override,message", [
    ("model.name=mlp2", "model='mlp2' is unknown; valid: cnn, wide_resnet, mlp; one of your own "
                        "goes into ddpscale.models.MODELS"),
    ("data.name=stripes2", "data='stripes2' is unknown; valid: fashion_mnist, mnist, synthetic, "
                           "stripes; one of your own goes into ddpscale.data.DATASETS"),
    ("optim.schedule=linear2", "optim.schedule='linear2' is unknown; valid: cosine, constant, linear; one "
                               "of your own goes into ddpscale.optim.SCHEDULES"),
])
def test_an_unregistered_name_fails_before_any_worker(tmp_path, override, message):
    proc = run_train(*QUICK, *PLUGINS, "model=mlp", override, "distributed.num_gpus=2",
                     f"hydra.run.dir={tmp_path}", script=SCRIPT, timeout=60)
    assert proc.returncode == 2, output(proc)
    assert message in output(proc) and "starting 2 worker(s)" not in output(proc)


@pytest.mark.parametrize("args,message", [
    (["data.frequency=0.5"], "data.frequency is a key of data=stripes, not of data=fashion_mnist (the default data, "
                             "from conf/config.yaml); add data=stripes, or drop data.frequency=0.5"),
    (["model=mlp", "model.depth=3"], "model.depth is a key of model=wide_resnet, not of model=mlp (the model "
                                     "chosen here); choose model=wide_resnet in place of model=mlp, or drop"),
])
def test_a_key_of_an_option_not_chosen_names_the_plugged_in_options_too(args, message):
    # Hydra answered "To append to your config use +data.frequency=0.5", which ddpscale refuses next
    proc = subprocess.run([sys.executable, str(REPO / SCRIPT), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, output(proc)
    assert f"error: {message}" in proc.stderr and "To append" not in output(proc)


def test_help_lists_the_plugged_in_options():
    # Hydra listed the groups of conf/ alone, without the options of a hydra.searchpath override
    proc = subprocess.run([sys.executable, str(REPO / SCRIPT), "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, output(proc)
    assert ("data: fashion_mnist, mnist, stripes, synthetic\ndistributed: default\nexperiment: scaling_study\n"
            "model: cnn, mlp, wide_resnet\noptim: adamw, rmsprop, sgd\n\n== Config ==") in proc.stdout


@pytest.mark.parametrize("args", [["--cfg", "job", "model=mlp", "data=stripes"],
                                  ["model=mlp", "data=stripes", "--cfg", "job"],
                                  ["--cfg", "job"]], ids=["flag-first", "flag-last", "no-overrides"])
def test_the_plugin_script_takes_flags_before_or_after_the_overrides(args):
    proc = subprocess.run([sys.executable, str(REPO / SCRIPT), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("name: mlp" in proc.stdout) == ("model=mlp" in args)


@pytest.mark.parametrize("registry,name", [(MODELS, "cnn"), (DATASETS, "fashion_mnist"), (OPTIMIZERS, "sgd"),
                                           (SCHEDULES, "cosine")])
def test_a_plugin_cannot_take_a_name_that_is_registered(registry, name):
    # MODELS["cnn"] = my_mlp trained the MLP, and results.csv said model=cnn
    builtin = registry[name]
    with pytest.raises(ValueError, match=f"'{name}' is already registered .*; register yours under a name of its own"):
        registry[name] = lambda *args: None
    registry[name] = builtin  # the same builder again (a module imported twice) is no clash
    assert registry[name] is builtin


def test_the_readme_extending_example_runs_as_written(tmp_path):
    # Its data option needed a schema path the README did not give, and an optimizer of one's
    # own without keys of its own had no schema to start from (/schema/optim/optim).
    commands = [line.strip() for line in EXTENDING.splitlines() if line.startswith("    python ")]
    assert commands, "README's Extending shows no command"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # a user's shell, in the checkout
    for n, command in enumerate(commands):
        args = shlex.split(command)[1:]
        proc = subprocess.run([sys.executable, *args, f"hydra.run.dir={tmp_path}/{n}"], cwd=REPO,
                              capture_output=True, text=True, timeout=240, env=env)
        assert proc.returncode == 0, f"{command}\n{output(proc)}"
        assert read_run(tmp_path / str(n))["status"] == "completed"


def test_the_files_the_readme_extending_quotes_are_the_examples_own():
    quoted = re.findall(r"\n\n((?:    .*\n|\n(?=    ))+)", EXTENDING)
    files = [block for block in quoted if block.startswith("    # examples/")]
    assert files, "README's Extending quotes no example file"
    for block in files:
        text = "".join(line[4:] + "\n" for line in block.rstrip("\n").split("\n"))
        path = text.split(":")[0][2:]
        assert (REPO / path).read_text() == text, f"README's copy of {path} differs from the file"


@pytest.mark.parametrize("group,schema,keys", [
    ("model", ModelConfig, ""), ("data", DataConfig, "\ndownload: false\nnum_classes: 3"),
    ("optim", OptimConfig, "\nlr: 0.2"),
])
def test_an_option_without_keys_of_its_own_starts_from_its_groups_schema(tmp_path, group, schema, keys):
    (tmp_path / group).mkdir()
    (tmp_path / group / "plain.yaml").write_text(f"defaults:\n  - /schema/{group}/{group}@_here_\n\n"
                                                  f"name: plain{keys}\n")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = to_config(compose("config", overrides=[f"hydra.searchpath=[file://{tmp_path}]", f"{group}=plain"]))
    node = getattr(cfg, group)
    assert type(node) is schema and node.name == "plain"
