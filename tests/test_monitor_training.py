"""The online collapse monitor inside a real training run (Megatron-Core on CPU).

The unit tests of ``collapse.monitor`` feed it synthetic curves; here the training entry point
runs it: a run trained against a reference the reference stage built from an unmonitored run of
the same seed checks at every interval after the align window and never alarms. The alarm side
(exit 3 with ``stop_on_alarm``, the checkpoint, the resume) is in tests/test_train.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from test_train_support import run_training, tiny_spec

from collapse import analysis as A
from collapse.reference import ALIGN_WINDOW
from collapse.train import EXIT_OK

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


def test_a_run_that_follows_its_reference_never_alarms(own_reference, tmp_path):
    spec = monitored(tmp_path, own_reference, stop=True)
    proc = run_training(spec, tmp_path)
    assert proc.returncode == EXIT_OK, proc.stderr[-3000:]
    checks = [r for r in records(spec) if r["status"] in ("ok", "alarm")]
    assert [r["step"] for r in checks] == list(range(FIRST_CHECK, STEPS + 1, EVERY))
    assert not any(r["alarm"] for r in checks)
    assert max(abs(r["residual"]) for r in checks) < 0.005  # the same seed, bit for bit
