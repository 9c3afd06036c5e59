"""Checks that what a patch replaces still exists, so a Megatron-Core upgrade fails loudly."""

from __future__ import annotations

import inspect
from typing import Any


class PatchTargetMissing(RuntimeError):
    """A patched function, attribute or source pattern is gone from Megatron-Core."""


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:  # pragma: no cover - metadata missing only in odd installs
        return "unknown"


def require_attr(obj: Any, name: str, patch: str) -> Any:
    """Return ``obj.name``; raise naming the patch when an upgrade removed it."""
    if not hasattr(obj, name):
        owner = getattr(obj, "__name__", type(obj).__name__)
        raise PatchTargetMissing(
            f"megatron_patches.{patch}: megatron-core {_version()} has no {owner}.{name}; "
            f"the patch was written for 0.16.1. Review the patch against the new release "
            f"(or pin megatron-core==0.16.1)."
        )
    return getattr(obj, name)


def require_source(func: Any, pattern: str, patch: str) -> str:
    """Return the source of ``func``; raise when it no longer contains ``pattern``."""
    source = inspect.getsource(func)
    if pattern not in source:
        raise PatchTargetMissing(
            f"megatron_patches.{patch}: {func.__qualname__} in megatron-core {_version()} no "
            f"longer contains {pattern!r}; the patch was written for 0.16.1. Review it against "
            f"the new release (or pin megatron-core==0.16.1)."
        )
    return source


def require_value(obj: Any, name: str, expected: Any, patch: str) -> None:
    """Raise when ``obj.name`` is not the value the patch was written against."""
    value = require_attr(obj, name, patch)
    if value != expected:
        owner = getattr(obj, "__name__", type(obj).__name__)
        raise PatchTargetMissing(
            f"megatron_patches.{patch}: {owner}.{name} is {value!r} in megatron-core "
            f"{_version()}, the patch expects {expected!r} (0.16.1). Review the patch."
        )
