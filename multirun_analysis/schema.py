"""Column names of the results.csv contract (DESIGN.md) and how the analysis uses them."""

RESULTS_CSV = "results.csv"
RUN_JSON = "run.json"

# Settings every row repeats: together they say which experiment a run is.
STRING_SETTINGS = ("model", "dataset", "optimizer", "backend", "device")
NUMERIC_SETTINGS = (
    "num_nodes",
    "num_gpus",
    "world_size",
    "batch_size",
    "global_batch_size",
    "lr",
    "seed",
    "epochs",
)
# Per-epoch measurements.
METRICS = (
    "epoch",
    "train_loss",
    "train_acc",
    "val_loss",
    "val_acc",
    "epoch_time_s",
    "elapsed_s",
    "images_per_sec",
)
# In DESIGN.md's order, which error messages keep.
REQUIRED = (
    "model",
    "dataset",
    "optimizer",
    "num_nodes",
    "num_gpus",
    "world_size",
    "backend",
    "device",
    "batch_size",
    "global_batch_size",
    "lr",
    "seed",
    "epochs",
    *METRICS,
)
assert set(REQUIRED) == {*STRING_SETTINGS, *NUMERIC_SETTINGS, *METRICS}

# Optional columns that also tell runs apart when present (a bf16 run is not a
# repeat of an fp32 run), so they join the settings used for grouping.
# (Not launcher: how a run was started is no setting. A SLURM sweep starts its 1-GPU job as
# one task that spawns its worker and its 4-GPU job as 4 tasks: one experiment, whose
# scaling groups must not split there. The runs table shows it beside the hostname.)
EXTRA_SETTINGS = ("precision", "data_loader", "comm_hook", "grad_accum_steps")
# Optional numeric columns; a bad value there becomes NaN instead of a problem.
EXTRA_NUMERIC = ("step_time_p50_s", "step_time_p90_s", "grad_sync_share", "eval_time_s")

# Timings every run measures: finite and above 0, or the scaling figures mean nothing.
TIMINGS = ("epoch_time_s", "elapsed_s", "images_per_sec")
# Values that must be present on every row: without them a row cannot be placed or scaled.
NON_EMPTY = (*NUMERIC_SETTINGS, "epoch", *TIMINGS)
# Spellings of a missing measurement (a diverged loss is a result, not a bad file).
MISSING_VALUES = frozenset({"", "nan", "NaN", "NAN", "-nan", "None", "null", "NA", "N/A"})

# Display order for settings; also the seed-less key that aggregates repeats.
SETTINGS_ORDER = (
    "model",
    "dataset",
    "optimizer",
    "precision",
    "data_loader",
    "backend",
    "device",
    "hardware",  # only where otherwise alike runs ran on different machines (collect.py)
    "comm_hook",
    "grad_accum_steps",
    "lr",
    "batch_size",
    "global_batch_size",
    "num_nodes",
    "num_gpus",
    "world_size",
    "epochs",
    "seed",
)
WORLD = ("world_size", "num_nodes", "num_gpus")

STATUSES = ("completed", "failed", "running", "interrupted", "unknown")
# Statuses whose runs may feed the tables (unknown = no run.json, see runs.py).
ANALYSABLE_STATUSES = ("completed", "unknown")


# Any other key of run.json's resolved config that differs between runs is a setting too
# (distributed.bucket_cap_mb=1 is not a repeat of bucket_cap_mb=25): its column is named by
# its dotted key, which no results.csv column has, and follows SETTINGS_ORDER's columns.
# These config keys never become such a column: a setting column above already carries them
# (the config says backend=auto, results.csv says the gloo it resolved to) ...
CONFIG_KEY_COLUMNS = {
    "model.name": "model",
    "data.name": "dataset",
    "optim.name": "optimizer",
    "train.precision": "precision",
    "data.loader": "data_loader",
    "distributed.backend": "backend",
    "distributed.device": "device",
    "distributed.comm_hook": "comm_hook",
    "train.grad_accum_steps": "grad_accum_steps",
    "optim.lr": "lr",
    "data.batch_size": "batch_size",
    "distributed.num_nodes": "num_nodes",
    "distributed.num_gpus": "num_gpus",
    "train.epochs": "epochs",
    "train.seed": "seed",
}
# ... and these say where and how a run was started, not what it measured.
CONFIG_KEYS_IGNORED = frozenset(
    {
        "distributed.node_id",
        "distributed.master_addr",
        "distributed.master_port",
        "distributed.timeout_s",
        "data.root",
        "data.download",
        "train.progress",
    }
)


# results.csv columns that repeat a config key with no setting column of its own: the value
# of that key for a run whose run.json lacks it (or is missing), so that concatenated
# results.csv files still keep a knob sweep's runs apart.
CSV_CONFIG_KEYS = {
    "channels_last": "train.channels_last",
    "compile": "train.compile",
    "bucket_cap_mb": "distributed.bucket_cap_mb",
    "gradient_as_bucket_view": "distributed.gradient_as_bucket_view",
    "static_graph": "distributed.static_graph",
}


def settings_in(columns) -> list[str]:
    """The setting columns present in `columns`, in display order (config keys last)."""
    present = set(columns)
    return [*(c for c in SETTINGS_ORDER if c in present), *config_settings_in(columns)]


def config_settings_in(columns) -> list[str]:
    """The columns named by a dotted config key (distributed.bucket_cap_mb), in their order."""
    return [c for c in columns if isinstance(c, str) and "." in c]


def config_keys(columns) -> list[str]:
    """Settings that identify a configuration: every setting except the seed."""
    return [c for c in settings_in(columns) if c != "seed"]
