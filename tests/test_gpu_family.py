"""The small GPU family (config/family/gpu_small.yaml), planned on slurm_h100: its sizes, tokens,
batches, FLOPs and time against hand arithmetic, so that it stays a ten-minute family."""

from __future__ import annotations

import math

import pytest

from collapse.config import load_config
from collapse.plan import plan_family

WIDTHS = (256, 384, 512, 768, 1024)
V, S, L = 8192, 1024, 4


@pytest.fixture(scope="module")
def plan():
    return plan_family(
        load_config(["family=gpu_small", "cluster=slurm_h100"]), corpus_tokens=10**10
    )


def hand_params(d: int) -> int:
    """Untied embedding and output layer 2 V d; per layer QKV 3d^2 + 3d, projection d^2 + d,
    FFN 4d^2 + 4d and 4d^2 + d, two layernorms 4d; the final layernorm 2d."""
    per_layer = (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d) + 4 * d
    return 2 * V * d + L * per_layer + 2 * d


def hand_batch(tokens: int) -> int:
    """B = 0.0306 D^0.383 sequences of 2048 tokens, in 1024-token sequences, to a multiple of 8."""
    seqs = 0.0306 * tokens**0.383 * 2048 / S
    return 8 * round(seqs / 8)


def test_sizes_tokens_and_batches_by_hand(plan):
    t = plan.table.set_index("run")
    assert hand_params(256) == 7_353_856  # 4,194,304 embedding + 3,159,552 in the layers
    for d in WIDTHS:
        row = t.loc[f"d{d}-tpp2-s0"]
        params = hand_params(d)
        assert row.params == params
        target = round(2 * params)  # TPP 2, all parameters counted
        batch = hand_batch(target)
        steps = round(target / (batch * S))
        assert (row.batch_seqs, row.steps, row.tokens) == (batch, steps, steps * batch * S)
        assert row.n_layers == L and row.n_heads == d // 64
    # d256: D = 14,707,712; B = 0.0306 x 14.7M^0.383 x 2 = 34.0 -> 32; 449 steps; 14,712,832
    assert (t.loc["d256-tpp2-s0", "batch_seqs"], t.loc["d256-tpp2-s0", "tokens"]) == (
        32,
        14_712_832,
    )
    # "a few tens of millions of tokens each": 15M to 134M
    assert t.tokens.min() > 14e6 and t.tokens.max() < 135e6
    assert sorted(t.loc[t.is_reference].index) == ["d256-tpp2-s0", "d256-tpp2-s1", "d256-tpp2-s2"]


def test_the_family_fits_ten_minutes_of_one_h100(plan):
    t = plan.table.set_index("run")

    def hand_flops(d: int, tokens: int) -> float:
        # Table 9: 6 N D - 2 V d D + 3 L C_attn D, C_attn = 4 S d + 3 S + d + 2 d^2 per token
        c_attn = 4 * S * d + 3 * S + d + 2 * d * d
        return (6 * hand_params(d) - 2 * V * d + 3 * L * c_attn) * tokens

    for d in WIDTHS:
        row = t.loc[f"d{d}-tpp2-s0"]
        assert row.flops == pytest.approx(hand_flops(d, row.tokens), rel=1e-12)
    # d256: (44,123,136 - 4,194,304 + 14,195,712) x 14,712,832 = 7.963e14
    assert t.loc["d256-tpp2-s0", "flops"] == pytest.approx(7.963e14, rel=1e-4)
    total = t.flops.sum()  # three d256 seeds and one run of each other size
    minutes = total / (989e12 * 0.30) / 60
    assert total == pytest.approx(9.66e16, rel=1e-3)
    assert minutes < 6  # 5.4 min of compute at 30 % MFU, the rest of ten minutes for start-up
    for run in t.index:  # every run fits one 80 GB GPU with room to spare
        assert t.loc[run, "memory_gb_per_gpu"] < 10
    assert math.isclose(minutes, 5.43, abs_tol=0.01)
