"""Time limits and segments: the plan's arithmetic by hand, the config's checks, the dry run, and
real CPU training cut into segments (and stopped by its time budget) that ends on exactly the
curve of one uninterrupted job."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest
from test_train_support import REPO, job_env, run_training, tiny_spec, write_spec
from workflow_cli import snakemake_cmd

from collapse import checkpoint
from collapse.config import ConfigError, load_config
from collapse.launch import signal_lead_s
from collapse.plan import plan_family, plan_report_markdown
from collapse.segments import (
    SegmentError,
    marker_path,
    plan_segments,
    save_minutes,
    segment_end,
)
from collapse.train import EXIT_OK, EXIT_PREEMPTED


# ------------------------------------------------------------------------------ arithmetic
def test_a_run_longer_than_the_limit_is_cut_by_hand():
    # 60-min limit: Slurm's early SIGTERM comes a tenth before it (360 s); a job spends
    # 2 min starting, 1 min loading and 1 min saving: 60 - 10 = 50 min of training per job.
    assert signal_lead_s(60) == 360
    p = plan_segments(100, 60, margin=1.5, save_min=1, startup_min=2, step_min=0.1)
    assert p.segments == 3  # ceil(100 x 1.5 / 50)
    assert p.runtime_min == 60  # every segment asks for the limit, never more
    assert p.exit_duration_min == 52  # 60 - 6 (lead) - 2 (start): the process stops by then
    assert p.train_min_per_segment == 50


def test_a_run_that_fits_is_one_job_within_the_limit():
    p = plan_segments(30, 60, margin=1.5, save_min=1, startup_min=2)
    assert (p.segments, p.runtime_min) == (1, 45)  # 30 x 1.5
    assert p.exit_duration_min == 45 - 270 / 60 - 2  # its own lead: a tenth of 45 min
    # no limit: the estimate with the margin, never under the cluster's minimum, no time stop
    p = plan_segments(30, None, margin=1.5, min_runtime_min=50)
    assert (p.segments, p.runtime_min, p.exit_duration_min) == (1, 50, 0.0)
    # the cluster's minimum request is capped by the limit; it never forces segments
    p = plan_segments(0.1, 2, margin=2, min_runtime_min=5, startup_min=0.5)
    assert (p.segments, p.runtime_min, p.exit_duration_min) == (1, 2, 0.5)  # 2 - 1 - 0.5


def test_a_limit_too_short_for_one_segment_names_the_size_and_the_checkpoint():
    # 10 min: lead 60 s; 2 + 2 x 3 + 1 = 9 min besides training leave 1 min < one step (3 min)
    with pytest.raises(SegmentError, match=r"size 1\.8B.*too short.*25\.2 GB checkpoint"):
        plan_segments(
            100, 10, margin=1.5, save_min=3, startup_min=2, step_min=2, checkpoint_gb=25.2,
            what="size 1.8B",
        )  # fmt: skip


def test_segments_share_the_steps_and_the_last_ends_the_run():
    assert [segment_end(10, 3, k) for k in (1, 2, 3)] == [4, 7, 10]
    assert [segment_end(7, 1, 1)] == [7]
    with pytest.raises(ValueError):
        segment_end(10, 3, 4)


def test_checkpoint_save_is_priced_from_the_parameters():
    # 1e9 parameters x 14 bytes (bf16 weights, fp32 master copy, Adam m and v) at 1 GB/s
    assert save_minutes(10**9, "gpu", 1.0) == pytest.approx(14 / 60)
    assert save_minutes(10**9, "cpu", 2.0) == pytest.approx(12 / 2 / 60)


# ------------------------------------------------------------------------------ the plan
@pytest.fixture(scope="module")
def celerity():
    return plan_family(load_config(["family=celerity", "cluster=slurm_h100"]))


def test_celerity_on_h100_with_a_48_hour_limit(celerity):
    cluster = celerity.config.cluster
    assert cluster.time_limit_min == 2880
    assert max(r.resources.runtime_min for r in celerity.runs) <= 2880  # no job asks for more
    t = celerity.table.set_index("run")
    row = t.loc["3.9B-tpp234-s0"]
    # by hand: the layout's wall time x 60 x 1.5 (margin); a job trains 2880 - 2 (start)
    # - 2 x save (load and save 14 bytes per parameter at 1 GB/s) - 10 (SIGTERM lead) min
    save = row.params * 14 / 1e9 / 60
    per_job = 2880 - 2 - 2 * save - 10
    need = row.wall_hours * 60 * 1.5 / per_job
    assert 3 < need < 4 and row.segments == 4
    assert t.loc["1.8B-tpp234-s0", "segments"] == 1  # 25.4 h x 1.5 = 38 h: one job
    spec = celerity.spec("3.9B-tpp234-s0")
    assert (spec.resources.segments, spec.resources.runtime_min) == (4, 2880)
    assert spec.resources.exit_duration_min == 2880 - 10 - 2
    report = plan_report_markdown(celerity)
    assert "## Time limit and segments" in report
    assert "| 3.9B-tpp234-s0 | 3.9B | 4 |" in report


def test_no_limit_no_segments():
    plan = plan_family(load_config(["family=smoke"]))
    assert set(plan.table.segments) == {1}
    assert all(r.resources.exit_duration_min == 0 for r in plan.runs)
    assert "Time limit" not in plan_report_markdown(plan)


@pytest.mark.parametrize("value", [0, -5])
def test_a_time_limit_of_zero_or_less_names_the_field(value):
    with pytest.raises(ConfigError, match=r"cluster\.time_limit_min: .*must be > 0 minutes"):
        load_config(["family=smoke", "cluster=slurm_h100", f"cluster.time_limit_min={value}"])


def test_a_time_limit_too_short_fails_at_plan_time_naming_the_size():
    cfg = load_config(["family=celerity", "cluster=slurm_h100", "cluster.time_limit_min=4"])
    with pytest.raises(ConfigError, match=r"size 3\.9B: the time limit of 4 min is too short") as e:
        plan_family(cfg)
    assert "54.4 GB checkpoint" in str(e.value) and "cluster.time_limit_min" in str(e.value)


def test_the_dry_run_lists_the_segments_and_caps_every_job(tmp_path):
    out = subprocess.run(
        snakemake_cmd(
            tmp_path, "-n", "--default-resources", "runtime=600", "--config",
            "family=celerity", "cluster=slurm_h100", 'overrides=["cluster.time_limit_min=360"]',
        ),
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    plan = plan_family(
        load_config(["family=celerity", "cluster=slurm_h100", "cluster.time_limit_min=360"])
    )
    trained = plan.table[plan.table.same_as == ""]
    expected = int((trained.segments - 1).sum())
    assert expected > 0
    segments = [line for line in out.stdout.splitlines() if "wildcards: run=" in line]
    listed = [line for line in segments if ", segment=" in line]
    assert len(listed) == expected
    jobs = [line for line in out.stdout.splitlines() if line.strip().startswith("resources:")]
    runtimes = [int(w[8:].rstrip(",")) for line in jobs for w in line.split() if "runtime=" in w]
    assert len(runtimes) == len(jobs) > expected
    assert max(runtimes) <= 360  # also the rules without a runtime of their own (default 600)


# ------------------------------------------------------------------------------ training
STEPS = 12
SEGMENTS = 3


def _spec(root: Path, run: str, **resources):
    spec = tiny_spec(root, run=run, steps=STEPS, d_model=64, checkpoint_every=5, eval_every=6)
    return spec.model_copy(
        update={"resources": spec.resources.model_copy(update=resources)}, deep=True
    )


def _curve(spec) -> pd.DataFrame:
    return pd.read_parquet(Path(spec.run_dir) / "curve.parquet")


def _segment(spec, root: Path, k: int, *, kill_at: int | None = None):
    """Run segment k of the spec; with ``kill_at``, SIGKILL the job once it logged that step."""
    cmd = [*_train_cmd(write_spec(spec, root)), "--segment", str(k)]
    log = root / f"{spec.run}.segment{k}.log"
    with log.open("w") as handle:
        proc = subprocess.Popen(
            cmd, env=job_env(), cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        if kill_at is not None:
            deadline = time.time() + 240
            while f"step {kill_at}/" not in log.read_text():
                assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, log.read_text()


def _train_cmd(path: Path) -> list[str]:
    import sys

    return [sys.executable, "-m", "collapse.train", "--spec", str(path)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    root = tmp_path_factory.mktemp("straight")
    spec = _spec(root, "straight")
    proc = run_training(spec, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return spec


def test_segments_killed_anywhere_end_on_the_uninterrupted_curve(tmp_path, straight):
    spec = _spec(tmp_path, "segmented", segments=SEGMENTS)
    ends = [segment_end(STEPS, SEGMENTS, k) for k in (1, 2, 3)]
    assert ends == [4, 8, 12]
    code, log = _segment(spec, tmp_path, 1)
    assert code == EXIT_OK, log[-3000:]
    assert json.loads(marker_path(spec.run_dir, 1).read_text())["step"] == 4
    assert not (Path(spec.run_dir) / "meta.json").exists()  # not finished-looking
    # segment 2 killed after step 6 (its checkpoint at 5 survives), then rerun
    code, log = _segment(spec, tmp_path, 2, kill_at=6)
    assert code == -signal.SIGKILL
    assert not marker_path(spec.run_dir, 2).exists()
    assert checkpoint.step_of(checkpoint.latest_complete(spec.checkpoint_dir)) == 5
    code, log = _segment(spec, tmp_path, 2)
    assert code == EXIT_OK and "resumed from" in log, log[-3000:]
    assert json.loads(marker_path(spec.run_dir, 2).read_text())["step"] == 8
    code, log = _segment(spec, tmp_path, 3)
    assert code == EXIT_OK, log[-3000:]
    curve, reference = _curve(spec), _curve(straight)
    for column in ("loss", "grad_norm", "lr"):
        assert curve[column].tolist() == reference[column].tolist()  # bitwise
    assert list(curve.step[curve.restart]) == [5, 6, 9]  # after 4, after 5 (kill), after 8
    valid = pd.read_parquet(Path(spec.run_dir) / "valid.parquet")
    valid_ref = pd.read_parquet(Path(straight.run_dir) / "valid.parquet")
    assert valid["valid_loss"].tolist() == valid_ref["valid_loss"].tolist()
    meta = json.loads((Path(spec.run_dir) / "meta.json").read_text())
    assert meta["steps_done"] == meta["steps_target"] == STEPS


def test_a_job_stops_at_its_exit_duration_and_the_next_resumes(tmp_path, straight):
    # a save estimate longer than the whole budget: the first step is the job's last
    spec = _spec(tmp_path, "budget", exit_duration_min=1.0, checkpoint_save_min=5.0)
    proc = run_training(spec, tmp_path)
    assert proc.returncode == EXIT_PREEMPTED, proc.stderr[-3000:]
    assert "stop requested (time budget" in proc.stdout
    assert checkpoint.step_of(checkpoint.latest_complete(spec.checkpoint_dir)) == 1
    assert not (Path(spec.run_dir) / "meta.json").exists()
    # the next job, with room for its steps (a job's budget is the plan's), trains to the end
    spec = _spec(tmp_path, "budget", exit_duration_min=30.0, checkpoint_save_min=0.01)
    proc = run_training(spec, tmp_path)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    assert _curve(spec)["loss"].tolist() == _curve(straight)["loss"].tolist()
    assert math.isfinite(_curve(spec)["loss"].iloc[-1])


def test_the_time_budget_attaches_before_preemption_where_the_plan_gives_one(tmp_path):
    from collapse.callbacks import Preemption
    from collapse.train import callbacks_for

    preemption = Preemption.__new__(Preemption)  # its handlers stay out of this process
    names = [type(c).__name__ for c in callbacks_for(_spec(tmp_path, "a"), preemption)]
    assert "TimeBudget" not in names
    timed = _spec(tmp_path, "b", exit_duration_min=30.0)
    names = [type(c).__name__ for c in callbacks_for(timed, preemption)]
    assert names[-3:] == ["TimeBudget", "Preemption", "Checkpointing"]
