"""Live tracking of a run: TensorBoard event files (on by default) and an offline W&B run
(``logging.wandb``), written as it trains (rank 0 only).

    results/<family>/tensorboard/<run>/      one folder per run (collapse.layout)
    tensorboard --logdir results/<family>/tensorboard
    results/<family>/wandb/wandb/offline-run-*   wandb sync them to upload

Every run of a family logs under the same tags, so each chart holds every size of the family:

    train/loss, train/lr, train/grad_norm, train/tokens_per_s, train/t_hat   every step
    valid/loss                                                               at evaluations
    monitor/ell, monitor/residual, monitor/threshold, monitor/alarm          at the monitor's checks
    monitor/message (text)                                                   at an alarm
    spec (text), and the run's hparams                                       once

The x axis is the optimizer step; ``train/t_hat`` maps it to the normalized time. ``monitor/ell``
is the normalized loss where the check found its largest residual (``ell_ref + residual``).
Against t_hat, for the sizes of a family on one chart (the run's ``t_hat`` folder, whose step is
``T_HAT_STEPS * t_hat``):

    by_t_hat/loss                                                            every step
    by_t_hat/ell                                                             at the monitor's checks

A resumed run appends to the same folder: the writer is opened with ``purge_step`` set to the
first step it trains, so TensorBoard drops what an earlier job logged past the checkpoint.
Events are flushed every step, so a job killed without warning loses none of its logged steps.

Like collapse.callbacks, this module never imports ``collapse.train``.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import TYPE_CHECKING

from collapse.callbacks import EXIT_BAD_INPUT, Callback, TrainingError, rank
from collapse.layout import FamilyLayout

if TYPE_CHECKING:
    from collapse.monitor import MonitorVerdict, OnlineMonitor
    from collapse.train import Loop


def tensorboard_dir(spec):
    """Where a run's event files go: beside its family's runs (collapse.layout)."""
    return FamilyLayout.of_run(spec.run_dir, spec.run).tensorboard(spec.run)


def _hparams(spec) -> dict:
    """The spec's scalars that tell the runs of a family apart, for TensorBoard's HPARAMS tab."""
    return {
        "size": spec.size,
        "params": spec.params,
        "tokens": spec.optim.tokens,
        "steps": spec.optim.steps,
        "batch_seqs": spec.optim.batch_seqs,
        "lr_hidden": spec.mup.lr_hidden,
        "weight_decay": spec.optim.weight_decay,
        "seed": spec.optim.seed,
        "d_model": spec.model.d_model,
        "n_layers": spec.model.n_layers,
    }


class Tracker(Callback):
    """Scalars of every step, and the collapse monitor's checks, into a tracking backend; a
    subclass says how to open it and write scalars and text (rank 0 only).

    ``monitor``: rank 0's OnlineMonitor when the spec enables it; its checks reach the tracker
    as they are made, after the step's scalars (trackers come before CollapseMonitor in the
    list, so the step an alarm stops the run at is logged too)."""

    def __init__(self, monitor: OnlineMonitor | None = None):
        self.monitor = monitor
        self.opened = False
        self.step = 0

    # the backend
    def open(self, loop: Loop) -> None:
        raise NotImplementedError

    def scalars(self, values: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def text(self, tag: str, text: str, step: int) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    # the hooks
    def on_train_start(self, loop: Loop) -> None:
        if rank() != 0:
            return
        self.open(loop)
        self.opened, self.step = True, loop.first_step
        if self.monitor is not None:
            self.monitor.listeners.append(self.log_verdict)

    def on_step_end(self, loop: Loop) -> None:
        if not self.opened:
            return
        row, step = loop.state.curve[-1], loop.step
        self.step = step
        values = {
            f"train/{k}": row[k] for k in ("loss", "lr", "grad_norm", "tokens_per_s", "t_hat")
        }
        if loop.state.valid and loop.state.valid[-1]["step"] == step:
            values["valid/loss"] = loop.state.valid[-1]["valid_loss"]
        self.scalars(values, step)
        self.flush()

    def log_verdict(self, verdict: MonitorVerdict) -> None:
        """A check of the collapse monitor (waiting checks log the threshold alone)."""
        if not self.opened:
            return
        step = verdict.step or self.step
        values = {"monitor/threshold": verdict.threshold, "monitor/alarm": float(verdict.alarm)}
        if verdict.residual is not None:
            values["monitor/residual"] = verdict.residual
            values["monitor/ell"] = self.ell(verdict)
        self.scalars(values, step)
        if verdict.alarm:
            self.text("monitor/message", verdict.message, step)
        self.flush()

    def ell(self, verdict: MonitorVerdict) -> float:
        """The normalized loss where the check found its residual: ell_ref + r at its t_hat."""
        return verdict.residual + float(self.monitor.reference.at(verdict.t_hat))

    def on_train_end(self, loop: Loop) -> None:
        if self.opened:
            self.close()
            self.opened = False


def _import_error(flag: str, err: ImportError) -> TrainingError:
    return TrainingError(
        f"logging.{flag} is true but it cannot be imported ({err}); install the project's "
        f"dependencies (make setup) or set training.{flag}: false in the family config",
        EXIT_BAD_INPUT,
    )


class TensorBoard(Tracker):
    """Event files under results/<family>/tensorboard/<run>; a resumed run purges past its
    checkpoint. A second folder, <run>/t_hat, holds the loss and ell against t_hat (its step is
    ``T_HAT_STEPS * t_hat``), so that the sizes of a family line up on one chart."""

    writer = by_t_hat = None

    def open(self, loop: Loop) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams
        except ImportError as err:
            raise _import_error("tensorboard", err) from err
        spec = loop.spec
        folder = tensorboard_dir(spec)
        folder.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(folder), purge_step=loop.first_step)
        self.first_t_hat = loop.first_step / loop.total
        self.by_t_hat = SummaryWriter(
            str(folder / "t_hat"), purge_step=t_hat_step(self.first_t_hat)
        )
        if loop.first_step == 1:  # once per run: the spec, as text and as hparams
            self.writer.add_text("spec", f"```\n{spec.to_json()}```", 0)
            # into this writer's file (add_hparams would open a second file in the folder,
            # and TensorBoard follows only the newest file of a folder as it grows)
            for summary in hparams(_hparams(spec), {"train/loss": math.nan}):
                self.writer.file_writer.add_summary(summary, 0)

    def on_step_end(self, loop: Loop) -> None:
        if self.opened:
            row = loop.state.curve[-1]
            self.by_t_hat.add_scalar("by_t_hat/loss", row["loss"], t_hat_step(row["t_hat"]))
        super().on_step_end(loop)

    def log_verdict(self, verdict: MonitorVerdict) -> None:
        # a resumed job's first check may look back past its first step: logged before
        if self.opened and verdict.residual is not None and verdict.t_hat >= self.first_t_hat:
            self.by_t_hat.add_scalar("by_t_hat/ell", self.ell(verdict), t_hat_step(verdict.t_hat))
        super().log_verdict(verdict)

    def scalars(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def text(self, tag: str, text: str, step: int) -> None:
        self.writer.add_text(tag, text, step)

    def flush(self) -> None:
        self.writer.flush()
        self.by_t_hat.flush()

    def close(self) -> None:
        self.writer.close()
        self.by_t_hat.close()


T_HAT_STEPS = 10**6  # the step of t_hat on the t_hat axis (a resolution of 1e-6)


def t_hat_step(t_hat: float) -> int:
    return round(T_HAT_STEPS * t_hat)


class WandB(Tracker):
    """A Weights & Biases run, offline (no network while training), under results/<family>/wandb:
    one per training run, grouped by family, its spec as config. A resumed job continues the
    same W&B run (its id is the run's name and trajectory). Upload later with ``wandb sync``."""

    run = None

    def open(self, loop: Loop) -> None:
        try:
            import wandb
        except ImportError as err:
            raise _import_error("wandb", err) from err
        spec = loop.spec
        folder = wandb_dir(spec)
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project="collapse",
            group=spec.family,
            job_type=str(spec.role),
            name=spec.run,
            id=wandb_id(spec),
            resume="allow",
            dir=str(folder),
            mode="offline",
            config=spec.model_dump(mode="json"),
            settings=wandb.Settings(console="off", save_code=False, disable_git=True),
        )
        self.replay(loop)

    def replay(self, loop: Loop) -> None:
        """A resumed job logs again the steps its checkpoint holds. W&B writes from another
        process, so a job killed without warning may leave none of its records on disk; the
        values are the same numbers (training resumes bit for bit), and a reader of the run's
        folders takes the later job's from its first step on."""
        valid = {v["step"]: v["valid_loss"] for v in loop.state.valid}
        for row in loop.state.curve:
            if row["step"] >= loop.first_step:
                break
            values = {
                f"train/{k}": row[k] for k in ("loss", "lr", "grad_norm", "tokens_per_s", "t_hat")
            }
            if row["step"] in valid:
                values["valid/loss"] = valid[row["step"]]
            self.run.log(values, step=row["step"])

    def scalars(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        self.run.log({tag: text}, step=step)

    def close(self) -> None:
        self.run.finish()


def wandb_dir(spec):
    """W&B's ``dir`` of a run (it writes its offline runs under ``wandb/`` there)."""
    return FamilyLayout.of_run(spec.run_dir, spec.run).wandb_dir


def wandb_id(spec) -> str:
    """The W&B run id: the run's name and a hash of its trajectory (collapse.runspec), so that
    a resumed job continues its W&B run and a changed one starts another."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", spec.run)
    return f"{name}-{hashlib.sha256(spec.trajectory_key().encode()).hexdigest()[:8]}"


def tracking_for(spec, monitor: OnlineMonitor | None) -> list[Callback]:
    """The tracking callbacks the spec asks for (its ``logging`` block)."""
    trackers: list[Callback] = []
    if spec.logging.tensorboard:
        trackers.append(TensorBoard(monitor))
    if spec.logging.wandb:
        trackers.append(WandB(monitor))
    return trackers
