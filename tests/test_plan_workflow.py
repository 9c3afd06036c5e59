"""`snakemake plan` through the real workflow: the specs it writes are the planner's, byte for
byte; a config edit reruns the spec jobs of exactly the runs whose spec changed; the plan's
warnings print once per call. No training: seconds, not minutes."""

import re

import pytest
from workflow_cli import run_snakemake

from collapse.config import load_config
from collapse.plan import plan_family

TINY = ("--config", "family=tiny")


def scheduled(output: str, rule: str) -> list[str]:
    """The `run` wildcards of the jobs of ``rule`` a dry run lists."""
    runs, in_rule = [], False
    for line in output.splitlines():
        if re.match(r"^(local)?rule \w+:", line):
            in_rule = line.split()[-1] == f"{rule}:"
        match = re.match(r"\s+wildcards: run=(\S+)", line)
        if in_rule and match:
            runs.append(match.group(1).rstrip(","))
    return sorted(runs)


def test_the_plan_target_writes_the_planners_specs_and_tables(tmp_path):
    run_snakemake(tmp_path, "plan", *TINY, timeout=120)
    plan = plan_family(load_config(["family=tiny"]))  # paths relative to the workdir
    plan_dir = tmp_path / "results/tiny/plan"
    written = sorted(p.stem for p in (plan_dir / "runs").glob("*.json"))
    assert written == sorted(plan.run_names())
    for spec in plan.runs:
        assert (plan_dir / "runs" / f"{spec.run}.json").read_text() == spec.to_json()
    for table in ("runs.csv", "report.md", "data.json", "plan.png"):
        assert (plan_dir / table).stat().st_size > 0, table

    again = run_snakemake(tmp_path, "plan", "-n", *TINY, timeout=120)
    assert "Nothing to be done" in again.stdout + again.stderr


def changed_or_new(override: str) -> list[str]:
    """The runs whose spec ``override`` changes or adds, by the planner itself."""
    base = plan_family(load_config(["family=tiny"]))
    edited = plan_family(load_config(["family=tiny", override]))
    before = {s.run: s.to_json() for s in base.runs}
    return sorted(s.run for s in edited.runs if before.get(s.run) != s.to_json())


def test_a_config_edit_reruns_the_spec_jobs_of_the_changed_runs_only(tmp_path):
    run_snakemake(tmp_path, "plan", *TINY, timeout=120)

    # Dropping the contrast changes no remaining run's spec: the tables are re-planned only.
    out = run_snakemake(
        tmp_path, "plan", "-n", *TINY, "overrides=family.contrast=null", timeout=120
    )
    assert changed_or_new("family.contrast=null") == scheduled(out.stdout, "spec") == []
    assert re.search(r"^(local)?rule plan:", out.stdout, re.M)

    # A second seed adds that seed's runs and leaves every other spec alone.
    out = run_snakemake(tmp_path, "plan", "-n", *TINY, "overrides=family.seeds=[0,1]", timeout=120)
    assert scheduled(out.stdout, "spec") == changed_or_new("family.seeds=[0,1]") != []

    # A new tau changes the family's specs (not the sweep's, whose grid sets tau): exactly their
    # spec jobs rerun, and their training follows in the same call.
    out = run_snakemake(tmp_path, "-n", *TINY, "overrides=family.tau=[0.3]", timeout=120)
    changed = changed_or_new("family.tau=[0.3]")
    assert scheduled(out.stdout, "spec") == changed
    assert any(r.startswith("sweep") for r in plan_family(load_config(["family=tiny"])).run_names())
    assert not any(r.startswith("sweep-") for r in changed)
    assert set(changed) <= set(scheduled(out.stdout, "train"))


@pytest.mark.parametrize(
    "config, warning",
    [
        (["family=experiments/tiny_tpp5"], "seen more than once"),  # d192: 1.09 epochs
        (["family=celerity", "cluster=slurm_h100"], "could not be counted"),  # placeholder blend
    ],
    ids=["repeated-data", "uncounted-corpus"],
)
def test_the_plans_warnings_print_once_per_call(tmp_path, config, warning):
    out = run_snakemake(tmp_path, "-n", "--config", *config, timeout=120)
    warnings = [line for line in out.stderr.splitlines() if line.startswith("warning:")]
    mine = [line for line in warnings if warning in line]
    assert len(mine) == 1 and len(set(warnings)) == len(warnings), out.stderr[-2000:]
