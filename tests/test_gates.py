"""Family statistics and collapse gates on synthetic families with a known universal curve."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from synthetic import synthetic_family

from collapse import analysis as A
from collapse.gates import GateFailed, GatePolicy, blocks, calibrate_threshold, require_passed
from collapse.reference import reference_curve

SIZES = {"s1": 3.4, "s2": 3.1, "s4": 2.8, "s8": 2.5}  # final losses; s1, s2 are the reference
UNRESCALED_TAU = {"s1": 0.2, "s2": 0.1, "s4": 0.05, "s8": 0.025}  # lambda kept, tau falls


def _analyse(df: pd.DataFrame, policy: GatePolicy | None = None):
    matrix = A.load_matrix(df)
    ref_rows = matrix.meta["size"].isin(["s1", "s2"]).to_numpy()
    reference = reference_curve(matrix.select(ref_rows))
    verdicts, residual = A.gate_matrix(matrix, reference, policy or GatePolicy())
    return matrix, reference, {v.run: v for v in verdicts}, residual


def test_exact_collapse_is_supercollapse_and_passes_every_gate():
    df = synthetic_family(SIZES, noise_rel=0.0, wiggle_rel=0.0, seed_spread_rel=0.01)
    matrix, reference, verdicts, _ = _analyse(df)
    stats = A.collapse_statistics(matrix)
    assert stats.score < 1e-9 and stats.supercollapse is True
    assert all(v.passed for v in verdicts.values())
    assert max(v.max_abs_residual for v in verdicts.values()) < 1e-9
    assert verdicts["s8_s0"].threshold == GatePolicy().floor  # no seed noise: the floor


def test_noisy_collapse_is_supercollapse_and_clean_seeds_pass():
    df = synthetic_family(SIZES, seeds=5, noise_rel=0.01, wiggle_rel=0.001, rng_seed=1)
    matrix, _, verdicts, _ = _analyse(df)
    stats = A.collapse_statistics(matrix)
    assert stats.supercollapse is True and stats.delta_over_sigma < 0.5
    assert stats.score < 0.005
    assert set(stats.sigma) == set(SIZES) and stats.excluded == []
    failed = [run for run, v in verdicts.items() if not v.passed]
    assert failed == [], [verdicts[r].message for r in failed]


def test_unrescaled_tau_family_does_not_collapse_and_its_large_sizes_fail():
    collapsing = synthetic_family(SIZES, seed_spread_rel=0.005, rng_seed=2)
    broken = synthetic_family(SIZES, tau=UNRESCALED_TAU, seed_spread_rel=0.005, rng_seed=2)
    good = A.collapse_statistics(A.load_matrix(collapsing))
    bad = A.collapse_statistics(A.load_matrix(broken))
    assert good.supercollapse is True and bad.supercollapse is False
    assert bad.score > 3 * good.score and bad.delta_over_sigma > 1
    _, _, verdicts, _ = _analyse(broken)
    assert all(not verdicts[f"s8_s{s}"].passed for s in range(3))
    assert "diverged" in verdicts["s8_s0"].message


def _inject(df: pd.DataFrame, run: str, kind: str, at: float) -> pd.DataFrame:
    df = df.copy()
    rows = (df["run"] == run).to_numpy()
    t = (df["step"] / df["steps"]).to_numpy()
    after = rows & (t >= at)
    loss = df["loss"].to_numpy().copy()
    if kind == "loss_bias":  # the paper's failure: a loss kernel going wrong after a restart
        loss[after] *= 1.04
    elif kind == "lr_spike":  # a spike that training recovers from
        loss[after] *= 1 + 0.10 * np.exp(-(t[after] - at) / 0.05)
    elif kind == "data_repeat":  # repeated data: training loss falls faster than it should
        loss[after] *= 1 - 0.25 * (t[after] - at)
    elif kind == "nan_loss":
        loss[after] = np.nan
    df["loss"] = loss
    return df


@pytest.mark.parametrize("kind", ["loss_bias", "lr_spike", "data_repeat", "nan_loss"])
@pytest.mark.parametrize("at", [0.55, 0.7])
def test_faults_are_caught_after_they_start_and_not_before(kind, at):
    clean = synthetic_family(SIZES, noise_rel=0.005, wiggle_rel=0.001, rng_seed=3)
    df = _inject(clean, "s8_s1", kind, at)
    _, _, verdicts, residual = _analyse(df)
    faulty = verdicts["s8_s1"]
    assert not faulty.passed, faulty.message
    assert at - 1e-9 <= faulty.first_crossing_t_hat <= at + 0.15, faulty.message
    assert f"{faulty.first_crossing_t_hat:.3f}" in faulty.message
    others = [v for run, v in verdicts.items() if run != "s8_s1"]
    assert all(v.passed for v in others), [v.message for v in others if not v.passed]
    grid = A.C.default_grid()
    before = residual[list(verdicts).index("s8_s1"), (grid >= 0.2) & (grid < at)]
    assert np.abs(before).max() < faulty.threshold  # nothing visible before the fault


def test_policy_overrides_threshold_enforcement_and_verdict_json(tmp_path):
    df = _inject(synthetic_family(SIZES, rng_seed=4), "s4_s0", "loss_bias", 0.6)
    _, reference, verdicts, _ = _analyse(df, GatePolicy(enforce=False))
    verdict = verdicts["s4_s0"]
    assert verdict.status == "overridden" and not verdict.passed
    assert "not enforced" in verdict.message
    path = verdict.write_json(tmp_path / "s4_s0.json")
    require_passed(path)  # overridden: does not block
    fields = json.loads(path.read_text())
    for key in (
        "run",
        "passed",
        "max_abs_residual",
        "at_t_hat",
        "threshold",
        "first_crossing_t_hat",
        "window",
        "reference_sizes",
        "plot",
        "message",
    ):
        assert key in fields
    _, _, enforced, _ = _analyse(df)
    with pytest.raises(GateFailed, match="s4_s0: diverged"):
        require_passed(enforced["s4_s0"].write_json(tmp_path / "enforced.json"))
    threshold, basis = calibrate_threshold(reference, GatePolicy(threshold=0.2))
    assert threshold == 0.2 and "fixed" in basis
    _, _, loose, _ = _analyse(df, GatePolicy(threshold=0.2))
    assert loose["s4_s0"].passed


def _threshold_oracle(matrix, k_sigma: float) -> float:
    """k_sigma x the largest pooled seed std of the early-aligned s1, s2 runs over t_hat >= 0.2.

    Plain numpy: ell_ref is the mean of L / L(T); each run's L(T) is exp(mean(log L - log
    ell_ref)) over t_hat [0.25, 0.5]; the seed std is pooled over the two sizes (2 dof each).
    """
    grid, loss = matrix.grid, matrix.loss
    sizes = matrix.meta["size"].to_numpy()
    rows = np.isin(sizes, ["s1", "s2"])
    ref = np.mean(loss[rows] / loss[rows, -1:], axis=0)
    cols = (grid >= 0.25) & (grid <= 0.5)
    final = np.exp(np.mean(np.log(loss[rows][:, cols]) - np.log(ref[cols]), axis=1))
    aligned, groups = loss[rows] / final[:, None], sizes[rows]
    var = [aligned[groups == g].var(axis=0, ddof=1) for g in ("s1", "s2")]
    seed_std = np.sqrt((2 * var[0] + 2 * var[1]) / 4)
    return k_sigma * seed_std[grid >= 0.2].max()


def test_calibrated_threshold_scales_with_reference_seed_noise():
    """Three times the seed wiggle, about three times the threshold; each exactly 4 x seed std."""
    quiet = synthetic_family(SIZES, noise_rel=0.002, wiggle_rel=0.002, rng_seed=5)
    loud = synthetic_family(SIZES, noise_rel=0.002, wiggle_rel=0.006, rng_seed=5)
    policy = GatePolicy(floor=0.0)
    thresholds = []
    for family in (quiet, loud):
        matrix, reference, _, _ = _analyse(family)
        threshold = calibrate_threshold(reference, policy)[0]
        assert threshold == pytest.approx(_threshold_oracle(matrix, 4.0), rel=1e-9)
        thresholds.append(threshold)
    t_quiet, t_loud = thresholds
    assert 2 < t_loud / t_quiet < 4.5


def test_partial_run_is_undetermined_neither_passed_nor_failed():
    df = synthetic_family(SIZES, rng_seed=6)
    df = df[~((df["run"] == "s8_s0") & (df["step"] > 800))]  # stopped at t_hat 0.4
    _, _, verdicts, _ = _analyse(df)
    verdict = verdicts["s8_s0"]
    assert verdict.status == "undetermined" and not verdict.passed and not blocks(verdict)
    stats = A.collapse_statistics(A.load_matrix(df))
    assert stats.excluded == ["s8_s0"]


def test_sizes_without_seeds_leave_supercollapse_undetermined():
    stats = A.collapse_statistics(A.load_matrix(synthetic_family(SIZES, seeds=1)))
    assert stats.supercollapse is None and stats.sigma == {} and stats.score < 0.01
