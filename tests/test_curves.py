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


def _family(tmp_path, runs=("d64_s0", "d128_s0")):
    """results/tiny as training writes it: runs/<run>/curve.parquet and plan/runs.csv."""
    fam = FamilyLayout.of("tiny", tmp_path)
    for run in runs:
        n = np.arange(1, 41)
        frame = pd.DataFrame({"run": run, "step": n, "loss": 2 + 1 / n})
        fam.run_dir(run).mkdir(parents=True)
        frame.to_parquet(fam.curve(run))
    fam.plan_dir.mkdir(parents=True)
    sizes = [run.split("_")[0] for run in runs]
    pd.DataFrame({"run": list(runs), "size": sizes, "tau": 0.1}).to_csv(
        fam.plan_dir / "runs.csv", index=False
    )
    return fam


def test_a_run_directory_reads_its_curve_and_the_family_plan(tmp_path):
    """results/<family>/runs/<run>: that run alone, its metadata from the family's plan."""
    fam = _family(tmp_path)
    curves = C.read_curves(fam.run_dir("d128_s0"))
    assert curves.runs == ["d128_s0"] and curves.meta.loc["d128_s0", "size"] == "d128"
    assert curves.meta.loc["d128_s0", "tau"] == 0.1 and len(curves.data) == 40
    # without a plan beside it the run still reads, without metadata
    (fam.plan_dir / "runs.csv").unlink()
    bare = C.read_curves(fam.run_dir("d128_s0"))
    assert bare.runs == ["d128_s0"] and "size" not in bare.meta.columns


def test_the_runs_folder_of_a_family_finds_the_plan_beside_it(tmp_path):
    """results/<family>/runs given instead of results/<family>: every run, the plan's sizes."""
    fam = _family(tmp_path)
    curves = C.read_curves(fam.root / "runs")
    assert sorted(curves.runs) == ["d128_s0", "d64_s0"]
    assert curves.meta["size"].to_dict() == {"d128_s0": "d128", "d64_s0": "d64"}


def test_curve_files_deeper_in_a_folder_are_found(tmp_path):
    """Neither runs/*/ nor */: curve.parquet files anywhere below are read, in path order."""
    fam = _family(tmp_path)
    deep = tmp_path / "archive" / "2026" / "tiny"
    deep.mkdir(parents=True)
    fam.run_dir("d64_s0").rename(deep / "d64_s0")
    curves = C.read_curves(tmp_path / "archive")
    assert curves.runs == ["d64_s0"] and "size" not in curves.meta.columns


def test_a_folder_or_path_without_curves_names_the_fix(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty: no curve.parquet.*give curve files"):
        C.read_curves(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"nowhere: no such file or directory; check the path"):
        C.read_curves(tmp_path / "nowhere")


def test_unreadable_tables_say_why(tmp_path):
    with pytest.raises(ValueError, match=r"missing.csv: no such file; check the path"):
        C.read_table(tmp_path / "missing.csv")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match=r"broken.parquet: cannot be read \(.*well-formed"):
        C.read_table(broken)
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty.csv: the file is empty; give a table"):
        C.read_table(empty)
    with pytest.raises(ValueError, match=r"curves.json: unknown file type"):
        C.read_table(tmp_path / "curves.json")
    tsv = tmp_path / "curves.tsv"
    tsv.write_text("run\tstep\tloss\na\t1\t2.5\n")
    assert C.read_table(tsv).to_dict("list") == {"run": ["a"], "step": [1], "loss": [2.5]}


def test_per_run_columns_move_to_meta_only_when_constant_within_each_run():
    """NaN counts as a value: a run NaN throughout is constant, NaN then a number is not."""
    df = _long({"a": 3, "b": 3})
    df["lr"] = [1e-3, 1e-3, 1e-3, np.nan, np.nan, np.nan]  # constant per run
    df["note"] = ["x", "x", "x", "y", "y", "y"]  # strings, constant per run
    df["tag"] = ["p", "p", "q", "r", "r", "r"]  # changes within run a
    df["eval"] = [np.nan, 2.0, 2.0, 1.0, 1.0, 1.0]  # NaN then a number in run a
    df["flag"] = [True, True, True, False, False, False]
    curves = C.curves_from_frame(df)
    meta = curves.meta
    assert meta.loc["a", "lr"] == 1e-3 and np.isnan(meta.loc["b", "lr"])
    assert meta["note"].to_dict() == {"a": "x", "b": "y"}
    assert meta["flag"].to_dict() == {"a": True, "b": False}
    assert "tag" in curves.data.columns and "tag" not in meta.columns
    assert "eval" in curves.data.columns and "eval" not in meta.columns
    # rows given out of order: the comparison runs within each run after sorting
    curves = C.curves_from_frame(df.iloc[::-1])
    assert curves.meta["note"].to_dict() == {"a": "x", "b": "y"}


def test_resample_grid_ends_at_the_last_point_of_a_partial_run():
    """A run stopped at t_hat 0.5 has values up to 0.5 exactly, NaN after; one logged from
    t_hat 0.3 is NaN before it. Interpolation is linear between logged points."""
    full = pd.DataFrame({"run": "full", "step": np.arange(1, 11), "loss": np.arange(1, 11) * 1.0})
    part = pd.DataFrame(
        {"run": "part", "step": np.arange(3, 6), "loss": [3.0, 4.0, 5.0], "steps": 10}
    )
    full["steps"] = 10
    grid = np.array([0.25, 0.3, 0.45, 0.5, 0.55, 1.0])
    matrix = C.resample(C.curves_from_frame(pd.concat([full, part])), grid, column="loss")
    # full: loss = 10 t_hat; part: loss = 10 t_hat on 0.3 .. 0.5
    assert matrix.loss[0] == pytest.approx([2.5, 3.0, 4.5, 5.0, 5.5, 10.0])
    assert np.isnan(matrix.loss[1, [0, 4, 5]]).all()
    assert matrix.loss[1, 1:4] == pytest.approx([3.0, 4.5, 5.0])
    assert matrix.meta["final_loss"].tolist()[0] == 10.0
    assert np.isnan(matrix.meta.loc["part", "final_loss"])
    assert matrix.meta.loc["part", "t_hat_max"] == 0.5 and not matrix.meta.loc["part", "complete"]


def test_categories_without_rows_are_not_runs():
    """A categorical run column may list runs that have no rows (a filtered table): they are
    left out, and the remaining runs keep their rows and order."""
    df = _long({"a": 4, "c": 3})
    df["run"] = pd.Categorical(df["run"], categories=["a", "b", "c", "d"])
    curves = C.curves_from_frame(df)
    assert curves.runs == ["a", "c"]
    assert list(curves.data["run"].cat.categories) == ["a", "c"]
    assert curves.data.groupby("run", observed=True).size().to_dict() == {"a": 4, "c": 3}
    assert curves.meta["t_hat_max"].tolist() == [1.0, 1.0]
    c = curves.data[curves.data["run"] == "c"]
    assert c["t_hat"].tolist() == pytest.approx([1 / 3, 2 / 3, 1.0])


def test_trailing_mean_with_negative_steps_matches_brute_force():
    """Steps may start below 0 (a log that counts warmup negative): groups stay apart."""
    steps = np.concatenate([np.arange(-20, 21, 4), np.arange(-9, 10, 3)])  # sparse, both groups
    groups = np.array([0] * 11 + [1] * 7)
    values = np.arange(18.0) ** 1.5
    window = np.full(18, 9)
    got = C.trailing_mean(values, steps, groups, window)
    want = [
        values[(groups == g) & (steps > s - 9) & (steps <= s)].mean()
        for s, g in zip(steps, groups, strict=True)
    ]
    assert got == pytest.approx(want, rel=1e-12)
    assert got[11] == values[11]  # the second group's first point averages itself alone


def test_smoothing_window_must_be_a_positive_count():
    curves = C.curves_from_frame(_long({"a": 10}, batch_seqs=[4]))
    with pytest.raises(ValueError, match="window_steps must be >= 1, got 0"):
        C.smooth(curves, window_steps=0)
    with pytest.raises(ValueError, match="in steps or in sequences, not both"):
        C.smooth(curves, window_steps=2, window_seqs=8)
    one = C.smooth(curves, window_steps=1)
    assert one.data["loss_smooth"].to_numpy() == pytest.approx(one.data["loss"], rel=1e-12)
    # 6 sequences at 4 per step: ceil(1.5) = 2 steps
    assert C.smooth(curves, window_seqs=6).meta["window_steps"].tolist() == [2]


def test_normalize_pairs_one_final_loss_with_each_run():
    """(L - L0) / (L(T) - L0): a row per run against its own L(T); one value per run likewise."""
    loss = np.array([[3.0, 2.5], [5.0, 4.0]])
    assert C.normalize(loss, np.array([2.0, 4.0])) == pytest.approx(
        np.array([[1.5, 1.25], [1.25, 1.0]])
    )
    assert C.normalize(np.array([3.0, 5.0]), np.array([2.0, 4.0])) == pytest.approx([1.5, 1.25])
    # L0 = 1: (3 - 1) / (2 - 1), (5 - 1) / (4 - 1)
    assert C.normalize(np.array([3.0, 5.0]), np.array([2.0, 4.0]), 1.0) == pytest.approx(
        [2.0, 4 / 3]
    )
    assert C.normalize(loss, 2.0) == pytest.approx(np.array([[1.5, 1.25], [2.5, 2.0]]))
