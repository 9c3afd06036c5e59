"""Malformed curves and flags are input errors (exit 2, one line naming the problem, nothing
written); what the curves cannot decide is "undetermined", never "yes" or "passed"."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from synthetic import synthetic_family

from collapse import analysis as A
from collapse.cli import main

STEPS = 200


@pytest.fixture(scope="module")
def family() -> pd.DataFrame:
    """Two sizes x two seeds, a clean curve table every case below breaks in one way."""
    return synthetic_family({"s1": 3.4, "s2": 3.1}, seeds=2, steps=STEPS, rng_seed=3)


def line_of(df: pd.DataFrame, run: str, step: int) -> int:
    """The CSV line (header = line 1) of a run's step."""
    return int(np.flatnonzero((df["run"] == run) & (df["step"] == step))[0]) + 2


def csv(tmp: Path, df: pd.DataFrame, name: str = "curves.csv") -> str:
    df.to_csv(tmp / name, index=False)
    return str(tmp / name)


def edit(df: pd.DataFrame, run: str, step: int, column: str, value) -> pd.DataFrame:
    df = df.astype({column: object}).copy()
    df.loc[(df["run"] == run) & (df["step"] == step), column] = value
    return df


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    return code, capsys.readouterr().err


def checksums(path: Path) -> dict[str, str]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def write(tmp: Path, name: str, text: str) -> str:
    (tmp / name).write_text(text)
    return str(tmp / name)


def managed_out(tmp: Path, df: pd.DataFrame) -> tuple[list[str], Path]:
    """--out inside a family folder of the workflow's (it has plan/)."""
    (tmp / "results" / "tiny" / "plan").mkdir(parents=True)
    write(tmp / "results" / "tiny" / "plan", "runs.csv", "run\n")
    out = earlier_analysis(tmp / "results" / "tiny" / "gates")
    return [csv(tmp, df), "--out", str(out)], out.parent


def foreign_out(tmp: Path, df: pd.DataFrame) -> tuple[list[str], Path]:
    """--out a folder holding someone's files, not an earlier analysis."""
    (tmp / "mine").mkdir()
    write(tmp / "mine", "notes.txt", "mine")
    return [csv(tmp, df), "--out", str(tmp / "mine")], tmp / "mine"


def earlier_analysis(out: Path) -> Path:
    """An output folder as an earlier analyze left it."""
    (out / "gates").mkdir(parents=True)
    (out / "collapse.json").write_text('{"supercollapse": true}\n')
    (out / "gates" / "s1_s0.json").write_text('{"passed": true}\n')
    return out


# Each case: (id, build(tmp, df) -> argv after "analyze" without --out, or (argv, out), regex).
Case = tuple[str, Callable[[Path, pd.DataFrame], list[str] | tuple[list[str], Path]], str]

CASES: list[Case] = [
    ("empty file", lambda t, d: [write(t, "c.csv", "")], r"c\.csv: the file is empty"),
    (
        "header only",
        lambda t, d: [csv(t, d.iloc[:0])],
        r"curves\.csv: the curve table has a header but no rows",
    ),
    ("no loss column", lambda t, d: [csv(t, d.drop(columns="loss"))], r"\['loss'\]"),
    ("no step column", lambda t, d: [csv(t, d.drop(columns="step"))], r"\['step'\]"),
    ("no run column", lambda t, d: [csv(t, d.drop(columns="run"))], r"\['run'\]"),
    (
        "loss named differently",
        lambda t, d: [csv(t, d.rename(columns={"loss": "train_loss"}))],
        r"lacks column\(s\) \['loss'\].*rename",
    ),
    (
        "duplicate step",
        lambda t, d: [csv(t, pd.concat([d, d.iloc[[4]]], ignore_index=True))],
        r"line 802 \(run s1_s0\): duplicate step 5 \(also at .*curves\.csv line 6\)",
    ),
    ("single run", lambda t, d: [csv(t, d[d["run"] == "s1_s0"])], "at least two complete runs"),
    ("missing path", lambda t, d: [str(t / "nowhere.csv")], r"nowhere\.csv: no such file"),
    ("unknown file type", lambda t, d: [csv(t, d, "curves.txt")], "unknown file type"),
    (
        "unreadable parquet",
        lambda t, d: [write(t, "c.parquet", "no parquet")],
        r"c\.parquet: cannot be read",
    ),
    (
        "non-numeric loss",
        lambda t, d: [csv(t, edit(d, "s2_s1", 30, "loss", "abc"))],
        r"line \d+ \(run s2_s1\): loss is not a number \('abc'\)",
    ),
    (
        "negative loss",
        lambda t, d: [csv(t, edit(d, "s1_s1", 10, "loss", -2.5))],
        r"\(run s1_s1\): loss is not positive",
    ),
    (
        "zero loss",
        lambda t, d: [csv(t, edit(d, "s2_s0", 100, "loss", 0.0))],
        r"\(run s2_s0\): loss is not positive",
    ),
    (
        "finite loss after NaN",
        lambda t, d: [csv(t, edit(d, "s1_s0", 50, "loss", np.nan))],
        r"line 51 \(run s1_s0\): loss is empty, NaN or infinite, yet finite losses follow "
        r"\(from .*line 52\)",
    ),
    (
        "offset above the losses",
        lambda t, d: [csv(t, d), "--offset", "5"],
        r"--offset 5 is not below every loss: run \w+ reaches",
    ),
    (
        "offset at the smallest loss",
        lambda t, d: [csv(t, d), "--offset", str(d["loss"].min())],
        r"--offset .* is not below every loss",
    ),
    (
        "size changes within a run",
        lambda t, d: [csv(t, edit(d, "s1_s0", 120, "size", "s2"))],
        r"line \d+: size changes within run s1_s0",
    ),
    (
        "tau changes within a run",
        lambda t, d: [csv(t, edit(d, "s2_s0", 7, "tau", 0.5))],
        "tau changes within run s2_s0",
    ),
    (
        "tpp changes within a run",
        lambda t, d: [csv(t, edit(d, "s2_s1", 8, "tpp", 80.0))],
        "tpp changes within run s2_s1",
    ),
    (
        "seed changes within a run",
        lambda t, d: [csv(t, edit(d, "s1_s1", 9, "seed", 7))],
        "seed changes within run s1_s1",
    ),
    (
        "negative step",
        lambda t, d: [csv(t, edit(d, "s1_s0", 1, "step", -1))],
        r"line 2 \(run s1_s0\): step is negative",
    ),
    (
        "fractional step",
        lambda t, d: [csv(t, edit(d, "s1_s1", 3, "step", 3.5))],
        r"\(run s1_s1\): step is not a whole number",
    ),
    (
        "non-numeric step",
        lambda t, d: [csv(t, edit(d, "s2_s0", 3, "step", "three"))],
        r"\(run s2_s0\): step is not a number \('three'\)",
    ),
    (
        "empty step",
        lambda t, d: [csv(t, edit(d, "s2_s1", 3, "step", np.nan))],
        r"\(run s2_s1\): step is empty",
    ),
    (
        "step beyond the declared total",
        lambda t, d: [csv(t, d.assign(steps=np.where(d["run"] == "s1_s1", 150, STEPS)))],
        r"run s1_s1 logs step 200, beyond its declared total steps 150",
    ),
    (
        "t_hat above 1",
        lambda t, d: [csv(t, d.assign(t_hat=d["step"] / 150))],
        r"\(run s1_s0\).*: t_hat 1\.00667 lies outside \[0, 1\]",
    ),
    (
        "t_hat partly empty",
        lambda t, d: [csv(t, edit(d.assign(t_hat=d["step"] / STEPS), "s1_s0", 9, "t_hat", ""))],
        r"\(run s1_s0\): t_hat is empty or not a number",
    ),
    (
        "duplicate size and seed",
        lambda t, d: [csv(t, d.assign(seed=np.where(d["run"] == "s1_s1", 0, d["seed"])))],
        r"runs s1_s0, s1_s1 have the same size 's1' and seed 0",
    ),
    (
        "run with one point",
        lambda t, d: [csv(t, d[(d["run"] != "s2_s1") | (d["step"] == 1)])],
        r"run s2_s1 has 1 finite loss point\(s\)",
    ),
    (
        "empty run name",
        lambda t, d: [csv(t, edit(d, "s2_s1", 11, "run", np.nan))],
        r"line \d+: the row has no run name",
    ),
    (
        "size missing for one run",
        lambda t, d: [csv(t, d.assign(size=np.where(d["run"] == "s2_s0", None, d["size"])))],
        r"run s2_s0 has no size",
    ),
    (
        "declared total steps not positive",
        lambda t, d: [csv(t, d.assign(steps=np.where(d["run"] == "s2_s0", 0, STEPS)))],
        r"run s2_s0: steps 0 is not a positive number",
    ),
    (
        "negative tau",
        lambda t, d: [csv(t, d.assign(tau=np.where(d["size"] == "s2", -0.2, 0.2)))],
        r"run s2_s0: tau -0.2 is not a positive number",
    ),
    (
        "runs table with two rows for a run",
        lambda t, d: [
            csv(t, d.drop(columns=["tau"])),
            "--runs",
            csv(t, pd.DataFrame({"run": ["s1_s0", "s1_s0"], "tau": [0.1, 0.2]}), "runs.csv"),
        ],
        r"runs\.csv line 2 and 1 more row: run s1_s0 has two rows with different values",
    ),
    (
        "runs table without a run column",
        lambda t, d: [csv(t, d), "--runs", csv(t, pd.DataFrame({"name": ["a"]}), "runs.csv")],
        r"runs\.csv: no column run",
    ),
    ("unknown reference size", lambda t, d: [csv(t, d), "--reference-sizes", "s16"], r"\['s16'\]"),
    ("negative k-sigma", lambda t, d: [csv(t, d), "--k-sigma", "-1"], r"--k-sigma: '-1'.*> 0"),
    ("k-sigma not a number", lambda t, d: [csv(t, d), "--k-sigma", "nan"], r"--k-sigma.*finite"),
    (
        "reversed gate window",
        lambda t, d: [csv(t, d), "--gate-window", "0.8,0.2"],
        r"--gate-window: '0\.8,0\.2'.*START < END",
    ),
    (
        "gate window beyond 1",
        lambda t, d: [csv(t, d), "--gate-window", "0.2,1.5"],
        r"--gate-window.*<= 1",
    ),
    ("one-number align window", lambda t, d: [csv(t, d), "--align-window", "0.5"], "START,END"),
    ("zero smoothing window", lambda t, d: [csv(t, d), "--window-steps", "0"], r"--window-steps"),
    (
        "out is a file",
        lambda t, d: ([csv(t, d), "--out", str(t / "curves.csv")], t / "curves.csv"),
        r"--out .*curves\.csv: is a file",
    ),
    (
        "out in the workflow's family folder",
        managed_out,
        r"lies in the workflow's family folder .*tiny .*--force",
    ),
    ("out holds other files", foreign_out, r"not an earlier analysis .*--force"),
]


@pytest.mark.parametrize("name, build, pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_an_input_error_and_writes_nothing(
    name, build, pattern, family, tmp_path, capsys
):
    built = build(tmp_path, family)
    if isinstance(built, tuple):
        argv, watched = built
    else:
        watched = earlier_analysis(tmp_path / "out")
        argv = [*built, "--out", str(watched)]
    before = checksums(watched)
    siblings = set(watched.parent.iterdir())
    code, err = run_cli(["analyze", *argv, "--plots", "none"], capsys)
    assert code == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(("error: ", "collapse analyze: error: ")), err
    assert re.search(pattern, last), last
    assert checksums(watched) == before
    assert set(watched.parent.iterdir()) == siblings  # no staging folder left behind


def test_table_has_at_least_30_malformed_inputs():
    assert len(CASES) >= 30


@pytest.mark.parametrize(
    "argv, pattern",
    [
        (["--fraction", "0.2", "0.2"], r"--fraction 0\.2 is given twice"),
        (["--fraction", "1"], r"--fraction 1 lies outside \(0, 1\)"),
        (["--fraction", "0"], r"--fraction 0 lies outside"),
    ],
)
def test_predict_checks_fractions_before_reading(argv, pattern, tmp_path, capsys):
    """The curve file does not exist: the fractions are refused before it is looked for."""
    out = tmp_path / "out"
    predict = ["predict", str(tmp_path / "no.csv"), "--reference-sizes", "s1", *argv]
    code, err = run_cli([*predict, "--out", str(out)], capsys)
    assert code == 2 and re.search(pattern, err) and not out.exists(), err


def test_predict_rejects_a_malformed_curve_like_analyze(family, tmp_path, capsys):
    path = csv(tmp_path, edit(family, "s2_s0", 20, "loss", "oops"))
    argv = ["predict", path, "--reference-sizes", "s1", "--fraction", "0.3"]
    code, err = run_cli([*argv, "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and re.search(r"\(run s2_s0\): loss is not a number", err), err


# ---------------------------------------------------------------- undetermined, not "yes"


def analyze(tmp: Path, df: pd.DataFrame, capsys, *extra: str) -> tuple[dict, str]:
    out = tmp / "out"
    assert main(["analyze", csv(tmp, df), "--out", str(out), "--plots", "none", *extra]) == 0
    return json.loads((out / "collapse.json").read_text()), capsys.readouterr().out


def test_one_size_leaves_supercollapse_undetermined(family, tmp_path, capsys):
    summary, printed = analyze(tmp_path, family[family["size"] == "s1"], capsys)
    assert summary["supercollapse"] is None and "one size" in summary["supercollapse_reason"]
    assert "supercollapse: undetermined (one size (s1)" in printed


def test_one_seed_per_size_leaves_supercollapse_undetermined(family, tmp_path, capsys):
    summary, printed = analyze(tmp_path, family[family["seed"] == 0], capsys)
    assert summary["supercollapse"] is None and "two seeds" in summary["supercollapse_reason"]
    assert "supercollapse: undetermined (no size has two seeds" in printed


def test_run_with_too_few_points_is_undetermined_not_passed(family, tmp_path, capsys):
    sparse = family[(family["run"] == "s2_s1") & family["step"].isin([1, 2, STEPS])]
    df = pd.concat([family[family["run"] != "s2_s1"], sparse], ignore_index=True)
    summary, printed = analyze(tmp_path, df, capsys)
    gate = summary["gates"]["s2_s1"]
    assert gate["status"] == "undetermined" and gate["passed"] is False
    assert "0 logged points lie in the align window" in gate["message"]
    assert summary["undetermined_gates"] == ["s2_s1"] and "s2_s1" not in summary["failed_gates"]
    assert "3 passed, 0 failed, 1 undetermined" in printed


def test_diverged_training_is_still_a_failed_gate(family, tmp_path, capsys):
    """A NaN from some step to the end is training that diverged, not bad input."""
    df = family.copy()
    df.loc[(df["run"] == "s2_s1") & (df["step"] >= 160), "loss"] = np.nan
    df = df.assign(steps=STEPS)
    df = pd.concat([df, family[family["run"] == "s2_s1"].assign(run="s2_s2", seed=2)])
    summary, printed = analyze(tmp_path, df, capsys, "--reference-sizes", "s1")
    assert summary["gates"]["s2_s1"]["status"] == "fail"
    assert "not finite" in summary["gates"]["s2_s1"]["message"] and "FAIL s2_s1" in printed


# ---------------------------------------------------------------- atomic outputs


def test_rerun_leaves_no_stale_files_and_a_crash_writes_nothing(
    family, tmp_path, capsys, monkeypatch
):
    out = tmp_path / "out"
    analyze(tmp_path, family, capsys)
    (out / "gates" / "old_run.json").write_text("{}")
    analyze(tmp_path, family, capsys)
    assert not (out / "gates" / "old_run.json").exists()
    before = checksums(out)

    def crash(*args, **kwargs):
        raise RuntimeError("plotting broke")

    monkeypatch.setattr(A, "plot_collapse", crash)
    code, err = run_cli(["analyze", str(tmp_path / "curves.csv"), "--out", str(out)], capsys)
    assert code == 1 and "error: RuntimeError: plotting broke" in err
    assert checksums(out) == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "curves.csv",
        "out",
    ]


def test_out_with_a_plan_folder_is_the_workflows(family, tmp_path, capsys):
    (tmp_path / "results" / "tiny" / "plan").mkdir(parents=True)
    argv = ["analyze", csv(tmp_path, family), "--out", str(tmp_path / "results" / "tiny")]
    code, err = run_cli(argv, capsys)
    assert code == 2 and "workflow's family folder" in err


def test_force_writes_into_a_workflow_folder_without_deleting(family, tmp_path, capsys):
    family_root = tmp_path / "results" / "tiny"
    (family_root / "plan").mkdir(parents=True)
    (family_root / "plan" / "runs.csv").write_text("run\n")
    out = family_root / "adhoc"
    path = csv(tmp_path, family)
    assert main(["analyze", path, "--out", str(out), "--plots", "none", "--force"]) == 0
    assert (out / "collapse.json").is_file() and (family_root / "plan" / "runs.csv").is_file()
