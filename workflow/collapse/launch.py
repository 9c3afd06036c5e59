"""How a training job is started: its shell command and the Slurm resources it asks for.

The train rule calls ``train_command`` for its shell line and ``slurm_resources`` for its
``resources:``; both read only the run's RunSpec (``spec.parallel``, ``spec.resources``).

What snakemake-executor-plugin-slurm 2.8 does with a job (read from its source, checked on a
real Slurm, see tests/test_slurm_cluster.py):

- It submits ``sbatch --nodes=N --gpus=G --cpus-per-task=C --mem=M -t T <slurm_extra>``; with
  ``gpu`` set it adds ``--ntasks-per-gpu`` only when ``tasks_per_gpu`` (or else ``tasks``) is
  >= 1, so ``tasks_per_gpu=0`` keeps the default of one task.
- Inside the allocation the jobstep plugin wraps the job in ``srun -n1 --gpus=G
  --cpus-per-task=C``: the rule's shell command runs once, on the first node, seeing all G
  GPUs. A single-node job therefore starts torchrun itself, never srun.
- With an ``mpi`` resource the jobstep runs the command without that srun, in the batch step
  on the first node, and leaves starting tasks to the command. Multi-node jobs use this: the
  command is ``srun`` (one task per node) around ``torchrun`` with a c10d rendezvous on the
  first node. The jobstep strips every SLURM_* variable but the job id from the command's
  environment; srun finds the allocation through SLURM_JOB_ID and sets the node list again
  in each task.

Signals: Slurm sends SIGTERM to every process of the job at its time limit, on preemption and
on ``scancel``, and SIGKILL KillWait seconds later. Snakemake's own processes in the job treat
SIGTERM gracefully (they wait for the job's command), so the training process has that grace
to write its checkpoint. ``--signal=TERM@S`` sends the same SIGTERM S seconds before the time
limit, so a long checkpoint save fits. SIGUSR1 is not used: it kills the Snakemake process
that wraps the command (its default action), which ends the job step under the training
process while it saves. The training job exits non-zero after such a checkpoint; the profile's
``retries`` (time limit, cancel) or Slurm's ``--requeue`` (preemption) start it again and it
resumes from ``spec.checkpoint_dir``.
"""

from __future__ import annotations

import shlex
from typing import Literal

from collapse.runspec import RunSpec

Executor = Literal["local", "slurm"]

TRAIN_MODULE = "collapse.train"
# first rendezvous port; each job adds its id modulo RDZV_PORT_SPAN, so that two multi-node
# jobs whose first node is the same do not collide
RDZV_PORT_BASE = 20000
RDZV_PORT_SPAN = 10000
# the roll call before torchrun (collapse.rendezvous) listens on the port above torchrun's range
ROLL_CALL_PORT_BASE = RDZV_PORT_BASE + RDZV_PORT_SPAN
# the lead of the early SIGTERM before the time limit: a tenth of the run time, within these
# bounds (Slurm delivers --signal with a resolution of about 60 s)
SIGNAL_LEAD_MIN_S = 60
SIGNAL_LEAD_MAX_S = 600


def signal_lead_s(runtime_min: int) -> int:
    """Seconds before a job's time limit that Slurm sends the early SIGTERM (``--signal``)."""
    runtime_s = runtime_min * 60
    return min(SIGNAL_LEAD_MAX_S, max(SIGNAL_LEAD_MIN_S, runtime_s // 10), runtime_s // 2)


def train_command(
    spec: RunSpec, spec_path: str, *, executor: Executor, segment: int | None = None
) -> str:
    """The shell command that trains ``spec`` (read from ``spec_path``) under ``executor``.

    One process: ``python -m collapse.train``; several processes on one node (CPU/gloo ranks or
    one per GPU): ``torchrun --standalone``; several nodes (Slurm only): srun + torchrun.
    ``segment``: the job trains that segment of a run cut by its time limit (collapse.segments).
    """
    check_parallel(spec)
    p = spec.parallel
    if executor not in ("local", "slurm"):
        raise ValueError(f"executor={executor!r}: use 'local' or 'slurm'")
    if p.nodes > 1 and executor != "slurm":
        raise ValueError(
            f"run {spec.run}: parallel.nodes={p.nodes} needs the Slurm executor; run with "
            "--profile slurm, or plan the family for a single node (a cluster config with "
            "one node per run)"
        )
    args = ["--spec", spec_path]
    if segment is not None:
        args += ["--segment", str(segment)]
    if p.nodes > 1:
        return multinode_command(
            TRAIN_MODULE,
            args,
            nodes=p.nodes,
            procs_per_node=p.procs_per_node,
            cpus_per_task=spec.resources.threads,
            rendezvous_timeout_s=spec.resources.rendezvous_timeout_s,
        )
    return single_node_command(
        TRAIN_MODULE, args, procs=p.procs_per_node, threads=spec.resources.threads
    )


def single_node_command(
    module: str, args: list[str], *, procs: int, threads: int | None = None
) -> str:
    """Run ``python -m module args`` as ``procs`` processes on this node; with ``threads``
    (the job's), each process gets its share as OMP_NUM_THREADS, since Snakemake exports the
    job's whole count and every rank would take all of it."""
    tail = shlex.join(["-m", module, *args])
    if procs == 1:
        return f"python {tail}"
    share = "" if threads is None else f"OMP_NUM_THREADS={max(1, threads // procs)} "
    # --standalone: a private rendezvous on a free local port, so parallel jobs never collide
    return f"{share}torchrun --standalone --nnodes=1 --nproc_per_node={procs} {tail}"


def multinode_command(
    module: str,
    args: list[str],
    *,
    nodes: int,
    procs_per_node: int,
    cpus_per_task: int,
    rendezvous_timeout_s: int = 300,
) -> str:
    """srun one torchrun per node of the current allocation; they meet on its first node.

    Must run inside the allocation (the batch step, as the jobstep plugin's ``mpi`` mode
    does); ``$SLURM_JOB_NODELIST`` and ``$SLURM_JOB_ID`` are read in each srun task.

    Each node's launcher first answers a roll call on the first node (collapse.rendezvous),
    which names the nodes that do not arrive within ``rendezvous_timeout_s``; torchrun's own
    rendezvous then gets the same ``join_timeout``. Each rank gets ``cpus_per_task //
    procs_per_node`` threads (OMP_NUM_THREADS): Snakemake sets the rule's threads, the whole
    node's, which every rank would otherwise take.
    """
    # the rendezvous host is the first node's NodeAddr, the address Slurm itself reaches it at
    # (a NodeName need not resolve, e.g. several slurmd on one host); its name where unset
    first_node = (
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1); '
        'addr=$(scontrol -o show node "$head" 2>/dev/null | grep -o "NodeAddr=[^ ]*" '
        "| cut -d= -f2); "
        "head=${addr:-$head}"
    )
    port = (
        f"port=$(({RDZV_PORT_BASE} + SLURM_JOB_ID % {RDZV_PORT_SPAN})); "
        f"roll_port=$(({ROLL_CALL_PORT_BASE} + SLURM_JOB_ID % {RDZV_PORT_SPAN}))"
    )
    me = 'me="${SLURMD_NODENAME:-$(hostname)}"'
    # one line per node in the job's log: which node's launcher started, and where it joins
    announce = (
        f'echo "launcher on node $me (node $((SLURM_NODEID + 1)) of {nodes}): joining the '
        f'rendezvous at $head:$port (timeout {rendezvous_timeout_s} s)" >&2'
    )
    roll_call = (
        'python -m collapse.rendezvous --node "$me" --nodes "$(scontrol show hostnames '
        '"$SLURM_JOB_NODELIST" | paste -sd, -)" --head "$head" --port "$roll_port" '
        f"--timeout {rendezvous_timeout_s} || exit $?"
    )
    threads = f"export OMP_NUM_THREADS={max(1, cpus_per_task // procs_per_node)}"
    torchrun = (
        f"torchrun --nnodes={nodes} --nproc_per_node={procs_per_node} "
        '--rdzv_backend=c10d --rdzv_id="$SLURM_JOB_ID" --rdzv_endpoint="$head:$port" '
        f"--rdzv_conf=join_timeout={rendezvous_timeout_s} " + shlex.join(["-m", module, *args])
    )
    per_node = "; ".join([first_node, port, me, announce, roll_call, threads, f"exec {torchrun}"])
    srun = (
        f"srun --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 "
        f"--cpus-per-task={cpus_per_task} --kill-on-bad-exit=1"
    )
    return f"{srun} bash -c {shlex.quote(per_node)}"


def slurm_resources(spec: RunSpec) -> dict[str, int | str | None]:
    """The Snakemake resources (names of snakemake-executor-plugin-slurm 2.8) of the train job.

    The keys are the same for every run, so a rule can declare each one with a callable; a
    value of None leaves the resource unset (Snakemake drops it). Memory and CPUs are per node.
    """
    check_parallel(spec)
    p, r = spec.parallel, spec.resources
    multinode = p.nodes > 1
    gpus_per_node = r.gpus_per_node if p.gpus > 0 else 0
    lead_s = signal_lead_s(r.runtime_min)
    # --requeue: preemption puts the job back in the queue (it resumes from its checkpoint);
    # --open-mode=append: the requeued job appends to its Slurm log instead of truncating it
    extra = f"--requeue --open-mode=append --signal=TERM@{lead_s}"
    return {
        "nodes": p.nodes,
        # single node: the plugin's one srun task runs torchrun over all GPUs; several nodes:
        # the command's own srun starts one task per node (see multinode_command)
        "tasks": p.nodes,
        "tasks_per_gpu": 0,  # keeps the plugin from passing --ntasks-per-gpu
        "mpi": "srun" if multinode else None,
        # --gpus=G counts GPUs of the whole job; per node the gres form is exact
        "gpu": gpus_per_node if not multinode and gpus_per_node else None,
        "gres": f"gpu:{gpus_per_node}" if multinode and gpus_per_node else None,
        "cpus_per_task": r.threads,
        "mem_mb": r.mem_mb,
        "runtime": r.runtime_min,
        "slurm_partition": r.slurm_partition or None,
        "slurm_account": r.slurm_account or None,
        "slurm_extra": extra,
    }


def sbatch_request(spec: RunSpec) -> str:
    """The sbatch options the Slurm plugin will submit the train job with, for the plan's report.

    Mirrors the plugin's submit string for the resources of ``slurm_resources`` (job name,
    log file and the wrapped command left out); an empty partition or account shows as the
    cluster's default.
    """
    res = slurm_resources(spec)
    words = []
    if res["slurm_account"]:
        words.append(f"-A {res['slurm_account']}")
    words.append(f"-p {res['slurm_partition'] or '<default>'}")
    words += [f"-t {res['runtime']}", f"--mem {res['mem_mb']}", f"--nodes={res['nodes']}"]
    if res["mpi"] or not (res["gpu"] or res["gres"]):
        words.append(f"--ntasks={res['tasks']}")
    words.append(f"--cpus-per-task={res['cpus_per_task']}")
    words.append(str(res["slurm_extra"]))
    if res["gres"]:
        words.append(f"--gres={res['gres']}")
    if res["gpu"]:
        words.append(f"--gpus={res['gpu']}")
    return "sbatch " + " ".join(words)


def check_parallel(spec: RunSpec) -> None:
    """Fail early, naming the field, where the spec's parallel and resources blocks disagree."""
    p, r = spec.parallel, spec.resources
    where = f"run {spec.run}"
    for name, value in (("parallel.nodes", p.nodes), ("parallel.procs_per_node", p.procs_per_node)):
        if value < 1:
            raise ValueError(f"{where}: {name}={value} must be >= 1")
    world = p.tp * p.pp * p.dp
    if p.nodes * p.procs_per_node != world:
        raise ValueError(
            f"{where}: parallel.nodes x parallel.procs_per_node = {p.nodes} x "
            f"{p.procs_per_node} but tp x pp x dp = {world}; one process per rank is needed"
        )
    if r.nodes != p.nodes:
        raise ValueError(
            f"{where}: resources.nodes={r.nodes} but parallel.nodes={p.nodes}; make them equal"
        )
    if p.gpus > 0:
        if p.gpus != p.nodes * p.procs_per_node:
            raise ValueError(
                f"{where}: parallel.gpus={p.gpus} but {p.nodes} node(s) x "
                f"{p.procs_per_node} process(es); one GPU per process is needed"
            )
        if r.gpus_per_node != p.procs_per_node:
            raise ValueError(
                f"{where}: resources.gpus_per_node={r.gpus_per_node} but "
                f"parallel.procs_per_node={p.procs_per_node}; request one GPU per process"
            )
    if r.runtime_min < 1:
        raise ValueError(f"{where}: resources.runtime_min={r.runtime_min} must be >= 1")
