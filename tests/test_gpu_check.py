"""benchmarks/gpu_check.py runs end to end in its CPU smoke mode (the GPU path needs a GPU).

The smoke model is the ladder family's planner spec with a 2-layer d64 size, sequence 64 and a
512-token vocabulary, 6 steps of 4 sequences; on CPU both of its runs are fp32.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from collapse.model import GPU_PRECISION_ENV, params_dtype

ROOT = Path(__file__).resolve().parents[1]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks/gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_mode_trains_and_prints_every_figure(tmp_path, capsys):
    gpu_check = _gpu_check()
    out = tmp_path / "figures.json"
    assert gpu_check.main(["--smoke", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for words in ("tokens/s", "MFU", "planner estimate", "vs float32"):
        assert words in printed
    f = json.loads(out.read_text())
    # parameters by hand: embedding and output layer 512 x 64 each; per layer QKV 64 x 192 + 192,
    # projection 64 x 64 + 64, FFN 64 x 256 + 256 and 256 x 64 + 64, two layernorms 2 x 128;
    # final layernorm 128
    per_layer = (64 * 192 + 192) + (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64) + 256
    assert f["params"] == 2 * 512 * 64 + 2 * per_layer + 128 == 165_632
    assert f["steps"] == 6 and f["batch"] == "4 x 64 (micro 4)"
    assert f["tokens_per_s"] > 0 and 0 < f["mfu"] < 1
    terms = {k: v for k, v in f["estimate_gib"].items() if k != "total"}
    assert math.isclose(sum(terms.values()), f["estimate_gib"]["total"])
    loss = f["loss"]
    # CPU: both runs fp32 on the same data and init, so the same losses bit for bit
    assert f["dtype"] == f["reference_dtype"] == "float32"
    assert loss["max_abs_diff"] == 0.0 and loss["steps"] == 6
    assert loss["final_fast"] < f["loss_first"]  # it learns the bigram chain
    assert all(math.isfinite(v) for v in (loss["final_fast"], f["loss_first"]))


def test_the_bigram_data_is_learnable_and_fixed():
    gpu_check = _gpu_check()
    a = gpu_check.bigram_tokens(64, 200, 33, seed=1)
    assert (a == gpu_check.bigram_tokens(64, 200, 33, seed=1)).all()
    assert a.min() >= 0 and a.max() < 64
    # each token is followed by one of its four successors (or noise): far fewer distinct
    # bigrams than the 64 x 64 possible
    pairs = {(int(x), int(y)) for row in a for x, y in zip(row[:-1], row[1:], strict=True)}
    assert len(pairs) < 64 * 4 + 0.05 * a.size


def test_gpu_precision_is_bf16_unless_asked_for_fp32(monkeypatch):
    monkeypatch.delenv(GPU_PRECISION_ENV, raising=False)
    assert params_dtype(True) == torch.bfloat16 and params_dtype(False) == torch.float32
    monkeypatch.setenv(GPU_PRECISION_ENV, "fp32")
    assert params_dtype(True) == torch.float32
    monkeypatch.setenv(GPU_PRECISION_ENV, "fp16")
    assert params_dtype(False) == torch.float32  # the CPU path is fp32 whatever is asked
    with pytest.raises(ValueError, match="COLLAPSE_GPU_PRECISION='fp16': use bf16"):
        params_dtype(True)
