"""The training entry point, for real: Megatron-Core on CPU through `python -m collapse.train`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
from test_train_support import losses, run_training, tiny_spec

from collapse import controls
from collapse.faults import Faults
from collapse.layout import CURVE_COLUMNS, VALID_COLUMNS
from collapse.scaling import lr_at
from collapse.train import EXIT_BAD_INPUT, EXIT_NONFINITE, steps_target


def _ok(proc) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_short_run_writes_the_declared_outputs(tmp_path: Path):
    spec = tiny_spec(tmp_path, steps=12, d_model=64, eval_every=6)
    proc = run_training(spec, tmp_path)
    _ok(proc)
    run_dir = Path(spec.run_dir)
    curve = pd.read_parquet(run_dir / "curve.parquet")
    valid = pd.read_parquet(run_dir / "valid.parquet")
    meta = json.loads((run_dir / "meta.json").read_text())
    assert tuple(curve.columns) == CURVE_COLUMNS
    assert tuple(valid.columns) == VALID_COLUMNS
    assert curve["step"].tolist() == list(range(1, 13))
    assert curve["tokens"].iloc[-1] == 12 * 8 * 32 == meta["tokens"]
    assert curve["t_hat"].iloc[-1] == 1.0
    assert not curve["restart"].any()
    assert valid["step"].tolist() == [6, 12]
    # it learns the toy language
    assert curve["loss"].iloc[-3:].mean() < curve["loss"].iloc[:3].mean() - 0.3
    # LR: the hidden group follows the shared D2Z schedule (update t uses lr_at(t-1))
    expected = [
        lr_at(t - 1, peak=spec.mup.lr_hidden, warmup_steps=1, total_steps=12) for t in range(1, 13)
    ]
    assert curve["lr"].tolist() == pytest.approx(expected, rel=1e-12)
    # lambda as Megatron's param group applied it: the plan's, so the audit finds the spec's tau
    assert curve["weight_decay"].tolist() == pytest.approx([spec.optim.weight_decay] * 12)
    tau = 1 / (spec.mup.lr_hidden * spec.optim.weight_decay * 12)  # this spec's, by hand
    checked = controls.audit(curve, 1, 12, tau, tolerance=1e-6)
    assert checked.index is None and checked.realized_tau == pytest.approx(tau)
    assert meta["steps_done"] == 12 and meta["final_loss"] == curve["loss"].iloc[-1]
    assert meta["restarts"] == [] and meta["world_size"] == 1
    assert meta["params_counted"] > 0 and meta["versions"]["megatron-core"] == "0.16.1"
    assert "tokens/s" in proc.stdout and "ETA" in proc.stdout


def test_stop_fraction_keeps_the_full_schedule(tmp_path: Path):
    spec = tiny_spec(tmp_path, steps=20, stop_fraction=0.3)
    _ok(run_training(spec, tmp_path))
    curve = pd.read_parquet(Path(spec.run_dir) / "curve.parquet")
    assert len(curve) == steps_target(spec) == 6
    assert curve["t_hat"].iloc[-1] == pytest.approx(0.3)
    assert curve["lr"].iloc[-1] == pytest.approx(
        lr_at(5, peak=spec.mup.lr_hidden, warmup_steps=2, total_steps=20)
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("activation", "positions", "tied", "kind"),
    [("swiglu", "alibi", False, "completep"), ("squared_relu", "learned", True, "sp")],
)
def test_architecture_variants_train(tmp_path: Path, activation, positions, tied, kind):
    spec = tiny_spec(
        tmp_path, steps=8, activation=activation, positions=positions, tied=tied, kind=kind
    )
    _ok(run_training(spec, tmp_path))
    values = losses(spec)
    assert len(values) == 8 and all(math.isfinite(v) for v in values)
    assert values[-1] < values[0]


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path: Path):
    from collapse.checkpoint import latest_complete, step_of
    from collapse.runspec import FaultInjection

    spec = tiny_spec(
        tmp_path,
        steps=10,
        checkpoint_every=3,
        fault=FaultInjection(kind="nan_loss", at_fraction=0.5, magnitude=0.0),
    )
    assert Faults.of(spec).step == 5
    proc = run_training(spec, tmp_path)
    assert proc.returncode == EXIT_NONFINITE, proc.stderr[-2000:]
    assert "loss is nan at step 5" in proc.stderr
    assert not (Path(spec.run_dir) / "meta.json").exists()
    assert step_of(latest_complete(spec.checkpoint_dir)) == 3


def test_world_size_mismatch_names_the_fix(tmp_path: Path):
    spec = tiny_spec(tmp_path, steps=4, tp=2)
    proc = run_training(spec, tmp_path)
    assert proc.returncode == EXIT_BAD_INPUT
    assert "torchrun --nproc_per_node=2" in proc.stderr


def test_missing_dataset_is_a_clear_error(tmp_path: Path):
    spec = tiny_spec(tmp_path, steps=4, dataset_prefix=str(tmp_path / "nowhere" / "train"))
    proc = run_training(spec, tmp_path)
    assert proc.returncode == EXIT_BAD_INPUT
    assert "nowhere" in proc.stderr


def test_faults_resolve_to_steps(tmp_path: Path):
    from collapse.runspec import FaultInjection

    def faults(kind, magnitude=2.0):
        fault = FaultInjection(kind=kind, at_fraction=0.5, magnitude=magnitude)
        return Faults.of(tiny_spec(tmp_path, steps=200, fault=fault))

    off = Faults.of(tiny_spec(tmp_path, steps=200))
    assert off.lr_factor(100) == 1.0 and off.data_step(150) == 150 and off.loss_bias(150) == 0
    assert faults("lr_spike").lr_factor(100) == 2.0 and faults("lr_spike").lr_factor(102) == 1.0
    assert faults("loss_bias", 0.1).loss_bias(99) == 0 and faults("loss_bias", 0.1).loss_bias(100)
    assert faults("data_repeat", 0.0).data_step(100) == 1
    assert faults("data_repeat", 0.0).data_step(150) == 51  # rewound once, then onward
    loop = faults("data_repeat", 0.02)  # steps 96-99 replayed in a loop from step 100 on
    assert [loop.data_step(s) for s in (99, 100, 103, 104, 150)] == [99, 96, 99, 96, 98]
    assert faults("nan_loss").poisons_loss(100) and not faults("nan_loss").poisons_loss(101)
    assert faults("loss_kernel", 0.875).kept_every(99) == 1
    assert faults("loss_kernel", 0.875).kept_every(100) == 8
    assert off.kept_every(150) == 1


def test_a_fault_runs_nan_is_its_outcome_not_a_failure(tmp_path: Path):
    """role=fault: the NaN ends the run with its curve written (the experiment measures it)."""
    from collapse.runspec import FaultInjection

    fault = FaultInjection(kind="nan_loss", at_fraction=0.5, name="nan-loss")
    spec = tiny_spec(tmp_path, steps=10, fault=fault).model_copy(update={"role": "fault"})
    proc = run_training(spec, tmp_path)
    _ok(proc)
    curve = pd.read_parquet(Path(spec.run_dir) / "curve.parquet")
    assert list(curve.step) == [1, 2, 3, 4, 5] and math.isnan(curve.loss.iloc[-1])
    assert curve.loss.iloc[:-1].notna().all()
    meta = json.loads((Path(spec.run_dir) / "meta.json").read_text())
    assert meta["stopped"] == "nonfinite" and meta["steps_done"] == 5


def test_loss_kernel_fault_changes_training_only_from_its_step(tmp_path: Path):
    """The broken reduction leaves every step before the fault bit-identical, then the run
    trains on 1 token in 8 (a different, noisier curve, not NaN and not a shift)."""
    from collapse.runspec import FaultInjection

    clean = tiny_spec(tmp_path / "clean", steps=12)
    fault = FaultInjection(kind="loss_kernel", at_fraction=0.5, magnitude=0.875)
    broken = tiny_spec(tmp_path / "broken", steps=12, fault=fault)
    _ok(run_training(clean, tmp_path / "clean"))
    _ok(run_training(broken, tmp_path / "broken"))
    a, b = losses(clean), losses(broken)
    assert a[:5] == b[:5]  # steps 1-5 (the fault starts at step 6)
    assert all(x != y for x, y in zip(a[6:], b[6:], strict=True))
    assert all(math.isfinite(y) for y in b)


def _monitored(tmp_path: Path, stop: bool):
    """A run whose monitor checks every 2 steps against a synthetic family's reference, with a
    threshold no real curve stays within: it alarms at its first check after the align window."""
    from synthetic import synthetic_family

    from collapse import analysis
    from collapse.runspec import Monitor

    reference = tmp_path / "reference" / "reference.csv"
    if not reference.is_file():
        family = synthetic_family({"s1": 3.4, "s2": 3.1}, steps=200, rng_seed=3)
        family.to_csv(tmp_path / "family.csv", index=False)
        analysis.build_reference([tmp_path / "family.csv"], None, ["s1", "s2"], reference.parent)
    monitor = Monitor(
        enabled=True,
        reference_csv=str(reference),
        every_steps=2,
        threshold=1e-9,
        stop_on_alarm=stop,
    )
    return tiny_spec(tmp_path, steps=20, d_model=64, monitor=monitor)


def test_a_monitor_alarm_with_stop_on_alarm_saves_and_stops_then_resumes(tmp_path: Path):
    """stop_on_alarm: the alarm step is checkpointed and the job exits 3 without outputs; the
    rerun without it resumes there (the monitor sees the restored curve again) and finishes."""
    from collapse.checkpoint import latest_complete, step_of
    from collapse.train import EXIT_MONITOR_ALARM

    spec = _monitored(tmp_path, stop=True)
    proc = run_training(spec, tmp_path)
    assert proc.returncode == EXIT_MONITOR_ALARM, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [json.loads(line) for line in (Path(spec.run_dir) / "monitor.jsonl").open()]
    print([(line["status"], line.get("step")) for line in lines])
    # the controls audit: this spec's eta * lambda is not the rate of the reference's tau
    assert [line["status"] for line in lines].count("controls") == 1
    checks = [line for line in lines if line["status"] != "controls"]
    assert {c["status"] for c in checks[:-1]} == {"waiting"}
    step = checks[-1]["step"]
    assert checks[-1]["status"] == "alarm" and 2 < step < 20
    assert f"collapse monitor alarm at step {step}" in proc.stderr
    assert step_of(latest_complete(spec.checkpoint_dir)) == step
    assert not (Path(spec.run_dir) / "meta.json").exists()

    _ok(run_training(_monitored(tmp_path, stop=False), tmp_path))
    curve = pd.read_parquet(Path(spec.run_dir) / "curve.parquet")
    assert curve["step"].tolist() == list(range(1, 21))
    assert curve.loc[curve["restart"], "step"].tolist() == [step + 1]
    last = json.loads((Path(spec.run_dir) / "monitor.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 20 and last["status"] == "alarm"  # aligned again after the replay


def test_the_spec_decides_which_callbacks_attach(tmp_path: Path):
    """A production run has no fault callback; a fault run gets its fault first (it changes what
    the others see) and its NaN as an outcome; a monitored run gets the monitor on every rank."""
    from collapse.callbacks import Preemption
    from collapse.runspec import FaultInjection, Monitor
    from collapse.train import callbacks_for

    preemption = Preemption.__new__(Preemption)  # its handlers stay out of this process

    def names(spec) -> list[str]:
        return [type(c).__name__ for c in callbacks_for(spec, preemption)]

    # trackers before the log line: a step the log shows is already in the dashboards
    production = [
        "NonFiniteLoss", "Evaluation", "TensorBoard", "Progress", "Preemption", "Checkpointing",
    ]  # fmt: skip
    assert names(tiny_spec(tmp_path)) == production
    quiet = tiny_spec(tmp_path)
    quiet = quiet.model_copy(
        update={"logging": quiet.logging.model_copy(update={"tensorboard": False})}
    )
    assert names(quiet) == [name for name in production if name != "TensorBoard"]
    fault = FaultInjection(kind="lr_spike", at_fraction=0.5, magnitude=2.0)
    faulty = tiny_spec(tmp_path, fault=fault).model_copy(update={"role": "fault"})
    assert names(faulty) == ["InjectFault", "NonFiniteOutcome", *production[1:]]
    assert names(tiny_spec(tmp_path, fault=fault))[:2] == ["InjectFault", "NonFiniteLoss"]
    planned = FaultInjection(kind="wrong_tau", at_fraction=0.0, magnitude=2.0)  # the plan's
    assert names(tiny_spec(tmp_path, fault=planned)) == production
    # the monitor reads its reference when made: rank 0 here, so the audit attaches too
    reference = tmp_path / "reference.csv"
    reference.write_text("t_hat,ell,lower,upper\n0.0,1.0,0.99,1.01\n1.0,0.5,0.49,0.51\n")
    monitor = Monitor(enabled=True, reference_csv=str(reference), every_steps=10)
    got = names(tiny_spec(tmp_path, monitor=monitor, run_dir=str(tmp_path / "run")))
    assert got == ["ControlsAudit", *production[:4], "CollapseMonitor", *production[4:]]


@pytest.mark.slow
def test_the_planned_recompute_trains_the_same_losses(tmp_path: Path):
    """Recompute changes memory, not arithmetic: full and selective give the losses of none."""
    curves = {}
    for recompute in ("none", "full", "selective"):
        spec = tiny_spec(tmp_path, run=f"recompute-{recompute}", steps=4)
        spec = spec.model_copy(
            update={"parallel": spec.parallel.model_copy(update={"recompute": recompute})}
        )
        _ok(run_training(spec, tmp_path))
        curves[recompute] = losses(spec)
    assert curves["full"] == pytest.approx(curves["none"], rel=1e-5)
    assert curves["selective"] == pytest.approx(curves["none"], rel=1e-5)
