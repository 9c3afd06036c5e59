"""Every change this project makes to Megatron-Core 0.16.1, applied from one entry point.

``megatron_patches.apply()`` (call it before building any Megatron object) installs the global
patches and returns their names:

- ``cpu.*`` (``cpu.py``), only when CUDA is absent: the six places where Megatron-Core assumes
  CUDA (RNG tracker, global memory buffer, causal masks, ``torch.cuda`` call sites, grad
  clipping, optimizer type strings). On a GPU machine none of them is installed.
- ``optimizer_groups.group_key`` (``optimizer_groups.py``), always: parameter groups that differ
  only in their learning rate collide when optimizer state is loaded (a 0.16.1 bug).

Per-model changes are not global patches but functions the model builder calls:

- ``mup.py``: µP / CompleteP (embedding and logit multipliers, residual-branch multiplier,
  per-group init std, per-group LR and weight-decay overrides);
- ``attention.py``: an SDPA core attention for the local layer spec, with ALiBi.

Every patch checks, before replacing anything, that its target still exists in the installed
Megatron-Core and raises ``PatchTargetMissing`` naming the patch when an upgrade removed it.
"""

from __future__ import annotations

import os

from megatron_patches._guard import PatchTargetMissing

__all__ = ["PatchTargetMissing", "apply", "applied", "cuda_absent"]

_APPLIED: list[str] = []


def cuda_absent() -> bool:
    """True when the CPU patches are needed (``MCORE_CPU_PATCHES=1`` forces them for tests)."""
    import torch

    return os.environ.get("MCORE_CPU_PATCHES") == "1" or not torch.cuda.is_available()


def apply() -> list[str]:
    """Install the global patches once; return the names of those installed."""
    if _APPLIED:
        return list(_APPLIED)
    from megatron_patches import optimizer_groups

    names = []
    if cuda_absent():
        from megatron_patches import cpu

        names += cpu.apply_cpu_patches()
    names += optimizer_groups.apply_group_key_fix()
    _APPLIED.extend(names)
    return list(_APPLIED)


def applied() -> list[str]:
    """Names of the patches installed in this process."""
    return list(_APPLIED)
