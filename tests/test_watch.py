"""``collapse watch`` on runs being written now: a SummaryWriter appends events in a thread
while the command, a real subprocess, polls them; Ctrl-C stops it cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from logwriters import write_wandb_runs
from synthetic import synthetic_family

from collapse import analysis as A
from collapse.watch import Watcher, watch

SIZES = {"s1": 3.4, "s2": 3.1, "s4": 2.8, "s8": 2.5}
STEPS = 1000
FAULT_T_HAT = 0.65
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """A collapsing synthetic family and its reference (sizes s1, s2)."""
    root = tmp_path_factory.mktemp("watch")
    df = synthetic_family(SIZES, steps=STEPS, noise_rel=0.005, wiggle_rel=0.001, rng_seed=3)
    df.to_csv(root / "curves.csv", index=False)
    A.build_reference([root / "curves.csv"], None, ["s1", "s2"], root / "reference")
    clean = df.loc[df["run"] == "s8_s1", "loss"].to_numpy()
    faulty = clean.copy()
    faulty[int(FAULT_T_HAT * STEPS) :] *= 1.04  # biased from t_hat 0.65 on
    return {"clean": clean, "faulty": faulty}, root / "reference"


def _write(logdir: Path, losses: dict[str, np.ndarray], chunk: int, pause: float) -> None:
    """One SummaryWriter per run (Megatron-LM's tag), appending ``chunk`` steps at a time."""
    from torch.utils.tensorboard import SummaryWriter

    writers = {run: SummaryWriter(str(logdir / run)) for run in losses}
    for start in range(0, STEPS, chunk):
        for run, loss in losses.items():
            for step in range(start + 1, start + chunk + 1):
                writers[run].add_scalar("lm loss", float(loss[step - 1]), step)
                writers[run].add_scalar("lr", 1e-3, step)
            writers[run].flush()
        time.sleep(pause)
    for writer in writers.values():
        writer.close()


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line.rstrip("\n"))


def test_watch_reports_the_run_that_leaves_the_band_and_stops_on_ctrl_c(family, tmp_path):
    losses, reference = family
    logdir, out = tmp_path / "tb", tmp_path / "watch"
    logdir.mkdir()
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'workflow'}{os.pathsep}{ROOT}"}
    flags = ["--out", str(out), "--steps", str(STEPS), "--interval", "0.2"]
    command = [sys.executable, "-m", "collapse.cli", "watch", str(logdir)]
    command += ["--reference", str(reference), *flags]
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    writer = threading.Thread(target=_write, args=(logdir, losses, 50, 0.3))
    writer.start()
    seen: list[str] = []
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=1))
            if any(line.startswith("ALARM faulty") for line in seen) and not writer.is_alive():
                break
        writer.join()
        time.sleep(1.0)  # a last poll sees the writers' final records
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    while not lines.empty():
        seen.append(lines.get())
    text = "\n".join(seen)
    assert rc == 0, text
    alarms = [line for line in seen if line.startswith("ALARM")]
    assert len(alarms) == 1 and alarms[0].startswith("ALARM faulty: left the reference band"), text
    t_hat = float(alarms[0].split("at t_hat ")[1].split(":")[0])
    assert FAULT_T_HAT <= t_hat < 0.7, text
    assert "residual +" in alarms[0]  # the faulty run's loss runs above the reference
    assert "stopped (SIGINT)" in seen and any(
        line.startswith("watched 2 run(s)") for line in seen
    ), text
    gates = {run: json.loads((out / "gates" / f"{run}.json").read_text()) for run in losses}
    assert gates["faulty"]["status"] == "fail" and gates["clean"]["status"] == "pass"
    assert gates["faulty"]["first_crossing_t_hat"] >= FAULT_T_HAT
    # the crossing reported live is the gate's (on the reference's t_hat grid, 0.005 apart)
    assert t_hat == pytest.approx(gates["faulty"]["first_crossing_t_hat"], abs=0.006)
    # the same verdict the offline gate gives the finished curve (the workflow's gate JSON)
    ref, summary = A._reference_context(reference)
    window = summary["smoothing"]["window_steps"]
    offline = A.load_matrix(_frame("faulty", losses["faulty"]), window_steps=window, grid=ref.t_hat)
    verdict, _ = A.gate_matrix(offline, ref, A.GatePolicy(), summary.get("offset", 0.0))
    assert gates["faulty"]["first_crossing_t_hat"] == pytest.approx(verdict[0].first_crossing_t_hat)
    checks = [json.loads(x) for x in (out / "monitor" / "faulty.jsonl").read_text().splitlines()]
    assert checks[-1]["status"] == "alarm" and checks[-1]["step"] == STEPS


def _frame(run: str, loss: np.ndarray):
    import pandas as pd

    return pd.DataFrame({"run": run, "step": np.arange(1, len(loss) + 1), "loss": loss})


def test_half_written_event_file_never_crashes_the_watcher(family, tmp_path):
    """The watcher polls a file cut inside a record, then the writer finishes the record."""
    losses, reference = family
    full = tmp_path / "full"
    _write(full, {"clean": losses["clean"]}, STEPS, 0)
    source = next((full / "clean").glob("*tfevents*"))
    data = source.read_bytes()
    logdir = tmp_path / "tb" / "clean"
    logdir.mkdir(parents=True)
    target = logdir / source.name
    target.write_bytes(data[: len(data) // 2 + 3])  # inside a record
    said: list[str] = []
    watcher = Watcher(tmp_path / "tb", reference, tmp_path / "out", steps=STEPS, echo=said.append)
    assert watch(watcher, interval=0.01, once=True) == 0
    first = watcher.runs["clean"].last_step
    assert 0 < first < STEPS
    with target.open("ab") as handle:
        handle.write(data[len(data) // 2 + 3 :])
    watcher.poll()
    assert watcher.runs["clean"].last_step == STEPS
    assert watcher.complete() and watcher.runs["clean"].gate.status == "pass"


def test_watch_without_total_steps_or_loss_tag(family, tmp_path):
    losses, reference = family
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb" / "r"))
    for step in range(1, 11):
        writer.add_scalar("objective", 3.0, step)
    writer.close()
    said: list[str] = []
    watcher = Watcher(tmp_path / "tb", reference, tmp_path / "out", steps=STEPS, echo=said.append)
    from collapse.validate import InputError

    with pytest.raises(InputError, match="scalar tags present: 'objective'"):
        watcher.poll()
    watcher = Watcher(
        tmp_path / "tb", reference, tmp_path / "out", loss_tag="objective", echo=said.append
    )
    watcher.poll()
    assert any("skip r: its total steps are unknown" in line for line in said)


def test_watch_reads_wandb_runs_as_they_grow(family, tmp_path):
    """A .wandb file cut inside a record, then whole: the watcher reads on to the end."""
    losses, reference = family
    steps = list(range(1, STEPS + 1))
    runs = {r: {"config": {}, "steps": steps, "loss": loss.tolist()} for r, loss in losses.items()}
    write_wandb_runs(tmp_path / "w", runs)
    files = sorted((tmp_path / "w" / "wandb").glob("offline-run-*/run-*.wandb"))
    data = {f: f.read_bytes() for f in files}
    for f in files:
        f.write_bytes(data[f][: len(data[f]) // 2 + 5])
    said: list[str] = []
    watcher = Watcher(tmp_path / "w", reference, tmp_path / "out", steps=STEPS, echo=said.append)
    watcher.poll()
    assert set(watcher.runs) == {"clean", "faulty"}
    assert all(0 < w.last_step < STEPS for w in watcher.runs.values())
    for f in files:
        f.write_bytes(data[f])
    watcher.poll()
    assert watcher.complete()
    assert [line.split(":")[0] for line in said if line.startswith("ALARM")] == ["ALARM faulty"]
    assert watcher.runs["faulty"].gate.status == "fail"
    assert watcher.runs["clean"].gate.status == "pass"
