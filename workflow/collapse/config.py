"""The family spec and the cluster spec: composed once with Hydra, validated into typed objects.

``compose_config`` turns the config groups under ``config/`` plus Hydra-style overrides into one
plain dict; ``validate_config`` turns that dict into ``FamilySpec`` / ``ClusterSpec`` or raises
``ConfigError`` naming every bad field and its fix. Nothing here writes files.
"""

from __future__ import annotations

import difflib
import os
import shlex
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from collapse.data import DataConfig, DataSpec
from collapse.tasks import PAPER_TASKS
from collapse.validate import InputError

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


class ConfigError(InputError):
    """A family or cluster spec that cannot be planned; the message names each field and a fix."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ------------------------------------------------------------------------------------ family
class SizeSpec(_Spec):
    """One model size. Architecture fields left out come from the family's ``arch`` block."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9.-]*$")]
    d_model: PositiveInt
    n_layers: PositiveInt
    n_heads: PositiveInt
    head_dim: PositiveInt | None = None  # default d_model / n_heads
    batch_seqs: PositiveInt | None = None  # used when batch.rule == "table"

    @model_validator(mode="after")
    def _heads_divide_width(self) -> SizeSpec:
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"n_heads={self.n_heads} does not divide d_model={self.d_model}: pick n_heads "
                f"from {_divisors(self.d_model)} or set head_dim explicitly"
            )
        return self


def _duplicate_problems(lists: dict[str, list]) -> list[str]:
    problems = []
    for field, values in lists.items():
        dupes = sorted({v for v in values if values.count(v) > 1})
        if dupes:
            shown = ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in dupes)
            problems.append(f"{field}: {shown} listed twice; list each value once")
    return problems


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, min(n, 64) + 1) if n % k == 0]


class ArchSpec(_Spec):
    """Architecture shared by all sizes of a family."""

    ffn_mult: PositiveFloat = 4.0
    activation: Literal["gelu", "squared_relu", "swiglu"] = "gelu"
    positions: Literal["rope", "alibi", "learned"] = "rope"
    vocab_size: Annotated[int, Field(ge=257)] = 4096
    seq_len: PositiveInt = 128
    tied_embeddings: bool = False
    norm_eps: PositiveFloat = 1e-5


class TauPowerLaw(_Spec):
    """tau_opt = coef * TPP^exponent (Power Lines, Bergsma et al. 2025a)."""

    coef: PositiveFloat = 1.084
    exponent: float = -0.527
    scale: PositiveFloat = 1.0  # Celerity ran at about 0.8x the law


class ScheduleSpec(_Spec):
    """Linear warmup then linear decay to zero (D2Z, Bergsma et al. 2025b)."""

    warmup_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.1
    warmup_max_tokens: PositiveInt | None = None  # Celerity: min(10 % of tokens, 375M)
    decay: Literal["linear_d2z"] = "linear_d2z"


class ParameterizationSpec(_Spec):
    """µP (Cerebras) or CompleteP; by default the paper's tuned proxy values (docs/method.md §7)."""

    kind: Literal["mup", "completep", "sp"] = "mup"
    d_base: PositiveInt = 256
    depth_base: PositiveInt = 2
    sigma_base: PositiveFloat = 8.67e-2
    eta_base: PositiveFloat = 1.62e-2
    alpha_input: PositiveFloat = 9.17
    alpha_output: PositiveFloat = 1.095
    beta1: Annotated[float, Field(ge=0, lt=1)] = 0.9
    beta2: Annotated[float, Field(ge=0, lt=1)] = 0.95
    eps: PositiveFloat = 1e-8
    completep_alpha: Annotated[float, Field(ge=0.5, le=1.0)] = 1.0
    # AdamW decays a group by lr_group x lambda per step. "coupled": one lambda for every matrix,
    # so the (un)embedding, at LR eta_base, has timescale tau / m_d, shorter than the hidden
    # weights' tau by the width multiplier; "same_tau": its weight decay is scaled by
    # lr_hidden / lr_embedding, so every decayed group has the family's tau.
    embedding_decay: Literal["coupled", "same_tau"] = "coupled"


class BatchSpec(_Spec):
    """Global batch in sequences: a per-size table or a power law in D (Power Lines)."""

    rule: Literal["table", "power_law"] = "power_law"
    coef: PositiveFloat = 0.0306  # B_opt = coef * D^exponent, in 2048-token sequences
    exponent: Annotated[float, Field(ge=0, le=1)] = 0.383
    multiple_of: PositiveInt = 8
    min_seqs: PositiveInt = 8


class ReferenceSpec(_Spec):
    """Which sizes build each band's reference curve, and with how many seeds."""

    sizes: list[str] = Field(min_length=1)
    seeds: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=lambda: [0, 1, 2], min_length=1
    )


class SweepSpec(_Spec):
    """A hyperparameter grid at one size; each variant is a run with its own spec."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9-]*$")]
    size: str
    tpp: PositiveFloat | None = None  # default: the family's first band
    grid: dict[Literal["tau", "weight_decay", "batch_seqs", "lr_peak", "eta_base"], list[float]]
    fraction: Annotated[float, Field(gt=0, le=1)] = 0.3
    fractions: list[Annotated[float, Field(gt=0, le=1)]] = Field(
        default_factory=lambda: [0.1, 0.2, 0.3]
    )
    validate_full: bool = False  # train every variant to the end to measure the truth
    seed: Annotated[int, Field(ge=0)] = 0
    # A small run per distinct tau of the grid is each variant's reference (docs/method.md §5,
    # step 1: one small model per combination of controls). Default: the first reference size.
    reference_size: str | None = None
    # Seeds of each tau's reference, averaged: one seed's noise in the reference moves every
    # prediction at that tau alike, by as much as variants differ. Default: [seed].
    reference_seeds: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=1)

    def seeds_of_references(self) -> list[int]:
        return self.reference_seeds if self.reference_seeds is not None else [self.seed]

    @field_validator("grid", mode="before")
    @classmethod
    def _known_hyperparameters(cls, grid: Any) -> Any:
        known = ("tau", "weight_decay", "batch_seqs", "lr_peak", "eta_base")
        if isinstance(grid, dict):
            for key in grid:
                if key not in known:
                    raise ValueError(
                        f"cannot sweep unknown hyperparameter {key!r}{_did_you_mean(key, known)}; "
                        f"sweepable: {', '.join(known)}"
                    )
        return grid

    @field_validator("grid")
    @classmethod
    def _non_empty(cls, grid: dict[str, list[float]]) -> dict[str, list[float]]:
        if not grid or any(len(v) == 0 for v in grid.values()):
            raise ValueError("a sweep needs at least one hyperparameter with at least one value")
        if any(x <= 0 for v in grid.values() for x in v):
            raise ValueError("sweep values must be positive")
        return grid


FAULT_KINDS = ("loss_kernel", "lr_spike", "data_repeat", "nan_loss", "wrong_tau")
# What a size takes over from the smallest size when its weight decay is not solved from tau
# (the contrast, the wrong_tau fault): the AdamW shrink per step eta * lambda, or lambda itself.
HeldDecay = Literal["decay_per_step", "weight_decay"]


class FaultSpec(_Spec):
    """One injected fault (collapse.faults.Faults says what each kind does to the run).

    magnitude: loss_kernel, the share of tokens the broken reduction drops (0.875: keeps 1 in 8);
    lr_spike, the LR factor for 1 % of the schedule; data_repeat, the window of the last
    batches (a fraction of training) that the loader replays in a loop (0: rewind to the start);
    nan_loss and wrong_tau ignore it. wrong_tau is a planning fault: the size keeps the smallest
    size's weight decay, not rescaled, so tau drifts; ``holds`` says which (as in ContrastSpec:
    eta * lambda by default, since lambda alone barely moves tau under µP).
    """

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9-]*$")]
    kind: Literal[FAULT_KINDS]
    magnitude: Annotated[float, Field(ge=0)] = 0.0
    at_fraction: Annotated[float, Field(gt=0, lt=1)] | None = None  # default: the experiment's
    holds: HeldDecay = "decay_per_step"  # wrong_tau only

    @model_validator(mode="after")
    def _holds_is_wrong_tau_only(self) -> FaultSpec:
        if "holds" in self.model_fields_set and self.kind != "wrong_tau":
            raise ValueError(
                f"fault {self.name!r}: holds applies to kind wrong_tau only; remove it from "
                f"this {self.kind} fault"
            )
        return self


class DetectorSpec(_Spec):
    """The raw-loss detectors the collapse monitor is compared with (the fault experiment)."""

    # OLMo-core's StabilityMonitorCallback defaults: a spike is a loss above the mean of the
    # previous 128 values by more than 6 standard deviations.
    spike_window_steps: PositiveInt = 128
    spike_k_sigma: PositiveFloat = 6.0
    # A smoothed raw-loss rise: the 100-step trailing mean (the paper's smoothing) above its
    # running minimum by more than rise_margin (relative).
    rise_window_steps: PositiveInt = 100
    rise_margin: PositiveFloat = 0.01
    # How often the collapse monitor is checked while replaying a curve, in logged steps. The
    # raw-loss rules look at every step; so does the monitor by default (a check is a trailing
    # mean over the new steps: cheap), so that its alarm is not late by its cadence alone.
    monitor_every_steps: PositiveInt = 1
    # The controls audit fires when a step's eta_t * lambda is off the reference runs' by more
    # than this (relative); collapse.controls says why 5 %.
    controls_tolerance: Annotated[float, Field(gt=0, lt=1)] = 0.05


class FaultExperimentSpec(_Spec):
    """Faults injected into one size (default: the largest) plus clean seeds of that size, to
    measure when the collapse monitor and the raw-loss detectors fire."""

    size: str | None = None
    tpp: PositiveFloat | None = None  # default: the family's first band
    clean_seeds: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=lambda: [0, 1, 2], min_length=1
    )
    at_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.55
    injections: list[FaultSpec] = Field(min_length=1)
    detectors: DetectorSpec = Field(default_factory=DetectorSpec)


class ContrastSpec(_Spec):
    """The contrast of the method (docs/method.md §9): the family's runs of one band again,
    identical except that tau is not held fixed; the smallest size's own runs are shared, not
    trained again. Its collapse is measured by the same statistics and gates, next to the
    family's.

    ``holds`` says which weight decay every size takes over from the smallest size:
    ``decay_per_step``: the AdamW shrink per step, eta * lambda, as a recipe with one learning
    rate and one lambda for every size applies it (Llama-style); tau = 1/(eta lambda T) then
    falls as 1/T. ``weight_decay``: lambda itself. Under µP (eta ~ 1/width) with batch ~ sqrt(D)
    that leaves tau nearly fixed (tiny: 1.12x from d96 to d192), so it contrasts little."""

    tpp: PositiveFloat | None = None  # default: the family's first band
    holds: HeldDecay = "decay_per_step"
    # seeds of every contrast size; None: the family's (its reference seeds at reference sizes)
    seeds: list[Annotated[int, Field(ge=0)]] | None = Field(default=None, min_length=1)
    # the sizes trained again; None: every size but the smallest (whose runs are shared). The
    # largest alone is the cheapest contrast that still spans the family's whole range of tau.
    sizes: list[str] | None = Field(default=None, min_length=1)


class TrainingSpec(_Spec):
    """Knobs of the training job that are not scaling rules."""

    grad_clip: PositiveFloat = 1.0
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    max_micro_batch_seqs: PositiveInt = 16
    log_every_steps: PositiveInt = 10
    eval_every_fraction: Annotated[float, Field(gt=0, le=1)] = 0.1
    eval_batches: PositiveInt = 4
    checkpoint_every_fraction: Annotated[float, Field(gt=0, le=1)] = 0.1
    keep_checkpoints: PositiveInt = 2
    tensorboard: bool = True  # event files under results/<family>/tensorboard/<run>
    wandb: bool = False  # an offline W&B run per training run, under results/<family>/wandb


class GateSpec(_Spec):
    """Threshold policy of the collapse gates (see collapse.gates) and per-run overrides."""

    k_sigma: PositiveFloat = 4.0
    floor: Annotated[float, Field(ge=0)] = 0.005
    window: tuple[float, float] = (0.2, 1.0)
    allow_fail: list[str] = Field(default_factory=list)  # runs whose failed gate does not block
    # False: every failed gate is recorded ("overridden") but blocks nothing, for a family known
    # not to collapse (the CPU demo); the threshold and the verdicts are unchanged.
    enforce: bool = True
    monitor: bool = True  # non-reference sizes run the online monitor during training
    monitor_every_fraction: Annotated[float, Field(gt=0, le=1)] = 0.05
    stop_on_alarm: bool = False


class EvaluationSpec(_Spec):
    """Downstream evaluation (lm-evaluation-harness, offline); ``limit`` examples per task."""

    tasks: list[Literal[PAPER_TASKS]] = Field(default_factory=lambda: list(PAPER_TASKS))
    limit: PositiveInt | None = None  # None: every example (GPU clusters)


class FamilySpec(_Spec):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]*$")]
    description: str = ""
    sizes: list[SizeSpec] = Field(min_length=1)
    arch: ArchSpec = Field(default_factory=ArchSpec)
    tpp: list[Annotated[float, Field(ge=0.5, le=10000)]] = Field(min_length=1)
    tau: list[Annotated[float, Field(gt=0, le=10)]] | TauPowerLaw
    tpp_counts: Literal["all", "non_embedding"] = "all"
    # A contrast recipe, not the method: one weight decay for every size (as Llama-style recipes
    # do), so tau = B/(eta lambda D) is no longer held fixed and the tau rule above is ignored.
    weight_decay: PositiveFloat | None = None
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec)
    parameterization: ParameterizationSpec = Field(default_factory=ParameterizationSpec)
    batch: BatchSpec = Field(default_factory=BatchSpec)
    seeds: list[Annotated[int, Field(ge=0)]] = Field(default_factory=lambda: [0], min_length=1)
    reference: ReferenceSpec
    sweeps: list[SweepSpec] = Field(default_factory=list)
    data: DataSpec = Field(default_factory=DataConfig)
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    gates: GateSpec = Field(default_factory=GateSpec)
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)
    faults: FaultExperimentSpec | None = None  # the fault-detection experiment; off by default
    contrast: ContrastSpec | None = None  # the same runs with lambda fixed; off by default

    @model_validator(mode="after")
    def _cross_field_checks(self) -> FamilySpec:
        names = [s.name for s in self.sizes]
        problems = []
        if len(set(names)) != len(names):
            dupes = sorted({n for n in names if names.count(n) > 1})
            problems.append(f"sizes: duplicate size names {dupes}; give every size its own name")
        if isinstance(self.tau, list) and len(self.tau) not in (1, len(self.tpp)):
            problems.append(
                f"tau: {len(self.tau)} values for {len(self.tpp)} TPP bands; give one tau per "
                "band, a single tau for all, or a power law {coef, exponent}"
            )
        for ref in self.reference.sizes:
            if ref not in names:
                problems.append(
                    f"reference.sizes: {ref!r} is not a size of the family"
                    f"{_did_you_mean(ref, names)}; sizes are {names}"
                )
        if self.batch.rule == "table":
            missing = [s.name for s in self.sizes if s.batch_seqs is None]
            if missing:
                problems.append(
                    f"sizes[].batch_seqs: missing for {missing} while batch.rule is 'table'; "
                    "set batch_seqs per size or use batch.rule: power_law"
                )
        for sweep in self.sweeps:
            if sweep.size not in names:
                problems.append(
                    f"sweeps[{sweep.name}].size: {sweep.size!r} is not a size of the family"
                    f"{_did_you_mean(sweep.size, names)}"
                )
            if sweep.reference_size is not None and sweep.reference_size not in names:
                problems.append(
                    f"sweeps[{sweep.name}].reference_size: {sweep.reference_size!r} is not a "
                    f"size of the family{_did_you_mean(sweep.reference_size, names)}"
                )
            ref_size = sweep.reference_size or (self.reference.sizes or [None])[0]
            if sweep.size == ref_size:
                problems.append(
                    f"sweeps[{sweep.name}].size: {sweep.size!r} is also the size of the sweep's "
                    "reference runs (reference_size, default the first reference size), so each "
                    "variant would be predicted from a copy of itself; sweep a larger size or "
                    "set reference_size to a smaller one"
                )
            if sweep.tpp is not None and sweep.tpp not in self.tpp:
                problems.append(
                    f"sweeps[{sweep.name}].tpp: {sweep.tpp} is not one of the bands {self.tpp}"
                )
            if "tau" in sweep.grid and "weight_decay" in sweep.grid:
                problems.append(
                    f"sweeps[{sweep.name}].grid: tau and weight_decay set the same thing "
                    "(tau = B/(eta lambda D)); sweep one of them"
                )
        if self.faults is not None:
            f = self.faults
            if f.size is not None and f.size not in names:
                problems.append(
                    f"faults.size: {f.size!r} is not a size of the family"
                    f"{_did_you_mean(f.size, names)}"
                )
            if f.tpp is not None and f.tpp not in self.tpp:
                problems.append(f"faults.tpp: {f.tpp} is not one of the bands {self.tpp}")
            if len({i.name for i in f.injections}) != len(f.injections):
                problems.append("faults.injections: two faults share a name; names must be unique")
            target = self.fault_size().name if f.size is None or f.size in names else None
            if target in self.reference.sizes:
                problems.append(
                    f"faults.size: {target!r} builds the reference; inject faults into a size "
                    "the reference does not use"
                )
        if self.contrast is not None:
            if self.weight_decay is not None:
                problems.append(
                    "contrast: this family already holds the weight decay fixed (weight_decay: "
                    f"{self.weight_decay:g}), so its contrast would be itself; set "
                    "contrast: null or drop weight_decay"
                )
            if self.contrast.tpp is not None and self.contrast.tpp not in self.tpp:
                problems.append(
                    f"contrast.tpp: {self.contrast.tpp} is not one of the bands {self.tpp}"
                )
            for name in self.contrast.sizes or []:
                if name not in names:
                    problems.append(
                        f"contrast.sizes: {name!r} is not a size of the family"
                        f"{_did_you_mean(name, names)}"
                    )
                elif name == self.smallest_size().name:
                    problems.append(
                        f"contrast.sizes: {name!r} is the smallest size, whose own runs are the "
                        "contrast's already (its weight decay is the one the others take over); "
                        "list larger sizes only"
                    )
        if len({s.name for s in self.sweeps}) != len(self.sweeps):
            problems.append("sweeps: two sweeps share a name; names must be unique")
        problems += _duplicate_problems(self.run_defining_lists())
        if self.data.vocab_size != self.arch.vocab_size:
            problems.append(
                f"data.vocab_size: {self.data.vocab_size} differs from arch.vocab_size "
                f"{self.arch.vocab_size}; the tokenizer's ids index the model's embedding rows, "
                "so set both to one value (data.vocab_size: ${family.arch.vocab_size})"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def run_defining_lists(self) -> dict[str, list]:
        """Every list whose values name runs: a value given twice would plan a run twice."""
        lists = {
            "tpp": self.tpp,
            "seeds": self.seeds,
            "reference.sizes": self.reference.sizes,
            "reference.seeds": self.reference.seeds,
        }
        for sweep in self.sweeps:
            lists[f"sweeps[{sweep.name}].fractions"] = sweep.fractions
            lists[f"sweeps[{sweep.name}].reference_seeds"] = sweep.seeds_of_references()
            for key, values in sweep.grid.items():
                lists[f"sweeps[{sweep.name}].grid.{key}"] = values
        if self.contrast is not None:
            lists["contrast.seeds"] = self.contrast.seeds or []
            lists["contrast.sizes"] = self.contrast.sizes or []
        if self.faults is not None:
            lists["faults.clean_seeds"] = self.faults.clean_seeds
        return lists

    def size(self, name: str) -> SizeSpec:
        return next(s for s in self.sizes if s.name == name)

    def fault_size(self) -> SizeSpec:
        """The size the fault experiment uses: the one named, else the largest."""
        if self.faults is not None and self.faults.size is not None:
            return self.size(self.faults.size)
        return max(self.sizes, key=lambda s: s.n_layers * s.d_model**2)

    def contrast_band(self) -> float | None:
        if self.contrast is None:
            return None
        return self.contrast.tpp if self.contrast.tpp is not None else self.tpp[0]

    def smallest_size(self) -> SizeSpec:
        return min(self.sizes, key=lambda s: s.n_layers * s.d_model**2)

    def tau_for(self, tpp: float) -> float | TauPowerLaw:
        if isinstance(self.tau, TauPowerLaw):
            return self.tau
        return self.tau[0] if len(self.tau) == 1 else self.tau[self.tpp.index(tpp)]


# ----------------------------------------------------------------------------------- cluster
class ClusterSpec(_Spec):
    """Where the family trains: facts the layout, wall time and scheduler requests come from."""

    name: str
    executor: Literal["local", "slurm"] = "local"
    accelerator: Literal["cpu", "gpu"] = "cpu"
    # GPU clusters
    gpus_per_node: Annotated[int, Field(ge=0)] = 0
    gpu_mem_gb: Annotated[float, Field(ge=0)] = 0
    max_nodes: PositiveInt = 1
    cpus_per_gpu: PositiveInt = 8
    mem_per_gpu_gb: PositiveFloat = 64
    # layout search (collapse.parallel.choose_layout): link bandwidths of the throughput model,
    # the floors of data-parallel and overall efficiency (estimated speed over all GPUs at the
    # MFU: what GPU-hours a faster layout may cost), and whether the GPU nodes have
    # TransformerEngine (sequence parallelism needs its LayerNorm)
    tp_bandwidth_gbs: PositiveFloat = 300.0
    dp_bandwidth_gbs: PositiveFloat = 40.0
    min_dp_efficiency: Annotated[float, Field(gt=0, le=1)] = 0.8
    min_efficiency: Annotated[float, Field(gt=0, le=1)] = 0.6
    transformer_engine: bool = True
    # both: peak FLOP/s per device (a GPU, or the whole CPU machine) and assumed MFU
    peak_flops: PositiveFloat = 1.0e11
    mfu: Annotated[float, Field(gt=0, le=1)] = 0.3
    # CPU (local) runs
    procs_per_run: PositiveInt = 1
    # CPU runs over several nodes (Slurm): procs_per_run gloo processes split evenly over
    # nodes_per_run nodes, and tensor/pipeline-parallel degrees of a run (data parallel takes
    # the rest). On CPUs TP and PP bring no speed; they exercise the layouts a GPU cluster uses.
    nodes_per_run: PositiveInt = 1
    tp: PositiveInt = 1
    pp: PositiveInt = 1
    threads_per_proc: PositiveInt = 2
    mem_gb: PositiveFloat = 16
    # scheduler
    partition: str = ""
    account: str = ""
    runtime_margin: Annotated[float, Field(ge=1)] = 1.5  # requested time = estimate x margin
    min_runtime_min: PositiveInt = 10
    # time limits (collapse.segments): the partition's limit caps every job's request, and a
    # run longer than it trains in segments, one job each, chained in the workflow
    time_limit_min: float | None = None  # None: no limit (this machine)
    checkpoint_gb_per_s: PositiveFloat = 1.0  # write (and read) speed of the checkpoint disk
    job_startup_min: Annotated[float, Field(ge=0)] = 2.0  # job start to the first step
    # distributed timeouts (collapse.launch, collapse.train): how long the launchers of a
    # multi-node job wait for every node to join the rendezvous (torchrun's join_timeout), and
    # how long a rank waits in a collective for the others (init_process_group's timeout, as
    # Megatron-LM's --distributed-timeout-minutes) before the job fails instead of hanging
    rendezvous_timeout_s: PositiveInt = 300
    distributed_timeout_min: PositiveInt = 10

    @field_validator("time_limit_min")
    @classmethod
    def _positive_time_limit(cls, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise ValueError(
                f"the partition's time limit must be > 0 minutes, got {value:g}; set it to the "
                "partition's MaxTime in minutes (`sinfo -o '%P %l'` shows it), or remove the key "
                "for no limit"
            )
        return value

    @model_validator(mode="after")
    def _gpu_facts(self) -> ClusterSpec:
        if self.accelerator == "gpu" and (self.gpus_per_node < 1 or self.gpu_mem_gb <= 0):
            raise ValueError(
                "a GPU cluster needs gpus_per_node >= 1 and gpu_mem_gb > 0 "
                "(set them in config/cluster/<name>.yaml)"
            )
        if self.executor == "slurm" and not self.partition:
            raise ValueError("partition: a Slurm cluster needs a partition name")
        return self


class Config(_Spec):
    """The composed top-level config: one family on one cluster, outputs under ``results``."""

    family: FamilySpec
    cluster: ClusterSpec
    results: str = "results"


# ----------------------------------------------------------------------------- composition
def hydra_overrides(snakemake_config: dict[str, Any]) -> list[str]:
    """Hydra overrides from Snakemake's ``--config``: ``family=``, ``cluster=``, ``overrides=``.

    ``overrides`` is a list (``'overrides=["family.tpp=[10]"]'``) or a space-separated string.
    """
    out = []
    for group in ("family", "cluster", "faults"):
        if snakemake_config.get(group):
            out.append(f"{group}={snakemake_config[group]}")
    extra = snakemake_config.get("overrides") or []
    if isinstance(extra, str):
        extra = shlex.split(extra)
    out.extend(str(o) for o in extra)
    unknown = sorted(
        set(snakemake_config) - {"family", "cluster", "faults", "overrides", "results"}
    )
    if unknown:
        raise ConfigError(
            f"--config: unknown keys {unknown}; use family=NAME, cluster=NAME, faults=standard, "
            "results=DIR, or "
            "'overrides=[\"family.tpp=[10]\"]' for any other field"
        )
    if snakemake_config.get("results"):
        out.append(f"results={snakemake_config['results']}")
    return out


CONFIG_DIR_ENV = "COLLAPSE_CONFIG_DIR"


def default_config_dir() -> Path:
    """The config folder: ``$COLLAPSE_CONFIG_DIR``, else the working directory's ``config/``.

    Never the folder beside the installed package, so that a second checkout plans from its own
    configs."""
    given = os.environ.get(CONFIG_DIR_ENV)
    return Path(given) if given else Path.cwd() / "config"


def compose_config(overrides: list[str] = (), config_dir: Path | None = None) -> dict[str, Any]:
    """Compose ``config.yaml`` with its groups and ``overrides``; a plain resolved dict.

    The family's ``name`` must be its file's name: it names the results folder, so two files
    with one name would overwrite each other's plan."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf, open_dict

    config_dir = Path(config_dir) if config_dir is not None else default_config_dir()
    if not (config_dir / "config.yaml").is_file():
        raise ConfigError(
            f"config folder: no config.yaml in {config_dir}; run from the workflow's folder "
            f"(the one holding config/), pass --config-dir DIR or set {CONFIG_DIR_ENV}=DIR"
        )
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base=None):
            cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    except HydraException as err:
        raise ConfigError(_explain_hydra_error(err, config_dir)) from None
    except yaml.YAMLError as err:  # the message names the file, line and column
        raise ConfigError(f"config file is not valid YAML: {err}; fix the syntax there") from None
    finally:
        GlobalHydra.instance().clear()
    family_choice = cfg.hydra.runtime.choices.get("family")  # e.g. tiny, experiments/tiny_tpp5
    with open_dict(cfg):
        del cfg["hydra"]
    raw = OmegaConf.to_container(cfg, resolve=True)
    name = (raw.get("family") or {}).get("name")
    family_file = Path(family_choice).name if family_choice else None
    if family_file and name is not None and name != family_file:
        raise ConfigError(
            f"family.name: {name!r} differs from its file name {family_file!r} "
            f"({config_dir / 'family' / family_choice}.yaml); the name is the results folder, "
            f"so set name: {family_file} (for a variant, copy the file under a new name or pass "
            "results=DIR)"
        )
    return raw


def config_options(config_dir: Path, group: str) -> list[str]:
    """The names a config group offers, sub-folders included (``experiments/tiny_tpp5``)."""
    folder = config_dir / group
    return sorted(p.relative_to(folder).with_suffix("").as_posix() for p in folder.rglob("*.yaml"))


def _explain_hydra_error(err: Exception, config_dir: Path) -> str:
    text = str(err)
    for group in ("family", "cluster"):
        marker = f"'{group}/"
        if marker in text and "Could not find" in text:
            name = text.split(marker, 1)[1].split("'", 1)[0]
            options = config_options(config_dir, group)
            # a family moved into a sub-folder is suggested by its file name first
            moved = [o for o in options if o.rsplit("/", 1)[-1] == name]
            hint = f" (did you mean {moved[0]!r}?)" if moved else _did_you_mean(name, options)
            return (
                f"{group}: no config named {name!r}{hint}; "
                f"available: {', '.join(options)} (files in {config_dir / group})"
            )
    if text.startswith("Could not override '"):
        key = text.split("'", 2)[1]
        return (
            f"config overrides: {key}: not set in the composed YAML, so Hydra cannot override it; "
            f"to set a field the YAML leaves at its default, prefix it with '+' "
            f"(+{key}=VALUE); a misspelled field is then named with the valid keys"
        )
    return f"config overrides: {text.splitlines()[0]}"


def validate_config(raw: dict[str, Any]) -> Config:
    """Typed config from the composed dict, or ConfigError listing every problem with a fix."""
    try:
        return Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, raw)) from None


def load_config(overrides: list[str] = (), config_dir: Path | None = None) -> Config:
    return validate_config(compose_config(overrides, config_dir))


# ------------------------------------------------------------------------------ messages
def _did_you_mean(word: str, choices) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _model_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that owns the last key of ``loc`` (for unknown-key hints)."""
    import typing

    current: Any = model
    for key in loc[:-1]:
        if isinstance(key, int) or not (
            isinstance(current, type) and issubclass(current, BaseModel)
        ):
            if isinstance(key, int):
                continue
            return None
        field = current.model_fields.get(key)
        if field is None:
            return None
        current = _unwrap(field.annotation, typing)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unwrap(annotation: Any, typing) -> Any:
    """The model class inside list[...], X | None, Annotated[...]."""
    origin = typing.get_origin(annotation)
    if origin is None:
        return annotation
    for arg in typing.get_args(annotation):
        inner = _unwrap(arg, typing)
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner
    return annotation


def format_validation_error(err: ValidationError, raw: dict[str, Any]) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        where = _format_loc(loc, raw)
        if e["type"] == "extra_forbidden":
            owner = _model_at(Config, loc)
            known = sorted(owner.model_fields) if owner else []
            hint = _did_you_mean(loc[-1], known)
            fix = f"remove it{hint}" + (f"; valid keys: {', '.join(known)}" if known else "")
            lines.append(f"{where}: unknown key; {fix}")
        elif e["type"] == "missing":
            lines.append(f"{where}: required field is missing; add it to the family/cluster yaml")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            value = e.get("input")
            shown = "" if isinstance(value, dict | list) else f" (got {value!r})"
            lines.append(f"{where}: {msg}{shown}")
    return "invalid config:\n  " + "\n  ".join(lines)


def _format_loc(loc: tuple, raw: dict[str, Any]) -> str:
    """``family.sizes[2](d96).d_model``: indices shown with the size/sweep name when known."""
    parts, node = [], raw
    for key in loc:
        if isinstance(key, int):
            name = (
                node[key].get("name")
                if isinstance(node, list) and isinstance(node[key], dict)
                else None
            )
            parts[-1] += f"[{key}]" + (f"({name})" if name else "")
        elif key in ("function-after", "function-before") or "[" in str(key):
            continue
        else:
            parts.append(str(key))
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            node = None
    return ".".join(parts)
