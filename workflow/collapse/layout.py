"""Where every artifact of a family lives, and the columns of the loss-curve contract.

One place for paths, so rules, the training job and the analysis never spell them twice.
Training checkpoints sit outside ``runs/`` on purpose: Snakemake deletes a job's declared
outputs before rerunning it, and a preempted job must resume, not restart.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Per-step loss curve (Parquet), written by training, read by every analysis stage.
CURVE_COLUMNS = (
    "run",  # str
    "step",  # int, 1-based optimizer step
    "tokens",  # int, tokens consumed so far
    "t_hat",  # float, step / total steps of the full-length schedule
    "loss",  # float, mean training loss of the step (nats/token)
    "lr",  # float, hidden-layer LR at the step
    "weight_decay",  # float, hidden-layer lambda as the optimizer applied it (NaN: not logged)
    "grad_norm",  # float
    "tokens_per_s",  # float
    "micro_batch_seqs",  # int
    "data_fraction",  # float, fraction of the training dataset consumed (epochs)
    "restart",  # bool, first step after a resume
)
# Held-out loss, sparse: same file layout, rows only where evaluated.
VALID_COLUMNS = ("run", "step", "tokens", "t_hat", "valid_loss")


@dataclass(frozen=True)
class FamilyLayout:
    root: Path  # results/<family>

    @classmethod
    def of(cls, family: str, results: str | Path = "results") -> FamilyLayout:
        return cls(Path(results) / family)

    # plan
    @property
    def plan_dir(self) -> Path:
        return self.root / "plan"

    def spec(self, run: str) -> Path:
        return self.plan_dir / "runs" / f"{run}.json"

    # data
    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    @property
    def tokenizer(self) -> Path:
        return self.data_dir / "tokenizer.json"

    @property
    def train_prefix(self) -> Path:
        return self.data_dir / "train_text_document"

    @property
    def valid_prefix(self) -> Path:
        return self.data_dir / "valid_text_document"

    # training
    def run_dir(self, run: str) -> Path:
        return self.root / "runs" / run

    def curve(self, run: str) -> Path:
        return self.run_dir(run) / "curve.parquet"

    def valid_curve(self, run: str) -> Path:
        return self.run_dir(run) / "valid.parquet"

    def meta(self, run: str) -> Path:
        return self.run_dir(run) / "meta.json"

    def monitor_reference(self, run: str) -> Path:
        """The reference a monitored run is checked against, copied beside the run before it
        trains (with its reference.json), so that removing or rebuilding the family's reference
        never makes a finished run stale."""
        return self.run_dir(run) / "reference" / "reference.csv"

    def monitor_log(self, run: str) -> Path:
        return self.run_dir(run) / "monitor.jsonl"

    def checkpoints(self, run: str) -> Path:
        return self.root / "checkpoints" / run

    # tracking (not declared outputs: a resumed run appends to its event files)
    @property
    def tensorboard_dir(self) -> Path:
        """``tensorboard --logdir`` of the whole family: one subfolder per run."""
        return self.root / "tensorboard"

    def tensorboard(self, run: str) -> Path:
        return self.tensorboard_dir / run

    @property
    def wandb_dir(self) -> Path:
        """W&B's offline runs of the family (``wandb sync`` uploads them)."""
        return self.root / "wandb"

    @classmethod
    def of_run(cls, run_dir: str | Path, run: str) -> FamilyLayout:
        """The layout that a run's ``run_dir`` (results/<family>/runs/<run>) belongs to."""
        return cls(Path(run_dir).parents[len(Path(run).parts)])

    # analysis
    @property
    def reference_dir(self) -> Path:
        return self.root / "reference"

    def gate(self, run: str) -> Path:
        return self.root / "gates" / f"{run}.json"

    @property
    def contrast_dir(self) -> Path:
        """The contrast's analysis (reference/, collapse/, gates/ as the family's); its runs
        train under runs/ like every other run."""
        return self.root / "contrast"

    @property
    def faults_dir(self) -> Path:
        return self.root / "faults"

    @property
    def report_dir(self) -> Path:
        return self.root / "report"
