"""Hand-built results.csv and run.json files, written the way the contract (DESIGN.md) says."""

import csv
import itertools
import json

COLUMNS = [
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
    "epoch",
    "train_loss",
    "train_acc",
    "val_loss",
    "val_acc",
    "epoch_time_s",
    "elapsed_s",
    "images_per_sec",
    "warmup",
    "grad_sync_share",
    "launcher",
]
IMAGES_PER_EPOCH = 6000
_RUN_MINUTES = itertools.count()


def run_rows(
    *,
    images_per_sec=(1000.0, 1000.0, 1000.0),
    val_acc=None,
    world_size=1,
    num_nodes=1,
    batch_size=64,
    lr=0.1,
    seed=0,
    model="cnn",
    dataset="fashion_mnist",
    optimizer="sgd",
    grad_sync_share=None,
    epochs=None,
    grad_accum_steps=1,
    launcher="spawn",
    bucket_cap_mb=25.0,
):
    """One dict per epoch; each epoch takes IMAGES_PER_EPOCH / images_per_sec seconds."""
    n = len(images_per_sec)
    val_acc = val_acc or [0.5 + 0.1 * i for i in range(n)]
    rows, elapsed = [], 0.0
    for i, (ips, acc) in enumerate(zip(images_per_sec, val_acc), start=1):
        epoch_time = IMAGES_PER_EPOCH / ips
        elapsed += epoch_time
        rows.append(
            {
                "model": model,
                "dataset": dataset,
                "optimizer": optimizer,
                "num_nodes": num_nodes,
                "num_gpus": world_size // num_nodes,
                "world_size": world_size,
                "backend": "gloo",
                "device": "cpu",
                "batch_size": batch_size,
                "global_batch_size": batch_size * world_size,
                "lr": lr,
                "seed": seed,
                "epochs": epochs or n,
                "epoch": i,
                "train_loss": 1.0 / i,
                "train_acc": acc,
                "val_loss": 1.1 / i,
                "val_acc": acc,
                "epoch_time_s": epoch_time,
                "elapsed_s": elapsed,
                "images_per_sec": ips,
                "warmup": i == 1,
                "grad_sync_share": "" if grad_sync_share is None else grad_sync_share,
                "launcher": launcher,
                # written only when `columns` has them
                "grad_accum_steps": grad_accum_steps,
                "bucket_cap_mb": bucket_cap_mb,
            }
        )
    return rows


def write_results(directory, rows, columns=COLUMNS):
    """results.csv as the training side writes it: header, then one line per epoch."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return directory / "results.csv"


def write_run_json(directory, status="completed", error=None, rows=None, config=None, **extra):
    """run.json with the resolved config taken from the first row; `config` adds or replaces
    keys of it by group, e.g. {"distributed": {"bucket_cap_mb": 1.0}}."""
    directory.mkdir(parents=True, exist_ok=True)
    first = rows[0] if rows else {}
    minute = next(_RUN_MINUTES) % 30
    doc = {
        "status": status,
        "error": error,
        # one run after another, as on one machine (overlapping runs get a warning)
        "start_time": f"2026-12-02T11:{2 * minute:02d}:00",
        "end_time": None if status == "running" else f"2026-12-02T11:{2 * minute + 1:02d}:00",
        "overrides": [f"distributed.num_gpus={first.get('num_gpus', 1)}"],
        "config": {
            "model": {"name": first.get("model", "cnn")},
            "data": {
                "name": first.get("dataset", "fashion_mnist"),
                "batch_size": first.get("batch_size", 64),
            },
            "optim": {"name": first.get("optimizer", "sgd"), "lr": first.get("lr", 0.1)},
            "distributed": {
                "num_gpus": first.get("num_gpus", 1),
                "num_nodes": first.get("num_nodes", 1),
            },
            "train": {
                "epochs": first.get("epochs", 3),
                "seed": first.get("seed", 0),
                "grad_accum_steps": first.get("grad_accum_steps", 1),
            },
        },
        "world_size": first.get("world_size", 1),
        "hostname": "node0",
        "launcher": first.get("launcher", "spawn"),
        **extra,
    }
    for group, fields in (config or {}).items():
        doc["config"].setdefault(group, {}).update(fields)
    (directory / "run.json").write_text(json.dumps(doc))


def new_sweep(tmp_path):
    """A sweep folder under tmp_path and a function that writes one run into it.

    write_run(name, status="completed", error=None, run_json=True, config=None,
    columns=COLUMNS, **run_rows kwargs) returns the run directory (`config` as in
    write_run_json, `columns` as in write_results). (Plain helpers rather than fixtures:
    a conftest.py here would share the module name `conftest` with tests/conftest.py and
    shadow it.)
    """
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir(exist_ok=True)

    def write_run(
        name,
        *,
        status="completed",
        error=None,
        run_json=True,
        config=None,
        columns=COLUMNS,
        **settings,
    ):
        directory = sweep_dir / name
        rows = run_rows(**settings)
        write_results(directory, rows, columns)
        if run_json:
            write_run_json(directory, status=status, error=error, rows=rows, config=config)
        return directory

    return sweep_dir, write_run
