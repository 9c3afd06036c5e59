"""Sweep metrics: a synthetic weight-decay sweep whose curves cross, and the report files.

docs/method.md §5: the variant ahead early ("current best") is not the one that ends best when
the curves cross; the collapse prediction, with a reference per tau (Eq. 4, b = b_c tau^b_e),
must still select the winner after 10-30 % of training.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from collapse.predict import METHODS, predict_final_loss
from collapse.surrogate import eq4_ell
from collapse.sweep import METRIC_COLUMNS, sweep_metrics, truth_from_predictions, write_sweep_report

STEPS = 1000
T_HAT = np.arange(1, STEPS + 1) / STEPS
TAUS = (0.05, 0.1, 0.2, 0.4)
FRACTIONS = (0.1, 0.2, 0.3)
NOISE_REL = 0.01


def b_of_tau(tau: float) -> float:
    """Longer AdamW timescale, larger late drop: b = b_c tau^b_e (docs/method.md §5)."""
    return 0.06 * (tau / 0.05) ** 0.6


def final_loss_of_tau(tau: float) -> float:
    """U-shaped in log tau, best at tau = 0.2."""
    return 3.0 + 0.06 * np.log2(tau / 0.2) ** 2


def smoothed(loss: np.ndarray) -> np.ndarray:
    return pd.Series(loss).rolling(20, min_periods=1).mean().to_numpy()


@pytest.fixture(scope="module")
def sweep() -> tuple[pd.DataFrame, pd.DataFrame]:
    """Predictions (3 methods x 3 fractions x 4 variants) and the variants' true final losses."""
    rows, truth = [], []
    for i, tau in enumerate(TAUS):
        run = f"tau{tau}"
        shape = eq4_ell(T_HAT, b_of_tau(tau), 1.0)
        ell = smoothed(shape) / smoothed(shape)[-1]  # the reference lags like a smoothed run
        rng = np.random.default_rng(i)
        curve = smoothed(final_loss_of_tau(tau) * shape * (1 + NOISE_REL * rng.normal(size=STEPS)))
        truth.append({"run": run, "true_final_loss": curve[-1]})
        for fraction in FRACTIONS:
            keep = np.less_equal(T_HAT, fraction + 1e-12)
            for method in METHODS:
                p = predict_final_loss(T_HAT[keep], curve[keep], T_HAT, ell, method=method)
                rows.append(
                    {"run": run, "fraction": fraction, "method": method}
                    | {"predicted_final_loss": p.final_loss}
                )
    return pd.DataFrame(rows), pd.DataFrame(truth)


def test_curves_cross_so_current_best_picks_wrong(sweep):
    metrics = sweep_metrics(*sweep).set_index(["method", "fraction"])
    for fraction in FRACTIONS:
        collapse, current = metrics.loc[("collapse", fraction)], metrics.loc[("current", fraction)]
        assert collapse["best_run"] == "tau0.2"
        assert collapse["selected_run"] == "tau0.2" and collapse["found_best"]
        assert collapse["regret_loss"] == 0.0
        assert current["selected_run"] == "tau0.1"
        assert current["regret_loss"] > 0.03
        assert collapse["mean_abs_error_pct"] < 0.5 < 10 < current["mean_abs_error_pct"]
        assert metrics.loc[("random", fraction), "regret_loss"] > 0
        assert collapse["compute_fraction_of_full_sweep"] == pytest.approx(fraction)
        assert collapse["compute_fraction_incl_finishing_selected"] == pytest.approx(
            fraction + (1 - fraction) / len(TAUS)
        )


def test_metrics_by_hand():
    predictions = pd.DataFrame(
        {
            "run": ["a", "b", "a", "b"],
            "fraction": [0.3] * 4,
            "method": ["collapse", "collapse", "current", "current"],
            "predicted_final_loss": [2.2, 2.0, 2.5, 2.6],
        }
    )
    truth = pd.DataFrame({"run": ["a", "b"], "true_final_loss": [2.0, 2.1], "flops": [1.0, 3.0]})
    metrics = sweep_metrics(predictions, truth)
    assert list(metrics.columns) == list(METRIC_COLUMNS)
    metrics = metrics.set_index("method")
    assert metrics.loc["collapse", "mean_abs_error_pct"] == pytest.approx(50 * (0.1 + 0.1 / 2.1))
    assert metrics.loc["collapse", "selected_run"] == "b"
    assert metrics.loc["collapse", "regret_loss"] == pytest.approx(0.1)
    assert metrics.loc["current", "regret_loss"] == 0.0
    assert metrics.loc["random", "regret_loss"] == pytest.approx(0.05)
    # finishing b (3 of 4 flops) after 30 % of everything
    assert metrics.loc["collapse", "compute_fraction_incl_finishing_selected"] == pytest.approx(
        0.3 + 0.7 * 3 / 4
    )


def test_missing_truth_leaves_regret_undefined():
    predictions = pd.DataFrame(
        {"run": ["a", "b"], "fraction": 0.2, "method": "collapse", "predicted_final_loss": [2, 3]}
    )
    metrics = sweep_metrics(predictions, pd.DataFrame({"run": ["a"], "true_final_loss": [2.0]}))
    row = metrics.set_index("method").loc["collapse"]
    assert row["mean_abs_error_pct"] == 0.0
    assert row["selected_run"] == "a"
    assert np.isnan(row["regret_loss"]) and row["found_best"] is None


def test_sweeps_are_kept_apart_and_bad_columns_named():
    predictions = pd.DataFrame(
        {
            "sweep": ["lr", "lr", "wd", "wd"],
            "run": ["a", "b", "c", "d"],
            "fraction": 0.3,
            "method": "collapse",
            "predicted_final_loss": [2.0, 2.1, 3.0, 2.9],
            "true_final_loss": [2.0, 2.1, 3.0, 2.9],
        }
    )
    metrics = sweep_metrics(predictions, truth_from_predictions(predictions))
    chosen = metrics[metrics["method"] == "collapse"].set_index("sweep")["selected_run"]
    assert chosen.to_dict() == {"lr": "a", "wd": "d"}
    with pytest.raises(ValueError, match="predicted_final_loss"):
        sweep_metrics(predictions.drop(columns="predicted_final_loss"), predictions)


def test_report_files(sweep, tmp_path):
    metrics = sweep_metrics(*sweep)
    paths = write_sweep_report(metrics, tmp_path / "report")
    assert [p.name for p in paths] == [f"sweep_metrics.{e}" for e in ("csv", "md", "png", "pdf")]
    assert pd.read_csv(paths[0]).shape == metrics.shape
    table = paths[1].read_text().splitlines()
    assert table[0].startswith("| sweep | method | trained (%)")
    assert len(table) == 2 + len(metrics)
    assert paths[2].read_bytes()[:4] == b"\x89PNG" and paths[3].read_bytes()[:4] == b"%PDF"
