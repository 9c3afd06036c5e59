"""Bytes per device of a Megatron-Core training job: model state, activations, bias, logits.

Pure functions over a ModelArch and a layout (TP, PP, DP, micro-batch, sequence parallelism,
activation recompute). The planner calls :func:`estimate` for every layout it considers and
never picks one whose total exceeds the GPU's usable memory.

Model state is exact per rank: :func:`rank_params` applies Megatron-Core's partitioning
(column-parallel QKV and FC1 split their outputs and biases, row-parallel projections split their
inputs and keep their biases whole, norms are replicated, the vocabulary is split over TP;
layers split evenly over PP, the first stage holds the embeddings, the last the final norm and
output layer). tests/test_memory.py checks it against GPTModels built on the meta device at the
planned layouts. Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation
in Large Transformer Models", Table 2 and section 4) for this project's layers, which have no
dropout (so no masks are stored), and are checked against peak memory measured on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from collapse.runspec import ModelArch

GIB = 2**30
Recompute = Literal["none", "selective", "full"]
RECOMPUTE: tuple[Recompute, ...] = ("none", "selective", "full")
# "fused": flash / memory-efficient / TransformerEngine fused attention, which keep Q, K, V, the
# output and a per-row log-sum-exp, never the [s, s] scores; "scores": an attention that stores
# its softmax probabilities for backward (SDPA's math path on the CPU).
Attention = Literal["fused", "scores"]


def cpu_attention(arch: ModelArch) -> Attention:
    """SDPA on the CPU: its fused (flash) kernel for causal attention, the math path, which
    stores the scores, when ALiBi passes a float bias."""
    return "scores" if arch.positions == "alibi" else "fused"


@dataclass(frozen=True)
class Precision:
    """Bytes per element of what a training job keeps.

    GPU (bf16): bf16 weights and activations, fp32 gradient buffer (Megatron DDP with
    ``grad_reduce_in_fp32=True``), Adam's fp32 master copy plus m and v (12 bytes). CPU: fp32
    throughout, Adam's m and v (8 bytes)."""

    param_bytes: int
    grad_bytes: int
    act_bytes: int

    @property
    def optimizer_bytes(self) -> int:
        return 8 + (4 if self.param_bytes < 4 else 0)


GPU_BF16 = Precision(param_bytes=2, grad_bytes=4, act_bytes=2)
CPU_FP32 = Precision(param_bytes=4, grad_bytes=4, act_bytes=4)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device on the most loaded pipeline stage."""

    weights: int
    grads: int
    optimizer: int
    activations: int  # transformer layers' stored activations (+ one rebuilt layer when full)
    attention_bias: int = 0  # ALiBi: one [heads/TP, s, s] bias shared by the device's layers
    logits: int = 0  # output layer and fp32 cross entropy (last stage)
    workspace: int = 0  # the largest weight's gradient before it joins the gradient buffer

    @property
    def state(self) -> int:
        return self.weights + self.grads + self.optimizer

    @property
    def activation_total(self) -> int:
        """Everything that grows with the micro-batch and sequence: the measured term."""
        return self.activations + self.attention_bias + self.logits + self.workspace

    @property
    def total(self) -> int:
        return self.state + self.activation_total

    def describe(self) -> str:
        parts = (
            ("weights", self.weights),
            ("grads", self.grads),
            ("optimizer", self.optimizer),
            ("activations", self.activations),
            ("ALiBi bias", self.attention_bias),
            ("logits", self.logits),
            ("workspace", self.workspace),
        )
        return ", ".join(f"{name} {value / GIB:.1f}" for name, value in parts if value) + " GiB"


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")


def layer_params(arch: ModelArch, *, tp: int) -> int:
    """Parameters of one transformer layer on one tensor-parallel rank (Megatron-Core 0.16.1).

    Column-parallel (QKV, FC1): weight and bias split over TP. Row-parallel (attention output,
    FC2): weight split over TP, bias whole. LayerNorms (weight and bias, two per layer): whole.
    """
    d, f = arch.d_model, arch.ffn_hidden
    attn = arch.n_heads * arch.head_dim
    fc1 = 2 * f if arch.activation == "swiglu" else f
    column = (d * 3 * attn + 3 * attn) + (d * fc1 + fc1)
    row_weights = attn * d + f * d
    return column // tp + row_weights // tp + 2 * d + 2 * 2 * d


def rank_params(arch: ModelArch, *, tp: int, pp: int, stage: int) -> int:
    """Parameters one rank of pipeline stage ``stage`` (0-based) holds.

    The first stage holds the word (and learned position) embeddings, vocabulary split over TP;
    the last stage the final LayerNorm and the output layer (its own tied copy of the word
    embeddings when tied and pp > 1). A tied single-stage model holds the matrix once.
    """
    _check_positive(tp=tp, pp=pp)
    if arch.n_layers % pp:
        raise ValueError(f"pp={pp} must divide n_layers={arch.n_layers}: pick a divisor")
    if not 0 <= stage < pp:
        raise ValueError(f"stage must be in [0, {pp}), got {stage}")
    if arch.vocab_size % tp or arch.n_heads % tp:
        raise ValueError(
            f"tp={tp} must divide vocab_size={arch.vocab_size} and n_heads={arch.n_heads}"
        )
    d = arch.d_model
    count = arch.n_layers // pp * layer_params(arch, tp=tp)
    vocab_rows = arch.vocab_size // tp * d
    if stage == 0:
        count += vocab_rows
        if arch.positions == "learned":
            count += arch.seq_len * d
    if stage == pp - 1:
        count += 2 * d  # final LayerNorm
        if not arch.tied_embeddings or pp > 1:
            count += vocab_rows
    return count


def max_rank_params(arch: ModelArch, *, tp: int, pp: int) -> int:
    """Parameters on the most loaded rank (the first or last pipeline stage)."""
    return max(rank_params(arch, tp=tp, pp=pp, stage=s) for s in {0, pp - 1})


def largest_weight(arch: ModelArch, *, tp: int) -> int:
    """Elements of the largest parameter tensor a rank holds: a vocabulary shard of the
    embedding or output layer, or a layer's QKV, FC1 or FC2 weight."""
    d, f = arch.d_model, arch.ffn_hidden
    fc1 = 2 * f if arch.activation == "swiglu" else f
    attn = arch.n_heads * arch.head_dim
    return max(arch.vocab_size * d, 3 * attn * d, fc1 * d, f * d) // tp


def layer_activation_bytes(
    arch: ModelArch,
    *,
    micro_batch_seqs: int,
    tp: int,
    sp: bool = False,
    act_bytes: int = 2,
    attention: Attention = "fused",
    recompute: Recompute = "none",
) -> int:
    """Activations one transformer layer keeps for backward, for one micro-batch.

    Korthikanti et al. 2022, Table 2, with this project's layers (no dropout, so no masks and no
    dropout outputs; an FFN of width f; attention width a = heads x head_dim):

    - kept whole on every TP rank, or split over TP by sequence parallelism: both LayerNorms'
      inputs and outputs (the QKV and FC1 inputs), 4 e s b h;
    - split over TP: the FFN's 2 f (the FC1 output and the activation's output; gated: 4 f);
      the attention's Q, K, V (one QKV tensor, 3 e s b a), its output as the attention keeps it
      for backward and as the output projection's input ([b, heads, s, d] and its [s, b, a]
      copy, 2 e s b a; Korthikanti count one); RoPE's rotated Q and K, 2 e s b a;
    - attention that stores its scores (the math path of SDPA, used with a float bias on the
      CPU) keeps the softmax probabilities, e heads s^2 b (Korthikanti's 5 a s^2 b less the
      dropout mask and output), and Q and K pre-scaled by the root of the softmax scale instead
      of the output (+ e s b a). Selective recompute rebuilds the core attention: neither is kept.

    Full recompute keeps only the layer's input, e s b h (over TP with sequence parallelism).
    tests/test_memory.py measures these against peak memory on the CPU.
    """
    _check_positive(micro_batch_seqs=micro_batch_seqs, tp=tp, act_bytes=act_bytes)
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    s, b, h = arch.seq_len, micro_batch_seqs, arch.d_model
    e = act_bytes
    sp_div = tp if sp else 1
    if recompute == "full":
        return -(-e * s * b * h // sp_div)
    attn, f = arch.n_heads * arch.head_dim, arch.ffn_hidden
    ffn_values = 4 * f if arch.activation == "swiglu" else 2 * f
    replicated = 4 * e * s * b * h
    attn_values = 5 + (2 if arch.positions == "rope" else 0)
    if attention == "scores" and recompute == "none":
        attn_values += 1
    sharded = e * s * b * (attn_values * attn + ffn_values)
    if attention == "scores" and recompute == "none":
        sharded += e * arch.n_heads * s * s * b
    return -(-replicated // sp_div) + -(-sharded // tp)


def attention_bias_bytes(arch: ModelArch, *, tp: int, act_bytes: int = 2) -> int:
    """ALiBi's additive bias, one [heads/TP, s, s] tensor in the activation dtype shared by all
    of a device's layers (0 for RoPE and learned positions)."""
    if arch.positions != "alibi":
        return 0
    return arch.n_heads // tp * arch.seq_len**2 * act_bytes


def logits_bytes(
    arch: ModelArch, *, micro_batch_seqs: int, tp: int, sp: bool = False, act_bytes: int = 2
) -> int:
    """The last stage's output: final LayerNorm input and output (e s b h each, over TP with
    sequence parallelism) and the logits at their peak (Megatron's vocab-parallel cross entropy:
    an fp32 copy of the e-byte logits, kept as the softmax for backward; in fp32 the copy is the
    logits themselves), s b v / TP of them."""
    s, b, h, v = arch.seq_len, micro_batch_seqs, arch.d_model, arch.vocab_size
    per_logit = 4 + (act_bytes if act_bytes < 4 else 0)
    norm = -(-2 * act_bytes * s * b * h // (tp if sp else 1))
    return norm + -(-per_logit * s * b * v // tp)


def estimate(
    arch: ModelArch,
    *,
    tp: int,
    pp: int,
    dp: int,
    micro_batch_seqs: int,
    grad_accum: int = 1,
    sp: bool = False,
    recompute: Recompute = "none",
    precision: Precision = GPU_BF16,
    distributed_optimizer: bool = True,
    attention: Attention = "fused",
) -> MemoryEstimate:
    """Memory per device on the most loaded pipeline stage of a Megatron-Core training job.

    State: weights and gradients of the rank's parameters; Adam state sharded over DP by the
    distributed optimizer (ZeRO-1: Rajbhandari et al. 2020; Megatron-LM distributed optimizer
    docs; its bucket padding, under 128 x dp elements, is left out). Activations: a 1F1B pipeline's
    first stage keeps min(pp, grad_accum) micro-batches of its n_layers/pp layers, the last stage
    one micro-batch plus the logits (Korthikanti et al. 2022, section 4.2.3); full recompute adds
    one layer rebuilt during backward.
    """
    _check_positive(tp=tp, pp=pp, dp=dp, micro_batch_seqs=micro_batch_seqs, grad_accum=grad_accum)
    if sp and tp == 1:
        sp = False  # sequence parallelism splits over TP: nothing to split
    on_rank = max_rank_params(arch, tp=tp, pp=pp)
    optimizer = on_rank * precision.optimizer_bytes
    if distributed_optimizer:
        optimizer = -(-optimizer // dp)
    e = precision.act_bytes
    kw = dict(micro_batch_seqs=micro_batch_seqs, tp=tp, sp=sp, act_bytes=e, attention=attention)
    stored = layer_activation_bytes(arch, recompute=recompute, **kw)
    working = layer_activation_bytes(arch, recompute="none", **kw) if recompute == "full" else 0
    layers = arch.n_layers // pp
    first = min(pp, grad_accum) * layers * stored + working
    last = layers * stored + working
    logits = logits_bytes(arch, micro_batch_seqs=micro_batch_seqs, tp=tp, sp=sp, act_bytes=e)
    if pp > 1 and first > last + logits:
        activations, logits = first, 0
    else:
        activations = last
    return MemoryEstimate(
        weights=on_rank * precision.param_bytes,
        grads=on_rank * precision.grad_bytes,
        optimizer=optimizer,
        activations=activations,
        attention_bias=attention_bias_bytes(arch, tp=tp, act_bytes=e),
        logits=logits,
        # Megatron's DDP (without gradient-accumulation fusion) lets autograd allocate each
        # weight's gradient in the weights' dtype, then adds it into the fp32 buffer and frees it
        workspace=largest_weight(arch, tp=tp) * precision.param_bytes,
    )
