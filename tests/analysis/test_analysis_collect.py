"""Collecting runs: discovery at any depth, settings, and every kind of bad file listed with its reason."""

import json
import os
import socket
import subprocess
import sys

import pandas as pd
import pytest
from analysis_files import COLUMNS, new_sweep, run_rows, write_results, write_run_json

from multirun_analysis.collect import collect
from multirun_analysis.discover import find_run_dirs
from multirun_analysis.sweep import analyse


def test_runs_are_found_at_any_depth_and_hidden_folders_are_skipped(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("a")
    write_run("2026-12-02/11-00-00/3")
    write_run_json(sweep_dir / "only_json", status="failed", error="boom")
    write_results(sweep_dir / "a" / ".hydra" / "copy", run_rows())  # a config folder, not a run
    found = [p.replace(str(sweep_dir), "") for p in find_run_dirs(sweep_dir)]
    assert found == ["/2026-12-02/11-00-00/3", "/a", "/only_json"]


def test_overlapping_sweep_dirs_count_each_run_once(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("x/1")
    assert len(collect([sweep_dir, sweep_dir / "x"]).runs) == 1


def test_settings_come_from_the_rows_and_extra_columns_are_kept(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("r", world_size=4, batch_size=32, lr=0.05, seed=7, grad_sync_share=0.25)
    collected = collect([sweep_dir])
    run = collected.runs.iloc[0]
    assert (run.world_size, run.batch_size, run.global_batch_size, run.lr, run.seed) == (
        4,
        32,
        128,
        0.05,
        7,
    )
    assert run.status == "completed" and run.problem == ""
    epochs = collected.epochs
    assert epochs.warmup.tolist() == [True, False, False]
    assert epochs.grad_sync_share.tolist() == [0.25] * 3
    assert epochs.launcher.tolist() == ["spawn"] * 3


def test_unknown_extra_columns_are_tolerated(tmp_path):
    sweep_dir, _ = new_sweep(tmp_path)
    rows = [dict(r, note="hello", step_time_p50_s=0.01) for r in run_rows()]
    write_results(sweep_dir / "r", rows, columns=[*COLUMNS, "note", "step_time_p50_s"])
    collected = collect([sweep_dir])
    assert collected.runs.problem.tolist() == [""]
    assert collected.epochs.note.tolist() == ["hello"] * 3
    assert collected.epochs.step_time_p50_s.tolist() == [0.01] * 3


def test_run_without_rows_takes_its_settings_from_run_json(tmp_path):
    sweep_dir, _ = new_sweep(tmp_path)
    write_run_json(
        sweep_dir / "r",
        status="failed",
        error="CUDA out of memory",
        rows=run_rows(world_size=2, batch_size=128, lr=0.3),
    )
    run = collect([sweep_dir]).runs.iloc[0]
    assert (run.world_size, run.batch_size, run.global_batch_size, run.lr) == (2, 128, 256, 0.3)
    assert run.status == "failed" and run.error == "CUDA out of memory"
    assert not run.has_results


def test_truncated_last_line_is_skipped_and_reported(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    csv_path = write_run("r") / "results.csv"
    csv_path.write_text(csv_path.read_text()[:-30])  # the writer died mid-line
    collected = collect([sweep_dir])
    assert collected.epochs.epoch.tolist() == [1, 2]
    assert "results.csv is truncated: line 4 has no line end" in collected.runs.problem[0]


def test_truncated_line_that_ends_in_a_newline_is_caught_by_its_field_count(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    csv_path = write_run("r") / "results.csv"
    lines = csv_path.read_text().splitlines()
    csv_path.write_text("\n".join([*lines[:-1], ",".join(lines[-1].split(",")[:5])]) + "\n")
    problem = collect([sweep_dir]).runs.problem[0]
    assert "line 4 has 5 fields, the header has 24" in problem


def test_header_only_and_empty_files(tmp_path):
    sweep_dir, _ = new_sweep(tmp_path)
    write_results(sweep_dir / "header_only", [])
    (sweep_dir / "empty").mkdir()
    (sweep_dir / "empty" / "results.csv").write_text("")
    runs = collect([sweep_dir]).runs
    by_name = dict(zip(runs.path.str.rsplit("/", n=1).str[-1], runs.problem))
    assert by_name == {"empty": "results.csv is empty (no header)", "header_only": ""}


def test_missing_required_column_is_reported_by_name(tmp_path):
    sweep_dir, _ = new_sweep(tmp_path)
    write_results(
        sweep_dir / "r",
        run_rows(),
        columns=[c for c in COLUMNS if c not in ("images_per_sec", "lr")],
    )
    collected = collect([sweep_dir])
    assert collected.runs.problem[0] == "results.csv lacks required column(s): lr, images_per_sec"
    assert collected.epochs.empty


def test_non_numeric_value_is_reported_with_column_and_value(tmp_path):
    sweep_dir, _ = new_sweep(tmp_path)
    rows = run_rows()
    rows[1]["images_per_sec"] = "fast"
    write_results(sweep_dir / "r", rows)
    problem = collect([sweep_dir]).runs.problem[0]
    assert problem == "results.csv: non-numeric value 'fast' in column images_per_sec"


@pytest.mark.parametrize("value,problem", [
    ("", "empty value in column images_per_sec"),
    ("nan", "empty value in column images_per_sec"),
    ("inf", "unusable value 'inf' in column images_per_sec"),
    ("-1800", "unusable value '-1800' in column images_per_sec"),
    ("0", "unusable value '0' in column images_per_sec"),  # an infinite speedup
])
def test_a_timing_no_run_could_measure_is_a_problem(tmp_path, value, problem):
    # It went through as NaN or inf, and the scaling plot crashed the whole analysis.
    sweep_dir, _ = new_sweep(tmp_path)
    rows = run_rows()
    rows[1]["images_per_sec"] = value
    write_results(sweep_dir / "r", rows)
    assert collect([sweep_dir]).runs.problem[0] == f"results.csv: {problem}"


def test_nan_metric_is_a_result_not_a_bad_file(tmp_path):
    sweep_dir, _ = new_sweep(tmp_path)
    rows = run_rows()
    rows[2]["val_loss"] = "nan"  # a diverged run
    write_results(sweep_dir / "r", rows)
    collected = collect([sweep_dir])
    assert collected.runs.problem[0] == ""
    assert collected.epochs.val_loss.isna().tolist() == [False, False, True]


def test_empty_setting_is_a_problem(tmp_path):
    sweep_dir, _ = new_sweep(tmp_path)
    rows = run_rows()
    rows[0]["world_size"] = ""
    write_results(sweep_dir / "r", rows)
    assert collect([sweep_dir]).runs.problem[0] == "results.csv: empty value in column world_size"


def test_bad_json_is_reported_and_the_status_is_unknown(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    directory = write_run("r")
    (directory / "run.json").write_text('{"status": "completed",')
    run = collect([sweep_dir]).runs.iloc[0]
    assert run.status == "unknown"
    assert run.problem.startswith("run.json is not valid JSON (Expecting")


@pytest.mark.parametrize(
    "doc, problem",
    [
        ([1, 2], "run.json is not a JSON object"),
        ({"error": None}, "run.json has no status"),
    ],
)
def test_run_json_without_a_status(tmp_path, doc, problem):
    sweep_dir, write_run = new_sweep(tmp_path)
    (write_run("r") / "run.json").write_text(json.dumps(doc))
    assert collect([sweep_dir]).runs.problem[0] == problem


def test_rows_of_two_runs_in_one_file_are_a_problem(tmp_path):
    sweep_dir, _ = new_sweep(tmp_path)
    write_results(sweep_dir / "r", run_rows(lr=0.1) + run_rows(lr=0.2))
    problem = collect([sweep_dir]).runs.problem[0]
    assert "rows disagree on lr" in problem and "repeats epoch 1" in problem


def test_every_run_is_listed_whatever_its_state(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("ok")
    write_run(
        "failed",
        status="failed",
        error="RuntimeError: NCCL timeout",
        images_per_sec=(900.0,),
        epochs=3,
    )
    write_run("running", status="running", images_per_sec=(900.0, 950.0), epochs=3)
    write_run("interrupted", status="interrupted", images_per_sec=(900.0,), epochs=3)
    write_run("timed_out", status="interrupted", error="stopped by SIGTERM",
              images_per_sec=(900.0,), epochs=3)
    write_run("no_json", run_json=False)
    write_run("no_json_partial", run_json=False, images_per_sec=(900.0,), epochs=3)
    write_run("short", images_per_sec=(900.0, 950.0), epochs=3)
    write_run("no_json_header_only", run_json=False, images_per_sec=())  # said "only 0 of ? epochs"
    runs = analyse([sweep_dir]).runs
    table = dict(
        zip(runs.path.str.rsplit("/", n=1).str[-1], zip(runs.status, runs.included, runs.problem))
    )
    assert table == {
        "ok": ("completed", True, ""),
        "failed": ("failed", False, "failed: RuntimeError: NCCL timeout"),
        "running": ("running", False, "still running, or stopped without updating run.json"),
        "interrupted": ("interrupted", False, "interrupted"),
        # which signal: Ctrl-C, or a scheduler's time limit
        "timed_out": ("interrupted", False, "interrupted: stopped by SIGTERM"),
        "no_json": ("unknown", True, ""),
        "no_json_partial": ("unknown", False, "no run.json and results.csv has only 1 of 3 epochs"),
        "short": ("completed", False, "completed but results.csv has 2 of 3 epochs"),
        "no_json_header_only": ("unknown", False, "no run.json, and results.csv has no epoch rows"),
    }


def test_a_run_whose_job_process_on_this_machine_is_gone_is_told_from_one_still_running(tmp_path):
    # A job process killed outright (kill -9, the out-of-memory killer) never writes its
    # end: its run.json says "running" for ever, and the report could only guess.
    sweep_dir, _ = new_sweep(tmp_path)
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    here = socket.gethostname()
    for name, host, pid in (("killed", here, ended.pid), ("alive", here, os.getpid()),
                            ("elsewhere", here + "-other", ended.pid)):
        rows = run_rows(images_per_sec=(900.0,), epochs=3)
        write_results(sweep_dir / name, rows)
        write_run_json(sweep_dir / name, status="running", rows=rows, hostname=host, pid=pid)
    runs = analyse([sweep_dir]).runs
    problems = dict(zip(runs.path.str.rsplit("/", n=1).str[-1], runs.problem))
    assert problems == {
        "killed": f"stopped without updating run.json: its job process (pid {ended.pid}) on this machine has "
                  "ended without recording why: killed outright (SIGKILL, the out-of-memory killer; see dmesg) "
                  "or the machine restarted",
        "alive": "still running, or stopped without updating run.json",
        "elsewhere": "still running, or stopped without updating run.json",  # cannot be told from here
    }
    assert (runs.status == "running").all()


def test_epochs_table_is_tidy(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("a", world_size=1)
    write_run("b", world_size=2)
    epochs = collect([sweep_dir]).epochs
    assert len(epochs) == 6
    assert not epochs.duplicated(["run_id", "epoch"]).any()
    assert pd.api.types.is_integer_dtype(epochs.world_size)


def test_a_long_error_is_cut_in_the_problem_and_says_so(tmp_path):
    """A 400-character error was cut at 300 mid-word with no mark: the reader took the stub
    ("... DIR/FashionMNIST/raw/ holding") for the whole message."""
    sweep_dir, write_run = new_sweep(tmp_path)
    error = "ValueError: " + "x" * 400 + " the fix"
    write_run("failed", status="failed", error=error, images_per_sec=(900.0,), epochs=3)
    runs = analyse([sweep_dir]).runs
    assert runs.problem.iloc[0] == "failed: " + error[:300] + " …"
    assert runs.error.iloc[0] == error  # runs.csv keeps the whole text


def test_runs_csv_says_which_runs_ran_edited_code(tmp_path):
    # run.json's git_dirty beside git_commit; a run.json from before it says nothing (empty)
    sweep_dir = tmp_path / "sweep"
    for name, extra in (("edited", {"git_dirty": True}), ("clean", {"git_dirty": False}), ("older", {})):
        rows = run_rows()
        write_results(sweep_dir / name, rows)
        write_run_json(sweep_dir / name, rows=rows, git_commit="6afdaa4", **extra)
    runs = analyse([sweep_dir]).runs
    runs = runs.set_index(runs.path.map(lambda p: p.rsplit("/", 1)[1]))
    assert runs.git_dirty.to_dict() == {"clean": False, "edited": True, "older": None}
    assert list(runs.columns[-3:]) == ["git_commit", "git_dirty", "overrides"]
