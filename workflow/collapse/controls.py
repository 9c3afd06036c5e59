"""The controls audit: does a run realize the AdamW timescale of the runs it is compared with?

Collapse compares runs that share their controls (docs/method.md §2: TPP, tau, schedule). A size
trained with a weight decay that was not rescaled has another tau, and in short runs that moves
its normalized curve less than the seed does (docs/experiments.md, "Fault detection"): no
loss-based detector can see it. Its optimizer can. AdamW shrinks the weights by eta_t * lambda
every step (an EMA of timescale tau_t = 1 / (eta_t * lambda * T)). For a run of T steps, the
reference's tau implies the rate s_t / (tau_ref * T), with s_t the schedule's shape (peak 1).
The audit compares that with the rate the run's optimizer applied (curve columns ``lr`` and
``weight_decay``, logged from its param groups) and fires at the first step where they differ
by more than a tolerance.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from collapse.scaling import lr_at

# Relative tolerance on eta_t * lambda. The plan realizes tau exactly (lambda is solved from
# it); 5 % leaves room for recipes set by hand and is well below what a weight decay not rescaled
# does in the tiny and smoke families (eta * lambda held: tau 1.5x and 2.3x off; lambda held:
# 9 % and 32 %).
CONTROLS_TOLERANCE = 0.05


@dataclass(frozen=True)
class ControlsAudit:
    """Realized against expected AdamW rate, step by step, for one run."""

    index: int | None  # first curve row out of tolerance (None: every logged step is within)
    ratio: np.ndarray  # realized / expected rate per row (NaN: not logged, or expected 0)
    realized_tau: float | None  # 1 / (median realized peak rate * T); None: not logged
    reference_tau: float
    tolerance: float

    @property
    def peak_deviation(self) -> float | None:
        finite = np.abs(self.ratio[np.isfinite(self.ratio)] - 1.0)
        return float(finite.max()) if len(finite) else None

    def detail(self, steps: np.ndarray) -> str:
        if self.realized_tau is None:
            return "lr or weight_decay not logged: cannot audit"
        head = f"tau {self.realized_tau:.4g} realized, the reference's {self.reference_tau:.4g}"
        if self.index is None:
            return head
        return (
            f"{head}; at step {int(steps[self.index])} eta*lambda is "
            f"{self.ratio[self.index]:.3g}x the reference's (tolerance {self.tolerance:g})"
        )


def expected_rate(
    steps: np.ndarray, warmup_steps: int, total_steps: int, reference_tau: float
) -> np.ndarray:
    """eta_t * lambda at each 1-based step for a run of ``total_steps`` at ``reference_tau``."""
    shape = np.array(
        [lr_at(int(s) - 1, peak=1.0, warmup_steps=warmup_steps, total_steps=total_steps)
         for s in steps]
    )  # fmt: skip
    return shape / (reference_tau * total_steps)


def audit(
    curve: pd.DataFrame,
    warmup_steps: int,
    total_steps: int,
    reference_tau: float,
    tolerance: float,
) -> ControlsAudit:
    """Compare the applied eta_t * lambda with the rate ``reference_tau`` implies, step by step."""
    steps = curve["step"].to_numpy()
    expected = expected_rate(steps, warmup_steps, total_steps, reference_tau)
    if "weight_decay" in curve.columns:
        realized = curve["lr"].to_numpy(float) * curve["weight_decay"].to_numpy(float)
    else:  # a curve from before the column existed
        realized = np.full(len(steps), np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(expected > 0, realized / expected, np.nan)
    finite = np.isfinite(ratio)
    off = finite & (np.abs(ratio - 1.0) > tolerance)
    hits = np.flatnonzero(off)
    realized_tau = float(reference_tau / np.median(ratio[finite])) if finite.any() else None
    return ControlsAudit(
        index=int(hits[0]) if len(hits) else None,
        ratio=ratio,
        realized_tau=realized_tau,
        reference_tau=float(reference_tau),
        tolerance=float(tolerance),
    )


def reference_tau(reference_csv: str | Path, runs_csv: str | Path | None = None) -> float | None:
    """The tau the reference's runs were planned with (median over them): from reference.json's
    ``controls``, else from the plan's runs.csv rows of the runs it names; None without either."""
    path = Path(reference_csv).parent / "reference.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    tau = (summary.get("controls") or {}).get("tau")
    if tau is not None:
        return float(tau)
    if runs_csv is None or not Path(runs_csv).is_file():
        return None
    runs = summary.get("runs") or []
    table = pd.read_csv(runs_csv)
    if "tau" not in table.columns:
        return None
    taus = table.loc[table["run"].astype(str).isin([str(r) for r in runs]), "tau"].dropna()
    return float(taus.median()) if len(taus) else None
