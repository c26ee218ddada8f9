"""Find run directories: any directory, at any depth, holding results.csv or run.json.

Standard library only, so the command can answer "no runs found" before loading pandas.
"""

from __future__ import annotations

import os

from .schema import RESULTS_CSV, RUN_JSON


def find_run_dirs(sweep_dir: str | os.PathLike) -> list[str]:
    """Every directory at any depth below `sweep_dir` that holds results.csv or run.json."""
    found, stack, seen_links = [], [os.fspath(sweep_dir)], set()
    while stack:
        directory = stack.pop()
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except OSError:
            continue
        names = {entry.name for entry in entries}
        if RESULTS_CSV in names or RUN_JSON in names:
            found.append(directory)
        for entry in entries:
            # Hidden folders (.hydra, .git) hold configs and history, never runs.
            if entry.name.startswith("."):
                continue
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
            elif entry.is_symlink() and entry.is_dir():
                target = os.path.realpath(entry.path)  # a link loop is walked only once
                if target not in seen_links:
                    seen_links.add(target)
                    stack.append(entry.path)
    return sorted(found)


def distinct_sweeps(sweeps: list, runs_under: list[list[str]]) -> list:
    """The sweeps worth naming, in order: each directory once (by its resolved path), and
    none that lies inside another given one without adding a run to it (`s5 s5/ s5/0` is
    s5). `runs_under[i]` is find_run_dirs(sweeps[i])."""
    resolved = [os.path.realpath(sweep) for sweep in sweeps]
    runs = [{os.path.realpath(run) for run in found} for found in runs_under]
    first = [resolved.index(path) for path in resolved]  # of each resolved path

    def covered(i: int) -> bool:
        return any(
            resolved[j] != resolved[i]
            and os.path.commonpath([resolved[i], resolved[j]]) == resolved[j]
            and runs[i] <= runs[j]
            for j in range(len(sweeps))
        )

    return [sweep for i, sweep in enumerate(sweeps) if first[i] == i and not covered(i)]
