"""Megatron-Core 0.16.1: optimizer parameter groups that differ only in their LR collide on load.

``MegatronOptimizer`` matches the parameter groups of a loaded checkpoint to the live ones by
``param_group_identifier_keys = ('wd_mult', 'lr_mult', 'is_expert_parallel', 'is_decoupled_lr')``.
A per-group learning rate set through ``config_overrides`` (µP: embedding, hidden, output
projections, unembedding) lives in ``max_lr``/``min_lr``, which that key ignores: two groups that
differ only there map to one key, and loading hands one group's state to the other (or fails).
The fix adds ``max_lr`` and ``min_lr`` to the key, in every module that imported it by name.
Every group carries both fields (``_get_param_groups`` sets them), so old and new groups match.
"""

from __future__ import annotations

from megatron_patches._guard import require_value

ORIGINAL_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
PATCHED_KEYS = (*ORIGINAL_KEYS, "max_lr", "min_lr")


def apply_group_key_fix() -> list[str]:
    import megatron.core.optimizer as optimizer_pkg
    from megatron.core.optimizer import distrib_optimizer, optimizer

    modules = (optimizer, distrib_optimizer, optimizer_pkg)
    if all(getattr(m, "param_group_identifier_keys", None) == PATCHED_KEYS for m in modules):
        return ["optimizer_groups.group_key"]
    for module in modules:
        require_value(
            module, "param_group_identifier_keys", ORIGINAL_KEYS, "optimizer_groups.group_key"
        )
    for module in modules:
        module.param_group_identifier_keys = PATCHED_KEYS
    return ["optimizer_groups.group_key"]
