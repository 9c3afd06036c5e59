"""One training job over two Slurm nodes, launched by the workflow's own path.

The local cluster runs two slurmd daemons on this machine (tests/slurm/start_cluster.sh), so a
job of ``--nodes=2`` gets two nodes. ``snakemake --profile slurm`` submits the train rule; its
command (collapse.launch.multinode_command) srun-starts one torchrun per node, and the two
torchruns meet in a c10d rendezvous on the first node; the ranks talk gloo. The curve is
compared, step by step, with the same spec trained by one process outside Slurm.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
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

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

FAMILY = "smoke"
RUN = "d32-tpp0.5-s0"
CURVE = f"results/{FAMILY}/runs/{RUN}/curve.parquet"
TOLERANCE = 1e-5
HOST = socket.gethostname().split(".")[0]
TP2_DP2 = dict(nodes=2, procs=4, tp=2)
PP2_DP2 = dict(nodes=2, procs=4, pp=2)
UNINTERRUPTED: dict[str, list[float]] = {}  # layout -> curve of a two-node run, for later tests


def overrides(*extra: str) -> list[str]:
    """The smoke family cut to d32 at TPP 0.5 (23 steps), on a CPU cluster submitted to Slurm."""
    items = [
        "cluster.executor=slurm",
        "+cluster.partition=debug",
        "cluster.mem_gb=2",
        "cluster.threads_per_proc=1",
        "cluster.min_runtime_min=20",
        "family.tpp=[0.5]",
        "family.sizes=[{name:d32,d_model:32,n_layers:2,n_heads:2}]",
        "family.reference.sizes=[d32]",
        "family.reference.seeds=[0]",
        "family.sweeps=[]",
        "family.data.max_corpus_bytes=400000",
        "family.training.log_every_steps=1",
        *extra,
    ]
    return ["--config", f"family={FAMILY}", "cluster=local", f"overrides={json.dumps(items)}"]


def layout_overrides(nodes: int, procs: int, tp: int = 1, pp: int = 1) -> list[str]:
    return [
        f"+cluster.nodes_per_run={nodes}",
        f"cluster.procs_per_run={procs}",
        f"+cluster.tp={tp}",
        f"+cluster.pp={pp}",
    ]


def snakemake(workdir: Path, *extra: str, timeout: float = 900) -> subprocess.CompletedProcess:
    args = snakemake_slurm_args(workdir, CURVE, "--retries", "0", snakefile=REPO / "Snakefile")
    return subprocess.run(
        [*args, *extra],
        cwd=workdir,
        env=snakemake_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def losses(run_dir: Path) -> list[float]:
    return pd.read_parquet(run_dir / "curve.parquet")["loss"].tolist()


def single_process_losses(workdir: Path) -> list[float]:
    """The planned spec of RUN, trained by one process outside Slurm (same global batch)."""
    from collapse.runspec import RunSpec

    spec = RunSpec.model_validate_json(
        (workdir / f"results/{FAMILY}/plan/runs/{RUN}.json").read_text()
    )
    p = spec.parallel
    batch = p.micro_batch_seqs * p.grad_accum * p.dp
    single = spec.model_copy(
        update=dict(
            parallel=p.model_copy(
                update=dict(
                    tp=1,
                    pp=1,
                    dp=1,
                    grad_accum=batch // p.micro_batch_seqs,
                    nodes=1,
                    procs_per_node=1,
                )
            ),
            resources=spec.resources.model_copy(update=dict(nodes=1)),
            run_dir=str(workdir / "single" / "run"),
            checkpoint_dir=str(workdir / "single" / "checkpoints"),
        )
    )
    path = workdir / "single" / "spec.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(single.to_json())
    done = subprocess.run(
        [sys.executable, "-m", "collapse.train", "--spec", str(path)],
        cwd=workdir,
        env=snakemake_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return losses(workdir / "single" / "run")


@pytest.fixture(scope="module")
def cluster():
    started = start_cluster(nodes=2)
    print(f"start_cluster.sh (2 nodes) took {started.start_s:.1f} s")
    yield started
    started.stop()


@pytest.mark.parametrize(
    "layout",
    [TP2_DP2, PP2_DP2],
    ids=["tp2-in-node-dp2-across", "pp2-across-nodes-dp2"],
)
def test_two_node_job_trains_the_one_process_curve(cluster, tmp_path, layout):
    began = time.monotonic()
    done = snakemake(tmp_path, *overrides(*layout_overrides(**layout)))
    took = time.monotonic() - began
    assert done.returncode == 0, done.stderr[-4000:]
    log = (tmp_path / f"results/{FAMILY}/logs/train/{RUN}.log").read_text()
    spec = json.loads((tmp_path / f"results/{FAMILY}/plan/runs/{RUN}.json").read_text())
    assert spec["parallel"]["nodes"] == 2 and spec["parallel"]["procs_per_node"] == 2
    (job,) = jobs_of_rule("train")[-1:]
    assert scontrol_job_field(job, "NodeList") == "vm-[1-2]".replace("vm", HOST)
    assert scontrol_job_field(job, "NumNodes") == "2"
    got = losses(tmp_path / f"results/{FAMILY}/runs/{RUN}")
    began = time.monotonic()
    expected = single_process_losses(tmp_path)
    single_s = time.monotonic() - began
    diff = max(abs(a - b) for a, b in zip(got, expected, strict=True))
    print(
        f"{layout}: snakemake {took:.0f} s, one process {single_s:.0f} s, "
        f"{len(got)} steps, max |loss diff| {diff:.3g}"
    )
    assert len(got) == len(expected) == spec["optim"]["steps"]
    assert diff < TOLERANCE, log[-2000:]
    UNINTERRUPTED[json.dumps(layout)] = got


# ------------------------------------------------------------------------------ bad requests
def scontrol_job_field(job_id: str, field: str) -> str:
    shown = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True
    )
    return dict(w.split("=", 1) for w in shown.stdout.split() if "=" in w).get(field, "")


def submit(*args: str) -> str:
    submitted = subprocess.run(
        ["sbatch", "--parsable", "-o", "/dev/null", *args, "--wrap", "true"],
        capture_output=True,
        text=True,
    )
    assert submitted.returncode == 0, submitted.stderr  # Slurm accepts the job ...
    return submitted.stdout.strip().split(";")[0]


@pytest.mark.ci
def test_slurm_itself_refuses_or_strands_these_requests(cluster):
    """What the workflow's check guards against, shown on Slurm itself: an unknown partition
    fails at sbatch; a refused account or too many nodes waits in the queue for ever."""
    unknown = subprocess.run(
        ["sbatch", "-p", "nosuch", "--wrap", "true"], capture_output=True, text=True
    )
    assert unknown.returncode != 0 and "invalid partition" in unknown.stderr.lower()
    refused = submit("-p", "restricted", "-A", "other")
    stranded = submit("-p", "single", "-N", "2")
    try:
        time.sleep(3)  # a few scheduling passes: both stay pending, each with its reason
        assert scontrol_job_field(refused, "JobState") == "PENDING"
        assert "account" in scontrol_job_field(refused, "Reason").lower()
        assert scontrol_job_field(stranded, "JobState") == "PENDING"
        assert scontrol_job_field(stranded, "Reason") == "PartitionNodeLimit"
    finally:
        subprocess.run(["scancel", refused, stranded])


@pytest.mark.ci
@pytest.mark.parametrize(
    "settings, named",
    [
        (["cluster.partition=nosuch"], "cluster.partition='nosuch': Slurm has no such partition"),
        (
            ["cluster.partition=restricted", "+cluster.account=other"],
            "cluster.account='other': partition 'restricted' allows only the accounts collapse",
        ),
        (
            ["cluster.partition=single", *layout_overrides(nodes=2, procs=2)],
            "nodes per run: d32-tpp0.5-s0 (2)",
        ),
    ],
    ids=["unknown-partition", "refused-account", "nodes-above-partition-limit"],
)
def test_a_request_slurm_would_refuse_stops_before_submission(cluster, tmp_path, settings, named):
    items = [s for s in settings]
    done = snakemake(tmp_path, "-n", *overrides(*items), timeout=300)
    assert done.returncode != 0
    message = done.stderr + done.stdout
    assert named in message, message[-3000:]
    assert not list((tmp_path / ".snakemake").glob("slurm_logs/**/*.log"))  # nothing submitted


@pytest.mark.ci
def test_a_request_slurm_accepts_passes_the_check(cluster, tmp_path):
    items = ["cluster.partition=single", *layout_overrides(nodes=1, procs=2)]
    done = snakemake(tmp_path, "-n", *overrides(*items), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


# ------------------------------------------------------------------------ requeue, rank failure
def running_train_job() -> str | None:
    running = jobs_of_rule("train", states="RUNNING")
    return running[-1] if running else None


def steps_logged(log: Path) -> int:
    if not log.exists():
        return 0
    return max((int(m) for m in re.findall(r"^step (\d+)/", log.read_text(), re.M)), default=0)


def uninterrupted(layout: dict, tmp_path_factory) -> list[float]:
    key = json.dumps(layout)
    if key not in UNINTERRUPTED:
        workdir = tmp_path_factory.mktemp("uninterrupted")
        done = snakemake(workdir, *overrides(*layout_overrides(**layout)))
        assert done.returncode == 0, done.stderr[-4000:]
        UNINTERRUPTED[key] = losses(workdir / f"results/{FAMILY}/runs/{RUN}")
    return UNINTERRUPTED[key]


def test_requeue_at_a_random_step_resumes_and_ends_on_the_same_curve(
    cluster, tmp_path, tmp_path_factory
):
    """scontrol requeue of the running two-node job: Slurm stops it (SIGTERM, the job saves a
    checkpoint) and starts the same job id again, which resumes from the last checkpoint."""
    expected = uninterrupted(TP2_DP2, tmp_path_factory)
    at_step = random.Random().randint(3, len(expected) - 4)
    print(f"requeue at step {at_step} of {len(expected)}")
    log = tmp_path / f"results/{FAMILY}/logs/train/{RUN}.log"
    args = snakemake_slurm_args(tmp_path, CURVE, "--retries", "0", snakefile=REPO / "Snakefile")
    began = time.monotonic()
    first = start_in_background(
        [*args, *overrides(*layout_overrides(**TP2_DP2))],
        cwd=tmp_path,
        env=snakemake_env(OMP_NUM_THREADS="1"),
    )
    try:
        wait_until(lambda: steps_logged(log) >= at_step, 900, f"step {at_step}", every_s=0.2)
        job = running_train_job()
        assert job, "no running train job"
        requeued = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        assert requeued.returncode == 0, requeued.stderr
        out, _ = first.communicate(timeout=900)
    finally:
        if first.poll() is None:
            first.kill()
    took = time.monotonic() - began
    assert first.returncode == 0, out[-4000:]
    assert scontrol_job_field(job, "Restarts") == "1"
    meta = json.loads((tmp_path / f"results/{FAMILY}/runs/{RUN}/meta.json").read_text())
    (restart,) = meta["restarts"]
    got = losses(tmp_path / f"results/{FAMILY}/runs/{RUN}")
    diff = max(abs(a - b) for a, b in zip(got, expected, strict=True))
    print(
        f"requeued at step {at_step}, resumed from step {restart['step']}; {took:.0f} s; "
        f"max |diff| to the uninterrupted run {diff:.3g}"
    )
    assert 0 < restart["step"] <= at_step + 1
    assert got == expected  # the same layout: bitwise


DP2_ACROSS = dict(nodes=2, procs=2)  # one rank per node


def rank_pids(node: str) -> list[int]:
    """Training ranks (torchrun's workers, which have RANK set) that run on Slurm node ``node``."""
    return training_pids(f"SLURMD_NODENAME={node}", ranks_only=True)


def test_a_rank_killed_on_one_node_fails_the_job_and_the_retry_resumes(cluster, tmp_path):
    """kill -9 of the rank on the second node: its torchrun exits, srun's --kill-on-bad-exit
    ends the first node's ranks, the job fails at once; Snakemake's retry resumes it."""
    from collapse.checkpoint import latest_complete, step_of

    checkpoints = tmp_path / f"results/{FAMILY}/checkpoints/{RUN}"
    args = snakemake_slurm_args(tmp_path, CURVE, "--retries", "1", snakefile=REPO / "Snakefile")
    began = time.monotonic()
    first = start_in_background(
        [*args, *overrides(*layout_overrides(**DP2_ACROSS))],
        cwd=tmp_path,
        env=snakemake_env(OMP_NUM_THREADS="1"),
    )
    try:
        wait_until(
            lambda: checkpoints.is_dir() and latest_complete(checkpoints, log=lambda m: None),
            900,
            "the first checkpoint",
        )
        saved = step_of(latest_complete(checkpoints, log=lambda m: None))
        job = running_train_job()
        victims = rank_pids(f"{HOST}-2")
        assert job and len(victims) == 1, (job, victims)
        subprocess.run(["kill", "-9", str(victims[0])], check=True)
        killed = time.monotonic()
        wait_until(lambda: squeue_state(job) not in ("RUNNING", ""), 300, f"job {job} to end")
        failed_after = time.monotonic() - killed
        assert squeue_state(job) in ("FAILED", "COMPLETING"), squeue_state(job)
        out, _ = first.communicate(timeout=900)
    finally:
        if first.poll() is None:
            first.kill()
    took = time.monotonic() - began
    assert first.returncode == 0, out[-4000:]
    meta = json.loads((tmp_path / f"results/{FAMILY}/runs/{RUN}/meta.json").read_text())
    (restart,) = meta["restarts"]
    got = losses(tmp_path / f"results/{FAMILY}/runs/{RUN}")
    expected = single_process_losses(tmp_path)
    diff = max(abs(a - b) for a, b in zip(got, expected, strict=True))
    print(
        f"rank on {HOST}-2 killed after checkpoint {saved}: job {job} failed "
        f"{failed_after:.1f} s later; retry resumed from step {restart['step']}; whole run "
        f"{took:.0f} s; max |diff| to one process {diff:.3g}"
    )
    assert failed_after < 60
    assert restart["step"] >= saved
    assert diff < TOLERANCE


def test_a_node_that_never_starts_its_launcher_fails_the_job_naming_it(cluster, tmp_path):
    """The second node's slurmd is frozen (SIGSTOP) once the job runs: srun cannot start the
    node's launcher, so it never joins the rendezvous; the job fails, and the log names it."""
    base = Path("/tmp/collapse-slurm/run")
    slurmd_pid = int((base / f"slurmd-{HOST}-2.pid").read_text())
    args = snakemake_slurm_args(tmp_path, CURVE, "--retries", "0", snakefile=REPO / "Snakefile")
    first = start_in_background(
        [*args, *overrides(*layout_overrides(**DP2_ACROSS))],
        cwd=tmp_path,
        env=snakemake_env(OMP_NUM_THREADS="1"),
    )
    stopped = None
    try:
        job = wait_until(running_train_job, 600, "the train job to run", every_s=0.1)
        os.kill(slurmd_pid, signal.SIGSTOP)
        stopped = time.monotonic()
        out, _ = first.communicate(timeout=600)
        failed_after = time.monotonic() - stopped
    finally:
        os.kill(slurmd_pid, signal.SIGCONT)
        if first.poll() is None:
            first.kill()
            subprocess.run(["scancel", job])
    log = (tmp_path / f"results/{FAMILY}/logs/train/{RUN}.log").read_text()
    print(f"job {job} failed {failed_after:.0f} s after {HOST}-2 froze; log: {log[-600:]}")
    assert first.returncode != 0
    assert f"{HOST}-2" in log
    assert failed_after < 300  # 110 s measured, most of it Snakemake noticing the failed job


def test_a_node_missing_from_the_rendezvous_is_named_within_the_configured_timeout(
    cluster, tmp_path
):
    """The second node's slurmd is frozen once the job runs, so its launcher never starts; the
    first node's roll call (collapse.rendezvous) waits cluster.rendezvous_timeout_s, 5 s here
    (Slurm's own launch failure comes after its MessageTimeout, 10 s), then names the node and
    fails the job."""
    base = Path("/tmp/collapse-slurm/run")
    slurmd_pid = int((base / f"slurmd-{HOST}-2.pid").read_text())
    args = snakemake_slurm_args(tmp_path, CURVE, "--retries", "0", snakefile=REPO / "Snakefile")
    settings = [*layout_overrides(**DP2_ACROSS), "+cluster.rendezvous_timeout_s=5"]
    first = start_in_background(
        [*args, *overrides(*settings)], cwd=tmp_path, env=snakemake_env(OMP_NUM_THREADS="1")
    )
    job = None
    try:
        job = wait_until(running_train_job, 600, "the train job to run", every_s=0.1)
        os.kill(slurmd_pid, signal.SIGSTOP)
        froze = time.monotonic()
        wait_until(lambda: squeue_state(job) not in ("RUNNING", ""), 300, f"job {job} to end")
        failed_after = time.monotonic() - froze
    finally:
        os.kill(slurmd_pid, signal.SIGCONT)
        # Slurm counts the frozen node's silence as a node failure and requeues the job
        # (--requeue); it must not run again once the node answers
        if job:
            subprocess.run(["scancel", job])
    try:
        out, _ = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
    log = (tmp_path / f"results/{FAMILY}/logs/train/{RUN}.log").read_text()
    print(f"job {job} ended {failed_after:.0f} s after {HOST}-2 froze; log: {log[-800:]}")
    assert first.returncode != 0
    assert f"launcher on node {HOST}-1 " in log and f"launcher on node {HOST}-2 " not in log
    assert f"rendezvous: node(s) {HOST}-2 did not reach the rendezvous on {HOST}-1" in log, log[
        -3000:
    ]
    assert "within 5 s (cluster.rendezvous_timeout_s)" in log
    assert failed_after < 120


def test_a_hung_rank_fails_the_job_within_the_configured_timeout_naming_it(cluster, tmp_path):
    """The rank on the second node is frozen (SIGSTOP) while it trains: the first node's rank
    waits cluster.distributed_timeout_min (1 min here) in its all-reduce, then a roll call at
    the job's store (collapse.hangs) names the silent rank, its node and pid, and the job fails
    (exit 6)."""
    log_path = tmp_path / f"results/{FAMILY}/logs/train/{RUN}.log"
    args = snakemake_slurm_args(tmp_path, CURVE, "--retries", "0", snakefile=REPO / "Snakefile")
    settings = [*layout_overrides(**DP2_ACROSS), "+cluster.distributed_timeout_min=1"]
    first = start_in_background(
        [*args, *overrides(*settings)], cwd=tmp_path, env=snakemake_env(OMP_NUM_THREADS="1")
    )
    victims: list[int] = []
    try:
        # the rank is found before it trains (28 steps take about a second), frozen at step 2
        victims = wait_until(lambda: rank_pids(f"{HOST}-2"), 900, "the rank on node 2", 0.1)
        job = running_train_job()
        assert job and len(victims) == 1, (job, victims)
        wait_until(lambda: steps_logged(log_path) >= 2, 300, "step 2", every_s=0.01)
        os.kill(victims[0], signal.SIGSTOP)
        frozen = time.monotonic()
        frozen_at = steps_logged(log_path)
        wait_until(lambda: squeue_state(job) not in ("RUNNING", ""), 600, f"job {job} to end")
        failed_after = time.monotonic() - frozen
        out, _ = first.communicate(timeout=600)
    finally:
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if first.poll() is None:
            first.kill()
    log = log_path.read_text()
    named = re.search(r"rank \d \(node (\S+), pid (\d+)\) did not answer within 1 min", log)
    print(
        f"the rank on {HOST}-2 frozen after step {frozen_at}: job {job} failed "
        f"{failed_after:.0f} s later; {named.group(0) if named else log[-1500:]}"
    )
    assert first.returncode != 0
    assert frozen_at < 28
    assert named and named.group(1) == f"{HOST}-2" and int(named.group(2)) == victims[0], log
    assert "a collective found no answer within 1 min (cluster.distributed_timeout_min)" in log
    assert 60 <= failed_after < 240  # the timeout, the roll call's wait, Slurm ending the job


# -------------------------------------------------------------------------------- resharding
DP4 = dict(nodes=2, procs=4)  # TP1 x PP1 x DP4 over the same two nodes


@pytest.mark.parametrize(
    "before, after", [(TP2_DP2, DP4), (PP2_DP2, DP4)], ids=["tp2xdp2-to-tp1xdp4", "pp2-to-pp1"]
)
def test_a_run_checkpointed_at_one_layout_resumes_at_another(cluster, tmp_path, before, after):
    """Cancel the two-node run after a checkpoint, plan it again at another layout: the rerun
    loads the checkpoint through dist_checkpointing, resharded, and continues the curve; both
    parts match one process (the same spec, one rank) within TOLERANCE per step."""
    from collapse.checkpoint import latest_complete, step_of

    checkpoints = tmp_path / f"results/{FAMILY}/checkpoints/{RUN}"
    args = snakemake_slurm_args(tmp_path, CURVE, "--retries", "0", snakefile=REPO / "Snakefile")
    env = snakemake_env(OMP_NUM_THREADS="1")
    first = start_in_background(
        [*args, *overrides(*layout_overrides(**before))], cwd=tmp_path, env=env
    )
    try:
        wait_until(
            lambda: checkpoints.is_dir() and latest_complete(checkpoints, log=lambda m: None),
            900,
            "the first checkpoint",
        )
        job = running_train_job()
        assert job
        subprocess.run(["scancel", job], check=True)
        out, _ = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode != 0, out[-3000:]
    resume_step = step_of(latest_complete(checkpoints, log=lambda m: None))

    began = time.monotonic()
    done = snakemake(tmp_path, *overrides(*layout_overrides(**after)))
    took = time.monotonic() - began
    assert done.returncode == 0, done.stderr[-4000:]
    spec = json.loads((tmp_path / f"results/{FAMILY}/plan/runs/{RUN}.json").read_text())
    assert (spec["parallel"]["tp"], spec["parallel"]["pp"], spec["parallel"]["dp"]) == (1, 1, 4)
    meta = json.loads((tmp_path / f"results/{FAMILY}/runs/{RUN}/meta.json").read_text())
    assert [r["step"] for r in meta["restarts"]] == [resume_step]
    got = losses(tmp_path / f"results/{FAMILY}/runs/{RUN}")
    expected = single_process_losses(tmp_path)
    assert len(got) == len(expected)
    diffs = [abs(a - b) for a, b in zip(got, expected, strict=True)]
    before_cut, after_cut = max(diffs[:resume_step]), max(diffs[resume_step:])
    print(
        f"{before} -> {after}: resumed at step {resume_step} of {len(expected)}, rerun "
        f"{took:.0f} s; max |loss diff| to one process: {before_cut:.3g} before the cut, "
        f"{after_cut:.3g} after resharding"
    )
    assert before_cut < TOLERANCE and after_cut < TOLERANCE
