"""Read every run directory below the sweep directories into two tidy tables.

Files are read with the csv and json modules and turned into one DataFrame per distinct
header, which is much faster than one `pd.read_csv` per run on a sweep of thousands of
runs. Nothing here judges a run; it records what the files say and every problem found
reading them (runs.py decides which runs count).

Settings come from results.csv's setting columns, and from run.json's resolved config
for anything those columns do not carry: a config key whose value differs between runs
of the same settings (a sweep over distributed.bucket_cap_mb) becomes a setting column
named by its dotted key, so such runs are never taken for repeats of each other. The knobs
results.csv repeats (its bucket_cap_mb, compile, ... columns) stand in for those keys where
run.json lacks them, and its launcher for run.json's, so a run without run.json keeps them.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import socket
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import pandas as pd

from .discover import find_run_dirs
from .schema import (
    CONFIG_KEY_COLUMNS,
    CONFIG_KEYS_IGNORED,
    CSV_CONFIG_KEYS,
    EXTRA_NUMERIC,
    METRICS,
    MISSING_VALUES,
    NON_EMPTY,
    NUMERIC_SETTINGS,
    REQUIRED,
    RESULTS_CSV,
    RUN_JSON,
    TIMINGS,
    WORLD,
    config_keys,
    settings_in,
)

INTEGER_COLUMNS = (
    "num_nodes",
    "num_gpus",
    "world_size",
    "batch_size",
    "global_batch_size",
    "seed",
    "epochs",
    "epoch",
    "grad_accum_steps",
)
# Optional setting columns read as numbers; a bad value there becomes NaN, as in EXTRA_NUMERIC.
NUMERIC_EXTRA_SETTINGS = ("grad_accum_steps",)
_BOOLEANS = {"True": True, "False": False, "true": True, "false": False}
META_COLUMNS = (
    "run_id",
    "path",
    "status",
    "problem",
    "error",
    "has_results",
    "start_time",
    "end_time",
    "launcher",
    "hostname",
    "usable_cores",
    "git_commit",
    "git_dirty",
    "overrides",
)


@dataclass(frozen=True)
class Collected:
    """What the files say: one row per (run, epoch) and one row per run directory."""

    epochs: pd.DataFrame
    runs: pd.DataFrame


def collect(sweep_dirs) -> Collected:
    """Read every run below `sweep_dirs` into an epochs table and a runs table."""
    run_dirs = _unique(d for sweep in sweep_dirs for d in find_run_dirs(sweep))
    metas, configs, problems = [], [], defaultdict(list)
    blocks = defaultdict(lambda: ([], []))  # header -> (run ids, rows)
    for run_id, directory in enumerate(run_dirs):
        meta, config, json_problems = _read_run_json(directory)
        configs.append(config)
        header, rows, csv_problems, has_results = _read_results(directory)
        problems[run_id].extend(json_problems + csv_problems)
        if rows:
            ids, body = blocks[tuple(header)]
            ids.extend([run_id] * len(rows))
            body.extend(rows)
        metas.append({"run_id": run_id, "path": directory, "has_results": has_results, **meta})
    raw = _raw_epochs(blocks)
    numbers = {
        column: _numbers(raw[column])
        for column in raw.columns
        if column in (*NUMERIC_SETTINGS, *METRICS, *EXTRA_NUMERIC, *NUMERIC_EXTRA_SETTINGS)
    }
    for run_id, message in _value_problems(raw, numbers).items():
        problems[run_id].append(message)
    epochs = _typed(raw, numbers).sort_values(["run_id", "epoch"], kind="stable", ignore_index=True)
    for run_id, message in _consistency_problems(epochs).items():
        problems[run_id].append(message)
    hardware = [meta.pop("hardware", None) for meta in metas]  # a setting only where it tells
    runs = (
        _runs_table(metas, epochs, problems)
        .pipe(_with_config_settings, _with_csv_config(configs, epochs))
        .pipe(_with_hardware, hardware)
    )
    return Collected(epochs=epochs, runs=runs)


def _unique(dirs) -> list[str]:
    """Drop directories reached twice (overlapping sweep arguments, links), by inode."""
    by_inode = {}
    for directory in dirs:
        stat = os.stat(directory)
        by_inode.setdefault((stat.st_dev, stat.st_ino), directory)
    return sorted(by_inode.values(), key=_natural)


def _natural(path: str) -> list:
    """Sort key that puts Hydra job 2 before job 10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def _read_run_json(directory: str) -> tuple[dict, dict, list[str]]:
    """run.json as a flat dict (status 'unknown' when absent or unreadable), its config's
    groups ({} when absent), and problems."""
    try:
        with open(os.path.join(directory, RUN_JSON), encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return {"status": "unknown"}, {}, []
    except json.JSONDecodeError as exc:
        return {"status": "unknown"}, {}, [
            f"run.json is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ]
    except (OSError, UnicodeDecodeError) as exc:
        return {"status": "unknown"}, {}, [f"run.json cannot be read ({exc})"]
    if not isinstance(doc, dict):
        return {"status": "unknown"}, {}, ["run.json is not a JSON object"]
    status = doc.get("status")
    problems = [] if isinstance(status, str) and status else ["run.json has no status"]
    overrides = doc.get("overrides")
    meta = {
        "status": status if isinstance(status, str) and status else "unknown",
        "error": _text(doc.get("error")) or (_ended_unrecorded(doc) if status == "running" else None),
        "start_time": _text(doc.get("start_time")),
        "end_time": _text(doc.get("end_time")),
        "launcher": _text(doc.get("launcher")),
        "hostname": _text(doc.get("hostname")),
        "usable_cores": _usable_cores(doc),
        "git_commit": _text(doc.get("git_commit")),
        # edited code, not the commit's (older run.json files do not say: None)
        "git_dirty": doc.get("git_dirty") if isinstance(doc.get("git_dirty"), bool) else None,
        "overrides": " ".join(map(str, overrides)) if isinstance(overrides, list) else None,
        "hardware": _hardware(doc.get("devices")),
        **_config_settings(doc),
    }
    config = doc.get("config")
    groups = (
        {group: fields for group, fields in config.items() if isinstance(fields, dict)}
        if isinstance(config, dict)
        else {}
    )
    return meta, groups, problems


def _usable_cores(doc: dict) -> int | None:
    """The cores the job could use: run.json's usable_cores, or for older runs the host's
    count its CPU device name carries ("Intel(R) Xeon(R) (2 logical cores)")."""
    cores = doc.get("usable_cores")
    if isinstance(cores, int) and not isinstance(cores, bool) and cores > 0:
        return cores
    devices = doc.get("devices")
    if not (isinstance(devices, list) and devices and isinstance(devices[0], str)):
        return None
    named = re.search(r"\((\d+) logical cores\)", devices[0])
    return int(named.group(1)) if named else None


def _config_settings(doc: dict) -> dict:
    """Settings from run.json's resolved config, for runs without readable rows."""
    config = doc.get("config")

    def dig(*keys):
        value = config
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    def number(value):
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    settings = {
        "model": _text(dig("model", "name")),
        "dataset": _text(dig("data", "name")),
        "optimizer": _text(dig("optim", "name")),
        "backend": _text(dig("distributed", "backend")),
        "device": _text(dig("distributed", "device")),
        "lr": number(dig("optim", "lr")),
        "batch_size": number(dig("data", "batch_size")),
        "num_gpus": number(dig("distributed", "num_gpus")),
        "num_nodes": number(dig("distributed", "num_nodes")),
        "epochs": number(dig("train", "epochs")),
        "seed": number(dig("train", "seed")),
    }
    world_size = number(doc.get("world_size"))
    if world_size is None and settings["num_gpus"] is not None:
        world_size = settings["num_gpus"] * (settings["num_nodes"] or 1)
    settings["world_size"] = world_size
    if world_size is not None and settings["batch_size"] is not None:
        settings["global_batch_size"] = settings["batch_size"] * world_size
    return settings


def _ended_unrecorded(doc: dict) -> str | None:
    """Why a run.json still saying "running" is not: its job process ran on this machine and
    is gone (killed outright, by SIGKILL or the out-of-memory killer, or the machine
    restarted), so it never wrote its end. None where that cannot be told from here."""
    pid = doc.get("pid")
    if doc.get("hostname") != socket.gethostname() or not isinstance(pid, int) or isinstance(pid, bool) or pid < 1:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return (f"its job process (pid {pid}) on this machine has ended without recording why: killed "
                "outright (SIGKILL, the out-of-memory killer; see dmesg) or the machine restarted")
    except OSError:  # it exists, under another user
        return None
    return None  # alive: still running (or its pid taken by another process since)


def _hardware(devices) -> str | None:
    """run.json's device names as one text, each kind once: a 1-GPU and a 4-GPU run on one
    machine list one name once and four times, and ran on the same hardware."""
    if not (isinstance(devices, list) and devices):
        return None
    return " + ".join(sorted({str(name) for name in devices}))


def _with_hardware(runs: pd.DataFrame, hardware: list) -> pd.DataFrame:
    """The runs table plus a `hardware` setting column where runs alike in every setting but
    the seed, world layout and batch ran on different machines (two sweeps, a laptop's and a
    server's, analysed together): their throughputs are neither repeats to average nor a
    baseline and its scaled-up run. One machine's sweep gets no such column."""
    column = pd.Series(hardware, index=runs.index, dtype=object)
    alike = [
        runs[k]
        for k in config_keys(runs.columns)
        if k not in (*WORLD, "batch_size", "global_batch_size")
    ]
    if column.isna().all() or not alike:
        return runs
    if column.groupby(alike, dropna=False).nunique().gt(1).any():
        return runs.assign(hardware=column)
    return runs


def _text(value) -> str | None:
    return None if value is None else str(value)


def _read_results(directory: str) -> tuple[list[str] | None, list[list[str]], list[str], bool]:
    """results.csv as (header, complete rows, problems, file exists)."""
    try:
        with open(os.path.join(directory, RESULTS_CSV), encoding="utf-8", newline="") as f:
            text = f.read()
    except FileNotFoundError:
        return None, [], [], False
    except (OSError, UnicodeDecodeError) as exc:
        return None, [], [f"results.csv cannot be read ({exc})"], True
    if not text.strip():
        return None, [], ["results.csv is empty (no header)"], True
    try:
        reader = csv.reader(io.StringIO(text))
        header = [name.strip() for name in next(reader)]
        lines = [(reader.line_num, row) for row in reader if row]
    except csv.Error as exc:
        return None, [], [f"results.csv is not valid CSV ({exc})"], True
    missing = [name for name in REQUIRED if name not in header]
    if missing:
        return header, [], [f"results.csv lacks required column(s): {', '.join(missing)}"], True
    if len(set(header)) != len(header):
        return header, [], ["results.csv has duplicate column names"], True
    problems = []
    # Rows end with a newline as they are flushed; a missing one means the writer died
    # mid-line, so the last row is partial even when its field count looks right.
    if lines and not text.endswith(("\n", "\r")):
        line_num, row = lines.pop()
        problems.append(
            f"results.csv is truncated: line {line_num} has no line end "
            f"(the writer stopped mid-line); it was skipped"
        )
    ragged = [(n, row) for n, row in lines if len(row) != len(header)]
    if ragged:
        line_num, row = ragged[0]
        more = f" (and {len(ragged) - 1} more)" if len(ragged) > 1 else ""
        problems.append(
            f"results.csv line {line_num} has {len(row)} fields, the header has "
            f"{len(header)}{more}; such lines were skipped"
        )
    return header, [row for _, row in lines if len(row) == len(header)], problems, True


def _raw_epochs(blocks: dict) -> pd.DataFrame:
    """All rows as strings, one frame per distinct header, stacked."""
    frames = [
        pd.DataFrame(rows, columns=list(header), dtype=str).assign(run_id=ids)
        for header, (ids, rows) in blocks.items()
    ]
    if not frames:
        return pd.DataFrame({name: pd.Series(dtype=str) for name in ("run_id", *REQUIRED)})
    return pd.concat(frames, ignore_index=True)


def _numbers(text: pd.Series) -> pd.Series:
    """A column of number strings as float64; anything unparsable becomes NaN."""
    try:
        return text.astype("float64")  # fast path: a clean column, several times faster
    except (TypeError, ValueError):
        return pd.to_numeric(text, errors="coerce")


def _value_problems(raw: pd.DataFrame, numbers: dict[str, pd.Series]) -> dict[int, str]:
    """The first non-numeric, missing or (for a timing) infinite or negative required value
    of each run, as a message."""
    flagged = []
    for column in (*NUMERIC_SETTINGS, *METRICS):
        unparsed = numbers[column].isna()
        if not unparsed.any():
            continue
        text = raw.loc[unparsed, column].fillna("").str.strip()
        missing = text.isin(MISSING_VALUES)
        cells = raw.loc[unparsed, ["run_id"]]
        flagged.append(
            cells[~missing].assign(
                message="non-numeric value '" + text[~missing] + f"' in column {column}"
            )
        )
        if column in NON_EMPTY:
            flagged.append(cells[missing].assign(message=f"empty value in column {column}"))
    for column in TIMINGS:
        unusable = np.isinf(numbers[column]) | (numbers[column] <= 0)
        flagged.append(raw.loc[unusable, ["run_id"]].assign(
            message="unusable value '" + raw.loc[unusable, column].str.strip() + f"' in column {column}"))
    cells = pd.concat(flagged, ignore_index=True) if flagged else pd.DataFrame()
    if cells.empty:
        return {}
    return (
        cells.groupby("run_id")
        .agg(message=("message", "first"), n=("message", "size"))
        .pipe(
            lambda d: d.message.where(
                d.n == 1, d.message + " (and " + (d.n - 1).astype(str) + " more)"
            )
        )
        .pipe(lambda messages: "results.csv: " + messages)
        .to_dict()
    )


def _typed(raw: pd.DataFrame, numbers: dict[str, pd.Series]) -> pd.DataFrame:
    """Required numbers as numbers (integers as nullable Int64), extras by content."""
    converted = {"run_id": raw["run_id"].astype("int64")}
    for column in raw.columns.drop("run_id"):
        if column in numbers:
            converted[column] = _as_int(column, numbers[column])
        elif column not in REQUIRED:
            converted[column] = _infer(raw[column])
    return raw.assign(**converted)


def _as_int(column: str, values: pd.Series) -> pd.Series:
    """Integer columns become Int64 when every value is whole (they print as 4, not 4.0)."""
    if column in INTEGER_COLUMNS and (values.dropna() % 1 == 0).all():
        return values.astype("Int64")
    return values


def _infer(values: pd.Series) -> pd.Series:
    """An extra column as booleans or numbers when every present value is one, else text."""
    distinct = pd.Series(values.dropna().unique(), dtype=str).str.strip()
    distinct = distinct[~distinct.isin(MISSING_VALUES)]
    if distinct.empty:
        return values
    if distinct.isin(_BOOLEANS).all():
        return values.str.strip().map(_BOOLEANS).astype("boolean")
    if pd.to_numeric(distinct, errors="coerce").notna().all():
        return _numbers(values.where(~values.fillna("").str.strip().isin(MISSING_VALUES)))
    return values


def _consistency_problems(epochs: pd.DataFrame) -> dict[int, str]:
    """Runs whose rows disagree on a setting, or that repeat an epoch."""
    disagree = (
        epochs.groupby("run_id")[settings_in(epochs.columns)]
        .nunique()
        .gt(1)
        .reset_index()
        .melt("run_id", var_name="setting", value_name="differs")
        .query("differs")
        .groupby("run_id", sort=False)
        .setting.agg(", ".join)
        .pipe(lambda names: "results.csv rows disagree on " + names + " (two runs in one file?)")
    )
    repeated = (
        epochs.loc[epochs.duplicated(["run_id", "epoch"])]
        .drop_duplicates("run_id")
        .set_index("run_id")
        .epoch.pipe(lambda epoch: "results.csv repeats epoch " + epoch.astype(str))
    )
    return pd.concat([disagree, repeated]).groupby(level=0).agg("; ".join).to_dict()


def _runs_table(metas: list[dict], epochs: pd.DataFrame, problems: dict) -> pd.DataFrame:
    """One row per run: metadata, problems, and settings (results.csv first, then run.json)."""
    meta = pd.DataFrame(metas).set_index("run_id")
    from_config = meta.reindex(columns=settings_in(meta.columns))
    first_rows = epochs.drop_duplicates("run_id").set_index("run_id")
    from_rows = first_rows.reindex(columns=settings_in(epochs.columns))
    settings = from_rows.combine_first(from_config).pipe(  # union of runs and columns; rows win
        lambda d: d.assign(
            **{
                c: _as_int(c, pd.to_numeric(d[c], errors="coerce"))
                for c in d.columns
                if c in NUMERIC_SETTINGS or c in NUMERIC_EXTRA_SETTINGS
            }
        )
    )
    problem = pd.Series({run_id: "; ".join(p) for run_id, p in problems.items() if p}, dtype=str)
    csv_launcher = first_rows.reindex(columns=["launcher"]).launcher.astype(object)
    return (
        meta.reindex(columns=[c for c in META_COLUMNS if c not in ("run_id", "problem")])
        .assign(
            problem=problem.reindex(meta.index).fillna(""),
            # results.csv's launcher stands in for a missing run.json's
            launcher=lambda d: d.launcher.astype(object).combine_first(csv_launcher),
        )
        .join(settings[settings_in(settings.columns)])
        .reset_index()
        .reindex(columns=[*META_COLUMNS, *settings_in(settings.columns)])
    )


def _with_csv_config(configs: list[dict], epochs: pd.DataFrame) -> list[dict]:
    """Each run's config groups, completed with the config keys its results.csv repeats
    (CSV_CONFIG_KEYS) where run.json lacks them; run.json's own values win."""
    columns = [c for c in CSV_CONFIG_KEYS if c in epochs.columns]
    if not columns:
        return configs
    first_rows = epochs.drop_duplicates("run_id").set_index("run_id")[columns].to_dict("index")
    completed = []
    for run_id, config in enumerate(configs):
        groups = {group: dict(fields) for group, fields in config.items()}
        for column, value in first_rows.get(run_id, {}).items():
            value = _csv_value(value)
            if value is not None:
                group, key = CSV_CONFIG_KEYS[column].split(".")
                groups.setdefault(group, {}).setdefault(key, value)
        completed.append(groups)
    return completed


def _csv_value(value):
    """A results.csv cell as the config value it repeats (None when missing): the column may
    be typed already, or text when its values mix kinds across files."""
    if value is None or value is pd.NA or (isinstance(value, float) and value != value):
        return None
    if isinstance(value, str):
        text = value.strip()
        if text in MISSING_VALUES:
            return None
        if text in _BOOLEANS:
            return _BOOLEANS[text]
        try:
            return float(text)
        except ValueError:
            return text
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    return float(value)


def _with_config_settings(runs: pd.DataFrame, configs: list[dict]) -> pd.DataFrame:
    """The runs table plus a setting column per config key that tells runs of the same
    settings apart (NaN for a run whose run.json lacks the key)."""
    paths = _differing_keys(configs, runs.columns)
    if not paths:
        return runs
    extra = pd.DataFrame(
        {
            ".".join(path): _setting_column([_lookup(c, path) for c in configs], runs.index)
            for path in paths
        }
    )
    # A key that only follows a setting (model.depth exists for wide_resnet alone, adamw's
    # weight_decay default is not sgd's) tells no runs apart; one that differs between runs
    # alike in every setting but the seed, world layout and batch does. Those are left out
    # of "alike" so that a key changed along with the world size is not missed. (Any run
    # with a config has run.json's model, dataset, ... columns, so `alike` is never empty.)
    alike = [
        runs[k]
        for k in config_keys(runs.columns)
        if k not in (*WORLD, "batch_size", "global_batch_size")
    ]
    differs = extra.groupby(alike, dropna=False).nunique().gt(1).any()
    return runs.join(extra.loc[:, differs])


def _differing_keys(configs: list[dict], columns) -> list[tuple]:
    """Paths of the config keys seen with two or more values, except those a setting column
    carries and those that never describe the experiment; in the order the configs list them."""
    values, seen_groups = defaultdict(set), set()
    for config in configs:
        for group, fields in config.items():
            # Runs share most of their config: read each distinct group once.
            try:
                content = (group, *fields.items())
                if content in seen_groups:
                    continue
                seen_groups.add(content)
            except TypeError:  # a list or a nested group inside: read it every time
                pass
            for path, value in _leaves(fields, (group,)):
                values[path].add(value)
    carried = {key for key, column in CONFIG_KEY_COLUMNS.items() if column in columns}
    skip = carried | CONFIG_KEYS_IGNORED
    return [path for path, seen in values.items() if len(seen) > 1 and ".".join(path) not in skip]


def _leaves(fields: dict, path: tuple):
    """(path, value) of every leaf below nested config fields."""
    for key, value in fields.items():
        if isinstance(value, dict):
            yield from _leaves(value, (*path, key))
        else:
            yield (*path, key), _leaf(value)


def _lookup(config: dict, path: tuple):
    """The value at `path` in a config, or None when the run has no such key."""
    value = config
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return None if isinstance(value, dict) else _leaf(value)


def _leaf(value):
    """A config value as a setting: JSON null as "null" (a value, unlike a key the run does
    not have), a list as its JSON text."""
    if value is None:
        return "null"
    return json.dumps(value) if isinstance(value, list) else value


def _setting_column(values: list, index: pd.Index) -> pd.Series:
    """One config key's values (None: the run lacks the key) as booleans, integers, floats
    or, when they mix kinds, text."""
    present = [v for v in values if v is not None]
    if all(isinstance(v, bool) for v in present):
        return pd.Series(values, index=index, dtype="boolean")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in present):
        return pd.Series(values, index=index, dtype="Int64")
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
        return pd.Series(values, index=index, dtype="float64")
    return pd.Series([v if v is None else str(v) for v in values], index=index, dtype=object)
