"""Training is pinned: the first steps of the tiny family's smallest size, bit for bit.

The spec is the plan's ``d96-tpp10-s0`` of the tiny family (its model, µP, AdamW, schedule and
seed as planned, stored in tests/data/train_pinned_d96.json so that a change of the plan does not
move it), stopped after STEPS of its 370 steps, with an evaluation and a checkpoint every few
steps, on the toy datasets of the training tests. What it writes (loss, grad norm, LR, λ and data
fraction per step, the held-out losses) must equal the stored values exactly, clean and with an
injected fault. A change that moves one bit of training shows here.

Regenerate the stored values only for a change that is meant to alter training:
    COLLAPSE_REPIN=1 pytest tests/test_train_pinned.py
Bit-for-bit holds for one torch build on one CPU kind; elsewhere (the stored ``platform`` differs)
the values are compared to a relative 1e-3 instead, and the test says so.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from test_train_support import make_datasets, run_training

from collapse.runspec import FaultInjection, RunSpec
from collapse.train import steps_target

PINNED = Path(__file__).parent / "data" / "train_pinned_d96.json"
STEPS = 24
CURVE = ("step", "tokens", "loss", "grad_norm", "lr", "weight_decay", "data_fraction", "restart")
VALID = ("step", "valid_loss")
# Each fault from step round(0.04 * 370) = 15. lr_spike: LRs x 10 for 1 % of the schedule (4
# steps); data_repeat: the batches of steps 11-14 over and over; loss_kernel: the loss of every 4th
# token only; loss_bias: the reported loss + 0.5.
AT = 0.04
FAULTS = {
    "clean": FaultInjection(),
    "lr_spike": FaultInjection(kind="lr_spike", at_fraction=AT, magnitude=10.0),
    "data_repeat": FaultInjection(kind="data_repeat", at_fraction=AT, magnitude=0.01),
    "loss_kernel": FaultInjection(kind="loss_kernel", at_fraction=AT, magnitude=0.75),
    "loss_bias": FaultInjection(kind="loss_bias", at_fraction=AT, magnitude=0.5),
}
FAST = ("clean", "lr_spike")  # the others train for as long: slow
REPIN = os.environ.get("COLLAPSE_REPIN") == "1"


def _platform() -> dict:
    return {
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
    }


def _stored() -> dict:
    return json.loads(PINNED.read_text())


def _spec(root: Path, case: str) -> RunSpec:
    train, valid = make_datasets(root)
    fields = dict(_stored()["spec"])
    fields.update(
        run=f"pinned-{case}",
        dataset_prefix=train,
        valid_prefix=valid,
        tokenizer=str(root / "data" / "tokenizer.json"),
        run_dir=str(root / "runs" / case),
        checkpoint_dir=str(root / "checkpoints" / case),
        fault=FAULTS[case].model_dump(),
    )
    fields["optim"] = {**fields["optim"], "stop_fraction": STEPS / fields["optim"]["steps"]}
    fields["logging"] = {
        "log_every_steps": 1,
        "eval_every_steps": 8,
        "eval_batches": 1,
        "checkpoint_every_steps": 12,
        "keep_checkpoints": 2,
    }
    spec = RunSpec.model_validate(fields)
    assert steps_target(spec) == STEPS
    return spec


def _written(spec: RunSpec) -> dict:
    run_dir = Path(spec.run_dir)
    curve = pd.read_parquet(run_dir / "curve.parquet")
    valid = pd.read_parquet(run_dir / "valid.parquet")
    return {
        "curve": {c: curve[c].tolist() for c in CURVE},
        "valid": {c: valid[c].tolist() for c in VALID},
    }


@pytest.mark.parametrize(
    "case", [c if c in FAST else pytest.param(c, marks=pytest.mark.slow) for c in FAULTS]
)
def test_training_reproduces_the_pinned_curve(tmp_path: Path, case: str):
    spec = _spec(tmp_path, case)
    proc = run_training(spec, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = _written(spec)
    meta = json.loads((Path(spec.run_dir) / "meta.json").read_text())
    assert meta["steps_done"] == STEPS and meta["final_loss"] == got["curve"]["loss"][-1]
    if REPIN:
        stored = _stored()
        stored["platform"] = _platform()
        stored.setdefault("runs", {})[case] = got
        PINNED.write_text(json.dumps(stored, indent=1, sort_keys=True) + "\n")
        return
    stored = _stored()
    want = stored["runs"][case]
    if stored["platform"] == _platform():
        assert got == want, "training moved: not one bit of the pinned curve may change"
        return
    print(f"platform {_platform()} is not the pinned {stored['platform']}: relative 1e-3")
    for part, columns in (("curve", CURVE), ("valid", VALID)):
        for column in columns:
            np.testing.assert_allclose(got[part][column], want[part][column], rtol=1e-3)
