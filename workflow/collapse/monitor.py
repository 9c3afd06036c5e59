"""Online collapse monitor: the gate, applied while a run trains (docs/method.md §4).

The training loop calls ``observe`` every step (cheap: appends to lists) and ``check`` every
``spec.monitor.every_steps``. Before the end of the align window the monitor only records.
After it, the run is early-aligned once (L(T) chosen to match the reference over the window;
the window's data never changes afterwards) and every check computes the residual
r = (L_smooth - L0)/(L(T) - L0) - ell_ref at the steps since the previous check, appends a JSON
line to ``monitor.jsonl`` and warns through ``logging`` when |r| crosses the threshold:
``spec.monitor.threshold`` when set (> 0), else the gate policy calibrated from the reference's
seed noise (collapse.gates). Stopping is the training loop's decision
(``MonitorVerdict.stop`` = alarm and ``spec.monitor.stop_on_alarm``).

``audit_controls`` checks every step, from the first, that the run's optimizer applies the AdamW
rate eta_t * lambda the reference runs' tau implies (collapse.controls): a run with another tau is
not comparable with the reference, and at small scale its curve does not show it. It warns once,
with a ``"status": "controls"`` line in the log; it never stops a run.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from collapse.controls import CONTROLS_TOLERANCE, expected_rate
from collapse.curves import default_window_steps, trailing_mean
from collapse.gates import GatePolicy, calibrate_threshold
from collapse.reference import ReferenceCurve, early_align
from collapse.runspec import RunSpec

log = logging.getLogger("collapse.monitor")


@dataclass(frozen=True)
class MonitorVerdict:
    alarm: bool
    message: str
    t_hat: float
    residual: float | None  # the largest |r| since the previous check, signed; None: waiting
    threshold: float
    step: int = 0
    status: str = "waiting"  # "waiting" (before the align window end), "ok", "alarm",
    # or "unaligned" (resumed without the steps of the align window: see replay)
    aligned_final_loss: float | None = None  # L(T) from early-align (nats/token)
    stop: bool = False  # alarm and spec.monitor.stop_on_alarm


def _finite(x: float | None) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


class OnlineMonitor:
    """Residual of a training run against its family's reference, checked as it trains."""

    def __init__(
        self,
        spec: RunSpec,
        log_path: Path,
        policy: GatePolicy | None = None,
        window_steps: int | None = None,
    ) -> None:
        path = Path(spec.monitor.reference_csv)
        if not path.is_file():
            raise FileNotFoundError(
                f"monitor.reference_csv {path} does not exist; the reference of this run's "
                "band must be built before monitored runs start (or set monitor.enabled=false)"
            )
        self.spec = spec
        self.log_path = Path(log_path)
        self.policy = policy or GatePolicy()
        self.reference = ReferenceCurve.read_csv(path)
        summary_path = path.parent / "reference.json"
        summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
        self.offset = float(summary.get("offset", 0.0) or 0.0)
        self.reference_tau = (summary.get("controls") or {}).get("tau")
        self.controls_warned = False
        self.reference = ReferenceCurve(
            **{**self.reference.__dict__, "sizes": summary.get("reference_sizes", [])}
        )
        if spec.monitor.threshold > 0:
            self.threshold = float(spec.monitor.threshold)
            self.threshold_basis = f"monitor.threshold {spec.monitor.threshold:g} of the run spec"
        else:
            self.threshold, self.threshold_basis = calibrate_threshold(self.reference, self.policy)
        smoothing = (summary.get("smoothing") or {}).get("window_steps")
        self.window_steps = int(window_steps or smoothing or default_window_steps(spec.optim.steps))
        self._steps: list[int] = []
        self._t_hat: list[float] = []
        self._loss: list[float] = []
        self._checked = 0  # history index from which the next check looks
        self._aligned: float | None = None
        self.first_crossing_t_hat: float | None = None
        # called with each verdict once it is logged (live tracking: collapse.tracking)
        self.listeners: list[Callable[[MonitorVerdict], None]] = []

    # called every training step: keep it cheap
    def observe(self, step: int, t_hat: float, loss: float) -> None:
        if self._steps and step <= self._steps[-1]:  # resumed from an earlier checkpoint
            keep = int(np.searchsorted(self._steps, step))
            del self._steps[keep:], self._t_hat[keep:], self._loss[keep:]
            self._checked = min(self._checked, keep)
        self._steps.append(int(step))
        self._t_hat.append(float(t_hat))
        self._loss.append(float(loss))

    def replay(self, rows: Iterable[Mapping[str, float]]) -> None:
        """Observe logged steps again (dicts with step, t_hat, loss), e.g. after a resume.

        A resumed job builds a fresh monitor; without the steps before the resume it cannot
        early-align. Pass the restored curve rows (RunState.curve) before training goes on.
        """
        for row in rows:
            self.observe(int(row["step"]), float(row["t_hat"]), float(row["loss"]))

    def _smoothed(self, start: int) -> np.ndarray:
        """Trailing-mean loss for history indices start.. (the same smoothing as the analysis)."""
        lo = max(0, start - self.window_steps)
        steps = np.asarray(self._steps[lo:], dtype=np.int64)
        loss = np.asarray(self._loss[lo:], dtype=float)
        window = np.full(len(steps), self.window_steps, dtype=np.int64)
        return trailing_mean(loss, steps, np.zeros(len(steps)), window)[start - lo :]

    def check(self) -> MonitorVerdict:
        """Residual since the last check; appends one JSON line to the log and warns on alarm."""
        n = len(self._steps)
        t_now = self._t_hat[-1] if n else 0.0
        step_now = self._steps[-1] if n else 0
        align_end = self.policy.align_window[1]
        if t_now < align_end:
            verdict = MonitorVerdict(
                alarm=False,
                message=f"recording: t_hat {t_now:.3f} is before the end of the align window "
                f"{align_end:g}",
                t_hat=t_now,
                residual=None,
                threshold=self.threshold,
                step=step_now,
            )
            self._write(verdict)
            return verdict
        if self._aligned is None:
            t_all = np.asarray(self._t_hat)
            lo = self.policy.align_window[0]
            if t_all[0] > lo + 1e-9:  # resumed without replaying the steps before the resume
                verdict = MonitorVerdict(
                    alarm=False,
                    message=f"cannot align: the monitor has seen t_hat {t_all[0]:.3f}.. only, "
                    f"not the align window from {lo:g}; replay() the curve before a resume",
                    t_hat=t_now,
                    residual=None,
                    threshold=self.threshold,
                    step=step_now,
                    status="unaligned",
                )
                self._write(verdict)
                return verdict
            smooth_all = self._smoothed(0)
            in_window = (t_all >= lo) & (t_all <= align_end) & np.isfinite(smooth_all)
            self._aligned = (
                early_align(
                    t_all,
                    smooth_all,
                    self.reference.t_hat,
                    self.reference.ell,
                    self.policy.align_window,
                    self.offset,
                ).final_loss
                if in_window.any()
                else math.nan  # a loss that went non-finite inside the window: alarm below
            )
        start = self._checked
        self._checked = n
        t = np.asarray(self._t_hat[start:])
        smooth = self._smoothed(start)
        in_window = (t >= self.policy.window[0]) & (t <= self.policy.window[1])
        t, smooth = t[in_window], smooth[in_window]
        with np.errstate(invalid="ignore", divide="ignore"):
            r = (smooth - self.offset) / (self._aligned - self.offset) - self.reference.at(t)
        if len(r) == 0:
            residual, at = None, t_now
            alarm = False
        elif not np.isfinite(r).all():
            at = float(t[np.flatnonzero(~np.isfinite(r))[0]])
            residual, alarm = math.nan, True
        else:
            i = int(np.argmax(np.abs(r)))
            residual, at = float(r[i]), float(t[i])
            alarm = abs(residual) > self.threshold
        if alarm and self.first_crossing_t_hat is None:
            self.first_crossing_t_hat = at
        sizes = ", ".join(self.reference.sizes) or "the reference sizes"
        if alarm and residual is not None and math.isnan(residual):
            message = f"{self.spec.run}: the loss is not finite at t_hat {at:.3f} (step {step_now})"
        elif alarm:
            side = "above" if residual > 0 else "below"
            message = (
                f"{self.spec.run}: normalized loss {side} the reference ({sizes}) at t_hat "
                f"{at:.3f}: residual {residual:+.4f} crosses the threshold {self.threshold:.4f} "
                f"({self.threshold_basis}); first crossing at t_hat "
                f"{self.first_crossing_t_hat:.3f}; log: {self.log_path}"
            )
        else:
            message = (
                f"{self.spec.run}: ok at t_hat {t_now:.3f}: residual "
                f"{'n/a' if residual is None else f'{residual:+.4f}'} within "
                f"{self.threshold:.4f}"
            )
        verdict = MonitorVerdict(
            alarm=alarm,
            message=message,
            t_hat=at,
            residual=residual,
            threshold=self.threshold,
            step=step_now,
            status="alarm" if alarm else "ok",
            aligned_final_loss=_finite(self._aligned),
            stop=alarm and self.spec.monitor.stop_on_alarm,
        )
        if alarm:
            log.warning("collapse monitor alarm: %s", message)
        self._write(verdict)
        return verdict

    def audit_controls(
        self, step: int, lr: float, weight_decay: float, tolerance: float = CONTROLS_TOLERANCE
    ) -> str | None:
        """The warning, once per run, when this step's applied eta * lambda is off the rate the
        reference runs' tau implies by more than ``tolerance``; None otherwise (or no tau)."""
        if self.controls_warned or self.reference_tau is None:
            return None
        optim = self.spec.optim
        expected = float(
            expected_rate(np.array([step]), optim.warmup_steps, optim.steps, self.reference_tau)[0]
        )
        applied = lr * weight_decay
        if not (expected > 0 and math.isfinite(applied)):
            return None
        ratio = applied / expected
        if abs(ratio - 1.0) <= tolerance:
            return None
        self.controls_warned = True
        message = (
            f"{self.spec.run}: at step {step} the optimizer applies eta*lambda {applied:.4g}, "
            f"{ratio:.3g}x the {expected:.4g} that the reference runs' tau "
            f"{self.reference_tau:.4g} implies (tolerance {tolerance:g}): this run's timescale "
            "is not the reference's, so its gate compares unlike runs; check its weight decay "
            "(lambda = B / (eta * tau * D)) and LR schedule"
        )
        log.warning("controls audit: %s", message)
        record = {"status": "controls", "step": int(step), "t_hat": step / optim.steps}
        record |= {"ratio": ratio, "reference_tau": self.reference_tau, "message": message}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        return message

    def residuals(self) -> tuple[np.ndarray, np.ndarray]:
        """r(t_hat) at every step seen so far (NaN before the run is aligned), for figures."""
        t = np.asarray(self._t_hat, dtype=float)
        if not len(t):
            return t, t.copy()
        aligned = self._aligned if self._aligned is not None else math.nan
        with np.errstate(invalid="ignore", divide="ignore"):
            r = (self._smoothed(0) - self.offset) / (aligned - self.offset)
        return t, r - self.reference.at(t)

    def _write(self, verdict: MonitorVerdict) -> None:
        record = {
            k: (_finite(v) if isinstance(v, float) else v) for k, v in asdict(verdict).items()
        }
        record["first_crossing_t_hat"] = self.first_crossing_t_hat
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
        for listener in self.listeners:
            listener(verdict)
