"""The compute plan: every run of a family with all its hyperparameters, resolved once.

``plan_family`` is pure: from a validated ``Config`` it derives one ``RunSpec`` per run (size x
TPP band x seed, each sweep variant, the fault experiment and the contrast) from three parts, each
one decision per method:

- ``ModelPlan``: size -> architecture, parameter counts, µP/CompleteP (``collapse.scaling``);
- ``RunPlan``: tokens, batch, steps, LR, lambda from tau, schedule, FLOPs (``collapse.flops``);
- ``ResourcePlan``: cluster -> layout and memory (``collapse.parallel``), time, Slurm request.

``Planner`` composes them for each run of a ``Role`` (``collapse.roles``), which names the run and
says whether it is a reference, monitored or stopped early. ``write_plan`` writes the spec files
(only those whose content changed; the workflow writes each in a job of its own instead),
``runs.csv`` and a report.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import sys
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

import pandas as pd

from collapse import flops as flops_rules
from collapse import parallel, scaling
from collapse import segments as time_limits
from collapse.config import (
    ClusterSpec,
    Config,
    ConfigError,
    FamilySpec,
    HeldDecay,
    SizeSpec,
    SweepSpec,
    TauPowerLaw,
    TrainingSpec,
    load_config,
)
from collapse.data import DataConfig
from collapse.layout import FamilyLayout
from collapse.roles import SWEEP_ROLES, Role
from collapse.runspec import (
    FaultInjection,
    Logging,
    ModelArch,
    Monitor,
    Optimization,
    Parallelism,
    Parameterization,
    Resources,
    RunSpec,
    write_if_changed,
)

# The columns of runs.csv, in order (the plan report's, plus what the analysis stages read).
RUNS_COLUMNS = [
    "run", "role", "sweep", "size", "tpp_band", "tpp", "seed", "d_model", "n_layers", "n_heads",
    "params", "params_non_embedding", "tokens", "seq_len", "batch_seqs", "steps", "lr_peak",
    "weight_decay", "tau", "warmup_steps", "stop_fraction", "flops_6nd", "flops", "tp", "pp", "dp",
    "micro_batch_seqs", "grad_accum", "gpus", "nodes", "wall_hours", "gpu_hours", "epochs",
    "memory_gb_per_gpu", "is_reference", "monitored", "fault", "same_as",
    "segments",
]  # fmt: skip


@dataclass(frozen=True)
class Plan:
    config: Config
    runs: tuple[RunSpec, ...]
    table: pd.DataFrame  # one row per run, RUNS_COLUMNS
    corpus_unknown: str = ""  # why the corpus could not be counted (epochs are then NaN)

    @property
    def layout(self) -> FamilyLayout:
        return FamilyLayout.of(self.config.family.name, self.config.results)

    def run_names(self, role: Role | None = None) -> list[str]:
        return [r.run for r in self.runs if role is None or r.role == role]

    def shared_runs(self) -> dict[str, str]:
        """Sweep members that train exactly like a family run, mapped to that run: they are
        trained once, under the family's name (plan column ``same_as``)."""
        shared = self.table[self.table.same_as != ""]
        return dict(zip(shared.run, shared.same_as, strict=True))

    def spec(self, run: str) -> RunSpec:
        return next(r for r in self.runs if r.run == run)

    def warnings(self) -> list[str]:
        """What the plan allows but a user should know before spending the compute."""
        corpus = (
            [
                "the corpus could not be counted, so the plan cannot tell whether a size sees it "
                f"more than once (epochs are empty in runs.csv): {self.corpus_unknown}"
            ]
            if self.corpus_unknown
            else repeated_data_warnings(self.table, self.config.family.data)
        )
        return (
            corpus
            + resource_warnings(self.table, self.config.cluster)
            + evaluation_warnings(self.config.family)
        )

    def report_layouts(self) -> str:
        """Markdown: each size's layout and its runners-up, with step time, wall time and
        memory (GPU clusters; empty on the CPU)."""
        return layouts_markdown(self)


def evaluation_warnings(family) -> list[str]:
    """A blend of the user's datasets without its tokenizer: evaluation cannot score tasks."""
    data = family.data
    if data.kind != "megatron" or data.tokenizer or not family.evaluation.tasks:
        return []
    return [
        "data.tokenizer is not set, so evaluation scores the held-out loss only (the downstream "
        "tasks need the tokenizer your datasets were made with). Fix: set data.tokenizer to its "
        "tokenizer.json, and data.eod_token to its end-of-document token"
    ]


# A run the local cluster would train for longer than this is worth a word before it starts.
CPU_WALL_HOURS_WARN = 24.0


def resource_warnings(table: pd.DataFrame, cluster: ClusterSpec) -> list[str]:
    """Sizes a CPU cluster cannot hold in memory, or would train for days, with the numbers.

    On a GPU cluster the layout search already refuses what does not fit a GPU."""
    if cluster.accelerator != "cpu":
        return []
    by_size = table.groupby("size", sort=False).agg(
        memory_gb=("memory_gb_per_gpu", "max"), wall_hours=("wall_hours", "max")
    )
    need = by_size.memory_gb * (cluster.procs_per_run // cluster.nodes_per_run)  # per node
    out = []
    over = need[need > cluster.mem_gb]
    if not over.empty:
        sizes = ", ".join(f"{size} ({gb:.3g} GB)" for size, gb in over.items())
        out.append(
            f"cluster {cluster.name!r} has mem_gb {cluster.mem_gb:g} per run, less than the "
            f"estimated weights, gradients, Adam state and activations of {sizes}. Fix: raise "
            "cluster.mem_gb, lower family.training.max_micro_batch_seqs, or plan those sizes "
            "on a GPU cluster (cluster=slurm_h100)"
        )
    long = by_size.wall_hours[by_size.wall_hours > CPU_WALL_HOURS_WARN]
    if not long.empty:
        sizes = ", ".join(f"{size} ({_hours(h)})" for size, h in long.items())
        out.append(
            f"on cluster {cluster.name!r} (peak {cluster.peak_flops:.3g} FLOP/s at MFU "
            f"{cluster.mfu:g}) one run trains for more than {CPU_WALL_HOURS_WARN:g} h: {sizes}. "
            "Fix: plan those sizes on a GPU cluster, or drop them"
        )
    return out


def _hours(h: float) -> str:
    return f"{h:,.0f} h" if h < 24 * 365 else f"{h / (24 * 365):,.3g} years"


def repeated_data_warnings(table: pd.DataFrame, data: DataConfig) -> list[str]:
    """A line naming the sizes whose runs see the corpus more than once, and the fixes.

    Repeated tokens lower a run's training loss by memorization in its last part, which bends its
    normalized curve away from the family's (a confound for collapse and for the fault monitor).
    """
    over = (
        table[table["epochs"] > 1.0]
        .groupby("size", sort=False)
        .agg(epochs=("epochs", "max"), tokens=("tokens", "max"))
    )
    if over.empty:
        return []
    sizes = ", ".join(
        f"{size} ({row.epochs:.2f} epochs of {_si(row.tokens)} tokens)"
        for size, row in over.iterrows()
    )
    fixes = {
        "megatron": "add datasets to family.data.train",
        "shards": "add files to family.data.files",
    }.get(getattr(data, "kind", "corpus"), "add a source to family.data.sources")
    fixes += ", lower family.tpp or drop those sizes"
    if getattr(data, "max_corpus_bytes", None) is not None:
        fixes = f"raise family.data.max_corpus_bytes ({_si(data.max_corpus_bytes)}B now), " + fixes
    return [
        f"the corpus is seen more than once by {sizes}: repeated tokens lower the late training "
        f"loss by memorization and bend the normalized curve. Fix: {fixes}"
    ]


def reference_csv(layout: FamilyLayout, tpp: float) -> Path:
    return layout.reference_dir / f"tpp{tpp:g}" / "reference.csv"


# ------------------------------------------------------------ architecture, parameterization
@dataclass(frozen=True)
class ModelPlan:
    """One size: its architecture, parameter counts and µP/CompleteP parameterization."""

    family: FamilySpec
    size: SizeSpec

    @cached_property
    def arch(self) -> ModelArch:
        """The size's own width, depth and heads; the rest from the family's ``arch`` block."""
        size, a = self.size, self.family.arch
        return ModelArch(
            d_model=size.d_model,
            n_layers=size.n_layers,
            n_heads=size.n_heads,
            head_dim=size.head_dim or size.d_model // size.n_heads,
            ffn_hidden=int(round(a.ffn_mult * size.d_model)),
            activation=a.activation,
            positions=a.positions,
            vocab_size=a.vocab_size,
            seq_len=a.seq_len,
            tied_embeddings=a.tied_embeddings,
            norm_eps=a.norm_eps,
        )

    @cached_property
    def count(self) -> scaling.ParamCount:
        return scaling.param_count(self.arch)

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token, Table 9 accounting (what the layout's step time runs)."""
        return flops_rules.flops_table9(self.arch, self.count.total, 1)

    @property
    def tpp_params(self) -> int:
        """The parameters TPP counts (``family.tpp_counts``): all, or those outside embeddings."""
        return self.count.total if self.family.tpp_counts == "all" else self.count.non_embedding

    def parameterize(self, eta_base: float) -> Parameterization:
        """µP/CompleteP of the size from the family's parameterization block and a base LR."""
        fields = self.family.parameterization.model_dump() | {"eta_base": eta_base}
        return scaling.mup_parameterization(self.arch, **fields)

    def eta_base(self, variant: Mapping[str, float]) -> float:
        """The base LR: the family's or a variant's, or the one that gives a variant's hidden-
        layer LR (``lr_peak``)."""
        eta_base = variant.get("eta_base", self.family.parameterization.eta_base)
        if "lr_peak" in variant:
            eta_base = variant["lr_peak"] * eta_base / self.parameterize(eta_base).lr_hidden
        return eta_base


# ------------------------------------------------------------------------------------ run
@dataclass(frozen=True)
class RunPlan:
    """The training of one size at one TPP band: tokens, batch, steps, LR, lambda from tau,
    schedule. ``variant`` overrides any of batch_seqs, eta_base, lr_peak, weight_decay, tau."""

    family: FamilySpec
    model: ModelPlan
    tpp: float
    variant: Mapping[str, float]

    @property
    def target_tokens(self) -> int:
        return scaling.tokens_for_tpp(self.tpp, self.model.tpp_params)

    @cached_property
    def batch_seqs(self) -> int:
        """A variant's batch, the size's (``batch.rule: table``) or the power law in D."""
        if "batch_seqs" in self.variant:
            return int(self.variant["batch_seqs"])
        if self.family.batch.rule == "table":
            return self.model.size.batch_seqs
        b, seq_len = self.family.batch, self.model.arch.seq_len
        law = scaling.batch_seqs_power_law(
            self.target_tokens, b.coef, b.exponent, seq_len, b.multiple_of
        )
        return max(b.min_seqs, law)

    @cached_property
    def steps(self) -> int:
        return scaling.steps_for(self.target_tokens, self.batch_seqs, self.model.arch.seq_len)

    @property
    def tokens(self) -> int:
        """D realized in whole steps."""
        return scaling.realized_tokens(self.steps, self.batch_seqs, self.model.arch.seq_len)

    @property
    def batch_tokens(self) -> int:
        return self.batch_seqs * self.model.arch.seq_len

    @cached_property
    def mup(self) -> Parameterization:
        return self.model.parameterize(self.model.eta_base(self.variant))

    @property
    def lr_peak(self) -> float:
        """eta: the hidden-layer LR, the one tau is defined with."""
        return self.mup.lr_hidden

    @property
    def target_tau(self) -> float:
        """The family's tau of the band (a fixed value, or its power law in TPP)."""
        rule = self.family.tau_for(self.tpp)
        if isinstance(rule, TauPowerLaw):
            return rule.scale * scaling.tau_power_law(self.tpp, rule.coef, rule.exponent)
        return rule

    @cached_property
    def weight_decay(self) -> float:
        """A variant's lambda, the family's fixed one (the contrast recipe: tau drifts), else
        lambda solved from the variant's or the family's tau."""
        if "weight_decay" in self.variant:
            return self.variant["weight_decay"]
        if self.family.weight_decay is not None:
            return self.family.weight_decay
        tau = self.variant.get("tau", self.target_tau)
        return scaling.weight_decay_for_tau(tau, self.lr_peak, self.batch_tokens, self.tokens)

    @property
    def tau(self) -> float:
        """The realized tau."""
        return scaling.tau_of(self.lr_peak, self.weight_decay, self.batch_tokens, self.tokens)

    @property
    def warmup_steps(self) -> int:
        s = self.family.schedule
        return scaling.warmup_steps(
            self.steps,
            fraction=s.warmup_fraction,
            max_tokens=s.warmup_max_tokens,
            batch_tokens=self.batch_tokens,
        )

    @property
    def flops(self) -> float:
        """Training FLOPs, Table 9 accounting."""
        return flops_rules.flops_table9(self.model.arch, self.model.count.total, self.tokens)

    @property
    def flops_6nd(self) -> float:
        return flops_rules.flops_6nd(self.model.count.total, self.tokens)

    def optimization(self, seed: int, stop_fraction: float) -> Optimization:
        return Optimization(
            seed=seed,
            tokens=self.tokens,
            batch_seqs=self.batch_seqs,
            steps=self.steps,
            warmup_steps=self.warmup_steps,
            lr_peak=self.lr_peak,
            weight_decay=self.weight_decay,
            tau=self.tau,
            grad_clip=self.family.training.grad_clip,
            stop_fraction=stop_fraction,
        )

    def every(self, fraction: float) -> int:
        """A period of ``fraction`` of the schedule, in whole steps (at least one)."""
        return max(1, round(self.steps * fraction))

    def logging(self) -> Logging:
        t = self.family.training
        return Logging(
            log_every_steps=min(t.log_every_steps, max(1, self.steps // 10)),
            eval_every_steps=self.every(t.eval_every_fraction),
            eval_batches=t.eval_batches,
            checkpoint_every_steps=self.every(t.checkpoint_every_fraction),
            keep_checkpoints=t.keep_checkpoints,
            tensorboard=t.tensorboard,
            wandb=t.wandb,
        )


# ------------------------------------------------------------------------------ resources
@dataclass(frozen=True)
class ResourcePlan(ABC):
    """What a run asks of the cluster: its layout, its time and the scheduler's request."""

    cluster: ClusterSpec
    training: TrainingSpec

    @staticmethod
    def of(cluster: ClusterSpec, training: TrainingSpec) -> ResourcePlan:
        kind = GpuResources if cluster.accelerator == "gpu" else CpuResources
        return kind(cluster, training)

    @abstractmethod
    def layout(self, model: ModelPlan, batch_seqs: int) -> parallel.Layout:
        """The TP x PP x DP layout, micro-batch and gradient accumulation, and its memory."""

    @abstractmethod
    def wall_hours(self, flops: float, lay: parallel.Layout) -> float:
        """Hours the full-length run trains on its layout."""

    @abstractmethod
    def gpu_hours(self, flops: float) -> float:
        """GPU-hours of the full-length run (0 without GPUs)."""

    @abstractmethod
    def threads(self, lay: parallel.Layout) -> int:
        """CPU threads asked for per node."""

    @abstractmethod
    def mem_mb(self, lay: parallel.Layout) -> int:
        """Host memory asked for per node."""

    @abstractmethod
    def gpus_per_node(self, lay: parallel.Layout) -> int:
        """GPUs asked for per node."""

    def runtime_min(self, wall_hours: float) -> int:
        """The time limit: the estimate with the cluster's margin, never under its minimum."""
        c = self.cluster
        return max(c.min_runtime_min, math.ceil(wall_hours * 60 * c.runtime_margin))

    def segments(
        self, wall_hours: float, params: int, steps: float, what: str
    ) -> time_limits.SegmentPlan:
        """The run's jobs under the cluster's time limit (collapse.segments)."""
        c = self.cluster
        return time_limits.plan_segments(
            wall_hours * 60,
            c.time_limit_min,
            margin=c.runtime_margin,
            min_runtime_min=c.min_runtime_min,
            save_min=time_limits.save_minutes(params, c.accelerator, c.checkpoint_gb_per_s),
            startup_min=c.job_startup_min,
            step_min=wall_hours * 60 / max(1.0, steps),
            checkpoint_gb=time_limits.checkpoint_bytes(params, c.accelerator) / time_limits.GB,
            what=what,
        )

    def resources(
        self, lay: parallel.Layout, wall_hours: float, seg: time_limits.SegmentPlan | None = None
    ) -> Resources:
        limits = {}
        if seg is not None:
            limits = dict(
                runtime_min=seg.runtime_min,
                segments=seg.segments,
                exit_duration_min=round(seg.exit_duration_min, 3),
                checkpoint_save_min=round(seg.save_min, 3),
            )
        return Resources(
            threads=self.threads(lay),
            mem_mb=self.mem_mb(lay),
            gpus_per_node=self.gpus_per_node(lay),
            nodes=lay.nodes,
            runtime_min=self.runtime_min(wall_hours),
            slurm_partition=self.cluster.partition,
            slurm_account=self.cluster.account,
            rendezvous_timeout_s=self.cluster.rendezvous_timeout_s,
            distributed_timeout_min=self.cluster.distributed_timeout_min,
        ).model_copy(update=limits)


class GpuResources(ResourcePlan):
    """A GPU cluster: the fastest layout over TP x PP x DP x micro-batch, SP and recompute."""

    def layout(self, model: ModelPlan, batch_seqs: int) -> parallel.Layout:
        try:
            return self._search(model, batch_seqs)
        except parallel.LayoutError as err:
            raise parallel.LayoutError(f"size {model.size.name}: {err}") from None

    def _search(self, model: ModelPlan, batch_seqs: int) -> parallel.Layout:
        c = self.cluster
        return _gpu_layout(
            model.arch,
            batch_seqs,
            model.flops_per_token,
            c.gpus_per_node,
            int(c.gpu_mem_gb * 2**30),
            c.max_nodes,
            parallel.Network(
                peak_flops=c.peak_flops,
                mfu=c.mfu,
                tp_bandwidth_gbs=c.tp_bandwidth_gbs,
                dp_bandwidth_gbs=c.dp_bandwidth_gbs,
                min_dp_efficiency=c.min_dp_efficiency,
                min_efficiency=c.min_efficiency,
            ),
            self.training.max_micro_batch_seqs,
            c.transformer_engine,
        )

    def wall_hours(self, flops: float, lay: parallel.Layout) -> float:
        c = self.cluster
        return parallel.wall_time_hours(flops, lay.gpus, c.peak_flops, c.mfu, lay.efficiency)

    def gpu_hours(self, flops: float) -> float:
        return parallel.gpu_hours(flops, self.cluster.peak_flops, self.cluster.mfu)

    def threads(self, lay: parallel.Layout) -> int:
        return self.cluster.cpus_per_gpu * lay.procs_per_node

    def mem_mb(self, lay: parallel.Layout) -> int:
        return int(self.cluster.mem_per_gpu_gb * 1024 * lay.procs_per_node)

    def gpus_per_node(self, lay: parallel.Layout) -> int:
        return lay.procs_per_node


@functools.lru_cache(maxsize=256)
def _gpu_layout(
    arch: ModelArch,
    batch_seqs: int,
    flops_per_token: float,
    gpus_per_node: int,
    gpu_mem_bytes: int,
    max_nodes: int,
    network: parallel.Network,
    max_micro_batch: int,
    transformer_engine: bool,
) -> parallel.Layout:
    """The layout search, once per size and batch (every TPP band and seed shares it)."""
    return parallel.choose_layout(
        arch,
        batch_seqs=batch_seqs,
        flops_per_token=flops_per_token,
        gpus_per_node=gpus_per_node,
        gpu_mem_bytes=gpu_mem_bytes,
        max_nodes=max_nodes,
        network=network,
        max_micro_batch=max_micro_batch,
        sequence_parallel=transformer_engine,
    )


class CpuResources(ResourcePlan):
    """The CPU cluster: data parallel over the run's gloo processes, the machine's memory."""

    def layout(self, model: ModelPlan, batch_seqs: int) -> parallel.Layout:
        return parallel.cpu_layout(
            model.arch,
            batch_seqs=batch_seqs,
            procs=self.cluster.procs_per_run,
            max_micro_batch=self.training.max_micro_batch_seqs,
            nodes=self.cluster.nodes_per_run,
            tp=self.cluster.tp,
            pp=self.cluster.pp,
        )

    def wall_hours(self, flops: float, lay: parallel.Layout) -> float:
        return flops / (self.cluster.peak_flops * self.cluster.mfu) / 3600

    def gpu_hours(self, flops: float) -> float:
        return 0.0

    def threads(self, lay: parallel.Layout) -> int:  # per node
        return self.cluster.threads_per_proc * lay.procs_per_node

    def mem_mb(self, lay: parallel.Layout) -> int:
        return int(self.cluster.mem_gb * 1024)

    def gpus_per_node(self, lay: parallel.Layout) -> int:
        return 0


def parallelism(lay: parallel.Layout) -> Parallelism:
    return Parallelism(**{field: getattr(lay, field) for field in Parallelism.model_fields})


# ------------------------------------------------------------------------------ planning
class Planned(NamedTuple):
    """A run's spec plus the plan-only facts (wall time, memory, epochs) for runs.csv."""

    spec: RunSpec
    facts: dict


@dataclass(frozen=True)
class Planner:
    """Composes the three parts into the runs of one family on one cluster."""

    cfg: Config
    corpus_tokens: int

    @property
    def family(self) -> FamilySpec:
        return self.cfg.family

    @cached_property
    def layout(self) -> FamilyLayout:
        return FamilyLayout.of(self.family.name, self.cfg.results)

    @cached_property
    def resources(self) -> ResourcePlan:
        return ResourcePlan.of(self.cfg.cluster, self.family.training)

    def seeds(self, size: SizeSpec) -> list[int]:
        """A reference size trains the reference seeds, every other size the family's."""
        reference = self.family.reference
        return reference.seeds if size.name in reference.sizes else self.family.seeds

    def run_plan(
        self, size: SizeSpec, tpp: float, variant: Mapping[str, float] | None = None
    ) -> RunPlan:
        return RunPlan(self.family, ModelPlan(self.family, size), tpp, dict(variant or {}))

    def run(
        self,
        role: Role,
        size: SizeSpec,
        tpp: float,
        seed: int,
        *,
        sweep: SweepSpec | None = None,
        variant: Mapping[str, float] | None = None,
        fault: FaultInjection | None = None,
    ) -> Planned:
        """One run of ``role``: the run part and the resources part, put into its spec."""
        run = self.run_plan(size, tpp, variant)
        lay = self.resources.layout(run.model, run.batch_seqs)
        stop_fraction = role.stop_fraction(sweep)
        wall_hours = self.resources.wall_hours(run.flops, lay) * stop_fraction
        monitored = self.monitored(role, size)
        fault = fault or FaultInjection()
        name = role.run_name(
            size.name, tpp, seed, sweep=sweep, variant=run.variant, fault=fault.name, tau=run.tau
        )
        seg = self.resources.segments(
            wall_hours, run.model.count.total, run.steps * stop_fraction, f"size {size.name}"
        )
        spec = RunSpec(
            run=name,
            family=self.family.name,
            size=size.name,
            tpp_band=tpp,
            tpp=run.tokens / run.model.tpp_params,
            role=role,
            sweep="" if sweep is None else sweep.name,
            variant=run.variant,
            params=run.model.count.total,
            params_non_embedding=run.model.count.non_embedding,
            flops_6nd=run.flops_6nd,
            flops=run.flops,
            **self.paths(name),
            model=run.model.arch,
            mup=run.mup,
            optim=run.optimization(seed, stop_fraction),
            parallel=parallelism(lay),
            resources=self.resources.resources(lay, wall_hours, seg),
            logging=run.logging(),
            monitor=self.monitor(run, name, monitored),
            fault=fault,
        )
        facts = {
            "wall_hours": wall_hours,
            "gpu_hours": self.resources.gpu_hours(run.flops) * stop_fraction,
            "epochs": self.epochs(run.tokens * stop_fraction),
            "memory_gb_per_gpu": (lay.memory.total / 2**30) if lay.memory is not None else 0.0,
            "is_reference": self.is_reference(role, size),
            "monitored": monitored,
            "fault": fault.name if role == Role.FAULT else "",
            "segments": seg.segments,
        }
        return Planned(spec, facts)

    def is_reference(self, role: Role, size: SizeSpec) -> bool:
        """Whether the run builds its band's reference curve."""
        return role.builds_reference and size.name in self.family.reference.sizes

    def monitored(self, role: Role, size: SizeSpec) -> bool:
        """Whether the collapse monitor watches the run: when the family turns it on, for a
        role it may watch, and never on the reference it checks against."""
        return self.family.gates.monitor and role.monitorable and not self.is_reference(role, size)

    def paths(self, run: str) -> dict[str, str]:
        """Where the run reads its data and tokenizer, writes its outputs and checkpoints."""
        layout = self.layout
        return {
            "dataset_prefix": str(layout.train_prefix),
            "valid_prefix": str(layout.valid_prefix),
            "tokenizer": str(layout.tokenizer),
            "run_dir": str(layout.run_dir(run)),
            "checkpoint_dir": str(layout.checkpoints(run)),
        }

    def monitor(self, run: RunPlan, name: str, monitored: bool) -> Monitor:
        gates = self.family.gates
        return Monitor(
            enabled=monitored,
            reference_csv=str(self.layout.monitor_reference(name)) if monitored else "",
            every_steps=run.every(gates.monitor_every_fraction) if monitored else 0,
            stop_on_alarm=gates.stop_on_alarm,
        )

    def epochs(self, tokens: float) -> float:
        """How often ``tokens`` pass over the corpus (NaN when it could not be counted)."""
        return tokens / self.corpus_tokens if self.corpus_tokens else float("nan")

    # ---------------------------------------------------------------------- the runs
    def family_runs(self) -> Iterator[Planned]:
        """Every size x TPP band x seed."""
        for tpp in self.family.tpp:
            for size in self.family.sizes:
                for seed in self.seeds(size):
                    yield self.run(Role.FAMILY, size, tpp, seed)

    def sweep_runs(self, sweep: SweepSpec) -> Iterator[Planned]:
        """A sweep's variants, then small full-length runs per tau of its grid (one per
        reference seed)."""
        family = self.family
        size = family.size(sweep.size)
        tpp = sweep.tpp if sweep.tpp is not None else family.tpp[0]
        taus = {}
        for variant in sweep_variants(sweep):
            planned = self.run(Role.SWEEP, size, tpp, sweep.seed, sweep=sweep, variant=variant)
            taus.setdefault(round(planned.spec.optim.tau, 4), planned.spec.optim.tau)
            yield planned
        reference = family.size(sweep.reference_size or family.reference.sizes[0])
        for tau in taus.values():
            for seed in sweep.seeds_of_references():
                yield self.run(
                    Role.SWEEP_REFERENCE, reference, tpp, seed, sweep=sweep, variant={"tau": tau}
                )

    def inherited_weight_decay(self, size: SizeSpec, tpp: float, holds: HeldDecay) -> float:
        """The lambda ``size`` gets when its weight decay is taken over from the smallest size
        instead of solved from tau: lambda itself (``weight_decay``) or the AdamW shrink per
        step eta * lambda (``decay_per_step``, as one LR and one lambda for every size apply
        it)."""
        smallest = self.run_plan(self.family.smallest_size(), tpp)
        if holds == "decay_per_step":
            return smallest.lr_peak * smallest.weight_decay / self.run_plan(size, tpp).lr_peak
        return smallest.weight_decay

    def fault_runs(self) -> Iterator[Planned]:
        """The fault-detection experiment: each injected fault in one size (default: the
        largest), seed 0 (the family's own run of that size is its clean twin), plus clean seeds
        of that size the family does not train already. wrong_tau keeps the smallest size's
        eta*lambda or lambda."""
        spec = self.family.faults
        if spec is None:
            return
        size = self.family.fault_size()
        tpp = spec.tpp if spec.tpp is not None else self.family.tpp[0]
        clean = FaultInjection(name="clean")
        for seed in (s for s in spec.clean_seeds if s not in self.seeds(size)):
            yield self.run(Role.FAULT, size, tpp, seed, fault=clean)
        for injection in spec.injections:
            wrong_tau = injection.kind == "wrong_tau"
            at = injection.at_fraction if injection.at_fraction is not None else spec.at_fraction
            fault = FaultInjection(
                kind=injection.kind,
                at_fraction=0.0 if wrong_tau else at,
                magnitude=injection.magnitude,
                name=injection.name,
            )
            variant = (
                {"weight_decay": self.inherited_weight_decay(size, tpp, injection.holds)}
                if wrong_tau
                else {}
            )
            yield self.run(Role.FAULT, size, tpp, 0, fault=fault, variant=variant)

    def contrast_runs(self) -> Iterator[Planned]:
        """The contrast (family.contrast): the family's runs of its band again, each size with
        the weight decay the smallest size's would give it (``contrast.holds``: eta * lambda or
        lambda), so tau is not held fixed. The smallest size's runs already have it: the
        contrast uses the family's own (contrast_members), it plans no twins."""
        family, band = self.family, self.family.contrast_band()
        if band is None:
            return
        smallest = family.smallest_size().name
        chosen = family.contrast.sizes or [s.name for s in family.sizes if s.name != smallest]
        for size in (s for s in family.sizes if s.name in chosen):
            decay = self.inherited_weight_decay(size, band, family.contrast.holds)
            for seed in family.contrast.seeds or self.seeds(size):
                yield self.run(Role.CONTRAST, size, band, seed, variant={"weight_decay": decay})

    def all_runs(self) -> Iterator[Planned]:
        yield from self.family_runs()
        for sweep in self.family.sweeps:
            yield from self.sweep_runs(sweep)
        yield from self.fault_runs()
        yield from self.contrast_runs()


def sweep_variants(sweep: SweepSpec) -> list[dict[str, float]]:
    keys = sorted(sweep.grid)
    return [
        dict(zip(keys, values, strict=True))
        for values in itertools.product(*(sweep.grid[k] for k in keys))
    ]


def corpus_size(cfg: Config) -> tuple[int, str]:
    """The corpus's tokens as its metadata gives them, or 0 and why it could not be counted."""
    from collapse.data import estimate_corpus_tokens

    layout = FamilyLayout.of(cfg.family.name, cfg.results)
    try:
        return estimate_corpus_tokens(cfg.family.data, layout.data_dir), ""
    except ValueError as err:  # a streamed source of unknown size, a package not installed
        return 0, str(err)


def shared_with(runs: list[RunSpec]) -> list[str]:
    """For each run, the family run it trains exactly like (a sweep's, ``Role.may_share``), or
    "". A sweep variant stopped early shares the full family run it is the first part of: it is
    predicted from the same first steps, and its true final loss is then known too."""
    family: dict[str, RunSpec] = {}
    for spec in runs:
        if spec.role == Role.FAMILY:
            family.setdefault(spec.prefix_key(), spec)
    twins = []
    for spec in runs:
        twin = family.get(spec.prefix_key()) if spec.role.may_share else None
        longer = twin is not None and twin.optim.stop_fraction >= spec.optim.stop_fraction
        twins.append(twin.run if longer else "")
    return twins


def plan_family(cfg: Config, corpus_tokens: int | None = None) -> Plan:
    """Every run of the family; ConfigError (naming the size) when a run cannot be laid out."""
    corpus_unknown = ""
    if corpus_tokens is None:
        corpus_tokens, corpus_unknown = corpus_size(cfg)
    try:
        planned = list(Planner(cfg, corpus_tokens).all_runs())
    except (parallel.LayoutError, time_limits.SegmentError) as err:
        raise ConfigError(f"cluster {cfg.cluster.name!r}: {err}") from None
    runs = [p.spec for p in planned]
    _check_ranges(runs)
    rows = [
        _row(p.spec, p.facts | {"same_as": same_as})
        for p, same_as in zip(planned, shared_with(runs), strict=True)
    ]
    table = pd.DataFrame(rows, columns=RUNS_COLUMNS)
    return Plan(config=cfg, runs=tuple(runs), table=table, corpus_unknown=corpus_unknown)


def contrast_members(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of the runs the contrast is measured on (a plan table or runs.csv): the family's
    runs of the smallest size in the contrast's band (its lambda is the contrast's already), then
    the contrast's own runs. Empty for a family without a contrast."""
    own = table[table.role == Role.CONTRAST]
    if own.empty:
        return own
    family = table[(table.role == Role.FAMILY) & (table.tpp_band == own.tpp_band.iloc[0])]
    width = family.n_layers * family.d_model**2  # as FamilySpec.smallest_size ranks sizes
    shared = family[width == width.min()]
    return pd.concat([shared, own])


def _check_ranges(runs: Iterable[RunSpec]) -> None:
    """Plans that would train nonsense: fail before any job starts."""
    problems = []
    for r in runs:
        if r.optim.steps < 10:
            problems.append(
                f"{r.run}: only {r.optim.steps} optimizer steps (tokens {r.optim.tokens}, batch "
                f"{r.optim.batch_seqs} x {r.model.seq_len}); raise family.tpp or lower the batch"
            )
        if not 1e-3 <= r.optim.tau <= 10:
            problems.append(
                f"{r.run}: tau {r.optim.tau:.3g} is outside [0.001, 10]; check family.tau "
                "(a fraction of training, e.g. 0.05-0.3)"
            )
    if problems:
        raise ConfigError("plan:\n  " + "\n  ".join(problems))


def _row(spec: RunSpec, facts: dict) -> dict:
    m, o, p = spec.model, spec.optim, spec.parallel
    return {
        "run": spec.run,
        "role": spec.role,
        "sweep": spec.sweep,
        "size": spec.size,
        "tpp_band": spec.tpp_band,
        "tpp": spec.tpp,
        "seed": o.seed,
        "d_model": m.d_model,
        "n_layers": m.n_layers,
        "n_heads": m.n_heads,
        "params": spec.params,
        "params_non_embedding": spec.params_non_embedding,
        "tokens": o.tokens,
        "seq_len": m.seq_len,
        "batch_seqs": o.batch_seqs,
        "steps": o.steps,
        "lr_peak": o.lr_peak,
        "weight_decay": o.weight_decay,
        "tau": o.tau,
        "warmup_steps": o.warmup_steps,
        "stop_fraction": o.stop_fraction,
        "flops_6nd": spec.flops_6nd,
        "flops": spec.flops,
        "tp": p.tp,
        "pp": p.pp,
        "dp": p.dp,
        "micro_batch_seqs": p.micro_batch_seqs,
        "grad_accum": p.grad_accum,
        "gpus": p.gpus,
        "nodes": p.nodes,
        **facts,
    }


# ----------------------------------------------------------------------------------- writing
def write_plan(plan: Plan, out_dir: Path | None = None, *, specs: bool = True) -> list[str]:
    """Write specs (only changed ones), runs.csv, the resolved config and the report.

    Returns the runs whose spec file changed. ``specs=False`` leaves the spec files to the
    workflow, which writes each in its own job so that a changed spec retrains its run at once.
    """
    layout = plan.layout
    out_dir = Path(out_dir or layout.plan_dir)
    changed = [
        spec.run
        for spec in (plan.runs if specs else [])
        if write_if_changed(out_dir / "runs" / f"{spec.run}.json", spec.to_json())
    ]
    write_if_changed(out_dir / "config.json", _resolved_config(plan.config))
    write_if_changed(out_dir / "data.json", plan.config.family.data.model_dump_json(indent=2))
    write_if_changed(out_dir / "runs.csv", plan.table.to_csv(index=False))
    write_if_changed(out_dir / "report.md", plan_report_markdown(plan))
    plot_plan(plan.table, out_dir / "plan.png")
    return changed


def _resolved_config(cfg: Config) -> str:
    return json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"


def plan_report_markdown(plan: Plan) -> str:
    fam, cl, t = plan.config.family, plan.config.cluster, plan.table
    show = [
        "run", "params", "tokens", "tpp", "batch_seqs", "steps", "lr_peak", "weight_decay", "tau",
        "warmup_steps", "flops", "tp", "pp", "dp", "gpus", "nodes", "wall_hours", "gpu_hours",
        "epochs", "segments",
    ]  # fmt: skip
    fmt = t[show].copy()
    for col in ("params", "tokens", "flops"):
        fmt[col] = fmt[col].map(_si)
    for col in ("lr_peak", "weight_decay", "tau", "tpp", "wall_hours", "gpu_hours", "epochs"):
        fmt[col] = fmt[col].map(lambda x: f"{x:.3g}")
    trained = t[t.same_as == ""]  # a shared run costs nothing twice

    def done(column: pd.Series) -> float:
        """What the runs train of a full-length figure (a run stopped early trains a part)."""
        return float((column * trained.stop_fraction).sum())

    total_gpu_h = trained["gpu_hours"].sum()
    total_wall_h = trained["wall_hours"].sum()
    lines = [
        f"# Compute plan: family `{fam.name}` on cluster `{cl.name}`",
        "",
        fam.description,
        "",
        f"- runs: {len(t)} ({(t.role == Role.FAMILY).sum()} family, "
        f"{t.role.isin(SWEEP_ROLES).sum()} sweep, "
        f"{(t.role == Role.FAULT).sum()} fault experiment, "
        f"{(t.role == Role.CONTRAST).sum()} contrast)"
        + (
            f"; {len(t) - len(trained)} of them a family run's twin, trained once"
            if len(t) > len(trained)
            else ""
        ),
        f"- training FLOPs (Table 9 accounting): {_si(done(trained.flops))}; "
        f"6ND: {_si(done(trained.flops_6nd))}; tokens: {_si(done(trained.tokens))}"
        + (
            " (sweep variants stopped early count the part they train)"
            if (trained.stop_fraction < 1).any()
            else ""
        ),
        f"- GPU-hours at MFU {cl.mfu:.0%}: {total_gpu_h:,.1f}",
        f"- wall-hours if run one after another: {total_wall_h:,.2f}",
        f"- reference sizes: {', '.join(fam.reference.sizes)} (seeds {fam.reference.seeds})",
        "",
        fmt.to_markdown(index=False) if _has_tabulate() else fmt.to_string(index=False),
        "",
        "![tokens, FLOPs and GPU-hours by size](plan.png)",
        "",
    ]
    if layouts := layouts_markdown(plan):
        lines += [layouts]
    if warnings := plan.warnings():
        lines += ["## Warnings", "", *(f"- {w}" for w in warnings), ""]
    lines += time_limits.report_lines(plan.runs, cl)
    if cl.executor == "slurm":
        from collapse.launch import sbatch_request

        lines += [
            "## Slurm requests of the training jobs",
            "",
            "What `snakemake --profile slurm` submits for each run (the plugin adds the job name,",
            "log file and command):",
            "",
            "| run | request |",
            "|---|---|",
            *(f"| {r.run} | `{sbatch_request(r)}` |" for r in plan.runs),
            "",
        ]
    return "\n".join(lines)


def layouts_markdown(plan: Plan) -> str:
    """The layout search's result per size: the chosen layout first, then the runners-up, each
    with its GPUs, memory per GPU, step time and the full-length wall time of the size's longest
    band; a size on fewer GPUs than a smaller one says why."""
    cl = plan.config.cluster
    if cl.accelerator != "gpu":
        return ""
    resources = ResourcePlan.of(cl, plan.config.family.training)
    family = plan.config.family
    t = plan.table[plan.table.same_as == ""]
    lines = [
        "## Layouts",
        "",
        "The fastest layout that fits each size (`collapse.parallel.choose_layout`), then the",
        "runners-up. Wall time: the size's longest run at full length. Memory: the estimate of",
        f"`collapse.memory`, against {cl.gpu_mem_gb:g} GB per GPU (85 % usable). Efficiency",
        f"floors: data-parallel {cl.min_dp_efficiency:.0%}, overall {cl.min_efficiency:.0%}.",
        "",
        "| size | layout | GPUs | memory/GPU (GiB) | step (s) | wall (h) | efficiency |",
        "|---|---|---|---|---|---|---|",
    ]
    notes, most_gpus = [], (0, "")
    for size in sorted(family.sizes, key=lambda z: ModelPlan(family, z).count.total):
        rows = t[t["size"] == size.name]
        if rows.empty:
            continue
        longest = rows.loc[rows.tokens.idxmax()]
        steps = int(longest.steps)
        lay = resources.layout(ModelPlan(family, size), int(longest.batch_seqs))
        chosen = parallel.Candidate(
            lay.tp, lay.pp, lay.dp, lay.micro_batch_seqs, lay.sequence_parallel, lay.recompute,
            lay.memory, lay.step_seconds, lay.efficiency, 1.0,
        )  # fmt: skip
        for i, c in enumerate((chosen, *lay.runners_up)):
            lines.append(
                f"| {size.name if i == 0 else ''} | {'**' if i == 0 else ''}{c.describe()}"
                f"{'**' if i == 0 else ''} | {c.gpus} | {c.memory.total / 2**30:.1f} | "
                f"{c.step_seconds:.3g} | {steps * c.step_seconds / 3600:.3g} | "
                f"{c.efficiency:.0%} |"
            )
        if lay.gpus < most_gpus[0]:
            notes.append(
                f"{size.name} runs on fewer GPUs than a smaller size ({most_gpus[1]}, "
                f"{most_gpus[0]}): {lay.limit}"
            )
        most_gpus = max(most_gpus, (lay.gpus, size.name))
    lines.append("")
    if notes:
        lines += ["Why a size has fewer GPUs than a smaller size:", ""]
        lines += [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401
    except ImportError:
        return False
    return True


def _si(x: float) -> str:
    for unit, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def plot_plan(table: pd.DataFrame, path: Path) -> None:
    """Tokens, FLOPs and GPU-hours (or CPU wall-hours) per size, log scales: one glance."""
    from collapse.plotting import Figure, save

    fam = table[table.role == Role.FAMILY].groupby("size", sort=False).first().reset_index()
    fam = fam.sort_values("params")
    hours_col = "gpu_hours" if fam["gpu_hours"].sum() > 0 else "wall_hours"
    panels = [
        ("tokens", "training tokens"),
        ("flops", "training FLOPs (Table 9)"),
        (hours_col, "GPU-hours" if hours_col == "gpu_hours" else "CPU wall-hours"),
    ]
    fig = Figure(figsize=(13, 3.8), layout="constrained")
    axes = fig.subplots(1, 3)
    for ax, (col, label) in zip(axes, panels, strict=True):
        for band, rows in table[table.role == Role.FAMILY].groupby("tpp_band"):
            rows = rows.groupby("size", sort=False).first().sort_values("params")
            ax.plot(rows["params"], rows[col], "o-", label=f"TPP {band:g}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        for _, r in fam.iterrows():
            ax.annotate(r["size"], (r["params"], r[col]), fontsize=7, alpha=0.7)
    axes[0].legend()
    fig.suptitle("Compute plan by size")
    save(fig, path, dpi=120)


# ------------------------------------------------------------------------------------- CLI
def add_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="validate a family spec and write its compute plan",
        description="Compose the family and cluster configs (Hydra), validate them, derive every "
        "run's hyperparameters and write results/<family>/plan/: one spec per run, runs.csv, "
        "report.md, plan.png, and config.json and data.json (the resolved configs). Nothing is "
        "written when the spec is invalid.",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides, e.g. family=celerity cluster=slurm_h100 family.tpp=[20]",
    )
    p.add_argument("--out", type=Path, help="plan directory (default results/<family>/plan)")
    p.add_argument(
        "--config-dir",
        type=Path,
        default=None,
        help="config folder (default: $COLLAPSE_CONFIG_DIR, else ./config)",
    )
    p.add_argument("--show", action="store_true", help="print the plan table")
    p.add_argument(
        "--no-specs",
        dest="specs",
        action="store_false",
        help="write the tables and the report only, not runs/<run>.json (the workflow writes "
        "each spec in a job of its own)",
    )
    p.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    try:
        plan = plan_family(load_config(args.overrides, args.config_dir))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    changed = write_plan(plan, args.out, specs=args.specs)
    out = args.out or plan.layout.plan_dir
    specs = f"{len(changed)} spec files changed" if args.specs else "spec files not written"
    print(f"planned {len(plan.runs)} runs into {out} ({specs})")
    for warning in plan.warnings():
        print(f"warning: {warning}", file=sys.stderr)
    if args.show:
        print(plan_report_markdown(plan))
    return 0
