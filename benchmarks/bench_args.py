"""Command-line checks shared by the benchmark scripts: argparse `type=` functions.

A nonsense value fails while the arguments are parsed, as argparse's own errors do
(`argument --steps: must be an integer >= 1, got 0`, exit 2), before any work starts:
not as a traceback, a hang, or a default silently put in its place.
"""

from __future__ import annotations

import argparse
import math


def at_least(low: int, why: str = ""):
    """An int >= low (`why`, if given, says what a smaller one would break)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(
                f"must be an integer >= {low}, got {value}" + (f": {why}" if why else ""))
        return value

    return parse


def seconds(text: str) -> float:
    """A finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value
