"""One training job over two Slurm nodes, launched by the workflow's own path.

The local cluster runs two slurmd daemons on this machine (tests/slurm/start_cluster.sh), so a
job of ``--nodes=2`` gets two nodes. ``snakemake --profile slurm`` submits the train rule; its
command (collapse.launch.multinode_command) srun-starts one torchrun per node, and the two
torchruns meet in a c10d rendezvous on the first node; the ranks talk gloo. The curve is
compared, step by step, with the same spec trained by one process outside Slurm.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from slurm.cluster import (
    REPO,
    snakemake_env,
    snakemake_slurm_args,
    start_cluster,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

FAMILY = "smoke"
RUN = "d32-tpp0.5-s0"
CURVE = f"results/{FAMILY}/runs/{RUN}/curve.parquet"
TOLERANCE = 1e-5


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
    [dict(nodes=2, procs=4, tp=2), dict(nodes=2, procs=4, pp=2)],
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
