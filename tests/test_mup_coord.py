"""µP coordinate check on the real training path.

Four widths at depth 2 go through ``collapse.train.build_stack`` (``build_gpt_model``, Megatron
DDP, ``get_megatron_optimizer`` with the per-group LR overrides) and ``train_step``, with the
Parameterization of ``collapse.scaling.mup_parameterization``. After a few AdamW steps on one
fixed batch, forward hooks read mean |x| of the embedding output, each layer's output and the
logits. Under µP these stay flat across width; under standard parameterization at the same eta
the updates grow with width, so the activations do too. This is the check that the µP wiring
(multipliers, per-group init, per-group LR) is right end to end, which no unit test of a single
hook can show.
"""

from __future__ import annotations

import torch
from test_train_support import VOCAB, tiny_spec

from collapse.scaling import mup_parameterization

WIDTHS = (64, 128, 256, 512)
D_BASE = 64
HEAD_DIM = 16  # fixed: heads grow with width, as in a µP family
LAYERS = 2
SEQ, BATCH = 32, 8
STEPS = 4
# docs/method.md §7: the paper's tuned proxy values
SIGMA, ETA, ALPHA_IN, ALPHA_OUT = 8.67e-2, 1.62e-2, 9.17, 1.095

# Thresholds from a measurement (largest/smallest width after 4 steps, this machine, fp32):
#   mup: embedding x0.97, layer0 x0.98, layer1 x0.99, logits x1.06
#   sp:  embedding x1.00, layer0 x47.8, layer1 x45.1, logits x1.92
# Under SP the residual stream grows faster than width (init std fixed, updates ~ eta * d);
# the logits grow less because the final layernorm rescales what the unembedding sees. The
# embedding coordinate does not depend on width under either parameterization (Adam moves each
# entry by ~eta), so it is only held flat, never asked to grow.
MUP_MAX_RATIO = 2.0  # every coordinate, both ways
SP_MIN_LAYER_RATIO = 10.0  # more than the width ratio (8)
SP_MIN_LOGIT_RATIO = 1.5


def coord_spec(root, d_model: int, kind: str):
    """A tiny RunSpec whose Parameterization is the project's own, at constant LR."""
    base = tiny_spec(
        root,
        run=f"coord_{kind}_{d_model}",
        d_model=d_model,
        n_layers=LAYERS,
        n_heads=d_model // HEAD_DIM,
        seq_len=SEQ,
        batch_seqs=BATCH,
        micro_batch_seqs=BATCH,
        kind=kind,
    )
    mup = mup_parameterization(
        base.model,
        kind=kind,
        d_base=D_BASE,
        depth_base=LAYERS,
        sigma_base=SIGMA,
        eta_base=ETA,
        alpha_input=ALPHA_IN,
        alpha_output=ALPHA_OUT,
        beta1=0.9,
        beta2=0.95,
        eps=1e-8,
    )
    # no warmup and a long schedule: the few steps here all run at (almost) the peak LR
    optim = base.optim.model_copy(
        update={"lr_peak": mup.lr_hidden, "warmup_steps": 0, "steps": 10_000, "weight_decay": 0.0}
    )
    return base.model_copy(update={"mup": mup, "optim": optim})


def fixed_batch() -> dict:
    """One batch of a toy language (repeating runs of tokens): structured, so gradients align."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randint(1, VOCAB, (BATCH, 1), generator=gen)
    period = torch.randint(2, 6, (BATCH, 1), generator=gen)
    pos = torch.arange(SEQ + 1)
    seq = 1 + (start + (pos % period) * 3) % (VOCAB - 1)
    return {
        "tokens": seq[:, :-1].contiguous(),
        "labels": seq[:, 1:].contiguous(),
        "loss_mask": torch.ones(BATCH, SEQ),
        "position_ids": pos[:SEQ].expand(BATCH, SEQ).contiguous(),
    }


def coordinates(root, d_model: int, kind: str) -> dict[str, float]:
    """mean |x| per coordinate after STEPS training steps on the fixed batch."""
    from collapse.train import build_stack, train_step

    spec = coord_spec(root, d_model, kind)
    stack = build_stack(spec)
    batch = fixed_batch()
    for _ in range(STEPS):
        loss, _, _ = train_step(stack, [batch], spec)
        assert torch.isfinite(torch.tensor(loss))
    gpt = stack.model.module
    scales: dict[str, float] = {}

    def record(name):
        def hook(module, args, output):
            x = output[0] if isinstance(output, tuple) else output
            scales[name] = x.detach().abs().mean().item()

        return hook

    # registered after the µP multiplier hooks, so they see the multiplied outputs
    modules = {"embedding": gpt.embedding}
    modules.update({f"layer{i}": layer for i, layer in enumerate(gpt.decoder.layers)})
    modules["logits"] = gpt.output_layer
    handles = [m.register_forward_hook(record(name)) for name, m in modules.items()]
    with torch.no_grad():
        stack.model.eval()
        gpt(batch["tokens"], batch["position_ids"], None)
    for handle in handles:
        handle.remove()
    return {name: scales[name] for name in modules}


def test_activations_stay_flat_across_width_under_mup_and_grow_under_sp(megatron_world, tmp_path):
    table = {kind: {d: coordinates(tmp_path, d, kind) for d in WIDTHS} for kind in ("mup", "sp")}
    names = list(table["mup"][WIDTHS[0]])
    ratio = {
        kind: {n: table[kind][WIDTHS[-1]][n] / table[kind][WIDTHS[0]][n] for n in names}
        for kind in table
    }
    print(f"\nmean |x| after {STEPS} AdamW steps (eta {ETA}, d_base {D_BASE}, depth {LAYERS})")
    print(f"{'kind':5} {'coordinate':10} " + " ".join(f"{'d=' + str(d):>9}" for d in WIDTHS))
    for kind in table:
        for n in names:
            row = " ".join(f"{table[kind][d][n]:9.4f}" for d in WIDTHS)
            print(f"{kind:5} {n:10} {row}  x{ratio[kind][n]:.2f}")
    for n in names:
        assert 1 / MUP_MAX_RATIO < ratio["mup"][n] < MUP_MAX_RATIO, (n, ratio["mup"][n])
    for n in names[1:-1]:
        assert ratio["sp"][n] > SP_MIN_LAYER_RATIO, (n, ratio["sp"][n])
    assert ratio["sp"]["logits"] > max(SP_MIN_LOGIT_RATIO, ratio["mup"]["logits"]), ratio
