"""Reliability: kills, broken checkpoints and data, a disk that fills mid-save, two writers at once.

Every test runs the real trainer (``python -m collapse.train``) or the real Snakemake on the repo's
Snakefile. Trainers run in their own session and are killed by process group: Megatron's checkpoint
writer has a helper process that outlives a kill -9 of its parent. Output goes to files, not pipes.

test_checkpoint.py already covers one SIGTERM, one kill -9 at a fixed step and a truncated shard;
this file adds seeded random kills (also inside saves), flipped bytes, a lost manifest, an
unrenamed save, failed writes, bad datasets through the trainer, and concurrent writers.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_train_support import (
    REPO,
    job_env,
    run_training,
    tiny_spec,
    train_command,
    write_indexed_dataset,
    write_spec,
)
from workflow_cli import snakemake_cmd

from collapse import checkpoint
from collapse.runspec import RunSpec
from collapse.train import EXIT_BAD_INPUT, EXIT_OK, EXIT_SAVE_FAILED

STEPS, EVERY = 80, 5  # 16 checkpoints: a random kill often lands in a save
WALL_CLOCK = ["tokens_per_s", "restart"]  # allowed to differ between runs
SEED = int(os.environ.get("RELIABILITY_SEED", "20250925"))
TIMEOUT = 240


def _spec(root: Path) -> RunSpec:
    # the same run name everywhere: the curve's run column is then comparable across roots
    return tiny_spec(root, run="r", steps=STEPS, d_model=32, checkpoint_every=EVERY, eval_every=20)


def _curve(spec: RunSpec) -> pd.DataFrame:
    return pd.read_parquet(Path(spec.run_dir) / "curve.parquet")


def assert_same_run(spec: RunSpec, reference: RunSpec) -> None:
    """Curve and held-out rows equal to the reference's, exactly, but for wall-clock columns."""
    curve, ref = _curve(spec), _curve(reference)
    pd.testing.assert_frame_equal(
        curve.drop(columns=WALL_CLOCK), ref.drop(columns=WALL_CLOCK), check_exact=True
    )
    valid = pd.read_parquet(Path(spec.run_dir) / "valid.parquet")
    valid_ref = pd.read_parquet(Path(reference.run_dir) / "valid.parquet")
    pd.testing.assert_frame_equal(valid, valid_ref, check_exact=True)
    meta = json.loads((Path(spec.run_dir) / "meta.json").read_text())
    resumed_at = {r["step"] for r in meta["restarts"] if r["step"] < STEPS}
    assert set(curve.loc[curve["restart"], "step"]) == {s + 1 for s in resumed_at}
    assert not list(Path(spec.checkpoint_dir).glob(".tmp_*"))  # the last save cleaned up


def _launch(spec: RunSpec, root: Path, name: str, preexec_fn=None) -> tuple[subprocess.Popen, Path]:
    log = root / f"{name}.log"
    with log.open("w") as handle:
        proc = subprocess.Popen(
            train_command(write_spec(spec, root)),
            env=job_env(),
            cwd=REPO,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=preexec_fn,
        )
    return proc, log


def _killpg(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _finish(proc: subprocess.Popen, log: Path) -> int:
    """Wait for the job; kill its whole group (helpers included) whatever happens."""
    try:
        return proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        tail = log.read_text()[-3000:]
        raise AssertionError(f"job did not end in {TIMEOUT} s:\n{tail}") from None
    finally:
        _killpg(proc)


def _resumed_step(text: str) -> int | None:
    for line in text.splitlines():
        if line.startswith("resumed from ") and " at step " in line:
            return int(line.rsplit(" ", 1)[1])
    return None


def _copy_checkpoints(reference: RunSpec, spec: RunSpec) -> Path:
    """The reference's kept checkpoints (steps 75 and 80) as this run's own."""
    target = Path(spec.checkpoint_dir)
    shutil.copytree(reference.checkpoint_dir, target)
    assert [checkpoint.step_of(d) for d in checkpoint.candidates(target)] == [80, 75]
    return target


def _rerun(spec: RunSpec, root: Path, name: str = "rerun") -> str:
    proc, log = _launch(spec, root, name)
    code = _finish(proc, log)
    text = log.read_text()
    assert code == EXIT_OK, text[-3000:]
    return text


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> RunSpec:
    root = tmp_path_factory.mktemp("reference")
    spec = _spec(root)
    proc = run_training(spec, root, timeout=TIMEOUT)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    assert not _curve(spec)["restart"].any()
    return spec


# ------------------------------------------------------------------------------ kill -9
@pytest.mark.parametrize("kills", [1, pytest.param(5, marks=pytest.mark.slow)])
def test_kill_9_at_random_points_gives_the_uninterrupted_curve(tmp_path, reference, kills):
    """SIGKILL of the whole job at seeded random (step, delay) points, some inside a save."""
    rng = np.random.default_rng([SEED, kills])
    steps = sorted(rng.choice(np.arange(2, STEPS - 4), size=kills, replace=False).tolist())
    delays = rng.uniform(0.0, 0.4, size=kills).round(3).tolist()
    print(f"RELIABILITY_SEED={SEED}: kill -9 after steps {steps} + delays {delays} s")
    spec = _spec(tmp_path)
    saved = None
    for i, (step, delay) in enumerate(zip(steps, delays, strict=True)):
        if saved is not None:  # a delay can carry a job past the next point: kill it later
            step = max(step, checkpoint.step_of(saved) + 1)
        proc, log = _launch(spec, tmp_path, f"attempt{i}")
        try:
            deadline = time.time() + TIMEOUT
            while f"step {step}/" not in log.read_text():
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.time() < deadline, log.read_text()[-3000:]
                time.sleep(0.02)
            time.sleep(delay)
            _killpg(proc)
            assert proc.wait(timeout=60) == -signal.SIGKILL
        finally:
            _killpg(proc)
        saved = checkpoint.latest_complete(spec.checkpoint_dir, log=print)
        print(f"killed after step {step} + {delay} s; newest complete checkpoint: {saved}")
    text = _rerun(spec, tmp_path)
    saved_before = checkpoint.step_of(saved) if saved is not None else None
    assert _resumed_step(text) == saved_before
    assert_same_run(spec, reference)


# ------------------------------------------------------------------------------ corrupt checkpoints
def _flip_bytes(newest: Path) -> None:
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    shard.write_bytes(bytes(data))  # same size: only the checksum can tell
    assert "checksum" in checkpoint.verify(newest)


def _lose_manifest(newest: Path) -> None:
    (newest / checkpoint.MANIFEST).unlink()  # e.g. lost by a file system that crashed


def _unrenamed_save(newest: Path) -> None:
    """A save killed just before its rename: a manifest, a half-written shard, a .tmp_ name."""
    tmp = newest.with_name(".tmp_" + newest.name)
    newest.rename(tmp)
    shard = max(tmp.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (newest.parent / checkpoint.LATEST).write_text("step_00000075\n")


@pytest.mark.parametrize(
    "damage",
    [
        _flip_bytes,
        # a lost manifest is the same fallback as a bad checksum here (and unit-tested in
        # test_checkpoint.py); an unrenamed save also comes from the disk-full test below
        pytest.param(_lose_manifest, marks=pytest.mark.slow),
        pytest.param(_unrenamed_save, marks=pytest.mark.slow),
    ],
    ids=["flipped_bytes", "no_manifest", "unrenamed_tmp"],
)
def test_a_broken_newest_checkpoint_falls_back_to_the_one_before(tmp_path, reference, damage):
    spec = _spec(tmp_path)
    root = _copy_checkpoints(reference, spec)
    damage(root / checkpoint.step_dir_name(80))
    text = _rerun(spec, tmp_path)
    assert _resumed_step(text) == 75, text[-3000:]
    assert checkpoint.verify(root / checkpoint.step_dir_name(80)) is None  # rewritten whole
    assert_same_run(spec, reference)


# ------------------------------------------------------------------------------ a changed spec
def test_checkpoints_of_another_trajectory_are_set_aside_not_resumed(tmp_path, reference):
    """A spec whose weight decay changed (as after an edit of family.tau) is another run: its
    old checkpoints are moved aside and training starts at step 1, not spliced onto them."""
    spec = _spec(tmp_path)
    optim = spec.optim.model_copy(update={"weight_decay": 2 * spec.optim.weight_decay})
    spec = spec.model_copy(update={"optim": optim})
    root = _copy_checkpoints(reference, spec)
    text = _rerun(spec, tmp_path)
    assert "belongs to another trajectory" in text and _resumed_step(text) is None, text[-3000:]
    curve = _curve(spec)
    assert curve.step.tolist() == list(range(1, STEPS + 1)) and not curve["restart"].any()
    assert not curve.loss.equals(_curve(reference).loss)  # its own run, not the copied one
    aside = list(root.glob("superseded-*"))
    assert len(aside) == 1 and [checkpoint.step_of(d) for d in checkpoint.candidates(aside[0])] == [
        80,
        75,
    ]
    assert [checkpoint.step_of(d) for d in checkpoint.candidates(root)] == [80, 75]  # its own


# ------------------------------------------------------------------------------ bad datasets
def _truncate_train_bin(spec: RunSpec) -> Path:
    path = Path(spec.dataset_prefix + ".bin")
    path.write_bytes(path.read_bytes()[:-100])
    return path


def _remove_valid_idx(spec: RunSpec) -> Path:
    path = Path(spec.valid_prefix + ".idx")
    path.unlink()
    return path


def _bin_of_another_build(spec: RunSpec) -> Path:
    other = Path(spec.dataset_prefix).parent / "other" / "train_text_document"
    write_indexed_dataset(other, n_docs=400, seed=99)  # the same recipe, another seed
    path = Path(spec.dataset_prefix + ".bin")
    assert Path(f"{other}.bin").stat().st_size != path.stat().st_size
    shutil.copy(f"{other}.bin", path)
    return path


def test_broken_datasets_stop_the_job_before_any_step_naming_the_file_and_fix(tmp_path):
    """Three breakages at once (each its own job, concurrently: startup dominates)."""
    cases = {}
    for breakage in (_truncate_train_bin, _remove_valid_idx, _bin_of_another_build):
        root = tmp_path / breakage.__name__
        spec = _spec(root)
        bad = breakage(spec)
        cases[breakage.__name__] = (spec, bad, *_launch(spec, root, "job"))
    for name, (spec, bad, proc, log) in cases.items():
        code, text = _finish(proc, log), log.read_text()
        assert code == EXIT_BAD_INPUT, (name, text[-3000:])
        error = [line for line in text.splitlines() if line.startswith("error: ")]
        assert error and error[-1].startswith(f"error: {bad}: "), (name, text[-3000:])
        assert "rerun the data rule" in error[-1], error
        assert "step 1/" not in text and "training steps" not in text
        assert not Path(spec.checkpoint_dir).exists() and not Path(spec.run_dir).exists()


# ------------------------------------------------------------------------------ disk full mid-save
def test_a_save_that_fails_midway_keeps_the_previous_checkpoint(tmp_path, reference):
    """RLIMIT_FSIZE in the job makes the shard writes of its next save fail with EFBIG (Python
    ignores SIGXFSZ), as a full disk would: the dist_checkpointing writer itself hits it."""
    spec = _spec(tmp_path)
    root = _copy_checkpoints(reference, spec)
    shutil.rmtree(root / checkpoint.step_dir_name(80))  # as if the run was stopped at 75..79
    (root / checkpoint.LATEST).write_text("step_00000075\n")
    ref_files = [p for p in (root / checkpoint.step_dir_name(75)).iterdir()]
    shard_bytes = max(p.stat().st_size for p in ref_files if p.suffix == ".distcp")
    limit = shard_bytes // 2  # above every other file the job writes before that save
    assert all(p.stat().st_size < limit for p in ref_files if p.suffix != ".distcp")

    def file_size_limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc, log = _launch(spec, tmp_path, "disk_full", preexec_fn=file_size_limit)
    code, text = _finish(proc, log), log.read_text()
    assert code == EXIT_SAVE_FAILED, text[-3000:]
    assert "previous checkpoint" in text and "disk space" in text, text[-3000:]
    assert "step 80/" in text and "checkpoint saved" not in text, text[-3000:]
    half = root / ".tmp_step_00000080"
    assert any(p.stat().st_size == limit for p in half.glob("*.distcp"))  # cut off mid-write
    assert not (root / checkpoint.step_dir_name(80)).exists()
    assert (root / checkpoint.LATEST).read_text().strip() == "step_00000075"
    assert checkpoint.latest_complete(root) == root / checkpoint.step_dir_name(75)
    assert not (Path(spec.run_dir) / "meta.json").exists()

    text = _rerun(spec, tmp_path)  # space is back
    assert _resumed_step(text) == 75, text[-3000:]
    assert_same_run(spec, reference)


# ------------------------------------------------------------------------------ two writers
def _snakemake(workdir: Path, log: Path) -> subprocess.Popen:
    cmd = snakemake_cmd(workdir, "plan", "--config", "family=smoke", cores=1)
    with log.open("w") as handle:
        return subprocess.Popen(
            cmd, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True
        )


def test_a_second_snakemake_on_the_same_directory_is_refused_and_the_first_finishes(tmp_path):
    """The first workflow is frozen (SIGSTOP) inside its job, so the overlap is certain.

    Frozen once its job has started, not as soon as a lock file appears: Snakemake writes the
    input lock, then the output lock, and a second workflow between the two is not refused.
    """
    workdir = tmp_path / "work"
    workdir.mkdir()
    locks = workdir / ".snakemake" / "locks"
    first_log = tmp_path / "first.log"
    first = _snakemake(workdir, first_log)
    try:
        deadline = time.time() + TIMEOUT
        while "localrule plan:" not in first_log.read_text():
            assert first.poll() is None, first_log.read_text()[-3000:]
            assert time.time() < deadline
            time.sleep(0.02)
        os.killpg(first.pid, signal.SIGSTOP)
        held = "".join(p.read_text() for p in locks.glob("*.output.lock"))
        assert "runs.csv" in held, "the first workflow ended before it could be frozen"
        second = _snakemake(workdir, tmp_path / "second.log")
        try:
            second_code = second.wait(timeout=TIMEOUT)
        finally:
            _killpg(second)
        os.killpg(first.pid, signal.SIGCONT)
        first_code = first.wait(timeout=TIMEOUT)
    finally:
        _killpg(first, signal.SIGCONT)
        _killpg(first)
    second_text = (tmp_path / "second.log").read_text()
    assert second_code != 0
    assert "Directory cannot be locked" in second_text and "--unlock" in second_text, second_text
    assert first_code == 0, first_log.read_text()[-3000:]
    assert "were not present when the DAG was created" not in first_log.read_text()
    plan = workdir / "results" / "smoke" / "plan"
    runs = pd.read_csv(plan / "runs.csv")
    assert len(runs) == 14  # 6 family, 4 sweep, 4 contrast (d32 shares its family runs)
    for run in runs.run:  # every spec whole and loadable
        assert RunSpec.load(plan / "runs" / f"{run}.json").run == run
    assert not list(locks.glob("*.lock"))  # released (Snakemake may remove the folder)


@pytest.fixture(scope="module")
def two_at_once(tmp_path_factory):
    """The same run started twice at the same moment, by hand (same spec, same directories)."""
    root = tmp_path_factory.mktemp("twice")
    spec = _spec(root)
    jobs = [_launch(spec, root, f"job{i}") for i in range(2)]
    codes = [_finish(proc, log) for proc, log in jobs]
    return spec, root, codes, [log.read_text() for _, log in jobs]


def test_two_trainings_of_one_run_at_once_do_not_corrupt_its_checkpoints(two_at_once, reference):
    spec, root, codes, _ = two_at_once
    print("exit codes of the two jobs:", codes)
    for path in checkpoint.candidates(Path(spec.checkpoint_dir)):
        assert checkpoint.verify(path) is None, path  # whatever was published is whole
    if EXIT_OK in codes:  # a job that says it finished left the right outputs
        pd.testing.assert_frame_equal(
            _curve(spec).drop(columns=WALL_CLOCK),
            _curve(reference).drop(columns=WALL_CLOCK),
            check_exact=True,
        )
    _rerun(spec, root)  # and the run can always be completed from what is there
    assert_same_run(spec, reference)


def test_the_second_training_of_a_run_is_refused_with_a_clear_message(two_at_once):
    _, _, codes, texts = two_at_once
    assert sorted(codes) == [EXIT_OK, EXIT_BAD_INPUT], codes
    loser = texts[codes.index(EXIT_BAD_INPUT)]
    assert "step 1/" not in loser and "already" in loser.lower(), loser[-2000:]
