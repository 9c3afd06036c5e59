"""Megatron-Core GPTModel from a RunSpec, with µP / CompleteP wired in.

Everything is read from the resolved spec (``spec.model``, ``spec.mup``): nothing here computes
a scaling rule. Megatron hooks are used where they exist (``softmax_scale``, config_overrides);
``megatron_patches.mup`` adds the multipliers and the per-group init that have none.
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F

from collapse.runspec import RunSpec

POSITION_EMBEDDING = {"rope": "rope", "learned": "learned_absolute", "alibi": "none"}


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


# fp32 on GPU as well when set to "fp32": the full-precision reference of benchmarks/gpu_check.py
GPU_PRECISION_ENV = "COLLAPSE_GPU_PRECISION"


def params_dtype(on_gpu: bool) -> torch.dtype:
    """bf16 on GPU, fp32 on CPU (the CPU path is for correctness and tiny runs); fp32 on GPU
    too where $COLLAPSE_GPU_PRECISION is "fp32"."""
    if not on_gpu:
        return torch.float32
    precision = os.environ.get(GPU_PRECISION_ENV, "bf16")
    if precision not in ("bf16", "fp32"):
        raise ValueError(f"{GPU_PRECISION_ENV}={precision!r}: use bf16 (default) or fp32")
    return torch.bfloat16 if precision == "bf16" else torch.float32


def validate_arch(spec: RunSpec) -> None:
    """Fail before any process group exists, naming the spec field and the fix."""
    arch, par = spec.model, spec.parallel
    if arch.n_heads * arch.head_dim <= 0:
        raise ValueError("model.n_heads and model.head_dim must be positive")
    if arch.n_heads % par.tp:
        raise ValueError(
            f"model.n_heads={arch.n_heads} is not divisible by parallel.tp={par.tp}: "
            "choose a tp that divides the head count"
        )
    if arch.vocab_size % par.tp:
        raise ValueError(
            f"model.vocab_size={arch.vocab_size} is not divisible by parallel.tp={par.tp}: "
            "pad the vocabulary (tokenizer) to a multiple of tp"
        )
    if arch.n_layers % par.pp:
        raise ValueError(
            f"model.n_layers={arch.n_layers} is not divisible by parallel.pp={par.pp}: "
            "choose a pp that divides the layer count"
        )
    if (
        par.sequence_parallel
        and par.tp > 1
        and not (torch.cuda.is_available() and transformer_engine_available())
    ):
        raise ValueError(
            "parallel.sequence_parallel needs TransformerEngine's layers on a GPU (the local "
            "layer spec's LayerNorm cannot split the sequence): install transformer_engine, or "
            "plan with cluster.transformer_engine=false"
        )
    if spec.mup.kind != "sp" and spec.mup.attention_scale <= 0:
        raise ValueError("mup.attention_scale must be positive (µP: 1/head_dim)")


def transformer_config(spec: RunSpec, on_gpu: bool):
    """The TransformerConfig of a run (fp32 on CPU, bf16 on GPU; no dropout)."""
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch, par = spec.model, spec.parallel
    activation = {
        "gelu": (F.gelu, False),
        "squared_relu": (squared_relu, False),
        "swiglu": (F.silu, True),
    }[arch.activation]
    dtype = params_dtype(on_gpu)
    return TransformerConfig(
        num_layers=arch.n_layers,
        hidden_size=arch.d_model,
        num_attention_heads=arch.n_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden,
        activation_func=activation[0],
        gated_linear_unit=activation[1],
        layernorm_epsilon=arch.norm_eps,
        softmax_scale=spec.mup.attention_scale,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        sequence_parallel=par.sequence_parallel and par.tp > 1,
        **recompute_options(par.recompute),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        # megatron_patches.mup.init_parameters re-initialises every weight after construction;
        # Megatron's own init must still run: it sets the tensor-parallel attributes it reads
        use_cpu_initialization=True,
        perform_initialization=True,
    )


def recompute_options(recompute: str) -> dict:
    """TransformerConfig's activation recompute for the plan's choice (collapse.memory counts
    what each keeps): selective rebuilds the core attention, full every layer from its input."""
    if recompute == "none":
        return {}
    if recompute == "selective":
        return {"recompute_granularity": "selective"}
    if recompute == "full":
        return {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    raise ValueError(f"parallel.recompute must be none, selective or full, got {recompute!r}")


def layer_spec(spec: RunSpec, on_gpu: bool):
    """TransformerEngine layer spec on GPU where importable (ALiBi by TE's fused attention), else
    the local spec with SDPA attention (ALiBi as one bias shared by every layer)."""
    from megatron.core.models.gpt import gpt_layer_specs

    from megatron_patches.attention import use_sdpa_core_attention, use_te_alibi_core_attention

    alibi = spec.model.positions == "alibi"
    if on_gpu and transformer_engine_available():
        base = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
        return use_te_alibi_core_attention(base) if alibi else base
    return use_sdpa_core_attention(gpt_layer_specs.get_gpt_layer_local_spec(), alibi=alibi)


def init_std_by_group(spec: RunSpec) -> dict[str, float]:
    mup = spec.mup
    return {
        "embedding": mup.init_std_embedding,
        "hidden": mup.init_std_hidden,
        "output_proj": mup.init_std_output_proj,
        "unembedding": mup.init_std_unembedding,
    }


def lr_by_group(spec: RunSpec) -> dict[str, float]:
    mup = spec.mup
    return {
        "embedding": mup.lr_embedding,
        "hidden": mup.lr_hidden,
        "output_proj": mup.lr_output_proj,
        "unembedding": mup.lr_unembedding,
        "norm_bias": mup.lr_norm_bias,
    }


def wd_mult_by_group(spec: RunSpec) -> dict[str, float]:
    mup = spec.mup
    return {
        "embedding": mup.wd_mult_embedding,
        "hidden": 1.0,
        "output_proj": 1.0,
        "unembedding": mup.wd_mult_unembedding,
        "norm_bias": 0.0,
    }


def build_gpt_model(spec: RunSpec, pre_process: bool = True, post_process: bool = True):
    """GPTModel for this rank's pipeline stage, µP-initialised, multipliers attached.

    Needs ``megatron_patches.apply()`` and initialised model-parallel groups.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_patches import mup as mup_patch

    validate_arch(spec)
    on_gpu = torch.cuda.is_available()
    config = transformer_config(spec, on_gpu)
    arch = spec.model
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(spec, on_gpu),
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.seq_len,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=arch.tied_embeddings,
        position_embedding_type=POSITION_EMBEDDING[arch.positions],
    )
    mup_patch.init_parameters(
        model,
        init_std_by_group(spec),
        seed=spec.optim.seed,
        tied_embeddings=arch.tied_embeddings,
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
    )
    mup_patch.attach_multipliers(model, spec.mup.alpha_input, spec.mup.logit_multiplier)
    mup_patch.attach_residual_multiplier(model, spec.mup.residual_multiplier)
    if on_gpu:
        model.cuda(torch.cuda.current_device())
    return model


def count_parameters(model, tied_embeddings: bool) -> int:
    """Parameters of this rank's shard, counting a tied last-stage embedding copy once."""
    total = 0
    for name, param in model.named_parameters():
        if tied_embeddings and name.endswith("output_layer.weight"):
            continue
        total += param.numel()
    return total
