"""PNG plots of the scaling and accuracy tables.

Figures are built with matplotlib's object API on the Agg canvas, never through
pyplot: no GUI backend, no global figure state, nothing left open between plots.
Each function returns the path it wrote, or None when there is nothing to draw.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FixedLocator, NullLocator

from .render import format_value
from .schema import WORLD, config_keys
from .tables import SCALING_KINDS, joined_labels, scaling_keys, varying_keys

MAX_LINES = 12  # more lines than this make a plot unreadable; the title says what is shown
MAX_PANELS = 9  # a 3 x 3 grid of heatmaps
# A legend label longer than this names only the keys that tell lines apart, then "…". At 9 pt
# one legend column of the narrowest figure (10 in) holds some 130 characters; at 60 the
# labels of a sweep over model, dataset and optimizer (and lr) lost the dataset and optimizer.
_LABEL_CHARS = 100
_LINE_STYLES = ("-", ":", "-.", "--")  # lines 0-9 solid in ten colours, 10-19 dotted, ...
_CMAP = colormaps["viridis"].with_extremes(bad="#f0f0f0")
_SHORT = {
    "world_size": "ws",
    "batch_size": "batch",
    "global_batch_size": "global batch",
    "num_nodes": "nodes",
    "num_gpus": "gpus/node",
    "optimizer": "optim",
}
# The figure beside a point, on a white patch: printed below its point it can land on the
# dashed ideal line (an efficiency of 1.41 sits on 1.0), which struck it through. Drawn
# above the lines (zorder 2) and below the axes' frame (2.5), which it must not break.
_NOTE = dict(
    textcoords="offset points",
    xytext=(6, -12),
    fontsize=9,
    zorder=2.2,
    bbox=dict(boxstyle="square,pad=0.15", facecolor="white", edgecolor="none", alpha=0.85),
)
_NOTE_PAD = 2.0  # pixels a figure's patch keeps from the axes' frame
_LEGEND_ROW = 0.2  # inches a row of a 9 pt legend takes (0.195 measured)
_TITLES = {
    "weak": "Weak scaling: per-worker batch fixed",
    "strong": "Strong scaling: global batch fixed",
}


def plot_scaling(
    scaling: pd.DataFrame, kind: str, path: Path, palette: dict[str, int]
) -> Path | None:
    """Speedup (with the ideal line) and efficiency against world size, one line per group,
    coloured and listed as `palette` (line_palette) says."""
    table = scaling[scaling.scaling == kind]
    if table.empty:
        return None
    table = table.assign(colour=_line_key(table, kind).map(palette))
    shown, total = _top_groups(table, "group")
    fig = _figure(12, 4.6)  # _legend adds the room its rows take below
    speed_ax, eff_ax = fig.subplots(1, 2)
    sizes = np.sort(table.world_size.unique().astype(float))
    for baseline in sorted(table.baseline_world_size.unique()):
        xs = sizes[sizes >= baseline]
        speed_ax.plot(
            xs,
            xs / baseline,
            "k--",
            lw=1.2,
            label="ideal (linear)" if baseline == table.baseline_world_size.min() else None,
        )
    eff_ax.axhline(1.0, color="k", ls="--", lw=1.2, label="ideal")
    labels = table.group + ": " + _labels(
        table, _line_keys(table.columns, kind), always=(SCALING_KINDS[kind],)
    )
    noted = {}  # (axes, x, text): groups that meet at a point (every baseline) print it once
    for i, group in shown.groupby("colour", sort=True):
        label = labels[group.index[0]]
        for suffix, marker, points in _layouts(group):
            style = dict(**_style(i), marker=marker, label=label + suffix)
            speed_ax.plot(points.world_size.astype(float), points.speedup, **style)
            eff_ax.plot(points.world_size.astype(float), points.efficiency, **style)
        if total <= 3:  # few lines: print the numbers next to the points, in the line's colour
            colour = _style(i)["color"]
            for x, speedup, efficiency in group[["world_size", "speedup", "efficiency"]].values:
                for ax, value, text in ((speed_ax, speedup, f"{speedup:.2f}×"),
                                        (eff_ax, efficiency, f"{efficiency:.2f}")):
                    note = noted.get((ax, x, text))
                    if note is None:
                        noted[ax, x, text] = ax.annotate(text, (x, value), color=colour, **_NOTE)
                    elif note.get_color() != colour:  # lines of several colours share it
                        note.set_color("black")
    _world_axis(speed_ax, sizes)
    _world_axis(eff_ax, sizes)
    if speed_ax.get_xscale() == "log":  # log-log: the ideal line is straight, gaps read as ratios
        speed_ax.set_yscale("log", base=2)
        speed_ax.yaxis.set_major_formatter(lambda v, _: f"{v:g}")
    speed_ax.set(ylabel="speedup over smallest world size", title="Speedup")
    eff_ax.set(
        ylabel="parallel efficiency",
        title="Efficiency (1.0 = linear)",
        ylim=(0, max(1.1, float(table.efficiency.max()) * 1.1)),
    )
    fig.suptitle(_TITLES[kind] + _shown(shown.group.nunique(), total, "groups"), fontsize=13)
    _legend(fig, speed_ax)
    _place_notes(fig, noted)
    return _save(fig, path)


def plot_throughput(configs: pd.DataFrame, path: Path, palette: dict[str, int]) -> Path | None:
    """Throughput (mean ± std over seeds) against world size; lines join runs of one per-worker
    batch, coloured and listed as `palette` (line_palette) says."""
    if configs.empty or configs.images_per_sec.isna().all():
        return None
    table = configs.assign(
        line=lambda d: _line_key(d, "weak"),
        colour=lambda d: d.line.map(palette),
        label=lambda d: _labels(d, _line_keys(d.columns, "weak"), always=("batch_size",)),
    )
    shown, total = _top_groups(table, "line")
    fig = _figure(10, 5.0)
    ax = fig.subplots()
    for i, line in shown.sort_values("world_size", kind="stable").groupby("colour", sort=True):
        for suffix, marker, points in _layouts(line):
            ax.errorbar(
                points.world_size.astype(float),
                points.images_per_sec,
                yerr=points.images_per_sec_std.fillna(0),
                **_style(i),
                marker=marker,
                capsize=3,
                label=line.label.iloc[0] + suffix,
            )
    _world_axis(ax, np.sort(table.world_size.unique().astype(float)))
    ax.set(ylabel="images / sec (sum over workers)", ylim=(0, None))
    ax.yaxis.set_major_formatter(lambda v, _: f"{v:,.0f}")
    fig.suptitle(
        "Throughput against world size" + _shown(shown.line.nunique(), total, "lines"), fontsize=13
    )
    _legend(fig, ax)
    return _save(fig, path)


def plot_accuracy_heatmap(configs: pd.DataFrame, path: Path) -> Path | None:
    """Final val_acc over lr x global batch, one panel per world size and per value of any
    other setting that varies (model, optimizer, grad_accum_steps, a config key, ...)."""
    table = configs.dropna(subset=["final_val_acc"])
    if table.empty:
        return None
    # A cell averages only the node layouts of one world size, never unlike runs.
    facets = [
        k
        for k in config_keys(table.columns)
        if k not in ("lr", "batch_size", "global_batch_size", "num_nodes", "num_gpus")
        and table[k].nunique(dropna=False) > 1
    ]
    panels = list(table.groupby(facets, sort=True, dropna=False)) if facets else [((), table)]
    total, panels = len(panels), panels[:MAX_PANELS]
    named = _telling_apart(pd.concat([panel.head(1) for _, panel in panels]), facets)
    # Each panel shows only the learning rates and batches it ran, so a weak-scaling
    # sweep (global batch grows with world size) is not mostly empty cells.
    grids = [
        panel.groupby(["lr", "global_batch_size"]).final_val_acc.mean().unstack("global_batch_size")
        for _, panel in panels
    ]
    n_rows = max(g.shape[0] for g in grids)
    n_cols = max(g.shape[1] for g in grids)
    cols = min(len(panels), 3)
    rows = -(-len(panels) // cols)
    cell = max(0.5, min(1.0, 6 / max(n_rows, n_cols)))
    fig = _figure(max(6.0, cols * (1.5 + cell * n_cols) + 1.2), rows * (1.3 + cell * n_rows) + 0.8)
    title_chars = int((1.5 + cell * n_cols) * 11)  # about what a panel's width holds at 10 pt
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    vmin, vmax = float(table.final_val_acc.min()), float(table.final_val_acc.max())
    vmin, vmax = (vmin - 0.01, vmax + 0.01) if vmax - vmin < 0.02 else (vmin, vmax)
    for ax, (key, _), grid in zip(axes, panels, grids):
        values = grid.to_numpy(float)
        image = ax.imshow(values, cmap=_CMAP, vmin=vmin, vmax=vmax, aspect="auto")
        for (r, c), value in np.ndenumerate(values):
            if np.isnan(value):
                ax.text(c, r, "not run", ha="center", va="center", fontsize=8, color="#888888")
            else:
                light = (value - vmin) / (vmax - vmin) < 0.6
                ax.text(
                    c,
                    r,
                    f"{value:.3f}",
                    ha="center",
                    va="center",
                    fontsize=9,
                    color="white" if light else "black",
                )
        ax.set_xticks(range(grid.shape[1]), [format_value(b) for b in grid.columns])
        ax.set_yticks(range(grid.shape[0]), [format_value(v) for v in grid.index])
        ax.set(xlabel="global batch size", ylabel="learning rate")
        key = dict(zip(facets, key if isinstance(key, tuple) else (key,)))
        title = ", ".join(f"{k}={format_value(key[k])}" for k in facets) or "all runs"
        if len(title) > 2 * title_chars:  # more than two lines: name what tells the panels apart
            title = ", ".join(f"{k}={format_value(key[k])}" for k in named)
            title += ", …" if len(named) < len(facets) else ""
        ax.set_title(textwrap.fill(title, title_chars, break_long_words=False), fontsize=10)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    fig.colorbar(
        image,
        ax=axes[: len(panels)].tolist(),
        label="final val_acc (mean over seeds)",
        shrink=min(0.9, 4 / rows + 0.1),
    )
    more = f" (first {MAX_PANELS} of {total} panels)" if total > MAX_PANELS else ""
    fig.suptitle("Final validation accuracy: learning rate × global batch" + more, fontsize=13)
    return _save(fig, path)


def plot_curves(
    epochs: pd.DataFrame, runs: pd.DataFrame, path: Path, palette: dict[str, int]
) -> Path | None:
    """val_acc over epochs and over training time, one line per configuration (mean over seeds),
    in its throughput line's colour and style from `palette` (line_palette), marked by world
    layout: picking colours of its own, a configuration here had another colour than there."""
    included = runs[runs.included]
    if included.empty:
        return None
    keys = config_keys(included.columns)
    runs_line = included.assign(line=included.groupby(keys, dropna=False).ngroup())
    lines = (  # one row per configuration shown, labelled once (not once per run)
        runs_line.drop_duplicates("line")
        .set_index("line")
        .assign(final=runs_line.groupby("line").final_val_acc.mean())
        # Labelled among all configurations, as the other plots label their lines: labelled
        # among those shown, a model that the best all share but others do not went unnamed.
        # A label cut short keeps the world size, which the curves are there to compare.
        .pipe(lambda d: d.assign(
            label=_labels(d, keys, always=("world_size",) if d.world_size.nunique() > 1 else ()),
            colour=_line_key(d, "weak").map(palette),
        ))
        .nlargest(MAX_LINES, "final")
        .sort_values(["colour", *WORLD], kind="stable")  # listed as the other legends are
    )
    layouts = lines[list(WORLD)].drop_duplicates().sort_values(list(WORLD)).apply(tuple, axis=1)
    markers = {layout: _LAYOUT_MARKERS[i] for i, layout in enumerate(layouts)}
    total = runs_line.line.nunique()
    curves = (
        epochs.merge(runs_line.loc[runs_line.line.isin(lines.index), ["run_id", "line"]])
        .groupby(["line", "epoch"], as_index=False)
        .agg(val_acc=("val_acc", "mean"), elapsed_s=("elapsed_s", "mean"))
    )
    fig = _figure(12, 4.6)
    epoch_ax, time_ax = fig.subplots(1, 2, sharey=True)
    for line, row in lines.iterrows():
        curve = curves[curves.line == line]
        marker = markers[tuple(row[list(WORLD)])]
        style = dict(**_style(int(row.colour)), marker=marker, ms=5, label=row.label or "all runs")
        epoch_ax.plot(curve.epoch.astype(float), curve.val_acc, **style)
        time_ax.plot(curve.elapsed_s, curve.val_acc, **style)
    epoch_ax.set(xlabel="epoch", ylabel="validation accuracy", title="Over epochs")
    # min_n_ticks=1: where every run has one epoch the axis spans 0.95-1.05, and a locator
    # that wants two ticks there gives up on whole numbers (0.96, 0.98, ...).
    epoch_ax.xaxis.get_major_locator().set_params(integer=True, min_n_ticks=1)
    time_ax.set(xlabel="training time (s, evaluation excluded)", title="Over training time")
    for ax in (epoch_ax, time_ax):
        ax.grid(alpha=0.3)
    more = f" (the {MAX_LINES} best of {total} configurations)" if total > MAX_LINES else ""
    fig.suptitle("Validation accuracy, mean over seeds" + more, fontsize=13)
    _legend(fig, epoch_ax)
    return _save(fig, path)


def line_palette(configs: pd.DataFrame, scaling: pd.DataFrame) -> dict[str, int]:
    """One colour number per line of the throughput and scaling plots, shared by them all and by
    the accuracy curves of the line's configurations: first each throughput line (a
    configuration but for its world layout; the weak-scaling groups are such lines), then each
    strong-scaling group, whose runs lie on several throughput lines and so takes a colour none
    of them has. Each kind is in the order the scaling table numbers its groups (by settings),
    which is the order every legend lists its lines in."""
    strong = scaling[scaling.scaling == "strong"]
    keys = [*_in_order(configs, "weak"), *_in_order(strong, "strong")]
    return {key: i for i, key in enumerate(keys)}


def _in_order(frame: pd.DataFrame, kind: str) -> list[str]:
    """The distinct line keys of `kind` in `frame`, ordered by their settings."""
    if frame.empty:
        return []
    order = frame.groupby(scaling_keys(frame.columns, kind), dropna=False, sort=True).ngroup()
    return _line_key(frame, kind).iloc[order.argsort(kind="stable")].unique().tolist()


def _line_keys(columns, kind: str) -> list[str]:
    """The settings a line of `kind` keeps: all but the world layout and the other batch (a
    throughput line is a weak-scaling one: its per-worker batch is fixed)."""
    other_batch = {"batch_size", "global_batch_size"} - {SCALING_KINDS[kind]}
    return [k for k in config_keys(columns) if k not in (*WORLD, *other_batch)]


def _line_key(frame: pd.DataFrame, kind: str) -> pd.Series:
    """Each row's line (a configuration but for its world layout and the other batch), as text;
    the name of the batch kept tells a strong line from a weak one."""
    return joined_labels(frame, _line_keys(frame.columns, kind))


def _style(i: int) -> dict:
    """The look of palette entry i: ten colours solid, then dotted, dash-dotted, dashed."""
    return dict(color=f"C{i % 10}", ls=_LINE_STYLES[i // 10 % len(_LINE_STYLES)])


# One per world layout the curves show (at most MAX_LINES configurations, all perhaps of one
# colour): with six, 1 node x 1 GPU and 2 nodes x 4 GPUs of one configuration looked alike.
_LAYOUT_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "p", "h"]
assert len(_LAYOUT_MARKERS) >= MAX_LINES


def _layouts(line: pd.DataFrame):
    """(label suffix, marker, rows) per node count of one line, when the line ran a world
    size in more than one layout (1 node x 4 GPUs and 2 nodes x 2 GPUs): joined as one
    line they made an unlabelled vertical segment. Otherwise the whole line, unsuffixed."""
    if not (line.groupby("world_size").num_nodes.nunique() > 1).any():
        yield "", "o", line
        return
    for i, (nodes, points) in enumerate(line.groupby("num_nodes", sort=True)):
        suffix = f", {int(nodes)} node{'' if nodes == 1 else 's'}"
        yield suffix, _LAYOUT_MARKERS[i % len(_LAYOUT_MARKERS)], points


def _labels(frame: pd.DataFrame, keys: list[str], always=()) -> pd.Series:
    """Short legend labels, "lr=0.1, batch=64, ws=4", from the keys that vary between rows.

    The GPUs per node follow from the world size unless the node count varies too, so
    they are named only then.
    """
    varying = varying_keys(frame, keys, always)
    if "num_nodes" not in varying:
        varying = [k for k in varying if k != "num_gpus"]
    labels = joined_labels(frame, varying, _SHORT)
    if labels.empty or labels.str.len().max() <= _LABEL_CHARS:
        return labels
    named = _telling_apart(frame, varying, always)
    return joined_labels(frame, named, _SHORT) + (", …" if len(named) < len(varying) else "")


def _telling_apart(frame: pd.DataFrame, varying: list[str], always=()) -> list[str]:
    """The keys a label too long to read names: `always`, then, in order, each varying key
    that tells more of the rows apart, until they are told apart as well as all the keys
    would. With some 20 keys varying (a whole outputs/ tree) naming every key made labels
    the width of the figure; the tables name every key."""
    def kinds(columns: list[str]) -> int:
        return len(frame[columns].astype(str).drop_duplicates()) if columns else 1

    everything = kinds(varying)
    named = [k for k in varying if k in always]
    for key in varying:
        if kinds(named) == everything:
            break
        if key not in named and kinds([*named, key]) > kinds(named):
            named.append(key)
    return [k for k in varying if k in named]


def _top_groups(table: pd.DataFrame, column: str) -> tuple[pd.DataFrame, int]:
    """The MAX_LINES groups with the highest peak throughput, and how many there were."""
    peak = table.groupby(column).images_per_sec.max().nlargest(MAX_LINES)
    return table[table[column].isin(peak.index)], table[column].nunique()


def _shown(shown: int, total: int, what: str) -> str:
    return f"\n(the {shown} of {total} {what} with the highest throughput)" if shown < total else ""


def _world_axis(ax, sizes: np.ndarray) -> None:
    """World size on a log2 axis (1, 2, 4, 8 evenly spaced), ticked at the sizes present."""
    if len(sizes) and sizes.max() / sizes.min() >= 4:
        ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sizes))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(lambda v, _: f"{v:g}")
    ax.set_xlabel("world size (workers)")
    ax.margins(x=0.08)
    ax.grid(alpha=0.3)


def _figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _place_notes(fig: Figure, notes: dict) -> None:
    """Keep the figures printed beside the points inside their axes, and move those of one world
    size apart, up and down, where their patches would overlap: lines that end close together
    (3.50x, 3.55x, 3.60x) printed them over each other, and the figures at the largest world
    size stuck out past the axes' right edge, struck through by the frame. Each stays as near
    its point as the others and the frame let it."""
    if not notes:  # more than three lines print none: nothing to measure, so no draw
        return
    by_point = {}
    for (ax, x, _), note in notes.items():
        # Kept inside the axes below, they need no room in the layout; counted, they shrank
        # the axes to make room for where they first stood.
        note.set_in_layout(False)
        by_point.setdefault((ax, x), []).append(note)
    fig.draw_without_rendering()
    for ax in dict.fromkeys(ax for ax, _, _ in notes):
        _widen_for_notes(ax, [note for (on, _, _), note in notes.items() if on is ax])
    for (ax, _), column in by_point.items():
        boxes = [note.get_bbox_patch().get_window_extent() for note in column]
        order = np.argsort([-box.y0 for box in boxes], kind="stable")  # top first
        height = max(box.height for box in boxes)
        wanted = np.array([(boxes[i].y0 + boxes[i].y1) / 2 for i in order])
        inside = (ax.bbox.y0 + _NOTE_PAD + height / 2, ax.bbox.y1 - _NOTE_PAD - height / 2)
        for i, y in zip(order, _apart(wanted, height + 1.0, *inside)):
            moved = (y - (boxes[i].y0 + boxes[i].y1) / 2) * 72 / fig.dpi  # pixels to points
            column[i].xyann = (column[i].xyann[0], column[i].xyann[1] + moved)


def _widen_for_notes(ax, notes: list) -> None:
    """Move the right end of the x axis out until every figure's patch ends inside the axes.
    A figure sits a fixed number of pixels right of its point, so its point may lie at most
    at fraction 1 - (those pixels + pad) / width of the axes; the axis grows by the ratio."""
    width = ax.bbox.width
    grow = 1.0
    for note in notes:
        point = ax.transData.transform(note.xy)[0]
        beyond = note.get_bbox_patch().get_window_extent().x1 - point + _NOTE_PAD
        at = (point - ax.bbox.x0) / width
        grow = max(grow, at / (1 - beyond / width))
    if grow > 1.0:  # extend in display space: on a log axis that is a ratio of world sizes
        right = ax.transData.inverted().transform(ax.transAxes.transform((grow, 0)))[0]
        ax.set_xlim(ax.get_xlim()[0], right)


def _apart(wanted: np.ndarray, gap: float, low=-np.inf, high=np.inf) -> np.ndarray:
    """Heights nearest `wanted` (falling) in the least-squares sense that lie `gap` or more apart,
    all within [low, high] where they fit: with y_i + i * gap they must not rise, which pooling
    adjacent violators solves; the first must stay under high and the last over low, which on
    that non-rising sequence are bounds on all of it, and clipping meets them at least cost."""
    shifted = wanted + gap * np.arange(len(wanted))
    blocks = []  # [sum, count] of runs of positions that move together
    for value in shifted:
        blocks.append([value, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] < blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    pooled = np.concatenate([np.full(count, total / count) for total, count in blocks])
    pooled = np.minimum(np.maximum(pooled, low + gap * (len(wanted) - 1)), high)
    return pooled - gap * np.arange(len(wanted))


def _legend(fig: Figure, ax) -> None:
    """The legend of ax's lines below the axes, in up to four columns as their labels allow.
    The figure grows by its rows, so the axes keep their height however long it is: grown by a
    row per line, 12 lines run in two node layouts (25 entries in one column) left the axes
    an inch and a half, too short for their own label."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        widest = max(len(label) for label in labels)
        ncols = max(1, min(4, len(labels), 120 // (widest + 8)))
        fig.legend(
            handles, labels, loc="outside lower center", ncols=ncols, fontsize=9, frameon=False
        )
        fig.set_figheight(fig.get_figheight() + _LEGEND_ROW * -(-len(labels) // ncols))


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path)
    return path
