"""The Slurm profile and launcher against a real single-node Slurm (Debian's packages).

The cluster declares fake GPUs (character devices in gres.conf), so GPU requests schedule and
jobs get CUDA_VISIBLE_DEVICES; the probe processes use gloo, not CUDA.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from slurm.cluster import (
    SLURM_TEST_DIR,
    jobs_of_rule,
    snakemake_env,
    snakemake_slurm_args,
    squeue_state,
    start_cluster,
    start_in_background,
    wait_until,
)
from slurm.runspecs import make_spec

from collapse.launch import single_node_command, slurm_resources

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def cluster():
    started = start_cluster()
    print(f"start_cluster.sh took {started.start_s:.1f} s")
    yield started
    started.stop()


def run(*cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def test_sbatch_and_srun_run_jobs(cluster, tmp_path):
    out = tmp_path / "batch.out"
    batch = run("sbatch", "--wait", "-o", str(out), "--wrap", "echo batch-on-$SLURMD_NODENAME")
    assert batch.returncode == 0, batch.stderr
    assert out.read_text().startswith("batch-on-")
    step = run("srun", "-n1", "echo", "step-ran")
    assert step.returncode == 0 and step.stdout.strip() == "step-ran", step.stderr


def test_gpu_requests_get_devices_and_counts_are_enforced(cluster):
    two = run("srun", "--gpus=2", "printenv", "CUDA_VISIBLE_DEVICES")
    assert two.returncode == 0, two.stderr
    assert len(two.stdout.strip().split(",")) == 2
    too_many = run("srun", "--nodes=1", f"--gpus={cluster.gpus + 1}", "true", timeout=30)
    assert too_many.returncode != 0
    assert "Requested node configuration is not available" in too_many.stderr


def write_workflow(workdir: Path, rules: str) -> None:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "Snakefile").write_text(textwrap.dedent(rules))


def as_resources(resources: dict) -> str:
    """A rule's ``resources:`` lines for the set values of a slurm_resources() dict."""
    return ", ".join(f"{k}={v!r}" for k, v in resources.items() if v is not None)


def test_workflow_runs_through_the_repo_profile_one_launcher_per_gpu_job(cluster, tmp_path):
    """A GPU rule with the launcher's resources and command: 2 ranks, not 2 tasks x 2 ranks."""
    spec = make_spec(dp=2, gpus=2, procs_per_node=2, gpus_per_node=2, threads=1, runtime_min=5)
    resources = dict(slurm_resources(spec), mem_mb=2000)
    probe = single_node_command("dist_probe", ["--out", "ranks"], procs=2)
    write_workflow(
        tmp_path,
        f"""
        rule all:
            input: "report.txt"

        rule prepare:
            output: "prepared.txt"
            shell: "echo prepared on $(hostname) > {{output}}"

        rule train:
            input: "prepared.txt"
            output: directory("ranks")
            resources: {as_resources(resources)}
            shell: "{probe}"

        rule report:
            input: "ranks"
            output: "report.txt"
            shell: "ls {{input}} > {{output}}"
        """,
    )
    env = snakemake_env(PYTHONPATH=str(SLURM_TEST_DIR), OMP_NUM_THREADS="1")
    began = time.monotonic()
    done = subprocess.run(
        snakemake_slurm_args(tmp_path, "--retries", "0"),
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(f"3-rule workflow through the profile: {time.monotonic() - began:.0f} s")
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads(p.read_text()) for p in sorted((tmp_path / "ranks").glob("*.json"))]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["world"] == 2 and r["all_reduce_sum"] == 2.0 for r in ranks)
    assert all(len(r["cuda_visible_devices"].split(",")) == 2 for r in ranks)
    (train_job,) = jobs_of_rule("train")[-1:]
    shown = run("scontrol", "show", "job", train_job).stdout
    assert "TresPerJob=gres:gpu:2" in shown
    assert "NumTasks=1" in shown
    assert "TimeLimit=00:05:00" in shown
    assert len(jobs_of_rule("prepare")) >= 1  # the CPU rule went through Slurm as well


COUNTER = '''\
"""Count to STEPS, one step per 0.5 s, with a checkpoint outside the rule's outputs."""
import json, signal, sys, time
from pathlib import Path

out, ckpt, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
state = json.loads(ckpt.read_text()) if ckpt.exists() else {"step": 0, "starts": []}
state["starts"].append(state["step"])

def save():
    tmp = ckpt.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(ckpt)

def on_term(signum, frame):
    save()  # the grace between SIGTERM and SIGKILL
    sys.exit(1)

signal.signal(signal.SIGTERM, on_term)
while state["step"] < steps:
    time.sleep(0.5)
    state["step"] += 1
    save()
out.write_text(json.dumps(state))
'''


@pytest.mark.slow  # 77 s; CI's family test cancels and resumes real training instead
def test_scancel_of_a_running_job_then_rerun_resumes_from_its_checkpoint(cluster, tmp_path):
    (tmp_path / "counter.py").write_text(COUNTER)
    checkpoint = tmp_path / "checkpoints" / "count.json"
    checkpoint.parent.mkdir()
    write_workflow(
        tmp_path,
        f"""
        rule count:
            output: "counted.json"
            resources: runtime=5, mem_mb=500
            shell: "python counter.py {{output}} {checkpoint} 30"
        """,
    )
    env = snakemake_env()
    first = start_in_background(
        snakemake_slurm_args(tmp_path, "--retries", "0"), cwd=tmp_path, env=env
    )
    try:
        wait_until(
            lambda: checkpoint.exists() and json.loads(checkpoint.read_text())["step"] >= 4,
            120,
            "the counter to pass step 4",
        )
        (job,) = jobs_of_rule("count", states="RUNNING")
        assert run("scancel", job).returncode == 0
        wait_until(lambda: squeue_state(job) in ("CANCELLED", ""), 60, f"job {job} to end")
        log, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode != 0, log[-2000:]
    assert not (tmp_path / "counted.json").exists()
    cancelled_at = json.loads(checkpoint.read_text())["step"]
    assert 4 <= cancelled_at < 30

    rerun = subprocess.run(
        snakemake_slurm_args(tmp_path, "--retries", "0"),
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    final = json.loads((tmp_path / "counted.json").read_text())
    assert final["step"] == 30
    assert final["starts"] == [0, cancelled_at]  # the second start resumed, it did not restart
