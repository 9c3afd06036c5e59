"""Final-loss prediction from partial curves on synthetic families of known truth.

Every curve is an Eq. 4 surrogate shape under linear warmup + decay to zero (docs/method.md §5)
times a per-run final loss, plus batch noise: the late D2Z drop is what makes "current" and
naive power laws overestimate, and what the collapse method must get right.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from collapse.predict import (
    METHODS,
    Prediction,
    alignment_window,
    predict_final_loss,
)
from collapse.surrogate import eq4_ell

STEPS = 1000
T_HAT = np.arange(1, STEPS + 1) / STEPS
SHAPE_B, SHAPE_Q = 0.12, 1.0  # ell(0.3) ~ 1.14, like the tiny family's curves
NOISE_REL = 0.02  # per-step relative batch noise
SMOOTH_STEPS = 20  # trailing window: 2 % of the run


def smoothed(loss: np.ndarray) -> np.ndarray:
    """Trailing moving average: causal, so cutting after smoothing equals smoothing the cut."""
    return pd.Series(loss).rolling(SMOOTH_STEPS, min_periods=1).mean().to_numpy()


def noisy_run(final_loss: float, seed: int, b: float = SHAPE_B) -> np.ndarray:
    rng = np.random.default_rng(seed)
    clean = final_loss * eq4_ell(T_HAT, b, SHAPE_Q)
    return smoothed(clean * (1 + NOISE_REL * rng.standard_normal(STEPS)))


@pytest.fixture(scope="module")
def reference() -> tuple[np.ndarray, np.ndarray]:
    """Mean normalized curve of three noisy small runs."""
    curves = [noisy_run(loss, seed) for seed, loss in enumerate((4.0, 3.7, 3.4))]
    return T_HAT, np.mean([c / c[-1] for c in curves], axis=0)


@pytest.fixture(scope="module")
def family() -> list[np.ndarray]:
    """Six larger runs of the same shape; truth is each smoothed curve's last value."""
    return [noisy_run(loss, 100 + i) for i, loss in enumerate(np.linspace(2.6, 3.3, 6))]


def cut(curve: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    keep = np.less_equal(T_HAT, fraction + 1e-12)
    return T_HAT[keep], curve[keep]


def test_alignment_window_is_the_partial_span_after_its_first_fifth():
    assert alignment_window(0.3) == pytest.approx((0.06, 0.3))
    assert alignment_window(0.1) == pytest.approx((0.02, 0.1))
    assert alignment_window(0.05) == pytest.approx((0.02, 0.05))  # floor: skip the first steps
    # below 4 % the floor would leave less than half the curve: its second half instead
    assert alignment_window(0.03) == pytest.approx((0.015, 0.03))
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            alignment_window(bad)


def test_points_before_the_window_do_not_change_the_prediction(reference):
    curve = 3.0 * eq4_ell(T_HAT, SHAPE_B, SHAPE_Q)
    t, y = cut(curve, 0.3)
    bumped = np.where(t < 0.06 - 1e-9, y * 1.5, y)
    inside = np.where((t > 0.1) & (t < 0.2), y * 1.05, y)
    ref_t, ref_ell = T_HAT, eq4_ell(T_HAT, SHAPE_B, SHAPE_Q)
    base = predict_final_loss(t, y, ref_t, ref_ell).final_loss
    assert predict_final_loss(t, bumped, ref_t, ref_ell).final_loss == pytest.approx(base)
    assert predict_final_loss(t, inside, ref_t, ref_ell).final_loss > base * 1.01


@pytest.mark.parametrize("offset", [0.0, 1.5])
def test_collapse_is_exact_on_the_reference_shape(offset):
    ell = eq4_ell(T_HAT, SHAPE_B, SHAPE_Q)
    curve = offset + (3.0 - offset) * ell  # ell = (L - L0) / (L(T) - L0)
    t, y = cut(curve, 0.2)
    p = predict_final_loss(t, y, T_HAT, ell, offset=offset)
    assert p == Prediction(pytest.approx(3.0), pytest.approx(3.0), pytest.approx(3.0), "collapse")


def test_reference_band_widens_the_bounds():
    ell = eq4_ell(T_HAT, SHAPE_B, SHAPE_Q)
    t, y = cut(3.0 * ell, 0.3)
    band = 0.01 * (ell - 1)  # zero width at t_hat 1, where every ell is 1
    p = predict_final_loss(t, y, T_HAT, ell, reference_lower=ell - band, reference_upper=ell + band)
    assert p.lower < 3.0 < p.upper
    assert 3.0 - p.lower == pytest.approx(3.0 * (1 - 1 / (1 + 0.01 * (ell[300] - 1))), rel=0.5)


@pytest.mark.parametrize("fraction", [0.1, 0.2, 0.3])
def test_collapse_error_within_noise_and_far_below_current(reference, family, fraction):
    ref_t, ref_ell = reference
    errors = {m: [] for m in METHODS}
    covered = 0
    for curve in family:
        truth = curve[-1]
        t, y = cut(curve, fraction)
        for method in METHODS:
            p = predict_final_loss(t, y, ref_t, ref_ell, method=method)
            assert p.lower <= p.final_loss <= p.upper
            errors[method].append(abs(p.final_loss - truth) / truth)
            if method == "collapse":
                covered += p.lower <= truth <= p.upper
    smoothed_noise = NOISE_REL / np.sqrt(SMOOTH_STEPS)  # ~0.45 %: noise of one smoothed point
    assert np.max(errors["collapse"]) < 2.5 * smoothed_noise
    assert np.mean(errors["collapse"]) < 1.5 * smoothed_noise
    assert covered >= len(family) - 1
    assert np.mean(errors["current"]) > 10 * np.mean(errors["collapse"])
    assert np.mean(errors["powerlaw"]) > 3 * np.mean(errors["collapse"])


def test_baselines_overestimate_under_decay_to_zero():
    """The paper's warning: the late D2Z drop is invisible to the loss now and to power laws."""
    curve = 3.0 * eq4_ell(T_HAT, SHAPE_B, SHAPE_Q)
    t, y = cut(curve, 0.3)
    current = predict_final_loss(t, y, method="current")
    assert current.final_loss == pytest.approx(y[-1])
    assert predict_final_loss(t, y, method="powerlaw").final_loss > 3.0 * 1.03


def test_powerlaw_recovers_a_true_power_law():
    a, b, c = 2.0, 0.5, 0.3
    t, y = cut(a + b * T_HAT**-c, 0.3)
    p = predict_final_loss(t, y, method="powerlaw")
    assert p.final_loss == pytest.approx(a + b, rel=5e-3)
    assert p.lower <= a + b <= p.upper


def test_powerlaw_respects_the_offset_as_floor():
    t, y = cut(2.0 + 0.5 * T_HAT**-0.3, 0.3)
    assert predict_final_loss(t, y, method="powerlaw", offset=2.4).final_loss >= 2.4


def test_bad_input_names_the_fix():
    ell = eq4_ell(T_HAT, SHAPE_B, SHAPE_Q)
    t, y = cut(3.0 * ell, 0.3)
    with pytest.raises(ValueError, match="method 'oracle' is unknown"):
        predict_final_loss(t, y, T_HAT, ell, method="oracle")
    with pytest.raises(ValueError, match="needs reference_t_hat"):
        predict_final_loss(t, y, method="collapse")
    with pytest.raises(ValueError, match="offset"):
        predict_final_loss(t, y, T_HAT, ell, offset=10.0)
    with pytest.raises(ValueError, match="log the loss more often"):
        predict_final_loss(t[::120], y[::120], T_HAT, ell)
    with pytest.raises(ValueError, match="reference covers"):
        predict_final_loss(t, y, T_HAT[500:], ell[500:])


# ---------------------------------------------------------------- the command


def write_family_csv(path) -> None:
    """Two reference sizes, three complete larger runs and one stopped at 40 %."""
    rows = []
    runs = [("ref_a", "s1", 4.0), ("ref_b", "s2", 3.7)]
    runs += [(f"big_{i}", "s3", loss) for i, loss in enumerate((3.0, 2.9, 2.8, 2.7))]
    for seed, (run, size, final_loss) in enumerate(runs):
        rng = np.random.default_rng(seed)
        loss = final_loss * eq4_ell(T_HAT, SHAPE_B, SHAPE_Q)
        loss *= 1 + NOISE_REL * rng.standard_normal(STEPS)
        logged = slice(0, 400) if run == "big_3" else slice(None)
        steps = np.arange(1, STEPS + 1)[logged]
        rows.append(pd.DataFrame({"run": run, "step": steps, "loss": loss[logged]}))
        rows[-1]["size"], rows[-1]["steps"], rows[-1]["seed"] = size, STEPS, seed
    pd.concat(rows).to_csv(path, index=False)


def run_cli(argv: list[str]) -> int:
    from collapse.cli import build_parser

    args = build_parser({"predict": "collapse.predict"}).parse_args(["predict", *argv])
    return args.func(args)


def test_cli_predicts_runs_outside_the_reference(tmp_path, capsys):
    curves = tmp_path / "curves.csv"
    write_family_csv(curves)
    out = tmp_path / "out"
    argv = [str(curves), "--reference-sizes", "s1,s2", "--fraction", "0.1", "0.3", "0.5"]
    assert run_cli([*argv, "--out", str(out), "--sweep-report"]) == 0
    table = pd.read_csv(out / "predictions.csv")
    assert list(table.columns) == [
        "run",
        "fraction",
        "predicted_final_loss",
        "lower",
        "upper",
        "method",
        "true_final_loss",
        "abs_error_pct",
    ]
    assert sorted(table["run"].unique()) == ["big_0", "big_1", "big_2", "big_3"]
    # three complete runs x 3 fractions, the run stopped at 40 % only at 0.1 and 0.3; four
    # methods: the three of predict_final_loss and the drift fitted on the two reference sizes
    assert len(table) == 4 * (3 * 3 + 2)
    assert set(table["method"]) == {*METHODS, "drift"}
    drift = json.loads((out / "drift.json").read_text())
    assert set(drift["reference_sizes"]) == {"s1", "s2"}
    by_size = pd.read_csv(out / "bias_by_size.csv")
    assert set(by_size["size"]) == {"s3"} and (by_size["n_runs"] == 3).all()
    partial = table[table["run"] == "big_3"]
    assert sorted(partial["fraction"].unique()) == [0.1, 0.3]
    assert partial["true_final_loss"].isna().all() and partial["abs_error_pct"].isna().all()
    error = table.dropna().groupby("method")["abs_error_pct"].mean()
    assert error["collapse"] < 1.0 < 10 < error["current"]
    assert (out / "sweep_metrics.md").read_text().count("| collapse |") == 3
    assert "mean absolute error" in capsys.readouterr().out


def test_cli_with_a_reference_file_predicts_every_run(tmp_path):
    curves = tmp_path / "curves.csv"
    write_family_csv(curves)
    ell = smoothed(eq4_ell(T_HAT, SHAPE_B, SHAPE_Q))
    ell = ell / ell[-1]
    ref_dir = tmp_path / "reference"
    ref_dir.mkdir()
    pd.DataFrame({"t_hat": T_HAT, "ell": ell, "lower": ell, "upper": ell}).to_csv(
        ref_dir / "reference.csv", index=False
    )
    out = tmp_path / "out"
    assert (
        run_cli([str(curves), "--reference", str(ref_dir), "--fraction", "0.2", "--out", str(out)])
        == 0
    )
    table = pd.read_csv(out / "predictions.csv")
    assert table["run"].nunique() == 6
    collapse = table[table["method"] == "collapse"].dropna()
    assert collapse["abs_error_pct"].max() < 1.0
    # a sweep report without every truth still selects (big_3, stopped at 40 %, ends lowest)
    assert (
        run_cli(
            [
                str(curves),
                "--reference",
                str(ref_dir / "reference.csv"),
                "--fraction",
                "0.2",
                "--out",
                str(out),
                "--sweep-report",
            ]
        )
        == 0
    )
    metrics = pd.read_csv(out / "sweep_metrics.csv").set_index("method")
    assert metrics.loc["collapse", "selected_run"] == "big_3"
    assert np.isnan(metrics.loc["collapse", "regret_loss"])


def test_cli_names_the_sizes_it_has(tmp_path, capsys):
    curves = tmp_path / "curves.csv"
    write_family_csv(curves)
    argv = [str(curves), "--reference-sizes", "s9", "--fraction", "0.3", "--out", str(tmp_path)]
    assert run_cli(argv) == 2
    assert "s1, s2, s3" in capsys.readouterr().err
    assert run_cli([*argv[:2], "s1", "--fraction", "1.5", "--out", str(tmp_path)]) == 2
    assert "fraction 1.5" in capsys.readouterr().err


def test_cli_with_a_surrogate_predicts_a_tau_never_run(tmp_path, capsys):
    """Eq. 4 fitted on small runs at tau 0.1 and 0.4 is the reference of runs at tau 0.2."""
    from collapse.surrogate import fit_surrogate

    def b_of(tau):  # the family's true shape parameter: b = 0.3 tau^0.5
        return 0.3 * tau**0.5

    grid = T_HAT[9::10]
    small = [eq4_ell(grid, b_of(tau), SHAPE_Q) for tau in (0.1, 0.4)]
    fit = fit_surrogate(grid, np.vstack(small), [0.1, 0.4], [20.0, 20.0])
    fit.write_json(tmp_path / "surrogate.json")
    rows = []
    for seed, final_loss in enumerate((3.0, 2.8)):
        rng = np.random.default_rng(seed)
        loss = final_loss * eq4_ell(T_HAT, b_of(0.2), SHAPE_Q)
        loss *= 1 + NOISE_REL * rng.standard_normal(STEPS)
        rows.append(pd.DataFrame({"run": f"tau0.2_{seed}", "step": range(1, STEPS + 1)}))
        rows[-1]["loss"], rows[-1]["tau"], rows[-1]["tpp"] = loss, 0.2, 20.0
    curves = tmp_path / "curves.csv"
    pd.concat(rows).to_csv(curves, index=False)
    out = tmp_path / "out"
    argv = [str(curves), "--fraction", "0.3", "--out", str(out)]
    assert run_cli([*argv, "--reference", str(tmp_path / "surrogate.json")]) == 0
    error = pd.read_csv(out / "predictions.csv").groupby("method")["abs_error_pct"].max()
    assert error["collapse"] < 1.0 < 5 < error["current"]
    # the tau 0.1 run's shape as the reference (what one small run gives) is clearly worse
    ell = eq4_ell(T_HAT, b_of(0.1), SHAPE_Q)
    pd.DataFrame({"t_hat": T_HAT, "ell": ell, "lower": ell, "upper": ell}).to_csv(
        tmp_path / "reference.csv", index=False
    )
    assert run_cli([*argv, "--reference", str(tmp_path / "reference.csv")]) == 0
    wrong = pd.read_csv(out / "predictions.csv").groupby("method")["abs_error_pct"].max()
    assert wrong["collapse"] > 2 * error["collapse"]
    # without the runs' controls there is nothing to draw the surrogate at
    pd.concat(rows).drop(columns=["tau"]).to_csv(curves, index=False)
    assert run_cli([*argv, "--reference", str(tmp_path / "surrogate.json")]) == 2
    assert "needs per-run columns tau and tpp" in capsys.readouterr().err


def test_current_is_the_last_reading_with_its_scatter_about_a_line():
    """y = 3 - 2 t + d (+1, -1, -1, +1): the pattern is orthogonal to 1 and to t, so the line
    fitted over the window is 3 - 2 t and the RMS scatter about it is d = 0.01."""
    t = np.array([0.01, 0.025, 0.05, 0.075, 0.1])  # window at 10 %: [0.02, 0.1]
    y = np.array([9.0, 3 - 0.05 + 0.01, 3 - 0.1 - 0.01, 3 - 0.15 - 0.01, 3 - 0.2 + 0.01])
    got = predict_final_loss(t, y, method="current")
    assert (got.final_loss, got.lower, got.upper) == pytest.approx((2.81, 2.80, 2.82), rel=1e-12)
    assert got.method == "current"


def test_collapse_bounds_combine_the_misfit_and_the_reference_band():
    """L - L0 is c = 2 times the reference, times exp(e) with e = +0.01, -0.02, +0.01, 0 over
    the window: log c is their mean, 0. The band (the reference x 0.99 and x 1.01) moves c to
    c / 0.99 and c / 1.01; the misfit is 2 x std(e, ddof 1) = 2 x sqrt(6e-4 / 3); the bounds
    combine the two in quadrature, in log space."""
    ref_t = np.linspace(0.0, 1.0, 101)
    ref = 1.0 + 0.5 * (1 - ref_t) ** 2
    t = np.array([0.05, 0.1, 0.2, 0.25, 0.3])  # window at 30 %: [0.06, 0.3]
    e = np.array([0.5, 0.01, -0.02, 0.01, 0.0])  # t_hat 0.05 lies before it
    loss = 1.0 + 2.0 * np.interp(t, ref_t, ref) * np.exp(e)
    misfit = 2 * np.sqrt((0.01**2 + 0.02**2 + 0.01**2) / 3)
    got = predict_final_loss(
        t, loss, ref_t, ref, reference_lower=0.99 * ref, reference_upper=1.01 * ref, offset=1.0
    )
    assert got.final_loss == pytest.approx(3.0, rel=1e-12)
    assert got.lower == pytest.approx(1.0 + 2.0 * np.exp(-np.hypot(np.log(1.01), misfit)))
    assert got.upper == pytest.approx(1.0 + 2.0 * np.exp(np.hypot(-np.log(0.99), misfit)))
    plain = predict_final_loss(t, loss, ref_t, ref, offset=1.0)
    assert (plain.lower, plain.upper) == pytest.approx(
        (1.0 + 2.0 * np.exp(-misfit), 1.0 + 2.0 * np.exp(misfit))
    )


def test_points_after_an_explicit_window_do_not_change_the_fit(reference):
    """A window that ends before the partial curve does: what lies after it is not fitted."""
    curve = 3.0 * eq4_ell(T_HAT, SHAPE_B, SHAPE_Q)
    t, y = cut(curve, 0.3)
    bumped = np.where(t > 0.2 + 1e-9, y * 1.5, y)
    ref_t, ref_ell = T_HAT, eq4_ell(T_HAT, SHAPE_B, SHAPE_Q)
    for method in ("collapse", "powerlaw"):
        base = predict_final_loss(t, y, ref_t, ref_ell, method=method, window=(0.06, 0.2))
        got = predict_final_loss(t, bumped, ref_t, ref_ell, method=method, window=(0.06, 0.2))
        assert got == base, method
    exact = predict_final_loss(t, bumped, ref_t, ref_ell, window=(0.06, 0.2))
    assert exact.final_loss == pytest.approx(3.0, rel=1e-9)


def test_powerlaw_bounds_span_the_exponents_within_twice_the_best_error():
    """The bounds are the smallest and largest a + b of the exponents c whose summed squared
    residuals stay within POWERLAW_SSE_TOLERANCE (2) x the best; the estimate is the best c's."""
    from collapse.predict import POWERLAW_EXPONENTS, _powerlaw_fit, predict_powerlaw

    rng = np.random.default_rng(2)
    t = np.linspace(0.06, 0.3, 60)
    y = 2.0 + 0.3 * t**-0.5 + 0.002 * rng.standard_normal(60)
    fits = np.array([_powerlaw_fit(t, y, c, 0.0) for c in POWERLAW_EXPONENTS])
    sse, final = fits[:, 0], fits[:, 1]
    within = final[sse <= 2.0 * sse.min()]
    assert 1 < len(within) < len(final) // 2  # some exponents, far from all
    got = predict_powerlaw(t, y)
    assert got.final_loss == final[np.argmin(sse)]
    assert (got.lower, got.upper) == (within.min(), within.max())
    assert got.lower < got.final_loss < got.upper
    # the sum of squares by hand for the best exponent: y - (a + b t^-c), a + b = the estimate
    c = POWERLAW_EXPONENTS[np.argmin(sse)]
    design = np.column_stack([np.ones_like(t), t**-c])
    (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
    assert a + b == pytest.approx(got.final_loss, rel=1e-9)
    assert np.sum((design @ [a, b] - y) ** 2) == pytest.approx(sse.min(), rel=1e-6)
