"""Memory per GPU, the parallel layout of a training job, wall time and GPU-hours.

Pure functions over primitives and a ModelArch: the planner picks the cluster numbers out of its
config and calls these once per run.
"""

from __future__ import annotations

from dataclasses import dataclass

from collapse.runspec import ModelArch
from collapse.scaling import param_count

GIB = 2**30
MIN_TOKENS_PER_REPLICA = 32_768


class LayoutError(ValueError):
    """No tensor/pipeline/data-parallel layout fits the model on the cluster."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU on the most loaded pipeline stage."""

    weights: int
    grads: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.activations


@dataclass(frozen=True)
class Layout:
    """How one training job runs: batch_seqs = micro_batch_seqs x grad_accum x dp."""

    tp: int
    pp: int
    dp: int
    micro_batch_seqs: int
    grad_accum: int
    gpus: int  # 0 on the CPU cluster
    nodes: int
    procs_per_node: int
    memory: MemoryEstimate


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def stage_params(arch: ModelArch, params: int, *, pp: int) -> int:
    """Parameters on the largest pipeline stage (before TP sharding).

    Source: Megatron-Core GPTModel: the first stage holds the word (and learned position)
    embeddings, the last the output layer (a tied copy of the word embeddings when pp > 1);
    transformer layers are split evenly.
    """
    counts = param_count(arch)
    positions = counts.breakdown["position_embeddings"]
    words = counts.breakdown["word_embeddings"]
    output = counts.breakdown["output_layer"]
    body = params - counts.embedding  # layers + final norm (params may include vocab padding)
    if pp == 1:
        return params
    first = body // pp + words + positions
    last = body // pp + (output if output else words)
    return max(first, last)


def activation_bytes_per_layer(
    arch: ModelArch, *, micro_batch_seqs: int, tp: int, act_bytes: int, flash_attention: bool
) -> int:
    """Activations one transformer layer keeps for backward, for one micro-batch.

    Source: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models", section 4 (tensor parallel, no sequence parallel): s b h (10 + 24/t) + 5 a s^2 b / t
    bytes for 2-byte activations and a 4h FFN. Generalized here to an FFN width f, an attention
    width heads x head_dim and ``act_bytes``-byte activations (dropout masks 1 byte). With flash
    attention the a s^2 b score terms are not stored.
    """
    s, b, h = arch.seq_len, micro_batch_seqs, arch.d_model
    d_attn, f, heads = arch.n_heads * arch.head_dim, arch.ffn_hidden, arch.n_heads
    e = act_bytes
    # replicated over TP: layernorm inputs (2), attention and FFN inputs, two dropout masks
    replicated = 2 * e * s * b * h + 2 * e * s * b * h + 2 * s * b * h
    # sharded over TP: Q, K, V, attention-output input; FFN hidden (gated FFN keeps 2f + f + f)
    ffn_hidden_values = 4 * f if arch.activation == "swiglu" else 2 * f
    sharded = 4 * e * s * b * d_attn + e * s * b * ffn_hidden_values
    if not flash_attention:  # softmax output, its dropout mask and the dropout output
        sharded += (2 * e + 1) * heads * s * s * b
    return replicated + -(-sharded // tp)


def output_activation_bytes(
    arch: ModelArch, *, micro_batch_seqs: int, tp: int, act_bytes: int
) -> int:
    """Activations of the final norm, output layer and cross entropy (last pipeline stage).

    Source: Korthikanti et al. 2022, section 4.3 (output layer and fp32 cross entropy
    4 s b v / t); the final-norm and output-layer inputs add e s b h each.
    """
    s, b, h, v = arch.seq_len, micro_batch_seqs, arch.d_model, arch.vocab_size
    return 2 * act_bytes * s * b * h + -(-(act_bytes + 4) * s * b * v // tp)


def memory_per_gpu_bytes(
    arch: ModelArch,
    params: int,
    *,
    tp: int,
    pp: int,
    dp: int,
    micro_batch_seqs: int,
    param_bytes: int = 2,
    grad_bytes: int = 4,
    distributed_optimizer: bool = True,
    activation_recompute: bool = False,
    flash_attention: bool = True,
) -> MemoryEstimate:
    """Memory per GPU of a Megatron-Core training job on its most loaded pipeline stage.

    Sources: weights ``param_bytes`` (bf16: 2) and gradients ``grad_bytes`` per parameter
    (Megatron's DDP keeps fp32 main grads for bf16), both sharded over TP and PP; Adam state
    (fp32 master copy when the weights are not fp32, plus m and v: 12 or 8 bytes per parameter)
    sharded over DP by the distributed optimizer (Rajbhandari et al. 2020, ZeRO-1; Megatron-LM
    distributed optimizer docs). Activations per Korthikanti et al. 2022: the first stage of a
    1F1B pipeline holds pp micro-batches in flight of n_layers/pp layers; the last stage holds
    one plus the output layer; full recompute keeps only each layer's input plus one layer.
    ``flash_attention=False`` for Megatron's local (unfused) attention, which stores the scores.
    """
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("micro_batch_seqs", micro_batch_seqs)):
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if arch.n_layers % pp:
        raise ValueError(f"pp={pp} must divide n_layers={arch.n_layers}: pick a divisor")
    on_stage = -(-stage_params(arch, params, pp=pp) // tp)
    weights = on_stage * param_bytes
    grads = on_stage * grad_bytes
    adam_bytes = 8 + (4 if param_bytes < 4 else 0)
    optimizer = on_stage * adam_bytes
    if distributed_optimizer:
        optimizer = -(-optimizer // dp)

    act_bytes = param_bytes
    layer = activation_bytes_per_layer(
        arch,
        micro_batch_seqs=micro_batch_seqs,
        tp=tp,
        act_bytes=act_bytes,
        flash_attention=flash_attention,
    )
    if activation_recompute:  # keep the layer inputs; one layer is rebuilt at a time
        layer_input = act_bytes * arch.seq_len * micro_batch_seqs * arch.d_model
        stored_per_layer, working = layer_input, layer
    else:
        stored_per_layer, working = layer, 0
    layers_per_stage = arch.n_layers // pp
    output = output_activation_bytes(
        arch, micro_batch_seqs=micro_batch_seqs, tp=tp, act_bytes=act_bytes
    )
    first = pp * layers_per_stage * stored_per_layer + working
    last = layers_per_stage * stored_per_layer + working + output
    activations = max(first, last)  # pp == 1: one stage, first + output = last
    return MemoryEstimate(
        weights=weights, grads=grads, optimizer=optimizer, activations=activations
    )


def _data_parallel(
    batch_seqs: int,
    seq_len: int,
    model_parallel: int,
    *,
    gpus_per_node: int,
    max_gpus: int,
    min_tokens_per_replica: int,
) -> int:
    """Largest DP that divides the batch, fills whole nodes and keeps enough tokens per replica.

    Rule (this project): a replica's gradient all-reduce costs ~ its parameters while its compute
    per step grows with the tokens it processes, so the ratio depends on tokens per replica alone;
    at 400 Gb/s links and ~400 TFLOP/s achieved, 32k tokens keep the exchange near 10 % of a step.
    Small models therefore do not spread over a whole cluster.
    """
    best = 1
    for dp in _divisors(batch_seqs):
        gpus = model_parallel * dp
        if gpus > max_gpus:
            break
        if gpus > gpus_per_node and gpus % gpus_per_node:
            continue
        if dp > 1 and batch_seqs // dp * seq_len < min_tokens_per_replica:
            continue
        best = dp
    return best


def choose_layout(
    arch: ModelArch,
    params: int,
    *,
    batch_seqs: int,
    gpus_per_node: int,
    gpu_mem_bytes: int,
    max_nodes: int,
    gpus: int | None = None,
    mem_headroom: float = 0.85,
    max_micro_batch: int = 8,
    min_tokens_per_replica: int = MIN_TOKENS_PER_REPLICA,
    param_bytes: int = 2,
    distributed_optimizer: bool = True,
    activation_recompute: bool = False,
    flash_attention: bool = True,
) -> Layout:
    """The smallest model-parallel layout that fits, data parallel over a reasonable allocation.

    Source: Narayanan et al. 2021 (Megatron-LM, "Efficient Large-Scale Language Model Training"):
    tensor parallel within a node before pipeline parallel across layers. Candidates: TP dividing
    the heads, the GPUs per node and the vocabulary; PP dividing the layers; ordered by TP x PP,
    then less PP. DP: ``gpus // (tp pp)`` when ``gpus`` is fixed, else the largest divisor of the
    batch within ``max_nodes`` whole nodes that keeps ``min_tokens_per_replica`` tokens per
    replica and step. Micro-batch: the largest divisor of the per-replica batch up to
    ``max_micro_batch`` whose memory fits ``mem_headroom`` x ``gpu_mem_bytes``.
    """
    for name, value in (
        ("batch_seqs", batch_seqs),
        ("gpus_per_node", gpus_per_node),
        ("gpu_mem_bytes", gpu_mem_bytes),
        ("max_nodes", max_nodes),
        ("max_micro_batch", max_micro_batch),
    ):
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if gpus is not None and gpus < 1:
        raise ValueError(f"gpus must be a positive integer or None, got {gpus}")
    if not 0 < mem_headroom <= 1:
        raise ValueError(f"mem_headroom must be in (0, 1], got {mem_headroom}")
    max_gpus = gpus if gpus is not None else max_nodes * gpus_per_node
    usable = int(mem_headroom * gpu_mem_bytes)
    candidates = sorted(
        (
            (tp, pp)
            for tp in _divisors(gpus_per_node)
            if arch.n_heads % tp == 0 and arch.vocab_size % tp == 0
            for pp in _divisors(arch.n_layers)
            if tp * pp <= max_gpus
        ),
        key=lambda c: (c[0] * c[1], c[1]),
    )
    smallest_need: tuple[int, str] | None = None
    for tp, pp in candidates:
        if gpus is not None:
            if gpus % (tp * pp) or batch_seqs % (gpus // (tp * pp)):
                continue
            dp = gpus // (tp * pp)
        else:
            dp = _data_parallel(
                batch_seqs,
                arch.seq_len,
                tp * pp,
                gpus_per_node=gpus_per_node,
                max_gpus=max_gpus,
                min_tokens_per_replica=min_tokens_per_replica,
            )
        total_gpus = tp * pp * dp
        if total_gpus > gpus_per_node and total_gpus % gpus_per_node:
            continue
        per_replica = batch_seqs // dp
        for micro in sorted(
            (m for m in _divisors(per_replica) if m <= max_micro_batch), reverse=True
        ):
            memory = memory_per_gpu_bytes(
                arch,
                params,
                tp=tp,
                pp=pp,
                dp=dp,
                micro_batch_seqs=micro,
                param_bytes=param_bytes,
                distributed_optimizer=distributed_optimizer,
                activation_recompute=activation_recompute,
                flash_attention=flash_attention,
            )
            if memory.total <= usable:
                nodes = max(1, total_gpus // gpus_per_node)
                return Layout(
                    tp=tp,
                    pp=pp,
                    dp=dp,
                    micro_batch_seqs=micro,
                    grad_accum=per_replica // micro,
                    gpus=total_gpus,
                    nodes=nodes,
                    procs_per_node=min(total_gpus, gpus_per_node),
                    memory=memory,
                )
            if micro == 1 and (smallest_need is None or memory.total < smallest_need[0]):
                smallest_need = (memory.total, f"tp={tp} pp={pp} dp={dp} micro-batch 1")
    size = (
        f"a {params / 1e9:.2f}B-parameter model (d_model {arch.d_model}, {arch.n_layers} layers, "
        f"{arch.n_heads} heads, seq {arch.seq_len}) with a batch of {batch_seqs} sequences"
    )
    where = f"{max_gpus} GPUs" + ("" if gpus is not None else f" ({max_nodes} nodes)")
    if smallest_need is None:
        raise LayoutError(
            f"no layout of {size} on {where}: no TP dividing {arch.n_heads} heads and "
            f"{gpus_per_node} GPUs per node with PP dividing {arch.n_layers} layers splits the "
            f"batch evenly{'' if gpus is None else f' over exactly {gpus} GPUs'}; fix: choose a "
            "GPU count that is a multiple of the model-parallel size and divides the batch, or a "
            "batch divisible by more GPUs"
        )
    need, at = smallest_need
    raise LayoutError(
        f"{size} does not fit on {where}: at best it needs {need / GIB:.1f} GiB per GPU ({at}) "
        f"against {usable / GIB:.1f} GiB usable ({mem_headroom:.0%} of "
        f"{gpu_mem_bytes / GIB:.0f} GiB); fix: GPUs with more memory, a shorter sequence, "
        "activation recompute (activation_recompute=True), or more nodes (max_nodes)"
    )


def cpu_layout(
    arch: ModelArch,
    params: int,
    *,
    batch_seqs: int,
    procs: int = 1,
    max_micro_batch: int = 8,
    nodes: int = 1,
    tp: int = 1,
    pp: int = 1,
) -> Layout:
    """Layout on the CPU cluster: one gloo process per rank, data parallel unless ``tp``/``pp``.

    Source: FINDINGS.md (TP/PP bring no speed on 2 cores). fp32 weights and activations, local
    (unfused) attention, no distributed optimizer; micro-batch is the largest divisor of the
    per-rank batch up to ``max_micro_batch``. ``procs`` processes split evenly over ``nodes``;
    TP and PP (a fixed choice of the cluster config, to exercise those layouts on CPUs) take
    ``tp x pp`` of them per data-parallel rank.
    """
    for name, value in (("procs", procs), ("nodes", nodes), ("tp", tp), ("pp", pp)):
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if max_micro_batch < 1:
        raise ValueError(f"max_micro_batch must be a positive integer, got {max_micro_batch}")
    if procs % nodes:
        raise LayoutError(
            f"procs_per_run={procs} does not split over nodes_per_run={nodes}: use a multiple"
        )
    if procs % (tp * pp):
        raise LayoutError(f"procs_per_run={procs} is not a multiple of tp x pp = {tp * pp}")
    if arch.n_heads % tp or arch.vocab_size % tp:
        raise LayoutError(f"tp={tp} must divide n_heads={arch.n_heads} and vocab_size")
    if arch.n_layers % pp:
        raise LayoutError(f"pp={pp} must divide n_layers={arch.n_layers}")
    dp = procs // (tp * pp)
    if batch_seqs < 1 or batch_seqs % dp:
        raise LayoutError(
            f"batch_seqs={batch_seqs} does not split over dp={dp} (procs={procs}, tp={tp}, "
            f"pp={pp}): use a batch that is a "
            "multiple of the data-parallel degree, or fewer processes"
        )
    per_proc = batch_seqs // dp
    micro = max(m for m in _divisors(per_proc) if m <= max_micro_batch)
    memory = memory_per_gpu_bytes(
        arch,
        params,
        tp=tp,
        pp=pp,
        dp=dp,
        micro_batch_seqs=micro,
        param_bytes=4,
        grad_bytes=4,
        distributed_optimizer=False,
        flash_attention=False,
    )
    return Layout(
        tp=tp,
        pp=pp,
        dp=dp,
        micro_batch_seqs=micro,
        grad_accum=per_proc // micro,
        gpus=0,
        nodes=nodes,
        procs_per_node=procs // nodes,
        memory=memory,
    )


def gpu_hours(flops: float, peak_flops_per_gpu: float, mfu: float) -> float:
    """GPU-hours = FLOPs / (peak x MFU) / 3600 (model FLOPs utilization as assumed)."""
    if peak_flops_per_gpu <= 0:
        raise ValueError(f"peak_flops_per_gpu must be positive, got {peak_flops_per_gpu}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    return flops / (peak_flops_per_gpu * mfu) / 3600.0


def wall_time_hours(flops: float, gpus: int, peak_flops_per_gpu: float, mfu: float) -> float:
    """Wall-clock hours on ``gpus`` GPUs at the assumed MFU: GPU-hours / gpus."""
    if gpus < 1:
        raise ValueError(f"gpus must be a positive integer, got {gpus}")
    return gpu_hours(flops, peak_flops_per_gpu, mfu) / gpus
