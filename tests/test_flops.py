"""FLOPs accounting against hand-computed values."""

from __future__ import annotations

import pytest
from archs import small_arch

from collapse.flops import attention_flops_per_token, flops_6nd, flops_table9
from collapse.runspec import ModelArch
from collapse.scaling import param_count


def test_flops_6nd():
    assert flops_6nd(1000, 20_000) == 120_000_000.0
    assert flops_6nd(1, 1) == 6.0  # the smallest counts allowed
    with pytest.raises(ValueError, match="params"):
        flops_6nd(0, 10)
    with pytest.raises(ValueError, match="tokens"):
        flops_6nd(10, 0)


def test_attention_terms_by_hand():
    # S 32, d_attn 64, d 64: QK 2*32*64 = 4096, softmax 3*32 = 96, AV 4096, act 64, proj 8192
    assert attention_flops_per_token(small_arch()) == 4096 + 96 + 4096 + 64 + 8192 == 16_544
    # attention width 4 x 8 = 32 differs from d_model 64: QK and AV use 32
    narrow = small_arch(head_dim=8)
    assert attention_flops_per_token(narrow) == 2048 + 96 + 2048 + 64 + 8192


def test_flops_table9_by_hand():
    a = small_arch()
    n = 108_544  # tests/test_scaling.py: this architecture's exact count
    assert param_count(a).total == n
    tokens = 1_000_000
    six_nd = 6 * n * tokens  # 651_264_000_000
    lookup = 2 * 100 * 64 * tokens  # 12_800_000_000
    attention = 3 * 2 * 16_544 * tokens  # 99_264_000_000
    assert flops_table9(a, n, tokens) == six_nd - lookup + attention == 737_728_000_000


def test_table9_exceeds_6nd_at_long_sequences():
    """Celerity 3.9B at S 8192: attention terms outweigh the embedding lookup."""
    a = ModelArch(
        d_model=2048,
        n_layers=40,
        n_heads=16,
        head_dim=128,
        ffn_hidden=16384,
        activation="squared_relu",
        positions="alibi",
        vocab_size=128256,
        seq_len=8192,
        tied_embeddings=False,
    )
    n = param_count(a).total
    tokens = 234 * n
    ratio = flops_table9(a, n, tokens) / flops_6nd(n, tokens)
    # per token: 6N = 2.329e10; lookup 2*128256*2048 = 5.25e8;
    # 3*40*(2*2*8192*2048 + 3*8192 + 2048 + 2*2048^2) = 3*40*7.550e7 = 9.06e9
    assert ratio == pytest.approx((6 * n - 525_336_576 + 120 * 75_524_096) / (6 * n))
    assert 1.3 < ratio < 1.4
