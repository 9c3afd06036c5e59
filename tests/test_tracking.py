"""Live tracking: the TensorBoard event files of a real run, read back with TensorBoard's own
EventAccumulator, hold the curve's numbers step by step, the monitor's checks, and each step
once after a kill and a resume."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pandas as pd
from test_checkpoint import _start_and_interrupt
from test_train_support import run_training, tiny_spec

from collapse.runspec import Monitor
from collapse.tracking import t_hat_step, tensorboard_dir


def _events(spec, subfolder: str = ""):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert tensorboard_dir(spec) == Path(spec.run_dir).parent.parent / "tensorboard" / spec.run
    folder = tensorboard_dir(spec) / subfolder
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def _scalars(events, tag: str) -> tuple[list[int], np.ndarray]:
    rows = events.Scalars(tag)
    return [r.step for r in rows], np.array([r.value for r in rows], dtype=np.float32)


def _curve(spec) -> pd.DataFrame:
    return pd.read_parquet(Path(spec.run_dir) / "curve.parquet")


def _ok(proc) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _monitored_spec(tmp_path: Path):
    """A monitored run whose threshold no real curve stays within: it alarms once aligned."""
    from synthetic import synthetic_family

    from collapse import analysis

    reference = tmp_path / "reference" / "reference.csv"
    family = synthetic_family({"s1": 3.4, "s2": 3.1}, steps=200, rng_seed=3)
    family.to_csv(tmp_path / "family.csv", index=False)
    analysis.build_reference([tmp_path / "family.csv"], None, ["s1", "s2"], reference.parent)
    monitor = Monitor(enabled=True, reference_csv=str(reference), every_steps=2, threshold=1e-9)
    return tiny_spec(tmp_path, steps=20, d_model=64, eval_every=10, monitor=monitor)


def test_tensorboard_logs_the_curve_and_the_monitor_checks(tmp_path: Path):
    spec = _monitored_spec(tmp_path)
    _ok(run_training(spec, tmp_path))
    events, curve = _events(spec), _curve(spec)
    steps = curve["step"].tolist()
    for tag, column in [("train/loss", "loss"), ("train/lr", "lr"), ("train/t_hat", "t_hat")]:
        logged_steps, values = _scalars(events, tag)
        assert logged_steps == steps, tag
        np.testing.assert_array_equal(values, curve[column].to_numpy(np.float32), err_msg=tag)
    for tag in ("train/grad_norm", "train/tokens_per_s"):
        assert _scalars(events, tag)[0] == steps
    valid = pd.read_parquet(Path(spec.run_dir) / "valid.parquet")
    valid_steps, valid_loss = _scalars(events, "valid/loss")
    assert valid_steps == valid["step"].tolist() == [10, 20]
    np.testing.assert_array_equal(valid_loss, valid["valid_loss"].to_numpy(np.float32))
    assert json.loads(events.Tensors("spec/text_summary")[0].tensor_proto.string_val[0]
                      .decode().strip("`\n"))["run"] == spec.run  # fmt: skip

    # the monitor: every check logs its threshold and alarm; aligned checks their residual and ell
    lines = [json.loads(line) for line in (Path(spec.run_dir) / "monitor.jsonl").open()]
    checks = [line for line in lines if line["status"] != "controls"]
    assert _scalars(events, "monitor/threshold")[0] == [c["step"] for c in checks] == steps[1::2]
    _, alarm = _scalars(events, "monitor/alarm")
    np.testing.assert_array_equal(alarm, [float(c["status"] == "alarm") for c in checks])
    aligned = [c for c in checks if c["residual"] is not None]
    assert aligned and any(c["status"] == "alarm" for c in aligned)
    residual_steps, residual = _scalars(events, "monitor/residual")
    assert residual_steps == [c["step"] for c in aligned]
    np.testing.assert_array_equal(residual, np.float32([c["residual"] for c in aligned]))
    from collapse.reference import ReferenceCurve

    reference = ReferenceCurve.read_csv(spec.monitor.reference_csv)
    ell_steps, ell = _scalars(events, "monitor/ell")
    expected = [c["residual"] + float(reference.at(c["t_hat"])) for c in aligned]
    assert ell_steps == residual_steps
    np.testing.assert_allclose(ell, expected, rtol=1e-6)
    # against t_hat (the run's t_hat folder): the loss every step, ell at the checks
    by_t_hat = _events(spec, "t_hat")
    t_hat_steps, loss = _scalars(by_t_hat, "by_t_hat/loss")
    assert t_hat_steps == [t_hat_step(t) for t in curve["t_hat"]]
    np.testing.assert_array_equal(loss, curve["loss"].to_numpy(np.float32))
    t_hat_steps, ell_by_t_hat = _scalars(by_t_hat, "by_t_hat/ell")
    assert t_hat_steps == [t_hat_step(c["t_hat"]) for c in aligned]
    np.testing.assert_array_equal(ell_by_t_hat, ell)
    messages = events.Tensors("monitor/message/text_summary")
    assert [m.step for m in messages] == [c["step"] for c in aligned if c["status"] == "alarm"]


def test_a_killed_and_resumed_run_logs_each_step_once(tmp_path: Path):
    """Killed (SIGKILL) after step 6, resumed from the checkpoint of step 4: the rerun's writer
    purges what the killed job logged past step 4, so every step is there once, as on the curve."""
    spec = tiny_spec(tmp_path, run="killed", steps=12, d_model=64, checkpoint_every=4)
    _start_and_interrupt(spec, tmp_path, at_step=6, how=signal.SIGKILL)
    killed_steps = _scalars(_events(spec), "train/loss")[0]
    assert killed_steps[:6] == [1, 2, 3, 4, 5, 6]
    _ok(run_training(spec, tmp_path))
    assert len(list(tensorboard_dir(spec).glob("events.out.tfevents.*"))) == 2
    curve = _curve(spec)
    (restart,) = curve.loc[curve["restart"], "step"].tolist()
    assert restart <= killed_steps[-1]  # the killed job logged steps the rerun trains again
    events = _events(spec)
    for tag, column in [("train/loss", "loss"), ("train/lr", "lr")]:
        logged_steps, values = _scalars(events, tag)
        assert logged_steps == list(range(1, 13)), tag
        np.testing.assert_array_equal(values, curve[column].to_numpy(np.float32), err_msg=tag)
    t_hat_steps, loss = _scalars(_events(spec, "t_hat"), "by_t_hat/loss")
    assert t_hat_steps == [t_hat_step(t) for t in curve["t_hat"]]
    np.testing.assert_array_equal(loss, curve["loss"].to_numpy(np.float32))


def test_tensorboard_off_writes_no_event_files(tmp_path: Path):
    spec = tiny_spec(tmp_path, steps=4)
    spec = spec.model_copy(
        update={"logging": spec.logging.model_copy(update={"tensorboard": False})}
    )
    assert '"tensorboard": false' in spec.to_json()
    _ok(run_training(spec, tmp_path))
    assert not tensorboard_dir(spec).exists()


def test_the_family_config_turns_tensorboard_off_in_every_spec():
    """training.tensorboard in the family config reaches each RunSpec's logging block; left at
    their defaults, tensorboard and wandb leave the spec as it read before they were fields (its
    hash, the rerun trigger, is unchanged)."""
    from test_plan_digest import CONFIG, CORPUS_TOKENS

    from collapse.config import load_config
    from collapse.plan import plan_family

    def plan(*overrides):
        config = load_config(["family=tiny", "cluster=local", *overrides], CONFIG)
        return plan_family(config, corpus_tokens=CORPUS_TOKENS)

    on, off = plan(), plan("family.training.tensorboard=false")
    assert all(spec.logging.tensorboard for spec in on.runs)
    assert not any(spec.logging.wandb for spec in on.runs)
    assert all('"tensorboard"' not in spec.to_json() for spec in on.runs)
    assert all('"wandb"' not in spec.to_json() for spec in on.runs)
    assert [spec.logging.tensorboard for spec in off.runs] == [False] * len(off.runs)
    assert '"tensorboard": false' in off.runs[0].to_json()


def _wandb_records(path: Path) -> list:
    """The records of an offline W&B run file (LevelDB log blocks after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    records, pos, buffer = [], 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buffer = chunk if kind in (1, 2) else buffer + chunk  # FULL/FIRST start a record
        if kind in (1, 4):  # FULL/LAST end it
            record = wandb_internal_pb2.Record()
            record.ParseFromString(buffer)
            records.append(record)
    return records


def test_wandb_offline_logs_one_run_per_training_run_with_the_spec(tmp_path: Path, monkeypatch):
    from collapse.tracking import wandb_dir, wandb_id

    monkeypatch.setenv("WANDB_SILENT", "true")
    spec = tiny_spec(tmp_path, run="tracked", steps=6)
    spec = spec.model_copy(update={"logging": spec.logging.model_copy(update={"wandb": True})})
    _ok(run_training(spec, tmp_path))
    assert wandb_dir(spec) == Path(spec.run_dir).parent.parent / "wandb"
    (path,) = wandb_dir(spec).glob(f"wandb/offline-run-*-{wandb_id(spec)}/run-*.wandb")
    records = _wandb_records(path)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.run_group, run.display_name) == (wandb_id(spec), "test", "tracked")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["run"] == "tracked" and config["optim"]["steps"] == 6
    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            history[items["_step"]] = items
    curve = _curve(spec)
    assert sorted(history) == curve["step"].tolist()
    assert [history[s]["train/loss"] for s in sorted(history)] == curve["loss"].tolist()
    assert [history[s]["train/lr"] for s in sorted(history)] == curve["lr"].tolist()


def test_a_run_finds_its_family_folder_from_its_run_dir():
    from collapse.layout import FamilyLayout

    layout = FamilyLayout.of("fam", "/results")
    for run in ("d96_tpp10_s0", "sweep/tau0.1"):
        assert FamilyLayout.of_run(layout.run_dir(run), run) == layout
        assert layout.tensorboard(run) == Path("/results/fam/tensorboard") / run


def test_a_killed_and_resumed_run_is_one_wandb_run_read_back_as_its_curve(
    tmp_path: Path, monkeypatch
):
    """W&B on, killed (SIGKILL) after step 6 and resumed from step 4: the rerun continues the
    same W&B run id (a second offline folder), and reading the W&B folder back gives the run's
    curve, each step once, equal to curve.parquet."""
    import warnings

    from collapse.logreaders import LogStitchWarning, read_logs
    from collapse.tracking import wandb_dir, wandb_id

    monkeypatch.setenv("WANDB_SILENT", "true")
    spec = tiny_spec(tmp_path, run="resumed", steps=12, d_model=64, checkpoint_every=4)
    spec = spec.model_copy(update={"logging": spec.logging.model_copy(update={"wandb": True})})
    _start_and_interrupt(spec, tmp_path, at_step=6, how=signal.SIGKILL)
    _ok(run_training(spec, tmp_path))
    folders = sorted(wandb_dir(spec).glob(f"wandb/offline-run-*-{wandb_id(spec)}"))
    assert len(folders) == 2  # one per job, one run id
    with warnings.catch_warnings():  # steps the killed job logged past 4, if it flushed them
        warnings.simplefilter("ignore", LogStitchWarning)
        [frame], _ = read_logs([wandb_dir(spec) / "wandb"], loss_tag="train/loss")
    curve = _curve(spec)
    assert frame["step"].tolist() == list(range(1, 13)) == curve["step"].tolist()
    np.testing.assert_array_equal(frame["loss"].to_numpy(), curve["loss"].to_numpy())
