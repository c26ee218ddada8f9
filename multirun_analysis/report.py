"""Write an Analysis to disk: CSV and Markdown tables, PNG plots, report.md and report.html."""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

import pandas as pd

from . import plots
from .findings import key_findings
from .render import Bullets, Heading, Image, Paragraph, Table, format_frame, markdown_table, to_html, to_markdown
from .runs import INCLUSION_RULE
from .schema import WORLD, settings_in
from .sweep import Analysis
from .tables import format_value

MAX_REPORT_ROWS = 500  # the report lists at most this many runs; runs.md and runs.csv hold all
METHOD = (
    "Throughput of a run is the median images/sec (summed over workers) over its epochs after "
    "the first (all epochs if it has one). Runs identical but for the seed are averaged: mean, "
    "std (over runs) and n. Speedup = throughput / throughput at the group's smallest world "
    "size; efficiency = speedup × smallest world size / world size (1.00 = linear). Weak "
    "scaling keeps the per-worker batch fixed, so the global batch grows with the world size; "
    "strong scaling keeps the global batch fixed. A group run at a single world size says "
    "nothing about scaling and is left out."
)


def write_report(analysis: Analysis, out: Path) -> Path:
    """Write every output file into `out` and return the path of report.html."""
    out.mkdir(parents=True, exist_ok=True)
    analysis.runs.to_csv(out / "runs.csv", index=False)
    analysis.scaling.to_csv(out / "scaling.csv", index=False)
    analysis.accuracy.to_csv(out / "accuracy.csv", index=False)
    runs_view, scaling_view, accuracy_view = _runs_view(analysis), _scaling_view(analysis.scaling), _accuracy_view(analysis)
    for name, title, view, shared in [
        ("runs", "Runs", runs_view, analysis.runs),
        ("scaling", "Scaling", scaling_view, analysis.scaling),
        ("accuracy", "Accuracy by configuration", accuracy_view, analysis.accuracy),
    ]:
        text = f"# {title}\n\n{_shared_settings(shared)}\n\n{markdown_table(format_frame(view))}\n"
        (out / f"{name}.md").write_text(text, encoding="utf-8")
    images = {
        "weak": plots.plot_scaling(analysis.scaling, "weak", out / "scaling_weak.png"),
        "strong": plots.plot_scaling(analysis.scaling, "strong", out / "scaling_strong.png"),
        "throughput": plots.plot_throughput(analysis.configs, out / "throughput.png"),
        "heatmap": plots.plot_accuracy_heatmap(analysis.configs, out / "accuracy_heatmap.png"),
        "curves": plots.plot_curves(analysis.epochs, analysis.runs, out / "val_acc_curves.png"),
    }
    blocks = _blocks(analysis, images, runs_view, scaling_view, accuracy_view)
    (out / "report.md").write_text(to_markdown(blocks), encoding="utf-8")
    (out / "report.html").write_text(to_html(blocks, title=_title(analysis)), encoding="utf-8")
    return out / "report.html"


def _blocks(analysis: Analysis, images: dict, runs_view, scaling_view, accuracy_view) -> list:
    """The report, top to bottom: findings, scaling, accuracy, runs, problems."""
    sweeps = ", ".join(f"`{d}`" for d in analysis.sweep_dirs)
    blocks = [
        Heading(_title(analysis), 1),
        Paragraph(
            f"Sweep: {sweeps} · {len(analysis.runs)} runs · target val_acc {analysis.target_acc:g} · "
            f"written {datetime.now():%Y-%m-%d %H:%M} by `python -m multirun_analysis`"
        ),
        Heading("Key findings"),
        Bullets(tuple(key_findings(analysis))),
        Heading("Scaling"),
        Paragraph(METHOD),
    ]
    if not analysis.configs.empty:
        blocks.append(Paragraph(_shared_settings(analysis.configs)))
    for kind, title in (("weak", "Weak scaling (per-worker batch fixed)"), ("strong", "Strong scaling (global batch fixed)")):
        blocks.append(Heading(title, 3))
        view = scaling_view[scaling_view.scaling == kind].drop(columns="scaling")
        if view.empty:
            blocks.append(Paragraph("No group of analysed runs differs only in world size for this kind."))
            continue
        blocks.append(Table(format_frame(view)))
        blocks.append(Image(images[kind], f"{title}: speedup against the ideal line, and efficiency, by world size"))
    if images["throughput"]:
        blocks += [Heading("Throughput", 3), Image(images["throughput"], "Throughput (images/sec, mean ± std over seeds) by world size")]
    blocks += [
        Heading("Accuracy"),
        Paragraph(
            f"Final and best val_acc per configuration (mean over seeds). epochs_to_target and "
            f"time_to_target_s: the first epoch, and the training time (evaluation excluded) up to it, "
            f"at which val_acc ≥ {analysis.target_acc:g}, averaged over the n_reached runs that got "
            "there; – means never reached."
        ),
    ]
    if accuracy_view.empty:
        blocks.append(Paragraph("No analysed runs."))
    else:
        blocks.append(Table(format_frame(accuracy_view)))
    blocks += [Image(images[k], alt) for k, alt in (
        ("heatmap", "Final validation accuracy by learning rate and global batch size"),
        ("curves", "Validation accuracy over epochs and over training time"),
    ) if images[k]]
    blocks += [Heading("Runs"), Paragraph(INCLUSION_RULE)]
    if len(runs_view) > MAX_REPORT_ROWS:
        blocks.append(Paragraph(f"The first {MAX_REPORT_ROWS} of {len(runs_view)} runs; `runs.csv` lists all."))
    blocks.append(Table(format_frame(runs_view.drop(columns="problem").head(MAX_REPORT_ROWS))))
    problems = runs_view.loc[runs_view.problem.ne(""), ["run", "status", "problem"]]
    blocks.append(Heading("Problems"))
    if problems.empty:
        blocks.append(Paragraph("None: every run was analysed."))
    else:
        if len(problems) > MAX_REPORT_ROWS:
            blocks.append(Paragraph(f"The first {MAX_REPORT_ROWS} of {len(problems)}; `runs.csv` lists all."))
        blocks.append(Table(format_frame(problems.head(MAX_REPORT_ROWS))))
    return blocks


def _title(analysis: Analysis) -> str:
    names = ", ".join(Path(d).resolve().name for d in analysis.sweep_dirs)
    return f"Scaling report: {names}"


def _varying(frame: pd.DataFrame, columns) -> list[str]:
    return [c for c in columns if c in frame and frame[c].nunique(dropna=False) > 1]


def _shared_settings(frame: pd.DataFrame) -> str:
    """One sentence naming the settings every row shares (the tables show only the rest)."""
    shared = [c for c in settings_in(frame.columns) if c != "seed" and frame[c].nunique(dropna=False) == 1]
    if frame.empty or not shared:
        return ""
    return "Shared by every row: " + ", ".join(f"{c}=`{format_value(frame[c].iloc[0])}`" for c in shared) + "."


def _scaling_view(scaling: pd.DataFrame) -> pd.DataFrame:
    """The scaling table with settings that never vary dropped."""
    settings = [c for c in _varying(scaling, settings_in(scaling.columns)) if c not in WORLD]
    metrics = ["n_runs", "images_per_sec", "images_per_sec_std", "speedup", "efficiency", "epoch_time_s",
               *(["grad_sync_share"] if scaling.grad_sync_share.notna().any() else []),
               "final_val_acc", "val_acc_change"]
    # Show the node layout only when some run used more than one node.
    world = ["world_size", "num_nodes", "num_gpus"] if scaling.num_nodes.nunique() > 1 else ["world_size"]
    return scaling[["scaling", "group", *settings, *world, *metrics]]


def _accuracy_view(analysis: Analysis) -> pd.DataFrame:
    """The accuracy table: lr, global batch, world size, the other settings that vary, and results."""
    table = analysis.accuracy
    core = ["lr", "global_batch_size", "world_size"]
    settings = [c for c in _varying(table, table.columns[: table.columns.get_loc("n_runs")]) if c not in core]
    return table[[*settings, *core, "n_runs", "final_val_acc", "final_val_acc_std", "best_val_acc",
                  "n_reached", "epochs_to_target", "time_to_target_s"]]


def _runs_view(analysis: Analysis) -> pd.DataFrame:
    """The runs table for reading: path relative to the sweep, status, varying settings, results."""
    runs = analysis.runs
    base = os.path.commonpath([os.path.abspath(d) for d in analysis.sweep_dirs])
    relative = runs.path.map(lambda p: os.path.relpath(os.path.abspath(p), base))
    settings = _varying(runs, settings_in(runs.columns))
    return runs.assign(
        run=relative,
        epochs_done=runs.epochs_done.astype(str) + "/" + runs.epochs.astype(str).replace("<NA>", "?"),
    )[["run", "status", "included", *settings, "epochs_done", "images_per_sec", "final_val_acc", "best_val_acc", "problem"]]
