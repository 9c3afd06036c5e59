"""The order Snakemake trains the default family in when cores are short (a dry run)."""

import re

from workflow_cli import run_snakemake

JOB = re.compile(r"^(?:local)?rule (\w+):$")
FIELD = re.compile(r"^\s+(wildcards|priority): (.+)$")


def dry_run_priorities(workdir) -> dict[tuple[str, str], float]:
    """(rule, wildcards) -> priority of every job of `snakemake -n` on the default family (a job
    without a priority line has Snakemake's default, 0)."""
    out = run_snakemake(workdir, "-n", timeout=300)
    jobs, job = {}, None
    for line in [*out.stdout.splitlines(), "rule end:"]:
        if m := JOB.match(line):
            if job:
                jobs[(job["rule"], job.get("wildcards", ""))] = float(job.get("priority", 0))
            job = {"rule": m.group(1)}
        elif (m := FIELD.match(line)) and job:
            job[m.group(1)] = m.group(2)
    return jobs


def test_reference_first_then_the_largest_run(tmp_path):
    """Every monitored run waits for the reference, so its runs and its rule go first; then the
    most FLOPs first, so that the largest size does not train alone while the other cores idle."""
    jobs = dry_run_priorities(tmp_path)
    train = {w.removeprefix("run="): p for (rule, w), p in jobs.items() if rule == "train"}
    reference = {f"d96-tpp10-s{seed}" for seed in range(3)}
    reference_runs = {r: p for r, p in train.items() if r in reference}
    others = {r: p for r, p in train.items() if r not in reference}
    contrast = {r for r in others if r.startswith("contrast-")}
    # the sweep's d96 references at tau 0.2 are d96-s0..s2, and its d128 variant at tau 0.2
    # (stopped at 30 %) the first part of d128-s0: they share_run, no train
    shared = [f"sweepref-tau-d96-tau0.2-s{seed}" for seed in range(3)]
    assert not set(shared) & set(train) and "sweep-tau-d128-tau0.2-s0" not in train
    # d128, d160, the contrast, two variants and three seeds at each of two other taus
    assert len(reference_runs) == 3 and len(others) == 11 and len(contrast) == 1, sorted(train)
    reference_rule = jobs[("reference", "scope=, band=10")]  # the family's, not the contrast's
    assert min(reference_runs.values()) > max(others.values())
    assert reference_rule > max(others.values())
    # d160 and its contrast twin (the same FLOPs) first: two cores train both at once
    assert others["d160-tpp10-s0"] == others["contrast-d160-tpp10-s0"] == max(others.values())
    assert (
        others["contrast-d160-tpp10-s0"]
        > others["sweepref-tau-d96-tau0.4-s0"]
        > others["sweep-tau-d128-tau0.4-s0"]  # 30 % of d128's FLOPs: less than a full d96
    )
