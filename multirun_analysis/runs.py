"""Per-run summaries (throughput, accuracy, time to target) and the rule for which runs count.

Which runs feed the scaling and accuracy tables: a run is *included* when it has no
problem (readable files, consistent rows), holds every epoch it was configured for,
and its status is `completed`, or `unknown` (results.csv without run.json: the rows
are all there, so nothing says the run went wrong). Every other run is listed with
the reason it was left out.
"""

from __future__ import annotations

from functools import reduce

import numpy as np
import pandas as pd

from .render import format_value
from .schema import ANALYSABLE_STATUSES, settings_in

INCLUSION_RULE = (
    "A run is analysed when its status is `completed` (or `unknown`: a results.csv "
    "without run.json), its results.csv holds every configured epoch, its files "
    "have no problem, and its final loss is finite. Failed, diverged, running, interrupted "
    "and unreadable runs are listed under Problems with the reason and left out of the "
    "scaling and accuracy tables."
)


def summarise_runs(epochs: pd.DataFrame, runs: pd.DataFrame, target_acc: float) -> pd.DataFrame:
    """The runs table with per-run metrics, `included` and the reason a run is left out."""
    return (
        runs.merge(per_run_metrics(epochs, target_acc), on="run_id", how="left")
        .assign(
            epochs_done=lambda d: d.epochs_done.fillna(0).astype("int64"),
            # A NaN or infinite final loss (optim.lr=100): training now fails such a run; one
            # from an older sweep, recorded as completed, is left out like a failed one.
            diverged=lambda d: d.epochs_done.gt(0)
            & ~(np.isfinite(d.final_train_loss) & np.isfinite(d.final_val_loss)),
        )
        .pipe(_judge)
        .pipe(_reorder)
    )


def _reorder(runs: pd.DataFrame) -> pd.DataFrame:
    """Who and whether first, then settings, results, and the rest of run.json last."""
    front = [
        "run_id",
        "path",
        "status",
        "included",
        "problem",
        *settings_in(runs.columns),
        "epochs_done",
    ]
    back = ["error", "has_results", "start_time", "end_time", "launcher", "hostname", "usable_cores",
            "git_commit", "git_dirty", "overrides"]
    return runs[[*front, *(c for c in runs.columns if c not in front and c not in back), *back]]


def per_run_metrics(epochs: pd.DataFrame, target_acc: float) -> pd.DataFrame:
    """One row per run: throughput, time per epoch, final/best val_acc, time to target."""
    ordered = epochs.sort_values(["run_id", "epoch"], kind="stable")
    by_run = ordered.groupby("run_id")
    # Throughput skips the first epoch (warm-up: data loader start, cudnn autotune,
    # allocator growth) unless it is the only one.
    steady = ordered[
        (ordered.epoch > by_run.epoch.transform("min")) | (by_run.epoch.transform("size") == 1)
    ]
    sync = {"grad_sync_share": ("grad_sync_share", "mean")} if "grad_sync_share" in epochs else {}
    last = ordered.drop_duplicates("run_id", keep="last").set_index("run_id")
    reached = (
        ordered[ordered.val_acc >= target_acc]
        .drop_duplicates("run_id", keep="first")
        .set_index("run_id")
    )
    return (
        by_run.agg(epochs_done=("epoch", "size"), best_val_acc=("val_acc", "max"))
        .join(
            steady.groupby("run_id").agg(
                images_per_sec=("images_per_sec", "median"),
                epoch_time_s=("epoch_time_s", "median"),
                **sync,
            )
        )
        .join(
            last[["val_acc", "val_loss", "train_loss", "elapsed_s"]].rename(
                columns={
                    "val_acc": "final_val_acc",
                    "val_loss": "final_val_loss",
                    "train_loss": "final_train_loss",
                }
            )
        )
        .join(
            reached[["epoch", "elapsed_s"]].rename(
                columns={
                    "epoch": "epochs_to_target",
                    "elapsed_s": "time_to_target_s",
                }
            )
        )
        .reset_index()
    )


def _judge(runs: pd.DataFrame) -> pd.DataFrame:
    """Add `included`, and put every reason a run is left out into `problem`."""
    files = runs.problem.fillna("")
    # A file problem already explains missing epochs; say it once.
    completeness = _completeness_reason(runs).where(files.eq(""), "")
    problem = reduce(_join, [_status_reason(runs), files, completeness, _diverged_reason(runs)])
    return runs.assign(problem=problem, included=problem.eq(""))


def _diverged_reason(runs: pd.DataFrame) -> pd.Series:
    """Why a run whose final loss is not finite is left out: its accuracy is a broken model's,
    and its throughput no measure of training (in one check, nan weights ran a CNN step 5% faster)."""
    losses = ("train_loss " + runs.final_train_loss.map("{:g}".format) + ", val_loss "
              + runs.final_val_loss.map("{:g}".format))
    return losses.radd("diverged (final ").add(")").where(runs.diverged, "")


ERROR_CHARS = 300  # of run.json's error in a problem; the Problems table stays readable


def _status_reason(runs: pd.DataFrame) -> pd.Series:
    """Why run.json's status keeps a run out ('' for completed and unknown)."""
    status = runs.status
    error = (  # as objects first: with no run.json at all the column is NaN, a float column
        runs.error.astype(object)
        .fillna("")
        .astype(str)
        .str.strip()
        .str.replace(r"\s+", " ", regex=True)
    )
    # A long error is cut, and says so: runs.csv's error column holds the whole text.
    error = error.where(error.str.len() <= ERROR_CHARS, error.str.slice(0, ERROR_CHARS) + " …")
    return pd.Series(
        np.select(
            [
                status.eq("failed") & error.ne(""),
                status.eq("failed"),
                status.eq("running") & error.ne(""),  # collect found its job process gone
                status.eq("running"),
                status.eq("interrupted") & error.ne(""),
                status.eq("interrupted"),
                ~status.isin(ANALYSABLE_STATUSES),
            ],
            [
                "failed: " + error,
                "failed (run.json gives no error)",
                "stopped without updating run.json: " + error,
                "still running, or stopped without updating run.json",
                # the signal tells Ctrl-C from a scheduler's time limit (SIGTERM)
                "interrupted: " + error,
                "interrupted",
                "status " + status.astype(str),
            ],
            default="",
        ),
        index=runs.index,
        dtype=str,
    )


def _completeness_reason(runs: pd.DataFrame) -> pd.Series:
    """Why a completed (or unknown-status) run's rows are not the whole run."""
    complete = runs.epochs_done.ge(runs.epochs.astype("Float64")).fillna(False).astype(bool)
    status = runs.status
    return pd.Series(
        np.select(
            [
                status.eq("completed") & ~runs.has_results,
                status.eq("completed") & ~complete,
                status.eq("unknown") & runs.epochs_done.eq(0).fillna(False).astype(bool),
                status.eq("unknown") & ~complete,
            ],
            [
                "completed but has no results.csv",
                "completed but results.csv has " + _k_of_n(runs),
                "no run.json, and results.csv has no epoch rows",
                "no run.json and results.csv has only " + _k_of_n(runs),
            ],
            default="",
        ),
        index=runs.index,
        dtype=str,
    )


def _join(left: pd.Series, right: pd.Series) -> pd.Series:
    """Two columns of messages joined with '; ', skipping empty ones."""
    return left.where(right.eq(""), left.where(left.eq(""), left + "; ") + right)


def _k_of_n(runs: pd.DataFrame) -> pd.Series:
    return runs.epochs_done.astype(str) + " of " + runs.epochs.map(format_value) + " epochs"
