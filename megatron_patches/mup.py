"""µP / CompleteP on Megatron-Core's GPTModel (docs/method.md §7).

Megatron-Core 0.16.1 has no µP switch. What it has is used directly:
- attention logits scale: ``TransformerConfig.softmax_scale`` (set by the caller, 1/d_head);
- per-group LR and weight decay: ``get_megatron_optimizer(config_overrides=...)`` with one
  ``ParamKey`` per group (``lr_overrides``). Each override carries ``wd_mult`` itself, so norms
  and biases keep "no weight decay" without merging Megatron's standard overrides back in.

What has no hook is added here, with plain PyTorch module hooks (no Megatron code replaced,
so nothing here depends on private Megatron functions):
- ``attach_multipliers``: embedding output x alpha_input (forward hook on ``model.embedding``);
  logits x logit_multiplier (forward pre-hook scaling the input of ``model.output_layer``, which
  is the same as scaling its output, and also covers tied embeddings);
- ``attach_residual_multiplier``: CompleteP's residual-branch multiplier, scaling the
  (output, bias) of every layer's attention and MLP before the bias-dropout-add;
- ``init_parameters``: per-group init std. Megatron's init callables cannot tell the
  unembedding from the hidden matrices (``GPTModel.output_layer`` uses ``config.init_method``),
  so every parameter is re-initialised after construction from its *global* name: a normal draw
  of the full (unsharded) tensor from a generator seeded by (seed, name), then the rank's
  tensor-parallel shard, cut the way Megatron's CPU initialisation cuts it (partition dim and
  stride). The result does not depend on TP, PP or DP: every layout starts from the same weights.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping

import torch

GROUPS = ("embedding", "hidden", "output_proj", "unembedding", "norm_bias")

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_HIDDEN = re.compile(r"\.(linear_qkv|linear_q|linear_kv|linear_fc1)\.weight$")
_OUTPUT_PROJ = re.compile(r"\.(linear_proj|linear_fc2)\.weight$")


def _strip_wrappers(name: str) -> str:
    while name.startswith("module."):  # DDP / Float16Module wrappers
        name = name[len("module.") :]
    return name


def classify_parameter(name: str, param: torch.Tensor, tied_embeddings: bool = False) -> str:
    """The µP group of a GPTModel parameter, by name; unknown matrices are an error."""
    name = _strip_wrappers(name)
    if param.dim() == 1:
        return "norm_bias"
    if name.startswith("embedding."):
        return "embedding"
    if name == "output_layer.weight":
        return "embedding" if tied_embeddings else "unembedding"
    if _HIDDEN.search(name):
        return "hidden"
    if _OUTPUT_PROJ.search(name):
        return "output_proj"
    raise ValueError(
        f"megatron_patches.mup: parameter {name!r} {tuple(param.shape)} belongs to no µP group "
        f"{GROUPS}; extend classify_parameter for this layer type"
    )


# ------------------------------------------------------------------------------ multipliers
def attach_multipliers(model, input_multiplier: float, logit_multiplier: float) -> list:
    """Scale the embedding output and the logits of a GPTModel; return the hook handles."""
    handles = []
    if input_multiplier != 1.0 and getattr(model, "pre_process", False):

        def scale_embedding(module, args, output):
            return output * input_multiplier

        handles.append(model.embedding.register_forward_hook(scale_embedding))
    if logit_multiplier != 1.0 and getattr(model, "post_process", False):

        def scale_unembedding_input(module, args, kwargs):
            if args:
                return (args[0] * logit_multiplier, *args[1:]), kwargs
            kwargs = dict(kwargs)
            kwargs["input_"] = kwargs["input_"] * logit_multiplier
            return args, kwargs

        handles.append(
            model.output_layer.register_forward_pre_hook(scale_unembedding_input, with_kwargs=True)
        )
    return handles


def attach_residual_multiplier(model, multiplier: float) -> list:
    """x + m * f(x) for every attention and MLP branch (CompleteP); return the hook handles."""
    if multiplier == 1.0:
        return []

    def scale_branch(module, args, output):
        out, bias = output
        return out * multiplier, (None if bias is None else bias * multiplier)

    handles = []
    for layer in model.decoder.layers:
        handles.append(layer.self_attention.register_forward_hook(scale_branch))
        handles.append(layer.mlp.register_forward_hook(scale_branch))
    return handles


# ------------------------------------------------------------------------------ init
def global_parameter_names(model) -> dict[str, str]:
    """Local parameter name -> name in the unsplit model (pipeline stages renumber layers)."""
    offsets = {}
    if getattr(model, "decoder", None) is not None:
        for local, layer in enumerate(model.decoder.layers):
            offsets[local] = layer.layer_number - 1  # layer_number is global and 1-based
    names = {}
    for name, _ in model.named_parameters():
        match = _LAYER.search(name)
        if match:
            local = int(match.group(1))
            name_global = name.replace(
                f"decoder.layers.{local}.", f"decoder.layers.{offsets[local]}."
            )
        else:
            name_global = name
        names[name] = name_global
    return names


def _shard(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    per_stride = param.shape[dim] // stride
    chunks = torch.split(full, per_stride, dim=dim)
    return torch.cat(chunks[tp_rank::tp_size], dim=dim)


def _full_shape(param: torch.Tensor, tp_size: int) -> list[int]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return shape


@torch.no_grad()
def init_parameters(
    model,
    init_std: Mapping[str, float],
    seed: int,
    tied_embeddings: bool = False,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> dict[str, str]:
    """Initialise every parameter by its µP group; return name -> group.

    Matrices: N(0, init_std[group]^2); norm weights 1, biases 0. The draw depends only on
    (seed, global name), never on the parallel layout.
    """
    missing = [g for g in GROUPS if g != "norm_bias" and g not in init_std]
    if missing:
        raise ValueError(f"megatron_patches.mup.init_parameters: init_std lacks groups {missing}")
    global_names = global_parameter_names(model)
    groups = {}
    for name, param in model.named_parameters():
        group = classify_parameter(name, param, tied_embeddings)
        groups[name] = group
        if group == "norm_bias":
            is_norm_weight = "norm" in name and name.endswith(".weight")
            param.fill_(1.0 if is_norm_weight else 0.0)
            continue
        if tp_size > 1 and not getattr(param, "tensor_model_parallel", False):
            raise ValueError(
                f"megatron_patches.mup.init_parameters: {name} carries no tensor-parallel "
                "attributes; build the model with perform_initialization=True"
            )
        source = global_names[name]
        if tied_embeddings and source == "output_layer.weight":
            source = "embedding.word_embeddings.weight"  # the last stage's copy of the embedding
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(source.encode()))
        full = torch.empty(_full_shape(param, tp_size), dtype=torch.float32)
        full.normal_(0.0, init_std[group], generator=generator)
        param.copy_(_shard(full, param, tp_rank, tp_size))
    return groups


# ------------------------------------------------------------------------------ optimizer
def lr_overrides(
    lr: Mapping[str, float],
    tied_embeddings: bool = False,
    wd_mult: Mapping[str, float] | None = None,
) -> dict:
    """``config_overrides`` for get_megatron_optimizer: one group per µP group.

    Every group has its own peak LR (``max_lr``, decayed to ``min_lr`` 0) and weight decay
    multiplier (``wd_mult``; by default 1, and 0 for norms and biases). Groups that differ only
    in LR need ``optimizer_groups.apply_group_key_fix`` to survive a checkpoint load
    (``megatron_patches.apply`` installs it).
    """
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamWithNamePredicate
    from megatron.core.optimizer_param_scheduler import ParamGroupOverride

    missing = [g for g in GROUPS if g not in lr]
    if missing:
        raise ValueError(f"megatron_patches.mup.lr_overrides: lr lacks groups {missing}")
    overrides = {}
    for group in GROUPS:

        def in_group(param, name, group=group):
            return classify_parameter(name, param, tied_embeddings) == group

        key = ParamKey(with_name_predicate=ParamWithNamePredicate(name=f"mup_{group}", fn=in_group))
        overrides[key] = ParamGroupOverride(
            max_lr=float(lr[group]),
            min_lr=0.0,
            wd_mult=float(wd_mult[group]) if wd_mult else (0.0 if group == "norm_bias" else 1.0),
        )
    return overrides
