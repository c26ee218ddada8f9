"""The files written into --out: tables, plots, and a report that opens with the findings."""

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from analysis_files import COLUMNS, new_sweep, run_rows, write_results, write_run_json

from multirun_analysis.findings import crowded_runs, key_findings, overlapping_runs, repeated_seeds
from multirun_analysis.plots import _labels
from multirun_analysis.render import format_cell, markdown_table
from multirun_analysis.report import write_report
from multirun_analysis.schema import config_keys
from multirun_analysis.sweep import analyse

OUTPUTS = {
    "runs.csv",
    "scaling.csv",
    "accuracy.csv",
    "runs.md",
    "scaling.md",
    "accuracy.md",
    "report.md",
    "report.html",
    "scaling_weak.png",
    "throughput.png",
    "accuracy_heatmap.png",
    "val_acc_curves.png",
}

def report_figures(analysis, out, monkeypatch) -> dict:
    """The report's figures by file name (without .png), as write_report saved them."""
    from multirun_analysis import plots

    figures, save = {}, plots._save
    monkeypatch.setattr(plots, "_save",
                        lambda fig, path: figures.setdefault(path.stem, fig) and save(fig, path))
    write_report(analysis, out)
    return figures



@pytest.fixture(scope="module")
def messy_out(tmp_path_factory):
    """The report of a weak-scaling sweep plus one failed run and one truncated results.csv.

    Written once for the tests that read it: plotting is the slow part.
    """
    sweep = tmp_path_factory.mktemp("messy") / "sweep"
    for world_size, throughput in [(1, 1000.0), (2, 1800.0), (4, 3000.0)]:
        rows = run_rows(
            world_size=world_size,
            images_per_sec=(throughput,) * 3,
            val_acc=[0.6, 0.8, 0.92 - 0.01 * world_size],
        )
        write_results(sweep / str(world_size), rows)
        write_run_json(sweep / str(world_size), rows=rows)
    failed = run_rows(world_size=8, images_per_sec=(5000.0,), epochs=3)
    write_results(sweep / "failed", failed)
    write_run_json(
        sweep / "failed", status="failed", error="RuntimeError: NCCL watchdog timeout", rows=failed
    )
    truncated = run_rows(world_size=8, images_per_sec=(5000.0,) * 3)
    csv_path = write_results(sweep / "truncated", truncated)
    csv_path.write_text(csv_path.read_text()[:-40])  # the writer died mid-line
    write_run_json(sweep / "truncated", rows=truncated)
    out = sweep.parent / "out"
    write_report(analyse([sweep]), out)
    return out


def test_messy_sweep_is_analysed_and_both_bad_runs_are_listed(messy_out):
    out = messy_out
    assert OUTPUTS <= {p.name for p in out.iterdir()}
    runs = (
        pd.read_csv(out / "runs.csv")
        .assign(name=lambda d: d.path.str.rsplit("/", n=1).str[-1])
        .set_index("name")
    )
    assert runs.loc["failed", "problem"] == "failed: RuntimeError: NCCL watchdog timeout"
    assert "results.csv is truncated" in runs.loc["truncated", "problem"]
    assert not runs.loc[["failed", "truncated"], "included"].any()
    report = (out / "report.md").read_text()
    problems = report[report.index("## Problems") :]
    assert "| failed | failed | failed: RuntimeError: NCCL watchdog timeout |" in problems
    assert "| truncated | completed | results.csv is truncated: line 4 has no line end" in problems
    scaling = pd.read_csv(out / "scaling.csv")
    assert scaling.efficiency.tolist() == [1.0, 0.9, 0.75]
    assert {
        "scaling",
        "world_size",
        "images_per_sec",
        "images_per_sec_std",
        "n_runs",
        "speedup",
        "efficiency",
        "epoch_time_s",
        "grad_sync_share",
        "batch_size",
        "global_batch_size",
        "lr",
    } <= set(scaling.columns)


def test_report_opens_with_findings_then_tables_plots_runs_problems(messy_out):
    report = (messy_out / "report.md").read_text()
    order = ["## Key findings", "## Scaling", "![", "## Accuracy", "## Runs", "## Problems"]
    positions = [report.index(marker) for marker in order]
    assert positions == sorted(positions)
    findings = report[positions[0] : positions[1]]
    assert "**Best throughput: 3,000 images/sec** with world size 4" in findings
    assert "at world size 4, **efficiency 0.75** (speedup 3.00× over world size 1" in findings
    assert "final val_acc changes by -0.030" in findings
    assert (
        "5 runs** found (4 completed, 1 failed); **3 analysed**. 2 left out (1 failed, 1 unreadable or incomplete)"
        in findings
    )
    assert "Final val_acc ranges from 0.880 to 0.910" in findings
    assert "at the same time" not in findings


@pytest.mark.parametrize("second_throughput,expected", [
    (1600.0, ["efficiency at each group's largest world size** is 0.80 in every group;",
              "gradient sync takes 5% of step time there; final val_acc changes by -0.020 in "
              "every group."]),
    (1700.0, ["ranges from 0.80 (W", "to 0.85 (W", "gradient sync takes 5% of step time",
              "final val_acc changes by -0.020 in every group."]),
])
def test_findings_name_a_figure_once_when_every_group_has_it(tmp_path, second_throughput,
                                                             expected):
    """Not "ranges from 0.80 (W1 ...) to 0.80 (W2 ...)" or "5%–5%" for groups alike."""
    sweep_dir, write_run = new_sweep(tmp_path)
    for lr, throughput in [(0.1, 1600.0), (0.01, second_throughput)]:
        write_run(f"{lr}-1", lr=lr, val_acc=[0.6, 0.8, 0.9])
        write_run(f"{lr}-2", lr=lr, world_size=2, images_per_sec=(throughput,) * 3,
                  val_acc=[0.6, 0.8, 0.88], grad_sync_share=0.05)
    findings = " ".join(key_findings(analyse([sweep_dir])))
    for text in expected:
        assert text in findings
    assert "5%–5%" not in findings and "to -0.020" not in findings


def test_a_figure_shared_by_some_groups_says_how_many(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    for lr in (0.1, 0.01, 0.001):
        start, end = ([0.6, 0.8, 0.9], [0.6, 0.8, 0.88]) if lr != 0.001 else (["", "", ""],) * 2
        write_run(f"{lr}-1", lr=lr, val_acc=start)
        write_run(f"{lr}-2", lr=lr, world_size=2, images_per_sec=(1600.0,) * 3, val_acc=end)
    findings = " ".join(key_findings(analyse([sweep_dir])))
    assert "final val_acc changes by -0.020 in the 2 groups that report it." in findings


def test_runs_at_the_same_time_on_one_host_are_called_out(tmp_path):
    # Two sweeps started together on one machine: every run measured the others' load.
    sweep_dir, write_run = new_sweep(tmp_path)
    times = {"a": ("11:00:00", "11:10:00", "node0"), "b": ("11:05:00", "11:15:00", "node0"),
             "c": ("11:20:00", "11:30:00", "node0"), "d": ("11:00:00", "11:30:00", "node1")}
    for name, (start, end, host) in times.items():
        run_dir = write_run(name, world_size=1 + (name in "bd"))
        doc = json.loads((run_dir / "run.json").read_text())
        doc.update(start_time=f"2026-12-02T{start}+00:00", end_time=f"2026-12-02T{end}+00:00", hostname=host)
        (run_dir / "run.json").write_text(json.dumps(doc))
    analysis = analyse([sweep_dir])
    assert sorted(Path(p).name for p in overlapping_runs(analysis.runs)) == ["a", "b"]
    write_report(analysis, tmp_path / "out")
    assert ("**2 runs ran at the same time as another on one host** (first: "
            in (tmp_path / "out" / "report.md").read_text())


@pytest.mark.parametrize("cores", [{"usable_cores": 2}, {"devices": ["Intel(R) Xeon(R) Processor (2 logical cores)"]}],
                         ids=["usable_cores", "older run.json"])
def test_more_cpu_workers_than_cores_are_called_out(tmp_path, cores):
    # num_gpus=4 on a 2-core laptop: the training log said so, the report's findings did not.
    sweep_dir, write_run = new_sweep(tmp_path)
    for world_size in (1, 2, 4):
        run_dir = write_run(f"ws{world_size}", world_size=world_size)
        doc = json.loads((run_dir / "run.json").read_text())
        (run_dir / "run.json").write_text(json.dumps({**doc, **cores}))
    analysis = analyse([sweep_dir])
    assert [Path(p).name for p in crowded_runs(analysis.runs).path] == ["ws4"]
    assert any(f.startswith("**1 run had more CPU workers than cores** (") and
               "ws4, 4 workers on 2 cores" in f for f in key_findings(analysis))
    for run_dir in sweep_dir.iterdir():  # under torchrun or SLURM a task may have cores of its own
        doc = json.loads((run_dir / "run.json").read_text())
        (run_dir / "run.json").write_text(json.dumps({**doc, "launcher": "torchrun"}))
    assert crowded_runs(analyse([sweep_dir]).runs).empty


def test_a_seed_run_twice_in_one_configuration_is_called_out(tmp_path):
    # A sweep analysed with its rerun (seed 0 again): the accuracy table said n_runs 3 and a
    # "mean over seeds" that counted seed 0 twice, with nothing to say so.
    sweep_dir, write_run = new_sweep(tmp_path)
    for seed in (0, 1):
        write_run(f"s{seed}", seed=seed, val_acc=[0.6, 0.7, 0.8 + 0.02 * seed])
        write_run(f"s{seed}-ws2", seed=seed, world_size=2, val_acc=[0.6, 0.7, 0.8])
    assert repeated_seeds(analyse([sweep_dir]).runs).empty
    assert not any("repeated a seed" in f for f in key_findings(analyse([sweep_dir])))
    write_run("s0-rerun", seed=0, val_acc=[0.6, 0.7, 0.8])
    analysis = analyse([sweep_dir])
    assert [Path(p).name for p in repeated_seeds(analysis.runs).path] == ["s0-rerun"]
    assert any(f.startswith("**1 run repeated a seed of its configuration** (first: ") and
               "s0-rerun, seed 0)" in f for f in key_findings(analysis))


def test_report_html_is_self_contained(messy_out):
    html = (messy_out / "report.html").read_text()
    assert html.count('src="data:image/png;base64,') == 4  # no strong-scaling group here
    sources = re.findall(r'(?:src|href)="([^"#][^"]*)"', html)
    assert all(s.startswith("data:image/png;base64,") for s in sources)
    assert "<link" not in html and "<script" not in html and "url(" not in html
    assert html.index("Key findings") < html.index("<table")
    assert '<a href="#problems">Problems</a>' in html and 'id="problems"' in html


def test_single_world_size_still_writes_a_report(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("a", lr=0.1)
    write_run("b", lr=0.01)
    write_report(analyse([sweep_dir]), tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "**Nothing to scale:** every analysed run used world size 1." in report
    assert "**Final val_acc is 0.700** in all 2 configurations." in report  # not "from 0.700 to 0.700"
    assert not (tmp_path / "scaling_weak.png").exists()
    assert pd.read_csv(tmp_path / "scaling.csv").empty


def test_no_completed_runs_still_writes_a_report(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("a", status="failed", error="OOM", images_per_sec=(1.0,), epochs=3)
    write_run("b", status="running", images_per_sec=(1.0,), epochs=3)
    write_report(analyse([sweep_dir]), tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "**No run could be analysed**" in report
    assert "| a | failed | failed: OOM |" in report
    assert {"report.html", "runs.csv", "accuracy.csv"} <= {p.name for p in tmp_path.iterdir()}


def test_markdown_tables_escape_pipes_and_format_numbers():
    frame = pd.DataFrame({"problem": ["a|b"], "images_per_sec": ["1,800"]})
    assert markdown_table(frame) == "| problem | images_per_sec |\n|---|---|\n| a\\|b | 1,800 |"
    assert format_cell("images_per_sec", 1800.0) == "1,800"
    assert format_cell("images_per_sec", 12345.6) == "12,346"
    assert format_cell("efficiency", 0.9) == "0.90"
    assert format_cell("final_val_acc", 0.91234) == "0.912"
    assert format_cell("lr", 0.001) == "0.001"
    assert format_cell("time_to_target_s", float("nan")) == "–"


def test_runs_without_any_rows_are_listed(tmp_path):
    sweep_dir, _ = new_sweep(tmp_path)
    write_run_json(sweep_dir / "a", status="failed", error="CUDA error: out of memory")
    write_run_json(sweep_dir / "b", status="running")
    write_results(sweep_dir / "c", [], columns=["model", "dataset"])
    write_report(analyse([sweep_dir]), tmp_path)
    runs = pd.read_csv(tmp_path / "runs.csv", keep_default_na=False)
    assert runs.problem.tolist() == [
        "failed: CUDA error: out of memory",
        "still running, or stopped without updating run.json",
        "results.csv lacks required column(s): " + ", ".join(COLUMNS[2:21]),
    ]
    assert runs.epochs_done.tolist() == [0, 0, 0]
    assert "**No run could be analysed**" in (tmp_path / "report.md").read_text()


def test_groups_meeting_at_a_point_print_its_figure_once(tmp_path, monkeypatch):
    # Two groups alike in speed: both lines pass through 1.00× at world size 1 and 1.60× at
    # 2; the figures printed beside the points must not be drawn over each other.
    from multirun_analysis import plots

    sweep_dir, write_run = new_sweep(tmp_path)
    for lr in (0.1, 0.01):
        write_run(f"{lr}-1", lr=lr)
        write_run(f"{lr}-2", lr=lr, world_size=2, images_per_sec=(1600.0,) * 3)
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    analysis = analyse([sweep_dir])
    palette = plots.line_palette(analysis.configs, analysis.scaling)
    plots.plot_scaling(analysis.scaling, "weak", tmp_path / "weak.png", palette)
    speed_ax, eff_ax = figures[0].axes[:2]
    assert sorted(t.get_text() for t in speed_ax.texts) == ["1.00×", "1.60×"]
    assert sorted(t.get_text() for t in eff_ax.texts) == ["0.80", "1.00"]
    assert len(speed_ax.get_lines()) == 3  # the ideal line and both groups' lines


def test_figures_of_lines_that_end_close_together_do_not_overlap(tmp_path, monkeypatch):
    """Speedups of 3.50x, 3.55x and 3.60x at world size 4 printed their figures over each
    other; they move apart, in the order of their points and near them."""
    from multirun_analysis import plots

    sweep_dir, write_run = new_sweep(tmp_path)
    for lr, end in [(0.1, 3500.0), (0.05, 3550.0), (0.02, 3600.0)]:
        for world_size, throughput in [(1, 1000.0), (2, 1900.0), (4, end)]:
            write_run(f"{lr}/ws{world_size}", lr=lr, world_size=world_size,
                      images_per_sec=(throughput,) * 3)
    figures = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or save(fig, path))
    analysis = analyse([sweep_dir])
    palette = plots.line_palette(analysis.configs, analysis.scaling)
    plots.plot_scaling(analysis.scaling, "weak", tmp_path / "weak.png", palette)  # drawn: laid out
    for ax in figures[0].axes[:2]:
        notes = [note for note in ax.texts if note.xy[0] == 4]
        assert len(notes) == 3
        boxes = [note.get_bbox_patch().get_window_extent() for note in notes]
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
        points = [ax.transData.transform(note.xy)[1] for note in notes]
        assert np.argsort(points).tolist() == np.argsort([box.y0 for box in boxes]).tolist()
        assert all(abs(point - box.y1) < 3 * box.height for point, box in zip(points, boxes))


def test_an_accuracy_change_that_rounds_to_zero_prints_without_a_minus(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    # seeds ending at 0.5 and 0.66 average to a hair above 0.58: the change to 0.58 is -1e-16
    for seed, final in [(0, 0.5), (1, 0.66)]:
        write_run(f"ws1/s{seed}", seed=seed, val_acc=[0.5, 0.6, final])
    write_run("ws2", world_size=2, images_per_sec=(1800.0,) * 3, val_acc=[0.5, 0.6, 0.58])
    analysis = analyse([sweep_dir])
    assert analysis.scaling.val_acc_change.iloc[-1] < 0  # the float arithmetic, as found
    write_report(analysis, tmp_path / "out")
    report = (tmp_path / "out" / "report.md").read_text()
    assert "final val_acc changes by +0.000." in report
    assert "-0.000" not in report and "-0.000" not in (tmp_path / "out" / "scaling.md").read_text()
    assert format_cell("val_acc_change", -0.0004) == "+0.000"
    assert format_cell("val_acc_change", -0.02) == "-0.020"


def test_plots_of_runs_that_differ_in_many_keys_stay_readable(tmp_path, recwarn):
    """Analysing a whole outputs/ tree: some 20 keys vary. Naming them all made each legend
    label and panel title wider than its figure (matplotlib warned that constrained layout
    collapsed); a label names only the keys that tell its runs apart, then "…"."""
    sweep_dir, write_run = new_sweep(tmp_path)
    for run in range(5):
        for world_size in (1, 2):
            knobs = {f"knob_number_{k}": (run * 7 + k) % 5 for k in range(20)}
            write_run(f"r{run}_ws{world_size}", world_size=world_size, lr=0.1 if run % 2 else 0.01,
                      config={"train": knobs}, val_acc=[0.5, 0.6, 0.7 + 0.01 * run])
    result = analyse([sweep_dir])
    write_report(result, tmp_path / "out")
    assert not [w for w in recwarn if "constrained_layout" in str(w.message)]

    configs = result.configs
    keys = [k for k in config_keys(configs.columns) if k not in ("world_size", "num_gpus", "global_batch_size")]
    labels = _labels(configs, keys, always=("batch_size",))
    lines = configs.groupby(keys, dropna=False).ngroup()
    assert labels.groupby(lines).nunique().eq(1).all() and labels.nunique() == lines.nunique() == 5
    assert labels.str.len().max() < 60 and labels.str.endswith(", …").all()
    assert labels[configs.lr == 0.01].str.startswith("lr=0.01, batch=64, train.knob_number_0=").all()


def test_legends_name_a_dataset_and_optimizer_that_vary_with_the_model(tmp_path, monkeypatch):
    """A sweep of two model, dataset and optimizer triples: labels longer than 60 characters
    named only the keys that tell lines apart, "model=cnn, lr=0.1, batch=64, …", dropping
    the dataset and optimizer. The whole label fits a legend of one column."""
    sweep_dir, write_run = new_sweep(tmp_path)
    for model, dataset, optimizer in [("cnn", "fashion_mnist", "sgd"),
                                      ("resnet18", "cifar10", "adamw")]:
        for lr in (0.1, 0.01):
            for world_size in (1, 2, 4):
                write_run(f"{model}/{lr}/ws{world_size}", model=model, dataset=dataset,
                          optimizer=optimizer, lr=lr, world_size=world_size,
                          images_per_sec=(1000.0 * world_size,) * 3)
    figures = report_figures(analyse([sweep_dir]), tmp_path / "out", monkeypatch)
    assert set(figures) == {"scaling_weak", "throughput", "accuracy_heatmap", "val_acc_curves"}
    for name in ("scaling_weak", "throughput", "val_acc_curves"):
        legend = figures[name].legends[0]
        labels = [t.get_text() for t in legend.get_texts() if not t.get_text().startswith("ideal")]
        assert "…" not in "".join(labels)
        assert "dataset=cifar10, optim=adamw" in labels[-1], name
        assert figures[name].bbox.contains(*legend.get_window_extent().p0)
        assert figures[name].bbox.contains(*legend.get_window_extent().p1)
    assert labels[-1] == (
        "model=resnet18, dataset=cifar10, optim=adamw, lr=0.1, global batch=256, ws=4"
    )


def test_short_labels_keep_every_varying_key_even_when_some_go_together():
    """lr and world size vary together in the demo's curves; world size is what the study is about."""
    frame = pd.DataFrame({"lr": [0.02, 0.05, 0.02, 0.05], "global_batch_size": [64, 64, 128, 128],
                          "world_size": [1, 1, 2, 2]})
    assert list(_labels(frame, ["lr", "global_batch_size", "world_size"])) == [
        "lr=0.02, global batch=64, ws=1", "lr=0.05, global batch=64, ws=1",
        "lr=0.02, global batch=128, ws=2", "lr=0.05, global batch=128, ws=2"]


@pytest.fixture
def two_layouts(tmp_path):
    """A weak-scaling sweep that ran world size 4 as 1 node x 4 GPUs and as 2 nodes x 2 GPUs."""
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("1x1", world_size=1, images_per_sec=(1000.0,) * 3)
    write_run("1x2", world_size=2, images_per_sec=(1800.0,) * 3)
    write_run("1x4", world_size=4, num_nodes=1, images_per_sec=(3000.0,) * 3)
    write_run("2x2", world_size=4, num_nodes=2, images_per_sec=(2500.0,) * 3)
    return analyse([sweep_dir])


def test_findings_name_each_layout_of_one_world_size(two_layouts):
    findings = " ".join(key_findings(two_layouts))
    assert "with world size 4 (1 node × 4 GPUs), batch 64/worker" in findings
    assert (
        "at world size 4, **efficiency 0.75 with 1 node × 4 GPUs and 0.62 with 2 nodes × 2 GPUs** "
        "(speedup 3.00× and 2.50× over world size 1; ideal 4.00×)" in findings
    )


def test_findings_name_the_layout_of_the_best_and_worst_group(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    for lr, slow in [(0.1, 2000.0), (0.01, 2500.0)]:
        write_run(f"{lr}-1x1", lr=lr)
        write_run(f"{lr}-1x4", lr=lr, world_size=4, images_per_sec=(3000.0,) * 3)
        write_run(f"{lr}-2x2", lr=lr, world_size=4, num_nodes=2, images_per_sec=(slow,) * 3)
    findings = " ".join(key_findings(analyse([sweep_dir])))
    assert "across 2 groups" in findings
    assert "ranges from 0.50 (W2: lr=0.1, batch_size=64, world size 4 (2 nodes × 2 GPUs))" in findings
    assert "to 0.75 (W1: lr=0.01, batch_size=64, world size 4 (1 node × 4 GPUs))" in findings


def test_plots_keep_node_layouts_of_one_world_size_apart(two_layouts, tmp_path, monkeypatch):
    """One line through 1x4 and 2x2 drew an unlabelled vertical segment at world size 4."""
    from multirun_analysis import plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    palette = plots.line_palette(two_layouts.configs, two_layouts.scaling)
    plots.plot_scaling(two_layouts.scaling, "weak", tmp_path / "weak.png", palette)
    plots.plot_throughput(two_layouts.configs, tmp_path / "throughput.png", palette)
    for ax in (figures[0].axes[0], figures[1].axes[0]):
        handles, labels = ax.get_legend_handles_labels()
        lines = {label: getattr(h, "lines", [h])[0] for h, label in zip(handles, labels)
                 if not label.startswith("ideal")}  # an errorbar's handle holds its line
        assert [label.rsplit(", ", 1)[1] for label in lines] == ["1 node", "2 nodes"]
        for label, line in lines.items():
            xs = list(line.get_xdata())
            assert len(xs) == len(set(xs)), f"{label} visits a world size twice"


def test_a_diverged_run_from_an_older_sweep_is_left_out_saying_why(tmp_path):
    # Analysed silently, its chance accuracy and its nan-speed throughput read like any run's.
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("lr0.1/ws1")
    write_run("lr0.1/ws2", world_size=2, images_per_sec=(1800.0,) * 3)
    write_run("lr100/ws1", lr=100.0, val_acc=[0.1] * 3)
    diverged = write_run("lr100/ws2", lr=100.0, world_size=2, images_per_sec=(1800.0,) * 3,
                         val_acc=[0.1] * 3)
    csv_path = diverged / "results.csv"  # completed, as training wrote it before it stopped such runs
    lines = csv_path.read_text().splitlines()
    loss_columns = [COLUMNS.index("train_loss"), COLUMNS.index("val_loss")]
    for i in (2, 3):
        cells = lines[i].split(",")
        cells[loss_columns[0]], cells[loss_columns[1]] = "nan", "inf"
        lines[i] = ",".join(cells)
    csv_path.write_text("\n".join(lines) + "\n")
    analysis = analyse([sweep_dir])
    assert analysis.runs.diverged.tolist() == [False, False, False, True]
    assert analysis.runs.included.tolist() == [True, True, True, False]
    assert analysis.runs.problem.iloc[3] == "diverged (final train_loss nan, val_loss inf)"
    assert analysis.scaling[analysis.scaling.lr == 100.0].empty  # its group lost its world size 2
    write_report(analysis, tmp_path / "out")
    report = (tmp_path / "out" / "report.md").read_text()
    assert "diverged (final train_loss nan, val_loss inf)" in report


def test_a_reused_out_loses_the_plots_this_analysis_did_not_draw(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("ws1")
    write_run("ws2", world_size=2, images_per_sec=(1800.0,) * 3)
    out = tmp_path / "out"
    write_report(analyse([sweep_dir]), out)
    assert (out / "scaling_weak.png").is_file()
    (out / "notes.txt").write_text("mine\n")
    (out / "scaling_weak_v1.png").write_bytes(b"mine")
    write_report(analyse([sweep_dir / "ws1"]), out)  # one world size: no scaling plot
    assert not (out / "scaling_weak.png").exists()
    assert (out / "throughput.png").is_file()
    assert (out / "notes.txt").read_text() == "mine\n"  # not the analysis's to remove
    assert (out / "scaling_weak_v1.png").read_bytes() == b"mine"


def test_a_run_that_failed_before_an_epoch_adds_no_setting_columns(tmp_path):
    """Its run.json says backend=auto and it has no results.csv for precision, grad_accum_steps,
    ...: that is no other setting, so the Runs table keeps its columns to what varies."""
    sweep_dir, write_run = new_sweep(tmp_path)
    for world_size in (1, 2):
        write_run(f"ws{world_size}", world_size=world_size, columns=[*COLUMNS, "grad_accum_steps"])
    for name, lr in [("early", 0.1), ("lr100", 100.0)]:
        write_run_json(sweep_dir / name, status="failed", error="ValueError: no", rows=[
            {"lr": lr, "num_gpus": 2, "world_size": 2}],
            config={"distributed": {"backend": "auto", "device": "auto"}})
    analysis = analyse([sweep_dir])
    assert set(analysis.runs.backend.fillna("?")) == {"gloo", "auto"}  # as found
    write_report(analysis, tmp_path / "out")
    runs_md = (tmp_path / "out" / "runs.md").read_text().splitlines()
    header = [c.strip() for c in runs_md[4].strip("|").split("|")]
    assert header[:7] == ["run", "status", "included", "lr", "global_batch_size", "world_size",
                          "epochs_done"]
    assert not {"backend", "device", "grad_accum_steps"} & set(header)
    assert "backend=`gloo`, device=`cpu`, grad_accum_steps=`1`" in runs_md[2]
    assert runs_md[2].startswith("Shared by every run that resolved them:")


def test_an_empty_scaling_table_says_why(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("ws1")
    write_run("ws1-lr", lr=0.01)
    write_report(analyse([sweep_dir]), tmp_path / "out")
    scaling_md = (tmp_path / "out" / "scaling.md").read_text()
    assert scaling_md == "# Scaling\n\nNo rows: every analysed run used world size 1.\n"
    assert "**Nothing to scale:** every analysed run used world size 1." in (
        tmp_path / "out" / "report.md").read_text()


def test_a_column_of_numbers_reads_in_one_format():
    """An exact 1246 printed "1246" beside "1,681", and 4.995 printed "5" beside "4.34"."""
    from multirun_analysis.render import format_frame

    frame = pd.DataFrame({
        "images_per_sec": [1246.0, 1681.3, float("nan")],
        "epoch_time_s": [4.995, 4.34, 0.5],
        "global_batch_size": pd.array([64, 128, 16384], dtype="Int64"),
        "n_runs": [1, 2, 3],
        "final_val_acc": [0.9, 0.91234, 0.5],
    })
    assert format_frame(frame).to_dict("list") == {
        "images_per_sec": ["1,246", "1,681", "–"],
        "epoch_time_s": ["5.00", "4.34", "0.50"],
        "global_batch_size": ["64", "128", "16384"],  # a setting: as typed
        "n_runs": ["1", "2", "3"],
        "final_val_acc": ["0.900", "0.912", "0.500"],
    }


def test_a_configuration_has_one_colour_in_the_weak_scaling_and_throughput_plots(tmp_path, monkeypatch):
    from multirun_analysis import plots

    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("lr0.001", lr=0.001)  # one world size: a throughput line, no scaling group
    for lr in (0.1, 0.01):
        write_run(f"lr{lr}-1", lr=lr)
        write_run(f"lr{lr}-2", lr=lr, world_size=2, images_per_sec=(1800.0,) * 3)
    analysis = analyse([sweep_dir])
    figures, save = [], plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or save(fig, path))
    write_report(analysis, tmp_path / "out")
    weak_fig, throughput_fig = figures[:2]

    def colours(ax) -> dict:
        handles, labels = ax.get_legend_handles_labels()
        return {label.split("lr=")[1].split(",")[0]: getattr(h, "lines", [h])[0].get_color()
                for h, label in zip(handles, labels) if "lr=" in label}

    weak, throughput = colours(weak_fig.axes[0]), colours(throughput_fig.axes[0])
    assert set(weak) == {"0.1", "0.01"} and len(throughput) == 3
    assert all(weak[lr] == throughput[lr] for lr in weak)


def test_tables_print_settings_as_typed_and_large_numbers_with_separators(tmp_path):
    """A swept config key printed in 3 significant digits (momentum 0.9995 as "1"), a global
    batch of 32768 as "32,768" (settings are typed without separators) and an exact 1800
    images/sec as "1800", though any other throughput from 1,000 up had separators."""
    sweep_dir, write_run = new_sweep(tmp_path)
    for momentum in (0.9, 0.9995):
        for world_size, throughput in [(1, 1800.0), (2, 3000.0)]:
            write_run(f"{momentum}/ws{world_size}", lr=0.05, world_size=world_size,
                      batch_size=16384, images_per_sec=(throughput,) * 3,
                      config={"optim": {"momentum": momentum}})
    write_report(analyse([sweep_dir]), tmp_path / "out")
    scaling_md = (tmp_path / "out" / "scaling.md").read_text()
    assert "lr=`0.05`, batch_size=`16384`" in scaling_md  # shared by every row
    # scaling, group, global batch, momentum, world size, n_runs, images/sec
    assert "| weak | W2 | 16384 | 0.9995 | 1 | 1 | 1,800 |" in scaling_md
    assert "| weak | W2 | 32768 | 0.9995 | 2 | 1 | 3,000 |" in scaling_md
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| 0.9995 | 0.05 | 32768 | 2 | 1 |" in report  # accuracy: momentum, lr, global batch
    assert "| 0.9995/ws2 | completed | yes | 32768 | 2 | 0.9995 | 3/3 | 3,000 |" in report  # runs


def test_large_and_small_settings_print_as_typed_and_keep_their_values_in_csv(tmp_path):
    """lr=1e10 printed as 10000000000 in every table and the key findings."""
    sweep_dir, write_run = new_sweep(tmp_path)
    for i, (lr, decay) in enumerate(((1e10, 0.0), (0.05, 0.0), (0.05, 1e-6))):
        for world_size in (1, 2):
            write_run(f"{i}/ws{world_size}", lr=lr, world_size=world_size,
                      config={"optim": {"weight_decay": decay}})
    write_report(analyse([sweep_dir]), tmp_path / "out")
    out = tmp_path / "out"
    shown = "".join((out / name).read_text() for name in ("report.md", "runs.md", "scaling.md", "accuracy.md"))
    assert "10000000000" not in shown and "| 1e+10 |" in (out / "runs.md").read_text()
    assert "1e-06" in (out / "runs.md").read_text()
    runs = pd.read_csv(out / "runs.csv")
    assert sorted(runs.lr.unique()) == [0.05, 1e10] and sorted(runs["optim.weight_decay"].unique()) == [0, 1e-6]


def test_every_plot_colours_a_line_as_the_others_do_and_lists_lines_in_colour_order(
    tmp_path, monkeypatch
):
    """The strong-scaling plot numbered its colours on its own: its lr=0.1 group took the
    colour of the throughput plot's lr=0.01 line. And the weak-scaling plot took the throughput
    plot's colours in world-size order while listing its groups by settings, so its legend
    ran C4, C0, C2."""
    from matplotlib.colors import to_hex

    sweep_dir, write_run = new_sweep(tmp_path)
    for lr in (0.1, 0.01):
        for batch, world_size in [(32, 1), (32, 2), (64, 1)]:  # global batch 64 twice: strong
            write_run(f"{lr}/b{batch}-ws{world_size}", lr=lr, batch_size=batch,
                      world_size=world_size, images_per_sec=(1000.0 * world_size,) * 3)
    for world_size in (2, 4):  # an lr first in order, but not run at world size 1
        write_run(f"0.001/ws{world_size}", lr=0.001, world_size=world_size,
                  images_per_sec=(1000.0 * world_size,) * 3)
    figures = report_figures(analyse([sweep_dir]), tmp_path / "out", monkeypatch)

    def legend(name) -> list[tuple[str, str]]:
        shown = figures[name].legends[0]
        return [(text.get_text(), to_hex(handle.get_color()))
                for text, handle in zip(shown.get_texts(), shown.legend_handles)
                if not text.get_text().startswith("ideal")]

    colour = [to_hex(f"C{i}") for i in range(10)]
    assert legend("throughput") == [
        ("lr=0.001, batch=64", colour[0]),
        ("lr=0.01, batch=32", colour[1]),
        ("lr=0.01, batch=64", colour[2]),
        ("lr=0.1, batch=32", colour[3]),
        ("lr=0.1, batch=64", colour[4]),
    ]
    assert legend("scaling_weak") == [
        ("W1: lr=0.001, batch=64", colour[0]),
        ("W2: lr=0.01, batch=32", colour[1]),
        ("W3: lr=0.1, batch=32", colour[3]),
    ]
    # each strong group's runs lie on two throughput lines: it takes a colour of its own
    assert legend("scaling_strong") == [
        ("S1: lr=0.01, global batch=64", colour[5]),
        ("S2: lr=0.1, global batch=64", colour[6]),
    ]


def test_the_accuracy_curves_colour_a_configuration_as_the_throughput_plot_does(
    tmp_path, monkeypatch
):
    """The curves numbered their colours by final accuracy: the most accurate configuration
    (lr=0.1, throughput's second line, orange) was blue there. A curve takes its throughput
    line's colour and style; its world sizes are told apart by marker."""
    from matplotlib.colors import to_hex

    sweep_dir, write_run = new_sweep(tmp_path)
    for i, lr in enumerate((0.01, 0.1)):  # lr=0.1 ends the more accurate: first by accuracy
        for world_size in (1, 2):
            write_run(f"{lr}/ws{world_size}", lr=lr, world_size=world_size,
                      images_per_sec=(1000.0 * world_size,) * 3,
                      val_acc=[0.5, 0.6, 0.7 + 0.1 * i - 0.01 * world_size])
    figures = report_figures(analyse([sweep_dir]), tmp_path / "out", monkeypatch)

    def looks(name) -> dict[str, tuple]:
        """(colour, line style, marker) of each line by its label's lr and world size."""
        handles, labels = figures[name].axes[0].get_legend_handles_labels()
        settings = [dict(part.split("=") for part in label.split(", ")) for label in labels]
        return {", ".join(f"{k}={s[k]}" for k in ("lr", "ws") if k in s):
                (to_hex(line.get_color()), line.get_linestyle(), line.get_marker())
                for s, line in zip(settings, (getattr(h, "lines", [h])[0] for h in handles))}

    throughput, curves = looks("throughput"), looks("val_acc_curves")
    for name, (colour, style, marker) in curves.items():
        assert (colour, style) == throughput[name.split(",")[0]][:2]
        assert marker == ("o" if name.endswith("ws=1") else "s")
    # listed in colour order, as the other legends are
    assert list(curves) == ["lr=0.01, ws=1", "lr=0.01, ws=2", "lr=0.1, ws=1", "lr=0.1, ws=2"]


def test_the_scaling_tables_name_a_setting_their_rows_share_that_other_runs_do_not(tmp_path):
    """lr=0.02 ran at world size 1 only (its 2-worker run failed): it is in no scaling group,
    so the tables' rows all have lr=0.1 and show no lr column. The report must still say it."""
    sweep_dir, write_run = new_sweep(tmp_path)
    for world_size in (1, 2):
        write_run(f"ws{world_size}", world_size=world_size, lr=0.1)
    write_run("ws1-lr", lr=0.02)
    write_report(analyse([sweep_dir]), tmp_path / "out")
    report = (tmp_path / "out" / "report.md").read_text()
    scaling = report.split("## Scaling")[1].split("### Weak")[0]
    assert "lr=`0.1`" in scaling


def test_the_epoch_axis_of_one_epoch_runs_has_whole_epochs_only(tmp_path, monkeypatch):
    """With train.epochs=1 every curve is one point at epoch 1, and the axis read 0.96, 0.98,
    1.00, 1.02, 1.04: epochs that do not exist."""
    from multirun_analysis import plots

    sweep_dir, write_run = new_sweep(tmp_path)
    for world_size in (1, 2):
        write_run(f"ws{world_size}", world_size=world_size, images_per_sec=(1000.0,))
    analysis = analyse([sweep_dir])
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    palette = plots.line_palette(analysis.configs, analysis.scaling)
    plots.plot_curves(analysis.epochs, analysis.runs, tmp_path / "curves.png", palette)
    epoch_ax = figures[0].axes[0]
    low, high = epoch_ax.get_xlim()
    ticks = [t for t in epoch_ax.get_xticks() if low <= t <= high]
    assert ticks == [1.0]


def test_the_report_of_one_run_says_1_run(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("a")
    write_report(analyse([sweep_dir]), tmp_path / "out")
    assert f"Sweep: `{sweep_dir}` · 1 run · target" in (tmp_path / "out" / "report.md").read_text()


def test_the_figures_beside_the_points_stay_readable_over_lines(tmp_path, monkeypatch):
    """An efficiency of 1.41 printed 12 points below its point landed on the dashed ideal
    line at 1.0, which struck it through; figures at the largest world size crossed the
    axes' frame. Each figure sits on a white patch that hides what is beneath it."""
    from matplotlib.colors import to_rgba

    from multirun_analysis import plots

    sweep_dir, write_run = new_sweep(tmp_path)
    for world_size, throughput in [(1, 1000.0), (2, 2820.0)]:
        write_run(f"ws{world_size}", world_size=world_size, images_per_sec=(throughput,) * 3)
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    analysis = analyse([sweep_dir])
    palette = plots.line_palette(analysis.configs, analysis.scaling)
    plots.plot_scaling(analysis.scaling, "weak", tmp_path / "weak.png", palette)
    texts = [t for ax in figures[0].axes[:2] for t in ax.texts]
    assert sorted(t.get_text() for t in texts) == ["1.00", "1.00×", "1.41", "2.82×"]
    for text in texts:
        patch = text.get_bbox_patch()
        assert patch is not None, text.get_text()
        assert to_rgba(patch.get_facecolor())[:3] == (1.0, 1.0, 1.0)
        assert patch.get_alpha() is None or patch.get_alpha() >= 0.7


def _close_lines_to_8_workers(tmp_path, monkeypatch):
    """The weak-scaling figure of three lines whose speedups at 2, 4 and 8 workers lie close
    together (3.55x, 3.59x and 3.64x at 8), saved; its axes and the renderer that drew it."""
    from multirun_analysis import plots

    sweep_dir, write_run = new_sweep(tmp_path)
    for i, lr in enumerate((0.1, 0.05, 0.02)):
        for world_size, throughput in [(1, 1000.0), (2, 1900.0), (4, 3400.0), (8, 3550.0)]:
            write_run(f"{lr}/ws{world_size}", lr=lr, world_size=world_size,
                      images_per_sec=(throughput * (1 + 0.012 * i * (world_size > 1)),) * 3)
    figures, save = [], plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or save(fig, path))
    analysis = analyse([sweep_dir])
    palette = plots.line_palette(analysis.configs, analysis.scaling)
    plots.plot_scaling(analysis.scaling, "weak", tmp_path / "weak.png", palette)
    return figures[0].axes[:2], figures[0].canvas.get_renderer()


def test_the_figures_beside_the_points_stay_inside_the_axes(tmp_path, monkeypatch):
    """The figures printed beside the points at 8 workers (3.64x, 3.59x, 3.55x) stuck out past
    the right of the axes, and the frame's line struck through them."""
    axes, renderer = _close_lines_to_8_workers(tmp_path, monkeypatch)
    assert len(axes[0].texts) == 10  # 1.00x once (every line meets there), then three per size
    for ax in axes:
        frame = ax.get_window_extent(renderer)
        for note in ax.texts:
            for box in (note.get_window_extent(renderer), note.get_bbox_patch().get_window_extent()):
                assert frame.x0 <= box.x0 and box.x1 <= frame.x1, (note.get_text(), box, frame)
                assert frame.y0 <= box.y0 and box.y1 <= frame.y1, (note.get_text(), box, frame)


def test_a_figure_beside_a_point_has_its_lines_colour(tmp_path, monkeypatch):
    """The figures were black: moved apart, they matched their lines only by order. A figure
    that several lines share (1.00x where every line starts, 0.45 at 8 workers for two of the
    efficiencies) stays black, naming none."""
    from matplotlib.colors import to_hex

    axes, _ = _close_lines_to_8_workers(tmp_path, monkeypatch)
    for ax in axes:
        lines = [line for line in ax.get_lines() if not line.get_label().startswith("ideal")]
        for note in ax.texts:
            through = {to_hex(line.get_color()) for line in lines  # at its x, printing as it
                       if any(x == note.xy[0] and f"{y:.2f}" == note.get_text().rstrip("×")
                              for x, y in line.get_xydata())}
            assert through, note.get_text()
            expected = through.pop() if len(through) == 1 else to_hex("black")
            assert to_hex(note.get_color()) == expected, note.get_text()


def test_every_world_layout_of_one_configuration_has_its_own_marker_in_the_curves(
    tmp_path, monkeypatch
):
    """1, 2, 4 and 8 GPUs on one node and on two are eight layouts of one configuration, all in
    its colour; six markers went round, so 1 node x 1 GPU and 2 nodes x 4 GPUs were both blue
    circles, two curves that looked alike in the plot and in the legend."""
    from multirun_analysis import plots

    sweep_dir, write_run = new_sweep(tmp_path)
    for nodes in (1, 2):
        for gpus in (1, 2, 4, 8):
            write_run(f"n{nodes}/g{gpus}", world_size=nodes * gpus, num_nodes=nodes,
                      val_acc=[0.6, 0.7, 0.8 - 0.002 * nodes * gpus])
    analysis = analyse([sweep_dir])
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    palette = plots.line_palette(analysis.configs, analysis.scaling)
    plots.plot_curves(analysis.epochs, analysis.runs, tmp_path / "curves.png", palette)
    lines = figures[0].axes[0].get_lines()
    looks = {(line.get_color(), line.get_linestyle(), line.get_marker()) for line in lines}
    assert len(lines) == 8 and len(looks) == 8


def test_a_long_legend_leaves_the_axes_their_height(tmp_path, monkeypatch):
    """Lines run at a world size in two node layouts have a legend entry per layout, but the
    figure grew by a row per line: six lines of long labels, each in two layouts, squashed
    the axes, and the speedup axis' label ran past their ends."""
    from multirun_analysis import plots

    sweep_dir, write_run = new_sweep(tmp_path)
    for model, dataset, optimizer in [("cnn", "fashion_mnist", "sgd"),
                                      ("wide_resnet", "cifar10", "adamw")]:
        for lr in (0.1, 0.01, 0.001):
            for nodes, gpus in [(1, 1), (1, 2), (2, 1)]:
                write_run(f"{model}/{lr}/{nodes}x{gpus}", model=model, dataset=dataset,
                          optimizer=optimizer, lr=lr, world_size=nodes * gpus, num_nodes=nodes,
                          images_per_sec=(1000.0 * (gpus + nodes - 1) ** 0.9 / nodes,) * 3)
    figures, save = [], plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or save(fig, path))
    analysis = analyse([sweep_dir])
    palette = plots.line_palette(analysis.configs, analysis.scaling)
    plots.plot_scaling(analysis.scaling, "weak", tmp_path / "weak.png", palette)
    plots.plot_throughput(analysis.configs, tmp_path / "throughput.png", palette)
    for fig in figures:
        renderer = fig.canvas.get_renderer()
        assert len(fig.legends[0].get_texts()) >= 12  # one column: the labels are long
        for ax in fig.axes:
            frame = ax.get_window_extent(renderer)
            assert frame.height / fig.dpi > 3.3
            assert ax.yaxis.label.get_window_extent(renderer).height < frame.height


def test_the_curves_name_what_their_best_configurations_share_that_others_do_not(
    tmp_path, monkeypatch
):
    """The curves show the 12 most accurate of 13 configurations, all of one model: labelled
    from those twelve alone, no label named the model, though the sweep ran two (the throughput
    and scaling plots label their lines among all of them). Labels of every setting run past
    100 characters here; cut short, they keep the world size."""
    from multirun_analysis import plots

    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("cnn", model="cnn", val_acc=[0.5, 0.6, 0.7])
    for lr in (0.1, 0.05, 0.02, 0.01):
        for nodes, gpus in [(1, 1), (1, 2), (2, 1)]:
            write_run(f"wrn/{lr}/{nodes}x{gpus}", model="wide_resnet", dataset="cifar10",
                      optimizer="adamw", lr=lr, world_size=nodes * gpus, num_nodes=nodes,
                      val_acc=[0.5, 0.7, 0.8])
    analysis = analyse([sweep_dir])
    figures = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or path)
    palette = plots.line_palette(analysis.configs, analysis.scaling)
    plots.plot_curves(analysis.epochs, analysis.runs, tmp_path / "curves.png", palette)
    labels = [text.get_text() for text in figures[0].legends[0].get_texts()]
    assert len(labels) == 12
    assert all(label.startswith("model=wide_resnet, ") for label in labels), labels
    assert all(re.search(r"ws=[12]\b", label) for label in labels), labels
