"""Time limits: a run longer than its partition allows trains in segments, one job each.

The plan gives each run an estimated wall time. On a cluster with a time limit
(``cluster.time_limit_min``) no job asks for more than the limit, and a run whose estimate (with
the cluster's ``runtime_margin``) does not fit one job is cut into segments:

    segments = ceil(estimate x margin / training time of one job)

where one job's training time is the limit less what a job spends besides training: its start
(``cluster.job_startup_min``: allocation, imports, dataset index, model build), loading the
checkpoint it resumes from and saving the one it leaves (checkpoint bytes /
``cluster.checkpoint_gb_per_s`` each), and the lead of Slurm's early SIGTERM (``--signal``,
``collapse.launch.signal_lead_s``). Segment k of n trains to step ``segment_end(T, n, k)``,
saves a checkpoint and writes ``runs/<run>/segments/<k>.json``; segment k+1 needs that file, so
the segments are jobs chained in the DAG (``snakemake -n`` lists them), the last one being the
run's ordinary ``train`` job that writes its outputs.

Inside a job the ``TimeBudget`` callback (``collapse.callbacks``) stops a segment that runs
slower than planned, as Megatron-LM's ``--exit-duration-in-mins`` does: before each step, when
the time elapsed plus that step plus a checkpoint save would pass the job's exit duration, the
step is the last one; the job saves and exits 75 (try again), and the workflow's retry resumes
the same segment from its checkpoint. Slurm's SIGTERM before the limit, preemption and a job
killed anywhere end the same way (``Preemption``), or, for SIGKILL, at the last checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from collapse.launch import signal_lead_s
from collapse.memory import CPU_FP32, GPU_BF16

GB = 1e9
# What a checkpoint holds per parameter (collapse.train.sharded_state): the model's weights in
# the training dtype plus the optimizer's state, as the memory model counts them. GPU: bf16
# weights (2) + fp32 main copy (4) + Adam m and v (8); CPU: fp32 weights (4) + Adam m and v (8).
CHECKPOINT_BYTES_PER_PARAM = {
    accelerator: precision.param_bytes + precision.optimizer_bytes
    for accelerator, precision in (("gpu", GPU_BF16), ("cpu", CPU_FP32))
}
SEGMENTS_DIR = "segments"


class SegmentError(ValueError):
    """A time limit too short for one segment of a run."""


def checkpoint_bytes(params: int, accelerator: str) -> int:
    """Bytes of one checkpoint of a ``params``-parameter model (all ranks together)."""
    return params * CHECKPOINT_BYTES_PER_PARAM[accelerator]


def save_minutes(params: int, accelerator: str, gb_per_s: float) -> float:
    """Minutes to write (or read) one checkpoint at ``gb_per_s``."""
    return checkpoint_bytes(params, accelerator) / GB / gb_per_s / 60


@dataclass(frozen=True)
class SegmentPlan:
    """How one run meets its time limit: its jobs, what each asks for, when each stops."""

    segments: int  # jobs in a chain; 1 = one ordinary training job
    runtime_min: int  # each job's time request (Slurm -t)
    exit_duration_min: float  # a job stops (saving) before this much time; 0 = never by time
    save_min: float  # estimated checkpoint save (and load)
    overhead_min: float  # what one job spends besides training (start, load, save, lead)

    @property
    def train_min_per_segment(self) -> float:
        return self.runtime_min - self.overhead_min


def plan_segments(
    estimated_min: float,
    limit_min: float | None,
    *,
    margin: float = 1.0,
    min_runtime_min: int = 1,
    save_min: float = 0.0,
    startup_min: float = 0.0,
    step_min: float = 0.0,
    checkpoint_gb: float = 0.0,
    what: str = "the run",
) -> SegmentPlan:
    """The segments of a run estimated to train ``estimated_min`` minutes under ``limit_min``.

    ``save_min``: one checkpoint's save (its load at the next start counts the same);
    ``startup_min``: a job's start before its first step; ``step_min``: one optimizer step (a
    segment trains at least one). ``limit_min`` None: no limit, one job of the estimate x
    ``margin``. Raises SegmentError, naming ``what`` and the checkpoint, when one segment cannot
    train a step within the limit.
    """
    if estimated_min < 0:
        raise ValueError(f"estimated_min must be >= 0, got {estimated_min}")
    need = max(float(min_runtime_min), math.ceil(estimated_min * margin))
    if limit_min is None:
        return SegmentPlan(1, int(need), 0.0, save_min, 0.0)
    # the cluster's floor on a request (min_runtime_min) never forces segments: it is capped
    if limit_min <= 0:
        raise ValueError(f"limit_min must be > 0, got {limit_min}")
    limit = max(1, int(math.floor(limit_min)))

    def exit_duration(runtime: int) -> float:
        """When the training process must have stopped, its checkpoint saved (from its start)."""
        return max(0.0, runtime - signal_lead_s(runtime) / 60 - startup_min)

    lead_min = signal_lead_s(limit) / 60
    overhead = startup_min + 2 * save_min + lead_min
    usable = limit - overhead
    if math.ceil(estimated_min * margin) <= limit:  # one job; it stops before its limit
        runtime = int(min(need, limit))
        overhead_one = startup_min + 2 * save_min + signal_lead_s(runtime) / 60
        return SegmentPlan(1, runtime, exit_duration(runtime), save_min, overhead_one)
    if usable < step_min * margin or usable <= 0:
        raise SegmentError(
            f"{what}: the time limit of {limit_min:g} min is too short for one segment: a job "
            f"needs {startup_min:.3g} min to start, {save_min:.3g} min to load and as much to "
            f"save its {checkpoint_gb:.3g} GB checkpoint, {lead_min:.3g} min of lead before the "
            "limit and "
            f"{step_min * margin:.3g} min for one step ({overhead + step_min * margin:.3g} min "
            "in all). Fix: a partition with a longer limit (cluster.time_limit_min), faster "
            "checkpoint storage (cluster.checkpoint_gb_per_s), or a layout over more GPUs"
        )
    segments = math.ceil(estimated_min * margin / usable)
    return SegmentPlan(max(2, segments), limit, exit_duration(limit), save_min, overhead)


def segment_end(target_steps: int, segments: int, segment: int) -> int:
    """The last step segment ``segment`` (1-based) of ``segments`` trains: equal shares of the
    run's ``target_steps``, the last segment ending at the target."""
    if not 1 <= segment <= segments:
        raise ValueError(f"segment {segment} is not in 1..{segments}")
    return math.ceil(segment * target_steps / segments)


def marker_path(run_dir: str | Path, segment: int) -> Path:
    """The file a finished segment (not the last) leaves: the next segment's input."""
    return Path(run_dir) / SEGMENTS_DIR / f"{segment}.json"


def write_marker(run_dir: str | Path, segment: int, segments: int, facts: dict) -> Path:
    path = marker_path(run_dir, segment)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"segment": segment, "segments": segments, **facts}, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def describe(plan: SegmentPlan) -> str:
    """One line for the plan report."""
    if plan.segments == 1:
        return f"1 job of {plan.runtime_min} min"
    return (
        f"{plan.segments} segments of {plan.runtime_min} min (about "
        f"{plan.train_min_per_segment:.0f} min training each; checkpoint save "
        f"{plan.save_min:.2g} min)"
    )


def report_lines(runs, cluster) -> list[str]:
    """The plan report's section on the time limit: each run's jobs, segments first."""
    if cluster.time_limit_min is None:
        return []
    cut = [r for r in runs if r.resources.segments > 1]
    lines = [
        "## Time limit and segments",
        "",
        f"The partition allows {cluster.time_limit_min:g} min per job (cluster.time_limit_min); "
        "no job asks for more. "
        + (
            f"{len(cut)} of {len(runs)} runs are longer and train in segments, one job each, "
            "chained in the workflow (rule train_segment, then the run's train job); each "
            "segment saves a checkpoint and stops before the limit."
            if cut
            else "Every run fits in one job."
        ),
        "",
    ]
    if cut:
        lines += [
            "| run | size | segments | steps per segment | request per job | exit after | "
            "checkpoint save |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in cut:
            n, steps = r.resources.segments, r.optim.steps
            target = max(1, min(steps, math.ceil(r.optim.stop_fraction * steps - 1e-9)))
            ends = [segment_end(target, n, k) for k in range(1, n + 1)]
            per = sorted({b - a for a, b in zip([0, *ends[:-1]], ends, strict=True)})
            share = f"{per[0]}" if len(per) == 1 else f"{per[0]}-{per[-1]}"
            lines.append(
                f"| {r.run} | {r.size} | {n} | {share} "
                f"| {r.resources.runtime_min} min | {r.resources.exit_duration_min:.4g} min "
                f"| {r.resources.checkpoint_save_min * 60:.3g} s |"
            )
        lines.append("")
    return lines


def cap_runtimes(rules, limit_min: float) -> None:
    """Hold the ``runtime`` of every Snakemake rule in ``rules`` (its own, or the profile's
    default-resources) to ``limit_min`` minutes, also where it is computed per job."""
    from snakemake.resources import Resource

    limit = int(limit_min)

    def capped(runtime: Resource) -> Resource:
        def cap(wildcards, input, attempt, threads, rulename, async_run):
            value = runtime.evaluate(
                wildcards,
                input=input,
                attempt=attempt,
                threads=threads,
                rulename=rulename,
                async_run=async_run,
            ).value
            return min(value, limit) if isinstance(value, int) else value

        return Resource("runtime", cap)

    for rule in rules:
        if "runtime" in rule.resources:
            rule.resources["runtime"] = capped(rule.resources["runtime"])
        else:
            rule.resources["runtime"] = limit
