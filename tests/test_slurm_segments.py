"""Segments on a real local Slurm whose partition allows 3 minutes per job.

One smoke run (d32) is planned longer than the limit, so it trains in three segments: two
train_segment jobs and its train job, chained by Snakemake, each submitted with ``-t 3``. The
second segment's job is cancelled while it trains; Snakemake's retry resumes it from its
checkpoint. The cancel cannot land after the segment's end: the segment's training process is
frozen (SIGSTOP) as soon as it logs a step, and only then cancelled; Slurm's cancel sends
SIGCONT and SIGTERM, so the process finishes its step, saves and exits 75. The final curve
equals, bit for bit, the same run trained in one process without a limit. A segment that runs
slower than planned stops by its time budget (exit 75) and is retried the same way. A second
test runs the segments of a run planned over two nodes, each segment a two-node job.

Three minutes, not one or two: Slurm's early SIGTERM comes 60 s before the limit (its
resolution), and on a 2-core machine busy with other work a job's start (imports, Megatron, the
dataset index) alone can take most of a minute, which left a 2-minute job about one step.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
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
    training_pids,
    wait_until,
)
from workflow_cli import snakemake_cmd

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

FAMILY = "smoke"
RUN = "d32-tpp4-s0"  # a reference size: not monitored, so it needs no reference curve
TARGET = f"results/{FAMILY}/runs/{RUN}/curve.parquet"
LIMIT_MIN = 3
PARTITION = "debug"
HOST = socket.gethostname().split(".")[0]
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


def steps_logged(log: Path) -> int:
    """The last step a training log shows (0: none yet)."""
    if not log.is_file():
        return 0
    return max((int(m) for m in re.findall(r"^step (\d+)/", log.read_text(), re.M)), default=0)


# 140-145 s on a quiet 2-core machine, up to 375 s on a busy one: slow only, so that the default
# run stays well under 30 minutes; tests/test_segments.py chains segments in CI without Slurm
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
    frozen: list[int] = []
    try:
        # segment 2 (steps 35..68) is cancelled while it trains: its training process is
        # frozen (SIGSTOP) as soon as the log shows its first step, so it cannot reach its end
        # before the cancel lands; Slurm's cancel sends SIGCONT, then SIGTERM, and the step
        # under way finishes, saves and exits 75
        segment_log = results / "logs" / "train" / f"{RUN}.segment2.log"

        def segment_2_process():
            job = running_segment_job(2)
            pids = training_pids(f"SLURM_JOB_ID={job}") if job else []
            return (job, pids) if pids else None

        job, pids = wait_until(segment_2_process, 900, f"segment 2 of {RUN} to start", 0.2)
        wait_until(lambda: steps_logged(segment_log), 300, "segment 2's first step", 0.02)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        frozen = pids
        frozen_at = steps_logged(segment_log)
        assert 35 <= frozen_at < 68, frozen_at
        subprocess.run(["scancel", job], check=True)
        wait_until(lambda: squeue_state(job) in ("CANCELLED", ""), 120, f"job {job} to end")
        log, _ = first.communicate(timeout=1800)
    finally:
        for pid in frozen:  # Slurm's SIGCONT reached them; this only covers a failed test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
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
    # the segment starts at 34 and 68, and the retry of the cancelled job from the checkpoint
    # it saved after the SIGTERM, inside segment 2
    resumed = [r["step"] for r in meta["restarts"]]
    assert len(resumed) == 3 and resumed[0] == 34 and resumed[2] == 68, resumed
    assert frozen_at < resumed[1] < 68, (frozen_at, resumed)

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


# ------------------------------------------------------------------------ segments over two nodes
TWO_NODE_RUN = "d32-tpp0.5-s0"
TWO_NODE_TARGET = f"results/{FAMILY}/runs/{TWO_NODE_RUN}/curve.parquet"
# d32 at TPP 0.5 (28 steps) over 2 nodes x 2 processes (TP2 inside a node, DP2 across), its
# estimate (10.9 GFLOP at 3e8 x MFU 0.25: 145 s, x margin 2 = 4.8 min) cut into three
# 3-minute jobs of 1.75 min training each: segments end at steps 10, 19 and 28
TWO_NODE_OVERRIDES = [
    "cluster.executor=slurm",
    f"+cluster.partition={PARTITION}",
    "cluster.mem_gb=2",
    "cluster.threads_per_proc=1",
    f"+cluster.time_limit_min={LIMIT_MIN}",
    "cluster.job_startup_min=0.25",
    "cluster.peak_flops=3e8",
    "+cluster.nodes_per_run=2",
    "cluster.procs_per_run=4",
    "+cluster.tp=2",
    "family.tpp=[0.5]",
    "family.sizes=[{name:d32,d_model:32,n_layers:2,n_heads:2}]",
    "family.reference.sizes=[d32]",
    "family.reference.seeds=[0]",
    "family.sweeps=[]",
    "family.data.max_corpus_bytes=400000",
    "family.training.log_every_steps=1",
]
TWO_NODE_CONFIG = [
    "--config",
    f"family={FAMILY}",
    "cluster=local",
    f"overrides={json.dumps(TWO_NODE_OVERRIDES)}",
]


def jobs_by_comment(after: int) -> dict[str, tuple[str, int, str]]:
    """Every job submitted after job id ``after``: its id -> (comment, nodes, node list)."""
    out = subprocess.run(
        ["squeue", "-h", "--states=all", "-o", "%i %k %D %N"], capture_output=True, text=True
    ).stdout
    jobs = {}
    for line in out.splitlines():
        job_id, comment, nodes, nodelist = (line.split() + [""])[:4]
        if int(job_id) > after:
            jobs[job_id] = (comment, int(nodes), nodelist)
    return jobs


def test_segments_of_a_two_node_run_chain_as_two_node_jobs(cluster, tmp_path):
    """A run planned over two nodes and longer than the limit: Snakemake chains its three
    segments, every one a job of two nodes (srun starts a launcher on each, they meet in one
    rendezvous), and the curve equals, bit for bit, the same layout trained in one go."""
    from collapse.runspec import RunSpec

    env = snakemake_env(OMP_NUM_THREADS="1")
    data = subprocess.run(
        snakemake_cmd(tmp_path, f"results/{FAMILY}/data/meta.json", *TWO_NODE_CONFIG, cores=1),
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert data.returncode == 0, data.stderr[-3000:]
    args = snakemake_slurm_args(
        tmp_path, TWO_NODE_TARGET, *TWO_NODE_CONFIG, snakefile=REPO / "Snakefile"
    )
    dry = subprocess.run(
        [*args, "-n"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert f"wildcards: run={TWO_NODE_RUN}, segment=1" in dry.stdout
    assert f"wildcards: run={TWO_NODE_RUN}, segment=2" in dry.stdout
    assert "segment=3" not in dry.stdout

    last_job = max(map(int, time_limits(0)), default=0)
    began = time.monotonic()
    # retries: a segment slower than planned here ends by its time budget and is resumed
    done = subprocess.run(
        [*args, "--retries", "2"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=1800,
    )  # fmt: skip
    took = time.monotonic() - began
    assert done.returncode == 0, done.stderr[-5000:]

    results = tmp_path / "results" / FAMILY
    run_dir = results / "runs" / TWO_NODE_RUN
    spec = RunSpec.load(results / "plan" / "runs" / f"{TWO_NODE_RUN}.json")
    assert (spec.parallel.nodes, spec.parallel.procs_per_node, spec.parallel.tp) == (2, 2, 2)
    assert spec.resources.segments == 3 and spec.resources.runtime_min == LIMIT_MIN
    marks = [json.loads((run_dir / "segments" / f"{k}.json").read_text()) for k in (1, 2)]
    assert [m["step"] for m in marks] == [10, 19]
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["steps_done"] == meta["steps_target"] == 28
    assert {10, 19} <= {r["step"] for r in meta["restarts"]}

    # every training job of the run had two nodes and stayed within the limit; each of its
    # logs has the launcher lines of both nodes
    jobs = jobs_by_comment(last_job)
    limits = time_limits(last_job)
    wildcards = f"wildcards_{TWO_NODE_RUN}"
    trained = {
        job: (comment, nodes, nodelist)
        for job, (comment, nodes, nodelist) in jobs.items()
        if comment.startswith((f"rule_train_segment_{wildcards}_", f"rule_train_{wildcards}"))
    }
    segments_seen = {comment.rsplit("_", 1)[-1] for comment, _, _ in trained.values()}
    assert {"1", "2", TWO_NODE_RUN} <= segments_seen, trained
    for job, (comment, nodes, nodelist) in trained.items():
        assert nodes == 2 and nodelist == f"{HOST}-[1-2]", (job, comment, nodes, nodelist)
        assert limits[job] <= LIMIT_MIN
    for log_name in (f"{TWO_NODE_RUN}.segment1.log", f"{TWO_NODE_RUN}.segment2.log",
                     f"{TWO_NODE_RUN}.log"):  # fmt: skip
        log = (results / "logs" / "train" / log_name).read_text()
        for node in (f"{HOST}-1", f"{HOST}-2"):
            assert f"launcher on node {node} " in log, (log_name, log[-2000:])

    # the same layout (TP2 x DP2, four gloo ranks) trained in one go, outside Slurm
    straight = spec.model_copy(
        update={
            "run_dir": str(tmp_path / "straight" / "run"),
            "checkpoint_dir": str(tmp_path / "straight" / "checkpoints"),
            "parallel": spec.parallel.model_copy(update={"nodes": 1, "procs_per_node": 4}),
            "resources": spec.resources.model_copy(
                update={"nodes": 1, "segments": 1, "exit_duration_min": 0.0}
            ),
        }
    )
    path = tmp_path / "straight" / "spec.json"
    path.parent.mkdir(parents=True)
    path.write_text(straight.to_json())
    alone = subprocess.run(
        ["torchrun", "--standalone", "--nnodes=1", "--nproc_per_node=4", "-m",
         "collapse.train", "--spec", str(path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert alone.returncode == 0, alone.stderr[-3000:]
    curve = pd.read_parquet(run_dir / "curve.parquet")
    reference = pd.read_parquet(Path(straight.run_dir) / "curve.parquet")
    diff = (curve.loss - reference.loss).abs().max()
    print(
        f"two-node run in 3 segments through Slurm: {took:.0f} s, jobs {sorted(trained)}, "
        f"restarts {[r['step'] for r in meta['restarts']]}, max |loss diff| to the "
        f"uninterrupted run {diff:.3g}"
    )
    assert list(curve.step) == list(range(1, 29))
    for column in ("loss", "grad_norm", "lr"):
        assert curve[column].tolist() == reference[column].tolist(), column
