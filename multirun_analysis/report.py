"""Write an Analysis to disk: CSV and Markdown tables, PNG plots, report.md and report.html."""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

import pandas as pd

from . import plots
from .findings import key_findings, no_scaling_reason
from .render import (
    Bullets,
    Heading,
    Image,
    Paragraph,
    Table,
    format_frame,
    format_value,
    markdown_table,
    to_html,
    to_markdown,
)
from .runs import INCLUSION_RULE
from .schema import settings_in
from .sweep import Analysis

SCALING_TITLES = {
    "weak": "Weak scaling (per-worker batch fixed)",
    "strong": "Strong scaling (global batch fixed)",
}
# The plots, by the report's name for each. Every other file the report writes is written
# every time; a plot with nothing to draw is not, and an older one of that name is removed.
PLOTS = {
    "weak": "scaling_weak.png",
    "strong": "scaling_strong.png",
    "throughput": "throughput.png",
    "heatmap": "accuracy_heatmap.png",
    "curves": "val_acc_curves.png",
}
MAX_REPORT_ROWS = 500  # the report lists at most this many runs; runs.md and runs.csv hold all
METHOD = (
    "Throughput of a run is the median images/sec (summed over workers) over its epochs after "
    "the first (all epochs if it has one). Runs identical but for the seed are averaged: mean, "
    "std (over runs) and n; a key of run.json's config that differs between otherwise alike "
    "runs (e.g. distributed.bucket_cap_mb; results.csv's bucket_cap_mb column where run.json "
    "lacks it) is a setting column of its own, so runs that differ in it are never averaged "
    "together, and so is `hardware` (run.json's device names) where alike runs ran on "
    "different machines. Speedup = throughput / throughput at the group's "
    "smallest world size; efficiency = speedup × smallest world size / world size (1.00 = "
    "linear). Weak scaling keeps the per-worker batch fixed, so the global batch grows with the "
    "world size; strong scaling keeps the global batch fixed. A group run at a single world "
    "size says nothing about scaling and is left out."
)


def write_report(analysis: Analysis, out: Path) -> Path:
    """Write every output file into `out` and return the path of report.html."""
    out.mkdir(parents=True, exist_ok=True)
    views = {
        "runs": _runs_view(analysis),
        "scaling": _scaling_view(analysis.scaling),
        "accuracy": _accuracy_view(analysis.accuracy),
    }
    for name, title, table in (
        ("runs", "Runs", analysis.runs),
        ("scaling", "Scaling", analysis.scaling),
        ("accuracy", "Accuracy by configuration", analysis.accuracy),
    ):
        table.to_csv(out / f"{name}.csv", index=False)
        body = markdown_table(format_frame(views[name]))
        if table.empty:  # a header row alone says nothing; say why there are no rows
            why = "no run could be analysed"
            body = f"No rows: {no_scaling_reason(analysis.configs) if name == 'scaling' else why}."
        values = _run_values(table) if name == "runs" and not table.included.all() else None
        parts = [f"# {title}", _shared_settings(table, values), body]
        text = "\n\n".join(part for part in parts if part) + "\n"
        (out / f"{name}.md").write_text(text, encoding="utf-8")
    palette = plots.line_palette(analysis.configs, analysis.scaling)  # shared: one line, one colour
    images = {
        "weak": plots.plot_scaling(analysis.scaling, "weak", out / PLOTS["weak"], palette),
        "strong": plots.plot_scaling(analysis.scaling, "strong", out / PLOTS["strong"], palette),
        "throughput": plots.plot_throughput(analysis.configs, out / PLOTS["throughput"], palette),
        "heatmap": plots.plot_accuracy_heatmap(analysis.configs, out / PLOTS["heatmap"]),
        "curves": plots.plot_curves(analysis.epochs, analysis.runs, out / PLOTS["curves"], palette),
    }
    for name, image in images.items():
        if image is None:  # an earlier analysis's plot must not pass for this one's
            (out / PLOTS[name]).unlink(missing_ok=True)
    blocks = [
        *_opening(analysis),
        *_scaling_section(analysis, views["scaling"], images),
        *_accuracy_section(analysis, views["accuracy"], images),
        *_runs_section(views["runs"], _never_ran(analysis)),
    ]
    (out / "report.md").write_text(to_markdown(blocks), encoding="utf-8")
    (out / "report.html").write_text(to_html(blocks, title=_title(analysis)), encoding="utf-8")
    return out / "report.html"


def _opening(analysis: Analysis) -> list:
    """Title, what was analysed, and the key findings in words."""
    sweeps = ", ".join(f"`{d}`" for d in analysis.sweep_dirs)
    return [
        Heading(_title(analysis), 1),
        Paragraph(
            f"Sweep: {sweeps} · {len(analysis.runs):,} run{'' if len(analysis.runs) == 1 else 's'} · "
            f"target val_acc {analysis.target_acc:g} · "
            f"written {datetime.now():%Y-%m-%d %H:%M} by `python -m multirun_analysis`"
        ),
        Heading("Key findings"),
        Bullets(tuple(key_findings(analysis))),
    ]


def _scaling_section(analysis: Analysis, view: pd.DataFrame, images: dict) -> list:
    """How throughput is measured, then each scaling kind's table and plot, then throughput."""
    blocks = [Heading("Scaling"), Paragraph(METHOD)]
    # The tables show only the settings that vary between their rows, so the sentence must
    # name what their rows share: a configuration in no group (lr=0.02 whose 2-worker run
    # failed) would otherwise hide the lr every row has.
    shared = analysis.scaling if not analysis.scaling.empty else analysis.configs
    if not shared.empty:
        blocks.append(Paragraph(_shared_settings(shared)))
    for kind, title in SCALING_TITLES.items():
        blocks.append(Heading(title, 3))
        rows = view[view.scaling == kind].drop(columns="scaling")
        if rows.empty:
            blocks.append(Paragraph("No group of analysed runs differs only in world size here."))
            continue
        blocks += _capped(rows, f"{kind}-scaling rows", "scaling.csv")
        alt = f"{title}: speedup against the ideal line, and efficiency, by world size"
        blocks.append(Image(images[kind], alt))
    if images["throughput"]:
        alt = "Throughput (images/sec, mean ± std over seeds) by world size"
        blocks += [Heading("Throughput", 3), Image(images["throughput"], alt)]
    return blocks


def _accuracy_section(analysis: Analysis, view: pd.DataFrame, images: dict) -> list:
    """The accuracy table, the lr x global batch heatmap and the validation curves."""
    blocks = [
        Heading("Accuracy"),
        Paragraph(
            "Final and best val_acc per configuration (mean over seeds). n_reached: how many "
            f"of the n_runs seeds reached val_acc ≥ {analysis.target_acc:g}. Only when all of "
            "them did: epochs_to_target, the epoch by which every seed had first reached it, "
            "and time_to_target_s, the training time (evaluation excluded) up to each seed's "
            "first such epoch, averaged over the seeds; – means not every seed reached it."
        ),
    ]
    if view.empty:
        return [*blocks, Paragraph("No analysed runs.")]
    blocks += _capped(view, "configurations", "accuracy.csv")
    if images["heatmap"]:
        alt = "Final validation accuracy by learning rate and global batch size"
        blocks.append(Image(images["heatmap"], alt))
    if images["curves"]:
        blocks.append(
            Image(images["curves"], "Validation accuracy over epochs and over training time")
        )
    return blocks


def _runs_section(view: pd.DataFrame, never_ran: pd.DataFrame) -> list:
    """Every run, the rule for which ones count, and each left-out run (and each job that
    left no run) with its reason."""
    blocks = [Heading("Runs"), Paragraph(INCLUSION_RULE)]
    blocks += _capped(view.drop(columns="problem"), "runs", "runs.csv")
    problems = pd.concat([view.loc[view.problem.ne(""), ["run", "status", "problem"]], never_ran],
                         ignore_index=True)
    blocks.append(Heading("Problems"))
    if problems.empty:
        return [*blocks, Paragraph("None: every run was analysed.")]
    return [*blocks, *_capped(problems, "runs with problems", "runs.csv")]


def _never_ran(analysis: Analysis) -> pd.DataFrame:
    """The Problems rows of the jobs a sweep planned that left no run (sweep_jobs.json)."""
    missing = analysis.missing
    return pd.DataFrame({
        "run": _run_names(missing.sweep, analysis.sweep_dirs) + " job " + missing.job.astype(str),
        "status": "never ran",
        "problem": "no run directory holds this job of the sweep: " + missing.overrides,
    }, columns=["run", "status", "problem"])


def _capped(view: pd.DataFrame, what: str, csv_name: str) -> list:
    """A table block, cut to MAX_REPORT_ROWS rows with a note saying where the rest is."""
    if len(view) <= MAX_REPORT_ROWS:
        return [Table(format_frame(view))]
    note = Paragraph(
        f"The first {MAX_REPORT_ROWS:,} of {len(view):,} {what}; `{csv_name}` has all of them."
    )
    return [note, Table(format_frame(view.head(MAX_REPORT_ROWS)))]


def _title(analysis: Analysis) -> str:
    names = ", ".join(Path(d).resolve().name for d in analysis.sweep_dirs)
    return f"Scaling report: {names}"


def _varying(frame: pd.DataFrame, columns, values=None) -> list[str]:
    """The columns whose value differs between rows, dropping the GPUs-per-node column when
    it only restates the world size (one node count throughout). `values(column)` gives the
    values that count (default: the whole column)."""
    values = values or frame.get
    varying = [c for c in columns if c in frame and values(c).nunique(dropna=False) > 1]
    if "num_nodes" not in varying:
        varying = [c for c in varying if c != "num_gpus"]
    return varying


def _shared_settings(frame: pd.DataFrame, values=None) -> str:
    """One sentence naming the settings every row shares (the tables show only the rest);
    `values` as in _varying, when they leave out some rows' unresolved values."""
    rows = "every row" if values is None else "every run that resolved them"
    values = values or frame.get
    shared = [
        c for c in settings_in(frame.columns) if c != "seed" and values(c).nunique(dropna=False) == 1
    ]
    if frame.empty or not shared:
        return ""
    text = ", ".join(f"{c}=`{format_value(values(c).iloc[0])}`" for c in shared)
    return f"Shared by {rows}: {text}."


UNRESOLVED = "auto"  # run.json's backend, device and comm_hook before a run resolves them


def _run_values(runs: pd.DataFrame):
    """values(column) for the runs table's varying and shared settings: when some runs were
    analysed, a run left out counts only with the values it resolved. One that failed before
    its first epoch has no results.csv, so run.json's `auto` backend and device, and nothing
    for precision, data loader, ..., stand in its row: they differ from the analysed runs'
    values without being another setting (its lr=100 still counts)."""
    if not runs.included.any():
        return runs.get
    analysed, left_out = runs[runs.included], runs[~runs.included]

    def values(column: str) -> pd.Series:
        other = left_out[column]
        resolved = other[other.notna() & other.ne(UNRESOLVED)]
        return pd.concat([analysed[column], resolved]) if len(resolved) else analysed[column]

    return values


def _scaling_view(scaling: pd.DataFrame) -> pd.DataFrame:
    """The scaling table for reading: group, the settings that vary, world size, results."""
    settings = [c for c in _varying(scaling, settings_in(scaling.columns)) if c != "world_size"]
    sync = ["grad_sync_share"] if scaling.grad_sync_share.notna().any() else []
    metrics = [
        "n_runs",
        "images_per_sec",
        "images_per_sec_std",
        "speedup",
        "efficiency",
        "epoch_time_s",
        *sync,
        "final_val_acc",
        "val_acc_change",
    ]
    return scaling[["scaling", "group", *settings, "world_size", *metrics]]


def _accuracy_view(accuracy: pd.DataFrame) -> pd.DataFrame:
    """The accuracy table for reading: the settings that vary, lr x global batch x world size."""
    core = ["lr", "global_batch_size", "world_size"]
    settings = [c for c in _varying(accuracy, settings_in(accuracy.columns)) if c not in core]
    return accuracy[
        [
            *settings,
            *core,
            "n_runs",
            "final_val_acc",
            "final_val_acc_std",
            "best_val_acc",
            "n_reached",
            "epochs_to_target",
            "time_to_target_s",
        ]
    ]


def _runs_view(analysis: Analysis) -> pd.DataFrame:
    """The runs table for reading: path relative to the sweep, status, varying settings, results."""
    runs = analysis.runs
    return runs.assign(
        run=_run_names(runs.path, analysis.sweep_dirs),
        epochs_done=runs.epochs_done.astype(str) + "/" + runs.epochs.map(format_value),
    )[
        [
            "run",
            "status",
            "included",
            *_varying(runs, settings_in(runs.columns), _run_values(runs)),
            "epochs_done",
            "images_per_sec",
            "final_val_acc",
            "best_val_acc",
            "problem",
        ]
    ]


def _run_names(paths: pd.Series, sweep_dirs) -> pd.Series:
    """Each run's path below the analysed directories; its own name when that is the run itself."""
    base = os.path.commonpath([os.path.abspath(d) for d in sweep_dirs])

    def name(path: str) -> str:
        relative = os.path.relpath(os.path.abspath(path), base)
        return os.path.basename(os.path.abspath(path)) if relative == "." else relative

    return paths.map(name)
