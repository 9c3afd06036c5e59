"""The parallel layout of a training job, its estimated step time, wall time and GPU-hours.

Pure functions over primitives and a ModelArch: the planner picks the cluster numbers out of its
config and calls these once per size. Memory per GPU comes from ``collapse.memory``.
"""

from __future__ import annotations

from dataclasses import dataclass

from collapse import memory
from collapse.memory import GIB, MemoryEstimate
from collapse.runspec import ModelArch

__all__ = ["GIB", "Layout", "LayoutError", "MemoryEstimate", "choose_layout", "cpu_layout"]


class LayoutError(ValueError):
    """No tensor/pipeline/data-parallel layout fits the model on the cluster."""


@dataclass(frozen=True)
class Network:
    """The throughput model's facts about a GPU cluster (its config's names)."""

    peak_flops: float  # dense bf16 FLOP/s per GPU
    mfu: float  # model FLOPs utilization of one GPU without communication or pipeline bubble
    tp_bandwidth_gbs: float = 300.0  # all-reduce bus bandwidth within a node, GB/s per GPU
    dp_bandwidth_gbs: float = 40.0  # between nodes, GB/s per GPU
    min_dp_efficiency: float = 0.8  # compute / (compute + gradient exchange), per replica
    min_efficiency: float = 0.6  # estimated over ideal speed: the GPU-hours traded for speed
    latency_s: float = 25e-6  # per collective or pipeline send (NCCL, small messages)


@dataclass(frozen=True)
class Candidate:
    """One layout the search considered: its shape, memory and estimated step time."""

    tp: int
    pp: int
    dp: int
    micro_batch_seqs: int
    sp: bool
    recompute: str
    memory: MemoryEstimate
    step_seconds: float  # estimated time of one optimizer step
    efficiency: float  # ideal step time (all GPUs at the assumed MFU) / estimated step time
    dp_efficiency: float

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def describe(self) -> str:
        extra = (" sp" if self.sp else "") + (
            f" recompute={self.recompute}" if self.recompute != "none" else ""
        )
        return f"tp={self.tp} pp={self.pp} dp={self.dp} micro-batch {self.micro_batch_seqs}{extra}"


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
    sequence_parallel: bool = False
    recompute: str = "none"  # none | selective | full (Megatron's recompute_granularity)
    efficiency: float = 1.0  # wall time = GPU-hours at the assumed MFU / gpus / efficiency
    step_seconds: float = 0.0
    runners_up: tuple[Candidate, ...] = ()
    limit: str = ""  # why the run does not take more GPUs


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def step_time(
    arch: ModelArch,
    net: Network,
    *,
    flops_per_token: float,
    batch_seqs: int,
    tp: int,
    pp: int,
    dp: int,
    micro_batch_seqs: int,
    recompute: str,
    params_on_rank: int,
    gpus_per_node: int,
) -> tuple[float, float]:
    """Seconds per optimizer step and the data-parallel efficiency of a layout.

    The throughput model of NeMo's auto-configurator, reduced to its terms: compute at the
    assumed MFU, slowed by the 1F1B pipeline bubble (p - 1) / (m + p - 1) (Narayanan et al. 2021)
    and by recomputation (full: one more forward, +1/3; selective: the core attention's forward
    again); tensor-parallel all-reduces, 4 per layer and micro-batch of s b h bf16 values (6 with
    full recompute; Korthikanti et al. 2022, section 3), 2 (t - 1) / t of them over the node's
    links; pipeline sends of s b h values per micro-batch both ways; the distributed optimizer's
    reduce-scatter of fp32 gradients and all-gather of bf16 weights, (dp - 1) / dp x 6 bytes per
    parameter, over the nodes' links when the replicas span nodes; ``latency_s`` per collective
    and send. Nothing overlaps (Megatron's communication overlap is off in training), so the
    estimate errs slow. Data-parallel efficiency: the step without recompute's extra work over
    the step plus the gradient exchange.
    """
    gpus = tp * pp * dp
    tokens = batch_seqs * arch.seq_len
    ideal = flops_per_token * tokens / (gpus * net.peak_flops * net.mfu)
    attn_flops = 12 * arch.n_layers * arch.seq_len * arch.n_heads * arch.head_dim
    recompute_factor = {
        "none": 1.0,
        "selective": 1.0 + attn_flops / 3 / flops_per_token,
        "full": 4.0 / 3.0,
    }[recompute]
    m = batch_seqs // dp // micro_batch_seqs
    bubble = (pp - 1) / (m + pp - 1)
    compute = ideal / (1.0 - bubble)
    activation = arch.seq_len * micro_batch_seqs * arch.d_model * 2
    intra, inter = net.tp_bandwidth_gbs * 1e9, net.dp_bandwidth_gbs * 1e9
    tp_comm = 0.0
    if tp > 1:
        per_layer = 6 if recompute == "full" else 4
        calls = m * arch.n_layers // pp * per_layer
        tp_comm = calls * (2 * (tp - 1) / tp * activation / intra + net.latency_s)
    pp_comm = 0.0
    if pp > 1:
        send = activation / tp / (inter if tp * pp > gpus_per_node else intra)
        pp_comm = 2 * m * (send + net.latency_s)
    dp_comm = 0.0
    if dp > 1:
        bandwidth = inter if gpus > gpus_per_node else intra
        dp_comm = (dp - 1) / dp * 6 * params_on_rank / bandwidth + 2 * net.latency_s
    busy = compute + tp_comm + pp_comm
    extra = compute * (recompute_factor - 1.0)
    return busy + extra + dp_comm, busy / (busy + dp_comm)


def choose_layout(
    arch: ModelArch,
    *,
    batch_seqs: int,
    flops_per_token: float,
    gpus_per_node: int,
    gpu_mem_bytes: int,
    max_nodes: int,
    network: Network,
    mem_headroom: float = 0.85,
    max_micro_batch: int = 8,
    sequence_parallel: bool = True,
    recompute: tuple[str, ...] = memory.RECOMPUTE,
    runners_up: int = 4,
) -> Layout:
    """The fastest layout that fits: TP x PP x DP x micro-batch, sequence parallelism, recompute.

    Source: NeMo's auto-configurator (NeMo Framework docs, "Auto Configurator"), which searches
    this space for throughput. Candidates: TP dividing the heads, the vocabulary and the GPUs of a
    node (TP stays inside a node: Narayanan et al. 2021); PP dividing the layers; DP dividing the
    batch; whole nodes once a job spans more than one; at most ``max_nodes`` x ``gpus_per_node``
    GPUs; micro-batches dividing the per-replica batch up to ``max_micro_batch``; sequence
    parallelism with TP > 1 when ``sequence_parallel`` (it needs TransformerEngine's layers; it
    is then always on: less memory at the same communication volume, Korthikanti et al. 2022);
    recompute in the order of ``recompute`` (none, selective, full: each slower and leaner), the
    first that fits kept.
    A candidate must fit ``mem_headroom`` x ``gpu_mem_bytes`` (``collapse.memory``) and keep the
    data-parallel efficiency at ``network.min_dp_efficiency`` or above; the fastest by
    :func:`step_time` wins, fewer GPUs then less model parallelism breaking ties.
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
    if not 0 < mem_headroom <= 1:
        raise ValueError(f"mem_headroom must be in (0, 1], got {mem_headroom}")
    max_gpus = max_nodes * gpus_per_node
    usable = int(mem_headroom * gpu_mem_bytes)
    fits: list[Candidate] = []
    closest: Candidate | None = None  # least memory of all that do not fit
    slow_dp: Candidate | None = None  # the fastest of those under the DP efficiency floor
    tps = [
        t for t in _divisors(gpus_per_node) if arch.n_heads % t == 0 and arch.vocab_size % t == 0
    ]
    for tp in tps:
        for pp in _divisors(arch.n_layers):
            on_rank = memory.max_rank_params(arch, tp=tp, pp=pp)
            for dp in _divisors(batch_seqs):
                gpus = tp * pp * dp
                if gpus > max_gpus:
                    break
                if gpus > gpus_per_node and gpus % gpus_per_node:
                    continue
                per_replica = batch_seqs // dp
                for micro in (m for m in _divisors(per_replica) if m <= max_micro_batch):
                    for sp in (tp > 1 and sequence_parallel,):
                        for rc in recompute:
                            mem = memory.estimate(
                                arch,
                                tp=tp,
                                pp=pp,
                                dp=dp,
                                micro_batch_seqs=micro,
                                grad_accum=per_replica // micro,
                                sp=sp,
                                recompute=rc,
                            )
                            seconds, dp_eff = step_time(
                                arch,
                                network,
                                flops_per_token=flops_per_token,
                                batch_seqs=batch_seqs,
                                tp=tp,
                                pp=pp,
                                dp=dp,
                                micro_batch_seqs=micro,
                                recompute=rc,
                                params_on_rank=on_rank,
                                gpus_per_node=gpus_per_node,
                            )
                            ideal = (
                                flops_per_token
                                * batch_seqs
                                * arch.seq_len
                                / (gpus * network.peak_flops * network.mfu)
                            )
                            cand = Candidate(
                                tp, pp, dp, micro, sp, rc, mem, seconds, ideal / seconds, dp_eff
                            )
                            if mem.total > usable:
                                if closest is None or mem.total < closest.memory.total:
                                    closest = cand
                            elif (
                                dp_eff < network.min_dp_efficiency
                                or cand.efficiency < network.min_efficiency
                            ):
                                if slow_dp is None or seconds < slow_dp.step_seconds:
                                    slow_dp = cand
                            else:
                                fits.append(cand)
                            if mem.total <= usable:
                                break  # more recompute: slower, never more efficient
    size = (
        f"d_model {arch.d_model}, {arch.n_layers} layers, {arch.n_heads} heads, seq "
        f"{arch.seq_len}, batch {batch_seqs} sequences"
    )
    where = f"{max_gpus} GPUs ({max_nodes} nodes of {gpus_per_node})"
    if not fits:
        if closest is None and slow_dp is None:
            raise LayoutError(
                f"no layout of {size} on {where}: no TP dividing {arch.n_heads} heads and "
                f"{gpus_per_node} GPUs per node with PP dividing {arch.n_layers} layers splits "
                "the batch over whole nodes; fix: a batch divisible by more GPUs"
            )
        if slow_dp is not None:
            raise LayoutError(
                f"no layout of {size} on {where} keeps data-parallel efficiency at "
                f"min_dp_efficiency={network.min_dp_efficiency:g} and its efficiency at "
                f"min_efficiency={network.min_efficiency:g}: the closest, {slow_dp.describe()}, "
                f"reaches {slow_dp.dp_efficiency:.0%} and {slow_dp.efficiency:.0%}; fix: lower "
                "them in the cluster config, or a larger batch"
            )
        assert closest is not None
        largest = max(
            (t * p for t in tps for p in _divisors(arch.n_layers) if t * p <= max_gpus),
            default=1,
        )
        at_largest = closest.tp * closest.pp == largest
        raise LayoutError(
            f"{size} does not fit on {where}: the closest layout, {closest.describe()}, needs "
            f"{closest.memory.total / GIB:.1f} GiB per GPU ({closest.memory.describe()}) against "
            f"{usable / GIB:.1f} GiB usable ({mem_headroom:.0%} of {gpu_mem_bytes / GIB:.0f} GiB)"
            + (
                f"; it exceeds the GPU even at the largest TP x PP the GPUs allow "
                f"({closest.tp} x {closest.pp}), with micro-batch 1 and every recompute choice"
                if at_largest
                else ""
            )
            + "; fix: GPUs with more memory, a shorter sequence, or more nodes (max_nodes)"
        )
    fits.sort(key=lambda c: (c.step_seconds, c.gpus, c.tp * c.pp, c.pp, c.memory.total))
    best = fits[0]
    return Layout(
        tp=best.tp,
        pp=best.pp,
        dp=best.dp,
        micro_batch_seqs=best.micro_batch_seqs,
        grad_accum=batch_seqs // best.dp // best.micro_batch_seqs,
        gpus=best.gpus,
        nodes=max(1, best.gpus // gpus_per_node),
        procs_per_node=min(best.gpus, gpus_per_node),
        memory=best.memory,
        sequence_parallel=best.sp,
        recompute=best.recompute,
        efficiency=best.efficiency,
        step_seconds=best.step_seconds,
        runners_up=_runners_up(fits, runners_up),
        limit=_limit(best, fits, slow_dp, closest, max_gpus),
    )


def _runners_up(fits: list[Candidate], n: int) -> tuple[Candidate, ...]:
    """The next fastest candidates of distinct shape (TP, PP, DP), best first."""
    seen, out = set(), []
    for c in fits:
        shape = (c.tp, c.pp, c.dp)
        if shape in seen:
            continue
        seen.add(shape)
        out.append(c)
        if len(out) > n:
            break
    return tuple(out[1:])


def _limit(
    best: Candidate,
    fits: list[Candidate],
    slow_dp: Candidate | None,
    closest: Candidate | None,
    max_gpus: int,
) -> str:
    """Why the chosen layout does not use more GPUs, in a sentence."""
    if best.gpus == max_gpus:
        return f"the GPU cap ({max_gpus})"
    more = [c for c in fits if c.gpus > best.gpus]
    if more:
        faster_more = min(more, key=lambda c: c.step_seconds)
        return (
            f"more GPUs are slower: the fastest on more, {faster_more.describe()} "
            f"({faster_more.gpus} GPUs), takes {faster_more.step_seconds:.3g} s per step against "
            f"{best.step_seconds:.3g} s"
        )
    if slow_dp is not None and slow_dp.gpus > best.gpus:
        return (
            f"efficiency: on more GPUs ({slow_dp.describe()}) it falls to "
            f"{slow_dp.efficiency:.0%} (data-parallel {slow_dp.dp_efficiency:.0%}), under the "
            "cluster's floors"
        )
    if closest is not None and closest.gpus > best.gpus:
        return "memory: no layout on more GPUs fits"
    return "the batch: no split of it fills more whole nodes"


def cpu_layout(
    arch: ModelArch,
    *,
    batch_seqs: int,
    procs: int = 1,
    max_micro_batch: int = 8,
    nodes: int = 1,
    tp: int = 1,
    pp: int = 1,
) -> Layout:
    """Layout on the CPU cluster: one gloo process per rank, data parallel unless ``tp``/``pp``.

    Source: FINDINGS.md (TP/PP bring no speed on 2 cores). fp32 weights and activations, SDPA
    attention (its fused CPU kernel, or the math path that stores scores with ALiBi's float
    bias), no distributed optimizer; micro-batch is the largest divisor of the per-rank batch
    up to ``max_micro_batch``. ``procs`` processes split evenly over ``nodes``; TP and PP (a
    fixed choice of the cluster config, to exercise those layouts on CPUs) take ``tp x pp`` of
    them per data-parallel rank.
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
    mem = memory.estimate(
        arch,
        tp=tp,
        pp=pp,
        dp=dp,
        micro_batch_seqs=micro,
        grad_accum=per_proc // micro,
        precision=memory.CPU_FP32,
        distributed_optimizer=False,
        attention=memory.cpu_attention(arch),
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
        memory=mem,
    )


def gpu_hours(flops: float, peak_flops_per_gpu: float, mfu: float) -> float:
    """GPU-hours = FLOPs / (peak x MFU) / 3600 (model FLOPs utilization as assumed)."""
    if peak_flops_per_gpu <= 0:
        raise ValueError(f"peak_flops_per_gpu must be positive, got {peak_flops_per_gpu}")
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    return flops / (peak_flops_per_gpu * mfu) / 3600.0


def wall_time_hours(
    flops: float, gpus: int, peak_flops_per_gpu: float, mfu: float, efficiency: float = 1.0
) -> float:
    """Wall-clock hours on ``gpus`` GPUs at the assumed MFU: GPU-hours / gpus, divided by the
    layout's efficiency (its ideal step time over its estimated one, :func:`step_time`)."""
    if gpus < 1:
        raise ValueError(f"gpus must be a positive integer, got {gpus}")
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
    return gpu_hours(flops, peak_flops_per_gpu, mfu) / gpus / efficiency
