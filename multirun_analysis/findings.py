"""The report's opening: the sweep's answers in a few sentences."""

from __future__ import annotations

import pandas as pd

from .render import format_value, signed
from .schema import WORLD, config_keys
from .sweep import Analysis
from .tables import SCALING_KINDS

_KIND_NAMES = {
    "weak": "Weak scaling (per-worker batch fixed)",
    "strong": "Strong scaling (global batch fixed)",
}


def key_findings(analysis: Analysis) -> list[str]:
    """Sentences that answer: how many runs, fastest setup, how close to linear, does accuracy change."""
    if not analysis.runs.included.any():
        return [
            _counts(analysis.runs),
            *_missing(analysis.missing),
            "**No run could be analysed**, so there are no scaling or accuracy results; "
            "[Problems](#problems) gives each run's reason.",
        ]
    return [
        _counts(analysis.runs),
        *_missing(analysis.missing),
        *_overlapping(analysis.runs),
        *_crowded(analysis.runs),
        *_repeated(analysis.runs),
        _best_throughput(analysis.configs),
        *_scaling(analysis.scaling, analysis.configs),
        *_more_than_linear(analysis.scaling),
        *_accuracy(analysis.configs, analysis.target_acc),
    ]


def _counts(runs: pd.DataFrame) -> str:
    """How many runs were found, analysed and left out, and why."""
    statuses = runs.status.replace({"unknown": "without a readable run.json"}).value_counts()
    found = ", ".join(f"{n:,} {status}" for status, n in statuses.items())
    left_out = runs[~runs.included]
    text = f"**{_plural(len(runs), 'run')}** found ({found}); **{int(runs.included.sum()):,} analysed**."
    if len(left_out):
        why = (
            left_out.status.where(
                left_out.status.isin(["failed", "running", "interrupted"]),
                "unreadable or incomplete",
            )
            .replace({"running": "still running"})
            .value_counts()
        )
        reasons = ", ".join(f"{n:,} {reason}" for reason, n in why.items())
        text += f" {len(left_out):,} left out ({reasons}); see [Problems](#problems)."
    unknown = runs.included & runs.status.eq("unknown")
    if unknown.sum() == 1:
        text += " 1 run without run.json is analysed because its results.csv holds every epoch."
    elif unknown.any():
        text += (
            f" {int(unknown.sum()):,} runs without run.json are analysed because their "
            "results.csv holds every epoch."
        )
    return text


def _missing(missing: pd.DataFrame) -> list[str]:
    """Jobs a sweep planned that left no run: the tables lack their points."""
    if missing.empty:
        return []
    first, many = missing.iloc[0], len(missing) > 1
    return [
        f"**{_plural(len(missing), 'job')} of a sweep never ran** ({'first: ' if many else ''}job "
        f"{first.job} of {first.sweep}: {first.overrides}): no run directory holds "
        f"{'them' if many else 'it'}, as when the sweep stopped before {'them' if many else 'it'} "
        "(Ctrl-C, a hangup, a crash) or has not reached it yet, so the tables lack "
        f"{'their points' if many else 'its point'}; see [Problems](#problems)."
    ]


def overlapping_runs(runs: pd.DataFrame) -> pd.Series:
    """Analysed runs that ran on one host while another run there did (run.json's start and
    end times, to the second): each measured its throughput under the other's load."""
    timed = (
        runs[runs.included]
        .assign(
            start=lambda d: _utc(d.start_time),
            end=lambda d: _utc(d.end_time),
        )
        .dropna(subset=["hostname", "start", "end"])
        .sort_values(["hostname", "start", "end"], kind="stable")
    )
    by_host = timed.groupby("hostname")
    # sorted by start: a run overlaps an earlier one if it starts before the latest end so
    # far, and a later one if the next run starts before it ends
    ends_before = by_host.end.cummax().groupby(timed.hostname).shift()
    next_start = by_host.start.shift(-1)
    return timed.loc[(timed.start < ends_before) | (next_start < timed.end), "path"]


def _utc(times: pd.Series) -> pd.Series:
    return pd.to_datetime(times, utc=True, errors="coerce", format="ISO8601")


def _overlapping(runs: pd.DataFrame) -> list[str]:
    paths = overlapping_runs(runs)
    if paths.empty:
        return []
    return [
        f"**{_plural(len(paths), 'run')} ran at the same time as another on one host** "
        f"(first: {paths.iloc[0]}): each measured its throughput under the other's load, so "
        "their speedups and efficiencies are not to be trusted; run such jobs one after another."
    ]


def crowded_runs(runs: pd.DataFrame) -> pd.DataFrame:
    """Analysed CPU runs that spawned more workers than the cores they could use
    (num_gpus=4 on a 2-core laptop): past the core count more workers cannot raise
    throughput. (Under torchrun or SLURM each task may be bound to cores of its own.)"""
    if not {"usable_cores", "device", "num_gpus", "launcher"} <= set(runs.columns):
        return runs.iloc[:0]
    cores = pd.to_numeric(runs.usable_cores, errors="coerce")
    spawned = runs.included & runs.device.eq("cpu") & runs.launcher.eq("spawn")
    return runs[spawned & (runs.num_gpus > cores).fillna(False)]


def _crowded(runs: pd.DataFrame) -> list[str]:
    crowded = crowded_runs(runs)
    if crowded.empty:
        return []
    first = crowded.iloc[0]
    which = f"{'first: ' if len(crowded) > 1 else ''}{first.path}"
    return [
        f"**{_plural(len(crowded), 'run')} had more CPU workers than cores** ({which}, "
        f"{int(first.num_gpus)} workers on {int(first.usable_cores)} cores): past the core "
        "count more workers cannot raise throughput, so speedup and efficiency there measure "
        "the crowded machine, not the scaling of training."
    ]


def repeated_seeds(runs: pd.DataFrame) -> pd.DataFrame:
    """Analysed runs that repeat the seed of an earlier analysed run of their configuration (a
    sweep analysed with its rerun, or a baseline rerun alone as a finding advises)."""
    included = runs[runs.included]
    return included[included.duplicated([*config_keys(included.columns), "seed"], keep="first")]


def _repeated(runs: pd.DataFrame) -> list[str]:
    repeats = repeated_seeds(runs)
    if repeats.empty:
        return []
    first = repeats.iloc[0]
    return [
        f"**{_plural(len(repeats), 'run')} repeated a seed of {'its' if len(repeats) == 1 else 'their'} "
        f"configuration** (first: {first.path}, seed {format_value(first.seed)}): the same seed trains "
        "the same model again, so the configuration's final val_acc mean counts that seed twice, its "
        "std understates the spread between seeds and n_runs is not a number of seeds; give each "
        "repeat a train.seed of its own. (As a repeat of throughput it is fair.)"
    ]


def _best_throughput(configs: pd.DataFrame) -> str:
    """The fastest configuration and its settings."""
    best = configs.loc[configs.images_per_sec.idxmax()]
    return (
        f"**Best throughput: {best.images_per_sec:,.0f} images/sec** with {describe(best, configs)}"
        f"; mean of {_plural(int(best.n_runs), 'run')}."
    )


def _scaling(scaling: pd.DataFrame, configs: pd.DataFrame) -> list[str]:
    """Efficiency and accuracy change at each group's largest world size, per scaling kind."""
    if scaling.empty:
        why = no_scaling_reason(configs)
        if why.startswith("every"):
            return [f"**Nothing to scale:** {why}."]
        return [f"**No scaling groups:** {why}."]
    return [_kind_sentence(kind, scaling[scaling.scaling == kind]) for kind in SCALING_KINDS]


def no_scaling_reason(configs: pd.DataFrame) -> str:
    """Why a sweep has no scaling group, as a clause."""
    sizes = configs.world_size.dropna().unique()
    if len(sizes) == 0:
        return "no run could be analysed"
    if len(sizes) == 1:
        return f"every analysed run used world size {format_value(sizes[0])}"
    return "no two analysed configurations differ only in world size"


def _kind_sentence(kind: str, table: pd.DataFrame) -> str:
    name = _KIND_NAMES[kind]
    if table.empty:
        fixed = SCALING_KINDS[kind]
        return (
            f"{name}: no groups (no {fixed} was run at two or more world sizes with everything "
            "else alike)."
        )
    # Every layout at a group's largest world size (1 node x 4 GPUs and 2 nodes x 2 GPUs are
    # both world size 4, and rarely equally fast): keeping one would hide the other.
    largest = table[table.world_size == table.groupby("group").world_size.transform("max")]
    if largest.group.nunique() == 1:
        row = largest.iloc[0]
        if len(largest) == 1:
            efficiency = f"**efficiency {row.efficiency:.2f}**"
            speedup = f"speedup {row.speedup:.2f}×"
        else:  # one group, several layouts at its largest world size: each by name
            efficiency = "**efficiency " + " and ".join(
                f"{r.efficiency:.2f} with {layout(r)}" for r in largest.itertuples()
            ) + "**"
            speedup = "speedup " + " and ".join(f"{r.speedup:.2f}×" for r in largest.itertuples())
        text = (
            f"{name}: at world size {format_value(row.world_size)}, {efficiency} "
            f"({speedup} over {_baseline(row, table)}; ideal {row.ideal_speedup:.2f}×)"
        )
        text += _sync_share(largest)
        change = largest.val_acc_change.dropna()
        if len(change):
            text += f"; final val_acc changes by {_span(change, signed, ' to ')}"
        return text + "."
    groups = largest.group.nunique()
    worst, best = largest.loc[largest.efficiency.idxmin()], largest.loc[largest.efficiency.idxmax()]
    low, high = f"{worst.efficiency:.2f}", f"{best.efficiency:.2f}"
    if low == high:  # "from 0.50 (W1 ...) to 0.50 (W2 ...)" says nothing the groups differ in
        text = (
            f"{name}: across {groups} groups, **efficiency at each group's largest world size** "
            f"is {low} in every group"
        )
    else:
        text = (
            f"{name}: across {groups} groups, **efficiency at each group's largest world size** "
            f"ranges from {low} ({worst.group}: {worst.group_label}, {_world(worst, table)}) "
            f"to {high} ({best.group}: {best.group_label}, {_world(best, table)}), "
            f"median {largest.efficiency.median():.2f}"
        )
    text += _sync_share(largest)
    change = largest.val_acc_change.dropna()
    if len(change):
        span = _span(change, signed, " to ")
        text += f"; final val_acc changes by {span}"
        if len(change) < len(largest):
            text += (" in the one group that reports it" if len(change) == 1
                     else f" in the {len(change)} groups that report it")
        elif " to " not in span:
            text += " in every group"
        if " to " in span:
            text += f" (mean {signed(change.mean())})"
    return text + "."


def _sync_share(largest: pd.DataFrame) -> str:
    """"; gradient sync takes 12% of step time there" (a span over several rows), or ""."""
    shares = largest.grad_sync_share.dropna()
    return f"; gradient sync takes {_span(shares, '{:.0%}'.format)} of step time there" if len(shares) else ""


def layout(row) -> str:
    """A world layout in words: "2 nodes × 2 GPUs" (num_nodes × num_gpus)."""
    return f"{_plural(int(row.num_nodes), 'node')} × {_plural(int(row.num_gpus), 'GPU')}"


def _world(row: pd.Series, table: pd.DataFrame) -> str:
    """ "world size 4", naming the layout when the row's group ran that size in more than one."""
    same = table[(table.group == row.group) & (table.world_size == row.world_size)]
    text = f"world size {format_value(row.world_size)}"
    return text + f" ({layout(row)})" if same.num_nodes.nunique() > 1 else text


def _baseline(row: pd.Series, table: pd.DataFrame) -> str:
    """The world size a row's speedup is measured against, with its layout when that size
    ran in more than one (the table takes the one with the fewest nodes)."""
    base = table[(table.group == row.group) & (table.world_size == row.baseline_world_size)]
    return _world(base.sort_values("num_nodes", kind="stable").iloc[0], table)


SUPERLINEAR = 1.1  # efficiency above this is worth a warning


def _more_than_linear(scaling: pd.DataFrame) -> list[str]:
    """Efficiencies well above 1: rare in data-parallel training, usually a slow baseline."""
    high = scaling[(scaling.world_size > scaling.baseline_world_size) & (scaling.efficiency > SUPERLINEAR)]
    if high.empty:
        return []
    top = high.loc[high.efficiency.idxmax()]
    return [
        f"**{_plural(len(high), 'scaling point')} above efficiency {SUPERLINEAR:.2f}** (highest: "
        f"{top.efficiency:.2f}, {top.group} at {_world(top, scaling)}): more than "
        "linear is rare in data-parallel training and usually means the baseline ran slow "
        "(other load on the machine, or fewer cores than its threads); rerun the baseline alone "
        "before trusting these speedups."
    ]


def _span(values: pd.Series, form, dash: str = "–") -> str:
    """"6%–9%", or "6%" when the lowest and highest read the same as printed by `form`."""
    low, high = form(values.min()), form(values.max())
    return low if low == high else f"{low}{dash}{high}"


def _accuracy(configs: pd.DataFrame, target: float) -> list[str]:
    """The spread of final val_acc over the sweep, and who reached the target first."""
    table = configs.dropna(subset=["final_val_acc"])
    if table.empty:
        return ["No analysed run reports a validation accuracy."]
    low, high = table.loc[table.final_val_acc.idxmin()], table.loc[table.final_val_acc.idxmax()]
    if len(table) == 1:
        spread = f"Final val_acc is **{high.final_val_acc:.3f}** (one configuration)."
    elif f"{low.final_val_acc:.3f}" == f"{high.final_val_acc:.3f}":
        spread = f"**Final val_acc is {high.final_val_acc:.3f}** in all {len(table)} configurations."
    else:
        spread = (
            f"**Final val_acc ranges from {low.final_val_acc:.3f} to {high.final_val_acc:.3f}** across "
            f"{len(table)} configurations (lowest: {describe(low, configs)}; highest: {describe(high, configs)})."
        )
    return [spread, _target(table, target, configs)]


def _target(table: pd.DataFrame, target: float, configs: pd.DataFrame) -> str:
    """Which configurations reached the target in every seed (tables.configurations), and
    the fastest of them; those that reached it in some seeds only are counted apart."""
    reached = table.dropna(subset=["time_to_target_s"])
    partly = int(table.n_reached.between(1, table.n_runs - 1).sum())
    every = " in every seed" if (table.n_runs > 1).any() else ""
    others = ("other " if partly == 1 else "others ") if len(reached) else ""
    some = (
        f"{partly:,} {others}reached it in only some of "
        f"{'its' if partly == 1 else 'their'} seeds"
    )
    if reached.empty:
        # A mean over seeds can sit below the target one seed reached: say it is a mean.
        best = (
            f"best mean final over seeds: {table.final_val_acc.max():.3f}"
            if (table.n_runs > 1).any()
            else f"best final {table.final_val_acc.max():.3f}"
        )
        if partly:
            return f"No configuration reached val_acc {target:g}{every}; {some} ({best})."
        return f"No configuration reached val_acc {target:g} ({best})."
    fastest = reached.loc[reached.time_to_target_s.idxmin()]
    n = int(fastest.n_runs)
    how = (
        f"epoch {int(fastest.epochs_to_target)}"
        if n == 1
        else f"mean over its {n} seeds, each of which reached it by epoch "
        f"{int(fastest.epochs_to_target)}"
    )
    return (
        f"{len(reached)} of {len(table)} configurations reached val_acc {target:g}{every}"
        f"{f' ({some})' if partly else ''}; fastest: **{fastest.time_to_target_s:,.1f} s** of "
        f"training ({how}) with {describe(fastest, configs)}."
    )


def describe(row: pd.Series, configs: pd.DataFrame) -> str:
    """A configuration in words: its world layout, batch, and the settings that vary in the sweep."""
    world = f"world size {format_value(row.world_size)}"
    # The layout, when it is not plain one node, or when another layout ran at this size.
    layouts = configs.loc[configs.world_size == row.world_size, "num_nodes"].nunique()
    if pd.notna(row.get("num_nodes")) and (row.num_nodes > 1 or layouts > 1):
        world += f" ({layout(row)})"
    batch = f"batch {format_value(row.batch_size)}/worker (global {format_value(row.global_batch_size)})"
    varying = [
        k
        for k in config_keys(configs.columns)
        if k not in (*WORLD, "batch_size", "global_batch_size")
        and configs[k].nunique(dropna=False) > 1
    ]
    return ", ".join([world, batch, *(f"{k}={format_value(row[k])}" for k in varying)])


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"
