"""Outputs written whole or not at all: a command builds them in a staging folder beside their
destination and moves them into place only when everything succeeded."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def staged_folder(out: Path, mode: str):
    """A fresh folder beside ``out`` to write into, moved into place only on success.

    "replace": the folder replaces ``out`` (stale files vanish); "merge": its files are moved
    into ``out`` one by one. On any error the staging folder is deleted and ``out`` is as it was.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        yield work
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    if mode == "merge":
        for path in sorted(p for p in work.rglob("*") if p.is_file()):
            target = out / path.relative_to(work)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
        shutil.rmtree(work, ignore_errors=True)
        return
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        os.replace(out, old / "previous")
    os.replace(work, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
