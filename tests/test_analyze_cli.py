"""`collapse analyze` end to end, and the rule entry points (reference, gate, statistics)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pandas as pd
import pytest
from synthetic import synthetic_family

from collapse import analysis as A
from collapse.cli import main
from collapse.gates import GatePolicy, GateVerdict
from collapse.layout import FamilyLayout

SIZES = {"s1": 3.4, "s2": 3.1, "s4": 2.8, "s8": 2.5}


@pytest.fixture(scope="module")
def curves_csv(tmp_path_factory):
    df = synthetic_family(SIZES, noise_rel=0.005, wiggle_rel=0.001, rng_seed=7)
    bad = (df["run"] == "s8_s2") & (df["step"] >= 1300)  # fault from t_hat 0.65
    df.loc[bad, "loss"] *= 1.05
    path = tmp_path_factory.mktemp("cli") / "curves.csv"
    df.to_csv(path, index=False)
    return path


def test_analyze_writes_the_documented_outputs(curves_csv, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["analyze", str(curves_csv), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "FAIL s8_s2: diverged" in printed and "1 failed" in printed
    summary = json.loads((out / "collapse.json").read_text())
    for key in ("t_hat", "delta", "sigma", "supercollapse", "score", "gates"):
        assert key in summary
    assert summary["reference_sizes"] == ["s1", "s2"]  # default: the two smallest
    assert set(summary["sigma"]) == set(SIZES) and len(summary["sigma"]["s4"]) == 200
    assert summary["failed_gates"] == ["s8_s2"]
    assert summary["gates"]["s8_s2"]["first_crossing_t_hat"] >= 0.65
    reference = pd.read_csv(out / "reference.csv")
    assert list(reference.columns[:4]) == ["t_hat", "ell", "lower", "upper"]
    assert reference["ell"].iloc[-1] == pytest.approx(1.0)
    for name in (
        "collapse.png",
        "residuals.png",
        "reference.png",
        "gates/s8_s2.png",
        "delta_sigma.csv",
        "runs.csv",
        "surrogate.json",
        "gates/s1_s0.json",
    ):
        assert (out / name).stat().st_size > 0, name
    assert not (out / "gates" / "s1_s0.png").exists()  # plots of failed runs only
    verdict = GateVerdict.model_validate_json((out / "gates" / "s8_s2.json").read_text())
    assert verdict.plot.endswith("gates/s8_s2.png") and verdict.plot in verdict.message


def test_analyze_options_reference_sizes_offset_threshold_strict(curves_csv, tmp_path):
    out = tmp_path / "out"
    args = [
        "analyze",
        str(curves_csv),
        "--out",
        str(out),
        "--reference-sizes",
        "s2,s4",
        "--offset",
        "1.0",
        "--threshold",
        "0.5",
        "--plots",
        "none",
    ]
    assert main(args) == 0
    summary = json.loads((out / "collapse.json").read_text())
    assert summary["reference_sizes"] == ["s2", "s4"] and summary["offset"] == 1.0
    assert summary["failed_gates"] == [] and summary["threshold"] == 0.5
    strict = ["analyze", str(curves_csv), "--out", str(tmp_path / "s"), "--strict"]
    assert main(strict) == 3
    bad = ["analyze", str(curves_csv), "--out", str(out), "--reference-sizes", "s16"]
    assert main(bad) == 2  # an input error: one line on stderr, no traceback


def test_help_documents_the_input_format(capsys):
    with pytest.raises(SystemExit):
        main(["analyze", "--help"])
    text = capsys.readouterr().out
    assert "run, step, loss" in text and "--reference-sizes" in text and "--offset" in text


def test_rule_entry_points_on_a_project_family_directory(tmp_path):
    """reference -> gate -> statistics on results/<family> as training writes it."""
    df = synthetic_family({"d64": 3.2, "d128": 2.9, "d256": 2.6}, seeds=2, rng_seed=8)
    fam = FamilyLayout.of("tiny", tmp_path)
    for run, part in df.groupby("run"):
        fam.run_dir(run).mkdir(parents=True)
        part[["run", "step", "loss"]].assign(
            tokens=part["step"] * 2048, t_hat=part["step"] / 2000
        ).to_parquet(fam.curve(run))
    fam.plan_dir.mkdir(parents=True)
    plan = df.groupby("run")[["size", "seed", "tau", "tpp", "steps"]].first().reset_index()
    plan.to_csv(fam.plan_dir / "runs.csv", index=False)
    runs_csv = fam.plan_dir / "runs.csv"

    ref_runs = [fam.curve(r) for r in plan.run if r.startswith("d64")]
    reference = A.build_reference(ref_runs, runs_csv, ["d64"], fam.reference_dir)
    assert (fam.reference_dir / "reference.json").is_file() and reference.sizes == ["d64"]

    verdict = A.gate_run(
        fam.curve("d256_s1"),
        fam.reference_dir / "reference.csv",
        runs_csv,
        GatePolicy(),
        fam.gate("d256_s1"),
        fam.gate("d256_s1").with_suffix(".png"),
    )
    assert verdict.passed and verdict.reference_sizes == ["d64"]
    assert fam.gate("d256_s1").is_file() and fam.gate("d256_s1").with_suffix(".png").is_file()

    stats = A.family_statistics([fam.root], None, tmp_path / "stats", reference=fam.reference_dir)
    assert stats.supercollapse is True and len(stats.runs) == 6
    saved = json.loads((tmp_path / "stats" / "collapse.json").read_text())
    assert saved["score"] == pytest.approx(stats.score)
    table = pd.read_csv(tmp_path / "stats" / "delta_sigma.csv")
    assert {"t_hat", "delta", "sigma_d64", "sigma_mean"} <= set(table.columns)
    assert np.isfinite(table["delta"]).all()


def test_analyze_warns_of_nothing_when_runs_log_sparsely(tmp_path):
    """Grid points before the first logged step are NaN by design: no numpy warnings about them
    (real runs log every 20 steps; the user saw "Mean of empty slice" on every analysis)."""
    df = synthetic_family(SIZES, noise_rel=0.005, wiggle_rel=0.001, rng_seed=7)
    sparse = tmp_path / "sparse.csv"
    df[df["step"] % 40 == 0].to_csv(sparse, index=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert (
            main(["analyze", str(sparse), "--out", str(tmp_path / "out"), "--plots", "none"]) == 0
        )


@pytest.fixture(scope="module")
def small_csv(tmp_path_factory):
    """Three sizes x two seeds, s4_s1 off the curve from t_hat 0.6."""
    df = synthetic_family({"s1": 3.4, "s2": 3.1, "s4": 2.8}, seeds=2, steps=1000, rng_seed=3)
    df.loc[(df["run"] == "s4_s1") & (df["step"] >= 600), "loss"] *= 1.05
    path = tmp_path_factory.mktemp("small") / "curves.csv"
    df.to_csv(path, index=False)
    return path


def test_plots_all_or_none_and_the_runs_table(small_csv, tmp_path):
    """--plots all: one gates/<run>.png per run, named in its verdict; --plots none: none, every
    verdict points at residuals.png. runs.csv carries each run's verdict."""
    out = tmp_path / "all"
    assert main(["analyze", str(small_csv), "--out", str(out), "--plots", "all"]) == 0
    summary = json.loads((out / "collapse.json").read_text())
    runs = ["s1_s0", "s1_s1", "s2_s0", "s2_s1", "s4_s0", "s4_s1"]
    assert summary["runs"] == runs and summary["failed_gates"] == ["s4_s1"]
    assert sorted(p.name for p in (out / "gates").glob("*.png")) == [f"{r}.png" for r in runs]
    for run in runs:
        verdict = GateVerdict.model_validate_json((out / "gates" / f"{run}.json").read_text())
        assert verdict.plot == str(out / "gates" / f"{run}.png")
        assert verdict.message.endswith(f"; evidence: {verdict.plot}")
        assert summary["gates"][run] == verdict.model_dump(mode="json")
    table = pd.read_csv(out / "runs.csv", index_col="run")
    assert table["size_label"].tolist() == ["s1", "s1", "s2", "s2", "s4", "s4"]
    assert table["in_reference"].tolist() == [True] * 4 + [False] * 2  # s1, s2 by default
    assert table["gate"].tolist() == ["pass"] * 5 + ["fail"]
    for run in runs:
        verdict = summary["gates"][run]
        assert table.loc[run, "max_abs_residual"] == pytest.approx(verdict["max_abs_residual"])
        assert table.loc[run, "aligned_final_loss"] == pytest.approx(verdict["aligned_final_loss"])
    assert table.loc["s4_s1", "first_crossing_t_hat"] >= 0.6
    assert summary["threshold"] == summary["gates"]["s1_s0"]["threshold"]
    assert summary["undetermined_gates"] == []
    assert summary["files"]["plots"] == ["collapse.png", "residuals.png", "reference.png"]

    none = tmp_path / "none"
    assert main(["analyze", str(small_csv), "--out", str(none), "--plots", "none"]) == 0
    assert list((none / "gates").glob("*.png")) == []
    failed = GateVerdict.model_validate_json((none / "gates" / "s4_s1.json").read_text())
    assert failed.plot == str(none / "residuals.png") and "evidence" not in failed.message


def test_gate_run_on_an_analysis_reproduces_its_verdict(small_csv, tmp_path):
    """A run gated against an analysis' reference folder is analysed with that reference's
    offset and smoothing (reference.json), so its verdict is the analysis' own."""
    out = tmp_path / "out"
    args = ["analyze", str(small_csv), "--out", str(out), "--plots", "none"]
    assert main([*args, "--offset", "1.5", "--window-steps", "40"]) == 0
    reference = json.loads((out / "reference.json").read_text())
    assert reference["offset"] == 1.5 and reference["smoothing"]["window_steps"] == 40
    for run in ("s2_s0", "s4_s1"):
        want = GateVerdict.model_validate_json((out / "gates" / f"{run}.json").read_text())
        got = A.gate_run(
            small_csv, out, None, GatePolicy(), tmp_path / f"{run}.json", None, run=run
        )
        assert not (tmp_path / f"{run}.png").exists()
        for key in ("status", "at_t_hat", "first_crossing_t_hat"):
            assert getattr(got, key) == getattr(want, key), key
        # reference.csv keeps 8 significant digits
        for key in ("threshold", "max_abs_residual", "aligned_final_loss"):
            assert getattr(got, key) == pytest.approx(getattr(want, key), rel=1e-6), key
        assert got.reference_sizes == ["s1", "s2"]
    # the reference.csv alone: no reference.json, so offset 0 and the default smoothing
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "reference.csv").write_bytes((out / "reference.csv").read_bytes())
    plain = A.gate_run(
        small_csv,
        alone / "reference.csv",
        None,
        GatePolicy(),
        tmp_path / "p.json",
        None,
        run="s2_s0",
    )
    assert plain.reference_sizes == [] and plain.aligned_final_loss != pytest.approx(
        GateVerdict.model_validate_json(
            (out / "gates" / "s2_s0.json").read_text()
        ).aligned_final_loss,
        rel=1e-6,
    )
    with pytest.raises(FileNotFoundError, match="no reference.csv; build the reference first"):
        A.gate_run(small_csv, tmp_path / "nothing", None, GatePolicy(), tmp_path / "n.json", None)
    with pytest.raises(ValueError, match="holds 6 runs; name the one to gate"):
        A.gate_run(small_csv, out, None, GatePolicy(), tmp_path / "n.json", None)


def test_the_printed_summary_states_the_verdicts(small_csv, tmp_path, capsys):
    """What the command prints is what collapse.json holds: runs, sizes, score, supercollapse
    (no, or undetermined with its reason) and the gate counts."""
    out = tmp_path / "out"
    assert main(["analyze", str(small_csv), "--out", str(out), "--plots", "none"]) == 0
    summary = json.loads((out / "collapse.json").read_text())
    assert summary["supercollapse"] is False  # s4_s1 leaves the curve: Delta passes sigma
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [
        "6 complete runs, sizes ['s1', 's2', 's4'], reference ['s1', 's2']",
        f"collapse score (mean Delta, t_hat >= 0.2): {summary['score']:.4f}; supercollapse: no",
        f"gates: 5 passed, 1 failed, 0 undetermined (threshold {summary['threshold']:.4f})",
    ]
    assert lines[3] == f"  FAIL {summary['gates']['s4_s1']['message']}"
    assert lines[4] == f"wrote {out / 'collapse.json'}"

    one_size = tmp_path / "one.csv"
    pd.read_csv(small_csv).query("size == 's1'").to_csv(one_size, index=False)
    args = ["analyze", str(one_size), "--out", str(tmp_path / "one"), "--plots", "none"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "supercollapse: undetermined (one size (s1): Delta over one size" in printed
