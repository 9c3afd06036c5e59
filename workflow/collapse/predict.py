"""Predict a run's final loss from a partial curve, to stop losing sweep settings early.

Source: docs/method.md §5 (Bergsma et al. 2025, arXiv 2509.25087): the divisor L(T) that best
aligns the partial normalized curve with the same segment of the reference curve is the
predicted final loss. Two baselines sit beside it, because the paper compares against them:
"current" (the loss now) and a power-law extrapolation of the partial curve. Under a
decay-to-zero schedule the loss drops sharply late in training, so both baselines overestimate.

The predict_* functions work on plain arrays (t_hat = step / total steps of the full-length
schedule, loss already smoothed by a trailing window), all methods over the same alignment
window; ``predict_runs`` and the command `collapse predict` do the loading, smoothing and
cutting of whole curve tables.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import lsq_linear

from collapse import validate as V
from collapse.curves import (
    Curves,
    default_grid,
    ordered_sizes,
    read_curves,
    resample,
    size_labels,
    smooth,
)
from collapse.drift import DriftFit, fit_drift_jackknife, predict_drift, size_coordinate
from collapse.outputs import staged_folder
from collapse.reference import ReferenceCurve, early_align, reference_curve
from collapse.surrogate import SurrogateFit

METHODS = ("collapse", "current", "powerlaw")
DRIFT_METHOD = "drift"  # collapse with the size drift fitted on the reference sizes (drift.py)

# Alignment window: [START_RATIO * fraction, fraction] of the partial curve, and never earlier
# than MIN_START_T_HAT (the first steps of warm-up move fastest and collapse worst).
START_RATIO = 0.2
MIN_START_T_HAT = 0.02
MIN_WINDOW_POINTS = 3

# Power law L(t) = a + b * t^-c: exponents tried, and how much worse (in summed squared
# residuals) an exponent may fit and still count towards the bounds.
POWERLAW_EXPONENTS = np.geomspace(0.01, 3.0, 121)
POWERLAW_SSE_TOLERANCE = 2.0


@dataclass(frozen=True)
class Prediction:
    """A predicted final loss L(T) with a lower and upper bound (nats/token, like the loss)."""

    final_loss: float
    lower: float
    upper: float
    method: str


def alignment_window(
    fraction: float, *, start_ratio: float = START_RATIO, min_start: float = MIN_START_T_HAT
) -> tuple[float, float]:
    """The t_hat span a partial curve ending at ``fraction`` is fitted on.

    All of the partial curve but its first fifth (at 30 %: [0.06, 0.3]; at 10 %: [0.02, 0.1]):
    the very first steps move fastest and collapse worst, and a long window averages out the
    batch noise. Measured on the tiny-family spike curves (4 reference/target splits, fractions
    0.1/0.2/0.3), mean absolute error 3.8 % with start ratio 0.2 against 4.4 % with 0.5
    and 0.8 (the paper's monitoring window, 0.25-0.5, does not exist before 50 %).
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction {fraction} must lie in (0, 1]: t_hat is step / total steps")
    return (max(start_ratio * fraction, min(min_start, fraction / 2)), fraction)


def _window_mask(t_hat: np.ndarray, window: tuple[float, float]) -> np.ndarray:
    lo, hi = window
    mask = (t_hat >= lo - 1e-12) & (t_hat <= hi + 1e-12)
    if mask.sum() < MIN_WINDOW_POINTS:
        raise ValueError(
            f"only {int(mask.sum())} points of the partial curve lie in the alignment window "
            f"t_hat [{lo:.3g}, {hi:.3g}]; need {MIN_WINDOW_POINTS}: log the loss more often or "
            "predict from a larger fraction"
        )
    return mask


def _as_curve(t_hat, loss, name: str) -> tuple[np.ndarray, np.ndarray]:
    t = np.asarray(t_hat, dtype=float)
    y = np.asarray(loss, dtype=float)
    if t.shape != y.shape or t.ndim != 1:
        raise ValueError(f"{name}: t_hat and loss must be 1-d arrays of equal length")
    keep = np.isfinite(t) & np.isfinite(y)
    order = np.argsort(t[keep], kind="stable")
    return t[keep][order], y[keep][order]


def predict_collapse(
    t_hat,
    loss,
    reference_t_hat,
    reference_ell,
    *,
    reference_lower=None,
    reference_upper=None,
    offset: float = 0.0,
    window: tuple[float, float] | None = None,
) -> Prediction:
    """Early-align the partial curve with the reference; the divisor is the final loss.

    Source: docs/method.md §3 and §5: ell(t_hat) = (L(t_hat T) - L0) / (L(T) - L0), so over the
    window L - L0 = c * ell_ref with c = L(T) - L0, fitted in log space by
    ``reference.early_align``. Bounds: its misfit band (z = 2 standard deviations of the log
    residuals; not divided by the number of points, since residuals of a smoothed curve are
    strongly correlated) combined in quadrature with the shift of c when aligning against the
    reference band instead (a higher reference curve means a lower final loss).
    """
    t, y = _as_curve(t_hat, loss, "partial curve")
    rt, rell = _as_curve(reference_t_hat, reference_ell, "reference")
    window = window or alignment_window(float(t.max()))
    covered = _window_mask(t, window) & (t >= rt.min()) & (t <= rt.max())
    if covered.sum() < MIN_WINDOW_POINTS:
        raise ValueError(
            f"the reference covers t_hat [{rt.min():.3g}, {rt.max():.3g}] but the alignment "
            f"window is [{window[0]:.3g}, {window[1]:.3g}]: build the reference on a grid "
            "that covers the window"
        )
    tc, yc = t[covered], y[covered]
    fit = early_align(tc, yc, rt, rell, window=window, offset=offset)
    scale = fit.final_loss - offset
    misfit = np.log(fit.upper - offset) - np.log(scale)
    band_down = band_up = 0.0  # log shifts of the scale against the reference band
    for band in (reference_lower, reference_upper):
        if band is None:
            continue
        bt, bell = _as_curve(reference_t_hat, band, "reference band")
        shift = np.log(
            early_align(tc, yc, bt, bell, window=window, offset=offset).final_loss - offset
        ) - np.log(scale)
        band_down, band_up = max(band_down, -shift), max(band_up, shift)
    return Prediction(
        final_loss=float(fit.final_loss),
        lower=float(offset + scale * np.exp(-np.hypot(band_down, misfit))),
        upper=float(offset + scale * np.exp(np.hypot(band_up, misfit))),
        method="collapse",
    )


def predict_current(t_hat, loss, *, window: tuple[float, float] | None = None) -> Prediction:
    """Baseline "current best": the smoothed loss at the stopping point is the final loss.

    Source: docs/method.md §5 (the run ahead at the stopping point). Bounds: plus/minus the RMS
    scatter of the loss about a straight line over the window, i.e. how noisy the reading is.
    """
    t, y = _as_curve(t_hat, loss, "partial curve")
    window = window or alignment_window(float(t.max()))
    mask = _window_mask(t, window)
    slope, intercept = np.polyfit(t[mask], y[mask], 1)
    scatter = float(np.sqrt(np.mean((y[mask] - (slope * t[mask] + intercept)) ** 2)))
    now = float(y[-1])
    return Prediction(now, now - scatter, now + scatter, "current")


def _powerlaw_fit(t: np.ndarray, y: np.ndarray, exponent: float, offset: float):
    """Linear least squares of y = a + b t^-c for a fixed c, with a >= offset and b >= 0."""
    design = np.column_stack([np.ones_like(t), t**-exponent])
    fit = lsq_linear(design, y, bounds=([offset, 0.0], [np.inf, np.inf]))
    a, b = fit.x
    return float(np.sum((design @ fit.x - y) ** 2)), float(a + b)


def predict_powerlaw(
    t_hat, loss, *, offset: float = 0.0, window: tuple[float, float] | None = None
) -> Prediction:
    """Baseline: fit L(t_hat) = a + b * t_hat^-c on the window and extrapolate to t_hat = 1.

    Constraints: a >= offset (an irreducible loss, 0 by default), b >= 0 (loss falls), c in
    [0.01, 3]. For each c on a grid the fit is linear in (a, b); the prediction is a + b from the
    best c, and the bounds span every c whose summed squared residuals stay within
    POWERLAW_SSE_TOLERANCE times the best (a profile over the poorly determined exponent).
    """
    t, y = _as_curve(t_hat, loss, "partial curve")
    window = window or alignment_window(float(t.max()))
    mask = _window_mask(t, window)
    if t[mask].min() <= 0:
        raise ValueError("power-law fit needs t_hat > 0 in the window")
    fits = np.array([_powerlaw_fit(t[mask], y[mask], c, offset) for c in POWERLAW_EXPONENTS])
    sse, final = fits[:, 0], fits[:, 1]
    best = int(np.argmin(sse))
    accepted = final[sse <= POWERLAW_SSE_TOLERANCE * sse[best] + 1e-300]
    return Prediction(float(final[best]), float(accepted.min()), float(accepted.max()), "powerlaw")


def predict_final_loss(
    partial_t_hat,
    partial_loss,
    reference_t_hat=None,
    reference_ell=None,
    *,
    method: str = "collapse",
    reference_lower=None,
    reference_upper=None,
    offset: float = 0.0,
    window: tuple[float, float] | None = None,
) -> Prediction:
    """Predicted final loss of a partial curve by one of METHODS.

    partial_t_hat: step / total steps of the full-length schedule; partial_loss: the smoothed
    training loss there. The reference (t_hat, ell, and optionally its band) is needed for
    "collapse" only. window defaults to ``alignment_window(max(partial_t_hat))``.
    """
    if method == "collapse":
        if reference_t_hat is None or reference_ell is None:
            raise ValueError("method 'collapse' needs reference_t_hat and reference_ell")
        return predict_collapse(
            partial_t_hat,
            partial_loss,
            reference_t_hat,
            reference_ell,
            reference_lower=reference_lower,
            reference_upper=reference_upper,
            offset=offset,
            window=window,
        )
    if method == "current":
        return predict_current(partial_t_hat, partial_loss, window=window)
    if method == "powerlaw":
        return predict_powerlaw(partial_t_hat, partial_loss, offset=offset, window=window)
    raise ValueError(f"method {method!r} is unknown: choose one of {', '.join(METHODS)}")


# ---------------------------------------------------------------- curves from anywhere

PREDICTION_COLUMNS = (
    "run",
    "fraction",
    "predicted_final_loss",  # nats/token, like the loss
    "lower",
    "upper",
    "method",
    "true_final_loss",  # smoothed loss at t_hat = 1; NaN when the run is not complete
    "abs_error_pct",  # 100 |predicted - true| / true
)


def reference_from_sizes(curves: Curves, sizes: Sequence[str], *, offset: float = 0.0):
    """The reference curve of the named sizes' complete runs (normalized, averaged).

    Source: docs/method.md §5, step 1. ``curves`` must be smoothed (``curves.smooth``).
    """
    labels = size_labels(curves.meta)
    wanted = [str(s).strip() for s in sizes if str(s).strip()]
    unknown = [s for s in wanted if s not in set(labels)]
    if unknown or not wanted:
        raise ValueError(
            f"--reference-sizes {','.join(wanted)}: no runs of size(s) {', '.join(unknown)}; "
            f"the curves have sizes {', '.join(ordered_sizes(curves.meta))} (from the size "
            "column, else params)"
        )
    runs = labels.index[labels.isin(wanted)]
    return reference_curve(resample(curves.select(runs)), offset=offset), list(runs)


def drift_from_sizes(curves: Curves, reference_runs: Sequence[str]) -> DriftFit:
    """L0 and the shape's drift with size, fitted on the reference runs (``collapse.drift``),
    with its jackknife replicas for the bounds."""
    return fit_drift_jackknife(resample(curves.select(reference_runs)))


def surrogate_references(curves: Curves, fit: SurrogateFit) -> dict[str, ReferenceCurve]:
    """Each run's reference drawn from the Eq. 4 surrogate at the run's own tau and TPP.

    Source: docs/method.md §5: the parametric curve gives a reference for controls that were
    never run. The band is +- the fit's mean absolute error; there is no seed noise.
    """
    missing = [c for c in ("tau", "tpp") if c not in curves.meta.columns]
    if missing or curves.meta[["tau", "tpp"]].isna().any().any():
        raise ValueError(
            "a surrogate reference needs per-run columns tau and tpp (the run's controls) for "
            "every run; add them to the curves or --runs-csv, or give a reference.csv instead"
        )
    grid = default_grid()
    references = {}
    for run, (tau, tpp) in curves.meta[["tau", "tpp"]].astype(float).iterrows():
        ell = fit.params.ell(grid, tau, tpp)
        nan = np.full_like(grid, np.nan)
        references[run] = ReferenceCurve(
            grid, ell, ell - fit.mae, ell + fit.mae, nan, nan, sizes=["surrogate"]
        )
    return references


def _prediction_row(run: str, fraction: float, method: str, p, truth: float) -> dict:
    """One row of PREDICTION_COLUMNS: a method's prediction of a run at a fraction."""
    return {
        "run": run,
        "fraction": float(fraction),
        "predicted_final_loss": p.final_loss,
        "lower": p.lower,
        "upper": p.upper,
        "method": method,
        "true_final_loss": truth,
        "abs_error_pct": 100 * abs(p.final_loss - truth) / truth,
    }


def predict_runs(
    curves: Curves,
    reference: ReferenceCurve | Mapping[str, ReferenceCurve],
    fractions: Sequence[float],
    *,
    runs: Sequence[str] | None = None,
    offset: float = 0.0,
    drift: DriftFit | None = None,
) -> pd.DataFrame:
    """Cut every run at each fraction of its own length and predict it by every method.

    ``curves`` must be smoothed (``curves.smooth``: trailing, so the cut curve sees no future).
    t_hat comes from the curves (step / full length: the ``steps`` column, else the largest
    step). A run that has not reached a fraction is skipped there. One row per run x fraction
    x method, columns PREDICTION_COLUMNS (plus ``sweep`` when the metadata has it).
    ``reference`` is one curve for every run, or one per run (``surrogate_references``).
    With ``drift`` (``drift_from_sizes``) every run is also predicted by DRIFT_METHOD, at its
    own size coordinate (``drift.size_coordinate``).
    """
    data = curves.data
    if "loss_smooth" not in data.columns:
        raise ValueError("curves have no loss_smooth column: call collapse.curves.smooth first")
    rows = []
    size_x = size_coordinate(curves.meta)[0] if drift is not None else None
    by_run = dict(tuple(data.groupby("run", sort=False)))
    for run in runs if runs is not None else curves.runs:
        curve = by_run[run]
        ref = reference[run] if isinstance(reference, Mapping) else reference
        t_hat = curve["t_hat"].to_numpy(float)
        loss = curve["loss_smooth"].to_numpy(float)
        complete = bool(curves.meta.at[run, "complete"])
        truth = float(loss[-1]) if complete else np.nan
        for fraction in fractions:
            window = alignment_window(fraction)
            if t_hat.max() < fraction - 1e-9:
                continue
            keep = t_hat <= fraction + 1e-9
            for method in METHODS:
                try:
                    p = predict_final_loss(
                        t_hat[keep],
                        loss[keep],
                        ref.t_hat,
                        ref.ell,
                        method=method,
                        reference_lower=ref.lower,
                        reference_upper=ref.upper,
                        offset=offset,
                        window=window,
                    )
                except ValueError as err:
                    raise ValueError(f"run {run} at fraction {fraction}, {method}: {err}") from err
                rows.append(_prediction_row(run, fraction, method, p, truth))
            if drift is not None:
                p = predict_drift(t_hat[keep], loss[keep], drift, size_x[run], window)
                rows.append(_prediction_row(run, fraction, DRIFT_METHOD, p, truth))
    table = pd.DataFrame(rows, columns=list(PREDICTION_COLUMNS))
    if "sweep" in curves.meta.columns:
        table["sweep"] = table["run"].map(curves.meta["sweep"]).fillna("").astype(str)
    return table


def held_out_size(
    curves: Curves, reference_runs: Sequence[str], fractions: Sequence[float], offset: float = 0.0
) -> pd.DataFrame:
    """The largest reference size predicted from the smaller ones: extrapolation checked on
    sizes whose truth is known.

    With three or more reference sizes the largest is held out, the reference curve and the
    drift are fitted on the others, and its runs are predicted at each fraction as
    ``predict_runs`` would predict a larger size. One row per method (collapse, drift) and
    fraction: size, fitted_on, n_runs, bias_pct (mean signed error, %), abs_error_pct. Empty
    with fewer than three reference sizes (the drift needs two to fit on).
    """
    columns = ["method", "fraction", "size", "fitted_on", "n_runs", "bias_pct", "abs_error_pct"]
    meta = curves.meta.loc[list(reference_runs)]
    labels, x = size_labels(meta), size_coordinate(meta)[0]
    order = x.groupby(labels).mean().sort_values()
    if len(order) < 3:
        return pd.DataFrame(columns=columns)
    held = labels.index[labels == order.index[-1]]
    fit_on = [r for r in reference_runs if r not in set(held)]
    reference = reference_curve(resample(curves.select(fit_on)), offset=offset)
    table = predict_runs(
        curves,
        reference,
        fractions,
        runs=list(held),
        offset=offset,
        drift=drift_from_sizes(curves, fit_on),
    )
    chosen = table[table["method"].isin(["collapse", DRIFT_METHOD])]
    out = bias_by_size(chosen, curves.meta)
    out.insert(3, "fitted_on", ",".join(str(s) for s in order.index[:-1]))
    return out[columns]


# ---------------------------------------------------------------- bias with size


def bias_by_size(table: pd.DataFrame, meta: pd.DataFrame, drift: DriftFit | None = None):
    """Mean signed error (%) per method, fraction and size of the complete runs in ``table``.

    Columns: method, fraction, size, x (the size coordinate, ``drift.size_coordinate``; NaN
    when the sizes carry no number), n_runs, bias_pct (100 (predicted - true) / true, averaged),
    abs_error_pct, and for the drift method the shape exponent it assumed at that size.
    """
    done = table.dropna(subset=["true_final_loss"])
    labels = size_labels(meta)
    try:
        x = size_coordinate(meta)[0]
    except ValueError:
        x = pd.Series(np.nan, index=meta.index)
    frame = done.assign(
        size=done["run"].map(labels),
        x=done["run"].map(x),
        bias_pct=100
        * (done["predicted_final_loss"] - done["true_final_loss"])
        / done["true_final_loss"],
    )
    out = (
        frame.groupby(["method", "fraction", "size"], sort=False)
        .agg(
            x=("x", "mean"),
            n_runs=("run", "size"),
            bias_pct=("bias_pct", "mean"),
            abs_error_pct=("abs_error_pct", "mean"),
        )
        .reset_index()
        .sort_values(["method", "fraction", "x", "size"], kind="stable")
    )
    if drift is not None:
        assumed = out["x"].map(lambda v: drift.exponent(v) if np.isfinite(v) else np.nan)
        out["drift_exponent"] = np.where(out["method"] == DRIFT_METHOD, assumed, np.nan)
    return out.reset_index(drop=True)


def bias_slope(by_size: pd.DataFrame, fit_se: pd.Series | None = None) -> pd.DataFrame:
    """Slope of the per-size bias (%) against the size coordinate, with its standard error.

    One row per method and fraction: slope_pct_per_unit_x, its standard error from ordinary
    least squares over the sizes, and t = slope / se (|t| > 2: the bias grows with size).
    NaN where fewer than three sizes have a coordinate. The OLS error treats the reference as
    exact. ``fit_se`` (``drift_slope_fit_se``: the jackknife standard error of the drift
    method's slope over its reference runs, indexed by fraction) adds slope_se_fit and
    t_with_fit = slope / sqrt(se^2 + se_fit^2), the test that counts the uncertainty of the
    fit every prediction shares.
    """
    rows = []
    for (method, fraction), group in by_size.groupby(["method", "fraction"], sort=False):
        g = group.dropna(subset=["x", "bias_pct"])
        slope = se = np.nan
        if len(g) >= 3:
            (slope, intercept), cov = np.polyfit(g["x"], g["bias_pct"], 1, cov="unscaled")
            resid = g["bias_pct"] - (slope * g["x"] + intercept)
            se = float(np.sqrt(cov[0, 0] * np.sum(resid**2) / (len(g) - 2)))
        row = {
            "method": method,
            "fraction": fraction,
            "slope_pct_per_unit_x": slope,
            "slope_se": se,
            "t": slope / se if se and np.isfinite(se) and se > 0 else np.nan,
        }
        if fit_se is not None:
            extra = float(fit_se.get(fraction, np.nan)) if method == DRIFT_METHOD else 0.0
            total = float(np.hypot(se, extra))
            row["slope_se_fit"] = extra if method == DRIFT_METHOD else np.nan
            row["t_with_fit"] = slope / total if np.isfinite(total) and total > 0 else np.nan
        rows.append(row)
    return pd.DataFrame(rows)


def drift_slope_fit_se(table: pd.DataFrame, curves: Curves, drift: DriftFit) -> pd.Series:
    """Jackknife standard error, per fraction, of the drift method's bias slope.

    Every drift row of ``table`` (``predict_runs``) is predicted again with each replica of the
    fit (``drift.replicas``: one reference run left out), the per-size bias and its slope
    recomputed, and the replicas' slopes combined as a jackknife. An error in L0 or in the
    exponent slope shifts every predicted size the same way, so its bias is a line in size
    even when the method is unbiased: this is how far that line moves with the reference's
    seed noise. NaN per fraction with fewer than two replicas.
    """
    rows = table[(table["method"] == DRIFT_METHOD)].dropna(subset=["true_final_loss"])
    fractions = list(pd.unique(rows["fraction"]))
    if len(drift.replicas) < 2 or rows.empty:
        return pd.Series(np.nan, index=fractions, dtype=float)
    size_x = size_coordinate(curves.meta)[0]
    by_run = dict(tuple(curves.data.groupby("run", sort=False)))
    slopes = []
    for replica in drift.replicas:
        again = rows.copy()
        for i, row in rows.iterrows():
            curve = by_run[row["run"]]
            keep = curve["t_hat"].to_numpy(float) <= row["fraction"] + 1e-9
            p = predict_drift(
                curve["t_hat"].to_numpy(float)[keep],
                curve["loss_smooth"].to_numpy(float)[keep],
                replica,
                size_x[row["run"]],
                alignment_window(row["fraction"]),
            )
            again.at[i, "predicted_final_loss"] = p.final_loss
        slopes.append(bias_slope(bias_by_size(again, curves.meta)).set_index("fraction"))
    values = pd.concat([s["slope_pct_per_unit_x"] for s in slopes], axis=1)
    n = values.shape[1]
    spread = values.sub(values.mean(axis=1), axis=0).pow(2).sum(axis=1)
    return np.sqrt((n - 1) / n * spread)


# ---------------------------------------------------------------- command line

INPUT_FORMAT = """\
input (CURVES, the same as `collapse analyze`):
  CSV (.csv, .csv.gz, .tsv) or Parquet files with one row per logged step and columns
    run    run name
    step   optimizer step (counted from 0 or 1)
    loss   training loss of the step (nats/token)
  optional per-step columns: tokens, t_hat (step / total steps of the full schedule);
  optional per-run metadata columns (constant within a run): size or params (what
  --reference-sizes matches), steps (the run's full length: without it the largest logged
  step is taken as the end, so a partial run needs steps or t_hat), tpp, tau, schedule, seed,
  sweep (groups runs for --sweep-report). A results/<family> directory or run directories
  holding curve.parquet work too (metadata then comes from plan/runs.csv).

method:
  the loss is smoothed by a trailing moving average (2 % of a run, at most 100 steps). Each run
  not in the reference is cut at fraction F of its own length; over the alignment window
  t_hat [max(0.2 F, 0.02), F] its final loss is predicted by
    collapse   the divisor L(T) that aligns (L - L0)/(L(T) - L0) with the reference
               (docs/method.md §5): the paper's method, shape assumed the same at every size
    drift      (with --reference-sizes of two or more sizes) collapse with what the reference
               sizes show about size: a fitted offset L0 (0 unless it brings their curves
               closer together) and a drift of the shape exponent with log parameters (else
               log flops, else the size label's number); the mean of the "offset only"
               and "drift continues" predictions
    current    the smoothed loss at F
    powerlaw   L(t) = a + b t^-c fitted on the window (a >= L0, b >= 0), extrapolated to 1
  lower/upper: collapse: 2-sigma misfit and reference band; drift: half the gap between its
  two hypotheses, the 2-sigma misfit, 2 jackknife standard errors (each reference run left
  out in turn) and half the range of its predictions with L0 fitted over t_hat 0.1-1, 0.2-1 and
  0.5-1; current: noise of the reading; powerlaw: every exponent that fits within
  twice the best squared error.

output: OUT/predictions.csv with columns run, fraction, predicted_final_loss, lower, upper,
  method, true_final_loss, abs_error_pct (the last two NaN for runs that are not complete);
  for complete runs OUT/bias_by_size.csv (mean signed error per method, fraction and size,
  and the exponent the drift method assumed there); with --reference-sizes also
  OUT/drift.json (the fitted L0, also per fit span, exponent slope, each reference size's
  exponent); with three or
  more reference sizes also OUT/held_out.csv: the largest of them predicted from the others
  by the collapse and drift methods, an extrapolation whose truth is known;
  with --sweep-report also OUT/sweep_metrics.{csv,md,png,pdf}.
"""


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "predict",
        help="predict final losses from partial curves (early stopping)",
        description="Predict each run's final loss from the first fraction(s) of its loss "
        "curve by aligning it with a reference curve (Bergsma et al. 2025, section 5), with "
        "and without a size drift fitted on the reference sizes, beside the 'current loss' and "
        "power-law baselines.",
        epilog=INPUT_FORMAT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("curves", nargs="+", metavar="CURVES", help="curve files or directories")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--reference",
        type=Path,
        metavar="DIR/reference.csv",
        help="a reference.csv (t_hat, ell, lower, upper) or the directory holding it; or a "
        "surrogate.json (the Eq. 4 fit `collapse analyze` writes), drawn at each run's own tau "
        "and tpp: a reference for controls never run",
    )
    source.add_argument(
        "--reference-sizes",
        metavar="S1,S2,...",
        help="build the reference from these sizes' complete runs (size column, else params); "
        "their runs are not predicted",
    )
    parser.add_argument(
        "--fraction",
        type=float,
        nargs="+",
        required=True,
        metavar="F",
        help="fraction(s) of each run's length to cut at, each in (0, 1) and given once, "
        "e.g. 0.1 0.2 0.3",
    )
    parser.add_argument(
        "--offset",
        type=V.finite,
        default=0.0,
        metavar="L0",
        help="irreducible loss subtracted before normalizing (default 0, the paper's choice)",
    )
    parser.add_argument(
        "--runs",
        "--runs-csv",
        dest="runs_csv",
        type=Path,
        metavar="TABLE",
        help="per-run metadata table with a run column (CSV/Parquet/YAML): size, params, "
        "steps, tpp, tau, seed, sweep of runs whose curves lack them",
    )
    parser.add_argument(
        "--loss-tag",
        default=None,
        metavar="TAG",
        help="the loss's tag in TensorBoard/W&B logs (default: the first known one a run logs)",
    )
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    parser.add_argument(
        "--sweep-report",
        action="store_true",
        help="also write per method and fraction the selected run, compute spent and, for "
        "complete runs, the error and selection regret (one sweep, or one per sweep column)",
    )
    parser.set_defaults(func=_cli)


def _fit_drift_for_cli(curves: Curves, reference_runs, targets) -> DriftFit | None:
    """The drift fit of ``--reference-sizes``, printed and written; None without them."""
    if not reference_runs:
        return None
    try:
        size_coordinate(curves.meta.loc[list(reference_runs) + list(targets)])
    except ValueError as err:
        print(f"note: no drift method: {err}", file=sys.stderr)
        return None
    drift = drift_from_sizes(curves, reference_runs)
    print(
        f"drift fitted on sizes {', '.join(drift.sizes)}: offset L0 = {drift.offset:.5g} "
        f"nats/token (jackknife standard error {drift.offset_se:.2g}), shape exponent "
        f"a = 1 + {drift.slope:.4g} (x - {drift.x_ref:.4g}), "
        f"x = {drift.coordinate}; relative spread of the reference sizes' log ell "
        f"{drift.spread_without_offset:.3g} without L0, {drift.spread_with_offset:.3g} with it"
    )
    if drift.span_fits:
        spans = ", ".join(
            f"{name} {value:.5g}"
            for name, value in drift.to_dict()["offset_L0_by_fit_span"].items()
        )
        print(f"L0 fitted over other t_hat spans (their spread widens the bounds): {spans}")
    for note in drift.notes:
        print(f"note: {note}", file=sys.stderr)
    return drift


def _write_outputs(args, work: Path, table: pd.DataFrame, curves, drift, held_out=None) -> None:
    """predictions.csv, drift.json, held_out.csv, bias_by_size.csv and the sweep report,
    written into ``work`` (the staging folder of ``args.out``) with the summaries printed."""
    table.to_csv(work / "predictions.csv", index=False, float_format="%.6g")
    if drift is not None:
        (work / "drift.json").write_text(json.dumps(drift.to_dict(), indent=2) + "\n")
    if held_out is not None and not held_out.empty:
        held_out.to_csv(work / "held_out.csv", index=False, float_format="%.6g")
        first = held_out.iloc[0]
        print(
            f"held-out check: reference size {first['size']} predicted from "
            f"{first['fitted_on']} (-> {args.out / 'held_out.csv'}), mean signed error (%):"
        )
        print(held_out.pivot_table("bias_pct", "fraction", "method").round(3).to_string())
    print(f"predicted {table['run'].nunique()} runs -> {args.out / 'predictions.csv'}")
    if table["true_final_loss"].notna().any():
        summary = table.pivot_table("abs_error_pct", "fraction", "method", aggfunc="mean")
        print("mean absolute error of the predicted final loss (%), complete runs:")
        print(summary.round(2).to_string())
        by_size = bias_by_size(table, curves.meta, drift)
        by_size.to_csv(work / "bias_by_size.csv", index=False, float_format="%.6g")
        print("bias by size: mean of 100 (predicted - true) / true (%), complete runs:")
        print(
            by_size.pivot_table("bias_pct", ["method", "fraction"], "size", sort=False)
            .round(3)
            .to_string()
        )
    if args.sweep_report:
        from collapse.sweep import sweep_metrics, truth_from_predictions, write_sweep_report

        metrics = sweep_metrics(table, truth_from_predictions(table))
        for path in write_sweep_report(metrics, work):
            print(f"wrote {args.out / path.name}")


def _cli(args: argparse.Namespace) -> int:
    """Exit status 0, or 2 with one ``error: ...`` line for bad input or flags."""
    try:
        V.check_fractions(args.fraction, "--fraction")
        curves = smooth(read_curves(args.curves, args.runs_csv, args.loss_tag))
        if args.reference is not None:
            path = args.reference / "reference.csv" if args.reference.is_dir() else args.reference
            if path.suffix == ".json":
                fit = SurrogateFit.read_json(path)
                for note in fit.notes:
                    print(f"warning: surrogate {path}: {note}", file=sys.stderr)
                reference, reference_runs = surrogate_references(curves, fit), []
            else:
                reference, reference_runs = ReferenceCurve.read_csv(path), []
        else:
            reference, reference_runs = reference_from_sizes(
                curves, args.reference_sizes.split(","), offset=args.offset
            )
        targets = [r for r in curves.runs if r not in set(reference_runs)]
        if not targets:
            raise ValueError("every run belongs to the reference: give curves of other runs too")
        drift = _fit_drift_for_cli(curves, reference_runs, targets)
        table = predict_runs(
            curves, reference, args.fraction, runs=targets, offset=args.offset, drift=drift
        )
        if table.empty:
            raise ValueError(
                f"no run reached fraction {min(args.fraction)}; give smaller --fraction values"
            )
        held_out = (
            held_out_size(curves, reference_runs, args.fraction, args.offset)
            if drift is not None
            else None
        )
        with staged_folder(args.out, "merge") as work:  # all outputs, or none on an error
            _write_outputs(args, work, table, curves, drift, held_out)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
