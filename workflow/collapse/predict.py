"""Predict a run's final loss from a partial curve, to stop losing sweep settings early.

Source: PAPER.md section 5 (Bergsma et al. 2025, arXiv 2509.25087): the divisor L(T) that best
aligns the partial normalized curve with the same segment of the reference curve is the
predicted final loss. Two baselines sit beside it, because the paper compares against them:
"current" (the loss now) and a power-law extrapolation of the partial curve. Under a
decay-to-zero schedule the loss drops sharply late in training, so both baselines overestimate.

Every function here works on plain arrays (t_hat = step / total steps of the full-length
schedule, loss already smoothed by a trailing window); the command `collapse predict` does the
loading, cutting and smoothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import lsq_linear

from collapse.reference import early_align

METHODS = ("collapse", "current", "powerlaw")

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

    Source: PAPER.md sections 3 and 5: ell(t_hat) = (L(t_hat T) - L0) / (L(T) - L0), so over the
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

    Source: PAPER.md section 5 (the run ahead at the stopping point). Bounds: plus/minus the RMS
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
