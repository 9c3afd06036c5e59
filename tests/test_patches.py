"""megatron_patches: every patch applies to the installed Megatron-Core, does its one job, and
fails loudly when what it replaces is gone."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import types

import pytest
import torch

import megatron_patches
from megatron_patches import PatchTargetMissing, cpu, mup, optimizer_groups
from megatron_patches._guard import require_attr, require_source, require_value

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- entry point
def test_apply_installs_every_patch_on_this_megatron_core():
    """Run in a fresh interpreter: every target exists in the installed release."""
    code = "import megatron_patches, json; print(json.dumps(megatron_patches.apply()))"
    env = dict(os.environ, MCORE_CPU_PATCHES="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    names = out.stdout.strip().splitlines()[-1]
    for name in (*[f"cpu.{n}" for n in cpu.CPU_PATCHES], "optimizer_groups.group_key"):
        assert name in names


def test_guards_name_the_patch_when_a_target_is_gone():
    module = types.ModuleType("fake")
    with pytest.raises(PatchTargetMissing, match="megatron_patches.cpu.x.*fake.gone"):
        require_attr(module, "gone", "cpu.x")

    def plain_function():
        return 1

    with pytest.raises(PatchTargetMissing, match="no longer contains 'cuda'"):
        require_source(plain_function, "cuda", "cpu.y")
    module.keys = ("a",)
    with pytest.raises(PatchTargetMissing, match="expects"):
        require_value(module, "keys", ("b",), "optimizer_groups.group_key")


def test_cpu_patches_refuse_a_changed_target(monkeypatch):
    from megatron.core import utils
    from megatron.core.fusions import fused_softmax  # noqa: F401  (imported by the patch)
    from megatron.core.optimizer import clip_grads
    from megatron.core.tensor_parallel import random as mrandom

    monkeypatch.delattr(mrandom, "CudaRNGStatesTracker")
    with pytest.raises(PatchTargetMissing, match="cpu.rng_tracker"):
        cpu.patch_rng_tracker()
    monkeypatch.setattr(utils.GlobalMemoryBuffer, "get_tensor", lambda self, *a: None)
    with pytest.raises(PatchTargetMissing, match="cpu.memory_buffer"):
        cpu.patch_memory_buffer()
    monkeypatch.delattr(clip_grads, "clip_grad_by_total_norm_fp32")
    with pytest.raises(PatchTargetMissing, match="cpu.clip_grads"):
        cpu.patch_clip_grads()


def test_group_key_fix_refuses_an_unknown_key(monkeypatch):
    from megatron.core.optimizer import distrib_optimizer, optimizer

    monkeypatch.setattr(optimizer, "param_group_identifier_keys", ("wd_mult", "lr_mult"))
    monkeypatch.setattr(distrib_optimizer, "param_group_identifier_keys", ("wd_mult", "lr_mult"))
    with pytest.raises(PatchTargetMissing, match="optimizer_groups.group_key"):
        optimizer_groups.apply_group_key_fix()


# ----------------------------------------------------------------------------- cpu
def test_rng_tracker_forks_the_cpu_generator(megatron_world):
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    assert type(tracker).__name__ == "CpuRNGStatesTracker"
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # outside state untouched
    with tracker.fork():
        b = torch.rand(3)
    assert not torch.equal(a, b)  # the forked stream advances


def test_memory_buffer_masks_and_proxy_stay_on_cpu(megatron_world):
    from megatron.core import parallel_state
    from megatron.core.optimizer import optimizer as moptimizer
    from megatron.core.transformer import utils as tutils

    buffer = parallel_state.get_global_memory_buffer().get_tensor((2, 3), torch.float32, "t")
    assert buffer.device.type == "cpu" and buffer.shape == (2, 3)
    mask = tutils.get_default_causal_mask(4)
    assert mask.device.type == "cpu" and mask[0, 1] and not mask[1, 0]
    proxied = moptimizer.torch
    assert proxied is not torch and proxied.cuda.current_device() == "cpu"
    assert proxied.zeros(2, device="cuda").device.type == "cpu"
    assert torch.zeros(1).device.type == "cpu"  # real torch untouched


def test_clip_grads_scales_cpu_gradients(megatron_world):
    from megatron.core.optimizer import clip_grads

    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.full((4,), 2.0)
    clip_grads.clip_grad_by_total_norm_fp32([param], max_norm=1.0, total_norm=4.0)
    assert param.grad.tolist() == pytest.approx([0.5] * 4, rel=1e-5)


def test_type_string_checks_are_cpu_names(megatron_world):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    code = DistributedOptimizer._build_model_and_main_param_groups.__code__
    assert "megatron_patches.cpu.type_strings" in code.co_filename
    assert "torch.FloatTensor" in code.co_consts


# ----------------------------------------------------------------------------- optimizer groups
def test_groups_that_differ_only_in_lr_load_into_the_right_group():
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    def group(max_lr, params):
        return dict(
            params=params, wd_mult=1.0, lr_mult=1.0, is_expert_parallel=False,
            is_decoupled_lr=False, max_lr=max_lr, min_lr=0.0,
        )  # fmt: skip

    current = [group(1e-2, [0]), group(5e-3, [1])]
    saved = [group(5e-3, [1]), group(1e-2, [0])]  # another order on disk
    megatron_patches.apply()
    loaded = MegatronOptimizer._filter_and_reorder_param_groups(current, saved)
    assert [g["max_lr"] for g in loaded] == [1e-2, 5e-3]
    from megatron.core.optimizer import optimizer as moptimizer

    original = moptimizer.param_group_identifier_keys
    moptimizer.param_group_identifier_keys = optimizer_groups.ORIGINAL_KEYS
    try:  # the 0.16.1 bug the patch fixes: both groups get one loaded group
        wrong = MegatronOptimizer._filter_and_reorder_param_groups(current, saved)
        assert wrong[0]["max_lr"] == wrong[1]["max_lr"]
    finally:
        moptimizer.param_group_identifier_keys = original


# ----------------------------------------------------------------------------- µP
def _tiny_gpt(layers=2, hidden=32, heads=4, vocab=64, seq=16, tied=False):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_patches.attention import use_sdpa_core_attention

    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        softmax_scale=1.0 / (hidden // heads),
    )  # fmt: skip
    spec = use_sdpa_core_attention(get_gpt_layer_local_spec())
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq,
        share_embeddings_and_output_weights=tied,
    )  # fmt: skip
    return model.eval()


STDS = {"embedding": 0.5, "hidden": 0.05, "output_proj": 0.01, "unembedding": 0.2}


def _inputs(vocab=64, seq=16):
    tokens = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0))
    return tokens, torch.arange(seq).expand(2, seq)


def test_init_by_group_sets_each_std_and_is_seed_deterministic(megatron_world):
    model = _tiny_gpt(hidden=64)
    groups = mup.init_parameters(model, STDS, seed=3)
    assert set(groups.values()) == set(mup.GROUPS)
    params = dict(model.named_parameters())
    assert groups["output_layer.weight"] == "unembedding"
    assert groups["decoder.layers.1.mlp.linear_fc2.weight"] == "output_proj"
    assert groups["decoder.layers.0.self_attention.linear_qkv.weight"] == "hidden"
    for name, group in groups.items():
        if group != "norm_bias":
            assert params[name].std().item() == pytest.approx(STDS[group], rel=0.1), name
    assert torch.all(params["decoder.final_layernorm.weight"] == 1)
    assert torch.all(params["decoder.layers.0.mlp.linear_fc1.bias"] == 0)
    again = _tiny_gpt(hidden=64)
    mup.init_parameters(again, STDS, seed=3)
    assert all(torch.equal(p, params[n]) for n, p in again.named_parameters())
    mup.init_parameters(again, STDS, seed=4)
    assert not torch.equal(again.output_layer.weight, params["output_layer.weight"])


def test_init_shards_like_megatron_tensor_parallel():
    full = torch.arange(24.0).view(6, 4)
    param = torch.empty(3, 4)
    param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, 0, 1
    assert torch.equal(mup._shard(full, param, 1, 2), full[3:])
    param.partition_stride = 3  # [gate, up, ...] interleaving: every rank takes its part of each
    assert mup._shard(full, param, 1, 2).tolist() == [full[1].tolist(), full[3].tolist(),
                                                     full[5].tolist()]  # fmt: skip


def test_embedding_and_logit_multipliers(megatron_world):
    tokens, positions = _inputs()
    model = _tiny_gpt()
    mup.init_parameters(model, STDS, seed=1)
    with torch.no_grad():
        base_embedding = model.embedding(input_ids=tokens, position_ids=positions)
        base_logits = model(tokens, positions, None)
    handles = mup.attach_multipliers(model, input_multiplier=3.0, logit_multiplier=1.0)
    with torch.no_grad():
        embedding = model.embedding(input_ids=tokens, position_ids=positions)
    assert torch.allclose(embedding, 3.0 * base_embedding)
    for handle in handles:
        handle.remove()
    mup.attach_multipliers(model, input_multiplier=1.0, logit_multiplier=0.25)
    with torch.no_grad():
        logits = model(tokens, positions, None)
    assert torch.allclose(logits, 0.25 * base_logits, atol=1e-6)


def test_residual_multiplier_scales_every_branch(megatron_world):
    tokens, positions = _inputs()
    model = _tiny_gpt()
    mup.init_parameters(model, STDS, seed=1)
    mup.attach_residual_multiplier(model, 0.0)  # branches off: the stream is the embedding
    captured = {}
    model.decoder.final_layernorm.register_forward_hook(
        lambda m, args, out: captured.setdefault("x", args[0])
    )
    with torch.no_grad():
        model(tokens, positions, None)
        embedding = model.embedding(input_ids=tokens, position_ids=positions)
    assert torch.allclose(captured["x"], embedding)


def test_lr_overrides_give_one_group_per_mup_group(megatron_world):
    from megatron.core.optimizer import _get_param_groups
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    model = _tiny_gpt()
    lrs = {"embedding": 1.0, "hidden": 0.5, "output_proj": 0.25, "unembedding": 0.125,
           "norm_bias": 2.0}  # fmt: skip
    groups = _get_param_groups(
        [model], OptimizerConfig(lr=0.5, weight_decay=0.1), mup.lr_overrides(lrs)
    )
    by_lr = {g["max_lr"]: g for g in groups if g["params"]}
    assert sorted(by_lr) == sorted(lrs.values())
    assert by_lr[2.0]["wd_mult"] == 0.0 and all(p.dim() == 1 for p in by_lr[2.0]["params"])
    assert all(g["wd_mult"] == 1.0 for lr, g in by_lr.items() if lr != 2.0)
    assert by_lr[0.125]["params"] == [model.output_layer.weight]
    wd = {"embedding": 0.25, "hidden": 1.0, "output_proj": 1.0, "unembedding": 0.25,
          "norm_bias": 0.0}  # fmt: skip
    groups = _get_param_groups(
        [model], OptimizerConfig(lr=0.5, weight_decay=0.1), mup.lr_overrides(lrs, wd_mult=wd)
    )
    by_lr = {g["max_lr"]: g for g in groups if g["params"]}
    assert {lr: by_lr[lr]["wd_mult"] for lr in by_lr} == {lrs[k]: v for k, v in wd.items()}


def test_unknown_parameters_are_an_error():
    with pytest.raises(ValueError, match="belongs to no µP group"):
        mup.classify_parameter("decoder.layers.0.router.weight", torch.empty(2, 2))


# ----------------------------------------------------------------------------- attention
def _qkv(seq=8, heads=4, dim=8):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(seq, 2, heads, dim, generator=gen) for _ in range(3)]


def test_sdpa_attention_matches_megatron_dot_product_attention(megatron_world):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_patches.attention import SDPAttention

    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, attention_dropout=0.0
    )
    args = dict(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                attention_type="self", softmax_scale=1 / 8)  # fmt: skip
    q, k, v = _qkv()
    reference = DotProductAttention(**args)(q, k, v, None)
    assert torch.allclose(SDPAttention(**args)(q, k, v, None), reference, atol=1e-5)


def test_alibi_matches_an_explicit_computation(megatron_world):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_patches.attention import SDPAlibiAttention, alibi_slopes

    assert alibi_slopes(8).tolist() == pytest.approx([2 ** -(i + 1) for i in range(8)])
    assert len(alibi_slopes(6)) == 6
    config = TransformerConfig(
        num_layers=1, hidden_size=32, num_attention_heads=4, attention_dropout=0.0
    )
    attention = SDPAlibiAttention(
        config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
        attention_type="self", softmax_scale=0.125,
    )  # fmt: skip
    q, k, v = _qkv()
    out = attention(q, k, v, None)
    slopes = alibi_slopes(4)
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    scores = qb @ kb.transpose(-1, -2) * 0.125
    i, j = torch.arange(8).view(8, 1), torch.arange(8).view(1, 8)
    scores = scores - slopes.view(1, 4, 1, 1) * (i - j)
    scores = scores.masked_fill(j > i, -math.inf)
    expected = (scores.softmax(-1) @ vb).permute(2, 0, 1, 3).reshape(8, 2, 32)
    assert torch.allclose(out, expected, atol=1e-5)


def test_every_layer_reads_one_alibi_bias_counted_once(megatron_world, tmp_path):
    """A 3-layer ALiBi GPT: one bias tensor for all layers, its bytes heads x s x s x 4 once."""
    from test_train_support import tiny_spec

    from collapse.model import build_gpt_model
    from megatron_patches import attention

    attention.clear_alibi_cache()
    spec = tiny_spec(tmp_path, n_layers=3, positions="alibi", seq_len=16)
    model = build_gpt_model(spec)
    seen = []
    for layer in model.decoder.layers:
        core = layer.self_attention.core_attention
        assert isinstance(core, attention.SDPAlibiAttention)

        def spy(*args, _orig=core._alibi):
            bias = _orig(*args)
            seen.append(bias)
            return bias

        core._alibi = spy
    tokens = torch.randint(0, spec.model.vocab_size, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    model(tokens, positions, None).float().sum().backward()
    assert len(seen) == 3
    assert len({b.untyped_storage().data_ptr() for b in seen}) == 1  # one storage, three layers
    heads, s = spec.model.n_heads, 16
    assert seen[0].shape == (heads, s, s)
    assert attention.alibi_cache_bytes() == heads * s * s * 4  # fp32 on CPU, counted once
    assert attention.alibi_bias_bytes(heads, s, dtype_bytes=4) == heads * s * s * 4
    # Celerity 3.9B on one GPU: 16 heads x 8192^2 x 2 bytes = 2 GiB per process (per layer it
    # was 40 x that); over tensor-parallel 2, half.
    assert attention.alibi_bias_bytes(16, 8192) == 2 * 2**30
    assert attention.alibi_bias_bytes(16, 8192, tp=2) == 2**30
    attention.clear_alibi_cache()
    assert attention.alibi_cache_bytes() == 0


def test_the_alibi_cache_keeps_ranks_and_lengths_apart():
    """Different slopes (another TP rank's heads) or lengths get their own bias, equal values
    get the same tensor."""
    from megatron_patches import attention

    attention.clear_alibi_cache()
    slopes = tuple(attention.alibi_slopes(4).tolist())
    cpu = torch.device("cpu")
    a = attention.shared_alibi_bias(slopes[:2], 8, 8, torch.float32, cpu)
    b = attention.shared_alibi_bias(slopes[2:], 8, 8, torch.float32, cpu)
    c = attention.shared_alibi_bias(slopes[:2], 4, 4, torch.float32, cpu)
    assert a is attention.shared_alibi_bias(tuple(slopes[:2]), 8, 8, torch.float32, cpu)
    assert not torch.equal(a, b) and c.shape == (2, 4, 4)
    assert torch.equal(a, attention.alibi_bias(torch.tensor(slopes[:2]), 8, 8))
    assert attention.alibi_cache_bytes() == (2 * 64 + 2 * 64 + 2 * 16) * 4
    attention.clear_alibi_cache()


def test_without_transformer_engine_the_te_spec_falls_back_to_the_shared_sdpa_bias():
    """TE's fused ALiBi needs TransformerEngine (a GPU machine); without it, the SDPA class."""
    import importlib.util

    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_patches import attention

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("TransformerEngine is installed: the fused path is used")
    assert attention.te_alibi_attention_class() is None
    spec = attention.use_te_alibi_core_attention(gpt_layer_specs.get_gpt_layer_local_spec())
    core = spec.submodules.self_attention.submodules.core_attention
    assert core is attention.SDPAlibiAttention


def test_the_optimizer_decays_each_group_by_the_specs_multiplier(megatron_world, tmp_path):
    from test_train_support import tiny_spec

    from collapse.train import build_stack

    spec = tiny_spec(tmp_path)
    wd = {"wd_mult_embedding": 0.25, "wd_mult_unembedding": 0.5}
    spec = spec.model_copy(update={"mup": spec.mup.model_copy(update=wd)})
    stack = build_stack(spec)
    gpt = stack.model.module
    by_param = {id(p): g for g in stack.optimizer.param_groups for p in g["params"]}

    def decay(param):
        group = by_param[id(param)]
        return group["wd_mult"], group["weight_decay"]

    assert decay(gpt.embedding.word_embeddings.weight) == pytest.approx((0.25, 0.025))
    assert decay(gpt.output_layer.weight) == pytest.approx((0.5, 0.05))
    assert decay(gpt.decoder.layers[0].mlp.linear_fc1.weight) == pytest.approx((1.0, 0.1))
    assert decay(gpt.decoder.final_layernorm.weight)[0] == 0.0
