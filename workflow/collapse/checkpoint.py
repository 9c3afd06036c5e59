"""Training checkpoints that a killed job can trust: written aside, verified, then published.

Layout under ``spec.checkpoint_dir`` (outside the rule's declared outputs, so Snakemake never
deletes it before a rerun):

    step_00000120/            one complete checkpoint
        <dist_checkpointing files>   model + optimizer (sharded) + scheduler (common state)
        train_state.pt        curve rows so far, held-out rows, restarts, wall time (rank 0)
        MANIFEST.json         size and CRC32 of every file above; written last
    latest                    name of the newest complete checkpoint (a convenience only)
    .tmp_step_00000140/       a save in progress (or killed): never loaded, removed on the next save

A save writes into ``.tmp_*``, then the manifest, then renames the directory: a directory named
``step_*`` with a manifest whose files all match is complete. On resume the newest such
directory wins; one whose files do not match its manifest (truncated, corrupt) is skipped with a
warning and the previous one is used. The data position needs no state: the batch of step t is a
pure function of t (see collapse.train), and dropout is off, so RNG states are not saved either.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import zlib
from pathlib import Path

import torch

MANIFEST = "MANIFEST.json"
TRAIN_STATE = "train_state.pt"
LATEST = "latest"
_PREFIX = "step_"
_TMP_PREFIX = ".tmp_step_"


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was expected, or a save failed."""


def lock_run(checkpoint_dir: str | Path):
    """Hold an exclusive lock on a run's checkpoint folder for the life of the process.

    Two trainings of one run would remove each other's saves in progress; the second one is
    refused instead. Returns the open lock file (keep a reference), or raises CheckpointError.
    """
    import fcntl

    root = Path(checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    handle = (root / ".lock").open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise CheckpointError(
            f"another training of this run is already running (it holds {root / '.lock'}); "
            "wait for it to finish or stop it, then rerun"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: Path, step: int) -> None:
    entries = {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "crc32": _crc32(p)}
        for p in _files(directory)
    }
    text = json.dumps({"step": step, "files": entries}, indent=1, sort_keys=True)
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(text)
    tmp.replace(directory / MANIFEST)


def verify(directory: Path) -> str | None:
    """None when the checkpoint is complete and intact, else what is wrong with it."""
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return "no manifest (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError):
        return "unreadable manifest"
    if TRAIN_STATE not in files:
        return f"manifest lists no {TRAIN_STATE}"
    for name, entry in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != entry["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {entry['bytes']}"
        if _crc32(path) != entry["crc32"]:
            return f"{name} does not match its checksum"
    return None


def step_of(directory: Path) -> int:
    return int(directory.name[len(_PREFIX) :])


def candidates(checkpoint_dir: Path) -> list[Path]:
    """Published checkpoint directories, newest first (not yet verified)."""
    if not checkpoint_dir.is_dir():
        return []
    dirs = [
        p
        for p in checkpoint_dir.iterdir()
        if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX) :].isdigit()
    ]
    return sorted(dirs, key=step_of, reverse=True)


def latest_complete(checkpoint_dir: str | Path, log=print) -> Path | None:
    """The newest checkpoint that passes ``verify``; broken ones are reported and skipped."""
    for directory in candidates(Path(checkpoint_dir)):
        problem = verify(directory)
        if problem is None:
            return directory
        log(f"checkpoint {directory} is unusable ({problem}); trying the previous one")
    return None


def _is_rank0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _broadcast_path(path: Path | None) -> Path | None:
    """Rank 0's decision, for every rank (so all load the same checkpoint or none)."""
    if not torch.distributed.is_initialized():
        return path
    box = [str(path) if path is not None else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return Path(box[0]) if box[0] is not None else None


def save(
    checkpoint_dir: str | Path,
    step: int,
    sharded_state: dict,
    train_state: dict,
    keep: int,
) -> Path:
    """Save collectively (every rank calls it); return the published directory."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    root = Path(checkpoint_dir)
    tmp = root / f"{_TMP_PREFIX}{step:08d}"
    final = root / step_dir_name(step)
    if _is_rank0():
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(f"{_TMP_PREFIX}*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    try:
        dist_checkpointing.save(sharded_state, str(tmp))
    except (Exception, CheckpointException) as err:  # disk full, quota, I/O: the last one stands
        raise CheckpointError(
            f"saving the step-{step} checkpoint into {tmp} failed ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); the previous checkpoint in "
            f"{root} is intact. Check free disk space there, then rerun to resume"
        ) from err
    _barrier()
    if _is_rank0():
        torch.save(train_state, tmp / TRAIN_STATE)
        write_manifest(tmp, step)
        if final.exists():  # a rerun that reached the same step again
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest_tmp = root / (LATEST + ".tmp")
        latest_tmp.write_text(final.name + "\n")
        latest_tmp.replace(root / LATEST)
        prune(root, keep)
    _barrier()
    return final


def prune(root: Path, keep: int) -> None:
    """Keep the ``keep`` newest checkpoints (at least one)."""
    for old in candidates(root)[max(1, keep) :]:
        shutil.rmtree(old, ignore_errors=True)


def find_resume_point(checkpoint_dir: str | Path) -> Path | None:
    """Collectively pick the checkpoint to resume from (rank 0 verifies, all ranks agree)."""
    found = None
    if _is_rank0():
        found = latest_complete(checkpoint_dir, log=lambda m: print(m, file=sys.stderr))
    return _broadcast_path(found)


def read_train_state(directory: Path) -> dict:
    """The train state of a verified checkpoint alone (cheap: no model or optimizer)."""
    return torch.load(directory / TRAIN_STATE, weights_only=False)


def set_aside(checkpoint_dir: str | Path, tag: str) -> Path:
    """Collectively move every checkpoint (and ``latest``) into ``superseded-<tag>/`` inside
    ``checkpoint_dir``: kept for the user to inspect or delete, invisible to resume."""
    root = Path(checkpoint_dir)
    target = root / f"superseded-{tag}"
    if _is_rank0():
        target.mkdir(parents=True, exist_ok=True)
        for path in [*candidates(root), root / LATEST]:
            if path.exists():
                os.replace(path, target / path.name)
    _barrier()
    return target


def load(directory: Path, sharded_state: dict) -> tuple[dict, dict]:
    """Load (collectively) the sharded state and the train state of a verified checkpoint."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(sharded_state, str(directory))
    train_state = torch.load(directory / TRAIN_STATE, weights_only=False)
    return state, train_state
