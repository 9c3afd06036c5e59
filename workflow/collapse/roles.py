"""What a run is in its family: one of five roles, each owning its name, what it changes of a
plain run, and whether it builds the reference, is monitored or may be a family run's twin.

A ``Role`` is a ``StrEnum``: it is its value in a spec file and in runs.csv, and compares equal
to it (``table.role == Role.FAMILY`` works on a table read back from CSV). Compare with ``==``.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collapse.config import SweepSpec


class Role(StrEnum):
    FAMILY = "family"  # a size x TPP band x seed of the family
    SWEEP = "sweep"  # a variant of a hyperparameter grid at one size
    SWEEP_REFERENCE = "sweep_reference"  # a small full-length run at one tau of a sweep's grid
    FAULT = "fault"  # the fault-detection experiment: an injected fault, or a clean seed
    CONTRAST = "contrast"  # the family again with the smallest size's weight decay (tau drifts)

    # ------------------------------------------------------------------------------ naming
    def run_name(
        self,
        size: str,
        tpp: float,
        seed: int,
        *,
        sweep: SweepSpec | None = None,
        variant: dict[str, float] | None = None,
        fault: str = "",
        tau: float = 0.0,
    ) -> str:
        """The run's name: a sweep's runs are named by their variant (a reference by its realized
        tau), a fault run by its fault, the others by size, band and seed."""
        if self == Role.SWEEP:
            values = "-".join(f"{k}{v:.4g}" for k, v in sorted((variant or {}).items()))
            return f"sweep-{sweep.name}-{size}-{values}-s{sweep.seed}"
        if self == Role.SWEEP_REFERENCE:
            return f"sweepref-{sweep.name}-{size}-tau{tau:.4g}-s{seed}"
        if self == Role.FAULT:
            return f"fault-{fault}-{size}-s{seed}"
        name = f"{size}-tpp{tpp:g}-s{seed}"
        return f"contrast-{name}" if self == Role.CONTRAST else name

    # --------------------------------------------------------------------------- overrides
    def stop_fraction(self, sweep: SweepSpec | None) -> float:
        """Where the run stops, as a fraction of its schedule: a sweep variant at its latest
        prediction point unless the sweep is validated to the end; every other run at 1."""
        if self == Role.SWEEP and not sweep.validate_full:
            return max([sweep.fraction, *sweep.fractions])
        return 1.0

    # ------------------------------------------------------------------------------- flags
    @property
    def builds_reference(self) -> bool:
        """Whether a run of a reference size builds its band's reference curve: the family's
        runs only (a fault or contrast run of that size is measured against it)."""
        return self == Role.FAMILY

    @property
    def monitorable(self) -> bool:
        """Whether the collapse monitor may watch the run (when the family turns it on and the
        run is not a reference): the family's and the fault experiment's runs."""
        return self in (Role.FAMILY, Role.FAULT)

    @property
    def in_sweep(self) -> bool:
        """A sweep's run: a variant or one of its references."""
        return self in (Role.SWEEP, Role.SWEEP_REFERENCE)

    @property
    def may_share(self) -> bool:
        """Whether the run may train exactly like a family run, and is then trained once under
        the family run's name (plan column ``same_as``): a sweep's runs."""
        return self.in_sweep


SWEEP_ROLES = [r for r in Role if r.in_sweep]
