"""Everything the training loop does besides a step: callbacks, and how a run ends.

``collapse.train.run`` trains a step, reads its loss and calls the hooks of an ordered list of
callbacks (``collapse.train.callbacks_for`` picks them from the run's spec):

    on_train_start(loop)  once, after the setup (and a resume)
    on_step_start(loop)   before the step: may change ``loop.data_step`` (whose batch it reads),
                          ``loop.reduce_loss`` (how the per-token losses become the loss) and the
                          optimizer's param groups; sets ``loop.stop_requested``
    on_loss(loop)         after the update: ``loop.loss``, ``lr``, ``grad_norm``, ``weight_decay``
                          are this step's (a hook may change ``loss`` and ``lr``, as reported)
    on_step_end(loop)     after the step is on the curve (``loop.state.step`` is this step)
    on_train_end(loop)    after the last step, before the declared outputs are written

``loop`` is the run in progress (``collapse.train.Loop``): its spec, stack, state, and what a
callback may ask of it (``evaluate``, ``save_checkpoint``, ``write_outputs``). A hook ends the
run by setting ``loop.exit_code`` (the hooks after it are not called, and no further step runs)
or by raising ``TrainingError``. This module never imports ``collapse.train``: the job runs it as
``__main__``, and a second copy of that module would have a second ``TrainingError``.
"""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # for the annotations only: see the end of the docstring
    from collapse.train import Loop

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_MONITOR_ALARM = 3
EXIT_NONFINITE = 4
EXIT_SAVE_FAILED = 5  # a checkpoint could not be written; the previous one is intact
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again", the job resumes from its checkpoint

MONITOR_FILE = "monitor.jsonl"


class TrainingError(RuntimeError):
    """A run that cannot continue; the message says why and what to do."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def log(message: str) -> None:
    if rank() == 0:
        print(message, flush=True)


class Callback:
    """A part of the training loop; each hook does nothing unless a subclass says otherwise."""

    def on_train_start(self, loop: Loop) -> None:
        pass

    def on_step_start(self, loop: Loop) -> None:
        pass

    def on_loss(self, loop: Loop) -> None:
        pass

    def on_step_end(self, loop: Loop) -> None:
        pass

    def on_train_end(self, loop: Loop) -> None:
        pass


def call(callbacks: list[Callback], hook: str, loop: Loop) -> None:
    """Call ``hook`` of each callback in order, until one of them ends the run."""
    for callback in callbacks:
        getattr(callback, hook)(loop)
        if loop.exit_code is not None:
            return


# ------------------------------------------------------------------------------ production
class NonFiniteLoss(Callback):
    """A NaN/inf loss stops the run (exit 4) without saving: the last good checkpoint is kept."""

    def on_loss(self, loop: Loop) -> None:
        if math.isfinite(loop.loss):
            return
        raise TrainingError(
            f"loss is {loop.loss} at step {loop.step} (t_hat {loop.step / loop.total:.4f}, lr "
            f"{loop.lr:.3e}, grad norm {loop.grad_norm:.3e}): stopping without saving. The last "
            f"good checkpoint in {loop.spec.checkpoint_dir} is kept; lower the LR or fix the "
            "data, then rerun to resume from it.",
            EXIT_NONFINITE,
        )


def format_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Progress(Callback):
    """The job log: a line every ``logging.log_every_steps`` (and at this job's first and last
    step) with loss, LR, grad norm, tokens/s of this job and its ETA."""

    def on_train_start(self, loop: Loop) -> None:
        self.started, self.tokens = time.time(), 0
        log(
            f"training steps {loop.first_step}..{loop.target} of {loop.total} "
            f"(data: {loop.dataset_tokens:,} tokens)"
        )

    def on_step_end(self, loop: Loop) -> None:
        self.tokens += loop.batch_tokens
        step = loop.step
        due = step % max(1, loop.spec.logging.log_every_steps) == 0
        if not (due or step in (loop.first_step, loop.target)):
            return
        rate = self.tokens / max(1e-9, time.time() - self.started)
        eta = (loop.target - step) * loop.batch_tokens / rate if rate > 0 else 0.0
        row = loop.state.curve[-1]
        log(
            f"step {step}/{loop.total} tokens {row['tokens']:,} t_hat {row['t_hat']:.4f} "
            f"loss {row['loss']:.4f} lr {row['lr']:.3e} grad_norm {row['grad_norm']:.3f} "
            f"tokens/s {rate:,.0f} data {row['data_fraction']:.3f} ep ETA {format_eta(eta)}"
        )


class Evaluation(Callback):
    """The held-out loss every ``logging.eval_every_steps`` and at this job's last step."""

    def on_step_end(self, loop: Loop) -> None:
        every, step = loop.spec.logging.eval_every_steps, loop.step
        # the run's last step, not a segment's: a run in segments evaluates as one job would
        if not ((every > 0 and step % every == 0) or step == loop.run_target):
            return
        valid_loss = loop.evaluate()
        loop.state.valid.append(
            {
                "run": loop.spec.run,
                "step": step,
                "tokens": step * loop.batch_tokens,
                "t_hat": step / loop.total,
                "valid_loss": valid_loss,
            }
        )
        log(f"step {step} valid_loss {valid_loss:.4f}")


def make_monitor(spec):
    """The online collapse monitor (rank 0 only: it owns monitor.jsonl), or None when off."""
    if not spec.monitor.enabled or rank() != 0:
        return None
    try:
        from collapse.monitor import OnlineMonitor
    except ImportError as err:
        raise TrainingError(
            f"monitor.enabled is true but collapse.monitor cannot be imported ({err}); "
            "install the monitor stage or set monitor.enabled=false in the plan",
            EXIT_BAD_INPUT,
        ) from err
    return OnlineMonitor(spec, Path(spec.run_dir) / MONITOR_FILE)


class ControlsAudit(Callback):
    """Checks the LR and λ each step used against the plan's τ (collapse.controls); warns once,
    through logging, into the job's log. Rank 0, with the monitor."""

    def __init__(self, monitor):
        self.monitor = monitor

    def on_loss(self, loop: Loop) -> None:
        self.monitor.audit_controls(loop.step, loop.lr, loop.weight_decay)


class CollapseMonitor(Callback):
    """The online collapse monitor: fed every step, checked every ``monitor.every_steps``. An
    alarm is logged; with ``monitor.stop_on_alarm`` the run saves a checkpoint and stops (exit 3).
    Every rank attaches it (rank 0's verdict is broadcast); ``monitor`` is None off rank 0."""

    def __init__(self, monitor):
        self.monitor = monitor

    def on_train_start(self, loop: Loop) -> None:
        if self.monitor is not None:  # a resumed run: the monitor sees the whole curve again
            for row in loop.state.curve:
                self.monitor.observe(row["step"], row["t_hat"], row["loss"])

    def on_step_end(self, loop: Loop) -> None:
        alarm = self.verdict(loop.spec, loop.step, loop.loss)
        if alarm is None:
            return
        log(f"collapse monitor alarm at step {loop.step}: {alarm}")
        if loop.spec.monitor.stop_on_alarm:
            loop.save_checkpoint()
            raise TrainingError(
                f"collapse monitor alarm at step {loop.step}: {alarm}", EXIT_MONITOR_ALARM
            )

    def verdict(self, spec, step: int, loss: float) -> str | None:
        """Feed the monitor; every monitor.every_steps its alarm message (all ranks agree)."""
        every = spec.monitor.every_steps
        checked = every > 0 and step % every == 0
        message = None
        if self.monitor is not None:
            self.monitor.observe(step, step / spec.optim.steps, loss)
            if checked:
                verdict = self.monitor.check()
                message = verdict.message if verdict.alarm else None
        if checked:
            box = [message]
            torch.distributed.broadcast_object_list(box, src=0)
            message = box[0]
        return message


class Preemption(Callback):
    """SIGTERM (Slurm preempts the job, or warns of its time limit with --signal=TERM@S) and
    SIGUSR1: the step finishes, a checkpoint is saved and the job exits 75 (rerun to resume).

    The handlers are installed when it is made: make it before the setup, so that a signal
    during the setup stops the run after its first step. Any rank's signal stops every rank:
    the flag travels with the step's loss reduction."""

    def __init__(self):
        self.signal: int | None = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal = signum

    def on_step_start(self, loop: Loop) -> None:
        if self.signal is not None:
            loop.stop_requested = 1.0
            loop.stop_reason = f"signal {signal.Signals(self.signal).name}"

    def on_step_end(self, loop: Loop) -> None:
        if loop.stop_anywhere:
            loop.save_checkpoint()
            why = loop.stop_reason or "another rank asked to stop"
            log(f"stop requested ({why}): saved step {loop.step}; rerun to resume")
            loop.exit_code = EXIT_PREEMPTED


class TimeBudget(Callback):
    """Stop before the job's time runs out, as Megatron-LM's ``--exit-duration-in-mins``: when
    the time since the job started, plus the coming step, plus a checkpoint save would pass
    ``exit_duration_s``, the coming step is the last; ``Preemption`` (after it in the list)
    saves and exits 75, and the job's retry resumes. A save is estimated by the plan
    (``resources.checkpoint_save_min``) until this job has timed one of its own; a step by
    the slowest this job trained. Every rank decides alike: the request travels with the loss."""

    def __init__(self, exit_duration_s: float, save_estimate_s: float):
        self.exit_duration_s = exit_duration_s
        self.save_estimate_s = save_estimate_s
        self.slowest_step_s = 0.0

    def on_step_start(self, loop: Loop) -> None:
        save_s = max(self.save_estimate_s, loop.slowest_save_s)
        elapsed = time.time() - loop.started
        if elapsed + self.slowest_step_s + save_s > self.exit_duration_s:
            loop.stop_requested = 1.0
            loop.stop_reason = (
                f"time budget: {elapsed:.0f} s elapsed + a step {self.slowest_step_s:.1f} s + a "
                f"save {save_s:.1f} s > exit duration {self.exit_duration_s:.0f} s"
            )

    def on_step_end(self, loop: Loop) -> None:
        self.slowest_step_s = max(self.slowest_step_s, loop.seconds)


class Checkpointing(Callback):
    """A checkpoint every ``logging.checkpoint_every_steps`` and one of the last step."""

    def on_step_end(self, loop: Loop) -> None:
        every = loop.spec.logging.checkpoint_every_steps
        if every > 0 and loop.step % every == 0 and loop.step != loop.target:
            loop.save_checkpoint()

    def on_train_end(self, loop: Loop) -> None:
        if not loop.checkpoint_exists():
            loop.save_checkpoint()
