"""Fixtures that write hand-built sweep directories under tmp_path."""

import pytest
from analysis_files import run_rows, write_results, write_run_json


@pytest.fixture
def write_run(tmp_path):
    """Factory: write_run("sub/dir", status=..., **run_rows kwargs) -> the run directory."""

    def write(name, *, status="completed", error=None, run_json=True, **settings):
        directory = tmp_path / "sweep" / name
        rows = run_rows(**settings)
        write_results(directory, rows)
        if run_json:
            write_run_json(directory, status=status, error=error, rows=rows)
        return directory

    return write


@pytest.fixture
def sweep_dir(tmp_path):
    """The directory write_run writes below."""
    (tmp_path / "sweep").mkdir(exist_ok=True)
    return tmp_path / "sweep"
