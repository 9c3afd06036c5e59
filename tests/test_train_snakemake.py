"""A small size trains for real through Snakemake: plan, data, train. tiny_tpp5's d48 (the
default family's smallest size before stop 18, 0.7M tokens) rather than tiny's d96 (3.2M tokens),
so that CI spends its minutes on the end-to-end family test instead."""

import json

import pandas as pd
import pytest
from workflow_cli import run_snakemake

pytestmark = [pytest.mark.slow, pytest.mark.ci]
CONFIG = ("--config", "family=tiny_tpp5")


def test_a_small_size_trains_through_snakemake(tmp_path):
    target = "results/tiny-tpp5/runs/d48-tpp5-s0/curve.parquet"
    run_snakemake(tmp_path, target, *CONFIG, timeout=1200)

    run_dir = tmp_path / "results/tiny-tpp5/runs/d48-tpp5-s0"
    spec = json.loads((tmp_path / "results/tiny-tpp5/plan/runs/d48-tpp5-s0.json").read_text())
    curve = pd.read_parquet(run_dir / "curve.parquet")
    assert len(curve) == spec["optim"]["steps"]
    assert curve.tokens.iloc[-1] == spec["optim"]["tokens"]
    assert curve.loss.iloc[-20:].mean() < curve.loss.iloc[:20].mean() - 1.0
    assert curve.lr.iloc[-1] < 0.02 * curve.lr.max()  # decayed to (nearly) zero
    log = (tmp_path / "results/tiny-tpp5/logs/train/d48-tpp5-s0.log").read_text()
    assert "ETA" in log and "tokens/s" in log
    assert (tmp_path / "results/tiny-tpp5/benchmarks/train/d48-tpp5-s0.tsv").is_file()

    again = run_snakemake(tmp_path, target, "-n", *CONFIG, timeout=300)
    assert "Nothing to be done" in again.stdout + again.stderr
