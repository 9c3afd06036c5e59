"""The run spec: the one contract between the plan and a training job.

The planner derives every hyperparameter once and writes one ``RunSpec`` JSON per run
(``results/<family>/plan/runs/<run>.json``). The training job, the monitor and the evaluation
read only this file (plus the dataset it names): nothing downstream recomputes a scaling rule.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from collapse.roles import Role


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelArch(_Strict):
    """Architecture of one size (Megatron-Core GPTModel)."""

    d_model: int
    n_layers: int
    n_heads: int
    head_dim: int
    ffn_hidden: int
    activation: Literal["gelu", "squared_relu", "swiglu"]
    positions: Literal["rope", "alibi", "learned"]
    vocab_size: int
    seq_len: int
    tied_embeddings: bool
    norm_eps: float = 1e-5


class Parameterization(_Strict):
    """µP / CompleteP multipliers, per-group learning rates and init stds, already resolved.

    Source: docs/method.md §7 (Cerebras µP), CompleteP for depth (Dey et al. 2025).
    """

    kind: Literal["mup", "completep", "sp"]
    d_base: int
    depth_base: int
    width_mult: float  # m_d = d_model / d_base
    depth_mult: float  # m_L = n_layers / depth_base (1 when not CompleteP)
    alpha_input: float  # embedding output multiplier
    logit_multiplier: float  # alpha_output / m_d
    residual_multiplier: float  # CompleteP (L_base/L)^alpha, 1.0 otherwise
    attention_scale: float  # softmax scale: 1/d_head under µP
    init_std_embedding: float
    init_std_hidden: float
    init_std_output_proj: float
    init_std_unembedding: float
    lr_embedding: float
    lr_hidden: float  # the µP-adjusted peak LR eta used for tau
    lr_output_proj: float
    lr_unembedding: float
    lr_norm_bias: float
    # weight decay multipliers of the (un)embedding (embedding_decay: 1 coupled, else
    # lr_hidden / lr_embedding); hidden matrices and output projections have 1, norms/biases 0
    wd_mult_embedding: float = 1.0
    wd_mult_unembedding: float = 1.0
    adam_beta1: float
    adam_beta2: float
    adam_eps: float


class Optimization(_Strict):
    """AdamW, schedule and the length of the run."""

    seed: int
    tokens: int  # D, realized after rounding to whole steps
    batch_seqs: int  # global batch B in sequences
    steps: int  # T
    warmup_steps: int
    lr_peak: float  # = Parameterization.lr_hidden
    weight_decay: float  # lambda, from tau = B / (eta * lambda * D)
    tau: float  # realized tau (fraction of training)
    schedule: Literal["linear_d2z"] = "linear_d2z"
    grad_clip: float = 1.0
    stop_fraction: float = 1.0  # sweeps stop early but keep the full-length schedule


class Parallelism(_Strict):
    tp: int
    pp: int
    dp: int
    micro_batch_seqs: int
    grad_accum: int  # batch_seqs = micro_batch_seqs * grad_accum * dp
    gpus: int  # 0 on the CPU cluster: one gloo process per tp*pp*dp rank
    nodes: int
    procs_per_node: int
    # Megatron's TransformerConfig: sequence_parallel, and recompute_granularity (selective:
    # the core attention; full: every layer, recompute_method uniform, one layer per checkpoint)
    sequence_parallel: bool = False
    recompute: Literal["none", "selective", "full"] = "none"


class Resources(_Strict):
    """What the scheduler is asked for (Snakemake resources / Slurm)."""

    threads: int
    mem_mb: int
    gpus_per_node: int
    nodes: int
    runtime_min: int
    slurm_partition: str = ""
    slurm_account: str = ""
    # time limits (collapse.segments): jobs the run trains in, when each stops, a save's cost
    segments: int = 1
    exit_duration_min: float = 0.0  # 0: no stop by time
    checkpoint_save_min: float = 0.0
    # distributed timeouts (the cluster's rendezvous_timeout_s, distributed_timeout_min)
    rendezvous_timeout_s: int = 300
    distributed_timeout_min: int = 10

    @model_serializer(mode="wrap")
    def _omit_default_timeouts(self, handler):
        """Timeouts left at their defaults serialize as before they were fields, so that a
        spec's hash (the rerun trigger) does not change and finished runs are not retrained."""
        out = handler(self)
        for field in ("rendezvous_timeout_s", "distributed_timeout_min"):
            if out.get(field) == type(self).model_fields[field].default:
                out.pop(field)
        return out


class Logging(_Strict):
    log_every_steps: int
    eval_every_steps: int
    eval_batches: int
    checkpoint_every_steps: int
    keep_checkpoints: int = 2
    tensorboard: bool = True  # event files under results/<family>/tensorboard/<run>
    wandb: bool = False  # an offline W&B run under results/<family>/wandb

    @model_serializer(mode="wrap")
    def _omit_default_tracking(self, handler):
        """A spec that leaves tracking at its defaults serializes as before these were fields,
        so that its hash (the workflow's rerun trigger) stays that of a spec written before."""
        out = handler(self)
        if self.tensorboard:
            out.pop("tensorboard", None)
        if not self.wandb:
            out.pop("wandb", None)
        return out


class Monitor(_Strict):
    """Online collapse monitor; inactive for the reference sizes themselves."""

    enabled: bool = False
    reference_csv: str = ""
    every_steps: int = 0
    threshold: float = 0.0
    stop_on_alarm: bool = False


class FaultInjection(_Strict):
    """Off by default; the fault-detection experiment (collapse.faults.Faults) turns it on.

    ``wrong_tau`` is realized by the plan (the weight decay in ``optim``); training ignores it.
    ``name`` labels the experiment's runs ("clean" for its clean seeds).
    """

    kind: Literal[
        "none", "loss_bias", "loss_kernel", "lr_spike", "data_repeat", "nan_loss", "wrong_tau"
    ] = "none"
    at_fraction: float = 0.0
    magnitude: float = 0.0
    name: str = ""


class RunSpec(_Strict):
    run: str
    family: str
    size: str
    tpp_band: float  # the requested TPP
    tpp: float  # realized TPP = tokens / params
    role: Role = Role.FAMILY
    sweep: str = ""
    variant: dict[str, float] = Field(default_factory=dict)
    params: int  # N, all parameters, embeddings included
    params_non_embedding: int
    flops_6nd: float
    flops: float  # Table 9 accounting
    dataset_prefix: str  # Megatron indexed dataset prefix (train split)
    valid_prefix: str  # held-out split
    tokenizer: str  # tokenizer file (EOD token id is always 0)
    run_dir: str  # declared outputs: curve.parquet, valid.parquet, meta.json, monitor.jsonl
    checkpoint_dir: str  # outside the declared outputs, so a rerun resumes
    model: ModelArch
    mup: Parameterization
    optim: Optimization
    parallel: Parallelism
    resources: Resources
    logging: Logging
    monitor: Monitor = Field(default_factory=Monitor)
    fault: FaultInjection = Field(default_factory=FaultInjection)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"

    def trajectory_key(self) -> str:
        """What decides the weights at every step: the model, its parameterization, AdamW and
        its schedule, the seed, an injected fault. Not where a run stops, its layout, logging
        or paths, which a resumed run may change; a checkpoint of another trajectory is not
        resumed (collapse.train.resume)."""
        decides = self.model_dump(mode="json", include={"model", "mup", "optim", "fault"})
        decides["optim"].pop("stop_fraction")
        return json.dumps(decides, sort_keys=True)

    def outputs_key(self) -> str:
        """What decides everything a run writes, step for step: two specs with one key are the
        same run under two names (a sweep's variant at the family's own tau and seed), which
        the plan trains once (plan column ``same_as``)."""
        decides = self.model_dump(
            mode="json",
            include={
                "model", "mup", "optim", "parallel", "logging", "fault", "dataset_prefix",
                "valid_prefix", "tokenizer",
            },
        )  # fmt: skip
        decides["stops_on_alarm"] = self.monitor.enabled and self.monitor.stop_on_alarm
        return json.dumps(decides, sort_keys=True)

    def prefix_key(self) -> str:
        """``outputs_key`` without where the run stops: two specs with one key write the same
        steps as far as the shorter goes (the schedule is the full run's either way), so a run
        stopped early is the first part of the longer one."""
        decides = json.loads(self.outputs_key())
        decides["optim"].pop("stop_fraction")
        return json.dumps(decides, sort_keys=True)

    @classmethod
    def load(cls, path: str | Path) -> RunSpec:
        return cls.model_validate_json(Path(path).read_text())


def spec_hash(spec: RunSpec) -> str:
    """Content hash of a spec: the workflow's rerun trigger and the run's identity in its
    checkpoints and meta.json."""
    return hashlib.sha256(spec.to_json().encode()).hexdigest()[:16]


def write_if_changed(path: Path, text: str) -> bool:
    """Write ``text`` unless the file already holds it, so unchanged runs never rerun."""
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return True
