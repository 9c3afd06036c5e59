"""Collapse statistics and gate thresholds pinned to numbers worked out by hand.

The other tests check the statistics on synthetic families against loose bounds; these fix the
exact values on a matrix small enough to compute on paper, so that a changed ddof, window,
normalization or gate factor fails here. Every expected value is a literal with its arithmetic
in a comment; nothing expected is computed by the code under test.

The family: three sizes (s1, s2, s3) x three seeds on the t_hat grid 0.2, 0.4, 0.6, 0.8, 1.0.
Within a size the seeds share their final loss L(T), so ell = L / L(T) is the table ``ELL``
and the raw loss is L(T) x ELL. Windows on this grid: late window [0.5, 1) -> {0.6, 0.8};
score window [0.2, 1) -> {0.2, 0.4, 0.6, 0.8}; align window [0.25, 0.5] -> {0.4};
gate window [0.2, 1] -> every point.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest

from collapse import analysis as A
from collapse.gates import GatePolicy, calibrate_threshold, evaluate_gate
from collapse.reference import ReferenceCurve, pooled_seed_std, reference_curve

GRID = np.array([0.2, 0.4, 0.6, 0.8, 1.0])
SIZES = ["s1", "s2", "s3"]
FINAL = {"s1": 4.0, "s2": 3.0, "s3": 2.0}  # L(T), the same for every seed of a size
# ell(t_hat) per run, seeds 0, 1, 2 of each size. At 0.4 every run is at 1.2, so early-align
# (one grid point in its window) divides each run by its own L(T). Within a size the seeds at
# 0.6 and 0.8 are mu - v, mu, mu + v: their std (ddof 1) is v.
ELL = {
    #        0.2    0.4     0.6    0.8   1.0
    "s1": [
        [1.5, 1.2, 1.097, 1.049, 1.0],  # v = 0.003 at 0.6, 0.001 at 0.8
        [1.5, 1.2, 1.100, 1.050, 1.0],
        [1.5, 1.2, 1.103, 1.051, 1.0],
    ],
    "s2": [
        [1.5, 1.2, 1.096, 1.043, 1.0],  # v = 0.004, 0.007
        [1.5, 1.2, 1.100, 1.050, 1.0],
        [1.5, 1.2, 1.104, 1.057, 1.0],
    ],
    "s3": [
        [1.8, 1.2, 1.095, 1.043, 1.0],  # v = 0.005, 0.007; 0.3 above the others at 0.2
        [1.8, 1.2, 1.100, 1.050, 1.0],
        [1.8, 1.2, 1.105, 1.057, 1.0],
    ],
}


def _table(ell: dict[str, list[list[float]]], final: dict[str, list[float]]) -> pd.DataFrame:
    """A curve table (run, step, loss, size, steps) with loss = L(T) x ell, 5 steps per run."""
    frames = []
    for size, rows in ell.items():
        for seed, (row, last) in enumerate(zip(rows, final[size], strict=True)):
            frames.append(
                pd.DataFrame(
                    {
                        "run": f"{size}_s{seed}",
                        "step": np.arange(1, 6),
                        "loss": last * np.asarray(row),
                        "size": size,
                        "steps": 5,
                    }
                )
            )
    return pd.concat(frames, ignore_index=True)


def _matrix(ell=ELL, final=None):
    """The real loading path, with a one-step window so smoothing leaves the values as given."""
    final = final or {size: [FINAL[size]] * 3 for size in ell}
    return A.load_matrix(_table(ell, final), window_steps=1, grid=GRID)


def _approx(values):
    return pytest.approx(values, rel=1e-9, abs=1e-12)


# ---------------------------------------------------------------- Delta, sigma, verdict, score


def test_delta_is_the_spread_over_every_run_of_the_normalized_curves():
    """Delta = std over all sizes and seeds (ddof 1) / mean, per t_hat (Qiu et al. 2025)."""
    stats = A.collapse_statistics(_matrix())
    assert stats.t_hat == _approx(GRID)
    assert stats.delta == _approx(
        [
            # 0.2: six runs at 1.5, three at 1.8: mean 1.6, squares 6 x 0.1^2 + 3 x 0.2^2
            # = 0.18, / 8 = 0.0225, std 0.15; 0.15 / 1.6
            0.09375,
            0.0,  # 0.4: every run at 1.2
            # 0.6: mean 1.1, squares 2 x (3^2 + 4^2 + 5^2) e-6 = 100e-6, / 8 = 12.5e-6,
            # std 3.5355339e-3; / 1.1
            0.0032141217326661,
            # 0.8: mean 1.05, squares 2 x (1 + 49 + 49) e-6 = 198e-6, / 8 = 24.75e-6,
            # std 4.9749372e-3; / 1.05
            0.0047380354147934,
            0.0,  # 1.0: ell = 1 for every run by construction
        ]
    )
    assert stats.sizes == SIZES and stats.excluded == [] and len(stats.runs) == 9


def test_sigma_per_size_is_the_relative_seed_std_of_the_raw_loss():
    """sigma_size = std_seeds(L) / mean_seeds(L) (ddof 1); sigma_mean averages the sizes."""
    stats = A.collapse_statistics(_matrix())
    # same L(T) within a size, so sigma = v / mu of ell: v / 1.1 at 0.6, v / 1.05 at 0.8
    assert stats.sigma["s1"] == _approx([0, 0, 0.003 / 1.1, 0.001 / 1.05, 0])
    assert stats.sigma["s1"][2:4] == _approx([0.0027272727272727, 0.00095238095238095])
    assert stats.sigma["s2"] == _approx([0, 0, 0.0036363636363636, 0.0066666666666667, 0])
    assert stats.sigma["s3"] == _approx([0, 0, 0.0045454545454545, 0.0066666666666667, 0])
    # (3 + 4 + 5)e-3 / 3 / 1.1 = 0.004 / 1.1; (1 + 7 + 7)e-3 / 3 / 1.05 = 0.005 / 1.05
    assert stats.sigma_mean == _approx([0, 0, 0.0036363636363636, 0.0047619047619048, 0])


def test_delta_over_sigma_supercollapse_and_score():
    """Late window {0.6, 0.8}: Delta below sigma at both points is supercollapse."""
    stats = A.collapse_statistics(_matrix())
    # 0.6: 3.5355339e-3 / 4e-3 = 0.88388348; 0.8: 4.9749372e-3 / 5e-3 = 0.99498744 (the 1.1
    # and 1.05 cancel); mean of the two
    assert stats.delta_over_sigma == pytest.approx(0.93943545679490, rel=1e-9)
    assert stats.supercollapse is True  # 2 of 2 late points below sigma, >= 90 %
    # mean Delta over {0.2, 0.4, 0.6, 0.8}: (0.09375 + 0 + 0.0032141217 + 0.0047380354) / 4
    assert stats.score == pytest.approx(0.025425539286865, rel=1e-9)
    assert stats.late_window == (0.5, 1.0)


def test_a_size_off_the_curve_late_is_no_supercollapse():
    """s3 0.015 high at t_hat 0.8: Delta passes sigma there, half the late window is not 90 %."""
    late = [1.058, 1.065, 1.072]  # s3's 1.043, 1.05, 1.057 at 0.8, moved up by 0.015
    ell = {**ELL, "s3": [row[:3] + [x, 1.0] for row, x in zip(ELL["s3"], late, strict=True)]}
    stats = A.collapse_statistics(_matrix(ell))
    # 0.8: six runs around 1.05, three around 1.065: mean 1.055; squares 6 x 0.005^2 +
    # 3 x 0.01^2 (sizes) + 198e-6 (seeds) = 648e-6, / 8 = 81e-6, std 0.009; 0.009 / 1.055
    assert stats.delta[3] == pytest.approx(0.0085308056872038, rel=1e-9)
    # sigma_s3 = 0.007 / 1.065; mean with 0.001 / 1.05 and 0.007 / 1.05
    assert stats.sigma_mean[3] == pytest.approx(0.0047306058573664, rel=1e-9)
    # (0.88388348 + 0.0085308057 / 0.0047306059 = 1.8033220) / 2
    assert stats.delta_over_sigma == pytest.approx(1.3436027457762, rel=1e-9)
    assert stats.supercollapse is False  # 1 of 2 late points below sigma: 50 % < 90 %
    assert A.collapse_statistics(_matrix(ell), supercollapse_fraction=0.5).supercollapse is True
    # (0.09375 + 0 + 0.0032141217 + 0.0085308057) / 4
    assert stats.score == pytest.approx(0.026373731854967, rel=1e-9)


def test_seeds_that_differ_only_in_scale_collapse_but_keep_their_raw_noise():
    """sigma is measured on the raw loss: seeds scaled by +-2.5 % have sigma 0.025, Delta 0."""
    same = [1.5, 1.2, 1.1, 1.05, 1.0]
    ell = {size: [same] * 3 for size in SIZES}
    final = {"s1": [3.9, 4.0, 4.1], "s2": [2.97, 3.0, 3.03], "s3": [1.98, 2.0, 2.02]}
    stats = A.collapse_statistics(_matrix(ell, final))
    assert stats.delta == _approx([0, 0, 0, 0, 0])
    assert stats.sigma["s1"] == _approx([0.025] * 5)  # 0.1 / 4.0 at every t_hat
    assert stats.sigma["s2"] == _approx([0.01] * 5)  # 0.03 / 3.0
    assert stats.sigma_mean == _approx([0.015] * 5)  # (0.025 + 0.01 + 0.01) / 3
    assert stats.supercollapse is True and stats.delta_over_sigma == _approx(0.0)
    # with L0 = 1 the noise floor at t_hat 1 is std(L(T)) / mean(L(T) - 1)
    with_offset = A.collapse_statistics(_matrix(ell, final), offset=1.0)
    last = [with_offset.sigma[size][-1] for size in SIZES]
    assert last == _approx([0.1 / 3.0, 0.03 / 2.0, 0.02 / 1.0])
    # ell = (L - 1) / (L(T) - 1) at t_hat 0.4 for s3: (1.2 x 1.98 - 1) / 0.98 = 1.4040816,
    # (1.2 x 2 - 1) / 1 = 1.4, (1.2 x 2.02 - 1) / 1.02 = 1.3960784
    ell_04 = _matrix(ell, final).normalized(1.0)[6:, 1]
    assert ell_04 == _approx([1.4040816326531, 1.4, 1.3960784313725])


# ---------------------------------------------------------------- seed noise and gate threshold


def test_pooled_seed_std_weights_groups_by_their_degrees_of_freedom():
    """sqrt(sum (n_g - 1) var_g / sum (n_g - 1)), per column, groups of one left out."""
    nan = np.nan
    values = np.array(
        [
            [0.0, 0.0, nan],  # group a
            [2.0, nan, nan],  # group a
            [4.0, 4.0, 5.0],  # group a
            [0.0, 1.0, nan],  # group b
            [2.0, 1.0, 3.0],  # group b
            [100.0, 100.0, 1.0],  # group c: one member, no seed noise
        ]
    )
    groups = np.array(["a", "a", "a", "b", "b", "c"])
    got = pooled_seed_std(values, groups)
    # column 0: a (0, 2, 4) var 4 with 2 dof, b (0, 2) var 2 with 1 dof: sqrt((8 + 2) / 3)
    # column 1: a (0, 4) var 8 with 1 dof, b (1, 1) var 0 with 1 dof: sqrt((8 + 0) / 2) = 2
    # column 2: no group has two finite values
    assert got[:2] == _approx([1.8257418583505538, 2.0])
    assert np.isnan(got[2])


def test_reference_mean_band_and_seed_noise():
    """The reference of s1 and s2: the mean ell, mean +- 2 std, and the pooled seed std."""
    matrix = _matrix()
    ref = reference_curve(matrix.select(matrix.meta["size"].isin(["s1", "s2"]).to_numpy()))
    assert ref.ell == _approx([1.5, 1.2, 1.1, 1.05, 1.0])
    # std over the six runs (ddof 1): 0.6: 2 x (9 + 16)e-6 / 5 = 10e-6 -> 3.1622777e-3;
    # 0.8: 2 x (1 + 49)e-6 / 5 = 20e-6 -> 4.4721360e-3
    assert ref.upper == _approx([1.5, 1.2, 1.1063245553203, 1.0589442719100, 1.0])
    assert ref.lower == _approx([1.5, 1.2, 1.0936754446797, 1.0410557280900, 1.0])
    # pooled within size (2 dof each): 0.6: sqrt((3^2 + 4^2) / 2) e-3; 0.8: sqrt((1 + 49) / 2)
    # e-3 = 5e-3 (not the mean of the two stds, 4e-3)
    assert ref.seed_std == _approx([0, 0, 0.0035355339059327, 0.005, 0])
    assert ref.sizes == ["s1", "s2"] and ref.n_curves.tolist() == [6] * 5


def _reference() -> ReferenceCurve:
    matrix = _matrix()
    return reference_curve(matrix.select(matrix.meta["size"].isin(["s1", "s2"]).to_numpy()))


def test_calibrated_threshold_is_k_sigma_times_the_largest_seed_std():
    """4 x 0.005 = 0.02; below the floor the floor; a fixed threshold replaces both."""
    reference = _reference()
    assert GatePolicy().k_sigma == 4.0 and GatePolicy().floor == 0.005
    threshold, basis = calibrate_threshold(reference, GatePolicy())
    assert threshold == pytest.approx(0.02, rel=1e-9)  # 4 x max(0, 0, 3.54e-3, 5e-3, 0)
    assert basis == "4 x reference seed std 0.005"
    assert calibrate_threshold(reference, GatePolicy(k_sigma=2.5))[0] == pytest.approx(0.0125)
    threshold, basis = calibrate_threshold(reference, GatePolicy(k_sigma=0.5))
    assert threshold == 0.005 and basis.startswith("floor 0.005")  # 0.5 x 0.005 = 0.0025
    assert calibrate_threshold(reference, GatePolicy(k_sigma=0.5, floor=0.0))[0] == (
        pytest.approx(0.0025)
    )
    # only the gate window counts: leaving out t_hat 0.8 leaves 4 x 3.5355339e-3
    narrow = GatePolicy(window=(0.2, 0.7))
    assert calibrate_threshold(reference, narrow)[0] == pytest.approx(0.014142135623731)
    assert calibrate_threshold(reference, GatePolicy(threshold=0.03))[0] == 0.03


def test_threshold_without_seed_noise_is_the_floor():
    """A reference with one seed per size has no seed std: the floor alone."""
    nan = np.full(5, np.nan)
    one_seed = ReferenceCurve(GRID, np.ones(5), np.ones(5), np.ones(5), nan, np.ones(5))
    threshold, basis = calibrate_threshold(one_seed, GatePolicy())
    assert threshold == 0.005 and "no seed noise" in basis


# ---------------------------------------------------------------- gate verdicts at the edge


def _probes(at_08: dict[str, float]) -> A.C.CurveMatrix:
    """Runs on the reference except at t_hat 0.8, with L(T) = 2.5 (early-align finds it)."""
    ell = {name: [[1.5, 1.2, 1.1, x, 1.0]] for name, x in at_08.items()}
    frame = _table(ell, {name: [2.5] for name in at_08})
    frame["run"] = frame["size"]  # one run per probe, named as given
    return A.load_matrix(frame, window_steps=1, grid=GRID)


def test_gate_passes_just_inside_the_threshold_and_fails_just_outside():
    """Threshold 0.02: r = +0.0195 passes, +0.0205 and -0.0205 fail at t_hat 0.8."""
    probes = _probes({"inside": 1.0695, "outside": 1.0705, "below": 1.0295})
    verdicts, residual = A.gate_matrix(probes, _reference(), GatePolicy())
    got = {v.run: v for v in verdicts}
    assert residual.ravel() == _approx(
        [0, 0, 0, 0.0195, 0] + [0, 0, 0, 0.0205, 0] + [0, 0, 0, -0.0205, 0]
    )
    inside, outside, below = got["inside"], got["outside"], got["below"]
    assert inside.passed and inside.status == "pass"
    assert inside.threshold == pytest.approx(0.02, rel=1e-9)
    assert inside.max_abs_residual == pytest.approx(0.0195, rel=1e-9)
    assert inside.at_t_hat == 0.8 and inside.first_crossing_t_hat is None
    assert inside.aligned_final_loss == pytest.approx(2.5, rel=1e-12)  # 3.0 / 1.2
    for verdict, sign in ((outside, 1), (below, -1)):
        assert not verdict.passed and verdict.status == "fail"
        assert verdict.first_crossing_t_hat == 0.8
        assert verdict.residual_at_max == pytest.approx(sign * 0.0205, rel=1e-9)
    assert "runs above it" in outside.message and "runs below it" in below.message
    # at the floor (k_sigma 0.5: 0.0025 < 0.005) the inside run fails too
    floor, _ = A.gate_matrix(probes, _reference(), GatePolicy(k_sigma=0.5))
    assert [v.passed for v in floor] == [False, False, False]
    assert floor[0].threshold == 0.005


def test_a_residual_exactly_at_the_threshold_passes():
    """The gate fails on |r| > threshold: |r| = threshold passes, the next float up fails."""
    policy = GatePolicy(threshold=0.02)
    at = np.array([0.0, 0.0, 0.0, 0.02, -0.02])
    verdict = evaluate_gate("edge", GRID, at, _reference(), policy)
    assert verdict.passed and verdict.max_abs_residual == 0.02
    over = at.copy()
    over[3] = np.nextafter(0.02, 1.0)
    verdict = evaluate_gate("over", GRID, over, _reference(), policy)
    assert not verdict.passed and verdict.first_crossing_t_hat == 0.8


def test_gate_of_the_family_flags_the_size_off_the_curve_early():
    """s3 is 0.3 above the reference at t_hat 0.2; s1 and s2 stay within 0.007 of it."""
    verdicts, _ = A.gate_matrix(_matrix(), _reference(), GatePolicy())
    got = {v.run: v for v in verdicts}
    for seed in range(3):
        s3 = got[f"s3_s{seed}"]
        assert not s3.passed and s3.first_crossing_t_hat == 0.2
        assert s3.max_abs_residual == pytest.approx(0.3, rel=1e-9)  # 1.8 - 1.5
    assert all(got[f"{size}_s{seed}"].passed for size in ("s1", "s2") for seed in range(3))
    # the largest clean residual: s2's seeds at 0.8, 1.05 -+ 0.007
    assert got["s2_s2"].max_abs_residual == pytest.approx(0.007, rel=1e-9)
    assert got["s2_s0"].residual_at_max == pytest.approx(-0.007, rel=1e-9)


def test_a_point_one_seed_covers_takes_no_part_in_the_pooled_seed_std():
    """Group a has two rows but only one finite value in column 1: that column's noise comes
    from group b alone. Column 0: a (1, 3) var 2, b (5, 9) var 8, pooled sqrt((2 + 8) / 2);
    column 1: b (6, 10) var 8 alone."""
    values = np.array([[1.0, 2.0], [3.0, np.nan], [5.0, 6.0], [9.0, 10.0]])
    groups = np.array(["a", "a", "b", "b"])
    assert pooled_seed_std(values, groups) == pytest.approx([np.sqrt(5.0), np.sqrt(8.0)])


def test_the_surrogate_fit_sees_only_its_window():
    """Points outside ``fit_window`` (here t_hat < 0.2 and > 0.8) may be anything: the fit is
    that of the clean curves. Two tau and two TPP values, so all four constants are fitted."""
    from collapse.surrogate import eq4_ell, fit_surrogate

    grid = np.linspace(0.01, 1.0, 100)
    tau, tpp = np.array([0.1, 0.3, 0.1, 0.3]), np.array([20.0, 20.0, 80.0, 80.0])
    b, q = (2.0 * tau**0.5).reshape(-1, 1), (0.4 * tpp**0.1).reshape(-1, 1)
    clean = eq4_ell(grid, b, q)
    outside = (grid < 0.2) | (grid > 0.8)
    spoiled = np.where(outside, 7.0, clean)
    a = fit_surrogate(grid, clean, tau, tpp, fit_window=(0.2, 0.8))
    z = fit_surrogate(grid, spoiled, tau, tpp, fit_window=(0.2, 0.8))
    assert z.params == a.params and z.mae == a.mae
    assert a.mae < 1e-3  # and the clean curves are what it fits


def test_warmup_never_takes_the_whole_run():
    """At least one step decays: 90 % warmup of 2 steps rounds to 2, capped at 1."""
    from collapse.scaling import warmup_steps

    assert warmup_steps(2, fraction=0.9) == 1
    assert warmup_steps(10, fraction=0.5) == 5


# ---------------------------------------------------------------- plots: what is drawn


@pytest.fixture
def drawn(monkeypatch):
    """The figures the plot functions hand to ``plotting.save`` (still written to disk), so a
    test reads back what was drawn: line data, spans, axis limits, labels."""
    from collapse import plotting

    figures = []
    write = plotting.save

    def keep(fig, path, *args, **kwargs):
        figures.append(fig)
        return write(fig, path, *args, **kwargs)

    monkeypatch.setattr(plotting, "save", keep)
    monkeypatch.setattr(A, "save", keep)
    return figures


def _span(patch) -> tuple[float, float]:
    """The t_hat extent of an axvspan."""
    xs = patch.get_path().vertices[:, 0] * patch.get_width() + patch.get_x()
    return float(xs.min()), float(xs.max())


def _ys(line) -> list[float]:
    """y data of a line, also of an axhline (whose data is a plain list)."""
    return np.asarray(line.get_ydata(), dtype=float).tolist()


def _legend_font(ax) -> float:
    return ax.get_legend().get_texts()[0].get_fontsize()


def _style(line) -> tuple:
    return line.get_color(), line.get_linestyle(), line.get_linewidth()


DELTA_BY_HAND = [0.09375, 0.0, 0.0032141217326661, 0.0047380354147934, 0.0]  # see above


def test_collapse_plot_draws_the_curves_delta_and_sigma(drawn, tmp_path):
    """collapse.png: every normalized run over the reference (top); 100 x Delta and 100 x sigma
    per size on a log axis over the late window (bottom)."""
    from matplotlib import colormaps

    matrix, reference = _matrix(), _reference()
    stats = A.collapse_statistics(matrix)
    A.plot_collapse(tmp_path / "collapse.png", matrix, stats, reference)
    assert (tmp_path / "collapse.png").stat().st_size > 0
    (fig,) = drawn
    top, bottom = fig.axes[:2]
    assert top.get_subplotspec().get_gridspec().get_height_ratios() == [3, 2]
    # top: the reference, then one curve per run, ell = L / L(T) = the table ELL
    assert top.lines[0].get_xydata() == _approx(np.column_stack([GRID, reference.ell]))
    runs = [row for size in SIZES for row in ELL[size]]
    assert len(top.lines) == 1 + len(runs)
    for line, row in zip(top.lines[1:], runs, strict=True):
        assert line.get_xydata() == _approx(np.column_stack([GRID, row]))
    assert top.get_title() == (
        "collapse score 0.0254 (mean Δ over t̂ ≥ 0.2); supercollapse"  # 0.025425539 above
    )
    # bottom: Delta in percent, black and heavier than the sigma lines
    delta = bottom.lines[0]
    assert delta.get_xydata() == _approx(np.column_stack([GRID, 100 * np.array(DELTA_BY_HAND)]))
    assert _style(delta) == ("k", "-", 1.5)
    sigma_by_hand = {
        "s1": [0, 0, 0.3 / 1.1, 0.1 / 1.05, 0],  # 100 x v / mu, v in 1e-3
        "s2": [0, 0, 0.4 / 1.1, 0.7 / 1.05, 0],
        "s3": [0, 0, 0.5 / 1.1, 0.7 / 1.05, 0],
    }
    viridis = colormaps["viridis"](np.linspace(0.0, 0.85, 3))  # smallest size darkest
    assert len(bottom.lines) == 4
    for line, size, colour in zip(bottom.lines[1:], SIZES, viridis, strict=True):
        assert line.get_xydata() == _approx(np.column_stack([GRID, sigma_by_hand[size]]))
        assert line.get_color() == tuple(colour) and line.get_linestyle() == "--"
        assert line.get_linewidth() == 1.0 and line.get_label() == f"σ seed noise, size {size}"
    (late,) = bottom.patches
    assert _span(late) == _approx(stats.late_window) and late.get_label() == "late window"
    assert bottom.get_yscale() == "log" and bottom.get_xlim() == (0.0, 1.0)
    assert top.get_xlim() == (0.0, 1.0)  # the panels share their t_hat axis


def test_collapse_plot_leaves_incomplete_runs_out(drawn, tmp_path):
    """A run that stopped at t_hat 0.6 has no L(T): it is neither drawn nor counted."""
    frame = _table(ELL, {size: [FINAL[size]] * 3 for size in ELL})
    frame = frame[(frame["run"] != "s2_s1") | (frame["step"] <= 3)]
    matrix = A.load_matrix(frame, window_steps=1, grid=GRID)
    stats = A.collapse_statistics(matrix)
    assert stats.excluded == ["s2_s1"]
    A.plot_collapse(tmp_path / "collapse.png", matrix, stats)
    top = drawn[0].axes[0]
    assert len(top.lines) == 8  # no reference given, eight complete runs
    assert top.lines[4].get_xydata()[:, 1] == _approx(ELL["s2"][2])  # s2_s1 skipped


def _probe_gates(policy: GatePolicy):
    probes = _probes({"inside": 1.0695, "outside": 1.0705, "below": 1.0295})
    return A.gate_matrix(probes, _reference(), policy)


def test_residuals_plot_draws_every_residual_and_the_threshold(drawn, tmp_path):
    """residuals.png: r of each run (failed ones red, thicker, on top), +-threshold, the gate
    window; y limits 1.2 x the largest |r| inside the window, its end included."""
    policy = GatePolicy(window=(0.2, 0.8))
    verdicts, residual = _probe_gates(policy)
    A.plot_residuals(tmp_path / "residuals.png", GRID, residual, verdicts)
    (ax,) = drawn[0].axes
    by_hand = [[0, 0, 0, 0.0195, 0], [0, 0, 0, 0.0205, 0], [0, 0, 0, -0.0205, 0]]
    runs, legend, thresholds = ax.lines[:3], ax.lines[3:5], ax.lines[5:]
    for line, row in zip(runs, by_hand, strict=True):
        assert line.get_xydata() == _approx(np.column_stack([GRID, row]))
    passed, failed = runs[0], runs[1]
    assert (passed.get_color(), passed.get_linewidth(), passed.get_alpha()) == ("0.55", 0.6, 0.5)
    assert (failed.get_color(), failed.get_linewidth(), failed.get_alpha()) == ("C3", 1.0, 0.9)
    assert failed.get_zorder() > passed.get_zorder() and runs[2].get_color() == "C3"
    assert [line.get_label() for line in legend] == ["passed (1) or undetermined", "failed (2)"]
    assert [_ys(line) for line in thresholds] == [_approx([0.02] * 2), _approx([-0.02] * 2)]
    assert [_style(line) for line in thresholds] == [("C1", "--", 1.0)] * 2
    assert thresholds[0].get_label() == "threshold ±0.0200"
    (window,) = ax.patches
    assert _span(window) == _approx((0.2, 0.8))
    # the largest |r| in the window is 0.0205 at t_hat 0.8, the window's last point
    assert ax.get_ylim() == _approx((-1.2 * 0.0205, 1.2 * 0.0205))
    assert ax.get_xlim() == (0.0, 1.0)
    assert drawn[0].get_size_inches().tolist() == [8.0, 4.5] and _legend_font(ax) == 8.0


def test_residuals_plot_limits_are_the_threshold_when_every_run_is_inside(drawn, tmp_path):
    verdicts, residual = _probe_gates(GatePolicy(threshold=0.05))
    A.plot_residuals(tmp_path / "residuals.png", GRID, residual, verdicts)
    ax = drawn[0].axes[0]
    assert ax.get_ylim() == _approx((-1.2 * 0.05, 1.2 * 0.05))  # 0.0205 < 0.05
    assert [line.get_label() for line in ax.lines[3:5]] == [
        "passed (3) or undetermined",
        "failed (0)",
    ]


def _eq4_by_hand(t, b, q, warmup=0.1):
    """Eq. 4 written out (docs/method.md §5): eps1 0.001, eps2 0.1, m 0.05, D2Z schedule."""
    eta = np.where(t < warmup, t / warmup, (1 - t) / (1 - warmup))
    raw = (1.001 / (t + 0.001)) ** 0.05 + b * (eta + 0.1) ** q
    return raw / (1 + b * 0.1**q)


def test_reference_plot_draws_the_band_the_curve_and_the_surrogate(drawn, tmp_path):
    from collapse.surrogate import SurrogateFit, SurrogateParams

    reference = _reference()
    params = SurrogateParams(b_c=0.5, b_e=0.5, q_c=0.4, q_e=0.1)
    fit = SurrogateFit(params, rounds=1, mae=0.0123, fit_window=(0.2, 1.0))
    A.plot_reference(tmp_path / "reference.png", reference, fit, [(0.04, 10.0)])
    (ax,) = drawn[0].axes
    (band,) = ax.collections
    corners = band.get_paths()[0].vertices
    assert corners[:, 1].max() == _approx(1.5) and corners[:, 1].min() == _approx(1.0)
    ref, surrogate = ax.lines
    assert ref.get_xydata() == _approx(np.column_stack([GRID, [1.5, 1.2, 1.1, 1.05, 1.0]]))
    assert _style(ref) == ("k", "-", 1.5) and ref.get_label() == "reference (s1, s2)"
    # b = 0.5 x 0.04^0.5 = 0.1, q = 0.4 x 10^0.1
    want = _eq4_by_hand(GRID, 0.1, 0.4 * 10**0.1)
    assert surrogate.get_ydata() == pytest.approx(want, rel=1e-12)
    assert surrogate.get_label() == "Eq. 4 surrogate τ=0.04, TPP=10 (MAE 0.0123)"
    # y from 0.98 to 2 % above the band's top over t_hat >= 0.2 (1.5 at 0.2)
    assert ax.get_ylim() == _approx((0.98, 1.02 * 1.5)) and ax.get_xlim() == (0.0, 1.0)


def test_gate_plot_draws_the_run_its_residual_and_the_crossing(drawn, tmp_path):
    """gates/<run>.png of a failed run: the early-aligned run on the reference (top), r against
    +-threshold with the first crossing marked (bottom)."""
    from collapse.gates import plot_gate

    verdicts, residual = _probe_gates(GatePolicy())
    reference = _reference()
    outside = verdicts[1]
    assert outside.run == "outside" and outside.status == "fail"
    ell_run = residual[1] + reference.ell  # as the analysis draws it
    plot_gate(tmp_path / "outside.png", outside, GRID, ell_run, reference)
    top, bottom = drawn[0].axes[:2]
    assert top.get_subplotspec().get_gridspec().get_height_ratios() == [3, 2]
    ref, run = top.lines
    assert ref.get_xydata() == _approx(np.column_stack([GRID, [1.5, 1.2, 1.1, 1.05, 1.0]]))
    assert run.get_xydata() == _approx(np.column_stack([GRID, [1.5, 1.2, 1.1, 1.0705, 1.0]]))
    assert _style(ref) == ("k", "-", 1.5) and _style(run) == ("C3", "-", 1.2)
    assert ref.get_label() == "reference (s1, s2)" and run.get_label() == "outside (early-aligned)"
    assert drawn[0].get_size_inches().tolist() == [7.5, 6.5]
    assert [_legend_font(ax) for ax in (top, bottom)] == [8.0, 8.0]
    (band,) = top.collections
    assert band.get_paths()[0].vertices[:, 1].max() == _approx(reference.upper.max())
    (align,) = top.patches
    assert _span(align) == _approx((0.25, 0.5))
    # ell from t_hat 0.2 on spans 1.0 .. 1.5
    assert top.get_ylim() == _approx((0.98 * 1.0, 1.02 * 1.5))
    assert top.get_title() == "outside: gate FAIL"
    r, upper, lower, crossing = bottom.lines
    assert r.get_xydata() == _approx(np.column_stack([GRID, [0, 0, 0, 0.0205, 0]]))
    assert _style(r) == ("C3", "-", 1.2)
    assert _ys(upper) == _approx([0.02] * 2) and _ys(lower) == _approx([-0.02] * 2)
    assert _style(upper) == _style(lower) == ("C1", "--", 1.0)
    assert upper.get_label() == "threshold ±0.0200" and lower.get_label().startswith("_")
    assert np.asarray(crossing.get_xdata(), float).tolist() == [0.8, 0.8]
    assert crossing.get_label() == "first crossing t̂ = 0.800"
    (window,) = bottom.patches
    assert _span(window) == _approx((0.2, 1.0))
    assert bottom.get_ylim() == _approx((-1.3 * 0.0205, 1.3 * 0.0205))
    assert bottom.get_xlim() == top.get_xlim() == (0.0, 1.0)  # one shared t_hat axis


def test_gate_plot_of_a_passed_run_is_blue_and_scaled_to_the_threshold(drawn, tmp_path):
    from collapse.gates import plot_gate

    verdicts, residual = _probe_gates(GatePolicy(window=(0.4, 1.0)))
    reference = _reference()
    inside = verdicts[0]
    assert inside.run == "inside" and inside.passed
    plot_gate(tmp_path / "inside.png", inside, GRID, residual[0] + reference.ell, reference)
    top, bottom = drawn[0].axes[:2]
    assert top.lines[1].get_color() == "C0" and bottom.lines[0].get_color() == "C0"
    # the y range covers the run from the window's start (t_hat 0.4: 1.0 .. 1.2), not the 1.5
    # at 0.2 before it
    assert top.get_ylim() == _approx((0.98 * 1.0, 1.02 * 1.2))
    assert top.get_title() == "inside: gate PASS"
    unnamed = dataclasses.replace(reference, sizes=[])
    plot_gate(tmp_path / "unnamed.png", inside, GRID, residual[0] + reference.ell, unnamed)
    assert drawn[1].axes[0].lines[0].get_label() == "reference"
    assert len(bottom.lines) == 3  # r and +-threshold: no crossing to mark
    # |r| at most 0.0195, below the threshold 0.02: the limits follow the threshold
    assert bottom.get_ylim() == _approx((-1.3 * 0.02, 1.3 * 0.02))


def test_verdict_messages_name_the_numbers():
    """The sentence a user reads, for a pass, a failure above, one below, and non-finite loss."""
    verdicts, _ = _probe_gates(GatePolicy())
    inside, outside, below = verdicts
    basis = "4 x reference seed std 0.005"
    assert inside.message == (
        "inside: follows the reference (sizes s1, s2): max |r| 0.0195 at t_hat 0.800 is within "
        f"the threshold 0.0200 ({basis}) over t_hat [0.2, 1]"
    )
    assert outside.message == (
        "outside: diverged from the reference (sizes s1, s2) at t_hat 0.800: the normalized "
        "loss runs above it, |r| = 0.0205 there and up to 0.0205 (+0.0205) at t_hat 0.800, "
        f"against the threshold 0.0200 ({basis})"
    )
    assert "runs below it" in below.message and "(-0.0205)" in below.message
    nan = np.array([0.0, 0.001, np.nan, np.nan, np.nan])
    diverged = evaluate_gate("nan", GRID, nan, _reference(), GatePolicy(), plot="x.png")
    assert diverged.status == "fail" and diverged.first_crossing_t_hat == 0.6
    assert diverged.max_abs_residual == 0.001 and diverged.at_t_hat == 0.4
    assert diverged.message == (
        "nan: the loss is not finite from t_hat 0.600 on (NaN or inf); it diverged against "
        "the reference (sizes s1, s2); evidence: x.png"
    )
    allowed = evaluate_gate("nan", GRID, nan, _reference(), GatePolicy(enforce=False))
    assert allowed.status == "overridden" and not allowed.passed
    assert allowed.message.endswith(
        "not enforced (family.gates.enforce=false or allow_fail in the config)"
    )


def test_a_run_that_stopped_is_gated_up_to_where_it_got():
    """t_hat_max 0.6: the window ends there (a residual beyond it is not the run's); before
    the end of the align window (0.5) nothing can be decided."""
    r = np.array([0.0, 0.0, 0.01, 0.5, 0.5])
    verdict = evaluate_gate("part", GRID, r, _reference(), GatePolicy(), t_hat_max=0.6)
    assert verdict.passed and verdict.max_abs_residual == 0.01 and verdict.at_t_hat == 0.6
    assert verdict.message.endswith("over t_hat [0.2, 0.6]")
    early = evaluate_gate("early", GRID, r, _reference(), GatePolicy(), t_hat_max=0.45)
    assert early.status == "undetermined" and not early.passed
    assert early.message == (
        "early: undetermined: the curve ends at t_hat 0.450, before the end of the align "
        "window 0.5, so it cannot be normalized yet"
    )
    sparse = evaluate_gate("sparse", GRID, r, _reference(), GatePolicy(), align_points=0)
    assert sparse.status == "undetermined" and sparse.max_abs_residual is None
    assert "0 logged points lie in the align window t_hat [0.25, 0.5]" in sparse.message
    assert evaluate_gate("one", GRID, r * 0, _reference(), GatePolicy(), align_points=1).passed


def test_reference_surrogate_uses_the_runs_controls_and_warmup():
    """Eq. 4 is fitted with the runs' median warmup share (warmup_steps / steps), and not at
    all without tau and tpp for every run."""
    frame = _table(ELL, {size: [FINAL[size]] * 3 for size in ELL}).assign(tau=0.1, tpp=20.0)
    # warmup of 1 step of 5 for s1 and s2, 2 of 5 for s3: median share 0.2
    frame["warmup_steps"] = np.where(frame["size"] == "s3", 2, 1)
    matrix = A.load_matrix(frame, window_steps=1, grid=GRID)
    fit = A.fit_reference_surrogate(matrix)
    assert fit is not None and fit.params.warmup_fraction == pytest.approx(0.2)
    assert fit.taus == [0.1] and fit.tpps == [20.0]
    no_warmup = A.load_matrix(frame.drop(columns="warmup_steps"), window_steps=1, grid=GRID)
    assert A.fit_reference_surrogate(no_warmup).params.warmup_fraction == 0.1  # the paper's
    assert A.fit_reference_surrogate(_matrix()) is None  # no tau, tpp
    gap = frame.assign(tpp=np.where(frame["run"] == "s2_s1", np.nan, 20.0))
    assert A.fit_reference_surrogate(A.load_matrix(gap, window_steps=1, grid=GRID)) is None


# ---------------------------------------------------------------- small helpers


def test_default_reference_sizes_leave_a_size_to_test():
    """The two smallest sizes, but never every size: with two sizes only the smaller one."""
    assert A.default_reference_sizes(["s1"]) == ["s1"]
    assert A.default_reference_sizes(["s1", "s2"]) == ["s1"]
    assert A.default_reference_sizes(["s1", "s2", "s3"]) == ["s1", "s2"]
    assert A.default_reference_sizes(["s1", "s2", "s3", "s4"]) == ["s1", "s2"]


def test_json_outputs_hold_no_nan(tmp_path):
    """NaN and inf (a statistic over too few points) become null; numpy values plain numbers."""
    payload = {
        "nan": float("nan"),
        "inf": np.float64(np.inf),
        "x": np.float32(0.5),
        "n": np.int64(3),
        "arr": np.array([1.0, np.nan]),
        "pair": (0.2, float("-inf")),
        1: {"deep": [np.nan, 2]},
    }
    path = A.write_json(tmp_path / "sub" / "out.json", payload)
    assert path.read_text() == (
        "{\n"
        '  "nan": null,\n'
        '  "inf": null,\n'
        '  "x": 0.5,\n'
        '  "n": 3,\n'
        '  "arr": [\n    1.0,\n    null\n  ],\n'
        '  "pair": [\n    0.2,\n    null\n  ],\n'
        '  "1": {\n    "deep": [\n      null,\n      2\n    ]\n  }\n'
        "}\n"
    )


def test_offset_must_be_finite_and_below_every_loss():
    meta = _matrix().meta  # min_loss: s3's runs reach 2.0 x 1.0 = 2.0 at t_hat 1
    assert meta["min_loss"].min() == pytest.approx(2.0)
    A.check_offset(meta, 1.99)
    with pytest.raises(ValueError, match=r"--offset 2 is not below every loss: run s3_s0 "):
        A.check_offset(meta, 2.0)
    with pytest.raises(ValueError, match=r"--offset nan: give a finite number"):
        A.check_offset(meta, float("nan"))
    with pytest.raises(ValueError, match=r"--offset inf"):
        A.check_offset(meta, float("inf"))


def test_reference_sizes_must_be_among_the_sizes():
    with pytest.raises(ValueError, match=r"\['s9'\] not among the sizes in the curves"):
        A._reference_part(_matrix(), ["s1", "s9"])
    with pytest.raises(ValueError, match=r"reference size\(s\) \[\] not among"):
        A._reference_part(_matrix(), [])
    part = A._reference_part(_matrix(), ["s2"])
    assert list(part.meta.index) == ["s2_s0", "s2_s1", "s2_s2"]


@pytest.mark.parametrize(
    "bad",
    [
        dict(window=(0.5, 0.5)),  # empty
        dict(window=(0.6, 0.3)),  # reversed
        dict(window=(-0.1, 0.5)),  # before the start of training
        dict(align_window=(0.2, 1.01)),  # past its end
        dict(k_sigma=0.0),
        dict(floor=-0.001),
        dict(threshold=0.0),
    ],
)
def test_gate_policy_refuses_windows_outside_training_and_non_positive_factors(bad):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="must satisfy 0 <= start < end <= 1|greater than"):
        GatePolicy(**bad)


def test_gate_policy_accepts_the_whole_run_and_a_zero_floor():
    policy = GatePolicy(window=(0.0, 1.0), align_window=(0.0, 0.5), floor=0.0)
    assert policy.window == (0.0, 1.0) and policy.floor == 0.0


# ---------------------------------------------------------------- early-align by hand


def test_early_align_is_the_geometric_mean_ratio_and_its_scatter():
    """Over the window, log(L - L0) - log ell_ref = log(L(T) - L0) + e with e = +0.01, -0.02,
    +0.01: mean 0, so L(T) - L0 = 2; scatter = std(e, ddof 1) = sqrt(6e-4 / 2) = 0.017320508;
    the band 2 exp(-+2 x 0.017320508) around it."""
    from collapse.reference import early_align, early_align_matrix

    ref_t, ref_ell = np.array([0.0, 0.25, 0.5, 1.0]), np.array([2.0, 1.2, 1.1, 1.0])
    t = np.array([0.1, 0.25, 0.375, 0.5, 0.75])
    e = np.array([0.3, 0.01, -0.02, 0.01, 0.3])  # the points outside the window are off
    ell_at_t = np.array([1.68, 1.2, 1.15, 1.1, 1.05])  # ref_ell interpolated by hand
    for offset in (0.0, 0.5):
        loss = offset + 2.0 * ell_at_t * np.exp(e)
        got = early_align(t, loss, ref_t, ref_ell, offset=offset)
        assert got.final_loss == pytest.approx(offset + 2.0, rel=1e-12)
        assert got.log_scatter == pytest.approx(0.017320508075689, rel=1e-9)
        assert got.lower == pytest.approx(offset + 2.0 * np.exp(-0.034641016151378), rel=1e-9)
        assert got.upper == pytest.approx(offset + 2.0 * np.exp(0.034641016151378), rel=1e-9)
        assert got.n_points == 3 and got.window == (0.25, 0.5) and got.offset == offset
        # the same on a grid, many rows: this run, one with a single point in the window
        # (scatter 0) and one with none (NaN)
        one = np.where(t == 0.375, loss, np.nan)
        rows = np.vstack([loss, one, np.full(5, np.nan)])
        final, scatter = early_align_matrix(t, rows, ell_at_t, offset=offset)
        assert final[:2] == pytest.approx([offset + 2.0, offset + 2.0 * np.exp(-0.02)])
        assert scatter[:2] == pytest.approx([0.017320508075689, 0.0], abs=1e-12)
        assert np.isnan(final[2]) and np.isnan(scatter[2])
    single = early_align(t[2:3], loss[2:3], ref_t, ref_ell, offset=0.5)
    assert single.log_scatter == 0.0 and single.lower == single.upper == single.final_loss
    with pytest.raises(
        ValueError, match=r"no finite point .* \(it has 1 points, up to t_hat 0.1\)"
    ):
        early_align(t[:1], loss[:1], ref_t, ref_ell)
    with pytest.raises(ValueError, match=r"\(it has 0 points, up to t_hat 0\)"):
        early_align(t[:0], loss[:0], ref_t, ref_ell)
    with pytest.raises(ValueError, match="loss - offset must be > 0"):
        early_align(t, loss, ref_t, ref_ell, offset=3.0)
    for window in ((0.5, 0.5), (-0.1, 0.5), (0.2, 1.1)):
        with pytest.raises(ValueError, match="must satisfy 0 <= start < end <= 1"):
            early_align(t, loss, ref_t, ref_ell, window=window)


def test_a_reference_curve_cannot_be_changed_in_place():
    """Gates, plots and predictions share one reference: none of them may alter it."""
    reference = _reference()
    with pytest.raises(dataclasses.FrozenInstanceError):
        reference.ell = reference.ell * 2


def test_reference_csv_is_written_into_new_folders(tmp_path):
    """reference.csv creates its folder, and reads back to 8 significant digits."""
    from collapse.reference import ReferenceCurve

    path = _reference().write_csv(tmp_path / "family" / "reference" / "reference.csv")
    back = ReferenceCurve.read_csv(path)
    assert back.ell == _approx([1.5, 1.2, 1.1, 1.05, 1.0])
    assert back.seed_std == pytest.approx([0, 0, 0.0035355339, 0.005, 0], rel=1e-8, abs=1e-12)
