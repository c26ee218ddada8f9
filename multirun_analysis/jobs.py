"""Jobs a sweep planned but never ran: its sweep_jobs.json against the runs' run.json overrides."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pandas as pd

SWEEP_JOBS = "sweep_jobs.json"  # written by ddpscale's sweep (ddpscale.sweep.write_sweep_jobs)
MISSING_COLUMNS = ["sweep", "job", "overrides"]


def missing_jobs(sweep_dirs, runs: pd.DataFrame) -> pd.DataFrame:
    """One row per job a sweep below `sweep_dirs` planned that no run below that sweep
    matches by its overrides (in any order): sweep directory, job number, overrides."""
    rows = []
    for plan in _plans(sweep_dirs):
        try:
            jobs = [" ".join(map(str, job)) for job in json.loads(plan.read_text())["jobs"]]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a damaged list names no job; the runs themselves are still analysed
        sweep = str(plan.parent)
        below = runs.path.map(lambda path: os.path.commonpath([os.path.abspath(path), sweep]) == sweep)
        ran = Counter(_key(text) for text in runs.overrides[below].dropna())
        for number, job in enumerate(jobs):
            if ran[_key(job)]:
                ran[_key(job)] -= 1
            else:
                rows.append({"sweep": sweep, "job": number, "overrides": job})
    return pd.DataFrame(rows, columns=MISSING_COLUMNS)


def _key(overrides: str) -> tuple[str, ...]:
    return tuple(sorted(overrides.split(" ")))


def _plans(sweep_dirs) -> list[Path]:
    """Every sweep_jobs.json below the directories (any depth), each once."""
    found = {}
    for sweep in sweep_dirs:
        for path in Path(sweep).rglob(SWEEP_JOBS):
            found.setdefault(os.path.realpath(path), path.absolute())
    return sorted(found.values())
