"""Part of the smoke family through ``snakemake --profile slurm`` on a real local Slurm.

Plan, data, three training jobs (the two reference sizes and d64), the reference and d64's
gate. The d64 training job is cancelled with scancel after its first checkpoint; the rerun
resumes it from that checkpoint (meta.json records the restart) and finishes the DAG.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest
from slurm.cluster import (
    REPO,
    snakemake_env,
    snakemake_slurm_args,
    squeue_state,
    start_cluster,
    start_in_background,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.ci]

FAMILY = "smoke"
CANCELLED_RUN = "d64-tpp4-s0"  # monitored: it trains after the reference exists
TARGET = f"results/{FAMILY}/gates/{CANCELLED_RUN}.json"
# this one-node cluster: the CPU "local" cluster facts, submitted through Slurm; one reference
# seed keeps the job count down; a long time limit keeps the early SIGTERM out of the way
CONFIG = [
    "--config",
    f"family={FAMILY}",
    "cluster=local",
    "overrides=["
    '"cluster.executor=slurm","+cluster.partition=debug","cluster.mem_gb=4",'
    '"cluster.min_runtime_min=30","family.reference.seeds=[0]"]',
]
NEEDED = [
    "Snakefile",
    "workflow/rules/plan.smk",
    "workflow/rules/data.smk",
    "workflow/rules/train.smk",
    "workflow/rules/reference.smk",
    "workflow/rules/gates.smk",
    f"config/family/{FAMILY}.yaml",
    "config/cluster/local.yaml",
    "workflow/collapse/train.py",
    "workflow/collapse/checkpoint.py",
]
EXPECTED_JOBS = {"plan": 1, "data": 1, "train": 3, "reference": 1, "gate": 1}


def family_args(workdir: Path, *extra: str) -> list[str]:
    # the target goes before --config, which takes every following word as a key=value pair
    return snakemake_slurm_args(workdir, TARGET, *extra, *CONFIG, snakefile=REPO / "Snakefile")


def dry_run_job_counts(workdir: Path) -> dict[str, int]:
    dry = subprocess.run(
        [*family_args(workdir, "-n", "--quiet", "rules")],
        cwd=workdir,
        env=snakemake_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert dry.returncode == 0, f"the workflow's dry run fails: {dry.stderr[-800:]}"
    counts = {}
    for line in dry.stdout.splitlines():
        words = line.split()
        if len(words) == 2 and words[1].isdigit():
            counts[words[0]] = int(words[1])
    return counts


@pytest.fixture(scope="module")
def cluster():
    missing = [p for p in NEEDED if not (REPO / p).exists()]
    assert not missing, f"the workflow's files are missing: {', '.join(missing)}"
    started = start_cluster()
    yield started
    started.stop()


def train_job_of(run: str) -> str | None:
    """The Slurm id of the running training job of ``run``, from the plugin's job comment."""
    out = subprocess.run(
        ["squeue", "-h", "-t", "R", "-o", "%i %k"], capture_output=True, text=True
    ).stdout
    for line in out.splitlines():
        job_id, _, comment = line.partition(" ")
        if comment == f"rule_train_wildcards_{run}":
            return job_id
    return None


def test_family_through_slurm_resumes_a_cancelled_training_job(cluster, tmp_path):
    from collapse.checkpoint import latest_complete, step_of

    counts = dry_run_job_counts(tmp_path)
    assert counts.get("train", 0) >= 2
    assert {k: counts.get(k) for k in EXPECTED_JOBS} == EXPECTED_JOBS, counts

    results = tmp_path / "results" / FAMILY
    checkpoints = results / "checkpoints" / CANCELLED_RUN
    env = snakemake_env()
    began = time.monotonic()
    first = start_in_background(family_args(tmp_path, "--retries", "0"), cwd=tmp_path, env=env)
    try:
        wait_until(
            lambda: checkpoints.is_dir() and latest_complete(checkpoints, log=lambda m: None),
            1500,
            f"the first complete checkpoint of {CANCELLED_RUN}",
            every_s=1,
        )
        job = train_job_of(CANCELLED_RUN)
        assert job, f"no running Slurm job for {CANCELLED_RUN}"
        saved_before_cancel = step_of(latest_complete(checkpoints, log=lambda m: None))
        assert subprocess.run(["scancel", job]).returncode == 0
        wait_until(lambda: squeue_state(job) in ("CANCELLED", ""), 120, f"job {job} to end")
        log, _ = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    first_s = time.monotonic() - began
    assert first.returncode != 0, log[-3000:]
    for run in ("d32-tpp4-s0", "d48-tpp4-s0"):
        assert (results / "runs" / run / "curve.parquet").exists(), log[-3000:]
    assert (results / "reference" / "tpp4" / "reference.csv").exists()
    assert not (results / "runs" / CANCELLED_RUN / "curve.parquet").exists()
    resume_step = step_of(latest_complete(checkpoints, log=lambda m: None))
    assert resume_step >= saved_before_cancel  # SIGTERM may have saved one more

    began = time.monotonic()
    rerun = subprocess.run(
        family_args(tmp_path), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800
    )
    rerun_s = time.monotonic() - began
    print(f"first run until cancel: {first_s:.0f} s, rerun: {rerun_s:.0f} s")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert json.loads((tmp_path / TARGET).read_text())
    meta = json.loads((results / "runs" / CANCELLED_RUN / "meta.json").read_text())
    assert [r["step"] for r in meta["restarts"]] == [resume_step]
    assert meta["steps_done"] == meta["steps_target"]
    curve = pd.read_parquet(results / "runs" / CANCELLED_RUN / "curve.parquet")
    assert list(curve.step) == list(range(1, meta["steps_target"] + 1))
    assert list(curve.step[curve.restart]) == [resume_step + 1]
