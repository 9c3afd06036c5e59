"""Reference curve, early-align and the Eq. 4 surrogate (collapse.reference, collapse.surrogate)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from collapse import curves as C
from collapse import surrogate
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


def _eq4_from_the_paper(t, b, q, warmup=0.1, eps1=0.001, eps2=0.1, m=0.05):
    """Eq. 4 of the paper written out afresh, an oracle that shares no code with the product.

    ((1 + eps1) / (t + eps1))^m + b (eta(t) + eps2)^q, divided by the same at t = 1, where
    eta is the D2Z schedule at peak 1 (linear warmup, then linear to 0 at t = 1).
    """
    t = np.asarray(t, dtype=float)
    eta = (1.0 - t) / (1.0 - warmup)
    if warmup > 0:
        eta = np.where(t < warmup, t / warmup, eta)

    def raw(x, e):
        return ((1.0 + eps1) / (x + eps1)) ** m + b * (e + eps2) ** q

    return raw(t, eta) / raw(1.0, 0.0)


T_CHECK = np.array([0.001, 0.02, 0.05, 0.0999, 0.1, 0.25, 0.5, 0.8, 0.999, 1.0])


@pytest.mark.parametrize(
    ("b", "q", "warmup"),
    [(0.13, 0.55, 0.1), (0.3, 1.2, 0.05), (1.0, 0.2, 0.2), (0.02, 2.0, 0.1), (0.5, 1.0, 0.0)],
)
def test_eq4_matches_the_paper_transcription(b, q, warmup):
    """The product's Eq. 4 with its fixed constants equals eps1 0.001, eps2 0.1, m 0.05."""
    got = eq4_ell(T_CHECK, b, q, warmup)
    assert got == pytest.approx(_eq4_from_the_paper(T_CHECK, b, q, warmup), rel=1e-12)
    assert got[-1] == pytest.approx(1.0, rel=1e-15)  # normalized at t_hat = 1


def test_eq4_at_two_points_worked_by_hand():
    """Two values from a calculator, so the oracle itself is checked too."""
    # t 0.5, b 0.2, q 1, warmup 0.1: eta = 0.5 / 0.9; (1.001 / 0.501)^0.05 = exp(0.05 x
    # 0.6921489) = 1.0352132; + 0.2 x (0.5556 + 0.1) = 0.1311111; / (1 + 0.2 x 0.1) = 1.02
    assert eq4_ell(0.5, 0.2, 1.0) == pytest.approx(1.1434552456086, rel=1e-12)
    # t 0.05 in the warmup, b 0.5, q 2: eta = 0.5; (1.001 / 0.051)^0.05 = exp(0.05 x 2.9768983)
    # = 1.1604948; + 0.5 x 0.6^2 = 0.18; / (1 + 0.5 x 0.1^2) = 1.005
    assert eq4_ell(0.05, 0.5, 2.0) == pytest.approx(1.3338256617510, rel=1e-12)
    assert _eq4_from_the_paper(0.5, 0.2, 1.0) == pytest.approx(1.1434552456086, rel=1e-12)


@pytest.mark.parametrize(
    ("eps1", "eps2", "m"), [(0.001, 0.3, 0.2), (0.01, 0.1, 0.05), (0.001, 0.05, 0.1)]
)
def test_eq4_form_holds_for_other_constants(monkeypatch, eps1, eps2, m):
    """With the constants changed the form still matches: none of them is hard-coded twice."""
    monkeypatch.setattr(surrogate, "EPS1", eps1)
    monkeypatch.setattr(surrogate, "EPS2", eps2)
    monkeypatch.setattr(surrogate, "M_EXPONENT", m)
    for b, q in ((0.13, 0.55), (0.4, 1.5)):
        want = _eq4_from_the_paper(T_CHECK, b, q, 0.1, eps1=eps1, eps2=eps2, m=m)
        assert surrogate.eq4_ell(T_CHECK, b, q) == pytest.approx(want, rel=1e-12)


def test_eq4_broadcasts_one_curve_per_row():
    """Column vectors of b and q give one curve per row, each the single-curve value."""
    b, q = np.array([[0.1], [0.3]]), np.array([[0.5], [1.5]])
    got = eq4_ell(T_CHECK, b, q)
    assert got.shape == (2, len(T_CHECK))
    for i in range(2):
        want = _eq4_from_the_paper(T_CHECK, b[i, 0], q[i, 0])
        assert got[i] == pytest.approx(want, rel=1e-12)


def test_partial_reference_runs_are_named_five_at_most():
    df = pd.concat(
        [
            pd.DataFrame({"run": f"p{i}", "step": np.arange(1, 51), "loss": 3.0, "steps": 100})
            for i in range(7)
        ]
    )
    matrix = C.resample(C.smooth(C.curves_from_frame(df)))
    with pytest.raises(ValueError, match=r"not: \['p0', 'p1', 'p2', 'p3', 'p4'\]; finish"):
        reference_curve(matrix)
