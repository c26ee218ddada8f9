"""Command-line checks shared by the benchmark scripts: argparse `type=` functions.

A nonsense value fails while the arguments are parsed, as argparse's own errors do
(`argument --steps: must be an integer >= 1, got 0`, exit 2), before any work starts:
not as a traceback, a hang, or a default silently put in its place, and not after a
25-minute run when the figures are written.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path


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


def fraction(text: str) -> float:
    """A number in [0, 1]: an accuracy, or a gap between two."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text}")
    return value


def output_file(text: str) -> Path:
    """A file this process can create or overwrite: checked before the run, not after it."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a directory; give a file name in it")
    parent = path.absolute().parent
    if not parent.is_dir():
        why = "is not a directory" if parent.exists() else "does not exist"
        raise argparse.ArgumentTypeError(f"cannot write {path}: {parent} {why}")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {path}: the file is not writable")
    if not path.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {path}: its directory {parent} is not writable")
    return path


def new_directory(text: str) -> Path:
    """A directory to fill from scratch: absent (it is created) or empty, never reused."""
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        raise argparse.ArgumentTypeError(
            f"{path} is not empty; give a new or empty directory (what is there would be read "
            "with what this run writes)")
    existing = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot create {path}: {existing} is not a writable directory")
    return path
