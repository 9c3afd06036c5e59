"""The online collapse monitor, fed step by step as the training loop does."""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import pytest
from synthetic import synthetic_family

from collapse import analysis as A
from collapse.monitor import OnlineMonitor
from collapse.runspec import RunSpec
from collapse.scaling import lr_at

SIZES = {"s1": 3.4, "s2": 3.1, "s4": 2.8, "s8": 2.5}
STEPS = 2000
EVERY = 50


def _spec(tmp_path, reference_csv: str, threshold: float = 0.0, stop: bool = False) -> RunSpec:
    """A complete, valid run spec of a small model; only the monitor block matters here."""
    spec = {
        "run": "s8_s1",
        "family": "synthetic",
        "size": "s8",
        "tpp_band": 20.0,
        "tpp": 20.0,
        "params": 1_000_000,
        "params_non_embedding": 800_000,
        "flops_6nd": 1.2e14,
        "flops": 1.3e14,
        "dataset_prefix": "d/train",
        "valid_prefix": "d/valid",
        "tokenizer": "d/tokenizer.json",
        "run_dir": str(tmp_path / "run"),
        "checkpoint_dir": str(tmp_path / "ckpt"),
        "model": {
            "d_model": 64,
            "n_layers": 2,
            "n_heads": 4,
            "head_dim": 16,
            "ffn_hidden": 256,
            "activation": "gelu",
            "positions": "rope",
            "vocab_size": 1024,
            "seq_len": 128,
            "tied_embeddings": False,
        },
        "mup": {
            "kind": "mup",
            "d_base": 32,
            "depth_base": 2,
            "width_mult": 2.0,
            "depth_mult": 1.0,
            "alpha_input": 1.0,
            "logit_multiplier": 0.5,
            "residual_multiplier": 1.0,
            "attention_scale": 1 / 16,
            "init_std_embedding": 0.08,
            "init_std_hidden": 0.06,
            "init_std_output_proj": 0.03,
            "init_std_unembedding": 0.06,
            "lr_embedding": 0.02,
            "lr_hidden": 0.01,
            "lr_output_proj": 0.01,
            "lr_unembedding": 0.01,
            "lr_norm_bias": 0.02,
            "adam_beta1": 0.9,
            "adam_beta2": 0.95,
            "adam_eps": 1e-8,
        },
        "optim": {
            "seed": 1,
            "tokens": 20_000_000,
            "batch_seqs": 16,
            "steps": STEPS,
            "warmup_steps": STEPS // 10,
            "lr_peak": 0.01,
            "weight_decay": 0.1,
            "tau": 0.2,
        },
        "parallel": {
            "tp": 1,
            "pp": 1,
            "dp": 1,
            "micro_batch_seqs": 16,
            "grad_accum": 1,
            "gpus": 0,
            "nodes": 1,
            "procs_per_node": 1,
        },
        "resources": {
            "threads": 1,
            "mem_mb": 1000,
            "gpus_per_node": 0,
            "nodes": 1,
            "runtime_min": 10,
        },
        "logging": {
            "log_every_steps": 1,
            "eval_every_steps": 200,
            "eval_batches": 1,
            "checkpoint_every_steps": 200,
        },
        "monitor": {
            "enabled": True,
            "reference_csv": reference_csv,
            "every_steps": EVERY,
            "threshold": threshold,
            "stop_on_alarm": stop,
        },
    }
    return RunSpec.model_validate(spec)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """A collapsing synthetic family, its reference built by the reference stage."""
    root = tmp_path_factory.mktemp("family")
    df = synthetic_family(SIZES, steps=STEPS, noise_rel=0.005, wiggle_rel=0.001, rng_seed=3)
    df.to_csv(root / "curves.csv", index=False)
    A.build_reference([root / "curves.csv"], None, ["s1", "s2"], root / "reference")
    return df, root / "reference" / "reference.csv"


def _feed(monitor: OnlineMonitor, loss: np.ndarray, start: int = 1):
    verdicts = []
    for step in range(start, len(loss) + 1):
        monitor.observe(step, step / STEPS, float(loss[step - 1]))
        if step % EVERY == 0:
            verdicts.append(monitor.check())
    return verdicts


def test_clean_run_never_alarms_and_logs_every_check(family, tmp_path):
    df, ref_csv = family
    loss = df.loc[df["run"] == "s8_s1", "loss"].to_numpy()
    log_path = tmp_path / "monitor.jsonl"
    monitor = OnlineMonitor(_spec(tmp_path, str(ref_csv)), log_path)
    verdicts = _feed(monitor, loss)
    assert not any(v.alarm for v in verdicts)
    waiting = [v for v in verdicts if v.status == "waiting"]
    assert len(waiting) == 19 and all(v.t_hat < 0.5 for v in waiting)  # checks at 50..950
    lines = [json.loads(x) for x in log_path.read_text().splitlines()]
    assert len(lines) == STEPS // EVERY and lines[-1]["status"] == "ok"
    assert {"step", "t_hat", "residual", "threshold", "alarm"} <= set(lines[-1])
    # the online normalization is the offline one (early-align on the same smoothing)
    offline = A.load_matrix(df[df["run"] == "s8_s1"])
    assert verdicts[-1].aligned_final_loss == pytest.approx(
        offline.meta["final_loss"].iloc[0], rel=0.005
    )


def test_fault_raises_alarm_after_it_starts_with_a_warning(family, tmp_path, caplog):
    df, ref_csv = family
    loss = df.loc[df["run"] == "s8_s1", "loss"].to_numpy().copy()
    loss[int(0.65 * STEPS) :] *= 1.04  # a biased loss from t_hat 0.65 on
    monitor = OnlineMonitor(_spec(tmp_path, str(ref_csv), stop=True), tmp_path / "m.jsonl")
    with caplog.at_level(logging.WARNING, logger="collapse.monitor"):
        verdicts = _feed(monitor, loss)
    alarms = [v for v in verdicts if v.alarm]
    assert alarms and alarms[0].t_hat >= 0.65 and alarms[0].t_hat < 0.75
    assert all(not v.alarm for v in verdicts if v.step < 0.65 * STEPS)
    assert alarms[0].stop and "above the reference" in alarms[0].message
    assert any("collapse monitor alarm" in r.message for r in caplog.records)
    assert monitor.first_crossing_t_hat == alarms[0].t_hat


def test_fixed_threshold_from_spec_and_nan_loss(family, tmp_path):
    df, ref_csv = family
    loss = df.loc[df["run"] == "s8_s1", "loss"].to_numpy().copy()
    loss[1500:] = np.nan
    monitor = OnlineMonitor(_spec(tmp_path, str(ref_csv), threshold=0.5), tmp_path / "m.jsonl")
    assert monitor.threshold == 0.5
    verdicts = _feed(monitor, loss)
    first = next(v for v in verdicts if v.alarm)
    assert "not finite" in first.message and first.t_hat == pytest.approx(1501 / STEPS)
    assert not first.stop  # stop_on_alarm is off in this spec


def test_resume_replays_steps_without_double_counting(family, tmp_path):
    df, ref_csv = family
    loss = df.loc[df["run"] == "s8_s1", "loss"].to_numpy()
    spec = _spec(tmp_path, str(ref_csv))
    straight = _feed(OnlineMonitor(spec, tmp_path / "a.jsonl"), loss)[-1]
    resumed = OnlineMonitor(spec, tmp_path / "b.jsonl")
    _feed(resumed, loss[:1300])
    last = _feed(resumed, loss, start=1201)[-1]  # restarted from the checkpoint at step 1200
    assert last.residual == pytest.approx(straight.residual, abs=1e-12)


def test_missing_reference_names_the_field(tmp_path):
    with pytest.raises(FileNotFoundError, match="monitor.reference_csv"):
        OnlineMonitor(_spec(tmp_path, str(tmp_path / "none.csv")), tmp_path / "m.jsonl")


def test_observe_is_cheap(family, tmp_path):
    _, ref_csv = family
    monitor = OnlineMonitor(_spec(tmp_path, str(ref_csv)), tmp_path / "m.jsonl")
    start = time.perf_counter()
    for step in range(1, 20_001):
        monitor.observe(step, step / 20_000, 3.0)
    assert time.perf_counter() - start < 1.0  # ~us per step; the training step takes far more


def test_fresh_monitor_after_resume_needs_replay(family, tmp_path):
    df, ref_csv = family
    loss = df.loc[df["run"] == "s8_s1", "loss"].to_numpy()
    spec = _spec(tmp_path, str(ref_csv))
    straight = _feed(OnlineMonitor(spec, tmp_path / "a.jsonl"), loss)[-1]
    blind = OnlineMonitor(spec, tmp_path / "b.jsonl")  # the job restarted at step 1200
    verdict = _feed(blind, loss, start=1201)[0]
    assert verdict.status == "unaligned" and "replay" in verdict.message and not verdict.alarm
    resumed = OnlineMonitor(spec, tmp_path / "c.jsonl")
    resumed.replay(
        {"step": s, "t_hat": s / STEPS, "loss": float(loss[s - 1])} for s in range(1, 1201)
    )
    last = _feed(resumed, loss, start=1201)[-1]
    assert last.residual == pytest.approx(straight.residual, abs=1e-12)


def test_controls_audit_warns_once_for_a_weight_decay_not_rescaled(family, tmp_path, caplog):
    """reference.json carries the reference runs' tau (0.2); a run applying 1.23x less decay
    (tau 0.246) is flagged at its first step with an LR, once, and the log says so."""
    _, ref_csv = family
    assert json.loads((ref_csv.parent / "reference.json").read_text())["controls"]["tau"] == 0.2
    spec = _spec(tmp_path, str(ref_csv))
    lam = 1 / (spec.optim.lr_peak * 0.2 * STEPS)  # the weight decay tau 0.2 asks for
    warmup = spec.optim.warmup_steps

    def lr(step: int) -> float:
        return lr_at(step - 1, peak=spec.optim.lr_peak, warmup_steps=warmup, total_steps=STEPS)

    clean = OnlineMonitor(spec, tmp_path / "clean.jsonl")
    assert all(clean.audit_controls(s, lr(s), lam) is None for s in range(1, STEPS + 1))
    assert not (tmp_path / "clean.jsonl").exists()

    log_path = tmp_path / "wrong.jsonl"
    wrong = OnlineMonitor(spec, log_path)
    with caplog.at_level(logging.WARNING, logger="collapse.monitor"):
        warnings = [wrong.audit_controls(s, lr(s), lam / 1.23) for s in range(1, STEPS + 1)]
    hits = [i for i, w in enumerate(warnings) if w is not None]
    assert hits == [1]  # step 2: step 1's LR is 0
    assert "0.813x" in warnings[1] and "weight decay" in warnings[1]
    (record,) = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert record["status"] == "controls" and record["step"] == 2
    assert "controls audit" in caplog.text
