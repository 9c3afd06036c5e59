"""Reference curve, early-align and the Eq. 4 surrogate (collapse.reference, collapse.surrogate)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from collapse import curves as C
from collapse.reference import (
    ReferenceCurve,
    early_align,
    early_align_matrix,
    reference_curve,
)
from collapse.surrogate import SurrogateParams, eq4_ell, fit_surrogate, synthetic_loss

STEPS = 4000
B, Q = 0.13, 0.55


def _family(final_losses: dict[tuple[str, int], float], noise=0.01, wiggle=0.002, seed=0):
    rng = np.random.default_rng(seed)
    step = np.arange(1, STEPS + 1)
    frames = []
    for (size, s), final in final_losses.items():
        loss = synthetic_loss(
            step / STEPS, final, B, Q, noise_rel=noise, wiggle_rel=wiggle, rng=rng
        )
        frames.append(
            pd.DataFrame({"run": f"{size}_s{s}", "step": step, "loss": loss, "size": size})
        )
    return C.resample(C.smooth(C.curves_from_frame(pd.concat(frames, ignore_index=True))))


def test_early_align_recovers_final_loss_of_exact_curve():
    t = np.arange(1, 1001) / 1000
    ell = eq4_ell(t, B, Q)
    partial = t <= 0.5
    result = early_align(t[partial], 2.7 * ell[partial], t, ell)
    assert result.final_loss == pytest.approx(2.7, rel=1e-9)
    assert result.lower == pytest.approx(2.7, rel=1e-6) and result.log_scatter < 1e-9
    assert result.n_points == 251 and result.window == (0.25, 0.5)


def test_early_align_with_offset_and_noise_stays_within_the_noise():
    rng = np.random.default_rng(3)
    t = np.arange(1, 2001) / 2000
    l0, final = 1.5, 3.2
    ell = eq4_ell(t, B, Q)
    loss = l0 + (final - l0) * ell * (1 + 0.004 * rng.standard_normal(len(t)))
    result = early_align(t[t <= 0.55], loss[t <= 0.55], t, ell, offset=l0)
    assert abs(result.final_loss - final) < 0.004 * final  # within one noise std
    assert result.lower < final < result.upper
    with pytest.raises(ValueError, match="align window"):
        early_align(t[t < 0.2], loss[t < 0.2], t, ell)
    with pytest.raises(ValueError, match="offset"):
        early_align(t, loss, t, ell, offset=10.0)


def test_matrix_align_equals_single_align():
    matrix = _family({("a", 0): 3.0, ("b", 0): 2.5, ("b", 1): 2.52})
    ref = eq4_ell(matrix.grid, B, Q)
    finals, scatter = early_align_matrix(matrix.grid, matrix.loss, ref)
    for i in range(3):
        one = early_align(matrix.grid, matrix.loss[i], matrix.grid, ref)
        assert finals[i] == pytest.approx(one.final_loss, rel=1e-12)
        assert scatter[i] == pytest.approx(one.log_scatter, rel=1e-9)


def test_early_align_on_noisy_family_recovers_each_final_loss():
    truth = {(size, s): 3.0 - 0.3 * i + 0.01 * s for i, size in enumerate("abc") for s in range(3)}
    matrix = _family(truth, noise=0.02, wiggle=0.001)
    ref = reference_curve(matrix.select(C.size_labels(matrix.meta).isin(["a", "b"])))
    finals, _ = early_align_matrix(matrix.grid, matrix.loss, ref.ell)
    rel_err = np.abs(finals / matrix.meta["final_loss"].to_numpy() - 1)
    # noise of the smoothed L(T): batch noise over an 80-step window, plus the 0.1 % wiggle
    noise = 0.02 / np.sqrt(80) + 0.001
    assert rel_err.max() < 3 * noise and rel_err.mean() < noise


def test_reference_curve_mean_band_and_seed_noise():
    truth = {(size, s): 3.0 - 0.2 * i for i, size in enumerate("ab") for s in range(3)}
    matrix = _family(truth, noise=0.01, wiggle=0.003)
    ref = reference_curve(matrix)
    assert ref.ell[-1] == pytest.approx(1.0) and (ref.lower <= ref.ell).all()
    assert np.abs(ref.ell[40:] - eq4_ell(matrix.grid[40:], B, Q)).max() < 0.006
    assert np.nanmax(ref.seed_std[50:]) < 0.01 and np.nanmin(ref.seed_std[50:]) > 0
    assert ref.sizes == ["a", "b"] and ref.n_curves[-1] == 6
    one_seed = reference_curve(matrix.select([True, False, False, True, False, False]))
    assert np.isnan(one_seed.seed_std).all()  # no size with two seeds: no seed noise


def test_reference_csv_round_trip_and_contract(tmp_path):
    matrix = _family({("a", 0): 3.0, ("a", 1): 3.01})
    ref = reference_curve(matrix)
    path = ref.write_csv(tmp_path / "reference.csv")
    table = pd.read_csv(path)
    assert list(table.columns[:4]) == ["t_hat", "ell", "lower", "upper"]
    back = ReferenceCurve.read_csv(path)
    assert np.allclose(back.ell, ref.ell) and np.allclose(back.seed_std, ref.seed_std)
    with pytest.raises(ValueError, match="lower"):
        ReferenceCurve.from_frame(table.drop(columns="lower"))


def test_reference_rejects_partial_runs():
    df = pd.DataFrame({"run": "p", "step": np.arange(1, 51), "loss": 3.0, "steps": 100})
    matrix = C.resample(C.smooth(C.curves_from_frame(df)))
    with pytest.raises(ValueError, match="complete"):
        reference_curve(matrix)


def test_surrogate_fit_recovers_known_constants():
    grid = C.default_grid()
    true = SurrogateParams(b_c=0.3, b_e=0.5, q_c=1.0, q_e=-0.2)
    tau, tpp = (x.ravel() for x in np.meshgrid([0.1, 0.2, 0.4], [10.0, 20.0, 40.0]))
    ell = np.array([true.ell(grid, a, p) for a, p in zip(tau, tpp, strict=True)])
    fit = fit_surrogate(grid, ell, tau, tpp)
    got = fit.params
    assert (got.b_c, got.b_e, got.q_c, got.q_e) == pytest.approx((0.3, 0.5, 1.0, -0.2), rel=1e-4)
    assert fit.mae < 1e-6 and not fit.notes
    rng = np.random.default_rng(0)
    noisy = fit_surrogate(grid, ell * (1 + 0.002 * rng.standard_normal(ell.shape)), tau, tpp)
    assert noisy.params.b_e == pytest.approx(0.5, abs=0.02)
    assert noisy.params.q_e == pytest.approx(-0.2, abs=0.02)
    # a control never run: the surrogate still gives its curve
    assert np.abs(noisy.params.ell(grid, 0.3, 30.0) - true.ell(grid, 0.3, 30.0)).max() < 0.003


def test_surrogate_with_one_tau_holds_its_exponent(tmp_path):
    grid = C.default_grid()
    ell = np.array([eq4_ell(grid, 0.12, 0.4), eq4_ell(grid, 0.12, 0.4)])
    fit = fit_surrogate(grid, ell, [0.2, 0.2], [20.0, 20.0])
    assert fit.params.b_e == 0.0 and fit.params.q_e == 0.0 and len(fit.notes) == 2
    assert fit.params.b(0.2) == pytest.approx(0.12, rel=1e-3)
    back = type(fit).read_json(fit.write_json(tmp_path / "surrogate.json"))
    assert back.params == fit.params
