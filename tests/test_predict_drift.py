"""The size-aware collapse prediction (collapse.drift) on synthetic families of known drift.

Each family is drawn by tests/synthetic.py with a known offset L0 (curves collapse only after
subtracting it) or a known drift of the shape exponent with log parameters; the fit sees the
reference sizes only, and its numbers are checked against the values the family was built
with or against hand arithmetic and scipy.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from synthetic import synthetic_family

from collapse.curves import curves_from_frame, resample, smooth
from collapse.drift import (
    FIT_SPAN_CHECKS,
    OFFSET_FLOOR,
    fit_drift,
    fit_drift_jackknife,
    predict_drift,
)
from collapse.predict import (
    DRIFT_METHOD,
    alignment_window,
    bias_by_size,
    bias_slope,
    drift_from_sizes,
    drift_slope_fit_se,
    predict_runs,
    reference_from_sizes,
)

FINALS = {"s1": 3.2, "s2": 3.0, "s3": 2.8, "s4": 2.65, "s5": 2.5}
N_PARAMS = {"s1": 1e6, "s2": 2e6, "s3": 4e6, "s4": 8e6, "s5": 16e6}
REFERENCE = ["s1", "s2"]


def family(offset=0.0, slope=0.0, noise=0.0, seeds=2):
    frame = synthetic_family(
        FINALS,
        seeds=seeds,
        steps=1000,
        noise_rel=noise,
        wiggle_rel=0.0,
        seed_spread_rel=0.0,
        offset=offset,
        n_params=N_PARAMS,
        exponent_slope=slope,
    )
    return smooth(curves_from_frame(frame))


def reference_matrix(curves):
    runs = curves.meta.index[curves.meta["size"].isin(REFERENCE)]
    return resample(curves.select(runs))


def test_recovers_a_known_offset_and_no_exponent_drift():
    fit = fit_drift(reference_matrix(family(offset=1.5)))
    assert fit.offset == pytest.approx(1.5, abs=2e-3)
    assert fit.slope == pytest.approx(0.0, abs=2e-3)
    assert fit.spread_with_offset < 0.01 * fit.spread_without_offset
    assert fit.sizes == REFERENCE and fit.coordinate == "log params"
    assert fit.notes == []


def test_an_offset_that_does_not_improve_the_collapse_is_not_used():
    """Curves that collapse exactly without an offset: the spread of log ell is 0 at L0 = 0,
    so no fitted L0 can lower it, and the fit keeps L0 = 0 and says why."""
    fit = fit_drift(reference_matrix(family()))
    assert fit.offset == 0.0
    assert fit.spread_without_offset == pytest.approx(0.0, abs=1e-20)
    assert len(fit.notes) == 1 and "L0 = 0 is used" in fit.notes[0]


def test_curves_that_differ_by_a_constant_put_L0_at_its_floor_and_say_so():
    """s2 = s1 - 0.2 nats at every step: L - L0 is proportional across them only as L0 -> -inf,
    so the fit stops at the lower end of its range, -1 x the lowest final loss, and says so."""
    frame = synthetic_family(FINALS, seeds=2, steps=1000, noise_rel=0.0, wiggle_rel=0.0)
    s1 = frame[frame["size"] == "s1"]
    s2 = s1.assign(run=s1["run"].str.replace("s1", "s2"), size="s2", loss=s1["loss"] - 0.2)
    shifted = pd.concat([s1, s2], ignore_index=True).assign(
        params=lambda f: f["size"].map(N_PARAMS)
    )
    matrix = resample(smooth(curves_from_frame(shifted)))
    fit = fit_drift(matrix)
    lowest = matrix.meta["final_loss"].min()  # of the smoothed curves, as the fit sees them
    assert fit.offset == pytest.approx(OFFSET_FLOOR * lowest, rel=1e-3)
    assert len(fit.notes) == 1 and "lower end of its search range" in fit.notes[0]
    assert fit.to_dict()["notes"] == fit.notes


def test_recovers_a_known_exponent_drift_with_the_offset_held():
    """ell_i = ell0 ** a_i, a_i = 1 + k log(N_i / N_1); the fit divides by the mean exponent.

    By hand: g = mean_i log ell_i = abar log ell0, so the fitted a_i = a_i / abar and the
    slope against log N is k / abar.
    """
    k = -0.05
    fit = fit_drift(reference_matrix(family(slope=k)), offset=0.0)
    a = 1 + k * np.log([1.0, 2.0])
    assert fit.exponents == pytest.approx(list(a / a.mean()), abs=1e-3)
    assert fit.slope == pytest.approx(k / a.mean(), rel=0.02)
    assert fit.x_ref == pytest.approx(np.mean(np.log([1e6, 2e6])))


def test_one_reference_size_fits_no_drift_and_says_so():
    curves = family(offset=1.5)
    runs = curves.meta.index[curves.meta["size"] == "s1"]
    fit = fit_drift(resample(curves.select(runs)))
    assert fit.offset == 0.0 and fit.slope == 0.0
    assert "one reference size" in fit.notes[0]


@pytest.mark.parametrize(("offset", "slope"), [(1.5, 0.0), (0.0, -0.03)])
def test_drift_method_removes_the_bias_that_grows_with_size(offset, slope):
    """The paper's method misses more the larger the size; the drift method does not."""
    curves = family(offset=offset, slope=slope, noise=0.005)
    reference, reference_runs = reference_from_sizes(curves, REFERENCE)
    drift = drift_from_sizes(curves, reference_runs)
    targets = [r for r in curves.runs if r not in set(reference_runs)]
    table = predict_runs(curves, reference, (0.1, 0.2, 0.3), runs=targets, drift=drift)
    by_size = bias_by_size(table, curves.meta, drift)
    paper = by_size[(by_size["method"] == "collapse") & (by_size["fraction"] == 0.3)]
    ours = by_size[(by_size["method"] == DRIFT_METHOD) & (by_size["fraction"] == 0.3)]
    assert paper["bias_pct"].abs().iloc[-1] > 2 * paper["bias_pct"].abs().iloc[0] > 0.2
    mae = table.groupby("method")["abs_error_pct"].mean()
    assert mae[DRIFT_METHOD] < 0.25 * mae["collapse"]
    assert mae[DRIFT_METHOD] < mae["powerlaw"]
    assert ours["bias_pct"].abs().max() < 0.3
    slopes = bias_slope(by_size).set_index(["method", "fraction"])
    assert abs(slopes.loc[("collapse", 0.3), "t"]) > 2  # the paper's bias grows with size
    assert ours["drift_exponent"].notna().all()


def test_bounds_span_both_hypotheses():
    curves = family(slope=-0.03)
    fit = fit_drift(reference_matrix(curves))
    run = curves.data[curves.data["run"] == "s5_s0"]
    keep = run["t_hat"] <= 0.3
    p = predict_drift(
        run["t_hat"][keep].to_numpy(),
        run["loss_smooth"][keep].to_numpy(),
        fit,
        np.log(16e6),
        alignment_window(0.3),
    )
    assert p.final_loss == pytest.approx(0.5 * (p.offset_only + p.continued_drift))
    assert p.lower <= min(p.offset_only, p.continued_drift)
    assert p.upper >= max(p.offset_only, p.continued_drift)
    assert p.exponent == pytest.approx(fit.exponent(np.log(16e6)))


def test_an_exact_offset_is_found_over_every_fit_span():
    """Noise-free curves that collapse exactly after L0 = 1.5: every span pins the same L0."""
    fit = fit_drift_jackknife(reference_matrix(family(offset=1.5)))
    spans = fit.to_dict()["offset_L0_by_fit_span"]
    assert len(spans) == 1 + len(FIT_SPAN_CHECKS) == len(fit.span_fits) + 1
    assert list(spans.values()) == pytest.approx([1.5] * len(spans), abs=2e-3)


def test_bounds_add_half_the_range_of_the_span_fits_predictions():
    """The bound is the quadrature sum of the other terms and half the range of the three
    spans' predictions, each span's prediction recomputed here from its own fit alone."""
    curves = family(offset=1.0, slope=-0.03, noise=0.01, seeds=3)
    fit = fit_drift_jackknife(reference_matrix(curves))
    run = curves.data[curves.data["run"] == "s5_s0"]
    keep = run["t_hat"] <= 0.3
    args = (run["t_hat"][keep].to_numpy(), run["loss_smooth"][keep].to_numpy())
    x, window = np.log(16e6), alignment_window(0.3)
    full = predict_drift(*args, fit, x, window)
    without = predict_drift(*args, replace(fit, span_fits=[]), x, window)
    centers = [full.final_loss] + [
        predict_drift(*args, replace(f, replicas=[]), x, window).final_loss for f in fit.span_fits
    ]
    half_range = 0.5 * (max(centers) - min(centers))
    assert half_range > 0
    assert full.final_loss == without.final_loss
    expected = np.hypot(without.upper - without.final_loss, half_range)
    assert full.upper - full.final_loss == pytest.approx(expected, rel=1e-9)
    assert full.final_loss - full.lower == pytest.approx(expected, rel=1e-9)


def test_bias_slope_matches_scipy():
    rng = np.random.default_rng(0)
    x = np.log([1e6, 2e6, 4e6, 8e6, 16e6])
    bias = 0.1 * x + rng.normal(0, 0.05, len(x))
    by_size = pd.DataFrame(
        {"method": "m", "fraction": 0.3, "size": list("abcde"), "x": x, "bias_pct": bias}
    )
    got = bias_slope(by_size).iloc[0]
    ref = stats.linregress(x, bias)
    assert got["slope_pct_per_unit_x"] == pytest.approx(ref.slope)
    assert got["slope_se"] == pytest.approx(ref.stderr)
    assert got["t"] == pytest.approx(ref.slope / ref.stderr)


def run_cli(argv: list[str]) -> int:
    from collapse.cli import build_parser

    args = build_parser({"predict": "collapse.predict"}).parse_args(["predict", *argv])
    return args.func(args)


def test_cli_prints_the_fit_and_the_bias_by_size(tmp_path, capsys):
    frame = synthetic_family(
        FINALS,
        seeds=2,
        steps=1000,
        noise_rel=0.0,
        wiggle_rel=0.0,
        seed_spread_rel=0.0,
        offset=1.5,
        n_params=N_PARAMS,
    )
    frame.to_csv(tmp_path / "curves.csv", index=False)
    argv = [str(tmp_path / "curves.csv"), "--fraction", "0.3", "--out", str(tmp_path / "out")]
    assert run_cli([*argv, "--reference-sizes", "s1,s2"]) == 0
    out = capsys.readouterr().out
    assert "offset L0 = 1.5" in out and "bias by size" in out
    assert "jackknife standard error" in out
    fit = json.loads((tmp_path / "out" / "drift.json").read_text())
    replicas = np.array(fit["jackknife_offset_L0"])
    n = len(replicas)
    assert fit["offset_L0_jackknife_se"] == pytest.approx(
        np.sqrt((n - 1) / n * np.sum((replicas - replicas.mean()) ** 2))
    )
    by_size = pd.read_csv(tmp_path / "out" / "bias_by_size.csv")
    drift_rows = by_size[by_size["method"] == DRIFT_METHOD]
    assert list(drift_rows["size"]) == ["s3", "s4", "s5"]
    assert drift_rows["bias_pct"].abs().max() < 0.05
    assert not (tmp_path / "out" / "held_out.csv").exists()  # two sizes: none to hold out
    # three reference sizes: the largest, s3, is predicted from s1 and s2 as above
    assert run_cli([*argv, "--reference-sizes", "s1,s2,s3", "--out", str(tmp_path / "three")]) == 0
    assert "held-out check: reference size s3 predicted from s1,s2" in capsys.readouterr().out
    held = pd.read_csv(tmp_path / "three" / "held_out.csv").set_index("method")
    assert set(held["size"]) == {"s3"} and set(held["fitted_on"]) == {"s1,s2"}
    assert (held["n_runs"] == 2).all()
    s3 = by_size[by_size["size"] == "s3"].set_index("method")
    for method in ("collapse", DRIFT_METHOD):
        assert held.at[method, "bias_pct"] == pytest.approx(s3.at[method, "bias_pct"], abs=1e-4)
    # the offset the paper's method ignores shows in its error; the drift method has none
    assert abs(held.at["collapse", "bias_pct"]) > 0.2
    assert abs(held.at[DRIFT_METHOD, "bias_pct"]) < 0.05
    # one reference size: nothing to fit a drift from, and the user is told so
    assert run_cli([*argv, "--reference-sizes", "s1"]) == 0
    assert "one reference size" in capsys.readouterr().err


def test_cli_without_a_size_number_skips_the_drift_method(tmp_path, capsys):
    frame = synthetic_family({"small": 3.2, "large": 3.0}, seeds=2, steps=1000)
    frame.to_csv(tmp_path / "curves.csv", index=False)
    out = tmp_path / "out"
    argv = [str(tmp_path / "curves.csv"), "--reference-sizes", "small", "--fraction", "0.3"]
    assert run_cli([*argv, "--out", str(out)]) == 0
    assert "no drift method" in capsys.readouterr().err
    assert DRIFT_METHOD not in set(pd.read_csv(out / "predictions.csv")["method"])


def test_bias_does_not_grow_with_size_over_noise_draws():
    """Known L0 1.2 and a known exponent drift of -0.02 per unit log parameters, 1 % step noise.

    One draw's bias is a line in size even for an unbiased method: the draw's error in the
    fitted L0 shifts every predicted size the same way. Over eight independent draws the drift
    method's mean slope stays within two standard errors of 0, while the paper's method, which
    ignores the drift, has a slope many standard errors away from 0 in the same test. The
    jackknife error of one draw's slope (drift_slope_fit_se) is checked against the spread of
    the slope over the draws, which it estimates from one draw's reference runs alone.
    """
    slopes, jackknife = {"collapse": [], DRIFT_METHOD: []}, []
    for draw in range(8):
        frame = synthetic_family(
            FINALS,
            seeds=3,
            steps=1000,
            noise_rel=0.01,
            wiggle_rel=0.0,
            seed_spread_rel=0.0,
            offset=1.2,
            n_params=N_PARAMS,
            exponent_slope=-0.02,
            rng_seed=draw,
        )
        curves = smooth(curves_from_frame(frame))
        reference, reference_runs = reference_from_sizes(curves, REFERENCE)
        drift = drift_from_sizes(curves, reference_runs)
        targets = [r for r in curves.runs if r not in set(reference_runs)]
        table = predict_runs(curves, reference, (0.1, 0.3), runs=targets, drift=drift)
        fit = bias_slope(bias_by_size(table, curves.meta, drift)).set_index(["method", "fraction"])
        for method, values in slopes.items():
            values.append(fit.loc[(method, 0.3), "slope_pct_per_unit_x"])
        jackknife.append(drift_slope_fit_se(table, curves, drift)[0.3])
    spread = np.std(slopes[DRIFT_METHOD], ddof=1)
    assert 0.5 * spread < np.median(jackknife) < 2 * spread, (spread, jackknife)
    for method, values in slopes.items():
        mean, se = np.mean(values), np.std(values, ddof=1) / np.sqrt(len(values))
        if method == DRIFT_METHOD:
            assert abs(mean) < 2 * se, (mean, se, values)
        else:
            assert mean < -10 * se, (mean, se, values)


def test_bias_slope_with_the_fit_error_of_the_drift_method_by_hand():
    """bias = 1 + 0.5 x + 0.1 (+1, -1, -1, +1) at x = 0..3: the pattern is orthogonal to 1 and
    x, so the slope is 0.5 and se = sqrt(4 x 0.01 / 2 / 5) (S_xx = 5) = 0.0632456. The drift
    method's fit error 0.05 adds in quadrature: t_with_fit = 0.5 / sqrt(0.004 + 0.0025); the
    other methods share no fit, so theirs is slope / se."""
    x = np.arange(4.0)
    bias = 1 + 0.5 * x + 0.1 * np.array([1, -1, -1, 1])
    by_size = pd.concat(
        [
            pd.DataFrame({"method": m, "fraction": 0.2, "x": x, "bias_pct": bias})
            for m in ("collapse", "drift")
        ]
    )
    got = bias_slope(by_size, pd.Series({0.2: 0.05})).set_index("method")
    assert got["slope_pct_per_unit_x"].tolist() == pytest.approx([0.5, 0.5], rel=1e-12)
    assert got["slope_se"].tolist() == pytest.approx([0.063245553203368] * 2, rel=1e-9)
    assert got.loc["drift", "slope_se_fit"] == 0.05
    assert np.isnan(got.loc["collapse", "slope_se_fit"])
    assert got.loc["drift", "t_with_fit"] == pytest.approx(0.5 / np.sqrt(0.0065), rel=1e-9)
    assert got.loc["collapse", "t_with_fit"] == pytest.approx(0.5 / 0.063245553203368, rel=1e-9)
    # two sizes are too few for a slope with an error
    few = bias_slope(by_size[by_size["x"] < 2]).iloc[0]
    assert np.isnan(few["slope_pct_per_unit_x"]) and np.isnan(few["t"])
