"""Fault injection: what each kind of the spec's ``fault`` does to a run, as training callbacks.

They attach only to a run whose spec asks for a fault (``collapse.train.callbacks_for``): the
fault-detection experiment trains such runs to see when the collapse monitor and the raw-loss
rules notice. A fault starts at step ``round(fault.at_fraction * optim.steps)`` (at least 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from collapse.callbacks import EXIT_OK, Callback, log
from collapse.roles import Role
from collapse.runspec import RunSpec

if TYPE_CHECKING:  # for the annotations only (collapse.callbacks says why)
    from collapse.train import Loop

LR_SPIKE_STEPS_FRACTION = 0.01  # an lr_spike fault lasts 1 % of the schedule
# The kinds a training run injects; wrong_tau is realized by the plan (the weight decay in optim).
TRAINING_FAULTS = ("loss_bias", "loss_kernel", "lr_spike", "data_repeat", "nan_loss")


def injects(spec: RunSpec) -> bool:
    """Whether the run's training injects a fault (InjectFault attaches)."""
    return spec.fault.kind in TRAINING_FAULTS


@dataclass(frozen=True)
class Faults:
    """The spec's FaultInjection, resolved to steps (off unless spec.fault.kind != none)."""

    kind: str
    step: int  # first faulty step (1-based); 0 when off
    magnitude: float
    total_steps: int

    @classmethod
    def of(cls, spec: RunSpec) -> Faults:
        kind = spec.fault.kind
        step = 0 if kind == "none" else max(1, round(spec.fault.at_fraction * spec.optim.steps))
        return cls(kind, step, spec.fault.magnitude, spec.optim.steps)

    def loss_bias(self, step: int) -> float:
        """loss_bias: the reported loss is shifted by magnitude (a faulty loss kernel)."""
        return self.magnitude if self.kind == "loss_bias" and step >= self.step else 0.0

    def lr_factor(self, step: int) -> float:
        """lr_spike: all LRs x magnitude for 1 % of the schedule from the fault step."""
        length = max(1, round(LR_SPIKE_STEPS_FRACTION * self.total_steps))
        active = self.kind == "lr_spike" and self.step <= step < self.step + length
        return self.magnitude if active else 1.0

    def data_step(self, step: int) -> int:
        """data_repeat: from the fault step the loader replays the last magnitude x T steps'
        batches over and over (a loader stuck on a window of its shard), so the model memorizes
        them; magnitude 0 rewinds once to the start of training and goes on from there."""
        if self.kind != "data_repeat" or step < self.step:
            return step
        if self.magnitude <= 0:
            return step - self.step + 1
        window = min(self.step - 1, max(1, round(self.magnitude * self.total_steps)))
        return max(1, self.step - window + (step - self.step) % max(1, window))

    def poisons_loss(self, step: int) -> bool:
        """nan_loss: the training loss of the fault step is NaN (gradients too)."""
        return self.kind == "nan_loss" and step == self.step

    def kept_every(self, step: int) -> int:
        """loss_kernel (the paper's failure: a loss kernel that goes wrong at the micro-batch
        size of a restart): from the fault step the loss is reduced over every k-th token only,
        k = 1/(1 - magnitude). The reported loss stays unbiased; the gradients are noisier, so
        the run falls behind slowly instead of spiking. 1: every token counts."""
        if self.kind != "loss_kernel" or step < self.step or self.magnitude <= 0:
            return 1
        return max(1, round(1.0 / max(1e-6, 1.0 - self.magnitude)))

    def reduction(self, step: int, base):
        """The loss reduction of ``step``: ``base`` (per-token loss, loss mask -> loss), or
        ``base`` over a strided subset of the tokens (loss_kernel), or NaN (nan_loss)."""
        kept, poison = self.kept_every(step), self.poisons_loss(step)
        if kept == 1 and not poison:
            return base

        def reduce(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
            mask = loss_mask.float().reshape(-1)
            if kept > 1:
                mask = mask * (torch.arange(mask.numel()) % kept == 0).to(mask)
            loss = base(per_token_loss, mask)
            return loss * float("nan") if poison else loss

        return reduce


class InjectFault(Callback):
    """Applies the spec's fault to each step: its LRs, the batch it reads, its loss reduction,
    and the loss and LR it reports."""

    def __init__(self, faults: Faults):
        self.faults = faults
        self.factor = 1.0

    def on_train_start(self, loop: Loop) -> None:
        self.base = loop.reduce_loss

    def on_step_start(self, loop: Loop) -> None:
        step = loop.step
        self.factor = self.faults.lr_factor(step)
        if self.factor != 1.0:  # the scheduler sets every group's LR again after the step
            for group in loop.stack.optimizer.param_groups:
                group["lr"] *= self.factor
        loop.data_step = self.faults.data_step(step)
        loop.reduce_loss = self.faults.reduction(step, self.base)

    def on_loss(self, loop: Loop) -> None:
        loop.lr *= self.factor
        loop.loss += self.faults.loss_bias(loop.step)


def nonfinite_is_outcome(spec: RunSpec) -> bool:
    """A run of the fault experiment measures where its loss breaks: a NaN ends it, not fails it."""
    return spec.role == Role.FAULT


class NonFiniteOutcome(Callback):
    """In place of ``NonFiniteLoss`` for a run of the fault experiment: the stop is the measured
    outcome, so the curve up to and including the non-finite step is the run's output (meta.json
    says ``stopped: nonfinite``) and the job exits 0."""

    def on_loss(self, loop: Loop) -> None:
        if math.isfinite(loop.loss):
            return
        loop.update_wall_time()
        loop.state.curve.append(loop.row())
        loop.state.step = loop.step
        loop.write_outputs(stopped="nonfinite")
        log(
            f"fault run stopped: loss {loop.loss} at step {loop.step} "
            f"(t_hat {loop.step / loop.total:.4f})"
        )
        loop.exit_code = EXIT_OK
