"""How the normalized curve drifts with size, fitted on the reference sizes, for prediction.

Source: docs/method.md §5 (prediction) and §9 (choices the paper leaves open). The paper's
predictor treats the reference's normalized shape as size-free. Measured on families that
collapse only approximately, its error then grows with the distance in size between the
reference and the predicted run (under-prediction on Qiu et al.'s µP transformers, whose larger
widths are flatter; over-prediction on a CPU family whose larger widths are steeper). Two
corrections are fitted here, from the complete curves of the reference sizes only:

offset L0
    Qiu et al. (2025, "Scaling collapse reveals universal dynamics in compute-optimally trained
    neural networks") normalize L - L0 with a fitted irreducible loss. Here L0 is the value
    that makes the reference sizes' curves L - L0 proportional: it minimizes the relative error
    of predicting each reference size's mean curve from another size's, L0 + s * (L_j - L0),
    the scale s fitted over t_hat in DRIFT_FIT_RANGE (an error in loss units: an L0 just below
    the losses is penalized, and one far below them tends to curves that differ by a constant).
    The scale is fitted, not read from the final losses, so that the noise of one smoothed
    point does not decide L0. A negative L0 is allowed: it is what a family whose larger sizes
    are steeper needs, a fitting device rather than an irreducible loss. L0 is kept only if it
    brings the sizes' normalized curves closer together (the relative spread of log ell over
    the same span) than L0 = 0; else it is 0. Two neighbouring sizes whose curves already
    collapse leave the fitting error flat in L0, and the L0 it then picks moves every larger
    size's prediction with it (Qiu et al.'s MLPs: 0.0040 fitted, where their 8 widths' final
    losses give 0.0013, and a bias that grew with width; docs/experiments.md).
exponent drift
    What L0 leaves: each reference size's log ell is fitted as a_i * g(t_hat), g the mean over
    sizes, and a_i = 1 + slope * (x_i - x_ref) with x = log parameters (else log FLOPs, else
    log of the number in the size label). A predicted size at x gets the shape
    exp((1 + slope * (x - x_ref)) * g).

The prediction ("drift" method) averages the two hypotheses about what happens beyond the
reference sizes, "the drift is all offset" (a = 1) and "the exponent drift continues
linearly in log size", because two reference sizes cannot tell them apart and extrapolating
the slope alone overshoots on measured families; the half difference between the two is part
of the prediction's uncertainty. The choice was made by measurement (benchmarks/bench_predict.py,
docs/method.md §9), one rule for every family.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd
from scipy.optimize import minimize_scalar

from collapse.curves import CurveMatrix, _size_number, nan_columns_expected, size_labels
from collapse.reference import BAND_Z, early_align
from collapse.surrogate import FIT_WINDOW

# t_hat span the reference sizes are compared over: the surrogate's fit window (docs/method.md
# §2: fits ignore the first 20 % of training). Measured against (0.02, 1): the fitted L0 lands
# nearer the one Qiu et al. fitted from their final losses (CIFAR-5M 3.133 against 3.155,
# chess 0.552 against 0.586, theirs 3.132 and 0.542).
DRIFT_FIT_RANGE = FIT_WINDOW
OFFSET_CEILING = 1 - 1e-6  # L0 stays below the lowest reference final loss (numerical guard)
OFFSET_FLOOR = -1.0  # ... and above this multiple of it (a negative L0: larger sizes steeper)
OFFSET_GRID_POINTS = 201  # L0 values tried before the bounded search refines the best one
BOUND_TOLERANCE = 1e-4  # L0 this close to an end of its range (x the lowest final) is "at" it
# Other t_hat spans the drift is fitted over, to measure how firmly the reference sizes pin L0
# down: half the range of the predictions under the three spans' fits is part of the bounds.
# Two neighbouring widths of Qiu et al.'s MLPs left L0 anywhere in -0.0013 to 0.0068 over these
# spans, and the 30 % predictions of the widest 14 % apart (measured before L0 had to lower the
# spread; docs/experiments.md); the jackknife over seeds sees none of it.
FIT_SPAN_CHECKS = ((0.1, 1.0), (0.5, 1.0))


@dataclass(frozen=True)
class DriftFit:
    """What the size-aware prediction assumes, all fitted on the reference sizes.

    ``offset``: L0 (nats/token); ``slope``: d a / d x, the change of the shape exponent per
    unit of ``coordinate`` (log parameters, log FLOPs or log of the size label's number);
    ``x_ref``: the mean x of the reference sizes, where a = 1; ``shape``: g(t_hat) =
    log ell_ref on ``t_hat``; ``exponents``: the fitted a_i per reference size;
    ``spread``: the relative spread of the reference sizes' log ell before (L0 = 0) and after
    the offset.
    """

    offset: float
    slope: float
    x_ref: float
    coordinate: str
    t_hat: np.ndarray
    shape: np.ndarray
    sizes: list[str] = field(default_factory=list)
    size_x: list[float] = field(default_factory=list)
    exponents: list[float] = field(default_factory=list)
    spread_without_offset: float = float("nan")
    spread_with_offset: float = float("nan")
    notes: list[str] = field(default_factory=list)
    replicas: list[DriftFit] = field(default_factory=list)  # jackknife: one reference run out
    span_fits: list[DriftFit] = field(default_factory=list)  # over FIT_SPAN_CHECKS
    size_shapes: np.ndarray | None = None  # log ell of each reference size's mean, on t_hat
    fit_range: tuple[float, float] = DRIFT_FIT_RANGE  # the t_hat span L0 and a were fitted on

    @property
    def offset_se(self) -> float:
        """Jackknife standard error of L0 over the replicas (NaN with fewer than two)."""
        values = np.array([r.offset for r in self.replicas])
        if len(values) < 2:
            return float("nan")
        n = len(values)
        return float(np.sqrt((n - 1) / n * np.sum((values - values.mean()) ** 2)))

    def exponent(self, x: float) -> float:
        """a at size coordinate x under the continued-drift hypothesis."""
        return 1.0 + self.slope * (float(x) - self.x_ref)

    def ell(self, x: float, exponent_drift: bool = True) -> np.ndarray:
        """Normalized shape assumed for a size at x (offset L0 subtracted)."""
        return np.exp((self.exponent(x) if exponent_drift else 1.0) * self.shape)

    def measured_shape(self, x: float) -> np.ndarray:
        """log ell at x as measured: at every t_hat, linear in x between the two fitted sizes
        around it (x clamped to the fitted span), so a fitted size gets its own mean curve."""
        if self.size_shapes is None:
            raise ValueError("the fit keeps no per-size shapes (fit_drift stores them)")
        order = np.argsort(self.size_x)
        xs, shapes = np.asarray(self.size_x)[order], self.size_shapes[order]
        x = float(np.clip(x, xs[0], xs[-1]))
        hi = int(np.clip(np.searchsorted(xs, x), 1, len(xs) - 1))
        weight = (x - xs[hi - 1]) / (xs[hi] - xs[hi - 1])
        return (1 - weight) * shapes[hi - 1] + weight * shapes[hi]

    def to_dict(self) -> dict:
        return {
            "offset_L0": self.offset,
            "exponent_slope_per_unit_x": self.slope,
            "x_ref": self.x_ref,
            "size_coordinate": self.coordinate,
            "reference_sizes": {
                s: {"x": x, "exponent": a}
                for s, x, a in zip(self.sizes, self.size_x, self.exponents, strict=True)
            },
            "relative_spread_without_offset": self.spread_without_offset,
            "relative_spread_with_offset": self.spread_with_offset,
            "jackknife_offset_L0": [r.offset for r in self.replicas],
            "offset_L0_jackknife_se": self.offset_se,
            "jackknife_exponent_slope": [r.slope for r in self.replicas],
            "offset_L0_by_fit_span": {
                _span_name(f.fit_range): f.offset for f in [self, *self.span_fits]
            },
            "notes": list(self.notes),
        }


def size_coordinate(meta: pd.DataFrame) -> tuple[pd.Series, str]:
    """x per run: log params, else log flops, else log of the number in the size label."""
    for column in ("params", "flops"):
        if column in meta.columns:
            values = pd.to_numeric(meta[column], errors="coerce")
            if values.notna().all() and (values > 0).all():
                return np.log(values.astype(float)), f"log {column}"
    numbers = size_labels(meta).map(_size_number)
    if np.isfinite(numbers).all() and (numbers > 0).all():
        return np.log(numbers.astype(float)), "log size label number"
    raise ValueError(
        "the drift of the curve shape with size needs each run's size as a number: give a "
        "params (or flops) column, or size labels with a number in them (d768, 125M)"
    )


def _log_size_means(
    matrix: CurveMatrix, labels: np.ndarray, sizes: list[str], offset: float
) -> np.ndarray:
    """log of the mean normalized curve of each size, (n_sizes, n_grid)."""
    ell = matrix.normalized(offset)
    with nan_columns_expected():
        return np.log(np.vstack([np.nanmean(ell[labels == s], axis=0) for s in sizes]))


def _relative_spread(logs: np.ndarray) -> float:
    """Spread across sizes of log ell relative to its mean square: 0 for perfect collapse."""
    with nan_columns_expected():
        center = np.nanmean(logs, axis=0)
        return float(np.nanmean(np.nanvar(logs, axis=0)) / np.nanmean(center**2))


def _size_mean_losses(
    matrix: CurveMatrix, labels: np.ndarray, sizes: list[str], cols: np.ndarray
) -> np.ndarray:
    """Mean smoothed loss of each size on the grid columns ``cols``, (n_sizes, n_cols)."""
    with nan_columns_expected():
        return np.vstack([np.nanmean(matrix.loss[labels == s][:, cols], axis=0) for s in sizes])


def _cross_prediction_error(losses: np.ndarray, offset: float) -> float:
    """Mean squared relative error of predicting each size's mean curve from another's shape.

    L_i(t) ~ L0 + s_ij * (L_j(t) - L0) for every ordered pair of sizes i != j, with the scale
    s_ij fitted by least squares over the whole span (closed form), as early-align fits the
    final loss of a run in progress. The error is the prediction's own, in loss units relative
    to L_i: an L0 just below the losses is penalized, and L0 -> -inf tends to a finite limit
    (curves differing by a constant). No single point fixes the scale: pinning s_ij to the
    ratio of the final losses lets the seed noise of the last smoothed points decide L0 (with
    two neighbouring sizes, a 0.1 % error in a final loss moves L0 by about a tenth of it).
    """
    errors = []
    for i in range(len(losses)):
        for j in range(len(losses)):
            if i == j:
                continue
            y = 1 - offset / losses[i]
            u = (losses[j] - offset) / losses[i]
            ok = np.isfinite(y) & np.isfinite(u)
            y, u = y[ok], u[ok]
            errors.append((y @ y - (u @ y) ** 2 / (u @ u)) / len(y))
    return float(np.mean(errors))


def _fit_offset(losses: np.ndarray, floor: float) -> float:
    """The L0 in [OFFSET_FLOOR, OFFSET_CEILING] x ``floor`` minimizing the cross-prediction error.

    A grid of OFFSET_GRID_POINTS values first (the error can have more than one minimum over
    so wide a range), then a bounded scalar search between the best value's neighbours.
    """
    grid = np.linspace(OFFSET_FLOOR * floor, OFFSET_CEILING * floor, OFFSET_GRID_POINTS)
    k = int(np.argmin([_cross_prediction_error(losses, l0) for l0 in grid]))
    lo, hi = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]
    result = minimize_scalar(
        lambda l0: _cross_prediction_error(losses, l0),
        bounds=(lo, hi),
        method="bounded",
        options={"xatol": 1e-7 * abs(floor)},
    )
    return float(result.x)


def _offset_bound_notes(offset: float, floor: float) -> list[str]:
    """A note when L0 lands on an end of its search range: the reference sizes then tell
    nothing about an offset, and L0 only encodes that their curves are closer to differing by
    a constant (floor) or to sharing an asymptote at their lowest loss (ceiling)."""
    near = BOUND_TOLERANCE * abs(floor)
    if abs(offset - OFFSET_FLOOR * floor) < near:
        where = (
            f"the lower end of its search range ({OFFSET_FLOOR:g} x the lowest reference final "
            "loss): the reference sizes' curves are nearer to differing by a constant than to "
            "being proportional after any L0"
        )
    elif abs(offset - OFFSET_CEILING * floor) < near:
        where = (
            "the lowest reference final loss: no L0 below the losses makes the curves proportional"
        )
    else:
        return []
    return [
        f"L0 = {offset:.4g} sits at {where}. It is a fitting device, not an irreducible loss, "
        "and the predictions beyond the reference sizes rest on it: check them on one larger "
        "size trained to the end before stopping runs on them (given a third reference size, "
        "`collapse predict` does, in held_out.csv)"
    ]


def _span_name(span: tuple[float, float]) -> str:
    return f"{span[0]:g}-{span[1]:g}"


def _exponent(log_ell: np.ndarray, shape: np.ndarray) -> float:
    """a in log ell_i = c_i + a * g: the slope of a size's log ell against the mean shape.

    The intercept c_i is free, so an error in the size's final loss (a constant in log ell)
    does not enter a; over sizes the a average to 1, since g is their mean.
    """
    ok = np.isfinite(log_ell) & np.isfinite(shape)
    x, y = shape[ok] - shape[ok].mean(), log_ell[ok] - log_ell[ok].mean()
    return float(x @ y / (x @ x))


def fit_drift(
    matrix: CurveMatrix,
    *,
    offset: float | None = None,
    fit_range: tuple[float, float] = DRIFT_FIT_RANGE,
) -> DriftFit:
    """Fit L0 (unless ``offset`` is given) and the exponent drift on complete reference runs.

    ``matrix``: the reference runs' smoothed curves on a common grid (``curves.resample``);
    their metadata must name sizes and give a size coordinate (``size_coordinate``). With one
    reference size neither can be fitted: L0 stays 0 (or ``offset``), the slope 0, and a note
    says so.
    """
    final = matrix.meta["final_loss"].to_numpy(float)
    if len(final) == 0 or not np.isfinite(final).all():
        raise ValueError("the drift fit needs complete reference runs (every one reaching t_hat 1)")
    labels = size_labels(matrix.meta).to_numpy()
    sizes = list(pd.unique(labels))
    x_run, coordinate = size_coordinate(matrix.meta)
    size_x = [float(x_run[labels == s].mean()) for s in sizes]
    cols = (matrix.grid >= fit_range[0]) & (matrix.grid <= fit_range[1])
    notes = []

    def spread(l0: float) -> float:
        return _relative_spread(_log_size_means(matrix, labels, sizes, l0)[:, cols])

    if len(sizes) < 2:
        notes.append(
            "one reference size: no drift with size can be fitted (L0 and slope left as given); "
            "give two or more reference sizes"
        )
        fitted = 0.0 if offset is None else float(offset)
        spreads = (float("nan"), float("nan"))
    elif offset is None:
        fitted = _fit_offset(_size_mean_losses(matrix, labels, sizes, cols), float(np.min(final)))
        with_offset, without = spread(fitted), spread(0.0)
        spreads = (without, with_offset)
        if with_offset < without:
            notes.extend(_offset_bound_notes(fitted, float(np.min(final))))
        else:
            notes.append(
                f"the fitted L0 = {fitted:.4g} does not bring the reference sizes' curves closer "
                f"together than L0 = 0 (relative spread of log ell {with_offset:.3g} against "
                f"{without:.3g}), so L0 = 0 is used and the drift is left to the shape exponent"
            )
            fitted, spreads = 0.0, (without, without)
    else:
        fitted = float(offset)
        spreads = (spread(0.0), spread(fitted))
    logs = _log_size_means(matrix, labels, sizes, fitted)
    with nan_columns_expected():
        shape = np.nanmean(logs, axis=0)
    g = shape[cols]
    exponents = [_exponent(row[cols], g) for row in logs]
    x_ref = float(np.mean(size_x))
    slope = float(np.polyfit(np.subtract(size_x, x_ref), exponents, 1)[0]) if len(sizes) > 1 else 0
    return DriftFit(
        offset=fitted,
        slope=slope,
        x_ref=x_ref,
        coordinate=coordinate,
        t_hat=matrix.grid.copy(),
        shape=shape,
        sizes=[str(s) for s in sizes],
        size_x=size_x,
        exponents=exponents,
        spread_without_offset=spreads[0],
        spread_with_offset=spreads[1],
        notes=notes,
        size_shapes=logs,
        fit_range=tuple(fit_range),
    )


def fit_drift_jackknife(matrix: CurveMatrix) -> DriftFit:
    """``fit_drift`` plus its replicas with each reference run left out in turn, and its fits
    over the other spans of FIT_SPAN_CHECKS.

    The replicas measure how much L0 and the slope rest on single seeds, the span fits how much
    they rest on the stretch of the curves compared: ``predict_drift`` adds both spreads to the
    bounds. A run is left out only where its size keeps another run.
    """
    fit = fit_drift(matrix)
    if len(fit.sizes) < 2:
        return fit
    fit = replace(fit, span_fits=[fit_drift(matrix, fit_range=span) for span in FIT_SPAN_CHECKS])
    labels = size_labels(matrix.meta).to_numpy()
    replicas = []
    for i in range(len(labels)):
        if np.sum(labels == labels[i]) < 2:
            continue
        keep = np.ones(len(labels), dtype=bool)
        keep[i] = False
        replicas.append(fit_drift(matrix.select(keep)))
    return replace(fit, replicas=replicas)


@dataclass(frozen=True)
class DriftPrediction:
    """The averaged prediction, both hypotheses, and the bounds (nats/token)."""

    final_loss: float
    lower: float
    upper: float
    offset_only: float
    continued_drift: float
    exponent: float


def predict_drift(
    t_hat: np.ndarray,
    loss: np.ndarray,
    fit: DriftFit,
    x: float,
    window: tuple[float, float],
    z: float = BAND_Z,
) -> DriftPrediction:
    """Early-align a partial curve (size coordinate ``x``) with the drifted shapes.

    Each hypothesis aligns L - L0 with its shape over ``window`` in log space
    (``reference.early_align``); the prediction is their mean. Bounds: the half difference of
    the two, the z-sigma misfit of the alignment, z times the jackknife standard error over
    the fit's replicas and half the range of the predictions under the fits over other t_hat
    spans (``fit_drift_jackknife``), combined in quadrature.
    """

    def both_hypotheses(f: DriftFit):
        kept = early_align(t_hat, loss, f.t_hat, f.ell(x, True), window=window, offset=f.offset)
        flat = early_align(t_hat, loss, f.t_hat, f.ell(x, False), window=window, offset=f.offset)
        return kept, flat

    both, flat = both_hypotheses(fit)
    center = 0.5 * (both.final_loss + flat.final_loss)
    misfit = (center - fit.offset) * (np.exp(z * max(both.log_scatter, flat.log_scatter)) - 1)
    jackknife = 0.0
    if len(fit.replicas) > 1:
        values = np.array(
            [0.5 * sum(p.final_loss for p in both_hypotheses(r)) for r in fit.replicas]
        )
        n = len(values)
        jackknife = z * float(np.sqrt((n - 1) / n * np.sum((values - values.mean()) ** 2)))
    by_span = [center]
    for f in fit.span_fits:
        try:
            value = 0.5 * sum(p.final_loss for p in both_hypotheses(f))
        except ValueError:  # a check on L0, not the prediction: one that cannot align is left out
            continue
        if np.isfinite(value):
            by_span.append(value)
    span = 0.5 * (max(by_span) - min(by_span))
    half = float(
        np.linalg.norm([0.5 * abs(both.final_loss - flat.final_loss), misfit, jackknife, span])
    )
    return DriftPrediction(
        final_loss=float(center),
        lower=float(center - half),
        upper=float(center + half),
        offset_only=float(flat.final_loss),
        continued_drift=float(both.final_loss),
        exponent=fit.exponent(x),
    )
