"""The size drift in a sweep's predictions: fitted on the family's own sizes, applied per tau.

Source: docs/method.md §5 (the sweep's prediction) and §9 (size drift, ``collapse.drift``). A
sweep predicts each variant against the small run trained at the variant's tau (the paper's one
reference per combination of controls). That run is one size, so the drift of the normalized
shape with size cannot be fitted from it: the paper's method carries it into every variant's
prediction, the more the further the variant's size is from the reference's. The family's own
sizes, trained to the end at the sweep's TPP band and the family's tau, do show the drift:
``collapse.drift.fit_drift`` fits an offset L0 and a slope of the shape exponent in log size on
them. Applied to a variant at another tau, under the assumption that the drift does not depend
on tau:

    log ell_tau(x) = log ell_tau(x_r) * D(x) / D(x_r),   ell = (L - L0) / (L(T) - L0)

with x_r the size of the variant's reference run, whose curve normalized with L0 gives
ell_tau(x_r), and D(x) the family's mean log ell at x, measured at its fitted sizes and
interpolated linearly in log size at every t_hat. Between the fitted sizes the drift is
measured, so it is used as measured: on tiny's sweep a change of exponent alone, a(x) =
1 + slope (x - x_ref), missed that the wider sizes differ early in training only (docs/method.md
§9). Where the drift is an exponent drift, the ratio equals a(x) / a(x_r) whatever the tau's own
shape. Beyond the fitted sizes, as in ``collapse.drift.predict_drift``, two hypotheses are
averaged: the drift stops at the nearest fitted size or continues from there by the exponent;
their half difference enters the uncertainty with the alignment misfit and the jackknife over
the family's runs. (``predict_drift``'s own "all offset" hypothesis, a = 1 at every size, would
discard the measured drift between the reference run's size and the variant's: 4.5 % error on
a synthetic exponent drift, docs/experiments.md, *Sweep prediction with the size drift*.)

Runs at the size of a variant are left out of the fit: at the family's tau such a run is a
variant's own future (a variant stopped early can be the first part of it). Where fewer than two
sizes remain, or the sizes carry no number, the sweep keeps the paper's method only and says why.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from collapse.curves import Curves, nan_columns_expected, resample, size_labels
from collapse.drift import DriftFit, fit_drift_jackknife, predict_drift, size_coordinate
from collapse.predict import DRIFT_METHOD, _prediction_row, alignment_window
from collapse.roles import Role

ASSUMPTION = (
    "the size drift fitted on the family's own sizes at its tau (offset L0; the change of the "
    "normalized shape as measured between the fitted sizes, by the shape exponent's slope in "
    "log size beyond them) holds at every tau of the sweep"
)
TAU_RTOL = 1e-6  # the planner's realized tau differs by float noise across sizes


def drift_fit_runs(runs: pd.DataFrame, sweep: str) -> list[str]:
    """The family runs a sweep's size drift is fitted on (plan table or runs.csv rows).

    Full-length family runs at the sweep's TPP band and the family's tau there (the tau most
    sizes were trained at, when the band has several), without the sizes of the sweep's
    variants. Empty when the sweep has no variants or the band no family runs.
    """
    table = runs.reset_index() if "run" not in runs.columns else runs
    variants = table[(table["role"] == Role.SWEEP) & (table["sweep"].astype(str) == sweep)]
    if variants.empty:
        return []
    family = table[(table["role"] == Role.FAMILY) & table["tpp_band"].isin(variants["tpp_band"])]
    if "stop_fraction" in family.columns:
        family = family[pd.to_numeric(family["stop_fraction"], errors="coerce") >= 1 - 1e-9]
    family = family[~family["size"].isin(set(variants["size"]))]
    if family.empty:
        return []
    taus = family["tau"].to_numpy(float)
    groups = [np.isclose(taus, t, rtol=TAU_RTOL) for t in taus]
    best = max(groups, key=lambda g: (family["size"][g].nunique(), g.sum()))
    return list(family["run"][best])


def fit_sweep_drift(curves: Curves, runs: list[str]) -> tuple[DriftFit | None, str]:
    """``fit_drift_jackknife`` on the complete ``runs`` of ``curves`` (smoothed); or None and
    the reason it cannot be fitted."""
    have = [r for r in runs if r in curves.meta.index and bool(curves.meta.at[r, "complete"])]
    missing = sorted(set(runs) - set(have))
    why = f" ({len(missing)} of the family's runs are missing or incomplete)" if missing else ""
    sizes = size_labels(curves.meta.loc[have]).nunique() if have else 0
    if sizes < 2:
        return None, (
            f"the family has {sizes} size(s) trained to the end at the sweep's tau and TPP "
            f"besides the variants' size{why}; the size drift needs two or more, so the sweep "
            "predicts with the paper's method only"
        )
    try:
        fit = fit_drift_jackknife(resample(curves.select(have)))
    except ValueError as err:
        return None, f"the size drift cannot be fitted ({err}); the paper's method only"
    notes = "".join(f"; note: {note}" for note in fit.notes)
    return fit, f"size drift fitted on {', '.join(fit.sizes)}{why}{notes}"


def transfer(
    fit: DriftFit, curves: Curves, reference_runs: list[str], x_reference: float, x_stop: float
) -> DriftFit:
    """The fit moved to another tau: its shape becomes the reference runs' (their seeds' mean
    normalized curve, normalized with L0).

    Inside the fitted sizes log ell changes by the family's measured ratio at every t_hat:
    log ell_tau(x) = log ell_tau(x_r) * D(x) / D(x_r), D = ``DriftFit.measured_shape`` (exact
    when the drift is a change of the shape exponent, whatever the tau's own shape). A
    reference run outside them is first brought to the nearest fitted size x_near by the
    exponent, log ell_tau(x_r) * a(x_near) / a(x_r). So the result's
    ``ell(x, exponent_drift=False)`` is the shape at ``x_stop`` (``stop_point``), and its
    ``ell(x)`` continues from there by the exponent, ell_stop ** (a(x) / a(x_stop)): the two
    hypotheses ``drift.predict_drift`` averages, equal inside the fitted sizes. The ratio is
    meant for the early alignment window; near t_hat 1, where D tends to 0, it is noise (NaN at
    t_hat 1). The jackknife replicas and the fits over other spans move alike, each with its own
    L0, slope and measured shapes.
    """
    matrix = resample(curves.select(reference_runs))
    x_near = stop_point(fit, x_reference)

    def moved(f: DriftFit) -> DriftFit:
        a_ref, a_near, a_stop = f.exponent(x_reference), f.exponent(x_near), f.exponent(x_stop)
        if not (a_ref > 0 and a_stop > 0):
            raise ValueError(
                f"the fitted shape exponent is {min(a_ref, a_stop):.3g} at a sweep run's size: "
                "the size drift does not extrapolate that far"
            )
        if not np.array_equal(matrix.grid, f.t_hat):
            raise ValueError("the reference run and the drift fit are on different t_hat grids")
        with np.errstate(invalid="ignore", divide="ignore"), nan_columns_expected():
            log_ell = np.log(np.nanmean(matrix.normalized(f.offset), axis=0))
            measured = f.measured_shape(x_stop) / f.measured_shape(x_near)
        return replace(
            f,
            slope=f.slope / a_stop,
            x_ref=float(x_stop),
            t_hat=matrix.grid,
            shape=log_ell * a_near / a_ref * measured,
        )

    return replace(
        moved(fit),
        replicas=[moved(r) for r in fit.replicas],
        span_fits=[m for f in fit.span_fits if (m := _moved_or_none(moved, f)) is not None],
    )


def _moved_or_none(moved, fit: DriftFit) -> DriftFit | None:
    """A span fit whose exponent cannot reach a sweep run's size is left out of the bounds
    rather than stopping the sweep: it is a check on L0, not the prediction."""
    try:
        return moved(fit)
    except ValueError:
        return None


def stop_point(fit: DriftFit, x: float) -> float:
    """x clamped to the span of the fitted sizes: where the drift stops if it stops."""
    return float(np.clip(x, min(fit.size_x), max(fit.size_x)))


def predict_sweep_drift(
    curves: Curves,
    fit: DriftFit,
    reference_runs: list[str],
    variants: list[str],
    fractions: list[float],
) -> pd.DataFrame:
    """DRIFT_METHOD rows (``predict.PREDICTION_COLUMNS``) of the variants sharing one reference
    (``reference_runs``: the seeds of one small run, averaged).

    ``curves`` smoothed, holding the variants and the reference runs; their sizes must carry the
    coordinate the fit was made in (``drift.size_coordinate``).
    """
    x, coordinate = size_coordinate(curves.meta.loc[[*reference_runs, *variants]])
    if coordinate != fit.coordinate:
        raise ValueError(
            f"the size drift was fitted in {fit.coordinate} but the sweep's runs give "
            f"{coordinate}: give every run the same size column (params)"
        )
    data = dict(tuple(curves.data.groupby("run", sort=False, observed=True)))
    rows = []
    for run in variants:
        t_hat = data[run]["t_hat"].to_numpy(float)
        loss = data[run]["loss_smooth"].to_numpy(float)
        truth = float(loss[-1]) if bool(curves.meta.at[run, "complete"]) else np.nan
        x_run = float(x[run])
        moved = transfer(
            fit, curves, reference_runs, float(x[reference_runs].mean()), stop_point(fit, x_run)
        )
        for fraction in fractions:
            if t_hat.max() < fraction - 1e-9:
                continue
            keep = t_hat <= fraction + 1e-9
            p = predict_drift(t_hat[keep], loss[keep], moved, x_run, alignment_window(fraction))
            rows.append(_prediction_row(run, fraction, DRIFT_METHOD, p, truth))
    return pd.DataFrame(rows)
