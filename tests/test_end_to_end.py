"""A real tiny sweep with train.py, analysed by multirun_analysis, numbers checked."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest

from conftest import QUICK, REPO, output, read_rows, run_train

pytestmark = pytest.mark.slow


def test_real_sweep_becomes_a_report_with_its_real_numbers(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_train(*QUICK, "distributed.num_gpus=1,2", "optim.lr=0.02,0.05",
                     f"hydra.sweep.dir={sweep}", "-m", timeout=400)
    assert proc.returncode == 0, output(proc)

    analysis = subprocess.run([sys.executable, "-m", "multirun_analysis", str(sweep)],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
    assert analysis.returncode == 0, output(analysis)
    out = sweep / "analysis"
    for name in ("runs.csv", "scaling.csv", "accuracy.csv", "runs.md", "scaling.md",
                 "accuracy.md", "report.md", "report.html"):
        assert (out / name).stat().st_size > 0, name
    assert "data:image/png;base64" in (out / "report.html").read_text()

    with (out / "runs.csv").open() as f:
        runs = list(csv.DictReader(f))
    assert len(runs) == 4 and {r["status"] for r in runs} == {"completed"}

    # Speedups in scaling.csv are the ratio of the runs' own epoch-2 throughputs.
    throughput = {}
    for run_dir in sorted(p.parent for p in sweep.rglob("results.csv")):
        last = read_rows(run_dir)[-1]
        throughput[(last["lr"], last["world_size"])] = float(last["images_per_sec"])
    with (out / "scaling.csv").open() as f:
        scaling = [r for r in csv.DictReader(f) if r["scaling"] == "weak"]
    assert len(scaling) == 4
    for row in scaling:
        lr, ws = f"{float(row['lr']):g}", str(int(float(row["world_size"])))
        expected = throughput[(lr, ws)] / throughput[(lr, "1")]
        assert float(row["speedup"]) == pytest.approx(expected, rel=1e-3)
        assert float(row["efficiency"]) == pytest.approx(expected / int(ws), rel=1e-3)
