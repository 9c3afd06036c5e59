"""The compute plan: every run of a family with all its hyperparameters, resolved once.

``plan_family`` is pure: from a validated ``Config`` it derives one ``RunSpec`` per run (size x
TPP band x seed, and each sweep variant) with the scaling rules of ``collapse.scaling``, the FLOPs
of ``collapse.flops`` and the layout of ``collapse.parallel``. ``write_plan`` writes the spec files
(only those whose content changed; the workflow writes each in a job of its own instead),
``runs.csv`` and a report.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from collapse import flops as flops_rules
from collapse import parallel, scaling
from collapse.config import (
    ClusterSpec,
    Config,
    ConfigError,
    FamilySpec,
    HeldDecay,
    ParameterizationSpec,
    SizeSpec,
    SweepSpec,
    TauPowerLaw,
    load_config,
)
from collapse.data import DataConfig
from collapse.layout import FamilyLayout
from collapse.runspec import (
    FaultInjection,
    Logging,
    ModelArch,
    Monitor,
    Optimization,
    Parallelism,
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

    def run_names(self, role: str | None = None) -> list[str]:
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
        return corpus + resource_warnings(self.table, self.config.cluster)


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
    need = by_size.memory_gb * cluster.procs_per_run
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


def run_name(size: str, tpp: float, seed: int) -> str:
    return f"{size}-tpp{tpp:g}-s{seed}"


def sweep_run_name(sweep: SweepSpec, size: str, variant: dict[str, float]) -> str:
    values = "-".join(f"{k}{v:.4g}" for k, v in sorted(variant.items()))
    return f"sweep-{sweep.name}-{size}-{values}-s{sweep.seed}"


def sweep_reference_name(sweep: SweepSpec, size: str, tau: float) -> str:
    return f"sweepref-{sweep.name}-{size}-tau{tau:.4g}-s{sweep.seed}"


def fault_run_name(fault: str, size: str, seed: int) -> str:
    return f"fault-{fault}-{size}-s{seed}"


def reference_csv(layout: FamilyLayout, tpp: float) -> Path:
    return layout.reference_dir / f"tpp{tpp:g}" / "reference.csv"


# ---------------------------------------------------------------------------------- planning
def architecture(family: FamilySpec, size: SizeSpec) -> ModelArch:
    a = family.arch
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


def target_tau(family: FamilySpec, tpp: float) -> float:
    rule = family.tau_for(tpp)
    if isinstance(rule, TauPowerLaw):
        return rule.scale * scaling.tau_power_law(tpp, rule.coef, rule.exponent)
    return rule


def plan_run(
    cfg: Config,
    size: SizeSpec,
    tpp: float,
    seed: int,
    *,
    corpus_tokens: int,
    sweep: SweepSpec | None = None,
    variant: dict[str, float] | None = None,
    role: str | None = None,
    fault: FaultInjection | None = None,
) -> tuple[RunSpec, dict]:
    """One run's spec plus the plan-only facts (wall time, memory, epochs) for runs.csv."""
    family, cluster = cfg.family, cfg.cluster
    layout = FamilyLayout.of(family.name, cfg.results)
    variant = dict(variant or {})
    arch = architecture(family, size)
    count = scaling.param_count(arch)
    tpp_params = count.total if family.tpp_counts == "all" else count.non_embedding
    target_tokens = scaling.tokens_for_tpp(tpp, tpp_params)

    if "batch_seqs" in variant:
        batch_seqs = int(variant["batch_seqs"])
    elif family.batch.rule == "table":
        batch_seqs = size.batch_seqs
    else:
        b = family.batch
        batch_seqs = max(
            b.min_seqs,
            scaling.batch_seqs_power_law(
                target_tokens, b.coef, b.exponent, arch.seq_len, b.multiple_of
            ),
        )
    steps = scaling.steps_for(target_tokens, batch_seqs, arch.seq_len)
    tokens = scaling.realized_tokens(steps, batch_seqs, arch.seq_len)
    batch_tokens = batch_seqs * arch.seq_len

    p = family.parameterization
    eta_base = variant.get("eta_base", p.eta_base)
    if "lr_peak" in variant:  # the hidden-layer LR is set; the base LR follows
        eta_base = variant["lr_peak"] * eta_base / parameterize(arch, p, eta_base).lr_hidden
    mup = parameterize(arch, p, eta_base)
    eta = mup.lr_hidden
    if "weight_decay" in variant:
        weight_decay = variant["weight_decay"]
    elif family.weight_decay is not None:  # the contrast recipe: lambda fixed, tau drifts
        weight_decay = family.weight_decay
    else:
        tau_goal = variant.get("tau", target_tau(family, tpp))
        weight_decay = scaling.weight_decay_for_tau(tau_goal, eta, batch_tokens, tokens)
    tau = scaling.tau_of(eta, weight_decay, batch_tokens, tokens)
    warmup = scaling.warmup_steps(
        steps,
        fraction=family.schedule.warmup_fraction,
        max_tokens=family.schedule.warmup_max_tokens,
        batch_tokens=batch_tokens,
    )
    flops_6nd = flops_rules.flops_6nd(count.total, tokens)
    flops = flops_rules.flops_table9(arch, count.total, tokens)

    t = family.training
    if cluster.accelerator == "gpu":
        lay = parallel.choose_layout(
            arch,
            count.total,
            batch_seqs=batch_seqs,
            gpus_per_node=cluster.gpus_per_node,
            gpu_mem_bytes=int(cluster.gpu_mem_gb * 2**30),
            max_nodes=cluster.max_nodes,
            max_micro_batch=t.max_micro_batch_seqs,
        )
        wall_hours = parallel.wall_time_hours(flops, lay.gpus, cluster.peak_flops, cluster.mfu)
        gpu_hours = parallel.gpu_hours(flops, cluster.peak_flops, cluster.mfu)
        threads = cluster.cpus_per_gpu * lay.procs_per_node
        mem_mb = int(cluster.mem_per_gpu_gb * 1024 * lay.procs_per_node)
        gpus_per_node = lay.procs_per_node
    else:
        lay = parallel.cpu_layout(
            arch,
            count.total,
            batch_seqs=batch_seqs,
            procs=cluster.procs_per_run,
            max_micro_batch=t.max_micro_batch_seqs,
        )
        wall_hours = flops / (cluster.peak_flops * cluster.mfu) / 3600
        gpu_hours = 0.0
        threads = cluster.threads_per_proc * cluster.procs_per_run
        mem_mb = int(cluster.mem_gb * 1024)
        gpus_per_node = 0

    role = role or ("family" if sweep is None else "sweep")
    stop_fraction = 1.0
    if role == "sweep" and not sweep.validate_full:
        stop_fraction = max([sweep.fraction, *sweep.fractions])
    wall_hours_run = wall_hours * stop_fraction
    runtime_min = max(
        cluster.min_runtime_min, math.ceil(wall_hours_run * 60 * cluster.runtime_margin)
    )
    is_reference = (
        size.name in family.reference.sizes and sweep is None and role not in ("fault", "contrast")
    )
    monitored = family.gates.monitor and not is_reference and sweep is None and role != "contrast"
    if role == "family":
        name = run_name(size.name, tpp, seed)
    elif role == "sweep":
        name = sweep_run_name(sweep, size.name, variant)
    elif role == "fault":
        name = fault_run_name(fault.name, size.name, seed)
    elif role == "contrast":
        name = f"contrast-{run_name(size.name, tpp, seed)}"
    else:
        name = sweep_reference_name(sweep, size.name, tau)
    every = lambda fraction: max(1, round(steps * fraction))  # noqa: E731

    spec = RunSpec(
        run=name,
        family=family.name,
        size=size.name,
        tpp_band=tpp,
        tpp=tokens / tpp_params,
        role=role,
        sweep="" if sweep is None else sweep.name,
        variant=variant,
        params=count.total,
        params_non_embedding=count.non_embedding,
        flops_6nd=flops_6nd,
        flops=flops,
        dataset_prefix=str(layout.train_prefix),
        valid_prefix=str(layout.valid_prefix),
        tokenizer=str(layout.tokenizer),
        run_dir=str(layout.run_dir(name)),
        checkpoint_dir=str(layout.checkpoints(name)),
        model=arch,
        mup=mup,
        optim=Optimization(
            seed=seed,
            tokens=tokens,
            batch_seqs=batch_seqs,
            steps=steps,
            warmup_steps=warmup,
            lr_peak=eta,
            weight_decay=weight_decay,
            tau=tau,
            grad_clip=t.grad_clip,
            stop_fraction=stop_fraction,
        ),
        parallel=Parallelism(
            tp=lay.tp,
            pp=lay.pp,
            dp=lay.dp,
            micro_batch_seqs=lay.micro_batch_seqs,
            grad_accum=lay.grad_accum,
            gpus=lay.gpus,
            nodes=lay.nodes,
            procs_per_node=lay.procs_per_node,
        ),
        resources=Resources(
            threads=threads,
            mem_mb=mem_mb,
            gpus_per_node=gpus_per_node,
            nodes=lay.nodes,
            runtime_min=runtime_min,
            slurm_partition=cluster.partition,
            slurm_account=cluster.account,
        ),
        logging=Logging(
            log_every_steps=min(t.log_every_steps, max(1, steps // 10)),
            eval_every_steps=every(t.eval_every_fraction),
            eval_batches=t.eval_batches,
            checkpoint_every_steps=every(t.checkpoint_every_fraction),
            keep_checkpoints=t.keep_checkpoints,
        ),
        monitor=Monitor(
            enabled=monitored,
            reference_csv=str(layout.monitor_reference(name)) if monitored else "",
            every_steps=every(family.gates.monitor_every_fraction) if monitored else 0,
            stop_on_alarm=family.gates.stop_on_alarm,
        ),
        fault=fault or FaultInjection(),
    )
    facts = {
        "wall_hours": wall_hours_run,
        "gpu_hours": gpu_hours * stop_fraction,
        "epochs": tokens * stop_fraction / corpus_tokens if corpus_tokens else float("nan"),
        "memory_gb_per_gpu": (lay.memory.total / 2**30) if lay.memory is not None else 0.0,
        "is_reference": is_reference,
        "monitored": monitored,
        "fault": spec.fault.name if role == "fault" else "",
    }
    return spec, facts


def parameterize(arch: ModelArch, p: ParameterizationSpec, eta_base: float):
    """µP/CompleteP of one size from the family's parameterization block and a base LR."""
    return scaling.mup_parameterization(
        arch,
        kind=p.kind,
        d_base=p.d_base,
        depth_base=p.depth_base,
        sigma_base=p.sigma_base,
        eta_base=eta_base,
        alpha_input=p.alpha_input,
        alpha_output=p.alpha_output,
        beta1=p.beta1,
        beta2=p.beta2,
        eps=p.eps,
        completep_alpha=p.completep_alpha,
        embedding_decay=p.embedding_decay,
    )


def sweep_variants(sweep: SweepSpec) -> list[dict[str, float]]:
    keys = sorted(sweep.grid)
    return [
        dict(zip(keys, values, strict=True))
        for values in itertools.product(*(sweep.grid[k] for k in keys))
    ]


def plan_family(cfg: Config, corpus_tokens: int | None = None) -> Plan:
    """Every run of the family; ConfigError (naming the size) when a run cannot be laid out."""
    from collapse.data import estimate_corpus_tokens

    family = cfg.family
    layout = FamilyLayout.of(family.name, cfg.results)
    corpus_unknown = ""
    if corpus_tokens is None:
        try:
            corpus_tokens = estimate_corpus_tokens(family.data, layout.data_dir)
        except ValueError as err:  # a streamed source of unknown size, a package not installed
            corpus_tokens, corpus_unknown = 0, str(err)
    runs, rows = [], []
    family_runs: dict[str, str] = {}  # outputs key -> family run

    def add(spec: RunSpec, facts: dict) -> None:
        key = spec.outputs_key()
        same_as = ""
        if spec.role == "family":
            family_runs.setdefault(key, spec.run)
        elif spec.role in ("sweep", "sweep_reference"):
            same_as = family_runs.get(key, "")
        runs.append(spec)
        rows.append(_row(spec, facts | {"same_as": same_as}))

    try:
        for tpp in family.tpp:
            for size in family.sizes:
                seeds = (
                    family.reference.seeds if size.name in family.reference.sizes else family.seeds
                )
                for seed in seeds:
                    add(*plan_run(cfg, size, tpp, seed, corpus_tokens=corpus_tokens))
        for sweep in family.sweeps:
            size = family.size(sweep.size)
            tpp = sweep.tpp if sweep.tpp is not None else family.tpp[0]
            ref_size = family.size(sweep.reference_size or family.reference.sizes[0])
            taus = {}
            for variant in sweep_variants(sweep):
                spec, facts = plan_run(
                    cfg, size, tpp, sweep.seed, corpus_tokens=corpus_tokens, sweep=sweep,
                    variant=variant,
                )  # fmt: skip
                add(spec, facts)
                taus.setdefault(round(spec.optim.tau, 4), spec.optim.tau)
            for tau in taus.values():  # one small full-length run per control (tau) of the grid
                add(
                    *plan_run(
                        cfg,
                        ref_size,
                        tpp,
                        sweep.seed,
                        corpus_tokens=corpus_tokens,
                        sweep=sweep,
                        variant={"tau": tau},
                        role="sweep_reference",
                    )  # fmt: skip
                )
        for spec, facts in plan_fault_experiment(cfg, corpus_tokens):
            add(spec, facts)
        for spec, facts in plan_contrast(cfg, corpus_tokens):
            add(spec, facts)
    except parallel.LayoutError as err:
        raise ConfigError(f"cluster {cfg.cluster.name!r}: {err}") from None
    _check_ranges(runs)
    table = pd.DataFrame(rows, columns=RUNS_COLUMNS)
    return Plan(config=cfg, runs=tuple(runs), table=table, corpus_unknown=corpus_unknown)


def inherited_weight_decay(smallest: Optimization, own: Optimization, holds: HeldDecay) -> float:
    """The lambda a size gets when its weight decay is taken over from the smallest size instead
    of solved from tau: lambda itself (``weight_decay``) or the AdamW shrink per step eta * lambda
    (``decay_per_step``, as one LR and one lambda for every size apply it)."""
    if holds == "decay_per_step":
        return smallest.lr_peak * smallest.weight_decay / own.lr_peak
    return smallest.weight_decay


def plan_fault_experiment(cfg: Config, corpus_tokens: int) -> list[tuple[RunSpec, dict]]:
    """The fault-detection experiment: each injected fault in one size (default: the largest),
    seed 0 (the family's own run of that size is its clean twin), plus clean seeds of that size
    the family does not train already. wrong_tau keeps the smallest size's eta*lambda or lambda."""
    family = cfg.family
    spec = family.faults
    if spec is None:
        return []
    size = family.fault_size()
    tpp = spec.tpp if spec.tpp is not None else family.tpp[0]
    out = []
    own_seeds = family.reference.seeds if size.name in family.reference.sizes else family.seeds
    for seed in spec.clean_seeds:
        if seed not in own_seeds:
            clean = FaultInjection(name="clean")
            out.append(
                plan_run(
                    cfg, size, tpp, seed, corpus_tokens=corpus_tokens, role="fault", fault=clean
                )
            )
    smallest = family.smallest_size()
    for injection in spec.injections:
        at = injection.at_fraction if injection.at_fraction is not None else spec.at_fraction
        fault = FaultInjection(
            kind=injection.kind,
            at_fraction=0.0 if injection.kind == "wrong_tau" else at,
            magnitude=injection.magnitude,
            name=injection.name,
        )
        variant = {}
        if injection.kind == "wrong_tau":  # the smallest size's decay, not rescaled
            small, _ = plan_run(cfg, smallest, tpp, 0, corpus_tokens=corpus_tokens)
            own, _ = plan_run(cfg, size, tpp, 0, corpus_tokens=corpus_tokens)
            variant = {
                "weight_decay": inherited_weight_decay(small.optim, own.optim, injection.holds)
            }
        out.append(
            plan_run(
                cfg,
                size,
                tpp,
                0,
                corpus_tokens=corpus_tokens,
                role="fault",
                fault=fault,
                variant=variant,
            )  # fmt: skip
        )
    return out


def plan_contrast(cfg: Config, corpus_tokens: int) -> list[tuple[RunSpec, dict]]:
    """The contrast (family.contrast): the family's runs of its band again, each size with the
    weight decay the smallest size's would give it (``contrast.holds``: eta * lambda or lambda),
    so tau is not held fixed. The smallest size's runs already have it: the contrast uses the
    family's own (contrast_members), it plans no twins."""
    family = cfg.family
    band = family.contrast_band()
    if band is None:
        return []
    smallest = family.smallest_size()
    small, _ = plan_run(cfg, smallest, band, 0, corpus_tokens=corpus_tokens)
    out = []
    chosen = family.contrast.sizes or [s.name for s in family.sizes if s.name != smallest.name]
    for size in (s for s in family.sizes if s.name in chosen):
        own, _ = plan_run(cfg, size, band, 0, corpus_tokens=corpus_tokens)
        decay = inherited_weight_decay(small.optim, own.optim, family.contrast.holds)
        seeds = family.contrast.seeds or (
            family.reference.seeds if size.name in family.reference.sizes else family.seeds
        )
        for seed in seeds:
            out.append(
                plan_run(
                    cfg,
                    size,
                    band,
                    seed,
                    corpus_tokens=corpus_tokens,
                    role="contrast",
                    variant={"weight_decay": decay},
                )  # fmt: skip
            )
    return out


def contrast_members(table: pd.DataFrame) -> pd.DataFrame:
    """The rows of the runs the contrast is measured on (a plan table or runs.csv): the family's
    runs of the smallest size in the contrast's band (its lambda is the contrast's already), then
    the contrast's own runs. Empty for a family without a contrast."""
    own = table[table.role == "contrast"]
    if own.empty:
        return own
    family = table[(table.role == "family") & (table.tpp_band == own.tpp_band.iloc[0])]
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
        "epochs",
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
        f"- runs: {len(t)} ({(t.role == 'family').sum()} family, "
        f"{t.role.isin(['sweep', 'sweep_reference']).sum()} sweep, "
        f"{(t.role == 'fault').sum()} fault experiment, {(t.role == 'contrast').sum()} contrast)"
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
    if warnings := plan.warnings():
        lines += ["## Warnings", "", *(f"- {w}" for w in warnings), ""]
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fam = table[table.role == "family"].groupby("size", sort=False).first().reset_index()
    fam = fam.sort_values("params")
    hours_col = "gpu_hours" if fam["gpu_hours"].sum() > 0 else "wall_hours"
    panels = [
        ("tokens", "training tokens"),
        ("flops", "training FLOPs (Table 9)"),
        (hours_col, "GPU-hours" if hours_col == "gpu_hours" else "CPU wall-hours"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8), constrained_layout=True)
    for ax, (col, label) in zip(axes, panels, strict=True):
        for band, rows in table[table.role == "family"].groupby("tpp_band"):
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
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------- CLI
def add_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="validate a family spec and write its compute plan",
        description="Compose the family and cluster configs (Hydra), validate them, derive every "
        "run's hyperparameters and write results/<family>/plan/: one spec per run, runs.csv, "
        "report.md and plan.png. Nothing is written when the spec is invalid.",
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
