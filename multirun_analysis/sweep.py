"""The analysis of one or more sweep directories as plain DataFrames, before any file is written."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from .collect import collect
from .jobs import missing_jobs
from .runs import summarise_runs
from .tables import accuracy_table, configurations, scaling_table


@dataclass(frozen=True)
class Analysis:
    """Every table the report is made of."""

    sweep_dirs: tuple[str, ...]
    target_acc: float
    epochs: pd.DataFrame  # one row per (run, epoch), as read
    runs: pd.DataFrame  # one row per run directory, with `included` and `problem`
    configs: pd.DataFrame  # included runs aggregated over seeds
    scaling: pd.DataFrame  # weak and strong scaling groups
    accuracy: pd.DataFrame  # accuracy by configuration
    missing: pd.DataFrame  # jobs a sweep planned that left no run (sweep, job, overrides)


def analyse(sweep_dirs, target_acc: float = 0.9) -> Analysis:
    """Collect every run below `sweep_dirs` and build the runs, scaling and accuracy tables."""
    collected = collect(sweep_dirs)
    runs = summarise_runs(collected.epochs, collected.runs, target_acc)
    configs = configurations(runs)
    return Analysis(
        sweep_dirs=tuple(map(str, sweep_dirs)),
        target_acc=target_acc,
        epochs=collected.epochs,
        runs=runs,
        configs=configs,
        scaling=scaling_table(configs),
        accuracy=accuracy_table(configs, target_acc),
        missing=missing_jobs(sweep_dirs, runs),
    )
