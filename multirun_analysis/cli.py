"""Command line: python -m multirun_analysis SWEEP_DIR [SWEEP_DIR ...] [--out DIR] [--target-acc 0.9]."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from .discover import distinct_sweeps, find_run_dirs

EXIT_BAD_ARGUMENT = 2  # argparse's own code for usage errors
EXIT_CANNOT_WRITE = 2  # like an --out that cannot be created: the fix is another directory
EXIT_NO_RUNS = 1


def parse_args(argv=None) -> argparse.Namespace:
    """The command's arguments."""
    parser = argparse.ArgumentParser(
        prog="python -m multirun_analysis",
        description=(
            "Turn one or more sweep directories into scaling tables, accuracy tables, plots "
            "and a report. A run is any directory below SWEEP_DIR (any depth) holding "
            "results.csv or run.json; directory names are never parsed."
        ),
        epilog=(
            "Writes runs.csv, scaling.csv, accuracy.csv (and .md twins), PNG plots, report.md "
            "and a self-contained report.html. Exit status: 0 report written, 1 no runs found, "
            "2 bad arguments (e.g. a directory that does not exist) or outputs that cannot be "
            "written."
        ),
    )
    parser.add_argument(
        "sweep_dirs",
        nargs="+",
        type=_path,
        metavar="SWEEP_DIR",
        help="a Hydra multirun directory, or any folder holding runs",
    )
    parser.add_argument(
        "--out",
        type=_path,
        default=None,
        help="output directory (default: analysis/ in the first SWEEP_DIR holding runs)",
    )
    parser.add_argument(
        "--target-acc",
        type=_fraction,
        default=0.9,
        metavar="FRACTION",
        help="validation accuracy to measure time-to-target against, in (0, 1] (default: 0.9)",
    )
    return parser.parse_args(argv)


def _path(text: str) -> Path:
    """A path argument; "" (a quoted shell variable that is unset) is refused, since Path("")
    is "." and would analyse, or write into, the current directory unasked."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?); give a directory")
    return Path(text)


def _fraction(text: str) -> float:
    """--target-acc's value; one that is not a number is answered with the fix, as one
    outside (0, 1] is (argparse said only "invalid float value: 'abc'")."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number; accuracies are fractions in (0, 1], e.g. --target-acc 0.9"
        ) from None


def main(argv=None) -> int:
    """Run the analysis; return the exit status."""
    args = parse_args(argv)
    problem = _check(args)
    if problem:
        print(f"multirun_analysis: error: {problem}", file=sys.stderr)
        return EXIT_BAD_ARGUMENT
    # pandas and matplotlib load only once there is something to analyse, so that
    # mistakes in the arguments are answered at once.
    found = [find_run_dirs(sweep) for sweep in args.sweep_dirs]
    empty = [sweep for sweep, runs in zip(args.sweep_dirs, found) if not runs]
    if len(empty) == len(args.sweep_dirs):
        print(
            f"multirun_analysis: error: no runs found under {', '.join(map(str, empty))} "
            "(a run is a directory holding results.csv or run.json)",
            file=sys.stderr,
        )
        return EXIT_NO_RUNS
    for sweep in empty:
        print(
            f"multirun_analysis: warning: no runs found under {sweep}; "
            "analysing the other directories",
            file=sys.stderr,
        )
    with_runs = [sweep for sweep, runs in zip(args.sweep_dirs, found) if runs]
    out = args.out or with_runs[0] / "analysis"  # by default beside the runs
    problem = _make_out(out)
    if problem:
        print(f"multirun_analysis: error: {problem}", file=sys.stderr)
        return EXIT_BAD_ARGUMENT
    from .report import write_report
    from .sweep import analyse

    # the report names only these: each once, and not s5/0 beside s5; absolute, since
    # runs.csv and the report outlive the directory the command ran from ("." says nothing)
    named = [
        Path(os.path.abspath(sweep))
        for sweep in distinct_sweeps(with_runs, [runs for runs in found if runs])
    ]
    analysis = analyse(named, target_acc=args.target_acc)
    try:
        report = write_report(analysis, out)
    except OSError as exc:  # a full disk, or a file in the way (report.md as a directory)
        print(
            f"multirun_analysis: error: cannot write {exc.filename or out}: "
            f"{exc.strerror or exc}; free the space or give --out a directory you can write to",
            file=sys.stderr,
        )
        return EXIT_CANNOT_WRITE
    runs = analysis.runs
    print(
        f"{len(runs)} run{'' if len(runs) == 1 else 's'} found, {int(runs.included.sum())} analysed, "
        f"{int((~runs.included).sum())} listed under Problems"
        + (f", as are {len(analysis.missing)} job(s) of a sweep that left no run" if len(analysis.missing) else "")
    )
    print(f"report: {report}")
    return 0


def _check(args: argparse.Namespace) -> str | None:
    """The first argument error, worded with the value and the fix."""
    for sweep in args.sweep_dirs:
        if not sweep.exists():
            return (
                f"sweep directory {sweep} does not exist; pass the directory a sweep wrote "
                "(multirun/<date>/<time>, or the hydra.sweep.dir it was given)"
            )
        if not sweep.is_dir():
            return f"{sweep} is not a directory; pass the sweep directory that holds the runs"
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        return f"--out {args.out} is a file; give a directory (it is created when missing)"
    if not 0 < args.target_acc <= 1:
        return (
            f"--target-acc={args.target_acc:g} is not a fraction in (0, 1]; "
            f"accuracies are fractions, e.g. --target-acc 0.9"
        )
    return None


def _make_out(out: Path) -> str | None:
    """Create the output directory before the analysis runs; the error, worded with the value
    and the fix, when it cannot be created (it lies under a file, or is not writable) or
    exists but cannot be written into."""
    if out.exists() and not out.is_dir():  # the default out; _check answers for --out
        return (
            f"the output directory {out} is a file; move it away, or give --out a directory "
            "(it is created when missing)"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        under_file = next((p for p in out.parents if p.is_file()), None)
        why = f"{under_file} is a file" if under_file else exc.strerror or str(exc)
        return (
            f"cannot create the output directory {out}: {why}; "
            "give --out a directory that can be created"
        )
    try:  # mkdir is content with a directory that exists, writable or not
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-check-"):
            pass
    except OSError as exc:
        return (
            f"cannot write into the output directory {out}: {exc.strerror or exc}; "
            "give --out a directory you can write to"
        )
    return None
