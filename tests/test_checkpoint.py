"""Checkpoints and resume: an interrupted run gives exactly the curve of an uninterrupted one."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest
from test_train_support import REPO, job_env, run_training, tiny_spec, train_command, write_spec

from collapse import checkpoint
from collapse.train import EXIT_PREEMPTED

STEPS = 12


def _spec(root: Path, run: str):
    # d_model 64 = 2x the base width: the µP groups then differ only in their LR, which is
    # what the optimizer-group patch must keep apart on load
    return tiny_spec(root, run=run, steps=STEPS, d_model=64, checkpoint_every=4, eval_every=6)


def _curve(spec) -> pd.DataFrame:
    return pd.read_parquet(Path(spec.run_dir) / "curve.parquet")


def _start_and_interrupt(spec, root: Path, at_step: int, how: int) -> subprocess.Popen:
    """Start the job; send ``how`` once it has logged step ``at_step``; wait for it to end.

    The job runs in its own session so that SIGKILL reaches its helper processes too (Megatron's
    checkpoint writer keeps a multiprocessing manager), as a Slurm job kill would.
    """
    log_path = root / f"{spec.run}.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(
            train_command(write_spec(spec, root)),
            env=job_env(),
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.time() + 180
        while f"step {at_step}/" not in log_path.read_text():
            assert proc.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.05)
        if how == signal.SIGKILL:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.send_signal(how)
        proc.wait(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the job, if any
    return proc


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    root = tmp_path_factory.mktemp("straight")
    spec = _spec(root, "straight")
    proc = run_training(spec, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return spec


def test_sigterm_saves_exits_and_resumes_to_the_same_curve(tmp_path: Path, straight):
    spec = _spec(tmp_path, "preempted")
    proc = _start_and_interrupt(spec, tmp_path, at_step=6, how=signal.SIGTERM)
    assert proc.returncode == EXIT_PREEMPTED
    assert not (Path(spec.run_dir) / "meta.json").exists()  # no finished-looking outputs
    saved = checkpoint.latest_complete(spec.checkpoint_dir)
    assert saved is not None and checkpoint.step_of(saved) >= 6
    resumed = run_training(spec, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    curve, reference = _curve(spec), _curve(straight)
    assert curve["loss"].tolist() == reference["loss"].tolist()  # exactly
    assert curve["grad_norm"].tolist() == reference["grad_norm"].tolist()
    assert curve["lr"].tolist() == reference["lr"].tolist()
    assert curve["restart"].sum() == 1
    assert curve.loc[curve["restart"], "step"].item() == checkpoint.step_of(saved) + 1
    valid = pd.read_parquet(Path(spec.run_dir) / "valid.parquet")
    valid_ref = pd.read_parquet(Path(straight.run_dir) / "valid.parquet")
    assert valid["valid_loss"].tolist() == valid_ref["valid_loss"].tolist()


def test_kill_9_then_rerun_gives_the_same_curve(tmp_path: Path, straight):
    spec = _spec(tmp_path, "killed")
    proc = _start_and_interrupt(spec, tmp_path, at_step=7, how=signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    resumed = run_training(spec, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert _curve(spec)["loss"].tolist() == _curve(straight)["loss"].tolist()


def test_a_corrupt_checkpoint_falls_back_to_the_previous_one(tmp_path: Path, straight):
    spec = _spec(tmp_path, "corrupt")
    proc = _start_and_interrupt(spec, tmp_path, at_step=10, how=signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    kept = checkpoint.candidates(Path(spec.checkpoint_dir))
    assert [checkpoint.step_of(d) for d in kept] == [8, 4]  # keep_checkpoints = 2
    victim = max((p for p in kept[0].rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])  # truncated
    assert "bytes" in checkpoint.verify(kept[0])
    assert checkpoint.step_of(checkpoint.latest_complete(spec.checkpoint_dir, log=print)) == 4
    resumed = run_training(spec, tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "unusable" in resumed.stderr and "step_00000004" in resumed.stdout
    assert _curve(spec)["loss"].tolist() == _curve(straight)["loss"].tolist()


def test_a_save_in_progress_is_never_loaded(tmp_path: Path):
    root = tmp_path / "ckpt"
    done = root / checkpoint.step_dir_name(4)
    done.mkdir(parents=True)
    (done / checkpoint.TRAIN_STATE).write_bytes(b"state")
    checkpoint.write_manifest(done, 4)
    unfinished = root / checkpoint.step_dir_name(8)  # renamed but manifest lost: not complete
    unfinished.mkdir()
    (unfinished / checkpoint.TRAIN_STATE).write_bytes(b"state")
    (root / ".tmp_step_00000012").mkdir()
    assert checkpoint.verify(unfinished) == "no manifest (the save did not finish)"
    assert checkpoint.latest_complete(root, log=lambda m: None) == done
    (done / checkpoint.TRAIN_STATE).write_bytes(b"STATE")  # same size, other bytes
    assert checkpoint.verify(done) == f"{checkpoint.TRAIN_STATE} does not match its checksum"
    assert checkpoint.latest_complete(root, log=lambda m: None) is None
