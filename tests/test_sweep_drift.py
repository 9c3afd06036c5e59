"""The sweep stage with the size drift (collapse.sweep_drift) on a synthetic family.

The family is drawn from Eq. 4 (tests/synthetic.py) with a known offset L0 and a known drift of
the shape exponent with log parameters, the same at every tau, and final losses that depend on
tau. Like tiny: three seeds of the small size s96, the sweep's size s128 and a larger s160 at
the family's tau 0.2; the sweep varies tau at s128, each variant trained to the end (so the
truth is known) with its reference the s96 run of its own tau. The paper's method, with one
reference size per tau, carries the drift from s96 to s128 into every prediction; the "drift"
method fits it on s96 and s160 and must recover the final losses and pick the winner.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
from synthetic import synthetic_family

from collapse.cli import main as cli_main
from collapse.config import load_config
from collapse.curves import read_curves, resample, smooth
from collapse.plan import plan_family
from collapse.sweep_drift import drift_fit_runs, fit_sweep_drift, stop_point, transfer

PARAMS = {"s96": 322_176.0, "s128": 527_872.0, "s160": 784_000.0}  # tiny's widths
L0 = 1.0
EXPONENT_SLOPE = 0.6  # per unit log parameters: wider sizes steeper early, like tiny
FAMILY_FINAL = {"s96": 3.0, "s128": 2.78, "s160": 2.63}  # at tau 0.2
TAU_FACTOR = {0.1: 1.025, 0.2: 1.0, 0.4: 0.99}  # final loss at tau over at 0.2: 0.4 wins
FRACTIONS = ("0.1", "0.2", "0.3")


def _runs_row(run: str, role: str, size: str, tau: float, seed: int, sweep: str = "") -> dict:
    return {
        "run": run,
        "role": role,
        "sweep": sweep,
        "size": size,
        "tpp_band": 20.0,
        "tau": tau,
        "seed": seed,
        "params": PARAMS[size],
        "flops": 6 * PARAMS[size] * 20 * PARAMS[size],
        "stop_fraction": 1.0,
    }


def _draw(finals: dict[str, float], tau: float, seeds: int, rng_seed: int) -> pd.DataFrame:
    return synthetic_family(
        finals,
        seeds=seeds,
        steps=1500,
        tau=tau,
        offset=L0,
        n_params=PARAMS,  # the exponent is 1 at s96, the first size, for every tau
        exponent_slope=EXPONENT_SLOPE,
        seed_spread_rel=0.0 if seeds == 1 else 0.003,
        rng_seed=rng_seed,
    )


def write_sweep_inputs(folder, family_sizes=("s96", "s128", "s160")) -> dict[str, float]:
    """curves.csv and runs.csv of the family, the sweep's variants and references; returns
    each variant's final loss as drawn (before noise)."""
    frames, rows, truth = [], [], {}
    family = _draw({s: FAMILY_FINAL[s] for s in family_sizes}, 0.2, 3, 0)
    for run, size, seed in family[["run", "size", "seed"]].drop_duplicates().itertuples(False):
        if size != "s96" and seed > 0:  # one seed of the wider sizes, as tiny trains them
            continue
        name = f"{size}-s{seed}"
        frames.append(family[family.run == run].assign(run=name))
        rows.append(_runs_row(name, "family", size, 0.2, seed))
    for i, (tau, factor) in enumerate(TAU_FACTOR.items()):
        variant = f"sweep-tau-s128-tau{tau:g}-s0"
        drawn = _draw({"s128": FAMILY_FINAL["s128"] * factor}, tau, 1, 10 + i)
        frames.append(drawn.assign(run=variant))
        rows.append(_runs_row(variant, "sweep", "s128", tau, 0, "tau"))
        truth[variant] = FAMILY_FINAL["s128"] * factor
        ref = f"sweepref-tau-s96-tau{tau:g}-s0"
        drawn = _draw({"s96": FAMILY_FINAL["s96"] * factor}, tau, 1, 20 + i)
        frames.append(drawn.assign(run=ref))
        rows.append(_runs_row(ref, "sweep_reference", "s96", tau, 0, "tau"))
    curves = pd.concat(frames, ignore_index=True)[["run", "step", "loss", "steps"]]
    curves.to_csv(folder / "curves.csv", index=False)
    pd.DataFrame(rows).to_csv(folder / "runs.csv", index=False)
    return truth


def run_stage(folder) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    out = folder / "sweeps" / "tau"
    code = cli_main(
        ["stage", "sweep", str(folder / "curves.csv"), "--runs", str(folder / "runs.csv")]
        + ["--fractions", *FRACTIONS, "--out", str(out)]
    )
    assert code == 0
    return (
        pd.read_csv(out / "predictions.csv"),
        pd.read_csv(out / "metrics.csv"),
        json.loads((out / "drift.json").read_text()),
    )


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sweep_drift")
    truth = write_sweep_inputs(folder)
    return (*run_stage(folder), truth)


def test_the_drift_is_fitted_on_the_other_sizes_of_the_family(staged):
    _, _, drift, _ = staged
    assert drift["fitted"]
    assert drift["fit_runs"] == ["s96-s0", "s96-s1", "s96-s2", "s160-s0"]  # s128: a variant's
    assert set(drift["reference_sizes"]) == {"s96", "s160"}
    assert "every tau" in drift["assumption"]


def test_drift_recovers_the_final_losses_far_better_than_the_paper_method(staged):
    preds, metrics, _, truth = staged
    assert set(preds.method) == {"collapse", "current", "powerlaw", "drift"}
    drift = preds[preds.method == "drift"]
    assert len(drift) == 3 * len(FRACTIONS)
    # each variant keeps its own tau's reference
    assert (drift.reference_run.str[-9:] == drift.run.str[-9:]).all()
    assert (drift.lower <= drift.predicted_final_loss).all()
    assert (drift.predicted_final_loss <= drift.upper).all()
    drawn = drift.run.map(truth)
    assert drift.true_final_loss.to_numpy() == pytest.approx(drawn.to_numpy(), rel=0.01)
    error = metrics.set_index(["method", "fraction"]).mean_abs_error_pct
    for fraction in (0.1, 0.2, 0.3):
        assert error["collapse", fraction] > 2.0  # the size drift, as on tiny's own sweep
        assert error["drift", fraction] < error["collapse", fraction] / 4
        assert error["drift", fraction] < error["powerlaw", fraction]
        assert error["drift", fraction] < 0.6


def test_drift_selects_the_true_winner(staged):
    _, metrics, _, _ = staged
    drift = metrics[metrics.method == "drift"]
    assert (drift.best_run == "sweep-tau-s128-tau0.4-s0").all()
    assert drift.found_best.astype(str).eq("True").all()
    assert (drift.regret_loss == 0).all()


def test_without_two_other_sizes_the_sweep_keeps_the_paper_method_and_says_why(tmp_path):
    write_sweep_inputs(tmp_path, family_sizes=("s96", "s128"))
    preds, metrics, drift = run_stage(tmp_path)
    assert set(preds.method) == {"collapse", "current", "powerlaw"}
    assert set(metrics.method) == {"collapse", "current", "powerlaw", "random"}
    assert not drift["fitted"]
    assert "1 size(s)" in drift["note"] and "paper's method only" in drift["note"]


def test_the_moved_shape_takes_the_measured_ratio_and_continues_by_the_exponent(tmp_path):
    """By hand from the fit's own numbers: inside the fitted sizes log ell_tau(x) =
    log ell_tau(x_r) * D(x) / D(x_r), D the fitted sizes' mean log ell interpolated linearly in
    log parameters at every t_hat; beyond them the drift stops at the largest fitted size or
    continues by the exponent, ell_stop ** (a(x) / a(x_stop))."""
    write_sweep_inputs(tmp_path)
    curves = smooth(read_curves(tmp_path / "curves.csv", tmp_path / "runs.csv"))
    fit, _ = fit_sweep_drift(curves, ["s96-s0", "s96-s1", "s96-s2", "s160-s0"])
    ref = "sweepref-tau-s96-tau0.1-s0"
    log_ref = np.log(resample(curves.select([ref])).normalized(fit.offset)[0])
    d96, d160 = fit.size_shapes  # in the fit's size order: s96, then s160
    assert fit.sizes == ["s96", "s160"]
    ok = np.isfinite(log_ref) & np.isfinite(d96) & np.isfinite(d160) & (np.abs(d96) > 1e-3)

    def a(x: float) -> float:
        return 1 + fit.slope * (x - fit.x_ref)

    x_r, x_160 = np.log(PARAMS["s96"]), np.log(PARAMS["s160"])
    x = np.log(PARAMS["s128"])
    weight = (x - x_r) / (x_160 - x_r)  # s128 lies between the fitted sizes
    assert 0 < weight < 1
    inside = transfer(fit, curves, [ref], x_r, stop_point(fit, x))
    with np.errstate(invalid="ignore"):  # 0 / 0 at t_hat 1, left out by ok
        by_hand = log_ref * ((1 - weight) * d96 + weight * d160) / d96  # D(x_r) = d96
        stopped = log_ref * d160 / d96
    assert np.log(inside.ell(x))[ok] == pytest.approx(by_hand[ok], rel=1e-9, abs=1e-12)
    assert inside.ell(x)[ok] == pytest.approx(inside.ell(x, exponent_drift=False)[ok], rel=1e-12)
    # several seeds of a reference: the log of their mean normalized curve takes the ratio
    seeds = ["s96-s0", "s96-s1"]
    both = transfer(fit, curves, seeds, x_r, stop_point(fit, x))
    normalized = resample(curves.select(seeds)).normalized(fit.offset)
    with np.errstate(invalid="ignore"):
        by_hand = np.log(normalized.mean(axis=0)) * ((1 - weight) * d96 + weight * d160) / d96
    assert np.log(both.ell(x))[ok] == pytest.approx(by_hand[ok], rel=1e-9, abs=1e-12)

    x_big = np.log(4 * PARAMS["s160"])
    assert stop_point(fit, x_big) == pytest.approx(x_160)
    moved = transfer(fit, curves, [ref], x_r, stop_point(fit, x_big))
    assert moved.offset == fit.offset
    assert np.log(moved.ell(x_big, exponent_drift=False))[ok] == pytest.approx(stopped[ok])
    continued = stopped * a(x_big) / a(x_160)
    assert np.log(moved.ell(x_big))[ok] == pytest.approx(continued[ok], rel=1e-9)
    assert len(moved.replicas) == len(fit.replicas) == 3  # one per s96 seed left out
    assert len(moved.span_fits) == len(fit.span_fits) == 2

    # a span fit whose exponent is negative at the run's size is left out, the prediction kept
    steep = replace(fit.span_fits[0], slope=-2.0 / (x_big - fit.span_fits[0].x_ref))
    kept = transfer(replace(fit, span_fits=[steep]), curves, [ref], x_r, x_big)
    assert kept.span_fits == [] and kept.offset == fit.offset


def test_tiny_sweep_fits_its_drift_on_d96_and_d160():
    plan = plan_family(load_config(["family=tiny"]), corpus_tokens=0)
    runs = drift_fit_runs(plan.table, "tau")
    assert runs == ["d96-tpp10-s0", "d96-tpp10-s1", "d96-tpp10-s2", "d160-tpp10-s0"]
    assert drift_fit_runs(plan.table, "no-such-sweep") == []
