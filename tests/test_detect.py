"""The fault-detection experiment's detectors, on synthetic curves with a known fault."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from synthetic import synthetic_family
from test_train_support import tiny_spec

from collapse import analysis as A
from collapse.config import DetectorSpec
from collapse.detect import collapse_alarm, outcome, rise_alarm, run_experiment, spike_alarm
from collapse.gates import GatePolicy
from collapse.reference import reference_curve
from collapse.runspec import FaultInjection

RNG = np.random.default_rng(0)


def _decreasing(n: int = 1000, noise: float = 0.01) -> np.ndarray:
    t = np.arange(1, n + 1) / n
    return 3.0 + 2.0 * (1 - t) ** 2 + noise * RNG.standard_normal(n)


def test_spike_detector_fires_at_a_spike_and_at_nan_only():
    loss = _decreasing()
    assert spike_alarm(loss, 128, 6.0).index is None
    spiked = loss.copy()
    spiked[600] += 1.0  # a real spike; the trend inside the window widens the std
    assert spike_alarm(spiked, 128, 6.0).index == 600
    broken = loss.copy()
    broken[700:] = np.nan
    alarm = spike_alarm(broken, 128, 6.0)
    assert alarm.index == 700 and alarm.detail == "non-finite loss"


def test_rise_detector_needs_a_sustained_rise_not_noise():
    loss = _decreasing()
    steps = np.arange(1, len(loss) + 1)
    assert rise_alarm(loss, steps, 100, 0.01).index is None
    rising = loss.copy()
    rising[600:] += np.linspace(0, 1.0, 400)  # faster than the trend falls: a real rise
    i = rise_alarm(rising, steps, 100, 0.01).index
    assert i is not None and 600 < i < 800


def test_outcomes():
    assert outcome(None, None) == "quiet" and outcome(0.3, None) == "false alarm"
    assert outcome(None, 0.55) == "missed" and outcome(0.6, 0.55) == "detected"
    assert outcome(0.4, 0.55) == "false alarm (before the fault)"


def _slow_fault_runs(tmp_path: Path) -> tuple[list, Path]:
    """Three seeds of one size against a reference of two smaller ones; seed 0 slowly falls
    behind from t_hat 0.55 (5 % by the end, no jump, no rise). Specs and their runs.csv."""
    sizes = {"s1": 3.4, "s2": 3.1, "s4": 2.8}
    family = synthetic_family(sizes, seeds=3, steps=1000, rng_seed=3)
    matrix = A.load_matrix(family[family["size"].isin(["s1", "s2"])])
    reference = reference_curve(matrix)
    ref_csv = tmp_path / "reference.csv"
    reference.to_frame().to_csv(ref_csv, index=False)

    specs = []
    for seed in range(3):
        rows = family[(family["size"] == "s4") & (family["seed"] == seed)].copy()
        fault = FaultInjection(name="clean")
        if seed == 0:  # the faulty twin of seed 0: 5 % behind by the end, no jump, no rise
            t = rows["step"].to_numpy() / 1000
            rows["loss"] = rows["loss"] * (1 + 0.05 * np.clip((t - 0.55) / 0.45, 0, None))
            fault = FaultInjection(kind="loss_kernel", at_fraction=0.55, name="slow")
        spec = tiny_spec(tmp_path / f"r{seed}", steps=1000, fault=fault)
        spec = spec.model_copy(
            update={
                "run": f"run{seed}",
                "size": "s4",
                "run_dir": str(tmp_path / f"run{seed}"),
                "monitor": spec.monitor.model_copy(update={"reference_csv": str(ref_csv)}),
                "optim": spec.optim.model_copy(update={"seed": seed}),
            }
        )
        Path(spec.run_dir).mkdir(parents=True)
        curve = pd.DataFrame(
            {"run": spec.run, "step": rows["step"], "t_hat": rows["step"] / 1000,
             "loss": rows["loss"]}
        )  # fmt: skip
        curve.to_parquet(Path(spec.run_dir) / "curve.parquet")
        specs.append(spec)

    runs_csv = tmp_path / "runs.csv"
    pd.DataFrame(
        {"run": [s.run for s in specs], "size": "s4", "params": 4e6, "seed": [0, 1, 2],
         "tpp": 20.0, "tau": 0.2, "steps": 1000}
    ).to_csv(runs_csv, index=False)  # fmt: skip
    return specs, runs_csv


def test_experiment_catches_a_slow_fault_the_raw_loss_detectors_miss(tmp_path: Path):
    """A run that slowly falls behind from t_hat 0.55 (the paper's failure) is caught by the
    collapse monitor and by neither raw-loss detector; the clean seeds raise no alarm."""
    specs, runs_csv = _slow_fault_runs(tmp_path)
    out = tmp_path / "faults"
    detections = run_experiment(specs, GatePolicy(), DetectorSpec(), out, runs_csv)
    got = detections.set_index(["fault", "detector"])
    assert got.loc[("slow", "collapse"), "outcome"] == "detected"
    at = got.loc[("slow", "collapse"), "alarm_t_hat"]
    assert 0.55 <= at <= 1.0 and math.isclose(got.loc[("slow", "collapse"), "fault_t_hat"], 0.55)
    assert got.loc[("slow", "spike"), "outcome"] == "missed"
    assert got.loc[("slow", "rise"), "outcome"] == "missed"
    own = got.loc[("slow", "collapse_own_size")]  # against seeds 1, 2 of its own size
    assert own["outcome"] == "detected" and own["alarm_t_hat"] >= 0.55
    clean = detections[detections["fault"] == "clean"]
    assert len(clean) == 8, clean
    assert set(clean[clean.detector == "collapse_own_size"].outcome) == {"in reference"}
    assert (clean[clean.detector != "collapse_own_size"].outcome == "quiet").all(), clean
    for name in ("detections.csv", "detections.md", "detections.png", "detections.pdf"):
        assert (out / name).stat().st_size > 0
    summary = (out / "detections.md").read_text()
    assert "collapse: 1 of 1 faults detected; 0 false alarm(s)" in summary
    # the collapse monitors report how close each run came to the threshold; the raw-loss
    # detectors have no residual
    slow, quiet = got.loc[("slow", "collapse")], clean[clean.detector == "collapse"]
    assert slow["peak_residual"] > slow["threshold"] > 0
    assert (quiet["peak_residual"] < quiet["threshold"]).all() and len(quiet) == 2
    assert got.loc[("slow", "spike"), ["peak_residual", "threshold"]].isna().all()
    lo, hi = quiet["peak_residual"].min(), quiet["peak_residual"].max()
    assert f"threshold {slow['threshold']:.3f}; clean runs' peak |r| {lo:.3f}-{hi:.3f}" in summary
    assert f"peak {slow['peak_residual']:.3f})" in summary


def test_the_monitor_alarms_at_the_first_step_past_the_threshold_when_checked_every_step(
    tmp_path: Path,
):
    """Checked every step (the default, as the raw-loss rules are), the replayed monitor alarms
    where its residual first crosses the threshold; checked every 10 rows, at the next check."""
    specs, _ = _slow_fault_runs(tmp_path)
    faulty = specs[0]
    curve = pd.read_parquet(Path(faulty.run_dir) / "curve.parquet")
    assert DetectorSpec().monitor_every_steps == 1
    every_step, monitor = collapse_alarm(faulty, curve, GatePolicy(), 1, tmp_path / "a.jsonl")
    t, r = monitor.residuals()
    inside = (t >= GatePolicy().window[0]) & np.isfinite(r)
    crossing = int(np.flatnonzero(inside & (np.abs(r) > monitor.threshold))[0])
    assert every_step.index == crossing and t[crossing] > 0.55
    coarse, _ = collapse_alarm(faulty, curve, GatePolicy(), 10, tmp_path / "b.jsonl")
    assert crossing < coarse.index < crossing + 10 and (coarse.index + 1) % 10 == 0
