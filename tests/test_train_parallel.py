"""TP=2, PP=2 and DP=2 (torchrun, 2 gloo processes) train the same curve as one process.

The µP init is drawn per global parameter name, so every layout starts from the same weights;
the data of step t is the same global batch whatever the layout. Losses then agree to float
rounding over 20 steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_train_support import losses, run_training, tiny_spec

STEPS = 20
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp1")
    spec = tiny_spec(root, run="tp1", steps=STEPS, d_model=64)
    proc = run_training(spec, root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(spec)


@pytest.mark.slow
@pytest.mark.ci  # the strongest check of the parallel layouts: 2.5 min on two cores
@pytest.mark.parametrize(
    "layout",
    [
        dict(tp=2),
        dict(pp=2),
        dict(dp=2),
        dict(tp=2, activation="swiglu", positions="alibi"),
    ],
    ids=["tp2", "pp2", "dp2", "tp2-swiglu-alibi"],
)
def test_parallel_layouts_match_one_process(tmp_path: Path, reference, layout):
    variant = {k: v for k, v in layout.items() if k in ("activation", "positions")}
    spec = tiny_spec(tmp_path, run="parallel", steps=STEPS, d_model=64, **layout)
    proc = run_training(spec, tmp_path, nproc=2, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = losses(spec)
    if variant:  # another architecture: compare with its own single-process run
        single = tiny_spec(tmp_path, run="single", steps=STEPS, d_model=64, **variant)
        assert run_training(single, tmp_path).returncode == 0
        expected = losses(single)
    else:
        expected = reference
    assert len(got) == STEPS
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < TOLERANCE
