"""The arithmetic, checked exactly on hand-built sweeps with known throughputs."""

import math
import statistics

import pandas as pd
import pytest
from analysis_files import IMAGES_PER_EPOCH, new_sweep

from multirun_analysis.findings import key_findings
from multirun_analysis.sweep import analyse


def weak(table: pd.DataFrame) -> pd.DataFrame:
    return table[table.scaling == "weak"].reset_index(drop=True)


def strong(table: pd.DataFrame) -> pd.DataFrame:
    return table[table.scaling == "strong"].reset_index(drop=True)


def test_weak_scaling_speedup_and_efficiency_are_exact(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    for world_size, throughput in [(1, 1000.0), (2, 1800.0), (4, 3000.0)]:
        write_run(
            f"ws{world_size}", world_size=world_size, images_per_sec=(10.0, throughput, throughput)
        )
    table = weak(analyse([sweep_dir]).scaling)
    assert table.world_size.tolist() == [1, 2, 4]
    assert table.images_per_sec.tolist() == [1000.0, 1800.0, 3000.0]
    assert table.speedup.tolist() == [1.0, 1.8, 3.0]
    assert table.efficiency.tolist() == [1.0, 0.9, 0.75]
    assert table.ideal_speedup.tolist() == [1.0, 2.0, 4.0]
    assert table.group.unique().tolist() == ["W1"]
    assert table.batch_size.unique().tolist() == [64]
    assert table.global_batch_size.tolist() == [64, 128, 256]
    # time per epoch: median after the first (6000 images per epoch in the fixture)
    assert table.epoch_time_s.tolist() == [6.0, 6000 / 1800, 2.0]


def test_strong_scaling_groups_by_global_batch_and_stays_apart_from_weak(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    for world_size, throughput in [(1, 1000.0), (2, 1800.0), (4, 3000.0)]:
        write_run(
            f"weak/ws{world_size}",
            world_size=world_size,
            batch_size=64,
            images_per_sec=(throughput,) * 2,
        )
    # global batch 256 at every size: 256 x 1, 128 x 2, 64 x 4 (the last is also in the weak group)
    write_run("strong/ws1", world_size=1, batch_size=256, images_per_sec=(1500.0,) * 2)
    write_run("strong/ws2", world_size=2, batch_size=128, images_per_sec=(2400.0,) * 2)
    table = analyse([sweep_dir]).scaling
    assert weak(table).world_size.tolist() == [1, 2, 4]
    assert weak(table).speedup.tolist() == [1.0, 1.8, 3.0]
    s = strong(table)
    assert s.global_batch_size.unique().tolist() == [256]
    assert s.batch_size.tolist() == [256, 128, 64]
    assert s.world_size.tolist() == [1, 2, 4]
    assert s.speedup.tolist() == [1.0, 1.6, 2.0]
    assert s.efficiency.tolist() == [1.0, 0.8, 0.5]
    # batch 256 and 128 ran at one world size each: no weak group for them
    assert set(weak(table).batch_size) == {64}


def test_seeds_aggregate_to_mean_std_and_n(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("base", world_size=1, images_per_sec=(1000.0, 1000.0))
    write_run("s0", world_size=2, seed=0, images_per_sec=(1.0, 1800.0), val_acc=[0.5, 0.80])
    write_run("s1", world_size=2, seed=1, images_per_sec=(1.0, 2000.0), val_acc=[0.5, 0.90])
    analysis = analyse([sweep_dir])
    row = weak(analysis.scaling).iloc[1]
    assert (row.n_runs, row.images_per_sec) == (2, 1900.0)
    assert row.images_per_sec_std == pytest.approx(math.sqrt(2 * 100.0**2), rel=1e-12)  # ddof=1
    assert row.speedup == pytest.approx(1.9, rel=1e-12)
    assert row.final_val_acc == pytest.approx(0.85, rel=1e-12)
    assert weak(analysis.scaling).iloc[0].n_runs == 1
    assert pd.isna(weak(analysis.scaling).iloc[0].images_per_sec_std)
    assert "seed" not in analysis.configs.columns


@pytest.mark.parametrize(
    "images_per_sec, expected",
    [
        ((100.0, 1000.0, 1200.0, 1100.0), 1100.0),  # first epoch dropped, median of the rest
        ((100.0, 1000.0), 1000.0),
        ((700.0,), 700.0),  # one epoch: it is all there is
        ((100.0, 1000.0, 1200.0), 1100.0),
        ((100.0, 1000.0, 1000.0, 1600.0), 1000.0),  # a median, not the mean (1200)
    ],
)
def test_throughput_is_the_median_after_the_first_epoch(tmp_path, images_per_sec, expected):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("r", images_per_sec=images_per_sec)
    runs = analyse([sweep_dir]).runs
    assert runs.images_per_sec.tolist() == [expected]
    timed = images_per_sec[1:] or images_per_sec
    assert runs.epoch_time_s.tolist() == [pytest.approx(statistics.median(IMAGES_PER_EPOCH / x for x in timed))]


def test_a_single_world_size_has_nothing_to_scale(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("a", lr=0.1)
    write_run("b", lr=0.2)
    analysis = analyse([sweep_dir])
    assert analysis.scaling.empty
    assert list(analysis.scaling.columns[:2]) == ["scaling", "group"]
    assert len(analysis.configs) == 2


def test_failed_and_unfinished_runs_stay_out_of_the_tables(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("ws1", world_size=1, images_per_sec=(1000.0,) * 3)
    write_run("ws2", world_size=2, images_per_sec=(1800.0,) * 3)
    write_run(
        "ws4_failed", world_size=4, status="failed", error="boom", images_per_sec=(9.0,), epochs=3
    )
    write_run("ws4_running", world_size=4, status="running", images_per_sec=(9.0,) * 3)
    analysis = analyse([sweep_dir])
    assert weak(analysis.scaling).world_size.tolist() == [1, 2]
    assert analysis.configs.n_runs.sum() == 2
    assert len(analysis.runs) == 4


def test_node_layouts_of_one_world_size_are_separate_rows(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("1x1", world_size=1, images_per_sec=(1000.0,) * 2)
    write_run("1x4", world_size=4, num_nodes=1, images_per_sec=(3600.0,) * 2)
    write_run("2x2", world_size=4, num_nodes=2, images_per_sec=(3000.0,) * 2)
    table = weak(analyse([sweep_dir]).scaling)
    assert table[["num_nodes", "num_gpus", "world_size", "efficiency"]].values.tolist() == [
        [1, 1, 1, 1.0],
        [1, 4, 4, 0.9],
        [2, 2, 4, 0.75],
    ]


def test_accuracy_table_final_best_and_time_to_target(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    # elapsed after epochs 1..4 at 1000 images/sec: 6, 12, 18, 24 s
    write_run("fast", lr=0.1, images_per_sec=(1000.0,) * 4, val_acc=[0.70, 0.91, 0.95, 0.93])
    write_run("slow", lr=0.01, images_per_sec=(1000.0,) * 4, val_acc=[0.50, 0.60, 0.70, 0.80])
    table = analyse([sweep_dir], target_acc=0.9).accuracy.set_index("lr")
    assert table.loc[
        0.1, ["final_val_acc", "best_val_acc", "epochs_to_target", "time_to_target_s"]
    ].tolist() == [
        0.93,
        0.95,
        2,
        12.0,
    ]
    assert table.loc[0.01, ["final_val_acc", "best_val_acc", "n_reached"]].tolist() == [0.8, 0.8, 0]
    assert pd.isna(table.loc[0.01, "time_to_target_s"]) and pd.isna(
        table.loc[0.01, "epochs_to_target"]
    )
    assert (table.target_acc == 0.9).all()
    assert {"global_batch_size", "world_size"} <= set(table.columns)


def test_a_configuration_reaches_the_target_only_when_every_seed_does(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    # lr 0.1: seeds reach 0.9 at epochs 1 and 2 (6 s and 12 s); lr 0.01: one seed of two,
    # though the quickest of all (epoch 1, 6 s).
    write_run("a0", lr=0.1, seed=0, val_acc=[0.91, 0.92, 0.93])
    write_run("a1", lr=0.1, seed=1, val_acc=[0.80, 0.91, 0.93])
    write_run("b0", lr=0.01, seed=0, val_acc=[0.95, 0.95, 0.95])
    write_run("b1", lr=0.01, seed=1, val_acc=[0.50, 0.60, 0.70])
    analysis = analyse([sweep_dir], target_acc=0.9)
    table = analysis.accuracy.set_index("lr")
    columns = ["n_runs", "n_reached", "epochs_to_target", "time_to_target_s"]
    # every seed by epoch 2 (not "epoch 1.5"), in a mean time of 9 s
    assert table.loc[0.1, columns].tolist() == [2, 2, 2, 9.0]
    assert table.loc[0.01, ["n_runs", "n_reached"]].tolist() == [2, 1]
    assert pd.isna(table.loc[0.01, "epochs_to_target"])
    assert pd.isna(table.loc[0.01, "time_to_target_s"])
    findings = " ".join(key_findings(analysis))
    assert (
        "1 of 2 configurations reached val_acc 0.9 in every seed (1 other reached it in only "
        "some of its seeds); fastest: **9.0 s** of training (mean over its 2 seeds, each of "
        "which reached it by epoch 2) with world size 1, batch 64/worker (global 64), lr=0.1."
    ) in findings


def test_two_configurations_that_reached_the_target_in_some_seeds_are_others(tmp_path):
    # it read "(2 other reached it in only some of their seeds)"
    sweep_dir, write_run = new_sweep(tmp_path)
    for lr, second in ((0.1, 0.91), (0.01, 0.5), (0.001, 0.5)):
        write_run(f"{lr}-0", lr=lr, seed=0, val_acc=[0.91, 0.92, 0.93])
        write_run(f"{lr}-1", lr=lr, seed=1, val_acc=[0.5, 0.6, second])
    findings = " ".join(key_findings(analyse([sweep_dir], target_acc=0.9)))
    assert "1 of 3 configurations reached val_acc 0.9 in every seed (2 others reached it in only " \
           "some of their seeds); fastest" in findings


def test_a_time_to_target_of_a_thousand_seconds_or_more_has_separators(tmp_path):
    # as every other measurement from 1,000 up: it printed "1200.0 s"
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("slow", images_per_sec=(IMAGES_PER_EPOCH / 600,) * 2, val_acc=[0.5, 0.95])
    findings = " ".join(key_findings(analyse([sweep_dir], target_acc=0.9)))
    assert "fastest: **1,200.0 s** of training" in findings


def test_no_configuration_reaching_the_target_in_every_seed_is_said_so(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("b0", seed=0, val_acc=[0.95, 0.95, 0.95])
    write_run("b1", seed=1, val_acc=[0.50, 0.60, 0.70])
    findings = key_findings(analyse([sweep_dir], target_acc=0.9))
    assert findings[-1] == (
        "No configuration reached val_acc 0.9 in every seed; 1 reached it in only some of its "
        "seeds (best mean final over seeds: 0.825)."
    )  # not "best final 0.825" beside a seed that ended at 0.95


def test_accuracy_change_when_scaling_is_in_the_scaling_table(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("ws1", world_size=1, val_acc=[0.5, 0.7, 0.90])
    write_run("ws4", world_size=4, val_acc=[0.5, 0.7, 0.85])
    table = weak(analyse([sweep_dir]).scaling)
    assert table.val_acc_change.tolist() == pytest.approx([0.0, -0.05], abs=1e-12)


def test_grad_sync_share_is_carried_to_the_scaling_table(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("ws1", world_size=1, grad_sync_share=0.0)
    write_run("ws2", world_size=2, grad_sync_share=0.4)
    assert weak(analyse([sweep_dir]).scaling).grad_sync_share.tolist() == [0.0, 0.4]


def test_no_groups_of_a_kind_says_what_else_must_be_alike(tmp_path):
    # Global batch 128 was run at world sizes 1 and 2, but at different learning rates.
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("ws1", world_size=1, batch_size=64, lr=0.1)
    write_run("ws2", world_size=2, batch_size=64, lr=0.1)
    write_run("ws1-b128", world_size=1, batch_size=128, lr=0.01)
    findings = key_findings(analyse([sweep_dir]))
    assert (
        "Strong scaling (global batch fixed): no groups (no global_batch_size was run at two or "
        "more world sizes with everything else alike)."
    ) in findings


@pytest.mark.parametrize("ws2_images_per_sec,warned", [(2600.0, True), (2100.0, False)])
def test_efficiency_well_above_one_is_flagged_as_a_slow_baseline(tmp_path, ws2_images_per_sec, warned):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("ws1", world_size=1, images_per_sec=(1000.0,) * 3)
    write_run("ws2", world_size=2, images_per_sec=(ws2_images_per_sec,) * 3)
    findings = " ".join(key_findings(analyse([sweep_dir])))
    flagged = ("scaling point above efficiency 1.10** (highest: 1.30, W1 at world size 2): more than "
               "linear is rare")
    assert (flagged in findings) == warned
    assert ("above efficiency" in findings) == warned
