"""Scaling tables, accuracy tables, plots and a report from sweep directories of ddpscale runs.

Reads results.csv and run.json as DESIGN.md's contract defines them; uses pandas and
matplotlib only and never imports torch, so it runs wherever the files are copied.

    python -m multirun_analysis SWEEP_DIR [SWEEP_DIR ...] [--out DIR] [--target-acc 0.9]

From Python: `analyse(dirs)` returns the tables, `write_report(analysis, out)` writes them.
Modules, in pipeline order: schema (column names), discover (find run directories),
collect (files -> epochs and runs tables), runs (per-run metrics and which runs count),
tables (seed aggregation, scaling, accuracy), sweep (the pipeline), plots, findings,
render (Markdown/HTML), report, cli.
"""

__all__ = ["analyse", "write_report"]


def __getattr__(name):
    # Lazy, so `python -m multirun_analysis --help` answers without importing pandas.
    if name == "analyse":
        from .sweep import analyse

        return analyse
    if name == "write_report":
        from .report import write_report

        return write_report
    raise AttributeError(name)
