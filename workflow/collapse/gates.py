"""Collapse gates: does a run follow the family's reference curve? (docs/method.md §4)

The residual r(t_hat) = ell_run(t_hat) - ell_ref(t_hat), with the run normalized by early-align
(its L(T) chosen to match the reference over the align window, so a fault late in training
cannot hide itself by shifting the normalization). The run passes when |r| stays within the
threshold over the gate window.

Threshold policy (the paper publishes no value): calibrated from the seed noise of the
reference sizes, threshold = max(floor, k_sigma * max over the gate window of seed_std(t_hat)),
where seed_std is the pooled within-size seed std of the early-aligned reference curves
(reference.csv column ``seed_std``). With no seed noise available (one seed per reference size)
the floor alone is used. ``GatePolicy.threshold`` fixes the value instead; ``enforce = False``
records a failed verdict without blocking (the per-run override of the config).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator

from collapse.reference import ALIGN_WINDOW, ReferenceCurve


class GatePolicy(BaseModel):
    """How a gate decides; extra keys (e.g. the family config's ``allow_fail``) are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    k_sigma: float = Field(4.0, gt=0)  # threshold = k_sigma x reference seed noise ...
    floor: float = Field(0.005, ge=0)  # ... but never below this (ell units: 0.005 = 0.5 %)
    threshold: float | None = Field(None, gt=0)  # a fixed threshold replaces the calibration
    window: tuple[float, float] = (0.2, 1.0)  # t_hat span where |r| is checked
    align_window: tuple[float, float] = ALIGN_WINDOW  # t_hat span early-align fits L(T) on
    enforce: bool = True  # False: a failed gate is recorded but does not block downstream jobs

    @field_validator("window", "align_window")
    @classmethod
    def _ordered(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not 0.0 <= value[0] < value[1] <= 1.0:
            raise ValueError(f"window {value} must satisfy 0 <= start < end <= 1 (t_hat)")
        return value


class GateVerdict(BaseModel):
    """The JSON a gate writes for one run (DESIGN.md: what diverged, where, by how much)."""

    run: str
    passed: bool
    # "pass", "fail", "overridden" (failed, not enforced) or "undetermined" (too little curve to
    # decide: passed is False, but it blocks nothing)
    status: str
    max_abs_residual: float | None  # max |r| over the gate window (ell units)
    at_t_hat: float | None  # where that maximum is
    residual_at_max: float | None  # signed r there: > 0 means the run is above the reference
    threshold: float
    threshold_basis: str
    first_crossing_t_hat: float | None  # first t_hat in the window with |r| > threshold
    window: tuple[float, float]
    align_window: tuple[float, float]
    aligned_final_loss: float | None  # L(T) chosen by early-align (nats/token)
    final_loss: float | None  # the run's own smoothed L(T) when complete
    reference_sizes: list[str]
    plot: str
    message: str

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.model_dump(mode="json"), indent=2) + "\n")
        return path


MIN_ALIGN_POINTS = 1  # early-align fixes L(T) from the logged points inside its window


class GateFailed(RuntimeError):
    """Raised where a failed, enforced gate must stop the run's downstream jobs."""


def calibrate_threshold(reference: ReferenceCurve, policy: GatePolicy) -> tuple[float, str]:
    """The gate threshold (ell units) and a sentence saying where it came from."""
    if policy.threshold is not None:
        return float(policy.threshold), f"fixed by policy ({policy.threshold:g})"
    lo, hi = policy.window
    cols = (reference.t_hat >= lo) & (reference.t_hat <= hi)
    noise = reference.seed_std[cols]
    noise = noise[np.isfinite(noise)]
    if len(noise) == 0:
        return float(policy.floor), (
            f"floor {policy.floor:g}: the reference has no seed noise (one seed per size)"
        )
    calibrated = policy.k_sigma * float(noise.max())
    if calibrated < policy.floor:
        return float(policy.floor), (
            f"floor {policy.floor:g} (k_sigma {policy.k_sigma:g} x reference seed std "
            f"{noise.max():.2g} = {calibrated:.2g} is below it)"
        )
    return calibrated, f"{policy.k_sigma:g} x reference seed std {noise.max():.3g}"


def _fmt(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def evaluate_gate(
    run: str,
    t_hat: np.ndarray,
    residual: np.ndarray,
    reference: ReferenceCurve,
    policy: GatePolicy,
    *,
    aligned_final_loss: float | None = None,
    final_loss: float | None = None,
    t_hat_max: float | None = None,
    align_points: int | None = None,
    plot: str = "",
) -> GateVerdict:
    """The verdict for one run from its early-aligned residual r(t_hat) (docs/method.md §4).

    A non-finite residual inside the window (a NaN or infinite loss) counts as a crossing. A run
    that stops before the end of the align window, or logs fewer than ``MIN_ALIGN_POINTS``
    points inside it (``align_points``), cannot be normalized: its verdict is "undetermined",
    neither passed nor failed, so it is never counted as following the reference.
    """
    threshold, basis = calibrate_threshold(reference, policy)
    t_hat, residual = np.asarray(t_hat, float), np.asarray(residual, float)
    t_end = float(np.nanmax(t_hat)) if t_hat_max is None else float(t_hat_max)
    lo, hi = policy.window
    sizes = ", ".join(reference.sizes) or "?"
    common = dict(
        run=run,
        threshold=threshold,
        threshold_basis=basis,
        window=policy.window,
        align_window=policy.align_window,
        aligned_final_loss=_finite_or_none(aligned_final_loss),
        final_loss=_finite_or_none(final_loss),
        reference_sizes=list(reference.sizes),
        plot=str(plot),
    )
    reason = None
    if t_end < policy.align_window[1]:
        reason = (
            f"the curve ends at t_hat {t_end:.3f}, before the end of the align window "
            f"{policy.align_window[1]:g}, so it cannot be normalized yet"
        )
    elif align_points is not None and align_points < MIN_ALIGN_POINTS:
        reason = (
            f"{align_points} logged points lie in the align window t_hat "
            f"[{policy.align_window[0]:g}, {policy.align_window[1]:g}], so nothing fixes its final "
            "loss: log the loss more often"
        )
    if reason is not None:
        return GateVerdict(
            passed=False,
            status="undetermined",
            max_abs_residual=None,
            at_t_hat=None,
            residual_at_max=None,
            first_crossing_t_hat=None,
            message=f"{run}: undetermined: {reason}",
            **common,
        )
    cols = (t_hat >= lo) & (t_hat <= min(hi, t_end) + 1e-12)
    t_win, r_win = t_hat[cols], residual[cols]
    finite = np.isfinite(r_win)
    abs_r = np.where(finite, np.abs(r_win), np.inf)
    crossing = np.flatnonzero(abs_r > threshold)
    first = float(t_win[crossing[0]]) if len(crossing) else None
    if finite.any():
        i = int(np.argmax(np.where(finite, np.abs(r_win), -1.0)))
        max_abs, at, signed = float(abs(r_win[i])), float(t_win[i]), float(r_win[i])
    else:
        max_abs = at = signed = None
    passed = not len(crossing)
    evidence = f"; evidence: {plot}" if plot else ""
    if passed:
        message = (
            f"{run}: follows the reference (sizes {sizes}): max |r| {_fmt(max_abs, 4)} at t_hat "
            f"{_fmt(at)} is within the threshold {threshold:.4f} ({basis}) over t_hat "
            f"[{lo:g}, {min(hi, t_end):.3g}]{evidence}"
        )
    elif not finite[crossing[0]]:
        message = (
            f"{run}: the loss is not finite from t_hat {first:.3f} on (NaN or inf); "
            f"it diverged against the reference (sizes {sizes}){evidence}"
        )
    else:
        side = "above" if r_win[crossing[0]] > 0 else "below"
        message = (
            f"{run}: diverged from the reference (sizes {sizes}) at t_hat {first:.3f}: the "
            f"normalized loss runs {side} it, |r| = {abs(r_win[crossing[0]]):.4f} there and up to "
            f"{_fmt(max_abs, 4)} ({signed:+.4f}) at t_hat {_fmt(at)}, against the threshold "
            f"{threshold:.4f} ({basis}){evidence}"
        )
    status = "pass" if passed else ("fail" if policy.enforce else "overridden")
    if status == "overridden":
        message += "; not enforced (family.gates.enforce=false or allow_fail in the config)"
    return GateVerdict(
        passed=passed,
        status=status,
        max_abs_residual=max_abs,
        at_t_hat=at,
        residual_at_max=signed,
        first_crossing_t_hat=first,
        message=message,
        **common,
    )


def blocks(verdict: GateVerdict) -> bool:
    """Whether this verdict stops the run's downstream jobs (an undetermined one does not)."""
    return verdict.status == "fail"


def require_passed(verdict_json: str | Path) -> GateVerdict:
    """Load a verdict and raise ``GateFailed`` (with its message) if it blocks.

    For the rules downstream of a gate: the gate job itself always succeeds and keeps its
    evidence (Snakemake would delete a failed job's outputs, the plot among them).
    """
    verdict = GateVerdict.model_validate_json(Path(verdict_json).read_text())
    if blocks(verdict):
        raise GateFailed(f"collapse gate failed: {verdict.message}")
    return verdict


def _finite_or_none(x: float | None) -> float | None:
    return float(x) if x is not None and np.isfinite(x) else None


def plot_gate(
    path: str | Path,
    verdict: GateVerdict,
    t_hat: np.ndarray,
    ell_run: np.ndarray,
    reference: ReferenceCurve,
) -> Path:
    """Evidence for one verdict: the early-aligned run on the reference band, and r(t_hat)."""
    from collapse.plotting import Figure, save

    fig = Figure(figsize=(7.5, 6.5), layout="tight")
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw=dict(height_ratios=[3, 2]))
    ref_label = f"reference ({', '.join(reference.sizes)})" if reference.sizes else "reference"
    top.fill_between(
        reference.t_hat,
        reference.lower,
        reference.upper,
        color="0.85",
        label="reference band (mean ± 2 std)",
    )
    top.plot(reference.t_hat, reference.ell, color="k", lw=1.5, label=ref_label)
    top.plot(
        t_hat,
        ell_run,
        color="C3" if not verdict.passed else "C0",
        lw=1.2,
        label=f"{verdict.run} (early-aligned)",
    )
    top.axvspan(*verdict.align_window, color="C2", alpha=0.08, label="align window")
    finite = ell_run[np.isfinite(ell_run) & (t_hat >= verdict.window[0])]
    if len(finite):
        top.set_ylim(0.98 * min(finite.min(), 1.0), 1.02 * max(finite.max(), 1.0))
    top.set_ylabel("normalized loss ℓ = L / L(T)")
    top.legend(fontsize=8, loc="upper right")
    top.grid(alpha=0.3)
    top.set_title(f"{verdict.run}: gate {verdict.status.upper()}", fontsize=11)

    residual = ell_run - reference.at(t_hat)
    bottom.plot(
        t_hat,
        residual,
        color="C3" if not verdict.passed else "C0",
        lw=1.2,
        label="residual r = ℓ_run − ℓ_ref",
    )
    for sign in (1, -1):
        bottom.axhline(
            sign * verdict.threshold,
            color="C1",
            ls="--",
            lw=1,
            label=f"threshold ±{verdict.threshold:.4f}" if sign > 0 else None,
        )
    bottom.axvspan(*verdict.window, color="C1", alpha=0.05, label="gate window")
    if verdict.first_crossing_t_hat is not None:
        bottom.axvline(
            verdict.first_crossing_t_hat,
            color="C3",
            lw=1,
            ls=":",
            label=f"first crossing t̂ = {verdict.first_crossing_t_hat:.3f}",
        )
    span = verdict.max_abs_residual or verdict.threshold
    bottom.set_ylim(-1.3 * max(span, verdict.threshold), 1.3 * max(span, verdict.threshold))
    bottom.set_xlabel("fraction of training t̂ = step / total steps")
    bottom.set_ylabel("residual (ℓ units)")
    bottom.legend(fontsize=8, loc="upper left")
    bottom.grid(alpha=0.3)
    bottom.set_xlim(0, 1)
    return save(fig, path)
