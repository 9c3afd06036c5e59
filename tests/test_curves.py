"""Reading, smoothing, resampling and normalizing loss curves (collapse.curves)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from collapse import curves as C
from collapse.layout import CURVE_COLUMNS, FamilyLayout


def _long(runs: dict[str, int], **meta_cols) -> pd.DataFrame:
    rows = []
    for i, (run, steps) in enumerate(runs.items()):
        step = np.arange(1, steps + 1)
        frame = pd.DataFrame({"run": run, "step": step, "loss": 3.0 + 1.0 / step})
        for name, values in meta_cols.items():
            frame[name] = values[i]
        rows.append(frame)
    return pd.concat(rows, ignore_index=True)


def test_generic_csv_metadata_and_t_hat_from_max_step(tmp_path):
    df = _long({"a": 50, "b": 80}, size=["s1", "s2"], seed=[0, 1], tau=[0.2, 0.2])
    path = tmp_path / "curves.csv"
    df.to_csv(path, index=False)
    curves = C.read_curves(path)
    assert list(curves.meta.index) == ["a", "b"]
    assert curves.meta.loc["b", "size"] == "s2" and curves.meta.loc["b", "seed"] == 1
    assert "size" not in curves.data.columns  # per-run columns move to meta
    last = curves.data.groupby("run")["t_hat"].max()
    assert np.allclose(last, 1.0) and curves.meta["complete"].all()
    b = curves.data[curves.data["run"] == "b"]
    assert np.allclose(b["t_hat"], b["step"] / 80)


def test_partial_run_with_known_length_is_not_complete(tmp_path):
    df = _long({"full": 100, "part": 30}, steps=[100, 100])
    curves = C.smooth(C.curves_from_frame(df), window_steps=5)
    assert curves.meta.loc["part", "t_hat_max"] == pytest.approx(0.3)
    assert not curves.meta.loc["part", "complete"] and curves.meta.loc["full", "complete"]
    matrix = C.resample(curves)
    part = matrix.loss[list(matrix.meta.index).index("part")]
    assert np.isnan(matrix.meta.loc["part", "final_loss"])
    assert np.isnan(part[matrix.grid > 0.3 + 1e-9]).all() and np.isfinite(part[5:60]).all()


def test_project_family_dir_with_plan_runs_csv(tmp_path):
    fam = FamilyLayout.of("tiny", tmp_path)
    for run, steps in {"d64_s0": 40, "d128_s0": 60}.items():
        n = np.arange(1, steps + 1)
        frame = pd.DataFrame({c: 0 for c in CURVE_COLUMNS}, index=range(steps))
        frame = frame.assign(run=run, step=n, tokens=n * 1024, t_hat=n / steps, loss=2 + 1 / n)
        fam.run_dir(run).mkdir(parents=True)
        frame.to_parquet(fam.curve(run))
    fam.plan_dir.mkdir(parents=True)
    pd.DataFrame(
        {"run": ["d64_s0", "d128_s0"], "size": ["d64", "d128"], "params": [1e5, 4e5], "seed": 0}
    ).to_csv(fam.plan_dir / "runs.csv", index=False)
    curves = C.read_curves(fam.root)
    assert curves.meta.loc["d128_s0", "size"] == "d128"
    assert C.ordered_sizes(curves.meta) == ["d64", "d128"]
    assert "tokens" in curves.data.columns and curves.meta["complete"].all()


def test_missing_column_names_it_and_the_fix():
    with pytest.raises(ValueError, match=r"\['loss'\].*rename"):
        C.curves_from_frame(pd.DataFrame({"run": ["a"], "step": [1], "train_loss": [2.0]}))


def test_duplicate_steps_are_rejected():
    df = pd.DataFrame({"run": ["a", "a"], "step": [1, 1], "loss": [2.0, 2.0]})
    with pytest.raises(ValueError, match="duplicate"):
        C.curves_from_frame(df)


def test_trailing_mean_matches_brute_force_with_sparse_logging_and_groups():
    rng = np.random.default_rng(0)
    steps = np.concatenate([np.arange(2, 41, 2), np.arange(1, 31)])  # run a logs every 2 steps
    groups = np.array(["a"] * 20 + ["b"] * 30)
    values = rng.normal(size=50)
    window = np.array([6] * 20 + [4] * 30)
    got = C.trailing_mean(values, steps, groups, window)
    want = [
        values[(groups == g) & (steps > s - w) & (steps <= s)].mean()
        for s, g, w in zip(steps, groups, window, strict=True)
    ]
    assert np.allclose(got, want)


def test_nan_loss_poisons_its_window_only():
    values = np.array([1.0, 2.0, np.nan, 4.0, 5.0, 6.0])
    got = C.trailing_mean(values, np.arange(1, 7), np.zeros(6), np.full(6, 2))
    assert np.isnan(got[2:4]).all() and got[4] == pytest.approx(4.5) and got[1] == 1.5


def test_window_in_sequences_uses_batch_size():
    df = _long({"small_batch": 40, "big_batch": 40}, batch_seqs=[8, 32])
    curves = C.smooth(C.curves_from_frame(df), window_seqs=64)
    assert curves.meta["window_steps"].to_dict() == {"big_batch": 2, "small_batch": 8}
    with pytest.raises(ValueError, match="batch_seqs"):
        C.smooth(C.curves_from_frame(_long({"a": 10})), window_seqs=64)


def test_default_window_is_paper_100_steps_capped_at_2_percent():
    assert list(C.default_window_steps([20_000, 1_000, 10])) == [100, 20, 1]


def test_resample_is_exact_for_linear_curves_and_normalize_with_offset():
    df = pd.DataFrame({"run": "a", "step": np.arange(1, 101), "loss": 5.0 - np.arange(1, 101) / 50})
    matrix = C.resample(C.curves_from_frame(df), column="loss")
    assert np.isnan(matrix.loss[0, 0])  # t_hat 0.005 lies before the first step (0.01)
    assert np.allclose(matrix.loss[0, 1:], 5.0 - matrix.grid[1:] * 2)
    assert matrix.meta.loc["a", "final_loss"] == pytest.approx(3.0)
    ell = matrix.normalized(offset=1.0)
    assert ell[0, -1] == pytest.approx(1.0)
    assert ell[0, 99] == pytest.approx((4.0 - 1.0) / (3.0 - 1.0))


def test_sizes_order_by_params_or_by_label_number():
    meta = pd.DataFrame({"size": ["1.8B", "300M", "900M"]}, index=["x", "y", "z"])
    assert C.ordered_sizes(meta) == ["300M", "900M", "1.8B"]
    meta = pd.DataFrame({"size": ["big", "small"], "params": [9e8, 1e6]}, index=["x", "y"])
    assert C.ordered_sizes(meta) == ["small", "big"]


def test_row_order_does_not_matter_and_runs_keep_first_appearance():
    df = _long({"zeta": 30, "alpha": 20}, size=["big", "small"])
    rng = np.random.default_rng(1)
    shuffled = df.iloc[rng.permutation(len(df))]
    a = C.smooth(C.curves_from_frame(df), window_steps=4)
    b = C.smooth(C.curves_from_frame(shuffled), window_steps=4)
    assert list(a.meta.index) == ["zeta", "alpha"]
    merged = a.data.merge(b.data, on=["run", "step"], suffixes=("_a", "_b"))
    assert len(merged) == 50 and np.allclose(merged["loss_smooth_a"], merged["loss_smooth_b"])
    labels = np.array(["b"] * 3 + ["a"] * 3)  # labels not in sorted order
    got = C.trailing_mean(np.arange(6.0), np.array([1, 3, 5, 1, 3, 5]), labels, np.full(6, 3))
    assert np.allclose(got, [0, 0.5, 1.5, 3, 3.5, 4.5])
