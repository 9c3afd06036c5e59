"""Synthetic curve tables for the tests: a family drawn from the Eq. 4 surrogate."""

import numpy as np
import pandas as pd

from collapse.surrogate import SurrogateParams, synthetic_loss


def synthetic_family(
    final_losses: dict[str, float],
    seeds: int = 3,
    steps: int = 2000,
    params: SurrogateParams | None = None,
    tau: float | dict[str, float] = 0.2,
    tpp: float = 20.0,
    noise_rel: float = 0.01,
    wiggle_rel: float = 0.001,
    seed_spread_rel: float = 0.01,
    rng_seed: int = 0,
    offset: float = 0.0,
    n_params: dict[str, float] | None = None,
    exponent_slope: float = 0.0,
) -> pd.DataFrame:
    """A long curve table (run, step, loss + size, seed, tau, tpp, steps) from Eq. 4.

    Every size shares the universal curve of ``params`` at its
    (tau, TPP); a per-size ``tau`` mapping breaks the collapse the way an unrescaled weight
    decay does. Seeds differ in final loss (``seed_spread_rel``), slow drift and batch noise.
    """
    params = params or SurrogateParams(b_c=0.3, b_e=0.5, q_c=1.0, q_e=-0.2)
    rng = np.random.default_rng(rng_seed)
    step = np.arange(1, steps + 1)
    frames = []
    first = next(iter(n_params.values())) if n_params else 1.0
    for size, final in final_losses.items():
        exponent = 1.0 + exponent_slope * np.log(n_params[size] / first) if n_params else 1.0
        size_tau = tau[size] if isinstance(tau, dict) else tau
        b, q = float(params.b(size_tau)), float(params.q(tpp))
        for seed in range(seeds):
            seed_final = final * (1 + seed_spread_rel * rng.standard_normal())
            ell = synthetic_loss(
                step / steps, 1.0, b, q, params.warmup_fraction, noise_rel, wiggle_rel, rng
            )
            loss = offset + (seed_final - offset) * ell**exponent
            frames.append(
                pd.DataFrame(
                    {
                        "run": f"{size}_s{seed}",
                        "step": step,
                        "loss": loss,
                        "size": size,
                        "seed": seed,
                        "tau": size_tau,
                        "tpp": tpp,
                        "steps": steps,
                    }
                )
            )
            if n_params:
                frames[-1]["params"] = n_params[size]
    return pd.concat(frames, ignore_index=True)
