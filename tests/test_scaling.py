"""Scaling rules against hand-computed values and against Megatron-Core itself."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
from archs import small_arch as arch

from collapse.runspec import ModelArch
from collapse.scaling import (
    ParamCount,
    batch_seqs_power_law,
    lr_at,
    mup_parameterization,
    param_count,
    realized_tokens,
    steps_for,
    tau_of,
    tau_power_law,
    tokens_for_tpp,
    warmup_steps,
    weight_decay_for_tau,
)

# docs/method.md §8: (name, d_model, heads, head size, layers, batch in sequences)
CELERITY = [
    ("300M", 640, 10, 64, 13, 176),
    ("500M", 896, 14, 64, 17, 240),
    ("900M", 1152, 9, 128, 23, 336),
    ("1.8B", 1536, 12, 128, 30, 464),
    ("3.9B", 2048, 16, 128, 40, 672),
]


def celerity_arch(d_model: int, heads: int, head_dim: int, layers: int) -> ModelArch:
    return ModelArch(
        d_model=d_model,
        n_layers=layers,
        n_heads=heads,
        head_dim=head_dim,
        ffn_hidden=8 * d_model,
        activation="squared_relu",
        positions="alibi",
        vocab_size=128256,
        seq_len=8192,
        tied_embeddings=False,
    )


# ---------------------------------------------------------------- parameter count


def test_param_count_by_hand_gelu_tied_learned():
    count = param_count(arch())
    # per layer: qkv 64*192 + 192, out 64*64 + 64, fc1 64*256 + 256, fc2 256*64 + 64, LN 4*64
    per_layer = 64 * 192 + 192 + 64 * 64 + 64 + 64 * 256 + 256 + 256 * 64 + 64 + 4 * 64
    assert per_layer == 49_984
    # + final LN 2*64, words 100*64 (tied: no output layer), positions 32*64
    assert count.total == 2 * per_layer + 128 + 6400 + 2048 == 108_544
    assert count.embedding == 6400 + 2048
    assert count.non_embedding == 2 * per_layer + 128
    assert count.breakdown["output_layer"] == 0
    assert sum(count.breakdown.values()) == count.total


def test_param_count_swiglu_has_three_matrices_and_untied_output():
    count = param_count(arch(activation="swiglu", positions="rope", tied_embeddings=False))
    assert count.breakdown["ffn_in_weight"] == 2 * (64 * 2 * 256)  # two d x f matrices fused
    assert count.breakdown["ffn_in_bias"] == 2 * (2 * 256)
    assert count.breakdown["ffn_out_weight"] == 2 * (256 * 64)
    assert count.breakdown["output_layer"] == 100 * 64
    assert count.breakdown["position_embeddings"] == 0
    assert count.embedding == 2 * 100 * 64


def test_param_count_uses_attention_width_not_d_model():
    # 4 heads of 8: attention width 32 != d_model 64
    count = param_count(arch(head_dim=8))
    assert count.breakdown["attention_qkv_weight"] == 2 * 64 * 96
    assert count.breakdown["attention_out_weight"] == 2 * 32 * 64


def test_celerity_sizes_land_near_their_names(capsys):
    """docs/method.md §8: vocab 128256 untied, squared-ReLU x8, ALiBi."""
    totals = {}
    for name, d, heads, head_dim, layers, _ in CELERITY:
        count = param_count(celerity_arch(d, heads, head_dim, layers))
        totals[name] = count.total
        # per layer 4 d^2 + 4 d (attention) + 16 d^2 + 9 d (FFN x8) + 4 d (LN) when heads*hd = d
        assert heads * head_dim == d
        expected = layers * (20 * d * d + 13 * d + 4 * d) + 2 * d + 2 * 128256 * d
        assert count.total == expected
    with capsys.disabled():
        print("\nCelerity parameter counts:", {k: f"{v / 1e6:.1f}M" for k, v in totals.items()})
    assert totals["300M"] == 270_806_400
    assert totals["3.9B"] == 3_882_176_512
    for name, total in totals.items():
        nominal = float(name[:-1]) * (1e9 if name.endswith("B") else 1e6)
        assert 0.85 < total / nominal < 1.1, name


_BUILD_GPT = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    import torch.nn.functional as F
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    from megatron.core import parallel_state
    from megatron.core.activations import squared_relu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    parallel_state.initialize_model_parallel()
    activations = {"gelu": F.gelu, "squared_relu": squared_relu, "swiglu": F.silu}
    positions = {"learned": "learned_absolute", "rope": "rope", "alibi": "none"}
    counts = []
    for a in json.loads(sys.argv[1]):
        config = TransformerConfig(
            num_layers=a["n_layers"], hidden_size=a["d_model"],
            num_attention_heads=a["n_heads"], kv_channels=a["head_dim"],
            ffn_hidden_size=a["ffn_hidden"], activation_func=activations[a["activation"]],
            gated_linear_unit=a["activation"] == "swiglu", layernorm_epsilon=a["norm_eps"],
            use_cpu_initialization=True, perform_initialization=False,
            params_dtype=torch.float32)
        model = GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=a["vocab_size"], max_sequence_length=a["seq_len"],
            position_embedding_type=positions[a["positions"]],
            share_embeddings_and_output_weights=a["tied_embeddings"])
        counts.append(sum(p.numel() for p in model.parameters()))
    print("COUNTS", json.dumps(counts))
    dist.destroy_process_group()
    """
)


def test_param_count_equals_megatron_gptmodel():
    """Build the real GPTModel on CPU (own process: torch.distributed must not leak)."""
    archs = [
        arch(),
        arch(activation="squared_relu", positions="alibi", tied_embeddings=False, head_dim=8),
        arch(
            activation="swiglu",
            positions="rope",
            tied_embeddings=False,
            n_layers=3,
            d_model=48,
            n_heads=3,
            ffn_hidden=80,
            vocab_size=77,
        ),
    ]
    payload = json.dumps([a.model_dump() for a in archs])
    done = subprocess.run(
        [sys.executable, "-c", _BUILD_GPT, payload, "29641"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("COUNTS"))
    megatron_counts = json.loads(line.split(" ", 1)[1])
    assert megatron_counts == [param_count(a).total for a in archs]


def test_param_count_is_frozen():
    count = param_count(arch())
    assert isinstance(count, ParamCount)
    with pytest.raises(AttributeError):
        count.total = 1  # type: ignore[misc]


# ---------------------------------------------------------------- tokens, batch, steps


def test_tokens_for_tpp():
    assert tokens_for_tpp(20, 270_806_400) == 5_416_128_000
    assert tokens_for_tpp(0.5, 3) == 2  # round(1.5) = 2 (banker's rounding)
    with pytest.raises(ValueError, match="tpp"):
        tokens_for_tpp(0, 100)
    with pytest.raises(ValueError, match="params"):
        tokens_for_tpp(20, 0)


def test_batch_power_law_in_2048_token_sequences():
    # D = 48.5e9: 0.0306 * 48.5e9^0.383 = 0.0306 * exp(0.383 * ln 48.5e9)
    seqs_2048 = 0.0306 * math.exp(0.383 * math.log(48.5e9))
    assert seqs_2048 == pytest.approx(378.8, abs=0.1)
    assert batch_seqs_power_law(48_500_000_000, 0.0306, 0.383, 2048, 1) == 379
    assert batch_seqs_power_law(48_500_000_000, 0.0306, 0.383, 2048, 8) == 376  # 47.35 -> 47 * 8
    # same tokens per batch in 8192-token sequences: 378.8 / 4 = 94.7 -> 96 (multiple of 8)
    assert batch_seqs_power_law(48_500_000_000, 0.0306, 0.383, 8192, 8) == 96
    # tiny D rounds up to the minimum
    assert batch_seqs_power_law(1000, 0.0306, 0.383, 2048, 4) == 4


def test_steps_and_realized_tokens():
    assert steps_for(1_000_000, 16, 128) == 488  # 1e6 / 2048 = 488.28
    assert steps_for(1_001_000, 16, 128) == 489  # 488.77
    assert steps_for(10, 16, 128) == 1
    assert realized_tokens(488, 16, 128) == 999_424
    with pytest.raises(ValueError, match="batch_seqs"):
        steps_for(100, 0, 128)


# ---------------------------------------------------------------- tau and weight decay


def test_tau_610m_check_from_the_paper():
    """docs/method.md §2: 610M, d 2048, d_base 256, eta_base 1.62e-2, lambda 0.1."""
    m610 = arch(d_model=2048, n_layers=24, n_heads=16, head_dim=128, ffn_hidden=8192)
    mup = mup_parameterization(
        m610,
        kind="mup",
        d_base=256,
        depth_base=24,
        sigma_base=8.67e-2,
        eta_base=1.62e-2,
        alpha_input=9.17,
        alpha_output=1.095,
        beta1=0.9,
        beta2=0.95,
        eps=1e-8,
    )
    assert mup.lr_hidden == pytest.approx(1.62e-2 / 8)  # 2.025e-3
    tau = tau_of(mup.lr_hidden, 0.1, 504 * 2048, 48_500_000_000)
    # 1032192 / (2.025e-3 * 0.1 * 48.5e9) = 1032192 / 9821250 = 0.10510
    assert round(tau, 3) == 0.105
    assert weight_decay_for_tau(tau, mup.lr_hidden, 504 * 2048, 48_500_000_000) == pytest.approx(
        0.1
    )


def test_weight_decay_for_tau_by_hand():
    # lambda = B / (eta tau D) = 4096 / (1e-2 * 0.2 * 4096000) = 0.5
    assert weight_decay_for_tau(0.2, 1e-2, 4096, 4_096_000) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="tau"):
        weight_decay_for_tau(0.0, 1e-2, 4096, 4_096_000)


def test_tau_power_law():
    assert tau_power_law(1) == pytest.approx(1.084)
    # 1.084 * 20^-0.527 = 1.084 * exp(-0.527 * 2.99573) = 1.084 * 0.20623 = 0.22356
    assert tau_power_law(20) == pytest.approx(0.22356, abs=1e-5)
    # Celerity used about 0.8x the law: 0.175 / 0.2236 = 0.78 at 20, 0.05 / 0.0612 = 0.82 at 234
    assert 0.175 / tau_power_law(20) == pytest.approx(0.79, abs=0.01)
    assert 0.05 / tau_power_law(234) == pytest.approx(0.8, abs=0.05)


# ---------------------------------------------------------------- warmup and schedule


def test_warmup_steps():
    assert warmup_steps(1000) == 100
    assert warmup_steps(1005) == 100  # round(100.5) = 100
    assert warmup_steps(1) == 0
    assert warmup_steps(5, fraction=0.5) == 2  # round(2.5) = 2
    # Celerity: min(10 % of tokens, 375M tokens); 1.44M-token batches (176 x 8192)
    batch_tokens = 176 * 8192
    assert warmup_steps(100_000, max_tokens=375_000_000, batch_tokens=batch_tokens) == 260
    assert warmup_steps(1_000, max_tokens=375_000_000, batch_tokens=batch_tokens) == 100
    with pytest.raises(ValueError, match="batch_tokens"):
        warmup_steps(1000, max_tokens=375_000_000)


def test_lr_at_by_hand():
    lrs = [lr_at(s, peak=1.0, warmup_steps=3, total_steps=10) for s in range(11)]
    assert lrs[:4] == [0.0, 1 / 3, 2 / 3, 1.0]
    assert lrs[4] == pytest.approx(6 / 7)  # 1 - (4 - 3) / (10 - 3)
    assert lrs[10] == 0.0
    assert lr_at(12, peak=1.0, warmup_steps=3, total_steps=10) == 0.0  # past the end: 0
    assert lr_at(0, peak=2.0, warmup_steps=0, total_steps=4) == 2.0
    with pytest.raises(ValueError, match="warmup_steps"):
        lr_at(0, peak=1.0, warmup_steps=10, total_steps=10)


def test_lr_at_matches_megatron_scheduler():
    import torch
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    peak, warmup, total = 3e-3, 7, 50
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=peak,
        min_lr=0.0,
        lr_warmup_steps=warmup,
        lr_decay_steps=total,
        lr_decay_style="linear",
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=total,
        wd_incr_style="constant",
    )
    for step in range(total + 1):
        ours = lr_at(step, peak=peak, warmup_steps=warmup, total_steps=total)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(ours, abs=1e-15), step
        scheduler.step(1)
    assert lr_at(total, peak=peak, warmup_steps=warmup, total_steps=total) == 0.0


# ---------------------------------------------------------------- parameterization

BASE = dict(
    d_base=256,
    depth_base=10,
    sigma_base=8.67e-2,
    eta_base=1.62e-2,
    alpha_input=9.17,
    alpha_output=1.095,
    beta1=0.9,
    beta2=0.95,
    eps=1e-8,
)


def test_mup_multipliers_by_hand():
    a = celerity_arch(2048, 16, 128, 40)
    mup = mup_parameterization(a, kind="mup", **BASE)
    assert mup.width_mult == 8.0
    assert mup.depth_mult == 1.0
    assert mup.residual_multiplier == 1.0
    assert mup.logit_multiplier == pytest.approx(1.095 / 8)
    assert mup.alpha_input == 9.17
    assert mup.attention_scale == 1 / 128
    assert mup.init_std_embedding == 8.67e-2
    assert mup.init_std_hidden == pytest.approx(8.67e-2 / math.sqrt(8))
    assert mup.init_std_output_proj == pytest.approx(8.67e-2 / math.sqrt(2 * 8 * 40))
    assert mup.init_std_unembedding == 8.67e-2
    assert mup.lr_hidden == mup.lr_output_proj == pytest.approx(1.62e-2 / 8)
    assert mup.lr_embedding == mup.lr_unembedding == mup.lr_norm_bias == 1.62e-2
    assert mup.adam_eps == 1e-8
    assert mup.wd_mult_embedding == mup.wd_mult_unembedding == 1.0  # "coupled", the default


def test_same_tau_decays_the_embeddings_on_the_hidden_timescale():
    a = celerity_arch(2048, 16, 128, 40)
    mup = mup_parameterization(a, kind="mup", embedding_decay="same_tau", **BASE)
    # lr_group x wd_mult x lambda is the hidden group's lr x lambda: 1/8 at width multiplier 8
    assert mup.wd_mult_embedding == mup.wd_mult_unembedding == pytest.approx(1 / 8)
    assert mup.lr_embedding * mup.wd_mult_embedding == pytest.approx(mup.lr_hidden)
    cp = mup_parameterization(a, kind="completep", embedding_decay="same_tau", **BASE)
    assert cp.lr_unembedding * cp.wd_mult_unembedding == pytest.approx(cp.lr_hidden)
    with pytest.raises(ValueError, match="embedding_decay"):
        mup_parameterization(a, kind="mup", embedding_decay="decoupled", **BASE)


def test_completep_depth_scaling_by_hand():
    a = celerity_arch(2048, 16, 128, 40)
    cp = mup_parameterization(a, kind="completep", **BASE)  # alpha 1: m_L = 40 / 10 = 4
    assert cp.depth_mult == 4.0
    assert cp.residual_multiplier == 0.25
    assert cp.lr_hidden == pytest.approx(1.62e-2 / 8)  # m_L^(alpha - 1) = 1
    assert cp.adam_eps == pytest.approx(1e-8 / (8 * 4))
    half = mup_parameterization(a, kind="completep", completep_alpha=0.5, **BASE)
    assert half.residual_multiplier == 0.5  # 4^-0.5
    assert half.lr_hidden == pytest.approx(1.62e-2 / 8 * 0.5)  # 4^(0.5 - 1)
    assert half.lr_norm_bias == pytest.approx(1.62e-2 * 0.5)
    assert half.adam_eps == pytest.approx(1e-8 / (8 * 2))
    with pytest.raises(ValueError, match="completep_alpha"):
        mup_parameterization(a, kind="completep", completep_alpha=2.0, **BASE)


def test_completep_scales_depth_once_through_the_residual_multiplier():
    """CompleteP (Dey et al. 2025): the output projections' init does not depend on depth; the
    branch x m_L^-alpha alone does. At the base depth the init is µP's sigma/sqrt(2 m_d L_base).
    Width 2048 (m_d 8), base depth 10, by hand."""
    expected_std = 8.67e-2 / math.sqrt(2 * 8 * 10)  # 0.00685...
    for layers, multiplier in ((10, 1.0), (20, 0.5), (40, 0.25), (80, 0.125)):
        cp = mup_parameterization(celerity_arch(2048, 16, 128, layers), kind="completep", **BASE)
        assert cp.init_std_output_proj == pytest.approx(expected_std)
        assert cp.residual_multiplier == pytest.approx(multiplier)  # 10 / L
        # the branch output at init scales as std x multiplier: 1/L, not 1/L^1.5
        assert cp.init_std_output_proj * cp.residual_multiplier == pytest.approx(
            expected_std * 10 / layers
        )
    mup = mup_parameterization(celerity_arch(2048, 16, 128, 10), kind="mup", **BASE)
    base = mup_parameterization(celerity_arch(2048, 16, 128, 10), kind="completep", **BASE)
    assert base.init_std_output_proj == mup.init_std_output_proj  # base depth: µP exactly
    deep_mup = mup_parameterization(celerity_arch(2048, 16, 128, 40), kind="mup", **BASE)
    assert deep_mup.init_std_output_proj == pytest.approx(8.67e-2 / math.sqrt(2 * 8 * 40))


def test_standard_parameterization():
    a = celerity_arch(640, 10, 64, 13)
    sp = mup_parameterization(a, kind="sp", **BASE)
    assert sp.width_mult == sp.depth_mult == sp.logit_multiplier == sp.alpha_input == 1.0
    assert sp.attention_scale == 1 / 8  # 1 / sqrt(64)
    assert sp.lr_hidden == sp.lr_embedding == sp.lr_unembedding == 1.62e-2
    assert sp.init_std_hidden == 8.67e-2
    assert sp.init_std_output_proj == pytest.approx(8.67e-2 / math.sqrt(26))


def test_mup_at_base_width_keeps_base_values():
    a = arch(d_model=256, n_heads=4, head_dim=64, ffn_hidden=1024)
    mup = mup_parameterization(a, kind="mup", **BASE)
    assert mup.width_mult == 1.0
    assert mup.lr_hidden == 1.62e-2
    assert mup.init_std_hidden == 8.67e-2
    with pytest.raises(ValueError, match="kind"):
        mup_parameterization(a, kind="umup", **BASE)  # type: ignore[arg-type]
