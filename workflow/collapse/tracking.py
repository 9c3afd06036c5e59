"""Live tracking of a run: TensorBoard event files, written as it trains (rank 0 only).

    results/<family>/tensorboard/<run>/      one folder per run (collapse.layout)
    tensorboard --logdir results/<family>/tensorboard

Every run of a family logs under the same tags, so TensorBoard draws every size on one chart:

    train/loss, train/lr, train/grad_norm, train/tokens_per_s, train/t_hat   every step
    valid/loss                                                               at evaluations
    monitor/ell, monitor/residual, monitor/threshold, monitor/alarm          at the monitor's checks
    monitor/message (text)                                                   at an alarm
    spec (text), and the run's hparams                                       once

The x axis is the optimizer step; ``train/t_hat`` maps it to the normalized time. ``monitor/ell``
is the normalized loss where the check found its largest residual (``ell_ref + residual``).
A resumed run appends to the same folder: the writer is opened with ``purge_step`` set to the
first step it trains, so TensorBoard drops what an earlier job logged past the checkpoint.
Events are flushed every step, so a job killed without warning loses none of its logged steps.

Like collapse.callbacks, this module never imports ``collapse.train``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from collapse.callbacks import EXIT_BAD_INPUT, Callback, TrainingError, rank
from collapse.layout import FamilyLayout

if TYPE_CHECKING:
    from collapse.monitor import MonitorVerdict, OnlineMonitor
    from collapse.train import Loop


def tensorboard_dir(spec):
    """Where a run's event files go: beside its family's runs (collapse.layout)."""
    return FamilyLayout.of_run_dir(spec.run_dir).tensorboard(spec.run)


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


class TensorBoard(Callback):
    """Scalars of every step, and the collapse monitor's checks, into TensorBoard event files.

    ``monitor``: rank 0's OnlineMonitor when the spec enables it; its checks reach this callback
    as they are made, after the step's scalars (it comes before CollapseMonitor in the list, so
    the step an alarm stops the run at is logged too)."""

    def __init__(self, monitor: OnlineMonitor | None = None):
        self.monitor = monitor
        self.writer = None
        self.step = 0

    def on_train_start(self, loop: Loop) -> None:
        if rank() != 0:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise TrainingError(
                f"logging.tensorboard is true but TensorBoard cannot be imported ({err}); "
                "install the project's dependencies (make setup) or set "
                "training.tensorboard: false in the family config",
                EXIT_BAD_INPUT,
            ) from err
        spec = loop.spec
        folder = tensorboard_dir(spec)
        folder.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(folder), purge_step=loop.first_step)
        self.step = loop.first_step
        if loop.first_step == 1:  # once per run: the spec, as text and as hparams
            self.writer.add_text("spec", f"```\n{spec.to_json()}```", 0)
            # into this writer's file (add_hparams would open a second file in the folder,
            # and TensorBoard follows only the newest file of a folder as it grows)
            from torch.utils.tensorboard.summary import hparams

            for summary in hparams(_hparams(spec), {"train/loss": math.nan}):
                self.writer.file_writer.add_summary(summary, 0)
        if self.monitor is not None:
            self.monitor.listeners.append(self.log_verdict)

    def on_step_end(self, loop: Loop) -> None:
        if self.writer is None:
            return
        row, step = loop.state.curve[-1], loop.step
        self.step = step
        for name in ("loss", "lr", "grad_norm", "tokens_per_s", "t_hat"):
            self.writer.add_scalar(f"train/{name}", row[name], step)
        if loop.state.valid and loop.state.valid[-1]["step"] == step:
            self.writer.add_scalar("valid/loss", loop.state.valid[-1]["valid_loss"], step)
        self.writer.flush()

    def log_verdict(self, verdict: MonitorVerdict) -> None:
        """A check of the collapse monitor (waiting checks log the threshold alone)."""
        if self.writer is None:
            return
        step = verdict.step or self.step
        self.writer.add_scalar("monitor/threshold", verdict.threshold, step)
        self.writer.add_scalar("monitor/alarm", float(verdict.alarm), step)
        if verdict.residual is not None:
            ell = verdict.residual + float(self.monitor.reference.at(verdict.t_hat))
            self.writer.add_scalar("monitor/residual", verdict.residual, step)
            self.writer.add_scalar("monitor/ell", ell, step)
        if verdict.alarm:
            self.writer.add_text("monitor/message", verdict.message, step)
        self.writer.flush()

    def on_train_end(self, loop: Loop) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def tracking_for(spec, monitor: OnlineMonitor | None) -> list[Callback]:
    """The tracking callbacks the spec asks for (its ``logging`` block)."""
    return [TensorBoard(monitor)] if spec.logging.tensorboard else []
