"""Compose and validate the family spec once, plan it in memory, and name every output.

The plan is computed at parse time (pure functions, fast) so the DAG has its real shape in a dry
run; a bad spec stops here, before any job, with a message naming the field and the fix.
"""

import hashlib
import math
import os
import re
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

from collapse.config import CONFIG_DIR_ENV, ConfigError, hydra_overrides, load_config
from collapse.data import stage_outputs
from collapse.jobs import ResourceError, data_requests, eval_request
from collapse.shards import shard_markers
from collapse.launch import slurm_resources, train_command
from collapse.plan import contrast_members, plan_family, reference_csv
from collapse.roles import Role
from collapse.runspec import spec_hash
from collapse.segments import marker_path


envvars:
    "PATH",


# Jobs call `collapse`, `python` and `torchrun`: those of the environment running Snakemake,
# also when it was started as .venv/bin/snakemake without activating the venv.
os.environ["PATH"] = os.pathsep.join(
    [os.path.dirname(sys.executable), os.environ["PATH"]]
)

# The workflow's own config/ (or $COLLAPSE_CONFIG_DIR), whatever the working directory; its
# jobs' `collapse` calls inherit it.
os.environ.setdefault(CONFIG_DIR_ENV, str(Path(workflow.basedir) / "config"))

try:
    OVERRIDES = hydra_overrides(config)
    PLAN = plan_family(load_config(OVERRIDES))
except ConfigError as err:
    raise WorkflowError(str(err)) from None
# What the plan allows but the user should know (e.g. a size that repeats the corpus); the plan
# report lists them too.
# Printed by the process the user started, not again by each job's own Snakemake (Slurm).
if workflow.is_main_process:
    for warning in PLAN.warnings():
        print(f"warning: {warning}", file=sys.stderr)

CFG = PLAN.config

# A partition, account or node count the Slurm cluster would refuse, or leave pending for ever,
# stops the workflow here, before any submission (collapse.slurm_check).
if CFG.cluster.executor == "slurm" and workflow.is_main_process:
    from collapse.slurm_check import check_requests

    SLURM_PROBLEMS = check_requests(
        CFG.cluster.partition,
        CFG.cluster.account,
        [(r.run, r.parallel.nodes) for r in PLAN.runs],
    )
    if SLURM_PROBLEMS:
        raise WorkflowError(
            "Slurm would not run this plan's jobs:\n  " + "\n  ".join(SLURM_PROBLEMS)
        )
FAMILY = CFG.family
LAYOUT = PLAN.layout
ROOT = str(LAYOUT.root)
TPP_BANDS = [f"{b:g}" for b in FAMILY.tpp]
FAMILY_RUNS = PLAN.run_names(Role.FAMILY)
SWEEP_RUNS = PLAN.run_names(Role.SWEEP)
SWEEPS = [s.name for s in FAMILY.sweeps]
# sweep run -> the family run it duplicates (trained once, rule share_run)
SHARED_RUNS = PLAN.shared_runs()
FAULTS_ON = FAMILY.faults is not None
CONTRAST_ON = FAMILY.contrast is not None
CONTRAST_BAND = f"{FAMILY.contrast_band():g}" if CONTRAST_ON else ""
CONTRAST_ROOT = str(LAYOUT.contrast_dir)
CONTRAST_TABLE = contrast_members(PLAN.table)  # its own runs and the shared family runs
CONTRAST_RUNS = list(CONTRAST_TABLE.run)
PLAN_OUT = str(LAYOUT.plan_dir)
# What the data rules write and a training job reads (by kind of data source).
DATA_FILES = stage_outputs(FAMILY.data, LAYOUT.data_dir)
# The plan reruns when the resolved config or a spec changes (not when an estimate does).
PLAN_SHA = hashlib.sha256(
    (CFG.model_dump_json() + "".join(r.to_json() for r in PLAN.runs)).encode()
).hexdigest()[:16]


wildcard_constraints:
    run="[A-Za-z0-9][A-Za-z0-9._-]*",
    band="[0-9.]+",
    sweep="[A-Za-z0-9-]+",


def spec_of(wildcards):
    return PLAN.spec(wildcards.run)


def spec_json(wildcards):
    """A run's spec as its file holds it: the spec job's param, so its rerun trigger."""
    return PLAN.spec(wildcards.run).to_json()


def spec_sha(wildcards):
    """Content hash of a run's spec: its training's rerun trigger (and meta.json's spec_hash)."""
    return spec_hash(PLAN.spec(wildcards.run))


def runs_in_band(band, *, reference_only=False):
    rows = PLAN.table[
        (PLAN.table.role == Role.FAMILY) & (PLAN.table.tpp_band == float(band))
    ]
    if reference_only:
        rows = rows[rows.is_reference]
    return list(rows.run)


def contrast_runs(*, reference_only=False):
    """The contrast's runs (one band, the smallest size's shared with the family); of the
    reference sizes only, if asked."""
    rows = CONTRAST_TABLE
    if reference_only:
        rows = rows[rows["size"].isin(FAMILY.reference.sizes)]
    return list(rows.run)


def curve(run):
    return str(LAYOUT.curve(run))


def train_inputs(wildcards):
    """The spec (rewritten only when it changes), the dataset and, when monitored, the reference."""
    spec = spec_of(wildcards)
    inputs = {
        "spec": str(LAYOUT.spec(wildcards.run)),
        "data": DATA_FILES["train_inputs"],
    }
    # The run's own copy of its reference (the monitor_reference job) must exist, not be older:
    # the monitor never changes the curve (unless stop_on_alarm), so neither a rebuilt nor a
    # removed family reference retrains a finished run.
    if spec.monitor.enabled:
        inputs["reference"] = ancient(spec.monitor.reference_csv)
    if previous := previous_segment(wildcards):
        inputs["segment"] = previous
    return inputs


# Runs longer than the cluster's time limit, by their number of jobs (collapse.segments):
# segment k < n is rule train_segment, the last one the run's train job; each needs the last.
SEGMENTS = {r.run: r.resources.segments for r in PLAN.runs if r.resources.segments > 1}


def previous_segment(wildcards):
    """The marker of the segment before this job's, or None (a first segment, or a run in one)."""
    k = int(getattr(wildcards, "segment", SEGMENTS.get(wildcards.run, 1)))
    return str(marker_path(LAYOUT.run_dir(wildcards.run), k - 1)) if k > 1 else None


def last_segment(wildcards):
    """The segment a run's train job trains: its last, or None for a run in one job."""
    return SEGMENTS.get(wildcards.run)


def monitor_reference_inputs(wildcards):
    """The run's spec (a changed spec copies the reference again, after it is rebuilt) and its
    band's reference, which must only exist (a rebuild alone leaves the copy as the run saw it).
    """
    reference = spec_reference(wildcards.run)
    return {
        "spec": str(LAYOUT.spec(wildcards.run)),
        "reference": ancient(reference),
        "summary": ancient(str(Path(reference).with_name("reference.json"))),
    }


def spec_reference(run):
    """The reference.csv a run is monitored and gated against (its band's)."""
    return str(reference_csv(LAYOUT, PLAN.spec(run).tpp_band))


def detect_runs():
    """The fault runs plus the family's own runs of the faulted size among the clean seeds."""
    if not FAULTS_ON:
        return []
    spec = FAMILY.faults
    band = spec.tpp if spec.tpp is not None else FAMILY.tpp[0]
    t = PLAN.table
    own = t[
        (t.role == Role.FAMILY)
        & (t["size"] == FAMILY.fault_size().name)
        & (t.tpp_band == band)
        & t.seed.isin(spec.clean_seeds)
    ]
    return list(own.run) + PLAN.run_names(Role.FAULT)


REFERENCE_PRIORITY = 100


def train_priority(wildcards):
    """When cores are short, the reference runs first (every monitored run waits for the
    reference, whose rule has REFERENCE_PRIORITY), then the longest runs first, so that the
    largest size does not train alone at the end while the other cores idle."""
    row = PLAN.table.set_index("run").loc[wildcards.run]
    trained = float(row.flops) * float(row.stop_fraction)  # a sweep variant stops early
    flops_rank = math.log10(max(trained, 1.0))  # < 30 for any real run
    return (REFERENCE_PRIORITY if row.is_reference else 0) + flops_rank


def train_resource(key):
    """One of launch.slurm_resources; None leaves the resource unset."""
    return lambda wildcards: slurm_resources(spec_of(wildcards)).get(key)


# The evaluation and data jobs' requests, from the plan (collapse.jobs): evaluation on one GPU of
# a GPU cluster with a scoring batch that fits it, data jobs sized from the corpus; a request
# beyond one node of the partition stops here, naming the job.
def _eval_requests():
    models = {spec.size: spec for spec in PLAN.runs}
    ev = FAMILY.evaluation
    return {
        size: eval_request(
            CFG.cluster, s.model, s.params, tasks=ev.tasks, limit=ev.limit, size=size
        )
        for size, s in models.items()
    }


try:
    EVAL_REQUESTS = _eval_requests()
    DATA_REQUESTS = data_requests(CFG.cluster, FAMILY.data)
except ResourceError as err:
    raise WorkflowError(str(err)) from None


def eval_job(wildcards):
    return EVAL_REQUESTS[spec_of(wildcards).size]


def eval_resource(key):
    """One resource of a run's evaluation job; None leaves it unset."""
    return lambda wildcards: eval_job(wildcards).resources(CFG.cluster)[key]


def data_resource(rule, key):
    """One resource of a data rule's job; None leaves it unset."""
    value = DATA_REQUESTS[rule].resources(CFG.cluster)[key]
    return lambda wildcards: value


# The analysis rules (reference, collapse_stats, gate) measure two scopes the same way: the
# family, and its contrast (family.contrast) with its own runs. Wildcard ``scope`` is "" for
# the family (results/<family>/reference/...) and "contrast/" for the contrast
# (results/<family>/contrast/reference/...).
SCOPES = "(contrast/)?"


def scope_curves(wildcards, *, reference_only=False):
    """The curves a scope is measured on: the family's runs of the band, or the contrast's
    runs (one band)."""
    if wildcards.scope:
        runs = contrast_runs(reference_only=reference_only)
    else:
        runs = runs_in_band(wildcards.band, reference_only=reference_only)
    return [curve(r) for r in runs]


def scope_reference(wildcards):
    """The reference a run is gated against: its band's, or the contrast's."""
    if wildcards.scope:
        return f"{CONTRAST_ROOT}/reference/tpp{CONTRAST_BAND}/reference.csv"
    return spec_reference(wildcards.run)
