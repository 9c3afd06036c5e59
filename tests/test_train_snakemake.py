"""The tiny family's smallest size trains for real through Snakemake: plan, data, train."""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.ci]


def test_smallest_tiny_size_trains_through_snakemake(tmp_path):
    target = "results/tiny/runs/d48-tpp5-s0/curve.parquet"
    cmd = [
        sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"),
        "--directory", str(tmp_path), "--cores", "2", target,
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-5000:]

    run_dir = tmp_path / "results/tiny/runs/d48-tpp5-s0"
    spec = json.loads((tmp_path / "results/tiny/plan/runs/d48-tpp5-s0.json").read_text())
    curve = pd.read_parquet(run_dir / "curve.parquet")
    assert len(curve) == spec["optim"]["steps"]
    assert curve.tokens.iloc[-1] == spec["optim"]["tokens"]
    assert curve.loss.iloc[-20:].mean() < curve.loss.iloc[:20].mean() - 1.0
    assert curve.lr.iloc[-1] < 0.02 * curve.lr.max()  # decayed to (nearly) zero
    log = (tmp_path / "results/tiny/logs/train/d48-tpp5-s0.log").read_text()
    assert "ETA" in log and "tokens/s" in log
    assert (tmp_path / "results/tiny/benchmarks/train/d48-tpp5-s0.tsv").is_file()

    again = subprocess.run([*cmd, "-n"], capture_output=True, text=True, timeout=300)
    assert "Nothing to be done" in again.stdout + again.stderr
