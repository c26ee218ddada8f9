"""`python -m multirun_analysis` as a user runs it: in a subprocess, exit status and messages."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from analysis_files import new_sweep

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args, code=None):
    """Run the command (or `python -c code`) from the repository root; return the finished process."""
    command = (
        [sys.executable, "-c", code, *args]
        if code
        else [sys.executable, "-m", "multirun_analysis", *args]
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_help():
    result = run_cli("--help")
    assert result.returncode == 0
    assert (
        "SWEEP_DIR" in result.stdout
        and "--target-acc" in result.stdout
        and "--out" in result.stdout
    )


def test_missing_directory_is_a_clear_error(tmp_path):
    result = run_cli(str(tmp_path / "nope"))
    assert result.returncode == 2
    assert (
        result.stderr
        == f"multirun_analysis: error: sweep directory {tmp_path / 'nope'} does not exist; pass the "
        "directory a sweep wrote (multirun/<date>/<time>, or the hydra.sweep.dir it was given)\n"
    )


def test_directory_without_runs_is_a_clear_error(tmp_path):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    result = run_cli(str(tmp_path / "empty"))
    assert result.returncode == 1
    assert result.stderr == (
        f"multirun_analysis: error: no runs found under {tmp_path / 'empty'} "
        "(a run is a directory holding results.csv or run.json)\n"
    )
    assert result.stderr.count("\n") == 1
    assert not (tmp_path / "empty" / "analysis").exists()


@pytest.mark.parametrize("value,says", [
    ("90", "error: --target-acc=90 is not a fraction in (0, 1]; accuracies are fractions, e.g. --target-acc 0.9"),
    # argparse said only "argument --target-acc: invalid float value: 'abc'"
    ("abc", "error: argument --target-acc: 'abc' is not a number; accuracies are fractions in (0, 1], "
            "e.g. --target-acc 0.9"),
])
def test_target_acc_must_be_a_fraction(tmp_path, value, says):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("a")
    result = run_cli(str(sweep_dir), "--target-acc", value)
    assert result.returncode == 2
    assert says in result.stderr, result.stderr


def test_out_must_be_a_directory(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("a")
    (tmp_path / "report.csv").write_text("mine\n")
    result = run_cli(str(sweep_dir), "--out", str(tmp_path / "report.csv"))
    assert result.returncode == 2
    assert result.stderr == (f"multirun_analysis: error: --out {tmp_path / 'report.csv'} is a file; "
                             "give a directory (it is created when missing)\n")
    assert (tmp_path / "report.csv").read_text() == "mine\n"


@pytest.mark.parametrize("below", ["sub", "sub/deeper"])
def test_out_below_a_file_is_a_clear_error(tmp_path, below):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("a")
    (tmp_path / "report.csv").write_text("mine\n")
    out = tmp_path / "report.csv" / below
    result = run_cli(str(sweep_dir), "--out", str(out))
    assert result.returncode == 2
    assert result.stderr == (
        f"multirun_analysis: error: cannot create the output directory {out}: "
        f"{tmp_path / 'report.csv'} is a file; give --out a directory that can be created\n"
    )
    assert (tmp_path / "report.csv").read_text() == "mine\n"


@pytest.mark.parametrize("where", ["sweep", "out"])
def test_an_empty_path_is_a_clear_error(tmp_path, where, capsys):
    """`--out "$OUT"` with OUT unset passed "", which Path reads as ".": the report went into
    the current directory (an empty SWEEP_DIR analysed every run below it). Checked through
    parse_args, in this process: before the fix a subprocess would have written into the
    repository it runs from."""
    from multirun_analysis.cli import parse_args

    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("a")
    argv = ["", "--out", str(tmp_path / "out")] if where == "sweep" else [str(sweep_dir), "--out", ""]
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    name = "SWEEP_DIR" if where == "sweep" else "--out"
    assert f"argument {name}: an empty path (an unset shell variable?); give a directory" in capsys.readouterr().err


@pytest.fixture
def two_sweeps(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    for world_size, throughput in [(1, 1000.0), (2, 1800.0)]:
        write_run(f"a/{world_size}", world_size=world_size, images_per_sec=(throughput,) * 3)
    write_run("b/0", world_size=4, images_per_sec=(3000.0,) * 3)
    return sweep_dir / "a", sweep_dir / "b"


def test_report_is_written_to_the_default_out_without_importing_torch(two_sweeps):
    a, b = two_sweeps
    code = (
        "import sys\n"
        "from multirun_analysis.cli import main\n"
        "status = main(sys.argv[1:])\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
        "sys.exit(status)\n"
    )
    result = run_cli(str(a), str(b), code=code)
    assert result.returncode == 0, result.stderr
    assert "torch imported: False" in result.stdout
    assert "3 runs found, 3 analysed, 0 listed under Problems" in result.stdout
    html = (a / "analysis" / "report.html").read_text()
    assert "data:image/png;base64," in html
    assert "efficiency 0.75" in html  # world sizes 1 and 2 from a, 4 from b: one group


@pytest.mark.parametrize("value", ["", "inf"])
def test_a_run_without_a_usable_throughput_is_listed_and_the_report_written(two_sweeps, value):
    a, b = two_sweeps
    results = a / "2" / "results.csv"
    lines = results.read_text().splitlines()
    column = lines[0].split(",").index("images_per_sec")
    cells = lines[1].split(",")
    cells[column] = value
    results.write_text("\n".join([lines[0], ",".join(cells), *lines[2:]]) + "\n")
    result = run_cli(str(a), str(b))
    assert result.returncode == 0, result.stderr
    assert "3 runs found, 2 analysed, 1 listed under Problems" in result.stdout
    assert (a / "analysis" / "report.html").is_file()


def test_out_and_target_acc_options(two_sweeps, tmp_path):
    a, _ = two_sweeps
    result = run_cli(str(a), "--out", str(tmp_path / "study"), "--target-acc", "0.6")
    assert result.returncode == 0, result.stderr
    assert f"report: {tmp_path / 'study' / 'report.html'}" in result.stdout
    accuracy = (tmp_path / "study" / "accuracy.csv").read_text()
    assert "target_acc" in accuracy.splitlines()[0]
    assert not (a / "analysis").exists()


def test_a_directory_without_runs_beside_others_is_a_warning(two_sweeps, tmp_path):
    a, _ = two_sweeps
    (tmp_path / "empty").mkdir()
    result = run_cli(str(tmp_path / "empty"), str(a))
    assert result.returncode == 0, result.stderr
    assert result.stderr == (
        f"multirun_analysis: warning: no runs found under {tmp_path / 'empty'}; "
        "analysing the other directories\n"
    )
    assert "2 runs found, 2 analysed" in result.stdout
    # the report goes beside the runs, not into the empty directory named first
    assert (a / "analysis" / "report.html").exists() and not (tmp_path / "empty" / "analysis").exists()
    assert "empty" not in (a / "analysis" / "report.md").read_text(), "it contributed nothing"


def test_one_run_analysed_by_itself_is_named_by_its_directory(two_sweeps, tmp_path):
    a, _ = two_sweeps
    result = run_cli(str(a / "2"), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    assert "1 run found, 1 analysed" in result.stdout  # not "1 runs"
    assert "| 2 | completed |" in (tmp_path / "out" / "runs.md").read_text()  # not "."


def test_directories_that_all_lack_runs_are_an_error(tmp_path):
    for name in ("empty1", "empty2"):
        (tmp_path / name).mkdir()
    result = run_cli(str(tmp_path / "empty1"), str(tmp_path / "empty2"))
    assert result.returncode == 1
    assert result.stderr.startswith(
        "multirun_analysis: error: no runs found under "
        f"{tmp_path / 'empty1'}, {tmp_path / 'empty2'} (a run is a directory holding results.csv or run.json)"
    )
    assert result.stderr.count("\n") == 1


def test_ctrl_c_ends_with_a_line_not_a_traceback(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    for world_size in (1, 2):
        write_run(f"ws{world_size}", world_size=world_size)
    proc = subprocess.Popen(
        [sys.executable, "-m", "multirun_analysis", str(sweep_dir)], cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )
    # While it loads pandas and matplotlib, as a user gives up on a slow start. Counted from
    # when Python handles SIGINT: 0.5 s from Popen came, on a loaded machine, before Python
    # had started (-2 and no line, as Ctrl-C gives any program then).
    while not _catches_sigint(proc.pid) and proc.poll() is None:
        time.sleep(0.01)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert stderr == "multirun_analysis: interrupted\n", stdout + stderr
    # 130, or death by SIGINT (which a shell reports as 130 too): CPython ends that way when
    # the interrupt passed through code a C module ran, though __main__ caught it
    assert proc.returncode in (130, -signal.SIGINT), stdout + stderr


def _catches_sigint(pid: int) -> bool:
    """Whether process `pid` has a handler for SIGINT (Linux's /proc/PID/status, SigCgt)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # it has ended
        return False
    caught = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught, 16) >> (signal.SIGINT - 1) & 1)


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nothing can be written into: mode 555, or for root (whom modes do not stop)
    the immutable attribute."""
    directory = tmp_path / "locked"
    directory.mkdir()
    if os.geteuid() != 0:
        directory.chmod(0o555)
        yield directory
        directory.chmod(0o755)
        return
    if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode != 0:
        pytest.skip("running as root without chattr +i: no directory is read-only")
    yield directory
    subprocess.run(["chattr", "-i", str(directory)], check=True)


def test_out_that_cannot_be_written_is_a_clear_error(tmp_path, read_only_dir):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("a")
    result = run_cli(str(sweep_dir), "--out", str(read_only_dir))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        f"multirun_analysis: error: cannot write into the output directory {read_only_dir}: "
    )
    assert result.stderr.endswith("; give --out a directory you can write to\n")
    assert result.stderr.count("\n") == 1 and not list(read_only_dir.iterdir())


def test_default_out_that_cannot_be_written_is_a_clear_error(read_only_dir):
    # the sweep's own analysis/ directory is the read-only one
    sweep_dir, write_run = new_sweep(read_only_dir.parent)
    write_run("a")
    (sweep_dir / "analysis").symlink_to(read_only_dir)
    result = run_cli(str(sweep_dir))
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        f"multirun_analysis: error: cannot write into the output directory {sweep_dir / 'analysis'}: "
    )
    assert result.stderr.endswith("; give --out a directory you can write to\n")


def test_an_output_that_cannot_be_written_is_a_line_not_a_traceback(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("a")
    (tmp_path / "out" / "report.md").mkdir(parents=True)  # in the way of the file
    result = run_cli(str(sweep_dir), "--out", str(tmp_path / "out"))
    assert result.returncode == 2
    assert result.stderr == (
        f"multirun_analysis: error: cannot write {tmp_path / 'out' / 'report.md'}: Is a directory; "
        "free the space or give --out a directory you can write to\n"
    )


def test_a_directory_given_twice_or_inside_another_is_named_once(two_sweeps):
    a, _ = two_sweeps
    result = run_cli(str(a), f"{a}/", str(a / "1"))
    assert result.returncode == 0, result.stderr
    assert "2 runs found" in result.stdout
    report = (a / "analysis" / "report.md").read_text()
    assert report.startswith("# Scaling report: a\n")
    assert f"Sweep: `{a}` ·" in report


def test_a_directory_inside_another_that_adds_runs_is_named(tmp_path):
    from multirun_analysis.discover import distinct_sweeps, find_run_dirs

    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("a/1")
    write_run("a/.old/2")  # hidden folders are not searched, so a/.old adds a run to a
    sweeps = [sweep_dir / "a", sweep_dir / "a" / ".old", sweep_dir / "a" / "1"]
    assert distinct_sweeps(sweeps, [find_run_dirs(s) for s in sweeps]) == sweeps[:2]


def test_default_out_that_is_a_file_is_a_clear_error(tmp_path):
    sweep_dir, write_run = new_sweep(tmp_path)
    write_run("a")
    (sweep_dir / "analysis").write_text("mine\n")
    result = run_cli(str(sweep_dir))
    assert result.returncode == 2
    assert result.stderr == (
        f"multirun_analysis: error: the output directory {sweep_dir / 'analysis'} is a file; "
        "move it away, or give --out a directory (it is created when missing)\n"
    )
    assert (sweep_dir / "analysis").read_text() == "mine\n"


def test_run_paths_in_the_outputs_do_not_depend_on_where_the_command_ran(two_sweeps):
    """Given `.` (or any relative path), runs.csv's path column, the report's Sweep line and
    the findings' run paths read `./6` and `.`: meaningless in a report opened later, from
    elsewhere. They are absolute."""
    a, _ = two_sweeps
    relative = os.path.relpath(a, REPO)  # run_cli runs from the repository root
    result = run_cli(relative)
    assert result.returncode == 0, result.stderr
    runs = (a / "analysis" / "runs.csv").read_text().splitlines()
    path = runs[0].split(",").index("path")
    assert sorted(line.split(",")[path] for line in runs[1:]) == [str(a / "1"), str(a / "2")]
    assert f"Sweep: `{a}` ·" in (a / "analysis" / "report.md").read_text()
