"""The Eq. 4 surrogate's schedule, input checks, fit bookkeeping and synthetic curves, against
values worked out by hand and properties that follow from the definitions (collapse.surrogate)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from collapse.surrogate import (
    SurrogateFit,
    d2z_schedule,
    eq4_ell,
    fit_surrogate,
    synthetic_loss,
)

GRID = np.linspace(0.01, 1.0, 100)


def test_d2z_schedule_by_hand():
    """Linear warmup to 1 over the first 10 %, then linear to 0 at t_hat 1."""
    t = np.array([0.0, 0.05, 0.1, 0.55, 0.91, 1.0])
    # 0.05 / 0.1; the peak; (1 - 0.55) / 0.9; (1 - 0.91) / 0.9
    assert d2z_schedule(t) == pytest.approx([0.0, 0.5, 1.0, 0.5, 0.1, 0.0], abs=1e-15)
    # 25 % warmup: 0.2 / 0.25 = 0.8 rising, (1 - 0.4) / 0.75 = 0.8 falling
    assert d2z_schedule(np.array([0.2, 0.4]), 0.25) == pytest.approx([0.8, 0.8], rel=1e-15)
    # no warmup: the decay from t_hat 0, (1 - 0.25) / 1, with no division by the zero warmup
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert d2z_schedule(np.array([0.0, 0.25]), 0.0) == pytest.approx([1.0, 0.75], rel=1e-15)


@pytest.mark.parametrize(
    ("tau", "tpp"),
    [
        ([0.1, 0.2], [20.0, 0.0]),  # every tau positive, one TPP zero
        ([0.1, 0.2], [20.0, -5.0]),
        ([0.1, 0.0], [20.0, 40.0]),  # every TPP positive, one tau zero
        ([-0.1, 0.2], [20.0, 40.0]),
    ],
)
def test_fit_refuses_a_control_that_is_not_positive(tau, tpp):
    """b = b_c tau^b_e and q = q_c TPP^q_e need both controls positive for every run."""
    ell = np.vstack([eq4_ell(GRID, 0.1, 0.5)] * 2)
    with pytest.raises(ValueError, match="tau and tpp must be positive for every run"):
        fit_surrogate(GRID, ell, tau, tpp)


def test_fit_refuses_controls_of_another_length():
    ell = np.vstack([eq4_ell(GRID, 0.1, 0.5)] * 2)
    with pytest.raises(ValueError, match="one entry per run"):
        fit_surrogate(GRID, ell, [0.1, 0.2, 0.3], [20.0, 40.0])
    with pytest.raises(ValueError, match="one entry per run"):
        fit_surrogate(GRID, ell, [0.1, 0.2], [20.0])


def test_fit_reports_its_window_controls_and_error(tmp_path):
    """The fit's mae is the mean |Eq. 4 - ell| over the window, recomputed here by hand from
    its parameters; the controls are listed once each, sorted."""
    tau = np.array([0.3, 0.1, 0.3, 0.1])
    tpp = np.array([80.0, 20.0, 20.0, 80.0])
    b, q = 2.0 * tau**0.5, 0.4 * tpp**0.1
    rng = np.random.default_rng(3)
    ell = eq4_ell(GRID, b[:, None], q[:, None]) * (1 + 0.003 * rng.standard_normal((4, 100)))
    fit = fit_surrogate(GRID, ell, tau, tpp, fit_window=(0.3, 0.9))
    assert fit.taus == [0.1, 0.3] and fit.tpps == [20.0, 80.0] and fit.notes == []
    assert fit.fit_window == (0.3, 0.9) and fit.rounds >= 1
    p = fit.params
    cols = (GRID >= 0.3) & (GRID <= 0.9)  # 30 points: t_hat 0.30 .. 0.89 (0.90 is 0.9000001)
    model = eq4_ell(GRID[cols], p.b_c * tau[:, None] ** p.b_e, p.q_c * tpp[:, None] ** p.q_e)
    assert fit.mae == pytest.approx(np.abs(model - ell[:, cols]).mean(), rel=1e-12)
    # noise 0.3 % of ell ~ 1.1-1.4: the mean |noise| is about 0.003 x 1.2 x sqrt(2 / pi) ~ 0.003
    assert 0.002 < fit.mae < 0.004
    assert (p.b_e, p.q_e) == pytest.approx((0.5, 0.1), abs=0.1)
    back = SurrogateFit.read_json(fit.write_json(tmp_path / "fit" / "surrogate.json"))
    assert back == fit


def test_fit_skips_missing_points():
    """NaN points (a run logged less) leave the fit as it is without them."""
    tau, tpp = np.array([0.1, 0.3, 0.1, 0.3]), np.array([20.0, 20.0, 80.0, 80.0])
    ell = eq4_ell(GRID, (2.0 * tau**0.5)[:, None], (0.4 * tpp**0.1)[:, None])
    gappy = ell.copy()
    gappy[1, 40:60] = np.nan
    full, part = fit_surrogate(GRID, ell, tau, tpp), fit_surrogate(GRID, gappy, tau, tpp)
    assert np.isfinite(part.mae) and part.mae < 1e-5
    assert (part.params.b_e, part.params.q_e) == pytest.approx((0.5, 0.1), rel=1e-3)
    assert part.params.b_e == pytest.approx(full.params.b_e, rel=1e-4)


def test_one_control_each_holds_both_exponents_and_says_so():
    """Controls within 1 % of each other count as one value: exponents held at 0."""
    ell = np.vstack([eq4_ell(GRID, 0.12, 0.4)] * 2)
    fit = fit_surrogate(GRID, ell, [0.2, 0.2019], [20.0, 20.19])  # 0.95 % apart
    assert fit.params.b_e == 0.0 and fit.params.q_e == 0.0
    assert fit.notes == [
        "one tau only: b_e held at 0, b does not extrapolate in tau",
        "one TPP only: q_e held at 0, q does not extrapolate in TPP",
    ]
    spread = fit_surrogate(GRID, ell, [0.2, 0.203], [20.0, 20.3])  # 1.5 % apart: both fitted
    assert spread.notes == []


def test_synthetic_loss_without_noise_is_the_final_loss_times_eq4():
    loss = synthetic_loss(GRID, 3.0, 0.2, 0.6)
    assert loss == pytest.approx(3.0 * eq4_ell(GRID, 0.2, 0.6), rel=1e-15)
    assert loss[-1] == pytest.approx(3.0, rel=1e-15)
    warm = synthetic_loss(GRID, 2.0, 0.2, 0.6, warmup_fraction=0.3)
    assert warm == pytest.approx(2.0 * eq4_ell(GRID, 0.2, 0.6, 0.3), rel=1e-15)


def test_synthetic_noise_is_iid_relative_noise_of_the_given_size():
    """noise_rel: loss x (1 + noise_rel x one standard normal draw per step), from ``rng``."""
    t = np.linspace(0.001, 1.0, 20_000)
    clean = 2.5 * eq4_ell(t, 0.2, 0.6)
    loss = synthetic_loss(t, 2.5, 0.2, 0.6, noise_rel=0.01, rng=np.random.default_rng(11))
    draws = np.random.default_rng(11).standard_normal(len(t))
    assert loss / clean - 1 == pytest.approx(0.01 * draws, abs=1e-12)
    # without an rng: seed 0
    again = synthetic_loss(t, 2.5, 0.2, 0.6, noise_rel=0.01)
    assert again / clean - 1 == pytest.approx(
        0.01 * np.random.default_rng(0).standard_normal(len(t))
    )


def test_synthetic_wiggle_is_a_smooth_sum_of_three_half_waves_of_unit_norm():
    """wiggle_rel: loss x (1 + wiggle_rel x w(t)), w = sum over k = 1, 2, 3 of
    a_k sin(pi k t + phi_k) / |a|. Least squares on sin and cos of pi k t recovers w exactly,
    and its amplitudes |a_k| / |a| have squares summing to 1."""
    t = np.linspace(0.002, 1.0, 500)
    clean = 3.0 * eq4_ell(t, 0.2, 0.6)
    for seed in range(4):
        rng = np.random.default_rng(seed)
        loss = synthetic_loss(t, 3.0, 0.2, 0.6, wiggle_rel=0.002, rng=rng)
        w = (loss / clean - 1) / 0.002
        basis = np.column_stack([f(np.pi * k * t) for k in (1, 2, 3) for f in (np.sin, np.cos)])
        coef, *_ = np.linalg.lstsq(basis, w, rcond=None)
        assert basis @ coef == pytest.approx(w, abs=1e-9)  # nothing but the three waves
        amplitude_sq = coef[0::2] ** 2 + coef[1::2] ** 2  # |a_k|^2 / |a|^2 per k
        assert amplitude_sq.sum() == pytest.approx(1.0, rel=1e-9)
        assert np.abs(w).max() <= np.sqrt(3) + 1e-12  # Cauchy-Schwarz bound of a unit norm
