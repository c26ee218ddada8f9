"""Turn a report (a list of blocks) and DataFrames into Markdown and self-contained HTML."""

from __future__ import annotations

import base64
import html
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from .schema import SETTINGS_ORDER


@dataclass(frozen=True)
class Heading:
    text: str
    level: int = 2


@dataclass(frozen=True)
class Paragraph:
    text: str  # may use **bold** and `code`


@dataclass(frozen=True)
class Bullets:
    items: tuple[str, ...]


@dataclass(frozen=True)
class Table:
    frame: pd.DataFrame  # already formatted: every cell a string


@dataclass(frozen=True)
class Image:
    path: Path
    alt: str


# Display formats by column name; everything else falls back to `_number`.
_FIXED = {
    "speedup": 2,
    "ideal_speedup": 2,
    "efficiency": 2,
    "grad_sync_share": 2,
    "val_acc_change": 3,
    "target_acc": 2,
}


def format_value(value) -> str:
    """A setting as the user typed it: 0.05, 1e-05, 64, 1e+10, cnn. A float prints in the fewest
    digits that read back as it (`:g` cut 0.00012345678 to 0.000123457), a whole one as an
    integer (results.csv's numbers load as floats: batch 64.0 prints 64), from a million up in
    `:g`'s exponent form where that reads back as it (lr 1e10 printed as 10000000000)."""
    if value is None or value is pd.NA or (isinstance(value, float) and value != value):
        return "?"
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if not value.is_integer():
            return repr(value)
        return str(int(value)) if abs(value) < 1e6 else _shortest(value)
    return str(value)


def _shortest(value: float) -> str:
    """`value` in the fewest significant digits, in `:g` form, that read back as it exactly:
    1e+10, 2.5e+07, 1234567 (`:g` writes digits while there are as many as the exponent)."""
    return next(text for digits in range(1, 18) if float(text := f"{value:.{digits}g}") == value)


def is_setting(name) -> bool:
    """Whether a column holds a setting (lr, batch_size, a dotted config key), which prints as
    typed, rather than a measurement."""
    return isinstance(name, str) and (name in SETTINGS_ORDER or "." in name)


def signed(value: float, digits: int = 3) -> str:
    """A change with its sign, "+0.020"; one that rounds to zero is "+0.000", never "-0.000"
    (0.7 - 0.7 can come out as -1e-16)."""
    return f"{round(value, digits) + 0.0:+.{digits}f}"  # + 0.0 turns -0.0 into 0.0


def format_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """Every cell as display text: settings as typed, accuracies to 3 decimals, numbers from
    1,000 up with separators, '–' for missing; a column of other numbers in one format (see
    _column_number)."""
    return frame.apply(
        lambda column: column.map(
            lambda v, name=column.name, form=_column_number(column): (
                form(v) if form and _is_number(v) else format_cell(name, v)
            )
        )
    )


def _is_number(value) -> bool:
    return (
        isinstance(value, (int, float, np.integer, np.floating))
        and not isinstance(value, (bool, np.bool_))
        and math.isfinite(value)
    )


def _column_number(column: pd.Series):
    """One format for a whole column of measurements, or None where format_cell decides cell by
    cell (named formats, settings). Formats chosen cell by cell printed an exact 1246 as
    "1246" beside "1,681", and 4.995 as "5" beside "4.34"."""
    name = column.name
    if (
        not isinstance(name, str)
        or name in _FIXED
        or is_setting(name)
        or name.endswith(("_acc", "_acc_std"))
        or not pd.api.types.is_numeric_dtype(column)
        or pd.api.types.is_bool_dtype(column)
    ):
        return None
    values = column[column.map(_is_number)].astype(float)
    if values.empty:
        return None
    largest = values.abs().max()
    if (values % 1 == 0).all():
        return lambda v: f"{int(v):,}"
    if largest >= 1000:
        return lambda v: f"{v:,.0f}"
    if largest >= 10:
        return lambda v: f"{v:.1f}"
    # three significant digits of the largest value, and as many decimals for the rest
    decimals = min(8, max(0, 2 - math.floor(math.log10(largest))))
    return lambda v: f"{v:.{decimals}f}"


def format_cell(name: str, value) -> str:
    """One value as display text, chosen by its column name: a setting as typed (format_value),
    a measurement from 1,000 up with separators."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, (bool, np.bool_)):
        return "yes" if value else "no"
    if isinstance(value, str):
        return value
    if name in _FIXED:
        if name == "val_acc_change":
            return signed(value, _FIXED[name])
        return f"{value:.{_FIXED[name]}f}"
    if name.endswith("_acc") or name.endswith("_acc_std"):
        return f"{value:.3f}"
    if is_setting(name):
        return format_value(value)
    return _number(value)


def _number(value) -> str:
    if float(value).is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}"


def markdown_table(frame: pd.DataFrame) -> str:
    """A GitHub-flavoured Markdown table of an already formatted frame."""

    def cell(text) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = [
        "| " + " | ".join(cell(c) for c in frame.columns) + " |",
        "|" + "|".join("---" for _ in frame.columns) + "|",
    ]
    lines += [
        "| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)
    ]
    return "\n".join(lines)


def html_table(frame: pd.DataFrame) -> str:
    """An HTML table of an already formatted frame; numeric-looking cells right-aligned."""
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns)
    body = "".join(
        "<tr>" + "".join(_html_cell(v) for v in row) + "</tr>"
        for row in frame.itertuples(index=False)
    )
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


_NUMERIC = re.compile(r"^[+\-–]?[\d,]*\.?\d+(e[+-]?\d+)?$|^–$")


def _html_cell(value) -> str:
    text = str(value)
    align = ' class="num"' if _NUMERIC.match(text) else ""
    return f"<td{align}>{html.escape(text)}</td>"


def to_markdown(blocks: list) -> str:
    """The report as Markdown; images are linked by file name (they sit beside it)."""
    parts = []
    for block in blocks:
        if isinstance(block, Heading):
            parts.append("#" * block.level + " " + block.text)
        elif isinstance(block, Paragraph):
            parts.append(block.text)
        elif isinstance(block, Bullets):
            parts.append("\n".join("- " + item for item in block.items))
        elif isinstance(block, Table):
            parts.append(markdown_table(block.frame))
        elif isinstance(block, Image):
            parts.append(f"![{block.alt}]({block.path.name})")
    return "\n\n".join(parts) + "\n"


def to_html(blocks: list, title: str) -> str:
    """The report as one self-contained HTML page: inline CSS, images as base64 data URIs."""
    parts = []
    for block in blocks:
        if isinstance(block, Heading):
            anchor = re.sub(r"[^a-z0-9]+", "-", block.text.lower()).strip("-")
            parts.append(f'<h{block.level} id="{anchor}">{_inline(block.text)}</h{block.level}>')
        elif isinstance(block, Paragraph):
            parts.append(f"<p>{_inline(block.text)}</p>")
        elif isinstance(block, Bullets):
            parts.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in block.items) + "</ul>")
        elif isinstance(block, Table):
            parts.append(html_table(block.frame))
        elif isinstance(block, Image):
            data = base64.b64encode(block.path.read_bytes()).decode("ascii")
            parts.append(
                f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(block.alt)}">'
                f"<figcaption>{html.escape(block.alt)}</figcaption></figure>"
            )
    body = "\n".join(parts)
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n"
        f"<body><main>\n{body}\n</main></body></html>\n"
    )


def _inline(text: str) -> str:
    """Escape, then render the two bits of inline Markdown the report uses."""
    text = html.escape(text)
    text = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", text)
    text = re.sub(r"`(.+?)`", r"<code>\1</code>", text)
    return re.sub(r"\[(.+?)\]\(#([a-z0-9-]+)\)", r'<a href="#\2">\1</a>', text)


_CSS = """
body { margin: 0; background: #f6f7f9; color: #1f2328;
  font: 15px/1.5 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; }
main { max-width: 1100px; margin: 0 auto; padding: 24px 32px 64px; background: #fff; }
h1 { font-size: 26px; margin: 8px 0 4px; }
h2 { font-size: 20px; margin-top: 36px; padding-bottom: 4px; border-bottom: 1px solid #d8dee4; }
h3 { font-size: 16px; margin-top: 24px; }
code { font: 13px ui-monospace, Menlo, Consolas, monospace; background: #eff1f3;
  padding: 1px 4px; border-radius: 4px; }
ul { padding-left: 22px; } li { margin: 4px 0; }
.scroll { overflow-x: auto; margin: 12px 0; max-height: 640px; overflow-y: auto; }
table { border-collapse: collapse; font-size: 13px; }
th, td { border: 1px solid #d8dee4; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #eef1f4; position: sticky; top: 0; white-space: nowrap; }
td.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
tbody tr:nth-child(even) { background: #f8f9fb; }
figure { margin: 16px 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #e3e6ea; }
figcaption { color: #59636e; font-size: 13px; }
"""
