"""Segments on a real local Slurm whose partition allows 3 minutes per job.

One smoke run (d32) is planned longer than the limit, so it trains in three segments: two
train_segment jobs and its train job, chained by Snakemake, each submitted with ``-t 3``. The
second segment's job is cancelled while it trains; Snakemake's retry resumes it from its
checkpoint. The final curve equals, bit for bit, the same run trained in one process without a
limit. A segment that runs slower than planned stops by its time budget (exit 75) and is retried
the same way.

Three minutes, not one or two: Slurm's early SIGTERM comes 60 s before the limit (its
resolution), and on a 2-core machine busy with other work a job's start (imports, Megatron, the
dataset index) alone can take most of a minute, which left a 2-minute job about one step.
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
    jobs_of_rule,
    snakemake_env,
    snakemake_slurm_args,
    squeue_state,
    start_cluster,
    start_in_background,
    wait_until,
)
from workflow_cli import snakemake_cmd

# 2.5 min. Not in CI: on a quiet machine segment 2 can train from step 50 to its end (18 steps,
# about 1 s) before the scancel lands, and the cancelled job's retry then never happens.
pytestmark = [pytest.mark.slurm, pytest.mark.slow]

FAMILY = "smoke"
RUN = "d32-tpp4-s0"  # a reference size: not monitored, so it needs no reference curve
TARGET = f"results/{FAMILY}/runs/{RUN}/curve.parquet"
LIMIT_MIN = 3
PARTITION = "debug"
# the CPU cluster's facts through Slurm, with the partition's 3-minute limit; its peak FLOP/s
# lowered so that d32's estimate (2.2 min x margin 2 = 4.4 min) needs three jobs of 1.75 min
# training each (3 min - 1 min of SIGTERM lead - 0.25 min of start)
OVERRIDES = [
    "cluster.executor=slurm",
    f"+cluster.partition={PARTITION}",
    "cluster.mem_gb=4",
    f"+cluster.time_limit_min={LIMIT_MIN}",
    "cluster.job_startup_min=0.25",
    "cluster.peak_flops=2.68e9",
]
CONFIG = [
    "--config",
    f"family={FAMILY}",
    "cluster=local",
    "overrides=[" + ",".join(f'"{o}"' for o in OVERRIDES) + "]",
]


def slurm_args(workdir: Path, *extra: str) -> list[str]:
    return snakemake_slurm_args(workdir, TARGET, *extra, *CONFIG, snakefile=REPO / "Snakefile")


@pytest.fixture(scope="module")
def cluster():
    started = start_cluster()
    subprocess.run(
        ["scontrol", "update", f"PartitionName={PARTITION}", f"MaxTime={LIMIT_MIN}"], check=True
    )
    yield started
    subprocess.run(["scontrol", "update", f"PartitionName={PARTITION}", "MaxTime=UNLIMITED"])
    started.stop()


def minutes(limit: str) -> float:
    """squeue's %l (``2:00``, ``1:02:00``, ``1-00:00:00``) in minutes."""
    days, _, clock = limit.rpartition("-")
    parts = [int(p) for p in clock.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    h, m, s = parts
    return (int(days or 0) * 24 + h) * 60 + m + s / 60


def time_limits(after: int) -> dict[str, float]:
    """The time limit of every job submitted after job id ``after``, by job id."""
    out = subprocess.run(
        ["squeue", "-h", "--states=all", "-o", "%i %l"], capture_output=True, text=True
    ).stdout
    rows = (line.split() for line in out.splitlines())
    return {i: minutes(limit) for i, limit in rows if int(i) > after}


def running_segment_job(segment: int) -> str | None:
    out = subprocess.run(
        ["squeue", "-h", "-t", "R", "-o", "%i %k"], capture_output=True, text=True
    ).stdout
    for line in out.splitlines():
        job_id, _, comment = line.partition(" ")
        if comment == f"rule_train_segment_wildcards_{RUN}_{segment}":
            return job_id
    return None


def test_a_run_longer_than_the_partition_limit_trains_in_segments(cluster, tmp_path):
    from collapse.runspec import RunSpec

    env = snakemake_env()
    # the data first, on this machine (tokenizing may take longer than the limit here)
    data = subprocess.run(
        snakemake_cmd(tmp_path, f"results/{FAMILY}/data/meta.json", *CONFIG, cores=1),
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert data.returncode == 0, data.stderr[-3000:]

    dry = subprocess.run(
        slurm_args(tmp_path, "-n"), cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert f"wildcards: run={RUN}, segment=1" in dry.stdout
    assert f"wildcards: run={RUN}, segment=2" in dry.stdout
    assert "segment=3" not in dry.stdout  # the third is the run's own train job

    results = tmp_path / "results" / FAMILY
    last_job = max(map(int, time_limits(0)), default=0)  # earlier jobs squeue still shows
    began = time.monotonic()
    first = start_in_background(slurm_args(tmp_path, "--retries", "8"), cwd=tmp_path, env=env)
    try:
        # cancel segment 2 while it trains (it logs every 10 steps; segment 1 ended at 34)
        segment_log = results / "logs" / "train" / f"{RUN}.segment2.log"

        def training_segment_2():
            job = running_segment_job(2)
            shows = segment_log.is_file() and "step 50/" in segment_log.read_text()
            return job if job and shows else None

        job = wait_until(training_segment_2, 900, f"segment 2 of {RUN} training", every_s=0.2)
        subprocess.run(["scancel", job])
        wait_until(lambda: squeue_state(job) in ("CANCELLED", ""), 120, f"job {job} to end")
        log, _ = first.communicate(timeout=1800)
    finally:
        if first.poll() is None:
            first.kill()
    took = time.monotonic() - began
    print(f"segmented run through Slurm, one cancel included: {took:.0f} s")
    assert first.returncode == 0, log[-5000:]

    run_dir = results / "runs" / RUN
    assert [json.loads((run_dir / "segments" / f"{k}.json").read_text())["step"] for k in (1, 2)]
    assert json.loads((run_dir / "segments" / "1.json").read_text())["step"] == 34
    assert json.loads((run_dir / "segments" / "2.json").read_text())["step"] == 68
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["steps_done"] == meta["steps_target"] == 101
    assert len(meta["restarts"]) >= 3  # two segment starts and the cancelled job's retry

    limits = time_limits(last_job)  # every job of this workflow, training or not
    trained = [j for j in jobs_of_rule("train_segment") + jobs_of_rule("train") if j in limits]
    assert len(trained) >= 4  # two segments, the retry of the cancelled one, the last segment
    assert max(limits.values()) <= LIMIT_MIN, limits

    # the same run in one process, no limit, elsewhere: the same curve, bit for bit
    spec = RunSpec.load(results / "plan" / "runs" / f"{RUN}.json")
    straight = spec.model_copy(
        update={
            "run_dir": str(tmp_path / "straight" / "run"),
            "checkpoint_dir": str(tmp_path / "straight" / "checkpoints"),
            "resources": spec.resources.model_copy(
                update={"segments": 1, "exit_duration_min": 0.0}
            ),
        }
    )
    path = tmp_path / "straight" / "spec.json"
    path.parent.mkdir(parents=True)
    path.write_text(straight.to_json())
    alone = subprocess.run(
        ["python", "-m", "collapse.train", "--spec", str(path)], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert alone.returncode == 0, alone.stderr[-3000:]
    curve = pd.read_parquet(run_dir / "curve.parquet")
    reference = pd.read_parquet(Path(straight.run_dir) / "curve.parquet")
    assert list(curve.step) == list(range(1, 102))
    for column in ("loss", "grad_norm", "lr"):
        assert curve[column].tolist() == reference[column].tolist()
