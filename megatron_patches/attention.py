"""Core attention for Megatron-Core's local layer spec: PyTorch SDPA, with optional ALiBi.

Why: the local spec's ``DotProductAttention`` materializes the score matrix through a baddbmm
and an unfused softmax (slow on CPU), and Megatron-Core has ALiBi only through
TransformerEngine. This module has the same constructor and forward signature as
``DotProductAttention`` and is swapped into the layer spec's ``core_attention`` slot
(``use_sdpa_core_attention``), so the rest of Megatron (QKV projection, TP sharding, rotary
embeddings, recompute) is unchanged. The softmax scale comes from ``softmax_scale`` (µP: 1/d_head).

ALiBi (Press et al. 2022): score(i, j) += -slope_h * (i - j), slopes the geometric sequence of
the paper for the total head count; a tensor-parallel rank takes the slopes of its own heads.

The bias [heads/tp, sq, sk] depends only on the head slopes, the sequence lengths, the dtype and
the device, never on the layer: one module-level cache holds it once per process, and every
layer's attention reads that one tensor (``shared_alibi_bias``). Forty layers therefore hold one
bias, not forty; ``alibi_bias_bytes`` is its size for the memory plan.

With TransformerEngine (GPU), ``TEAlibiAttention`` replaces all of this with TE's fused
attention and its own ALiBi (``core_attention_bias_type="alibi"`` with the same slopes): no bias
tensor is materialized at all.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from megatron_patches._guard import PatchTargetMissing


def alibi_slopes(n_heads: int, device=None) -> torch.Tensor:
    """ALiBi head slopes; for a head count that is not a power of two, the paper's interleave."""

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_two(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32, device=device)


def alibi_bias(slopes: torch.Tensor, sq: int, sk: int) -> torch.Tensor:
    """Additive causal bias [heads, sq, sk]: -slope*(i-j) on and below the diagonal, -inf above."""
    i = torch.arange(sk - sq, sk).view(sq, 1)
    j = torch.arange(sk).view(1, sk)
    distance = (i - j).to(torch.float32)
    bias = -slopes.view(-1, 1, 1) * distance
    return bias.masked_fill(j > i, float("-inf"))


# (slopes of this rank's heads, sq, sk, dtype, device) -> the bias; shared by every layer
_ALIBI_CACHE: dict[tuple, torch.Tensor] = {}


def shared_alibi_bias(
    slopes: tuple[float, ...], sq: int, sk: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The ALiBi bias for these slopes and lengths: built once per process, then the same tensor.

    Keyed by the slope values themselves (a tuple, so no device read per call), so two
    tensor-parallel ranks in one process, or two models with different head counts, never share
    a wrong bias.
    """
    key = (slopes, sq, sk, dtype, torch.device(device))
    bias = _ALIBI_CACHE.get(key)
    if bias is None:
        values = torch.tensor(slopes, dtype=torch.float32)
        bias = alibi_bias(values, sq, sk).to(device=device, dtype=dtype)
        _ALIBI_CACHE[key] = bias
    return bias


def clear_alibi_cache() -> None:
    """Drop every cached bias (e.g. between models of different sequence lengths)."""
    _ALIBI_CACHE.clear()


def alibi_cache_bytes() -> int:
    """Bytes the cached ALiBi biases hold in this process (each counted once)."""
    seen = {}
    for bias in _ALIBI_CACHE.values():
        seen[bias.untyped_storage().data_ptr()] = bias.untyped_storage().nbytes()
    return sum(seen.values())


def alibi_bias_bytes(n_heads: int, seq_len: int, *, tp: int = 1, dtype_bytes: int = 2) -> int:
    """Bytes of the one shared ALiBi bias per GPU: heads/tp x seq x seq elements.

    What the SDPA path holds per process for training at ``seq_len`` (the TransformerEngine path
    holds none). The bias does not grow with the layer count.
    """
    return -(-n_heads // tp) * seq_len * seq_len * dtype_bytes


class SDPAttention(MegatronModule):
    """Drop-in for ``DotProductAttention`` (causal self-attention), computed by SDPA."""

    alibi = False  # SelfAttention instantiates the class itself: a subclass switches ALiBi on

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention: context parallelism needs TransformerEngine")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention: only causal attention, got {attn_mask_type}")
        if pg_collection is not None and hasattr(pg_collection, "tp"):
            tp_size, tp_rank = pg_collection.tp.size(), pg_collection.tp.rank()
        else:
            tp_size = parallel_state.get_tensor_model_parallel_world_size()
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
        heads = config.num_attention_heads
        if heads % tp_size:
            raise ValueError(f"n_heads {heads} is not divisible by tensor parallel size {tp_size}")
        self.heads_per_partition = heads // tp_size
        self.groups_per_partition = config.num_query_groups // tp_size
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        )
        self.dropout_p = (
            attention_dropout if attention_dropout is not None else config.attention_dropout
        )
        self.use_alibi = self.alibi
        if self.use_alibi:
            lo = tp_rank * self.heads_per_partition
            slopes = alibi_slopes(heads)[lo : lo + self.heads_per_partition]
            self.register_buffer("alibi_slopes", slopes, persistent=False)
            # read on the CPU: a model built on the meta device (memory checks) has no values
            cpu = alibi_slopes(heads, device="cpu")[lo : lo + self.heads_per_partition]
            self._slopes_key = tuple(cpu.tolist())

    def _alibi(self, sq: int, sk: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return shared_alibi_bias(self._slopes_key, sq, sk, dtype, device)

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention: packed sequences and attention_bias are unsupported")
        if attention_mask is not None:
            raise ValueError(
                "SDPAttention: an explicit attention_mask is unsupported (causal only); build the "
                "dataset with create_attention_mask=False"
            )
        # [s, b, heads, d] -> [b, heads, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.heads_per_partition != self.groups_per_partition:  # grouped-query attention
            repeat = self.heads_per_partition // self.groups_per_partition
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        dropout = self.dropout_p if self.training else 0.0
        sq, sk = q.shape[2], k.shape[2]
        mask = self._alibi(sq, sk, q.dtype, q.device) if self.use_alibi else None
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout else contextlib.nullcontext()
        with rng:
            context = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout,
                is_causal=mask is None,
                scale=self.softmax_scale,
            )
        # [b, heads, s, d] -> [s, b, heads*d]
        b, h, s, d = context.shape
        return context.permute(2, 0, 1, 3).reshape(s, b, h * d)


class SDPAlibiAttention(SDPAttention):
    """``SDPAttention`` with ALiBi position biases."""

    alibi = True


def te_alibi_attention_class():
    """A ``TEDotProductAttention`` with TE's own ALiBi, or None without TransformerEngine.

    Megatron-Core 0.16.1's ``TEDotProductAttention.forward`` passes TE only a post-scale bias
    tensor; TE's ``DotProductAttention.forward`` itself takes ``core_attention_bias_type="alibi"``
    and ``alibi_slopes`` (fp32, one per head of this rank) and applies -slope*(i-j) inside its
    fused kernel (flash or cuDNN), after the softmax scale, as ``SDPAttention`` does. The slopes
    are ``alibi_slopes`` cut to the rank's heads. Not run on this machine (no
    GPU, no TransformerEngine): the CPU path above is the one the tests check.
    """
    try:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
        from transformer_engine.pytorch import DotProductAttention as TEBase
    except ImportError:
        return None

    class TEAlibiAttention(TEDotProductAttention):
        def __init__(self, config, layer_number, attn_mask_type, attention_type, **kwargs):
            super().__init__(config, layer_number, attn_mask_type, attention_type, **kwargs)
            if attn_mask_type != AttnMaskType.causal:
                raise ValueError(f"TEAlibiAttention: only causal attention, got {attn_mask_type}")
            pg = kwargs.get("pg_collection")
            if pg is not None and hasattr(pg, "tp"):
                tp_size, tp_rank = pg.tp.size(), pg.tp.rank()
            else:
                tp_size = parallel_state.get_tensor_model_parallel_world_size()
                tp_rank = parallel_state.get_tensor_model_parallel_rank()
            per_rank = config.num_attention_heads // tp_size
            lo = tp_rank * per_rank
            # fp32, and not a buffer: Float16Module would round a buffer to bf16, and head
            # counts that are not powers of two have slopes that bf16 cannot hold
            self._slopes = alibi_slopes(config.num_attention_heads)[lo : lo + per_rank]

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, **kwargs):
            if any(kwargs.get(k) is not None for k in ("packed_seq_params", "attention_bias")):
                raise ValueError(
                    "TEAlibiAttention: packed sequences and attention_bias unsupported"
                )
            return TEBase.forward(
                self,
                query,
                key,
                value,
                attention_mask,
                attn_mask_type="causal",
                core_attention_bias_type="alibi",
                alibi_slopes=self._slopes_on(query.device),
            )

        def _slopes_on(self, device):
            if self._slopes.device != device:
                self._slopes = self._slopes.to(device)
            return self._slopes

    return TEAlibiAttention


def use_te_alibi_core_attention(layer_spec):
    """The TransformerEngine layer spec with TE's fused ALiBi attention; SDPA if TE lacks it."""
    te_class = te_alibi_attention_class()
    if te_class is None:
        return use_sdpa_core_attention(layer_spec, alibi=True)
    spec = copy.deepcopy(layer_spec)
    attention = spec.submodules.self_attention
    if not hasattr(attention.submodules, "core_attention"):
        raise PatchTargetMissing(
            "megatron_patches.attention: the GPT layer spec has no "
            "submodules.self_attention.submodules.core_attention (written for 0.16.1)"
        )
    attention.submodules.core_attention = te_class
    return spec


def use_sdpa_core_attention(layer_spec, alibi: bool = False):
    """Return the GPT layer spec with its ``core_attention`` replaced by ``SDPAttention``."""
    spec = copy.deepcopy(layer_spec)
    attention = spec.submodules.self_attention
    if not hasattr(attention.submodules, "core_attention"):
        raise PatchTargetMissing(
            "megatron_patches.attention: the GPT layer spec has no "
            "submodules.self_attention.submodules.core_attention (written for 0.16.1)"
        )
    attention.submodules.core_attention = SDPAlibiAttention if alibi else SDPAttention
    return spec
