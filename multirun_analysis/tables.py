"""Seed aggregation, scaling tables and accuracy tables, all from the runs table."""

from __future__ import annotations

import pandas as pd

from .render import format_value
from .schema import SETTINGS_ORDER, WORLD, config_keys, config_settings_in

# Scaling kind -> the batch setting held fixed while the world size grows.
SCALING_KINDS = {"weak": "batch_size", "strong": "global_batch_size"}
SCALING_COLUMNS = (
    "scaling",
    "group",
    "group_label",
    "n_runs",
    "images_per_sec",
    "images_per_sec_std",
    "speedup",
    "ideal_speedup",
    "efficiency",
    "epoch_time_s",
    "grad_sync_share",
    "final_val_acc",
    "val_acc_change",
    "baseline_world_size",
)
# The settings in display order up to lr, then the batch and world columns in the order
# the question "does accuracy change when we scale?" reads them (then any config keys).
ACCURACY_ORDER = (
    *SETTINGS_ORDER[: SETTINGS_ORDER.index("lr") + 1],
    "global_batch_size",
    "world_size",
    "batch_size",
    "num_nodes",
    "num_gpus",
    "epochs",
)
ACCURACY_COLUMNS = (
    "n_runs",
    "final_val_acc",
    "final_val_acc_std",
    "best_val_acc",
    "target_acc",
    "n_reached",
    "epochs_to_target",
    "time_to_target_s",
    "elapsed_s",
)


def configurations(runs: pd.DataFrame) -> pd.DataFrame:
    """Included runs identical but for seed, aggregated to mean, std (ddof=1) and n; time to
    target only for configurations whose every seed reached it."""
    keys = config_keys(runs.columns)
    sync = {"grad_sync_share": ("grad_sync_share", "mean")} if "grad_sync_share" in runs else {}
    return (
        runs[runs.included]
        .groupby(keys, dropna=False, sort=True)
        .agg(
            n_runs=("run_id", "size"),
            images_per_sec=("images_per_sec", "mean"),
            images_per_sec_std=("images_per_sec", "std"),
            epoch_time_s=("epoch_time_s", "mean"),
            **sync,
            final_val_acc=("final_val_acc", "mean"),
            final_val_acc_std=("final_val_acc", "std"),
            best_val_acc=("best_val_acc", "mean"),
            n_reached=("time_to_target_s", "count"),
            epochs_to_target=("epochs_to_target", "max"),
            time_to_target_s=("time_to_target_s", "mean"),
            elapsed_s=("elapsed_s", "mean"),
        )
        # A configuration reaches the target only when every seed of it did: a mean over the
        # lucky seeds alone would flatter it. Then epochs_to_target is the epoch by which all
        # had (a whole epoch, unlike a mean) and time_to_target_s the mean over all of them.
        .assign(
            epochs_to_target=lambda d: d.epochs_to_target.where(d.n_reached == d.n_runs),
            time_to_target_s=lambda d: d.time_to_target_s.where(d.n_reached == d.n_runs),
        )
        .reset_index()
    )


def scaling_table(configs: pd.DataFrame) -> pd.DataFrame:
    """Weak and strong scaling groups with speedup and efficiency against the smallest world size."""
    frames = [_scaling(configs, kind, fixed) for kind, fixed in SCALING_KINDS.items()]
    return pd.concat(frames, ignore_index=True)


def _scaling(configs: pd.DataFrame, kind: str, fixed: str) -> pd.DataFrame:
    """One scaling kind: configurations identical but for the world layout (and the other batch)."""
    keys = scaling_keys(configs.columns, kind)
    settings = [*keys, *(c for c in ("batch_size", "global_batch_size") if c != fixed), *WORLD]
    columns = [*SCALING_COLUMNS[:3], *settings, *SCALING_COLUMNS[3:]]
    if configs.empty:
        return pd.DataFrame(columns=columns)
    grouped = (
        configs.assign(scaling=kind, group=configs.groupby(keys, dropna=False).ngroup())
        # A group at a single world size says nothing about scaling; leave it out.
        .pipe(lambda d: d[d.groupby("group").world_size.transform("nunique") >= 2])
        .sort_values(["group", "world_size", "num_nodes"], kind="stable")
    )
    baseline = grouped.drop_duplicates("group").set_index("group")
    return (
        grouped.assign(
            baseline_world_size=lambda d: d.group.map(baseline.world_size),
            speedup=lambda d: d.images_per_sec / d.group.map(baseline.images_per_sec),
            ideal_speedup=lambda d: d.world_size / d.baseline_world_size,
            efficiency=lambda d: d.speedup / d.ideal_speedup,
            val_acc_change=lambda d: d.final_val_acc - d.group.map(baseline.final_val_acc),
            group=lambda d: kind[0].upper() + d.group.rank(method="dense").astype(int).astype(str),
        )
        .pipe(lambda d: d.assign(group_label=group_labels(d, keys, always=(fixed,))))
        .reindex(columns=columns)
        .reset_index(drop=True)
    )


def scaling_keys(columns, kind: str) -> list[str]:
    """The settings a `kind` scaling group keeps, in the order that numbers the groups: all but
    the world layout and the batches, then the batch held fixed."""
    keys = [k for k in config_keys(columns) if k not in (*WORLD, *SCALING_KINDS.values())]
    return [*keys, SCALING_KINDS[kind]]


def group_labels(frame: pd.DataFrame, keys: list[str], always=()) -> pd.Series:
    """A short label per row, "lr=0.1, batch_size=64", naming the keys that vary between rows."""
    return joined_labels(frame, varying_keys(frame, keys, always))


def varying_keys(frame: pd.DataFrame, keys: list[str], always=()) -> list[str]:
    """The keys whose values differ between rows, and those in `always`."""
    return [k for k in keys if k in always or frame[k].nunique(dropna=False) > 1]


def joined_labels(frame: pd.DataFrame, keys: list[str], names: dict[str, str] | None = None) -> pd.Series:
    """ "key=value, ..." per row over `keys` (each key as `names` calls it); "" without keys."""
    if not keys or frame.empty:
        return pd.Series("", index=frame.index, dtype=str)
    parts = [(names or {}).get(k, k) + "=" + frame[k].map(format_value) for k in keys]
    return pd.concat(parts, axis=1).agg(", ".join, axis=1)


def accuracy_table(configs: pd.DataFrame, target_acc: float) -> pd.DataFrame:
    """Final and best val_acc, and epochs and time to `target_acc`, by configuration."""
    settings = [
        *(c for c in ACCURACY_ORDER if c in configs.columns),
        *config_settings_in(configs.columns),
    ]
    return (
        configs.assign(target_acc=target_acc)
        .sort_values(settings, kind="stable")
        .reindex(columns=[*settings, *ACCURACY_COLUMNS])
        .reset_index(drop=True)
    )
