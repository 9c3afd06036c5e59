"""A small size trains for real through Snakemake: plan, data, train. tiny_tpp5's d48 (0.7M
tokens) rather than tiny's d96 (3.2M tokens), so that CI spends its minutes on the end-to-end family
test instead."""

import json

import pandas as pd
import pytest
from workflow_cli import run_snakemake

# slow only (67 s): CI trains every size through Snakemake in tests/test_e2e.py
pytestmark = pytest.mark.slow
CONFIG = ("--config", "family=experiments/tiny_tpp5")


def test_a_small_size_trains_through_snakemake(tmp_path):
    target = "results/tiny_tpp5/runs/d48-tpp5-s0/curve.parquet"
    run_snakemake(tmp_path, target, *CONFIG, timeout=1200)

    run_dir = tmp_path / "results/tiny_tpp5/runs/d48-tpp5-s0"
    spec = json.loads((tmp_path / "results/tiny_tpp5/plan/runs/d48-tpp5-s0.json").read_text())
    curve = pd.read_parquet(run_dir / "curve.parquet")
    assert len(curve) == spec["optim"]["steps"]
    assert curve.tokens.iloc[-1] == spec["optim"]["tokens"]
    assert curve.loss.iloc[-20:].mean() < curve.loss.iloc[:20].mean() - 1.0
    assert curve.lr.iloc[-1] < 0.02 * curve.lr.max()  # decayed to (nearly) zero
    log = (tmp_path / "results/tiny_tpp5/logs/train/d48-tpp5-s0.log").read_text()
    assert "ETA" in log and "tokens/s" in log
    assert (tmp_path / "results/tiny_tpp5/benchmarks/train/d48-tpp5-s0.tsv").is_file()

    again = run_snakemake(tmp_path, target, "-n", *CONFIG, timeout=300)
    assert "Nothing to be done" in again.stdout + again.stderr
    meta = json.loads((run_dir / "meta.json").read_text())

    # An edit that changes other runs' specs re-plans, but does not retrain this run.
    others = run_snakemake(
        tmp_path, target, "-n", *CONFIG, "overrides=family.contrast=null", timeout=300
    )
    assert "rule plan:" in others.stdout and "rule train:" not in others.stdout, others.stdout

    # An edit that changes its spec retrains it in the same call (Snakemake 9.27 did not, while
    # one plan job wrote every spec and training took its spec as an ancient input).
    edited = (*CONFIG, "overrides=family.tau=[0.3]")
    run_snakemake(tmp_path, target, *edited, timeout=1200)
    retrained = json.loads((run_dir / "meta.json").read_text())
    spec = json.loads((tmp_path / "results/tiny_tpp5/plan/runs/d48-tpp5-s0.json").read_text())
    assert spec["optim"]["tau"] == pytest.approx(0.3)
    assert retrained["spec_hash"] != meta["spec_hash"]  # trained from the new spec, from step 1
    assert retrained["restarts"] == [] and retrained["steps_done"] == spec["optim"]["steps"]
    again = run_snakemake(tmp_path, target, "-n", *edited, timeout=300)
    assert "Nothing to be done" in again.stdout + again.stderr
