"""A real local Slurm cluster for the tests (two compute nodes on this machine): start, query, stop.

``start_cluster()`` runs start_cluster.sh (which installs Debian's packages when missing) and
skips the calling test, with the reason, only where that cannot work: not root, or the
packages cannot be installed. A cluster that was already up before the tests is left running.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

SLURM_TEST_DIR = Path(__file__).resolve().parent
REPO = SLURM_TEST_DIR.parents[1]
PROFILE = REPO / "slurm"
START = SLURM_TEST_DIR / "start_cluster.sh"
STOP = SLURM_TEST_DIR / "stop_cluster.sh"
BINARIES = ("slurmctld", "slurmd", "sbatch", "munged")
FAKE_GPUS = 4
NODES = 2  # slurmd daemons on this machine, each its own node (start_cluster.sh)


@dataclass
class Cluster:
    gpus: int  # per node
    started_here: bool  # False: it was up before the tests, so they leave it up
    start_s: float  # wall time of start_cluster.sh
    nodes: int = NODES

    def stop(self) -> None:
        """Stop the daemons and remove the config the tests generated: with /etc/slurm/slurm.conf
        left behind, every later `scontrol show config` (which the Snakemake Slurm plugin runs
        when it loads, in any Snakemake call) waits 9 s for a controller that is gone."""
        if self.started_here:
            subprocess.run([str(STOP), "--purge"], check=True, capture_output=True, text=True)


def cluster_is_up() -> bool:
    if shutil.which("scontrol") is None:
        return False
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    return "is UP" in ping.stdout


def start_cluster(gpus: int = FAKE_GPUS, nodes: int = NODES) -> Cluster:
    if os.geteuid() != 0:
        pytest.skip("a local Slurm needs root (packages, munged, slurmd); run the tests as root")
    if shutil.which("apt-get") is None and not all(shutil.which(b) for b in BINARIES):
        pytest.skip("Slurm is not installed and there is no apt-get to install Debian's packages")
    was_up = cluster_is_up()
    env = dict(os.environ, SLURM_FAKE_GPUS=str(gpus), SLURM_NODES=str(nodes))
    env.pop("SLURM_CONF", None)
    began = time.monotonic()
    started = subprocess.run([str(START)], env=env, capture_output=True, text=True)
    start_s = time.monotonic() - began
    if started.returncode != 0:
        if not all(shutil.which(b) for b in BINARIES):
            pytest.skip(
                "could not install Debian's slurmctld slurmd slurm-client munge: "
                + started.stderr[-500:]
            )
        raise RuntimeError(f"start_cluster.sh failed:\n{started.stderr}")
    return Cluster(gpus=gpus, started_here=not was_up, start_s=start_s, nodes=nodes)


def squeue_state(job_id: str) -> str:
    """The job's state (RUNNING, COMPLETED, ...), or "" once squeue forgot it."""
    out = subprocess.run(
        ["squeue", "-h", "-j", job_id, "--states=all", "-o", "%T"], capture_output=True, text=True
    )
    return out.stdout.strip()


def wait_until(predicate, timeout_s: float, what: str, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_s)
    raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")


def jobs_of_rule(rule: str, states: str = "all") -> list[str]:
    """Ids of the jobs the Snakemake plugin submitted for ``rule`` (it comments them so), in
    ``states`` (squeue's --states). slurmctld recovers finished jobs from its state directory
    when it restarts, so an earlier test session's jobs can still be listed under "all"."""
    out = subprocess.run(
        ["squeue", "-h", f"--states={states}", "-o", "%i %k"], capture_output=True, text=True
    )
    ids = []
    for line in out.stdout.splitlines():
        job_id, _, comment = line.partition(" ")
        if comment == f"rule_{rule}" or comment.startswith(f"rule_{rule}_wildcards_"):
            ids.append(job_id)
    return sorted(ids, key=int)


def training_pids(env_entry: str, *, ranks_only: bool = False) -> list[int]:
    """The training processes (``collapse.train``, not their torchrun launcher) on this machine
    whose environment holds ``env_entry`` (``SLURM_JOB_ID=...``, ``SLURMD_NODENAME=...``);
    ``ranks_only``: torchrun's workers only (RANK set)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        launcher = b"torch.distributed.run" in argv or any(a.endswith(b"torchrun") for a in argv)
        if b"collapse.train" not in argv or launcher or env_entry.encode() not in environ:
            continue
        if not ranks_only or any(e.startswith(b"RANK=") for e in environ):
            pids.append(int(proc.name))
    return pids


def start_in_background(args: list[str], *, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    """A Snakemake call left running while the test acts on its jobs (cancel, requeue, kill);
    its output, stderr included, is read with ``communicate``."""
    return subprocess.Popen(
        args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def snakemake_env(**extra: str) -> dict[str, str]:
    """The environment for a snakemake run: this venv first on PATH (python, torchrun)."""
    env = dict(os.environ, **extra)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("SLURM_CONF", None)
    return env


def snakemake_slurm_args(workdir: Path, *extra: str, snakefile: Path | None = None) -> list[str]:
    """``snakemake --profile <repo>/slurm`` on ``workdir``'s Snakefile, polling often.

    The Snakefile is named explicitly: snakemake looks for one in its working directory, not
    in ``--directory``.
    """
    return [
        sys.executable,
        "-m",
        "snakemake",
        "--profile",
        str(PROFILE),
        "--snakefile",
        str(snakefile or workdir / "Snakefile"),
        "--directory",
        str(workdir),
        # the profile's 40 s wait before the first status check suits a busy real cluster;
        # here it would only slow each job down
        "--slurm-init-seconds-before-status-checks",
        "2",
        "--latency-wait",
        "5",
        *extra,
    ]
