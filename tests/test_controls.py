"""The controls audit: the AdamW rate a run applied against the one its reference's tau implies."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from collapse.controls import audit, expected_rate, reference_tau
from collapse.scaling import lr_at

STEPS, WARMUP, TAU, PEAK = 400, 40, 0.2, 0.01
LAMBDA = 1 / (PEAK * TAU * STEPS)  # tau = 1 / (eta * lambda * T)


def _curve(weight_decay: float = LAMBDA, lr_factor: dict[int, float] | None = None) -> pd.DataFrame:
    steps = np.arange(1, STEPS + 1)
    lr = np.array([lr_at(s - 1, peak=PEAK, warmup_steps=WARMUP, total_steps=STEPS) for s in steps])
    for step, factor in (lr_factor or {}).items():
        lr[step - 1] *= factor
    return pd.DataFrame({"step": steps, "lr": lr, "weight_decay": weight_decay})


def test_expected_rate_peaks_at_one_over_tau_t():
    rate = expected_rate(np.arange(1, STEPS + 1), WARMUP, STEPS, TAU)
    assert rate.max() == pytest.approx(1 / (TAU * STEPS)) and rate[0] == 0.0
    assert int(np.argmax(rate)) == WARMUP  # step WARMUP + 1 uses the peak LR


def test_a_clean_run_is_quiet_and_realizes_its_tau():
    checked = audit(_curve(), WARMUP, STEPS, TAU, 0.05)
    assert checked.index is None
    assert checked.realized_tau == pytest.approx(TAU) and checked.peak_deviation < 1e-9


def test_a_weight_decay_not_rescaled_fires_at_the_first_step_with_a_rate():
    """d48's lambda on d192 in the tiny family: tau 0.246 instead of 0.2 (1.23x)."""
    checked = audit(_curve(LAMBDA / 1.23), WARMUP, STEPS, TAU, 0.05)
    assert checked.index == 1  # step 2: step 1 has LR 0, so nothing to compare
    assert checked.realized_tau == pytest.approx(TAU * 1.23)
    assert "tau 0.246 realized" in checked.detail(np.arange(1, STEPS + 1))
    # within tolerance: quiet
    assert audit(_curve(LAMBDA / 1.03), WARMUP, STEPS, TAU, 0.05).index is None


def test_an_lr_spike_fires_at_its_first_step_and_leaves_the_realized_tau():
    spiked = _curve(lr_factor={s: 10.0 for s in range(220, 224)})
    checked = audit(spiked, WARMUP, STEPS, TAU, 0.05)
    assert checked.index == 219 and checked.ratio[219] == pytest.approx(10.0)
    assert checked.realized_tau == pytest.approx(TAU)  # the median ignores four steps


def test_a_curve_without_the_weight_decay_column_cannot_be_audited():
    checked = audit(_curve().drop(columns="weight_decay"), WARMUP, STEPS, TAU, 0.05)
    assert checked.index is None and checked.realized_tau is None
    assert "not logged" in checked.detail(np.arange(1, STEPS + 1))


def test_reference_tau_comes_from_the_reference_runs_in_the_plan(tmp_path: Path):
    (tmp_path / "reference.csv").write_text("t_hat,ell\n")
    (tmp_path / "reference.json").write_text(json.dumps({"runs": ["a", "b"]}))
    runs = tmp_path / "runs.csv"
    pd.DataFrame({"run": ["a", "b", "c"], "tau": [0.2, 0.2, 0.4]}).to_csv(runs, index=False)
    assert reference_tau(tmp_path / "reference.csv", runs) == 0.2
    assert reference_tau(tmp_path / "reference.csv", None) is None
    # the reference stage records its runs' controls: no runs.csv needed
    (tmp_path / "reference.json").write_text(json.dumps({"runs": [], "controls": {"tau": 0.3}}))
    assert reference_tau(tmp_path / "reference.csv") == 0.3
    (tmp_path / "reference.json").unlink()
    assert reference_tau(tmp_path / "reference.csv", runs) is None
