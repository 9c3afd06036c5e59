"""A plain-PyTorch GPT (nanoGPT-style) of the same shape as the project's Megatron GPTModel.

The reference for bench_train.py: what the same arithmetic costs without Megatron-Core. Same
layout as Megatron's local layer spec with learned positions: pre-norm blocks, LayerNorm with
bias, fused QKV and output projections with bias, GELU MLP of ``ffn_hidden``, final LayerNorm, an
untied bias-free unembedding. Attention is PyTorch SDPA (causal) with the run's softmax scale;
the µP embedding and logit multipliers are applied as in ``megatron_patches.mup``, so both models
compute the same function class.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from collapse.runspec import RunSpec


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, head_dim: int, ffn: int, eps: float, scale):
        super().__init__()
        self.n_heads, self.head_dim, self.scale = n_heads, head_dim, scale
        inner = n_heads * head_dim
        self.ln_1 = nn.LayerNorm(d_model, eps=eps)
        self.c_attn = nn.Linear(d_model, 3 * inner)
        self.c_proj = nn.Linear(inner, d_model)
        self.ln_2 = nn.LayerNorm(d_model, eps=eps)
        self.c_fc = nn.Linear(d_model, ffn)
        self.mlp_proj = nn.Linear(ffn, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(self.n_heads * self.head_dim, dim=2)
        q, k, v = (t.view(b, s, self.n_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class PlainGPT(nn.Module):
    def __init__(self, spec: RunSpec):
        super().__init__()
        arch, mup = spec.model, spec.mup
        self.alpha_input, self.logit_multiplier = mup.alpha_input, mup.logit_multiplier
        self.wte = nn.Embedding(arch.vocab_size, arch.d_model)
        self.wpe = nn.Embedding(arch.seq_len, arch.d_model)
        self.blocks = nn.ModuleList(
            Block(
                arch.d_model,
                arch.n_heads,
                arch.head_dim,
                arch.ffn_hidden,
                arch.norm_eps,
                mup.attention_scale,
            )
            for _ in range(arch.n_layers)
        )
        self.ln_f = nn.LayerNorm(arch.d_model, eps=arch.norm_eps)
        self.lm_head = nn.Linear(arch.d_model, arch.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, 0.0, mup.init_std_hidden)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = (self.wte(tokens) + self.wpe(pos)) * self.alpha_input
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x) * self.logit_multiplier)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


def plain_optimizer(model: PlainGPT, spec: RunSpec) -> torch.optim.AdamW:
    """torch AdamW as nanoGPT sets it up: weight decay on matrices only."""
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": spec.optim.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=spec.mup.lr_hidden,
        betas=(spec.mup.adam_beta1, spec.mup.adam_beta2),
        eps=spec.mup.adam_eps,
    )


def plain_step(model: PlainGPT, optimizer, batch: dict, grad_clip: float) -> float:
    """One update as nanoGPT does it: forward, backward, clip, step."""
    optimizer.zero_grad(set_to_none=True)
    loss = model(batch["tokens"], batch["labels"])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss.item()
