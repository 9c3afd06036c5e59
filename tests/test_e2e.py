"""The whole DAG on the smoke family: plan, data, training, reference, gates, sweep, the fault
experiment, evaluation, report; then the properties of what it wrote (not only the exit code)."""

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from workflow_cli import snakemake_cmd

from collapse.layout import CURVE_COLUMNS
from collapse.plan import contrast_members

pytestmark = [pytest.mark.slow, pytest.mark.ci]


def snakemake(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = snakemake_cmd(workdir, "--config", "family=smoke", "faults=standard", *args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=2700)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    workdir = tmp_path_factory.mktemp("smoke")
    out = snakemake(workdir)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return workdir / "results" / "smoke"


def test_plan_lists_every_run(smoke):
    runs = pd.read_csv(smoke / "plan" / "runs.csv")
    # family + sweep, 5 faults and 2 more clean seeds of d96, the contrast of the 6 family runs
    # but d32's 2 (their lambda is the contrast's already: shared, not trained again)
    assert len(runs) == 10 + 7 + 4
    assert set(runs.role) == {"family", "sweep", "sweep_reference", "fault", "contrast"}
    assert set(runs[runs.role == "fault"]["size"]) == {"d96"}
    assert (runs.tokens == runs.steps * runs.batch_seqs * runs.seq_len).all()


def test_curves_are_complete_and_decreasing(smoke):
    runs = pd.read_csv(smoke / "plan" / "runs.csv").set_index("run")
    for run, row in runs.iterrows():
        curve = pd.read_parquet(smoke / "runs" / run / "curve.parquet")
        assert tuple(curve.columns) == CURVE_COLUMNS
        if row.role == "fault" and row.fault == "nan-loss":  # the NaN ends the run: its outcome
            assert curve.loss.isna().iloc[-1] and curve.t_hat.iloc[-1] == pytest.approx(
                0.55, abs=0.02
            )
            continue
        assert curve.step.tolist() == list(range(1, int(row.steps * row.stop_fraction) + 1))
        tenth = max(1, len(curve) // 10)
        assert curve.loss.iloc[-tenth:].mean() < curve.loss.iloc[:tenth].mean() - 0.5, run
        assert curve.t_hat.iloc[-1] == pytest.approx(row.stop_fraction, abs=1 / row.steps)
        meta = json.loads((smoke / "runs" / run / "meta.json").read_text())
        assert meta["params"] == row.params


def test_gates_and_collapse_statistics(smoke):
    runs = pd.read_csv(smoke / "plan" / "runs.csv")
    for run in runs[runs.role == "family"].run:
        verdict = json.loads((smoke / "gates" / f"{run}.json").read_text())
        assert verdict["run"] == run and isinstance(verdict["passed"], bool)
        assert verdict["message"] and (smoke / "gates" / f"{run}.png").stat().st_size > 0
    stats = json.loads((smoke / "collapse" / "tpp4" / "collapse.json").read_text())
    assert {"t_hat", "delta", "sigma", "supercollapse", "score"} <= set(stats)
    ref = pd.read_csv(smoke / "reference" / "tpp4" / "reference.csv")
    assert ref.ell.iloc[-1] == pytest.approx(1.0)


def test_gate_verdicts_follow_from_the_curves_and_the_reference(smoke, tmp_path):
    """Each gate JSON the workflow wrote is the verdict of its own inputs: recomputed from the
    run's curve and its band's reference through the analysis API it equals the file; the
    threshold is max(floor, k_sigma x the largest seed std inside the window) of reference.csv,
    by hand; and the status is what max |r| against that threshold says."""
    from collapse import analysis as A
    from collapse.config import load_config
    from collapse.gates import GatePolicy

    policy = GatePolicy(**load_config(["family=smoke"]).family.gates.model_dump())
    runs = pd.read_csv(smoke / "plan" / "runs.csv")
    reference = smoke / "reference" / "tpp4"
    ref = pd.read_csv(reference / "reference.csv")
    lo, hi = policy.window
    inside = ref[(ref.t_hat >= lo) & (ref.t_hat <= hi)]
    threshold = max(policy.floor, policy.k_sigma * inside.seed_std.max())
    for run in runs[runs.role == "family"].run:
        written = json.loads((smoke / "gates" / f"{run}.json").read_text())
        again = A.gate_run(
            smoke / "runs" / run / "curve.parquet", reference, smoke / "plan" / "runs.csv",
            policy, tmp_path / f"{run}.json", None,
        )  # fmt: skip
        for key in ("status", "max_abs_residual", "at_t_hat", "threshold", "aligned_final_loss"):
            assert again.model_dump(mode="json")[key] == pytest.approx(written[key]), (run, key)
        assert written["threshold"] == pytest.approx(threshold, rel=1e-6), run
        if written["status"] == "undetermined":
            continue
        assert abs(written["residual_at_max"]) == pytest.approx(written["max_abs_residual"])
        assert lo <= written["at_t_hat"] <= hi
        over = written["max_abs_residual"] > written["threshold"]
        assert written["status"] == ("fail" if over else "pass"), written
        assert (written["first_crossing_t_hat"] is not None) == over


def test_report_tables_equal_their_sources(smoke):
    """Every number the report's tables show is the number its stage wrote."""
    report = smoke / "report"
    gates = pd.read_csv(report / "gates.csv").set_index("run")
    for path in (smoke / "gates").glob("*.json"):
        verdict = json.loads(path.read_text())
        row = gates.loc[verdict["run"]]
        assert row.status == verdict["status"]
        for key in ("max_abs_residual", "threshold"):
            assert row[key] == pytest.approx(verdict[key], rel=1e-9), (verdict["run"], key)
    summary = pd.read_csv(report / "collapse_summary.csv").set_index("tpp_band")
    stats = json.loads((smoke / "collapse" / "tpp4" / "collapse.json").read_text())
    assert summary.at[4, "score_mean_delta"] == pytest.approx(stats["score"], rel=1e-9)
    assert summary.at[4, "delta_over_sigma_late"] == pytest.approx(
        stats["delta_over_sigma"], rel=1e-9
    )
    family = pd.read_csv(report / "family_table.csv").set_index("run")
    for run, row in family.iterrows():
        verdict = json.loads((smoke / "gates" / f"{run}.json").read_text())
        result = json.loads((smoke / "evals" / f"{run}.json").read_text())
        assert row.final_train_loss == pytest.approx(verdict["final_loss"], rel=1e-6), run
        assert row.heldout_loss == pytest.approx(result["heldout_loss"], rel=1e-9), run
        assert row.downstream_avg_acc_pct == pytest.approx(100 * result["average_acc"]), run
        assert row.gate == gates.at[run, "status"]
    metrics = pd.read_csv(report / "sweep_metrics.csv")
    source = pd.read_csv(smoke / "sweeps" / "tau" / "metrics.csv")
    merged = metrics.merge(source, on=["method", "fraction"], suffixes=("", "_source"))
    assert len(merged) == len(source)
    assert merged.mean_abs_error_pct.to_numpy() == pytest.approx(
        merged.mean_abs_error_pct_source.to_numpy(), rel=1e-9, nan_ok=True
    )
    detections = pd.read_csv(report / "detections.csv")
    pd.testing.assert_frame_equal(detections, pd.read_csv(smoke / "faults" / "detections.csv"))


def test_sweep_predictions_and_metrics(smoke):
    preds = pd.read_csv(smoke / "sweeps" / "tau" / "predictions.csv")
    # the size drift is fitted on the family's sizes other than the sweep's d64
    drift = json.loads((smoke / "sweeps" / "tau" / "drift.json").read_text())
    fit_runs = ["d32-tpp4-s0", "d32-tpp4-s1", "d48-tpp4-s0", "d48-tpp4-s1", "d96-tpp4-s0"]
    assert drift["fit_runs"] == fit_runs
    assert set(preds.method) - {"drift"} == {"collapse", "current", "powerlaw"}
    assert ("drift" in set(preds.method)) == drift["fitted"], drift["note"]
    assert set(preds.fraction) == {0.2, 0.3}
    metrics = pd.read_csv(smoke / "sweeps" / "tau" / "metrics.csv")
    assert metrics[metrics.method == "collapse"].selected_run.str.startswith("sweep-tau").all()
    error = metrics[metrics.fraction == 0.3].set_index("method").mean_abs_error_pct
    assert error["collapse"] < error["current"]  # the method beats the loss-now baseline


def test_fault_detection_experiment(smoke):
    detections = pd.read_csv(smoke / "faults" / "detections.csv")
    faults = {"loss-kernel", "lr-spike", "data-repeat", "wrong-tau", "nan-loss"}
    assert set(detections.fault) == faults | {"clean"}
    assert len(detections) == 5 * (len(faults) + 3)  # five detectors; three clean seeds
    detectors = {"collapse", "collapse_own_size", "spike", "rise", "controls"}
    assert set(detections.detector) == detectors
    known = {"detected", "missed", "false alarm", "quiet", "false alarm (before the fault)"}
    known |= {"in reference"}  # clean seeds 1, 2 build the own-size reference
    assert set(detections.outcome) <= known
    # every detector of the loss sees a NaN, at the NaN step (the controls audit reads the
    # optimizer's LR and weight decay, which a NaN loss leaves alone)
    nan = detections[(detections.fault == "nan-loss") & (detections.detector != "controls")]
    assert (nan.outcome == "detected").all()
    assert nan.alarm_t_hat.nunique() == 1 and nan.alarm_t_hat.iloc[0] == pytest.approx(
        0.55, abs=0.02
    )

    # the replayed batches are memorized: the training loss ends well below a clean seed's
    def final_loss(fault: str) -> float:
        run = detections[detections.fault == fault].run.iloc[0]
        return pd.read_parquet(smoke / "runs" / run / "curve.parquet").loss.iloc[-10:].mean()

    assert final_loss("data-repeat") < 0.9 * final_loss("clean")
    wrong_tau = detections[detections.fault == "wrong-tau"]
    assert (wrong_tau.fault_t_hat == 0).all()
    # the controls audit reads the optimizer's log: it sees the unrescaled weight decay from the
    # first step with an LR, and the LR spike at its first step; the clean seeds realize the
    # reference's tau, and a fault of the loss or the data leaves the controls alone
    audit = detections[detections.detector == "controls"].set_index("fault")
    assert audit.loc["wrong-tau", "outcome"] == "detected"
    assert audit.loc["wrong-tau", "alarm_t_hat"] < 0.05
    assert audit.loc["lr-spike", "outcome"] == "detected"
    assert audit.loc["lr-spike", "alarm_t_hat"] == pytest.approx(0.55, abs=0.01)
    assert (audit.loc[["loss-kernel", "data-repeat"], "outcome"] == "missed").all()
    assert (audit.loc["clean", "outcome"] == "quiet").all()
    summary = (smoke / "faults" / "detections.md").read_text()
    assert "all detectors together: 5 of 5 faults detected" in summary
    assert "Fault detection" in (smoke / "report" / "index.md").read_text()
    assert (smoke / "report" / "fault_detection.png").stat().st_size > 1000


def test_compare_reads_the_familys_results(smoke, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "collapse.cli", "compare", str(smoke), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    table = pd.read_csv(tmp_path / "comparison.csv")
    assert table.family.tolist() == ["smoke"] and table.gates.iloc[0] == 6
    assert table.final_loss_largest.iloc[0] < table.final_loss_smallest.iloc[0]
    assert (tmp_path / "comparison.png").stat().st_size > 1000


def test_contrast_is_measured_like_the_family(smoke):
    """family.contrast: the same runs with the smallest size's lambda, so tau rises with size;
    its collapse statistics and gates are the family's, and the report sets them side by side."""
    runs = pd.read_csv(smoke / "plan" / "runs.csv")
    family, contrast = runs[runs.role == "family"], contrast_members(runs)
    assert len(contrast) == len(family) and contrast.weight_decay.nunique() == 1
    taus = contrast.groupby("size", sort=False).tau.first()
    assert list(taus.index) == ["d32", "d48", "d64", "d96"] and taus.is_monotonic_increasing
    assert taus.iloc[-1] > 1.2 * taus.iloc[0]
    # the smallest size keeps its own lambda: the contrast measures its family runs, no twins
    assert set(contrast[contrast["size"] == "d32"].role) == {"family"}
    assert not (smoke / "runs" / "contrast-d32-tpp4-s0").exists()
    stats = json.loads((smoke / "contrast" / "collapse" / "tpp4" / "collapse.json").read_text())
    assert {"t_hat", "delta", "sigma", "supercollapse", "delta_over_sigma"} <= set(stats)
    for run in contrast.run:
        verdict = json.loads((smoke / "contrast" / "gates" / f"{run}.json").read_text())
        assert verdict["run"] == run and isinstance(verdict["passed"], bool)
    table = pd.read_csv(smoke / "report" / "contrast.csv")
    assert table.family.tolist() == ["smoke", "smoke (contrast)"]
    assert (table.gates == len(family)).all() and table.delta_over_sigma_late.notna().all()
    assert "## Contrast: tau not held fixed" in (smoke / "report" / "index.md").read_text()
    assert (smoke / "report" / "contrast.png").stat().st_size > 1000


def test_evaluation_results(smoke):
    runs = pd.read_csv(smoke / "plan" / "runs.csv")
    for run in runs[runs.role == "family"].run:
        result = json.loads((smoke / "evals" / f"{run}.json").read_text())
        assert result["heldout_loss"] > 0
        for task in ("arc_easy", "boolq", "piqa"):
            assert 0.0 <= result["tasks"][task]["acc"] <= 1.0
            assert result["tasks"][task]["n"] == 4


def test_report_built(smoke):
    index = (smoke / "report" / "index.md").read_text()
    assert "smoke" in index
    pngs = list((smoke / "report").rglob("*.png"))
    assert pngs and all(p.stat().st_size > 1000 for p in pngs)


def test_rerun_has_nothing_to_do(smoke):
    out = snakemake(smoke.parent.parent, "-n")
    assert out.returncode == 0
    assert "Nothing to be done" in out.stdout + out.stderr


def test_snakemake_html_report_has_every_figure(smoke, tmp_path):
    html = tmp_path / "report.html"
    out = snakemake(smoke.parent.parent, "--report", str(html))
    assert out.returncode == 0, out.stderr[-3000:]
    text = html.read_text(errors="replace")
    for name in ("collapse_curves.png", "delta_sigma.png", "downstream_vs_flops.png"):
        assert name in text


ANALYSIS_DIRS = (
    "reference",
    "gates",
    "collapse",
    "sweeps",
    "faults",
    "contrast",
    "evals",
    "report",
)


def test_removing_and_rebuilding_every_analysis_output_retrains_nothing(smoke):
    """Analysis is downstream of training: a monitored run reads its own copy of the reference,
    so neither removing the family's reference nor rebuilding it makes a finished run stale.
    Last in this file: it rebuilds what the tests above read."""
    import shutil

    metas = {p: p.stat().st_mtime_ns for p in smoke.glob("runs/*/meta.json")}
    removed = [d for d in ANALYSIS_DIRS if (smoke / d).is_dir()]
    assert {"reference", "gates", "collapse", "evals", "report"} <= set(removed)
    for name in removed:
        shutil.rmtree(smoke / name)

    dry = snakemake(smoke.parent.parent, "-n")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "rule reference:" in dry.stdout and "rule gate:" in dry.stdout
    assert "rule train:" not in dry.stdout, dry.stdout[-5000:]

    out = snakemake(smoke.parent.parent)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert {p: p.stat().st_mtime_ns for p in smoke.glob("runs/*/meta.json")} == metas
    assert all((smoke / d).is_dir() for d in removed)
    again = snakemake(smoke.parent.parent, "-n")
    assert "Nothing to be done" in again.stdout + again.stderr
