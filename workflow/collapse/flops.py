"""Training FLOPs: the 6ND rule and the paper's Table 9 accounting."""

from __future__ import annotations

from collapse.runspec import ModelArch


def _check(params: int, tokens: int) -> None:
    if params < 1:
        raise ValueError(f"params must be a positive integer, got {params}")
    if tokens < 1:
        raise ValueError(f"tokens must be a positive integer, got {tokens}")


def flops_6nd(params: int, tokens: int) -> float:
    """Training FLOPs as 6 N D (2 forward + 4 backward per parameter and token).

    Source: docs/method.md §6 (the first term of Table 9); Kaplan et al. 2020.
    """
    _check(params, tokens)
    return 6.0 * params * tokens


def attention_flops_per_token(arch: ModelArch) -> float:
    """Forward FLOPs per token of one layer beyond its weight matmuls, C_attn / tokens.

    Source: docs/method.md §6 (Table 9), term by term as the paper lists it, with S the
    sequence length, d_attn = heads x head_dim the attention width and d the model width:
    QK^T 2 S d_attn; softmax, scaling and mask 3 S; attention x V 2 S d_attn; FFN activation d;
    and the paper's further 2 d^2 "projection" term, counted here as the paper lists it
    although 6N already covers the projection weights.
    """
    seq, d = arch.seq_len, arch.d_model
    d_attn = arch.n_heads * arch.head_dim
    qk = 2 * seq * d_attn
    softmax_scale_mask = 3 * seq
    attn_v = 2 * seq * d_attn
    ffn_activation = d
    projection = 2 * d * d
    return float(qk + softmax_scale_mask + attn_v + ffn_activation + projection)


def flops_table9(arch: ModelArch, params: int, tokens: int) -> float:
    """Training FLOPs = 6 N D - 2 V d D + 3 L C_attn(D).

    Source: docs/method.md §6 (Table 9 of arXiv 2509.25087). The 2 V d D term removes the
    input-embedding lookup that 6 N D counts as a matmul; the factor 3 on the attention terms is
    one forward plus two backward passes.
    """
    _check(params, tokens)
    embedding_lookup = 2.0 * arch.vocab_size * arch.d_model * tokens
    attention = 3.0 * arch.n_layers * attention_flops_per_token(arch) * tokens
    return flops_6nd(params, tokens) - embedding_lookup + attention
