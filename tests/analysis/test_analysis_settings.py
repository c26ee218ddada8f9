"""Runs that differ in any setting but the seed are never averaged, and the tables show how."""

import pandas as pd
import pytest
from analysis_files import COLUMNS, new_sweep

from multirun_analysis.report import write_report
from multirun_analysis.sweep import analyse


def weak(table: pd.DataFrame) -> pd.DataFrame:
    return table[table.scaling == "weak"].reset_index(drop=True)


def started(port: int, **groups) -> dict:
    """Config keys that say where and how a run was started (they differ between repeats of
    one experiment), plus `groups`."""
    config = {
        "distributed": {"master_port": port, "master_addr": f"node{port}", "timeout_s": port / 10},
        "data": {"root": f"/home/{port}/data", "download": port % 2 == 0},
        "train": {"progress": port % 2 == 0},
    }
    for group, fields in groups.items():
        config[group] = {**config.get(group, {}), **fields}
    return config


def test_a_config_key_swept_beside_the_world_size_splits_the_scaling_groups(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    throughputs = {25.0: (1000.0, 1800.0), 1.0: (1000.0, 1500.0)}
    for bucket, (ws1, ws2) in throughputs.items():
        for world_size, throughput in [(1, ws1), (2, ws2)]:
            write_run(
                f"b{bucket:g}/ws{world_size}",
                world_size=world_size,
                images_per_sec=(throughput,) * 3,
                config=started(29500 + world_size, distributed={"bucket_cap_mb": bucket}),
            )
    analysis = analyse([sweep_dir])
    table = weak(analysis.scaling)
    assert table[["group_label", "world_size", "speedup"]].values.tolist() == [
        ["distributed.bucket_cap_mb=1, batch_size=64", 1, 1.0],
        ["distributed.bucket_cap_mb=1, batch_size=64", 2, 1.5],
        ["distributed.bucket_cap_mb=25, batch_size=64", 1, 1.0],
        ["distributed.bucket_cap_mb=25, batch_size=64", 2, 1.8],
    ]
    assert table.n_runs.tolist() == [1, 1, 1, 1]
    assert analysis.configs["distributed.bucket_cap_mb"].tolist() == [1.0, 25.0, 1.0, 25.0]
    # the key follows the fixed settings; start-up keys never become columns
    columns = analysis.runs.columns.tolist()
    assert columns.index("distributed.bucket_cap_mb") == columns.index("seed") + 1
    assert [c for c in analysis.configs.columns if "." in c] == ["distributed.bucket_cap_mb"]
    assert "distributed.bucket_cap_mb" in analysis.accuracy.columns

    out = tmp_path / "out"
    write_report(analysis, out)
    assert "distributed.bucket_cap_mb" in pd.read_csv(out / "runs.csv").columns
    report = (out / "report.md").read_text()
    assert "| W1 | 64 | 1 | 1 | 1 | 1,000 |" in report  # group, global batch, bucket, world size
    assert "distributed.bucket_cap_mb=25, batch_size=64, world size 2" in report  # key findings


def test_grad_accum_steps_splits_the_scaling_groups(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    for steps, (ws1, ws2) in {1: (1000.0, 1500.0), 4: (900.0, 1710.0)}.items():
        for world_size, throughput in [(1, ws1), (2, ws2)]:
            write_run(
                f"accum{steps}/ws{world_size}",
                world_size=world_size,
                grad_accum_steps=steps,
                images_per_sec=(throughput,) * 3,
                columns=[*COLUMNS, "grad_accum_steps"],
            )
    analysis = analyse([sweep_dir])
    table = weak(analysis.scaling)
    assert table.group_label.unique().tolist() == [
        "grad_accum_steps=1, batch_size=64",
        "grad_accum_steps=4, batch_size=64",
    ]
    assert table.speedup.tolist() == [1.0, 1.5, 1.0, 1.9]
    assert table.n_runs.tolist() == [1, 1, 1, 1]
    assert analysis.runs.grad_accum_steps.dtype == "Int64"
    # results.csv carries it, so the config key train.grad_accum_steps is no column of its own
    assert not [c for c in analysis.runs.columns if "." in c]


def test_a_config_key_counts_even_where_results_csv_lacks_the_column(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    for steps in (1, 4):
        for world_size in (1, 2):
            write_run(f"accum{steps}/ws{world_size}", world_size=world_size, grad_accum_steps=steps)
    table = weak(analyse([sweep_dir]).scaling)
    assert table.group.nunique() == 2
    assert table["train.grad_accum_steps"].tolist() == [1, 1, 4, 4]


def test_runs_that_differ_only_in_seed_and_start_up_keys_aggregate(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    for world_size, (s0, s1) in [(1, (1000.0, 1000.0)), (2, (1700.0, 1900.0))]:
        for seed, throughput in [(0, s0), (1, s1)]:
            write_run(
                f"ws{world_size}/s{seed}",
                world_size=world_size,
                seed=seed,
                images_per_sec=(throughput,) * 3,
                config=started(29500 + 10 * world_size + seed),
            )
    analysis = analyse([sweep_dir])
    table = weak(analysis.scaling)
    assert table.n_runs.tolist() == [2, 2]
    assert table.speedup.tolist() == [1.0, 1.8]
    assert not [c for c in analysis.runs.columns if "." in c]


def test_how_a_run_was_started_does_not_split_a_scaling_group(tmp_path):
    # A SLURM sweep of num_gpus=1,2: the one-task job spawns its worker itself (launcher
    # spawn), the two-task job's tasks are the workers (launcher slurm). One experiment.
    sweep_dir, write_run = new_sweep(tmp_path)
    for world_size, launcher, throughput in [(1, "spawn", 1000.0), (2, "slurm", 1800.0)]:
        write_run(f"ws{world_size}", world_size=world_size, launcher=launcher,
                  images_per_sec=(throughput,) * 3)
    analysis = analyse([sweep_dir])
    table = weak(analysis.scaling)
    assert table.group.nunique() == 1
    assert table.speedup.tolist() == [1.0, 1.8] and table.baseline_world_size.tolist() == [1, 1]
    assert analysis.runs.launcher.tolist() == ["spawn", "slurm"], "still shown per run"


def test_a_key_that_only_follows_a_setting_is_no_column(tmp_path):
    # adamw's default weight decay is not sgd's, and only sgd has momentum: the optimizer
    # column already tells these runs apart.
    sweep_dir, write_run = new_sweep(tmp_path)
    for optimizer, optim in [
        ("sgd", {"weight_decay": 0.0, "momentum": 0.9}),
        ("adamw", {"weight_decay": 0.01, "beta1": 0.9}),
    ]:
        for world_size in (1, 2):
            write_run(
                f"{optimizer}/ws{world_size}",
                world_size=world_size,
                optimizer=optimizer,
                config={"optim": optim},
            )
    analysis = analyse([sweep_dir])
    assert not [c for c in analysis.runs.columns if "." in c]
    assert weak(analysis.scaling).group.nunique() == 2


def test_null_is_a_value_and_a_run_without_run_json_is_still_analysed(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("all", config={"data": {"train_size": None}})
    write_run("some", config={"data": {"train_size": 1000}})
    write_run("old", run_json=False)  # an old sweep, or a lost run.json
    analysis = analyse([sweep_dir])
    assert analysis.runs.included.all()
    column = analysis.runs.set_index(analysis.runs.path.str.rsplit("/", n=1).str[-1])[
        "data.train_size"
    ]
    assert column[["all", "some"]].tolist() == ["null", "1000"]
    assert pd.isna(column["old"])
    assert analysis.configs.n_runs.tolist() == [1, 1, 1]


@pytest.mark.parametrize("missing", ["no run.json", "no config"])
def test_runs_without_a_config_aggregate_as_before(tmp_path, missing):
    sweep_dir, write_run = new_sweep(tmp_path)
    for seed in (0, 1):
        directory = write_run(f"s{seed}", seed=seed, run_json=missing != "no run.json")
        if missing == "no config":
            text = (directory / "run.json").read_text()
            (directory / "run.json").write_text(text.replace('"config"', '"not_config"'))
    analysis = analyse([sweep_dir])
    assert analysis.configs.n_runs.tolist() == [2]


@pytest.mark.parametrize("without_run_json", [("b1/ws1", "b1/ws2", "b25/ws1", "b25/ws2"),
                                              ("b1/ws2",)])
def test_results_csv_knob_columns_keep_runs_without_run_json_apart(tmp_path, without_run_json):
    # A bucket_cap_mb=1,25 sweep whose run.json files are lost (all of them, or one):
    # results.csv repeats the knob, so its runs are still no repeats of each other.
    sweep_dir, write_run = new_sweep(tmp_path)
    for bucket, (ws1, ws2) in {1.0: (1000.0, 1500.0), 25.0: (1000.0, 1800.0)}.items():
        for world_size, throughput in [(1, ws1), (2, ws2)]:
            name = f"b{bucket:g}/ws{world_size}"
            write_run(
                name,
                world_size=world_size,
                bucket_cap_mb=bucket,
                launcher="torchrun",
                images_per_sec=(throughput,) * 3,
                columns=[*COLUMNS, "bucket_cap_mb"],
                config={"distributed": {"bucket_cap_mb": bucket}},
                run_json=name not in without_run_json,
            )
    analysis = analyse([sweep_dir])
    assert analysis.runs.included.all()
    assert analysis.runs["distributed.bucket_cap_mb"].tolist() == [1.0, 1.0, 25.0, 25.0]
    assert analysis.runs.launcher.tolist() == ["torchrun"] * 4  # results.csv's, where no run.json
    table = weak(analysis.scaling)
    assert table.group_label.unique().tolist() == [
        "distributed.bucket_cap_mb=1, batch_size=64",
        "distributed.bucket_cap_mb=25, batch_size=64",
    ]
    assert table.n_runs.tolist() == [1, 1, 1, 1]
    assert table.speedup.tolist() == [1.0, 1.5, 1.0, 1.8]


def test_run_json_wins_over_results_csv_for_a_knob(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    for seed in (0, 1):  # results.csv says 25 for both; run.json says 1 for seed 1
        write_run(f"s{seed}", seed=seed, columns=[*COLUMNS, "bucket_cap_mb"],
                  config={"distributed": {"bucket_cap_mb": 25.0 if seed == 0 else 1.0}})
    analysis = analyse([sweep_dir])
    assert analysis.runs["distributed.bucket_cap_mb"].tolist() == [25.0, 1.0]


def test_runs_on_different_machines_are_neither_averaged_nor_scaled_against_each_other(tmp_path):
    """Two sweeps, a laptop's and a server's, analysed from their parent: alike runs were
    averaged as if repeats (747 and 7,471 images/sec gave 4,109 ± 4,755), and a laptop's
    1-worker run served as the baseline of a server's 2-worker one (efficiency 8.39).
    run.json's device names tell the machines apart; how many of one kind a run sees does not."""
    from analysis_files import run_rows, write_results, write_run_json

    sweep = tmp_path / "sweep"
    machines = {
        "laptop": (["AMD EPYC (2 logical cores)"], 1000.0),
        "server": (["NVIDIA H100 80GB HBM3"] * 4, 10000.0),
    }
    for machine, (devices, throughput) in machines.items():
        for world_size in (1, 2):
            speedup = {1: 1.0, 2: 1.8}[world_size]
            rows = run_rows(world_size=world_size, images_per_sec=(throughput * speedup,) * 3)
            write_results(sweep / machine / str(world_size), rows)
            names = devices[:world_size] if machine == "server" else devices  # visible GPUs
            write_run_json(sweep / machine / str(world_size), rows=rows, devices=names)
    analysis = analyse([sweep])
    assert analysis.configs.n_runs.tolist() == [1, 1, 1, 1]
    table = weak(analysis.scaling)
    assert table.efficiency.round(2).tolist() == [1.0, 0.9, 1.0, 0.9]
    assert set(table.hardware) == {"AMD EPYC (2 logical cores)", "NVIDIA H100 80GB HBM3"}


def test_one_machine_adds_no_hardware_column(tmp_path):
    from analysis_files import run_rows, write_results, write_run_json

    sweep = tmp_path / "sweep"
    for world_size in (1, 2, 4):
        rows = run_rows(world_size=world_size)
        write_results(sweep / str(world_size), rows)
        write_run_json(sweep / str(world_size), rows=rows,
                       devices=["NVIDIA H100 80GB HBM3"] * world_size)
    assert "hardware" not in analyse([sweep]).runs.columns
