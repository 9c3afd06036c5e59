"""``collapse watch``: the online collapse monitor on runs another stack is training now.

Polls a TensorBoard log directory (``collapse.logreaders``: every folder with event files is a
run, read incrementally; a record still being written is read on a later poll), or a folder of
W&B runs (their ``run-<id>.wandb`` files, offline or the local copy of an online run, re-read
when they grow; the folder must hold one when the watch starts). Each run with a
loss tag and a known length (its ``steps`` in the ``--runs`` table, else ``--steps``) feeds an
``OnlineMonitor`` (collapse.monitor): the same early-align, smoothing and threshold as the
monitor inside this project's training loop. Per run, under ``--out``:

    monitor/<run>.jsonl   one line per check (the monitor's log)
    gates/<run>.json      the gate verdict of the curve so far (collapse.gates, the JSON the
                          workflow's gate rule writes), rewritten as the run grows

A run that leaves the reference band is reported once on stdout, with its t_hat and residual;
a run that comes back is reported too. Ctrl-C (SIGINT) or SIGTERM stops the watch: the gates
are written a last time, a summary printed, and the exit status is 0.
"""

from __future__ import annotations

import argparse
import math
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from collapse import logreaders as L
from collapse import validate as V
from collapse.gates import GatePolicy, GateVerdict
from collapse.monitor import MonitorVerdict, OnlineMonitor
from collapse.validate import InputError

# how many distinct steps a run may log without the loss tag before the tag counts as absent
TAG_GRACE_STEPS = 3


@dataclass(frozen=True)
class _MonitorBlock:
    reference_csv: str
    threshold: float = 0.0  # 0: calibrated from the reference's seed noise
    stop_on_alarm: bool = False


@dataclass(frozen=True)
class _Optim:
    steps: int


@dataclass(frozen=True)
class WatchedSpec:
    """What ``OnlineMonitor`` reads of a run spec, for a run this project did not plan."""

    run: str
    monitor: _MonitorBlock
    optim: _Optim


@dataclass
class WatchedRun:
    name: str
    steps: int
    tag: str
    monitor: OnlineMonitor
    fed: int = 0  # points of the tag already observed
    last_step: int = -1
    first_step: int | None = None
    alarmed: bool = False
    verdict: MonitorVerdict | None = None
    gate: GateVerdict | None = None
    refused: str | None = None
    points: list[tuple[int, float]] = field(default_factory=list)


def _safe(name: str) -> str:
    return "/".join(part if part not in ("", ".", "..") else "_" for part in name.split("/"))


class Watcher:
    """Polls one log directory and keeps one monitor per run."""

    def __init__(
        self,
        logdir: str | Path,
        reference: str | Path,
        out: str | Path,
        runs_table: pd.DataFrame | None = None,
        steps: int | None = None,
        loss_tag: str | None = None,
        policy: GatePolicy | None = None,
        threshold: float | None = None,
        echo=print,
    ):
        from collapse.analysis import _reference_context

        self.logdir = Path(logdir)
        if not self.logdir.exists():
            raise V.fail(
                "no such directory", "give the log directory the runs write to", str(logdir)
            )
        ref = Path(reference)
        self.reference_csv = ref / "reference.csv" if ref.is_dir() else ref
        self.reference, summary = _reference_context(self.reference_csv)
        self.offset = float(summary.get("offset", 0.0) or 0.0)
        self.window_steps = (summary.get("smoothing") or {}).get("window_steps")
        self.out = Path(out)
        self.policy = policy or GatePolicy()
        self.threshold = threshold
        self.steps = steps
        self.loss_tag = loss_tag
        self.meta = runs_table.set_index("run") if runs_table is not None else None
        self.tb: L.TensorBoardDir | L.WandbDir = (
            L.WandbDir(self.logdir)
            if self.logdir.name.endswith(".wandb") or L._wandb_files(self.logdir)
            else L.TensorBoardDir(self.logdir)
        )
        self.runs: dict[str, WatchedRun] = {}
        self.skipped: dict[str, str] = {}  # run -> why it is not watched (said once)
        self.echo = echo
        self.polls = 0

    # ------------------------------------------------------------ one poll

    def _total_steps(self, name: str) -> int | None:
        """From --runs, else the run's own log (a W&B config's steps), else --steps."""
        if self.meta is not None and name in self.meta.index and "steps" in self.meta.columns:
            value = self.meta.loc[name, "steps"]
            if pd.notna(value):
                return int(value)
        logged = self.tb.runs[name].meta.get("steps")
        if isinstance(logged, (int, float)) and logged > 0:
            return int(logged)
        return self.steps

    def _skip(self, name: str, why: str) -> None:
        if self.skipped.get(name) != why:
            self.skipped[name] = why
            self.echo(f"skip {name}: {why}")

    def _start(self, name: str) -> WatchedRun | None:
        run = self.tb.runs[name]
        tag = L.loss_tag_of(run, self.loss_tag)
        if tag is None:
            return None
        steps = self._total_steps(name)
        if steps is None:
            self._skip(
                name,
                "its total steps are unknown, so t_hat = step / steps is too: give a steps "
                "column in --runs or --steps",
            )
            return None
        spec = WatchedSpec(
            name,
            _MonitorBlock(str(self.reference_csv), float(self.threshold or 0.0)),
            _Optim(steps),
        )
        log_path = self.out / "monitor" / f"{_safe(name)}.jsonl"
        log_path.unlink(missing_ok=True)
        monitor = OnlineMonitor(spec, log_path, self.policy, self.window_steps)  # type: ignore[arg-type]
        self.echo(f"watching {name}: tag {tag!r}, {steps} steps, threshold {monitor.threshold:.4f}")
        return WatchedRun(name, steps, tag, monitor)

    def _check_tags(self) -> None:
        """No run logs the loss tag although runs log scalars at several steps: an error."""
        if any(w for w in self.runs.values()):
            return
        logs = list(self.tb.runs.values())
        busy = [r for r in logs if len({s for pts in r.scalars.values() for s, _ in pts}) > 2]
        if busy and all(L.loss_tag_of(r, self.loss_tag) is None for r in logs):
            L.choose_runs(logs, self.loss_tag)  # raises, listing the tags present

    def _feed(self, watched: WatchedRun) -> bool:
        """Observe the run's new points; False when nothing new came."""
        points = self.tb.runs[watched.name].scalars.get(watched.tag, [])
        new = points[watched.fed :]
        watched.fed = len(points)
        if not new or watched.refused:
            return False
        for step, value in new:
            if watched.first_step is None:
                watched.first_step = step
            elif step <= watched.first_step and watched.last_step >= step:
                watched.refused = (
                    f"its step counter goes back from {watched.last_step} to {step}, at or "
                    f"before its first step {watched.first_step}: two attempts in one folder; "
                    "no longer watched (move the abandoned attempt's event files away)"
                )
                self.echo(f"refuse {watched.name}: {watched.refused}")
                return True
            if step <= watched.last_step:  # resumed from a checkpoint: later values replace
                watched.points = [p for p in watched.points if p[0] < step]
            watched.points.append((step, value))
            watched.last_step = step
            watched.monitor.observe(step, step / watched.steps, value)
        return True

    def _gate(self, watched: WatchedRun) -> None:
        from collapse import analysis as A

        if len(watched.points) < V.MIN_RUN_POINTS:
            return
        frame = pd.DataFrame(
            {
                "run": watched.name,
                "step": [p[0] for p in watched.points],
                "loss": [p[1] for p in watched.points],
                "steps": watched.steps,
            }
        )
        policy = self.policy
        if self.threshold:
            policy = policy.model_copy(update={"threshold": self.threshold})
        try:
            matrix = A.load_matrix(
                frame,
                window_steps=watched.monitor.window_steps,
                grid=self.reference.t_hat,
                align_window=policy.align_window,
            )
        except InputError as err:
            self._skip(watched.name, f"its curve so far is refused: {err}")
            return
        verdicts, _ = A.gate_matrix(matrix, self.reference, policy, self.offset)
        watched.gate = verdicts[0]
        path = self.out / "gates" / f"{_safe(watched.name)}.json"
        partial = watched.gate.write_json(path.with_name(path.name + ".partial"))
        partial.replace(path)  # a reader never sees a half-written verdict

    def poll(self) -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            grew = self.tb.poll()
        for warning in caught:
            self.echo(f"note: {warning.message}")
        self.polls += 1
        for name in sorted(grew):
            if name not in self.runs:
                started = self._start(name)
                if started is None:
                    continue
                self.runs[name] = started
            watched = self.runs[name]
            if not self._feed(watched) or watched.refused:
                continue
            verdict = watched.monitor.check()
            watched.verdict = verdict
            self._report(watched, verdict)
            self._gate(watched)
        self._check_tags()

    def _report(self, watched: WatchedRun, verdict: MonitorVerdict) -> None:
        if verdict.alarm and not watched.alarmed:
            watched.alarmed = True
            residual = (
                "not finite"
                if verdict.residual is None or math.isnan(verdict.residual)
                else f"{verdict.residual:+.4f}"
            )
            self.echo(
                f"ALARM {watched.name}: left the reference band at t_hat "
                f"{self._first_crossing(watched, verdict):.3f}: residual {residual} (the largest "
                f"since the last check, at t_hat {verdict.t_hat:.3f}), threshold "
                f"{verdict.threshold:.4f}; read up to step {verdict.step}"
            )
        elif not verdict.alarm and watched.alarmed and verdict.status == "ok":
            watched.alarmed = False
            self.echo(
                f"back {watched.name}: within the band at t_hat {verdict.t_hat:.3f} "
                f"(residual {verdict.residual:+.4f})"
                if verdict.residual is not None
                else f"back {watched.name}: within the band at t_hat {verdict.t_hat:.3f}"
            )

    def _first_crossing(self, watched: WatchedRun, verdict: MonitorVerdict) -> float:
        """The first t_hat in the gate window where |r| exceeds the threshold."""
        t, r = watched.monitor.residuals()
        lo, hi = self.policy.window
        with np.errstate(invalid="ignore"):
            crossing = np.flatnonzero((t >= lo) & (t <= hi) & ~(np.abs(r) <= verdict.threshold))
        return float(t[crossing[0]]) if len(crossing) else verdict.t_hat

    def complete(self) -> bool:
        """Every watched run has reached its last step (and at least one is watched)."""
        return bool(self.runs) and all(
            w.refused or w.last_step >= w.steps for w in self.runs.values()
        )

    def summary(self) -> list[str]:
        lines = [f"watched {len(self.runs)} run(s) in {self.logdir} over {self.polls} poll(s)"]
        for w in self.runs.values():
            t_hat = w.last_step / w.steps if w.last_step >= 0 else 0.0
            gate = w.gate.status if w.gate else "none yet"
            state = "refused" if w.refused else (w.verdict.status if w.verdict else "waiting")
            worst = (
                f", max |r| {w.gate.max_abs_residual:.4f} at t_hat {w.gate.at_t_hat:.3f}"
                if w.gate and w.gate.max_abs_residual is not None
                else ""
            )
            lines.append(
                f"  {w.name}: t_hat {t_hat:.3f}, monitor {state}, gate {gate}{worst}"
                + (f" -> {self.out / 'gates' / (_safe(w.name) + '.json')}" if w.gate else "")
            )
        return lines


def watch(watcher: Watcher, interval: float, until_complete: bool = False, once: bool = False):
    """Poll until Ctrl-C/SIGTERM (or every run is complete / one poll); print the summary.

    The first signal lets the poll under way finish (its gate files stay whole), a second one
    interrupts it.
    """
    stop: list[int] = []

    def handler(signum, frame):  # noqa: ARG001
        stop.append(signum)
        if len(stop) > 1:
            raise KeyboardInterrupt

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop:
            watcher.poll()
            sys.stdout.flush()
            if once or (until_complete and watcher.complete()):
                break
            deadline = time.monotonic() + interval
            while not stop and time.monotonic() < deadline:
                time.sleep(min(0.1, interval))
    except KeyboardInterrupt:
        pass
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if stop:
        watcher.echo(f"stopped ({signal.Signals(stop[0]).name})")
    for line in watcher.summary():
        watcher.echo(line)
    sys.stdout.flush()
    return 0


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "watch",
        help="run the online collapse monitor on TensorBoard logs of runs training now",
        description="Poll a TensorBoard log directory (any stack: Megatron-LM, torchtitan, "
        "OLMo-core, this project) and check each run against a reference curve as it trains: "
        "report when a run leaves the reference band (run, t_hat, residual) and keep its gate "
        "JSON up to date. Ctrl-C stops it with a summary (exit status 0).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="per run in --out: monitor/<run>.jsonl (the monitor's checks), gates/<run>.json "
        "(the gate verdict so far).\nA run's total steps come from --runs (steps column) or "
        "--steps; runs without them are skipped with a message.",
    )
    parser.add_argument(
        "logdir", metavar="LOGDIR", help="TensorBoard log directory, or a folder of W&B runs"
    )
    parser.add_argument(
        "--reference",
        required=True,
        metavar="DIR/reference.csv",
        help="reference.csv (from collapse analyze or the workflow) or its directory",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument(
        "--runs", metavar="TABLE", help="per-run table (CSV/Parquet/YAML) with run, steps"
    )
    parser.add_argument(
        "--steps", type=V.positive_int, help="total steps of every run not in --runs"
    )
    parser.add_argument("--loss-tag", metavar="TAG", help="the loss's tag (default: known tags)")
    parser.add_argument(
        "--threshold", type=V.positive, help="fixed threshold on |r| (default: calibrated)"
    )
    parser.add_argument(
        "--interval", type=V.positive, default=10.0, help="seconds between polls (default 10)"
    )
    parser.add_argument(
        "--until-complete",
        action="store_true",
        help="stop once every watched run reached its last step",
    )
    parser.add_argument("--once", action="store_true", help="poll once, then stop")
    parser.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    from collapse.curves import read_table

    table = None
    if args.runs:
        table = V.check_runs_table(read_table(args.runs), args.runs)
    watcher = Watcher(
        args.logdir,
        args.reference,
        args.out,
        runs_table=table,
        steps=args.steps,
        loss_tag=args.loss_tag,
        threshold=args.threshold,
        echo=lambda line: print(line, flush=True),
    )
    return watch(watcher, args.interval, args.until_complete, args.once)
