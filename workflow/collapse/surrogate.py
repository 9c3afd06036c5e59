"""The parametric universal curve of Eq. 4, its fit on small runs, and curves drawn from it.

Source: docs/method.md §5 (Bergsma et al. 2025, Eq. 4):
    ell_hat(t) = ((1 + eps1) / (t + eps1))^m + b * (eta(t) + eps2)^q, divided by its value at 1,
with eps1 = 0.001, eps2 = 0.1, m = 0.05 fixed, eta(t) the LR schedule normalized to peak 1,
b = b_c * tau^b_e and q = q_c * TPP^q_e. The constants are not published: ``fit_surrogate``
fits them on a set of small runs, alternating between the b and the q parameters, so a
reference exists for controls (tau, TPP) that were never run.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

EPS1 = 1e-3
EPS2 = 0.1
M_EXPONENT = 0.05
WARMUP_FRACTION = 0.1  # docs/method.md §2: 10 % warmup in the paper's experiments
FIT_WINDOW = (0.2, 1.0)  # docs/method.md §2: fits ignore the first 20 % of training


def d2z_schedule(t_hat: np.ndarray, warmup_fraction: float = WARMUP_FRACTION) -> np.ndarray:
    """eta(t_hat)/eta_peak: linear warmup to 1 over ``warmup_fraction``, then linear to 0 at 1."""
    t = np.asarray(t_hat, dtype=float)
    w = float(warmup_fraction)
    warm = t / w if w > 0 else np.ones_like(t)
    decay = (1.0 - t) / (1.0 - w)
    return np.clip(np.where(t < w, warm, decay), 0.0, 1.0)


def eq4_ell(
    t_hat: np.ndarray,
    b: np.ndarray | float,
    q: np.ndarray | float,
    warmup_fraction: float = WARMUP_FRACTION,
) -> np.ndarray:
    """Eq. 4 normalized curve; ``b``/``q`` broadcast against ``t_hat`` (column vectors for many).

    Source: docs/method.md §5.
    """
    t = np.asarray(t_hat, dtype=float)
    b, q = np.asarray(b, dtype=float), np.asarray(q, dtype=float)
    eta = d2z_schedule(t, warmup_fraction)
    raw = ((1 + EPS1) / (t + EPS1)) ** M_EXPONENT + b * (eta + EPS2) ** q
    at_end = 1.0 + b * EPS2**q  # the value at t_hat = 1 (eta = 0, first term = 1)
    return raw / at_end


@dataclass(frozen=True)
class SurrogateParams:
    """b = b_c * tau^b_e, q = q_c * TPP^q_e (docs/method.md §5)."""

    b_c: float
    b_e: float
    q_c: float
    q_e: float
    warmup_fraction: float = WARMUP_FRACTION

    def b(self, tau: np.ndarray | float) -> np.ndarray:
        return self.b_c * np.asarray(tau, dtype=float) ** self.b_e

    def q(self, tpp: np.ndarray | float) -> np.ndarray:
        return self.q_c * np.asarray(tpp, dtype=float) ** self.q_e

    def ell(self, t_hat: np.ndarray, tau: float, tpp: float) -> np.ndarray:
        """The surrogate reference curve for controls (tau, TPP)."""
        return eq4_ell(t_hat, self.b(tau), self.q(tpp), self.warmup_fraction)


@dataclass(frozen=True)
class SurrogateFit:
    params: SurrogateParams
    rounds: int
    mae: float  # mean |ell_hat - ell| over the fit window, all curves
    fit_window: tuple[float, float]
    taus: list[float] = field(default_factory=list)
    tpps: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def read_json(cls, path: str | Path) -> SurrogateFit:
        raw = json.loads(Path(path).read_text())
        raw["params"] = SurrogateParams(**raw["params"])
        raw["fit_window"] = tuple(raw["fit_window"])
        return cls(**raw)


def fit_surrogate(
    grid: np.ndarray,
    ell: np.ndarray,
    tau: np.ndarray,
    tpp: np.ndarray,
    warmup_fraction: float = WARMUP_FRACTION,
    fit_window: tuple[float, float] = FIT_WINDOW,
    max_rounds: int = 200,
    rtol: float = 1e-10,
) -> SurrogateFit:
    """Fit (b_c, b_e, q_c, q_e) of Eq. 4 to normalized curves, alternating b and q.

    Source: docs/method.md §5. ``ell`` is (n_runs, n_grid) on ``grid``; ``tau``/``tpp`` per
    run. Least squares on ell over ``fit_window`` (NaN points skipped). An exponent is
    identifiable only with two or more distinct values of its control; otherwise it is held at
    0 (the curve fits, but does not extrapolate in that control) and a note says so.
    """
    grid = np.asarray(grid, dtype=float)
    ell = np.atleast_2d(np.asarray(ell, dtype=float))
    tau = np.asarray(tau, dtype=float).reshape(-1, 1)
    tpp = np.asarray(tpp, dtype=float).reshape(-1, 1)
    if not (len(tau) == len(tpp) == len(ell)):
        raise ValueError("fit_surrogate: ell, tau and tpp need one entry per run")
    if not (np.all(tau > 0) and np.all(tpp > 0)):
        raise ValueError("fit_surrogate: tau and tpp must be positive for every run")
    cols = (grid >= fit_window[0]) & (grid <= fit_window[1])
    t, target = grid[cols], ell[:, cols]
    ok = np.isfinite(target)
    notes = []
    # Realized tau/TPP differ from their targets by rounding: a control varies only when its
    # values span more than 1 % (else its exponent is unidentifiable and the fit diverges).
    fit_b_e = bool(np.ptp(np.log(np.asarray(tau, float))) > 0.01)
    fit_q_e = bool(np.ptp(np.log(np.asarray(tpp, float))) > 0.01)
    if not fit_b_e:
        notes.append("one tau only: b_e held at 0, b does not extrapolate in tau")
    if not fit_q_e:
        notes.append("one TPP only: q_e held at 0, q does not extrapolate in TPP")

    # theta = (log b_c, b_e, log q_c, q_e); logs keep b_c and q_c positive
    theta = np.array([np.log(0.1), 0.0, np.log(0.5), 0.0])

    def residual(th: np.ndarray) -> np.ndarray:
        b = np.exp(th[0]) * tau ** th[1]
        q = np.exp(th[2]) * tpp ** th[3]
        return (eq4_ell(t, b, q, warmup_fraction) - target)[ok]

    def fit_block(th: np.ndarray, free: list[int]) -> tuple[np.ndarray, float]:
        def block_residual(x: np.ndarray) -> np.ndarray:
            full = th.copy()
            full[free] = x
            return residual(full)

        sol = least_squares(block_residual, th[free])
        out = th.copy()
        out[free] = sol.x
        return out, float(sol.cost)

    b_block = [0, 1] if fit_b_e else [0]
    q_block = [2, 3] if fit_q_e else [2]
    cost, rounds = np.inf, 0
    while rounds < max_rounds:
        rounds += 1
        theta, _ = fit_block(theta, b_block)
        theta, new_cost = fit_block(theta, q_block)
        converged = cost - new_cost <= rtol * max(new_cost, 1e-300)
        cost = new_cost
        if converged:
            break
    log_b_c, b_e, log_q_c, q_e = theta
    params = SurrogateParams(
        float(np.exp(log_b_c)), float(b_e), float(np.exp(log_q_c)), float(q_e), warmup_fraction
    )
    mae = float(np.mean(np.abs(residual(theta))))
    return SurrogateFit(
        params=params,
        rounds=rounds,
        mae=mae,
        fit_window=(float(fit_window[0]), float(fit_window[1])),
        taus=sorted({float(x) for x in tau.ravel()}),
        tpps=sorted({float(x) for x in tpp.ravel()}),
        notes=notes,
    )


def synthetic_loss(
    t_hat: np.ndarray,
    final_loss: float,
    b: float,
    q: float,
    warmup_fraction: float = WARMUP_FRACTION,
    noise_rel: float = 0.0,
    wiggle_rel: float = 0.0,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """A loss curve whose normalized shape is Eq. 4 (b, q), for tests and benchmarks.

    ``noise_rel``: i.i.d. per-step relative noise (batch noise); ``wiggle_rel``: a smooth random
    relative perturbation over t_hat (a seed's slow drift, what survives smoothing).
    """
    t = np.asarray(t_hat, dtype=float)
    loss = final_loss * eq4_ell(t, b, q, warmup_fraction)
    rng = rng or np.random.default_rng(0)
    if wiggle_rel:
        freqs = np.arange(1, 4)
        phases = rng.uniform(0, 2 * np.pi, size=3)
        amps = rng.normal(0, 1, size=3) / freqs
        wiggle = np.sum(amps[:, None] * np.sin(np.pi * freqs[:, None] * t + phases[:, None]), 0)
        loss = loss * (1 + wiggle_rel * wiggle / np.sqrt(np.sum(amps**2)))
    if noise_rel:
        loss = loss * (1 + noise_rel * rng.standard_normal(len(t)))
    return loss
