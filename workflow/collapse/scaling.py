"""Scaling rules: parameters, tokens, batch, steps, AdamW timescale, schedule and µP.

Every function here is pure and small; each names its source (a section of docs/method.md,
which restates the papers). The planner calls them once per run and writes the results into
the run spec, so nothing downstream recomputes a rule.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Literal

from collapse.runspec import ModelArch, Parameterization

REFERENCE_SEQ_LEN = 2048  # Power Lines reports its batch law in 2048-token sequences


@dataclass(frozen=True)
class ParamCount:
    """Parameters of a Megatron-Core GPTModel (local layer spec), split the way TPP needs."""

    total: int
    embedding: int  # input word embeddings + untied output layer + learned positions
    non_embedding: int
    breakdown: dict[str, int] = field(default_factory=dict)


def _positive_int(name: str, value: int) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, numbers.Real) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def param_count(arch: ModelArch) -> ParamCount:
    """Exact parameter count of Megatron-Core 0.16.1 GPTModel with get_gpt_layer_local_spec.

    Source: docs/method.md §1 (TPP counts all parameters, embeddings included); the layout is
    Megatron-Core's: linear layers with biases (add_bias_linear), LayerNorm with weight and bias
    (two per layer plus the final one), fused QKV, output layer without bias. Swiglu is
    gated_linear_unit=True with ``ffn_hidden`` per matrix (three d x f matrices). ALiBi and RoPE
    add no parameters. The vocabulary is counted as given (pad it before calling if the trainer
    pads it).
    """
    d, layers, f = arch.d_model, arch.n_layers, arch.ffn_hidden
    attn_width = arch.n_heads * arch.head_dim
    fc1_out = 2 * f if arch.activation == "swiglu" else f
    per_layer = {
        "attention_qkv_weight": d * 3 * attn_width,
        "attention_qkv_bias": 3 * attn_width,
        "attention_out_weight": attn_width * d,
        "attention_out_bias": d,
        "ffn_in_weight": d * fc1_out,
        "ffn_in_bias": fc1_out,
        "ffn_out_weight": f * d,
        "ffn_out_bias": d,
        "layernorms": 2 * 2 * d,
    }
    breakdown = {name: layers * count for name, count in per_layer.items()}
    breakdown["final_layernorm"] = 2 * d
    breakdown["word_embeddings"] = arch.vocab_size * d
    breakdown["output_layer"] = 0 if arch.tied_embeddings else arch.vocab_size * d
    breakdown["position_embeddings"] = arch.seq_len * d if arch.positions == "learned" else 0
    embedding = (
        breakdown["word_embeddings"] + breakdown["output_layer"] + breakdown["position_embeddings"]
    )
    total = sum(breakdown.values())
    return ParamCount(
        total=total, embedding=embedding, non_embedding=total - embedding, breakdown=breakdown
    )


def tokens_for_tpp(tpp: float, params: int) -> int:
    """Training tokens D = TPP x N, rounded to a whole token.

    Source: docs/method.md §1 (TPP = D / N, N all parameters).
    """
    _positive("tpp", tpp)
    _positive_int("params", params)
    return round(tpp * params)


def batch_seqs_power_law(
    tokens: int,
    coef: float,
    exponent: float,
    seq_len: int,
    multiple_of: int,
    *,
    ref_seq_len: int = REFERENCE_SEQ_LEN,
) -> int:
    """Global batch in sequences of ``seq_len`` from B_opt = coef * D^exponent.

    Source: docs/method.md §2 (Power Lines: B_opt ~ 0.0306 * D^0.383 in 2048-token sequences).
    The law is converted to other sequence lengths by tokens per batch, then rounded to the
    nearest multiple of ``multiple_of`` (at least ``multiple_of``) so it splits over devices.
    """
    _positive_int("tokens", tokens)
    _positive("coef", coef)
    _positive_int("seq_len", seq_len)
    _positive_int("multiple_of", multiple_of)
    _positive_int("ref_seq_len", ref_seq_len)
    batch_tokens = coef * tokens**exponent * ref_seq_len
    seqs = batch_tokens / seq_len
    return max(multiple_of, multiple_of * round(seqs / multiple_of))


def steps_for(tokens: int, batch_seqs: int, seq_len: int) -> int:
    """Optimizer steps T = D / (B x S), rounded to the nearest whole step, at least 1.

    Source: docs/method.md §2 (t_hat = t B / D); report the realized tokens after rounding.
    """
    _positive_int("tokens", tokens)
    _positive_int("batch_seqs", batch_seqs)
    _positive_int("seq_len", seq_len)
    return max(1, round(tokens / (batch_seqs * seq_len)))


def realized_tokens(steps: int, batch_seqs: int, seq_len: int) -> int:
    """Tokens a run of whole steps actually consumes: T x B x S (docs/method.md §2)."""
    _positive_int("steps", steps)
    _positive_int("batch_seqs", batch_seqs)
    _positive_int("seq_len", seq_len)
    return steps * batch_seqs * seq_len


def tau_power_law(tpp: float, coef: float = 1.084, exponent: float = -0.527) -> float:
    """Optimal AdamW timescale (fraction of training) tau_opt = coef * TPP^exponent.

    Source: docs/method.md §2 (Power Lines; the coefficient from secondary sources).
    """
    _positive("tpp", tpp)
    _positive("coef", coef)
    return coef * tpp**exponent


def tau_of(lr: float, weight_decay: float, batch_tokens: int, tokens: int) -> float:
    """AdamW EMA timescale as a fraction of training, tau = B / (eta lambda D).

    Source: docs/method.md §2; ``lr`` is the µP-adjusted hidden LR, B and D in tokens.
    """
    _positive("lr", lr)
    _positive("weight_decay", weight_decay)
    _positive_int("batch_tokens", batch_tokens)
    _positive_int("tokens", tokens)
    return batch_tokens / (lr * weight_decay * tokens)


def weight_decay_for_tau(tau: float, lr: float, batch_tokens: int, tokens: int) -> float:
    """Weight decay that realizes a target timescale, lambda = B / (eta tau D).

    Source: docs/method.md §2; ``lr`` is the µP-adjusted hidden LR, B and D in tokens.
    """
    _positive("tau", tau)
    _positive("lr", lr)
    _positive_int("batch_tokens", batch_tokens)
    _positive_int("tokens", tokens)
    return batch_tokens / (lr * tau * tokens)


def warmup_steps(
    steps: int,
    *,
    fraction: float = 0.1,
    max_tokens: int | None = None,
    batch_tokens: int | None = None,
) -> int:
    """Linear-warmup length: ``fraction`` of the steps, capped at ``max_tokens`` when given.

    Source: docs/method.md §2 (10 % of steps in the paper's experiments) and section 8
    (Celerity: min(10 % of tokens, 375M tokens)). Always below ``steps``, since Megatron's
    scheduler needs warmup < decay steps.
    """
    _positive_int("steps", steps)
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction must be in [0, 1), got {fraction!r}")
    warmup = round(fraction * steps)
    if max_tokens is not None:
        if batch_tokens is None:
            raise ValueError("batch_tokens is needed with max_tokens: pass tokens per step")
        _positive_int("max_tokens", max_tokens)
        _positive_int("batch_tokens", batch_tokens)
        warmup = min(warmup, round(max_tokens / batch_tokens))
    return min(warmup, steps - 1)


def lr_at(step: int, *, peak: float, warmup_steps: int, total_steps: int) -> float:
    """LR after ``step`` scheduler steps: linear warmup from 0, then linear decay to 0 (D2Z).

    Source: docs/method.md §1 (decay to zero) and Megatron-Core 0.16.1
    OptimizerParamScheduler(init_lr=0, lr_decay_style="linear", min_lr=0,
    lr_decay_steps=total_steps), whose get_lr this reproduces: the LR used by optimizer update
    ``step`` (0-based) is lr_at(step); lr_at(total_steps) = 0.
    """
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(
            f"warmup_steps must be in [0, total_steps), got {warmup_steps} with "
            f"total_steps {total_steps}"
        )
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if warmup_steps > 0 and step <= warmup_steps:
        return peak * step / warmup_steps
    if step > total_steps:
        return 0.0
    return peak * (1.0 - (step - warmup_steps) / (total_steps - warmup_steps))


def mup_parameterization(
    arch: ModelArch,
    *,
    kind: Literal["mup", "completep", "sp"],
    d_base: int,
    depth_base: int,
    sigma_base: float,
    eta_base: float,
    alpha_input: float,
    alpha_output: float,
    beta1: float,
    beta2: float,
    eps: float,
    completep_alpha: float = 1.0,
    embedding_decay: Literal["coupled", "same_tau"] = "coupled",
) -> Parameterization:
    """Per-group init stds, LRs and multipliers for µP, CompleteP or standard parameterization.

    Source: docs/method.md §7 (Cerebras µP: Cerebras-GPT / BTLM). Width m_d = d_model/d_base:
    embedding std sigma_base, LR eta_base, output x alpha_input; hidden matrices var
    sigma_base^2/m_d, LR eta_base/m_d; output projections var sigma_base^2/(2 m_d L), LR
    eta_base/m_d; norms and biases LR eta_base; attention 1/d_head; logits alpha_output/m_d.
    Unembedding (untied): std sigma_base and LR eta_base, as in Cerebras µP and EleutherAI
    nanoGPT-mup, where the unembedding is the (tied) embedding matrix: its width-dependence is
    carried by the 1/m_d logit multiplier alone.
    CompleteP (Dey et al. 2025, "Don't be lazy: CompleteP"; EleutherAI nanoGPT-mup branch
    completep and the Cerebras llm-foundry CompleteP port): depth m_L = L/L_base, residual
    branches x m_L^-alpha, hidden weight LR x m_L^(alpha-1) (hidden norms and biases too), Adam
    eps x 1/(m_d m_L^alpha). Megatron has one eps for all groups: the hidden-layer value is used.
    No init variance depends on depth under CompleteP: the output projections keep µP's
    sigma_base^2/(2 m_d L) at the base depth, L = L_base (docs/method.md §7).
    "sp": every multiplier 1, one LR eta_base, std sigma_base (output projections
    sigma_base/sqrt(2L), Megatron's default), attention 1/sqrt(d_head); eps as given.
    Weight decay: AdamW shrinks a group by lr_group x lambda per step, so tau (defined with the
    hidden LR, docs/method.md §2) holds for the (un)embedding only with its weight decay x
    lr_hidden / eta_base ("same_tau"); "coupled" leaves it at 1 (timescale tau / m_d).
    """
    _positive_int("d_base", d_base)
    _positive_int("depth_base", depth_base)
    _positive("sigma_base", sigma_base)
    _positive("eta_base", eta_base)
    if kind not in ("mup", "completep", "sp"):
        raise ValueError(f"kind must be 'mup', 'completep' or 'sp', got {kind!r}")
    if embedding_decay not in ("coupled", "same_tau"):
        raise ValueError(
            f"embedding_decay must be 'coupled' or 'same_tau', got {embedding_decay!r}"
        )
    if not 0.5 <= completep_alpha <= 1.0:
        raise ValueError(f"completep_alpha must be in [0.5, 1] (CompleteP), got {completep_alpha}")
    layers = arch.n_layers
    output_proj_std = sigma_base / math.sqrt(2 * layers)
    if kind == "sp":
        return Parameterization(
            kind="sp",
            d_base=d_base,
            depth_base=depth_base,
            width_mult=1.0,
            depth_mult=1.0,
            alpha_input=1.0,
            logit_multiplier=1.0,
            residual_multiplier=1.0,
            attention_scale=1.0 / math.sqrt(arch.head_dim),
            init_std_embedding=sigma_base,
            init_std_hidden=sigma_base,
            init_std_output_proj=output_proj_std,
            init_std_unembedding=sigma_base,
            lr_embedding=eta_base,
            lr_hidden=eta_base,
            lr_output_proj=eta_base,
            lr_unembedding=eta_base,
            lr_norm_bias=eta_base,
            adam_beta1=beta1,
            adam_beta2=beta2,
            adam_eps=eps,
        )
    width_mult = arch.d_model / d_base
    if kind == "completep":
        depth_mult = layers / depth_base
        residual_multiplier = depth_mult**-completep_alpha
        depth_lr_mult = depth_mult ** (completep_alpha - 1.0)
        adam_eps = eps / (width_mult * depth_mult**completep_alpha)
    else:
        depth_mult, residual_multiplier, depth_lr_mult, adam_eps = 1.0, 1.0, 1.0, eps
    hidden_lr = eta_base / width_mult * depth_lr_mult
    # The output projections' GPT-2 1/(2L) init factor: at the model's own depth under µP; under
    # CompleteP at the base depth, so that the init does not depend on depth (the residual
    # multiplier alone carries it, as in Dey et al. 2025) and the base-depth model is µP's.
    init_depth = depth_base if kind == "completep" else layers
    wd_mult = hidden_lr / eta_base if embedding_decay == "same_tau" else 1.0
    return Parameterization(
        kind=kind,
        d_base=d_base,
        depth_base=depth_base,
        width_mult=width_mult,
        depth_mult=depth_mult,
        alpha_input=alpha_input,
        logit_multiplier=alpha_output / width_mult,
        residual_multiplier=residual_multiplier,
        attention_scale=1.0 / arch.head_dim,
        init_std_embedding=sigma_base,
        init_std_hidden=sigma_base / math.sqrt(width_mult),
        init_std_output_proj=sigma_base / math.sqrt(2 * width_mult * init_depth),
        init_std_unembedding=sigma_base,
        lr_embedding=eta_base,
        lr_hidden=hidden_lr,
        lr_output_proj=hidden_lr,
        lr_unembedding=eta_base,
        lr_norm_bias=eta_base * depth_lr_mult,
        wd_mult_embedding=wd_mult,
        wd_mult_unembedding=wd_mult,
        adam_beta1=beta1,
        adam_beta2=beta2,
        adam_eps=adam_eps,
    )
