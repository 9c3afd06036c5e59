"""The report stage builds every artifact from a small, real results tree the test makes.

The tree: runs.csv from the planner (tiny family, two TPP bands), synthetic Eq. 4 curves in the
training job's curve.parquet format (one run with a late fault, one still in progress), and the
reference, collapse statistics, gate verdicts and sweep predictions the analysis code itself
writes from them. Only the evaluation JSONs are written by hand, in collapse.evaluate's format.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from workflow_cli import run_snakemake

from collapse import analysis, report
from collapse.artifacts import ARTIFACTS, SECTIONS, reported, section
from collapse.cli import main as cli_main
from collapse.config import load_config
from collapse.gates import GatePolicy
from collapse.layout import CURVE_COLUMNS, FamilyLayout
from collapse.plan import contrast_members, plan_family
from collapse.surrogate import SurrogateParams, synthetic_loss

SIZES = ",".join(
    f"{{name: d{d}, d_model: {d}, n_layers: 2, n_heads: {d // 16}}}"
    for d in (64, 96, 128, 192, 256)
)
# The tree's own family (tiny's settings with these sizes), so the test does not follow tiny.
OVERRIDES = [
    "family=tiny",
    f"family.sizes=[{SIZES}]",
    "family.reference.sizes=[d64,d96]",
    "family.sweeps.0.size=d128",
    "family.tpp=[10,20]",
    "family.tau=[0.2,0.1]",
    "family.contrast.sizes=null",
]
FAULTY = "d256-tpp10-s0"  # its loss rises 3 % over the last 40 % of training
PARTIAL = "d192-tpp20-s0"  # stopped at 70 % of its schedule (still training)
PARTIAL_T_HAT = 0.7
NOT_EVALUATED = "d192-tpp10-s0"  # no evals JSON: held-out loss comes from meta.json
SHAPE = SurrogateParams(b_c=0.3, b_e=0.5, q_c=1.0, q_e=-0.2)


def final_loss_of(params: float, seed: int) -> float:
    return 7.0 * (params / 2e5) ** -0.1 * (1 + 0.003 * (seed - 1))


def write_curve(layout: FamilyLayout, row: pd.Series, rng: np.random.Generator) -> float:
    """A curve.parquet in the training job's format; returns the noise-free final loss."""
    steps = int(row["steps"])
    t_end = PARTIAL_T_HAT if row["run"] == PARTIAL else 1.0
    step = np.arange(1, int(round(t_end * steps)) + 1)
    t_hat = step / steps
    final = final_loss_of(row["params"], row["seed"])
    if row["role"] == "sweep":  # tau 0.2 is best; off by 2x costs 2 %
        final *= 1 + 0.02 * abs(np.log2(row["tau"] / 0.2))
    b, q = float(SHAPE.b(row["tau"])), float(SHAPE.q(row["tpp_band"]))
    loss = synthetic_loss(t_hat, final, b, q, 0.1, noise_rel=0.003, wiggle_rel=0.0005, rng=rng)
    if row["run"] == FAULTY:
        loss = loss * (1 + 0.03 * np.clip((t_hat - 0.6) / 0.4, 0, None))
    curve = pd.DataFrame(
        {
            "run": row["run"],
            "step": step,
            "tokens": step * int(row["batch_seqs"]) * int(row["seq_len"]),
            "t_hat": t_hat,
            "loss": loss,
            "lr": row["lr_peak"] * np.minimum(1.0, 1.0 - t_hat + 1e-9),
            "weight_decay": row["weight_decay"],
            "grad_norm": 1.0,
            "tokens_per_s": 1e4,
            "micro_batch_seqs": int(row["micro_batch_seqs"]),
            "data_fraction": t_hat * 0.5,
            "restart": False,
        }
    )[list(CURVE_COLUMNS)]
    path = layout.curve(row["run"])
    path.parent.mkdir(parents=True, exist_ok=True)
    curve.to_parquet(path, index=False)
    if t_end == 1.0:
        meta = {"run": row["run"], "final_loss": float(loss[-1]), "final_valid_loss": final + 0.05}
        layout.meta(row["run"]).write_text(json.dumps(meta))
    return final


def eval_json(row: pd.Series, average_acc: float) -> dict:
    shots = dict(arc_challenge=25, arc_easy=0, boolq=0, hellaswag=10, piqa=0, siqa=0, winogrande=5)
    return {
        "run": row["run"],
        "size": row["size"],
        "params": int(row["params"]),
        "tokens": int(row["tokens"]),
        "flops": float(row["flops"]),
        "heldout_loss": 4.25 + 0.01 * row.name,
        "heldout_ppl": float(np.exp(4.25 + 0.01 * row.name)),
        "tasks": {t: {"acc": 0.3, "acc_norm": 0.31, "n": 20, "shots": s} for t, s in shots.items()},
        "average_acc": average_acc,
        "limit": 20,
    }


def make_tree(root: Path, *, analysed: bool = True) -> dict:
    """results/<family>/ with plan, curves and (when ``analysed``) every analysis output."""
    layout = FamilyLayout(root)
    plan = plan_family(load_config(OVERRIDES), corpus_tokens=2_000_000)  # finite epochs
    runs = plan.table
    layout.plan_dir.mkdir(parents=True)
    runs_csv = layout.plan_dir / "runs.csv"
    runs.to_csv(runs_csv, index=False)
    rng = np.random.default_rng(0)
    finals = {row["run"]: write_curve(layout, row, rng) for _, row in runs.iterrows()}
    facts = {"runs": runs, "finals": finals, "evals": {}}
    if not analysed:
        return facts
    family = runs[runs.role == "family"]
    sizes = ["d64", "d96"]
    # The reference is built without tau: the planner's realized tau and TPP differ by float
    # noise and rounding across sizes (0.2 vs 0.2 + 4e-17, TPP 10.0 vs 10.009), which
    # surrogate.fit_surrogate counts as two values and then fails to fit (exponent overflow).
    no_tau_csv = layout.plan_dir / "runs_without_tau.csv"
    runs.drop(columns=["tau"]).to_csv(no_tau_csv, index=False)
    for band in (10, 20):
        in_band = family[family.tpp_band == band]
        ref_dir = layout.reference_dir / f"tpp{band}"
        analysis.build_reference(
            [layout.curve(r) for r in in_band[in_band.is_reference].run], no_tau_csv, sizes, ref_dir
        )
        analysis.family_statistics(
            [layout.curve(r) for r in in_band.run],
            runs_csv,
            root / "collapse" / f"tpp{band}",
            reference=ref_dir / "reference.csv",
        )
        for run in in_band[in_band.monitored].run:
            analysis.gate_run(
                layout.curve(run),
                ref_dir / "reference.csv",
                runs_csv,
                GatePolicy(),
                layout.gate(run),
                layout.gate(run).with_suffix(".png"),
            )
    sweep_runs = runs[runs.role.isin(["sweep", "sweep_reference"])].run  # variants + references
    code = cli_main(
        ["stage", "sweep", *[str(layout.curve(r)) for r in sweep_runs], "--runs", str(runs_csv)]
        + ["--fractions", "0.1", "0.2", "0.3", "--out", str(root / "sweeps" / "tau")]
    )
    assert code == 0
    (root / "evals").mkdir()
    for i, (_, row) in enumerate(family[family.tpp_band == 10].iterrows()):
        if row["run"] in (NOT_EVALUATED, FAULTY):
            continue
        facts["evals"][row["run"]] = eval_json(row, 0.28 + 0.01 * i)
        (root / "evals" / f"{row['run']}.json").write_text(json.dumps(facts["evals"][row["run"]]))
    return facts


@pytest.fixture(scope="module")
def celerity():
    return plan_family(load_config(list(report.CELERITY_OVERRIDES)), corpus_tokens=0)


@pytest.fixture(scope="module")
def built(tmp_path_factory, celerity):
    root = tmp_path_factory.mktemp("results") / "tiny"
    facts = make_tree(root)
    paths = report.build_report(root, root / "report", celerity_plan=celerity)
    return root, facts, paths


def test_every_artifact_is_written_and_linked(built):
    root, _, paths = built
    out = root / "report"
    for a in ARTIFACTS:
        if section(a.section).needs not in ("", "sweeps"):  # no faults, no contrast here
            continue
        if a.kind == "figure":
            for ext in ("png", "pdf"):
                assert (out / f"{a.name}.{ext}").stat().st_size > 5000, a.name
        else:
            assert (out / f"{a.name}.csv").stat().st_size > 0, a.name
            assert (out / f"{a.name}.md").stat().st_size > 0, a.name
    assert paths[-1] == out / "index.md"
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths)
    index = (out / "index.md").read_text()
    links = re.findall(r"\]\(([^)]+)\)", index)
    assert links and all((out / link).is_file() for link in links)
    assert (out / "gates" / f"{FAULTY}.png").is_file()
    assert "## Missing" not in index  # every stage has run in this tree


def test_family_table_rows_and_values(built):
    root, facts, _ = built
    runs = facts["runs"]
    table = pd.read_csv(root / "report" / "family_table.csv").set_index("run")
    family = runs[runs.role == "family"].set_index("run")
    assert list(table.index) == list(family.index)
    for col in ("params", "tokens"):
        assert (table[col] == family[col]).all()
    np.testing.assert_allclose(table["epochs"], family["epochs"])
    np.testing.assert_allclose(table["flops"], family["flops"], rtol=1e-6)
    complete = [r for r in family.index if r not in (PARTIAL, FAULTY)]
    finals = pd.Series(facts["finals"])[complete]
    np.testing.assert_allclose(table.loc[complete, "final_train_loss"], finals, rtol=0.01)
    assert np.isnan(table.at[PARTIAL, "final_train_loss"])
    assert table.at[PARTIAL, "trained_fraction"] == pytest.approx(PARTIAL_T_HAT, abs=0.01)
    for run, e in facts["evals"].items():
        assert table.at[run, "heldout_loss"] == pytest.approx(e["heldout_loss"])
        assert table.at[run, "downstream_avg_acc_pct"] == pytest.approx(100 * e["average_acc"])
    assert table.at[NOT_EVALUATED, "heldout_loss"] == pytest.approx(
        facts["finals"][NOT_EVALUATED] + 0.05
    )
    assert np.isnan(table.at[NOT_EVALUATED, "downstream_avg_acc_pct"])
    assert table.at[FAULTY, "gate"] == "fail"
    gated = family.index[family.monitored & (family.index != FAULTY)]
    assert (table.loc[gated, "gate"] == "pass").all()
    assert table.loc[family.index[family.is_reference], "gate"].isna().all()


def test_downstream_table_uses_planner_flops_and_frontier(built, celerity):
    root, facts, _ = built
    table = pd.read_csv(root / "report" / "downstream.csv")
    released = celerity.table[(celerity.table.role == "family") & (celerity.table.tpp_band == 234)]
    cel = table[table.group == "Celerity"].set_index("model")
    assert len(cel) == 5
    for _, row in released.iterrows():
        assert cel.at[f"Celerity-{row['size']}", "flops"] == pytest.approx(row["flops"])
        assert cel.at[f"Celerity-{row['size']}", "tokens"] == pytest.approx(row["tokens"])
    own = table[table.group == "this family"]
    assert set(own.model) == set(facts["evals"])
    # frontier: a point is on it iff every cheaper-or-equal point is less accurate
    for _, row in table.iterrows():
        cheaper = table[(table.flops <= row.flops) & (table.index != row.name)]
        beaten = (cheaper.avg_acc_pct >= row.avg_acc_pct).any()
        assert bool(row.on_frontier) == (not beaten), row.model
    assert table.loc[table.model == "BTLM-3b-8k-base", "flops"].item() == pytest.approx(1.55e22)


def test_gate_and_collapse_tables_follow_the_analysis_outputs(built):
    root, _, _ = built
    gates = pd.read_csv(root / "report" / "gates.csv").set_index("run")
    for path in (root / "gates").glob("*.json"):
        verdict = json.loads(path.read_text())
        assert gates.at[verdict["run"], "status"] == verdict["status"]
        assert gates.at[verdict["run"], "threshold"] == pytest.approx(verdict["threshold"])
    summary = pd.read_csv(root / "report" / "collapse_summary.csv")
    assert sorted(summary.tpp_band) == [10, 20]
    stats = json.loads((root / "collapse" / "tpp10" / "collapse.json").read_text())
    row = summary[summary.tpp_band == 10].iloc[0]
    assert row.score_mean_delta == pytest.approx(stats["score"])
    metrics = pd.read_csv(root / "report" / "sweep_metrics.csv")
    assert set(metrics.sweep) == {"tau"} and set(metrics.fraction) == {0.1, 0.2, 0.3}


def test_missing_stages_are_listed_not_fatal(tmp_path, celerity):
    root = tmp_path / "tiny"
    make_tree(root, analysed=False)
    paths = report.build_report(root, root / "report", celerity_plan=celerity)
    index = (root / "report" / "index.md").read_text()
    missing = index.split("## Missing")[1].split("\n## ")[0]
    for what in ("sweeps", "downstream", "gates", "Delta vs sigma", "reference curve"):
        assert what in missing, what
    assert (root / "report" / "downstream_vs_flops.png") in paths
    assert (root / "report" / "collapse_curves.png") in paths
    assert not (root / "report" / "sweep_predictions.png").exists()


def test_cli_accepts_the_index_path_and_plans_celerity(tmp_path):
    root = tmp_path / "tiny"
    (root / "plan").mkdir(parents=True)
    plan_family(load_config(OVERRIDES), corpus_tokens=0).table.to_csv(
        root / "plan" / "runs.csv", index=False
    )
    assert cli_main(["report", "--root", str(root), "--out", str(root / "report/index.md")]) == 0
    table = pd.read_csv(root / "report" / "downstream.csv")
    assert table.loc[table.group == "Celerity", "flops"].notna().all()
    assert "no loss curves yet" in (root / "report" / "index.md").read_text()


def test_pareto_frontier_by_hand():
    flops = np.array([1.0, 2.0, 2.0, 3.0, 4.0, np.nan])
    acc = np.array([50.0, 49.0, 55.0, 55.0, 60.0, 99.0])
    assert report.pareto_frontier(flops, acc).tolist() == [True, False, True, False, True, False]


def test_the_registry_drives_index_and_captions(built):
    """Each registered section has a builder; index.md shows every written artifact under its
    section with its summary; captions/<name>.rst holds the caption --report renders."""
    root, _, paths = built
    out = root / "report"
    assert list(report._BUILDERS) == [s.key for s in SECTIONS]
    index = (out / "index.md").read_text()
    titles = [line.removeprefix("## ") for line in index.splitlines() if line.startswith("## ")]
    assert titles == [s.title for s in SECTIONS if s.needs in ("", "sweeps")]
    for a in ARTIFACTS:
        if section(a.section).needs in ("", "sweeps"):
            body = index.split(f"## {section(a.section).title}\n")[1].split("\n## ")[0]
            assert (
                a.summary in body and f"{a.name}.{'pdf' if a.kind == 'figure' else 'csv'}" in body
            )
    shown = reported(sweeps=True, faults=True, contrast=True)
    assert {a.name for a in shown} == {a.name for a in ARTIFACTS if a.kind == "figure"} | {
        "family_table"
    }
    for a in shown:
        caption = out / "captions" / f"{a.name}.rst"
        assert caption in paths and caption.read_text() == a.caption + "\n"
        assert len(a.caption.split()) > 10, a.name
    assert {a.name for a in reported(sweeps=False, faults=False, contrast=False)} == {
        "family_table", "collapse_curves", "delta_sigma", "gate_summary", "downstream_vs_flops"
    }  # fmt: skip


def test_the_report_rule_declares_the_registry_and_the_contrast_uses_the_familys_rules(tmp_path):
    """A dry run of tiny (sweeps and a contrast, no faults): the report job's outputs are the
    registered artifacts with their captions; the contrast's reference, statistics and gates are
    jobs of the family's own rules, with the contrast's paths and runs."""
    dry = run_snakemake(tmp_path, "-n", "-p", "--config", "family=tiny", timeout=180).stdout
    block = dry.split("\nrule report:\n")[1]
    outputs = set(re.search(r"^\s+output: (.*)$", block, re.M).group(1).split(", "))
    shown = reported(sweeps=True, faults=False, contrast=True)
    assert outputs == {"results/tiny/report/index.md"} | {
        f"results/tiny/report/{f}" for a in shown for f in (a.file, f"captions/{a.name}.rst")
    }
    plan = plan_family(load_config(["family=tiny"]))
    contrast = sorted(contrast_members(plan.table).run)
    band = f"{plan.config.family.contrast_band():g}"
    scoped = re.findall(
        r"^rule (\w+):\n(?:\s+\w+:.*\n)*?\s+wildcards: scope=contrast/, (\w+)=(\S+)", dry, re.M
    )
    assert sorted(w for rule, key, w in scoped if rule == "gate") == contrast
    assert {(rule, w) for rule, key, w in scoped if key == "band"} == {
        ("reference", band), ("collapse_stats", band)
    }  # fmt: skip
    assert "rule contrast_" not in dry
