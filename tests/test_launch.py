"""The training job's shell command and Slurm resources (collapse.launch), without a cluster."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from slurm.runspecs import make_spec

from collapse.launch import (
    multinode_command,
    sbatch_request,
    single_node_command,
    slurm_resources,
    train_command,
)

SLURM_TEST_DIR = Path(__file__).parent / "slurm"


SPEC_PATH = "results/tiny/plan/runs/d128.json"


def test_one_process_runs_python_directly():
    spec = make_spec()
    for executor in ("local", "slurm"):
        command = train_command(spec, SPEC_PATH, executor=executor)
        assert command == f"python -m collapse.train --spec {SPEC_PATH}"


def test_cpu_ranks_on_one_node_run_under_torchrun_standalone():
    spec = make_spec(dp=2, procs_per_node=2, threads=2)
    command = train_command(spec, "plan dir/d128.json", executor="local")
    assert shlex.split(command) == [
        "OMP_NUM_THREADS=1",  # each rank its share of the job's 2 threads, not both
        "torchrun",
        "--standalone",
        "--nnodes=1",
        "--nproc_per_node=2",
        "-m",
        "collapse.train",
        "--spec",
        "plan dir/d128.json",
    ]


def test_single_node_gpus_one_torchrun_and_one_slurm_task():
    spec = make_spec(tp=2, dp=2, gpus=4, procs_per_node=4, gpus_per_node=4, threads=16)
    command = train_command(spec, SPEC_PATH, executor="slurm")
    assert command.split()[:5] == [
        "OMP_NUM_THREADS=4", "torchrun", "--standalone", "--nnodes=1", "--nproc_per_node=4"
    ]  # fmt: skip
    assert "srun" not in command  # the jobstep plugin already runs the command in one srun task
    resources = slurm_resources(spec)
    assert resources["gpu"] == 4 and resources["gres"] is None
    assert resources["tasks_per_gpu"] == 0  # else the plugin may ask for one task per GPU
    assert resources["nodes"] == 1 and resources["tasks"] == 1
    assert resources["mpi"] is None  # its mere presence would drop the jobstep's srun
    assert resources["cpus_per_task"] == 16
    assert resources["mem_mb"] == 16000 and resources["runtime"] == 60


def test_multinode_srun_starts_one_torchrun_per_node_with_c10d_rendezvous():
    spec = make_spec(tp=8, dp=4, gpus=32, nodes=4, procs_per_node=8, gpus_per_node=8, threads=64)
    command = train_command(spec, SPEC_PATH, executor="slurm")
    words = shlex.split(command)
    assert words[:6] == [
        "srun",
        "--nodes=4",
        "--ntasks=4",
        "--ntasks-per-node=1",
        "--cpus-per-task=64",
        "--kill-on-bad-exit=1",
    ]
    assert words[6:8] == ["bash", "-c"] and len(words) == 9
    per_node = words[8]
    assert per_node.count("torchrun") == 1
    assert "--nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d" in per_node
    assert '--rdzv_endpoint="$head:$port"' in per_node
    assert f"-m collapse.train --spec {SPEC_PATH}" in per_node
    # the cluster's rendezvous timeout, for the roll call and torchrun; 64 threads / 8 ranks
    assert "--timeout 300 || exit $?" in per_node and "--rdzv_conf=join_timeout=300" in per_node
    assert "export OMP_NUM_THREADS=8; exec torchrun" in per_node
    resources = slurm_resources(spec)
    assert resources["mpi"] == "srun" and resources["tasks"] == 4 and resources["nodes"] == 4
    assert resources["gres"] == "gpu:8" and resources["gpu"] is None  # per node, not per job
    assert resources["tasks_per_gpu"] == 0


def test_multinode_per_node_script_finds_the_first_node_and_a_port(tmp_path):
    """Run the per-node script under bash with scontrol and torchrun replaced by stubs: the
    rendezvous is at the first node's NodeAddr (how Slurm reaches it), on a port of the job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -o ]; then echo "NodeName=$4 Arch=x86_64 NodeAddr=10.1.0.17 State=ALLOC"; '
        "else echo gpu017; echo gpu018; fi\n"
    )
    (bin_dir / "torchrun").write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    # the roll call before torchrun (collapse.rendezvous, tested on its own): its arguments
    (bin_dir / "python").write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/roll_call"\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    command = multinode_command(
        "collapse.train", ["--spec", SPEC_PATH], nodes=2, procs_per_node=8, cpus_per_task=4
    )
    per_node = shlex.split(command)[-1]
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="12345")
    env.update(SLURM_JOB_NODELIST="gpu[017-018]", SLURMD_NODENAME="gpu018", SLURM_NODEID="1")
    out = subprocess.run(["bash", "-c", per_node], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    args = out.stdout.split()
    assert "--rdzv_endpoint=10.1.0.17:22345" in args  # the first node's NodeAddr
    assert "--rdzv_id=12345" in args
    assert args[-4:] == ["-m", "collapse.train", "--spec", SPEC_PATH]
    assert "--rdzv_conf=join_timeout=300" in args  # the cluster's rendezvous_timeout_s
    roll_call = (bin_dir / "roll_call").read_text().split()
    assert roll_call[:2] == ["-m", "collapse.rendezvous"]
    assert roll_call[2:] == [
        "--node", "gpu018", "--nodes", "gpu017,gpu018", "--head", "10.1.0.17",
        "--port", "32345", "--timeout", "300",
    ]  # fmt: skip
    assert "launcher on node gpu018 (node 2 of 2): joining the rendezvous at 10.1.0.17:22345" in (
        out.stderr
    )


def test_multinode_needs_slurm():
    spec = make_spec(dp=2, nodes=2, procs_per_node=1)
    with pytest.raises(ValueError, match="parallel.nodes=2 needs the Slurm executor"):
        train_command(spec, SPEC_PATH, executor="local")


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"dp": 2, "procs_per_node": 1}, "parallel.procs_per_node"),
        ({"dp": 2, "procs_per_node": 2, "gpus": 2, "gpus_per_node": 1}, "gpus_per_node"),
        ({"dp": 2, "procs_per_node": 2, "gpus": 4, "gpus_per_node": 2}, "parallel.gpus=4"),
        ({"runtime_min": 0}, "resources.runtime_min"),
    ],
)
def test_inconsistent_specs_fail_naming_the_field(overrides, field):
    spec = make_spec(**overrides)
    with pytest.raises(ValueError, match=field):
        slurm_resources(spec)


def test_resources_carry_partition_account_and_signal_before_the_time_limit():
    spec = make_spec(runtime_min=240, partition="gpu", account="proj42")
    resources = slurm_resources(spec)
    assert resources["slurm_partition"] == "gpu" and resources["slurm_account"] == "proj42"
    extra = resources["slurm_extra"].split()
    assert "--requeue" in extra
    assert "--signal=TERM@600" in extra  # a tenth of 4 h, capped at 10 min
    assert slurm_resources(make_spec(runtime_min=20))["slurm_extra"].endswith("TERM@120")
    assert slurm_resources(make_spec(runtime_min=2))["slurm_extra"].endswith("TERM@60")
    # empty partition/account: unset, so the plugin takes the cluster's defaults
    assert slurm_resources(make_spec())["slurm_partition"] is None


def test_torchrun_standalone_command_starts_exactly_the_ranks_asked_for(tmp_path):
    """The single-node command, run for real with two gloo ranks of a probe module."""
    command = single_node_command("dist_probe", ["--out", str(tmp_path)], procs=2)
    env = dict(os.environ, PYTHONPATH=str(SLURM_TEST_DIR), OMP_NUM_THREADS="1")
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    run = subprocess.run(command, shell=True, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert [r["rank"] for r in records] == [0, 1]
    assert all(r["world"] == 2 and r["all_reduce_sum"] == 2.0 for r in records)


def test_sbatch_request_shows_what_the_plugin_submits():
    single = make_spec(tp=2, dp=2, gpus=4, procs_per_node=4, gpus_per_node=4, threads=16)
    assert sbatch_request(single) == (
        "sbatch -p <default> -t 60 --mem 16000 --nodes=1 --cpus-per-task=16 "
        "--requeue --open-mode=append --signal=TERM@360 --gpus=4"
    )
    multi = make_spec(
        tp=8,
        dp=4,
        gpus=32,
        nodes=4,
        procs_per_node=8,
        gpus_per_node=8,
        threads=64,
        partition="gpu",
        account="proj42",
    )
    request = sbatch_request(multi)
    assert request.startswith("sbatch -A proj42 -p gpu -t 60 --mem 16000 --nodes=4 --ntasks=4 ")
    assert request.endswith("--gres=gpu:8")
    cpu = sbatch_request(make_spec())
    assert "--ntasks=1" in cpu and "gpu" not in cpu


def test_multinode_launcher_stops_before_torchrun_when_the_roll_call_fails(tmp_path):
    """A node missing from the roll call (collapse.rendezvous exits 1): the launcher exits with
    its code and never starts torchrun, so srun's --kill-on-bad-exit ends the job at once."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho gpu017; echo gpu018\n")
    (bin_dir / "python").write_text("#!/bin/sh\nexit 1\n")
    (bin_dir / "torchrun").write_text('#!/bin/sh\ntouch "$(dirname "$0")/torchrun_ran"\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    spec = make_spec(dp=4, nodes=2, procs_per_node=2, threads=4)
    resources = spec.resources.model_copy(update={"rendezvous_timeout_s": 42})
    spec = spec.model_copy(update={"resources": resources})
    per_node = shlex.split(train_command(spec, SPEC_PATH, executor="slurm"))[-1]
    assert "--timeout 42 " in per_node and "join_timeout=42" in per_node
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="7")
    env.update(SLURM_JOB_NODELIST="gpu[017-018]", SLURMD_NODENAME="gpu017", SLURM_NODEID="0")
    out = subprocess.run(["bash", "-c", per_node], env=env, capture_output=True, text=True)
    assert out.returncode == 1
    assert not (bin_dir / "torchrun_ran").exists()


def test_the_cluster_config_sets_both_distributed_timeouts_of_every_run():
    from collapse.config import ConfigError, load_config
    from collapse.plan import plan_family
    from collapse.runspec import RunSpec

    default = plan_family(load_config(["family=smoke", "cluster=slurm_h100"]))
    assert {(r.resources.rendezvous_timeout_s, r.resources.distributed_timeout_min)
            for r in default.runs} == {(300, 10)}  # fmt: skip
    cfg = load_config(
        ["family=smoke", "cluster=slurm_h100", "cluster.rendezvous_timeout_s=42",
         "cluster.distributed_timeout_min=3"]
    )  # fmt: skip
    plan = plan_family(cfg)
    assert {(r.resources.rendezvous_timeout_s, r.resources.distributed_timeout_min)
            for r in plan.runs} == {(42, 3)}  # fmt: skip
    # at their defaults they are left out of the spec, whose hash (the rerun trigger) stays
    # what it was before they were settings; a spec read back gets the defaults again
    assert all('"rendezvous_timeout_s"' not in r.to_json() for r in default.runs)
    assert all('"distributed_timeout_min": 3' in r.to_json() for r in plan.runs)
    back = RunSpec.model_validate_json(default.runs[0].to_json())
    assert (back.resources.rendezvous_timeout_s, back.resources.distributed_timeout_min) == (
        300,
        10,
    )
    for key in ("rendezvous_timeout_s", "distributed_timeout_min"):
        with pytest.raises(ConfigError, match=rf"cluster\.{key}"):
            load_config(["family=smoke", "cluster=slurm_h100", f"cluster.{key}=0"])
