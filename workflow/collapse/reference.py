"""The family's reference curve and early-align (docs/method.md §§3-4).

The reference is the mean normalized curve of the reference sizes (all their seeds), with a band
and the seed noise the gates calibrate their threshold from. Early-align normalizes a run that
is still in progress: the divisor L(T) that best matches its partial curve to the reference over
a window (25-50 % of training by default) is its predicted final loss.

reference.csv columns: ``t_hat, ell, lower, upper`` (the contract the monitor reads), plus
``seed_std`` (pooled within-size seed std of the early-aligned reference curves) and
``n_curves``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from collapse.curves import CurveMatrix, nan_columns_expected, normalize, size_labels

ALIGN_WINDOW = (0.25, 0.5)  # docs/method.md §3: the paper aligns over 25-50 % of training
BAND_Z = 2.0  # reference band: mean +- 2 std over the reference curves
REFERENCE_COLUMNS = ("t_hat", "ell", "lower", "upper")


# ---------------------------------------------------------------- early-align


@dataclass(frozen=True)
class AlignResult:
    """Early-align of one partial curve: the predicted final loss L(T) and its uncertainty.

    ``lower``/``upper`` = L0 + (L(T) - L0) * exp(-/+ z * log_scatter): the band of divisors the
    residual scatter allows. ``log_scatter`` is the std of log((L - L0) / ell_ref) over the
    window: 0 for a curve of exactly the reference's shape.
    """

    final_loss: float
    lower: float
    upper: float
    log_scatter: float
    n_points: int
    window: tuple[float, float]
    offset: float = 0.0


def _check_window(window: tuple[float, float]) -> tuple[float, float]:
    lo, hi = float(window[0]), float(window[1])
    if not 0.0 <= lo < hi <= 1.0:
        raise ValueError(f"align window {window} must satisfy 0 <= start < end <= 1 (t_hat)")
    return lo, hi


def early_align(
    t_hat: np.ndarray,
    loss: np.ndarray,
    ref_t_hat: np.ndarray,
    ref_ell: np.ndarray,
    window: tuple[float, float] = ALIGN_WINDOW,
    offset: float = 0.0,
    z: float = BAND_Z,
) -> AlignResult:
    """The L(T) that best aligns a partial (smoothed) curve with the reference over ``window``.

    Source: docs/method.md §3 ("early-align"). Least squares in log space:
    log(L(t) - L0) = log(L(T) - L0) + log ell_ref(t) + e(t), so log(L(T) - L0) = mean(...),
    which weighs relative errors equally at every t_hat. Uses the run's own points inside the
    window (the reference is interpolated there); raises if the curve has none there.
    """
    lo, hi = _check_window(window)
    t_hat, loss = np.asarray(t_hat, dtype=float), np.asarray(loss, dtype=float)
    inside = (t_hat >= lo) & (t_hat <= hi) & np.isfinite(loss)
    if inside.sum() < 1:
        raise ValueError(
            f"the partial curve has no finite point in the align window t_hat {window} "
            f"(it has {len(t_hat)} points, up to t_hat {np.max(t_hat, initial=0.0):.3g}); "
            "wait until it is past the window or give an earlier window"
        )
    ref = np.interp(t_hat[inside], np.asarray(ref_t_hat, float), np.asarray(ref_ell, float))
    with np.errstate(invalid="ignore", divide="ignore"):
        log_ratio = np.log(loss[inside] - offset) - np.log(ref)
    if not np.isfinite(log_ratio).all():
        raise ValueError(
            f"loss - offset must be > 0 in the align window (offset L0 = {offset}); "
            "lower --offset below the smallest loss"
        )
    log_c = float(log_ratio.mean())
    scatter = float(log_ratio.std(ddof=1)) if len(log_ratio) > 1 else 0.0
    c = np.exp(log_c)
    return AlignResult(
        final_loss=offset + c,
        lower=offset + c * np.exp(-z * scatter),
        upper=offset + c * np.exp(z * scatter),
        log_scatter=scatter,
        n_points=int(inside.sum()),
        window=(lo, hi),
        offset=offset,
    )


def early_align_matrix(
    grid: np.ndarray,
    loss: np.ndarray,
    ref_ell: np.ndarray,
    window: tuple[float, float] = ALIGN_WINDOW,
    offset: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized ``early_align`` for many curves on one grid: (final_loss, log_scatter) per row.

    ``loss`` is (n_runs, n_grid) on ``grid``; ``ref_ell`` is the reference on the same grid.
    Rows with no finite point in the window get NaN.
    """
    lo, hi = _check_window(window)
    cols = (grid >= lo) & (grid <= hi)
    with np.errstate(invalid="ignore", divide="ignore"):
        log_ratio = np.log(np.atleast_2d(loss)[:, cols] - offset) - np.log(ref_ell[cols])
    log_ratio[~np.isfinite(log_ratio)] = np.nan
    n = np.sum(np.isfinite(log_ratio), axis=1)
    with np.errstate(invalid="ignore"):
        total = np.nansum(log_ratio, axis=1)
        log_c = np.where(n > 0, total / np.maximum(n, 1), np.nan)
        dev = np.nansum((log_ratio - log_c[:, None]) ** 2, axis=1)
        scatter = np.where(
            n > 1, np.sqrt(dev / np.maximum(n - 1, 1)), np.where(n == 1, 0.0, np.nan)
        )
    return offset + np.exp(log_c), scatter


def aligned_residuals(
    matrix: CurveMatrix,
    ref_ell: np.ndarray,
    window: tuple[float, float] = ALIGN_WINDOW,
    offset: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """r(t_hat) = ell_run - ell_ref with each run early-aligned (docs/method.md §4).

    Returns (residual matrix (n_runs, n_grid), aligned final loss per run).
    """
    final, _ = early_align_matrix(matrix.grid, matrix.loss, ref_ell, window, offset)
    return normalize(matrix.loss, final, offset) - ref_ell[None, :], final


# ---------------------------------------------------------------- the reference curve


@dataclass(frozen=True)
class ReferenceCurve:
    """Mean normalized curve of the reference runs, its band and the seed noise (per t_hat)."""

    t_hat: np.ndarray
    ell: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    seed_std: np.ndarray  # pooled within-size seed std of early-aligned curves; NaN: no seeds
    n_curves: np.ndarray
    sizes: list[str] = field(default_factory=list)

    def at(self, t_hat: np.ndarray | float) -> np.ndarray:
        """ell_ref interpolated at ``t_hat``."""
        return np.interp(t_hat, self.t_hat, self.ell)

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(
            {
                "t_hat": self.t_hat,
                "ell": self.ell,
                "lower": self.lower,
                "upper": self.upper,
                "seed_std": self.seed_std,
                "n_curves": self.n_curves,
            }
        )

    def write_csv(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.to_frame().to_csv(path, index=False, float_format="%.8g")
        return path

    @classmethod
    def from_frame(cls, df: pd.DataFrame, sizes: list[str] | None = None) -> ReferenceCurve:
        missing = [c for c in REFERENCE_COLUMNS if c not in df.columns]
        if missing:
            raise ValueError(
                f"reference table lacks column(s) {missing}; it needs t_hat, ell, lower, upper "
                "(the reference.csv that `collapse analyze` writes)"
            )
        df = df.sort_values("t_hat")
        nan = np.full(len(df), np.nan)
        return cls(
            t_hat=df["t_hat"].to_numpy(float),
            ell=df["ell"].to_numpy(float),
            lower=df["lower"].to_numpy(float),
            upper=df["upper"].to_numpy(float),
            seed_std=df["seed_std"].to_numpy(float) if "seed_std" in df else nan,
            n_curves=df["n_curves"].to_numpy(float) if "n_curves" in df else nan,
            sizes=list(sizes or []),
        )

    @classmethod
    def read_csv(cls, path: str | Path) -> ReferenceCurve:
        return cls.from_frame(pd.read_csv(path))


def pooled_seed_std(values: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """Within-group std (ddof 1) pooled over groups with >= 2 members, per column.

    sqrt(sum_g (n_g - 1) var_g / sum_g (n_g - 1)): the seed noise of one size, averaged over
    sizes, with the cross-size differences left out. NaN where no group has two members.
    """
    num = np.zeros(values.shape[1])
    dof = np.zeros(values.shape[1])
    for g in pd.unique(groups):
        rows = values[groups == g]
        counts = np.sum(np.isfinite(rows), axis=0)
        if rows.shape[0] < 2:
            continue
        with nan_columns_expected():
            var = np.nanvar(rows, axis=0, ddof=1)
        ok = counts >= 2
        num[ok] += (counts[ok] - 1) * var[ok]
        dof[ok] += counts[ok] - 1
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(dof > 0, np.sqrt(num / dof), np.nan)


def reference_curve(
    matrix: CurveMatrix,
    offset: float = 0.0,
    window: tuple[float, float] = ALIGN_WINDOW,
    band_z: float = BAND_Z,
) -> ReferenceCurve:
    """The reference from complete runs of the reference sizes (docs/method.md §5, step 1).

    ell_ref = mean over sizes and seeds of ell = (L - L0)/(L(T) - L0); band = mean +- z std
    (zero width for a single curve). ``seed_std``: the runs early-aligned to ell_ref, then the
    pooled within-size seed std, the noise a clean run of these sizes shows after early-align.
    """
    if len(matrix.meta) == 0:
        raise ValueError("no reference runs: name reference sizes that have complete runs")
    incomplete = matrix.meta.index[~np.isfinite(matrix.meta["final_loss"].to_numpy(float))]
    if len(incomplete):
        raise ValueError(
            f"reference runs must be complete (reach t_hat 1), these are not: "
            f"{list(incomplete)[:5]}; finish them or leave their size out of the reference"
        )
    ell = matrix.normalized(offset)
    n = np.sum(np.isfinite(ell), axis=0)
    with nan_columns_expected():
        mean = np.nanmean(ell, axis=0)
        std = np.where(n > 1, np.nanstd(ell, axis=0, ddof=1 if len(ell) > 1 else 0), 0.0)
    final, _ = early_align_matrix(matrix.grid, matrix.loss, mean, window, offset)
    aligned = normalize(matrix.loss, final, offset)
    sizes = size_labels(matrix.meta).to_numpy()
    return ReferenceCurve(
        t_hat=matrix.grid.copy(),
        ell=mean,
        lower=mean - band_z * std,
        upper=mean + band_z * std,
        seed_std=pooled_seed_std(aligned, sizes),
        n_curves=n.astype(float),
        sizes=list(pd.unique(sizes)),
    )
