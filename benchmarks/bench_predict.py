"""Benchmark: how well the final loss is predicted from 10, 20 and 30 % of a curve, per family.

    python benchmarks/bench_predict.py                           # the synthetic families
    python benchmarks/bench_predict.py --family NAME=CURVES:S1,S2 [--family ...]

Every family is split into reference sizes (complete curves the predictors may fit on) and the
runs of every larger size (early stopping predicts upward: a size below the reference is not
predicted), which are cut at each fraction and predicted by every method of `collapse predict`
(collapse, drift, current, powerlaw). Printed per family, method and fraction: the mean
absolute error (%), the mean signed error at the smallest and the largest predicted size, the
slope of the per-size bias against log parameters with its t value (|t| > 2: the bias grows
with size), the share of runs whose truth lies inside [lower, upper] and the bounds' mean half
width (% of the truth), and the selection regret:
each predicted size is a sweep of its runs (variants, or seeds where a family has none), the
lowest prediction is selected, regret = its true final loss minus the best one's (nats/token,
mean over sizes) and "found" the share of sizes where the best was selected.

Synthetic families (docs/method.md §5 shape under warmup + decay to zero, 5 sizes of 1-16M
parameters, s1 and s2 the reference, 3 seeds each, per-step noise 1 %, 4 variants per predicted
size whose final losses differ by 1-3 %): "offset" collapses after subtracting L0 = 1.5,
"exponent" has a shape exponent drifting by -0.03 per unit log parameters, "both" has both.
CURVES: any file `collapse predict` reads, with a size (or params) column; Qiu et al.'s
published µP-transformer curves convert with benchmarks/published_curves.py. Prints only.

With --realizations N each synthetic family is drawn N times (noise seeds 0..N-1) and the
drift method's mean bias slope over the draws is printed with its standard error: one draw's
slope also carries that draw's error in the fitted L0, which every predicted size shares (the
column slope_t_fit counts it through the fit's jackknife error).

Measured (2 CPU cores, 2026-12-07 and -08; c5m and chess from published_curves.py, d768+d896 the
reference; tiny_spike from benchmarks/data, d48+d64 the reference and d80-d112 predicted, a CPU
family that does not collapse), mean absolute error (%) of the final loss at 10 / 20 / 30 %:
    family              collapse            drift               best baseline (powerlaw)
    synthetic offset    1.37 1.32 1.23      0.25 0.24 0.23      10.2 8.55 4.96
    synthetic exponent  1.00 0.96 0.92      0.75 0.71 0.69      20.5 17.3 10.3
    synthetic both      1.49 1.43 1.34      0.27 0.26 0.26      12.0 10.1 5.88
    c5m                 1.09 0.51 0.35      0.10 0.03 0.01      0.49 0.17 0.11
    chess               2.98 1.89 1.47      0.22 0.08 0.06      1.12 0.45 0.28
    tiny_spike          10.0 13.2 15.8      4.66 3.86 8.66      36.2 39.3 28.1
    mlp (2026-12-08)    8.45 3.81 2.17      6.11 2.06 0.77      12.2 7.29 5.72
Bias slope of drift against log parameters: |t| < 0.6 on c5m; chess +0.10-0.12 %/unit (t 1.7-3.7
over sizes, 0.5-0.7 with the fit's jackknife error, L0 0.552 +- 0.018 against Qiu et al.'s
0.542); tiny_spike -8 / +14 / +18 %/unit (t with the fit's error -1.0 / +3.3 / +4.7): its wider
sizes fall much further after 30 % of training than the reference's, which no early prediction
sees; mlp (Qiu et al.'s MLPs, d384+d512 the reference) t with the fit's error -0.1 / +0.2 / +0.2
(+2.3 / +3.5 / +3.9 before the fit kept L0 only where it improves the collapse; the synthetic
exponent family's MAE was 0.51 / 0.49 / 0.48 before). docs/experiments.md has the figures over
noise draws and the mlp measurements.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd

from collapse.curves import curves_from_frame, read_curves, size_labels, smooth
from collapse.drift import size_coordinate
from collapse.predict import (
    bias_by_size,
    bias_slope,
    drift_from_sizes,
    drift_slope_fit_se,
    predict_runs,
    reference_from_sizes,
)
from collapse.surrogate import synthetic_loss
from collapse.sweep import sweep_metrics, truth_from_predictions

FRACTIONS = (0.1, 0.2, 0.3)
SIZES = {"s1": (1e6, 3.3), "s2": (2e6, 3.1), "s3": (4e6, 2.9), "s4": (8e6, 2.75), "s5": (16e6, 2.6)}
SYNTHETIC = {"offset": (1.5, 0.0), "exponent": (0.0, -0.03), "both": (1.2, -0.02)}


def synthetic_family(offset: float, slope: float, steps: int = 2000, seed: int = 0):
    """Reference sizes s1, s2 (3 seeds); s3-s5 each a sweep of 4 variants (1-3 % apart)."""
    rng = np.random.default_rng(seed)
    t_hat = np.arange(1, steps + 1) / steps
    frames = []
    for size, (params, final) in SIZES.items():
        exponent = 1 + slope * np.log(params / SIZES["s1"][0])
        variants = [final] * 3 if size in ("s1", "s2") else final * np.array([1, 1.01, 1.02, 1.03])
        for k, variant_final in enumerate(rng.permutation(variants)):
            ell = synthetic_loss(t_hat, 1.0, 0.12, 1.0, 0.1, 0.01, 0.001, rng)
            loss = offset + (variant_final - offset) * ell**exponent
            frames.append(
                pd.DataFrame({"run": f"{size}_v{k}", "step": np.arange(1, steps + 1), "loss": loss})
            )
            frames[-1]["size"], frames[-1]["params"], frames[-1]["steps"] = size, params, steps
    return curves_from_frame(pd.concat(frames, ignore_index=True))


def evaluate(name: str, curves, reference_sizes: list[str]) -> pd.DataFrame:
    """One row per method and fraction: error, bias by size, coverage and regret."""
    curves = smooth(curves)
    start = time.perf_counter()
    reference, reference_runs = reference_from_sizes(curves, reference_sizes)
    drift = drift_from_sizes(curves, reference_runs)
    # Early stopping predicts the sizes above the reference: a smaller size is not predicted.
    size_x = size_coordinate(curves.meta)[0]
    above = size_x[size_x > max(drift.size_x) + 1e-9].index
    targets = [r for r in curves.runs if r in set(above)]
    table = predict_runs(curves, reference, FRACTIONS, runs=targets, drift=drift)
    seconds = time.perf_counter() - start
    print(
        f"{name}: {len(targets)} runs predicted in {seconds:.1f} s; drift fitted on "
        f"{', '.join(drift.sizes)}: L0 {drift.offset:.4g}, exponent slope {drift.slope:.4g} "
        f"per unit {drift.coordinate}"
    )
    done = table.dropna(subset=["true_final_loss"])
    by_size = bias_by_size(done, curves.meta, drift)
    fit_se = drift_slope_fit_se(done, curves, drift)
    slopes = bias_slope(by_size, fit_se).set_index(["method", "fraction"])
    inside = (done["lower"] <= done["true_final_loss"]) & (done["true_final_loss"] <= done["upper"])
    half_width = 50 * (done["upper"] - done["lower"]) / done["true_final_loss"]
    sweeps = done.assign(sweep=done["run"].map(size_labels(curves.meta)))
    metrics = sweep_metrics(sweeps, truth_from_predictions(sweeps))
    rows = []
    for (method, fraction), group in done.groupby(["method", "fraction"], sort=False):
        sizes = by_size[(by_size["method"] == method) & (by_size["fraction"] == fraction)]
        picked = metrics[(metrics["method"] == method) & (metrics["fraction"] == fraction)]
        rows.append(
            {
                "family": name,
                "method": method,
                "trained_pct": round(100 * fraction),
                "mae_pct": group["abs_error_pct"].mean(),
                "bias_smallest_pct": sizes["bias_pct"].iloc[0],
                "bias_largest_pct": sizes["bias_pct"].iloc[-1],
                "bias_slope_pct": slopes.loc[(method, fraction), "slope_pct_per_unit_x"],
                "slope_t": slopes.loc[(method, fraction), "t"],
                "slope_t_fit": slopes.loc[(method, fraction), "t_with_fit"],
                "inside_bounds_pct": 100 * inside[group.index].mean(),
                "half_width_pct": half_width[group.index].mean(),
                "regret_nats": picked["regret_loss"].mean(),
                "found_best_pct": 100 * picked["found_best"].astype(float).mean(),
            }
        )
    return pd.DataFrame(rows)


def _slope_verdict(t: float) -> str:
    """|t| <= 2: no significant growth of the bias with size; NaN: under three predicted sizes."""
    if np.isnan(t):
        return "n/a (fewer than three predicted sizes)"
    return "ok" if abs(t) <= 2 else "GROWS WITH SIZE"


def verdict(results: pd.DataFrame) -> str:
    """Per family and fraction: is drift's MAE at most the best baseline's, its slope |t| <= 2?"""
    lines = []
    for (family, trained), group in results.groupby(["family", "trained_pct"], sort=False):
        by = group.set_index("method")
        ours, best = by.loc["drift"], by.loc[["current", "powerlaw"], "mae_pct"].min()
        error_ok = "ok" if ours["mae_pct"] <= best else "WORSE"
        slope_ok, fit_ok = (_slope_verdict(ours[column]) for column in ("slope_t", "slope_t_fit"))
        lines.append(
            f"{family} {trained:>2d} %: drift MAE {ours['mae_pct']:.3f} vs best baseline "
            f"{best:.3f} -> {error_ok}; bias slope t {ours['slope_t']:+.1f} -> {slope_ok}, "
            f"with the fit's uncertainty {ours['slope_t_fit']:+.1f} -> {fit_ok}; "
            f"regret {ours['regret_nats']:.4f} nats "
            f"(collapse {by.loc['collapse', 'regret_nats']:.4f})"
        )
    return "\n".join(lines)


def over_draws(draws: pd.DataFrame) -> str:
    """The drift method over noise draws of each synthetic family: mean MAE and bias slope.

    A bias that grows with size is systematic when the slope's mean over draws differs from 0
    by more than twice its standard error; one draw's slope also carries that draw's error in
    the fitted L0, which the reference's seed noise sets.
    """
    ours = draws[draws["method"] == "drift"]
    lines = []
    for (family, trained), group in ours.groupby(["family", "trained_pct"], sort=False):
        slope = group["bias_slope_pct"]
        se = slope.std(ddof=1) / np.sqrt(len(slope))
        lines.append(
            f"{family} {trained:>2d} % over {len(group)} draws: drift MAE "
            f"{group['mae_pct'].mean():.3f} %, bias slope {slope.mean():+.3f} +- {se:.3f} "
            f"%/unit (t {slope.mean() / se:+.1f}), draws with |t| > 2: "
            f"{int((group['slope_t'].abs() > 2).sum())} raw, "
            f"{int((group['slope_t_fit'].abs() > 2).sum())} with the fit's uncertainty"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--family",
        action="append",
        default=[],
        metavar="NAME=CURVES:S1,S2",
        help="a family of curves and its reference sizes (repeatable)",
    )
    parser.add_argument("--no-synthetic", action="store_true", help="only the --family curves")
    parser.add_argument(
        "--realizations",
        type=int,
        default=1,
        metavar="N",
        help="noise draws of each synthetic family; with N > 1 the drift method's bias slope "
        "is also averaged over the draws (the table shows draw 0)",
    )
    args = parser.parse_args(argv)
    results, draws = [], []
    if not args.no_synthetic:
        for name, (offset, slope) in SYNTHETIC.items():
            for seed in range(args.realizations):
                curves = synthetic_family(offset, slope, seed=seed)
                draws.append(evaluate(f"synthetic {name}", curves, ["s1", "s2"]))
                draws[-1]["draw"] = seed
                if seed == 0:
                    results.append(draws[-1].drop(columns="draw"))
    for spec in args.family:
        name, rest = spec.split("=", 1)
        path, sizes = rest.rsplit(":", 1)
        results.append(evaluate(name, read_curves([path]), sizes.split(",")))
    table = pd.concat(results, ignore_index=True)
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(table.round(3).to_string(index=False))
    print(verdict(table))
    if args.realizations > 1:
        print(over_draws(pd.concat(draws, ignore_index=True)))


if __name__ == "__main__":
    main()
