"""The online collapse monitor inside a real training run (Megatron-Core on CPU).

The unit tests of ``collapse.monitor`` feed it synthetic curves; here the training entry point
runs it. A run trained against a reference built from its own seed's curve never alarms; against
a reference of another shape it alarms at its first check after the align window, and with
``stop_on_alarm`` it stops there with exit status 3 and a checkpoint of the step it stopped at.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_train_support import run_training, tiny_spec

from collapse import analysis as A
from collapse import checkpoint
from collapse.reference import ALIGN_WINDOW
from collapse.train import EXIT_MONITOR_ALARM, EXIT_OK

STEPS, EVERY = 40, 4
# the first check after the align window's end (t_hat 0.5): the monitor only records before it
FIRST_CHECK = next(s for s in range(EVERY, STEPS + 1, EVERY) if s / STEPS >= ALIGN_WINDOW[1])


def monitored(root: Path, reference_csv: Path, stop: bool):
    spec = tiny_spec(root, steps=STEPS, d_model=64)
    monitor = spec.monitor.model_copy(
        update={
            "enabled": True,
            "reference_csv": str(reference_csv),
            "every_steps": EVERY,
            "threshold": 0.02,  # fixed: 2 % of the loss range, far above this run's own noise
            "stop_on_alarm": stop,
        }
    )
    return spec.model_copy(update={"monitor": monitor})


def records(spec) -> list[dict]:
    lines = (Path(spec.run_dir) / "monitor.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def own_reference(tmp_path_factory) -> Path:
    """A reference built by the reference stage from an unmonitored run of the same seed."""
    root = tmp_path_factory.mktemp("plain")
    spec = tiny_spec(root, steps=STEPS, d_model=64)
    proc = run_training(spec, root)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    curve = pd.read_parquet(Path(spec.run_dir) / "curve.parquet")
    table = curve.assign(run="own", size="d64", seed=0)[["run", "size", "seed", "step", "loss"]]
    table.to_csv(root / "curves.csv", index=False)
    A.build_reference([root / "curves.csv"], None, ["d64"], root / "reference")
    return root / "reference" / "reference.csv"


@pytest.fixture(scope="module")
def wrong_reference(own_reference, tmp_path_factory) -> Path:
    """The same reference bent: ell_ref + 0.3 (1 - t_hat)^2, 0.3 at the start, 0 at the end."""
    frame = pd.read_csv(own_reference)
    bend = 0.3 * (1 - frame["t_hat"]) ** 2
    for column in ("ell", "lower", "upper"):
        frame[column] = frame[column] + bend
    path = tmp_path_factory.mktemp("wrong") / "reference.csv"
    frame.to_csv(path, index=False)
    return path


def test_a_run_that_follows_its_reference_never_alarms(own_reference, tmp_path):
    spec = monitored(tmp_path, own_reference, stop=True)
    proc = run_training(spec, tmp_path)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    checks = [r for r in records(spec) if r["status"] in ("ok", "alarm")]
    assert [r["step"] for r in checks] == list(range(FIRST_CHECK, STEPS + 1, EVERY))
    assert not any(r["alarm"] for r in checks)
    assert max(abs(r["residual"]) for r in checks) < 0.005  # the same seed, bit for bit


def test_an_alarm_with_stop_on_alarm_stops_at_the_check_with_exit_3(wrong_reference, tmp_path):
    spec = monitored(tmp_path, wrong_reference, stop=True)
    proc = run_training(spec, tmp_path)
    assert proc.returncode == EXIT_MONITOR_ALARM, proc.stderr[-3000:]
    assert f"collapse monitor alarm at step {FIRST_CHECK}" in proc.stdout + proc.stderr
    last = records(spec)[-1]
    assert last["alarm"] and last["step"] == FIRST_CHECK, last
    # below the bent reference, past the threshold, by at most the bend at the check (early
    # align scales the run towards the bent curve over the align window, absorbing a part)
    bend = 0.3 * (1 - FIRST_CHECK / STEPS) ** 2
    assert 0.02 < -last["residual"] <= bend, last
    # saved where it stopped, so a rerun (with the right reference) resumes from there; the
    # run's outputs are not written, since it did not finish
    saved = checkpoint.latest_complete(spec.checkpoint_dir)
    assert saved is not None and checkpoint.step_of(saved) == FIRST_CHECK
    assert not (Path(spec.run_dir) / "curve.parquet").exists()


def test_an_alarm_without_stop_on_alarm_is_recorded_and_training_finishes(
    wrong_reference, tmp_path
):
    spec = monitored(tmp_path, wrong_reference, stop=False)
    proc = run_training(spec, tmp_path)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    alarms = [r["step"] for r in records(spec) if r["alarm"]]
    assert alarms and alarms[0] == FIRST_CHECK
    assert pd.read_parquet(Path(spec.run_dir) / "curve.parquet")["step"].max() == STEPS
    assert np.isfinite(json.loads((Path(spec.run_dir) / "meta.json").read_text())["final_loss"])
