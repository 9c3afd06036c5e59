"""GPU check: a few hundred steps of a ``ladder`` size on one GPU, on the training code path.

Prints figures; not a test. What it runs is what ``collapse.train`` runs (``build_stack``:
the project's GPTModel with µP, Megatron DDP and AdamW; ``train_step``), on one GPU in bf16
(``Float16Module``, fp32 main grads; TransformerEngine layers where installed), for a spec the
planner made for the size on ``slurm_h100``. The schedule is shortened to ``--steps`` (warmup a
tenth), the batch to ``--batch-seqs``. The data is synthetic and learnable: sequences of a fixed
random bigram chain (each token has four successors, probabilities 0.6/0.2/0.1/0.1, and 5 %
uniform noise), the same tokens in every run, so that the loss falls well below ln(vocab).

It prints:
- tokens/s and MFU (Table 9 FLOPs per step / step time / the cluster's peak FLOP/s), over the
  steps after the first tenth (compilation, allocator warm-up);
- peak GPU memory (``torch.cuda.max_memory_allocated``, and reserved) against the planner's
  per-GPU estimate for the same layout (tp = pp = dp = 1, the check's micro-batch), term by term;
- the loss of the bf16 run against an fp32 run (``COLLAPSE_GPU_PRECISION=fp32``: fp32 weights,
  no TF32) on the same steps and data: per-step difference, and its mean over the last fifth.

Both precisions train in one process, one after the other (bf16 first), each on a freshly built
model and optimizer; the memory peak is reset in between, so each peak is its own run's. Time on
one H100 (estimated, not measured here): 60M at the defaults, 200 steps of 32 x 2048 tokens, is 13M
tokens, 6e15 FLOPs: well under a minute in bf16, two to four minutes in fp32 (no TF32), plus
start-up; ``--fp32-steps`` shortens the reference.

    python benchmarks/gpu_check.py [--size 60M] [--steps 200] [--batch-seqs 32] [--json out.json]
    python benchmarks/gpu_check.py --smoke      # CPU, seconds: a 2-layer d64 model, 6 steps

On CPU the training path is fp32 only: both runs are fp32 and the loss difference is 0 by
construction; the smoke mode checks that the script runs end to end, not the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT / "workflow", ROOT):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from collapse.model import GPU_PRECISION_ENV  # noqa: E402

GIB = 2**30
SMOKE_OVERRIDES = [
    "family.sizes=[{name:d64,d_model:64,n_layers:2,n_heads:2}]",
    "family.reference.sizes=[d64]",
    "family.sweeps=[]",
    "family.arch.seq_len=64",
    "family.arch.vocab_size=512",
]


# ------------------------------------------------------------------------------ planner adapter
def planner_memory_estimate(spec) -> dict[str, int]:
    """The planner's per-GPU memory estimate for ``spec``'s layout, bytes by term and "total".

    The one place this script calls the planner's memory model (``collapse.memory``): bf16
    weights with fp32 grads and Adam state on GPU, fp32 everything on CPU; fused attention on GPU,
    SDPA's math path (stored scores) for ALiBi on CPU; the one shared ALiBi bias unless
    TransformerEngine computes it in its kernel.
    """
    from collapse import memory
    from collapse.model import transformer_engine_available

    on_gpu = _cuda()
    p = spec.parallel
    estimate = memory.estimate(
        spec.model,
        tp=p.tp,
        pp=p.pp,
        dp=p.dp,
        micro_batch_seqs=p.micro_batch_seqs,
        grad_accum=p.grad_accum,
        sp=p.sequence_parallel,
        recompute=p.recompute,
        precision=memory.GPU_BF16 if on_gpu else memory.CPU_FP32,
        distributed_optimizer=on_gpu and p.dp > 1,
        attention="fused" if on_gpu else memory.cpu_attention(spec.model),
    )
    terms = {k: int(v) for k, v in dataclasses.asdict(estimate).items()}
    if on_gpu and transformer_engine_available():
        terms["attention_bias"] = 0  # TE's fused ALiBi holds no bias tensor
    terms["total"] = sum(terms.values())
    return terms


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# ------------------------------------------------------------------------------ the spec
def check_spec(size: str, steps: int, batch_seqs: int, micro: int | None, smoke: bool, root: Path):
    """The planner's spec of ``size`` (ladder, first seed), cut to ``steps`` x ``batch_seqs`` on
    one device; returns (spec, peak FLOP/s of the cluster it was planned for)."""
    from collapse.config import load_config
    from collapse.plan import plan_family
    from collapse.roles import Role

    cluster = "local" if smoke and not _cuda() else "slurm_h100"
    overrides = ["family=ladder", f"cluster={cluster}", *(SMOKE_OVERRIDES if smoke else [])]
    cfg = load_config(overrides)
    plan = plan_family(cfg, corpus_tokens=10**13)  # synthetic data: the corpus never repeats
    runs = [r for r in plan.run_names(Role.FAMILY) if plan.spec(r).size == size]
    if not runs:
        sizes = sorted({plan.spec(r).size for r in plan.run_names(Role.FAMILY)})
        raise SystemExit(f"--size {size!r}: the ladder family has sizes {sizes}")
    spec = plan.spec(runs[0])
    if micro is None:
        micro = min(spec.parallel.micro_batch_seqs, batch_seqs)
    if batch_seqs % micro:
        raise SystemExit(f"--batch-seqs {batch_seqs} is not a multiple of the micro-batch {micro}")
    seq = spec.model.seq_len
    optim = spec.optim.model_copy(
        update=dict(
            batch_seqs=batch_seqs,
            steps=steps,
            warmup_steps=max(1, steps // 10),
            tokens=steps * batch_seqs * seq,
        )
    )
    parallel_ = spec.parallel.model_copy(
        update=dict(
            tp=1,
            pp=1,
            dp=1,
            micro_batch_seqs=micro,
            grad_accum=batch_seqs // micro,
            gpus=1 if _cuda() else 0,
            nodes=1,
            procs_per_node=1,
        )
    )
    resources = spec.resources.model_copy(update=dict(nodes=1, gpus_per_node=1, threads=1))
    spec = spec.model_copy(
        update=dict(
            run=f"gpu-check-{size}",
            optim=optim,
            parallel=parallel_,
            resources=resources,
            run_dir=str(root / "run"),
            checkpoint_dir=str(root / "checkpoints"),
        )
    )
    return spec, cfg.cluster.peak_flops


def bigram_tokens(vocab: int, sequences: int, length: int, seed: int) -> np.ndarray:
    """``sequences`` x ``length`` tokens of a fixed random bigram chain (see the module doc)."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, size=(vocab, 4))
    cumulative = np.cumsum([0.6, 0.2, 0.1, 0.1])
    out = np.empty((sequences, length), dtype=np.int64)
    out[:, 0] = rng.integers(0, vocab, size=sequences)
    for t in range(1, length):
        pick = np.searchsorted(cumulative, rng.random(sequences), side="right").clip(max=3)
        nxt = successors[out[:, t - 1], pick]
        noise = rng.random(sequences) < 0.05
        nxt[noise] = rng.integers(0, vocab, size=int(noise.sum()))
        out[:, t] = nxt
    return out


# ------------------------------------------------------------------------------ the runs
def worker(spec_path: Path, out_path: Path, runs: list[tuple[str, int]]) -> None:
    """Train the spec once per (precision, steps) in ``runs``, in this process, in order; write
    each run's losses, step times and peak memory."""
    import torch

    import megatron_patches
    from collapse.runspec import RunSpec
    from collapse.train import init_distributed

    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
    spec = RunSpec.load(spec_path)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32; bf16 matmuls are unaffected
    torch.backends.cudnn.allow_tf32 = False
    if not torch.cuda.is_available():
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    megatron_patches.apply()
    init_distributed(spec)
    longest = max(steps for _, steps in runs)
    data = torch.from_numpy(
        bigram_tokens(
            spec.model.vocab_size, longest * spec.optim.batch_seqs, spec.model.seq_len + 1, 1234
        )
    )
    results = {}
    for precision, steps in runs:
        os.environ[GPU_PRECISION_ENV] = precision  # read when the model and optimizer are built
        began = time.perf_counter()
        results[precision] = train_once(spec, data, steps)
        results[precision]["wall_s"] = time.perf_counter() - began
    out_path.write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


def train_once(spec, data, steps: int) -> dict:
    """``steps`` steps of a freshly built stack on ``data``; the peak memory is this run's."""
    import gc

    import torch

    from collapse.flops import flops_table9
    from collapse.train import build_stack, train_step

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    stack = build_stack(spec)
    p, seq = spec.parallel, spec.model.seq_len
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    positions = torch.arange(seq).expand(p.micro_batch_seqs, seq).to(device)
    ones = torch.ones(p.micro_batch_seqs, seq, device=device)
    losses, times = [], []
    for step in range(steps):
        batches = []
        for m in range(p.grad_accum):
            start = step * spec.optim.batch_seqs + m * p.micro_batch_seqs
            chunk = data[start : start + p.micro_batch_seqs].to(device, non_blocking=True)
            batches.append(
                dict(
                    tokens=chunk[:, :-1],
                    labels=chunk[:, 1:],
                    loss_mask=ones,
                    position_ids=positions,
                )
            )
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        began = time.perf_counter()
        loss, _, _ = train_step(stack, batches, spec)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
        losses.append(loss)
    tokens_per_step = spec.optim.batch_seqs * seq
    result = {
        "dtype": str(next(stack.model.parameters()).dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "transformer_engine": _te_layers(stack.model),
        "params": stack.params_counted,
        "tokens_per_step": tokens_per_step,
        "flops_per_step": flops_table9(spec.model, stack.params_counted, tokens_per_step),
        "losses": losses,
        "step_seconds": times,
        "peak_allocated": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0,
        "peak_reserved": torch.cuda.max_memory_reserved() if torch.cuda.is_available() else 0,
    }
    del stack
    return result


def _te_layers(model) -> bool:
    return any(type(m).__module__.startswith("transformer_engine") for m in model.modules())


# ------------------------------------------------------------------------------ the report
def summarize(result: dict, peak_flops: float) -> dict:
    times = result["step_seconds"]
    timed = times[max(1, len(times) // 10) :] or times
    step_s = sum(timed) / len(timed)
    return {
        "tokens_per_s": result["tokens_per_step"] / step_s,
        "mfu": result["flops_per_step"] / step_s / peak_flops,
        "step_s": step_s,
    }


def compare_losses(fast: list[float], reference: list[float]) -> dict:
    n = min(len(fast), len(reference))
    diff = [fast[i] - reference[i] for i in range(n)]
    tail = diff[n - max(1, n // 5) :]
    return {
        "steps": n,
        "max_abs_diff": max(abs(d) for d in diff),
        "mean_diff_last_fifth": sum(tail) / len(tail),
        "final_fast": fast[n - 1],
        "final_reference": reference[n - 1],
        "rel_diff_final": (fast[n - 1] - reference[n - 1]) / reference[n - 1],
    }


def run_worker(spec_path: Path, root: Path, runs: list[tuple[str, int]], timeout: int) -> dict:
    out = root / "runs.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "workflow"), str(ROOT), env.get("PYTHONPATH", "")]
    )
    env.setdefault("OMP_NUM_THREADS", "1")
    plan = ",".join(f"{precision}:{steps}" for precision, steps in runs)
    command = [sys.executable, __file__, "--worker", str(spec_path), "--worker-out", str(out)]
    command += ["--worker-runs", plan]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"the training process failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default=None, help="a ladder size (default 60M; smoke: d64)")
    parser.add_argument("--steps", type=int, default=None, help="default 200 (smoke: 6)")
    parser.add_argument("--fp32-steps", type=int, default=None, help="default: --steps")
    parser.add_argument("--batch-seqs", type=int, default=None, help="default 32 (smoke: 4)")
    parser.add_argument("--micro-batch-seqs", type=int, default=None, help="default: planned")
    parser.add_argument("--smoke", action="store_true", help="tiny model, CPU-friendly")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--timeout", type=int, default=900, help="seconds for both runs")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-runs", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        runs = [(r.split(":")[0], int(r.split(":")[1])) for r in args.worker_runs.split(",")]
        worker(args.worker, args.worker_out, runs)
        return 0
    size = args.size or ("d64" if args.smoke else "60M")
    steps = args.steps or (6 if args.smoke else 200)
    batch = args.batch_seqs or (4 if args.smoke else 32)
    fp32_steps = min(args.fp32_steps or steps, steps)
    for name, value in (("--steps", steps), ("--batch-seqs", batch), ("--fp32-steps", fp32_steps)):
        if value < 1:
            raise SystemExit(f"{name} must be >= 1, got {value}")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        root = Path(tmp)
        spec, peak_flops = check_spec(size, steps, batch, args.micro_batch_seqs, args.smoke, root)
        spec_path = root / "spec.json"
        spec_path.write_text(spec.to_json())
        estimate = planner_memory_estimate(spec)
        began = time.perf_counter()
        runs = run_worker(spec_path, root, [("bf16", steps), ("fp32", fp32_steps)], args.timeout)
        total_s = time.perf_counter() - began
    fast, reference = runs["bf16"], runs["fp32"]
    figures = {
        "size": size,
        "device": fast["device"],
        "dtype": fast["dtype"],
        "reference_dtype": reference["dtype"],
        "transformer_engine": bool(fast["transformer_engine"]),
        "params": fast["params"],
        "steps": steps,
        "batch": f"{batch} x {spec.model.seq_len} (micro {spec.parallel.micro_batch_seqs})",
        **summarize(fast, peak_flops),
        "peak_flops": peak_flops,
        "peak_allocated_gib": fast["peak_allocated"] / GIB,
        "peak_reserved_gib": fast["peak_reserved"] / GIB,
        "estimate_gib": {k: v / GIB for k, v in estimate.items()},
        "loss": compare_losses(fast["losses"], reference["losses"]),
        "loss_first": fast["losses"][0],
        "ln_vocab": math.log(spec.model.vocab_size),
        "wall_s": {"bf16": fast["wall_s"], "fp32": reference["wall_s"], "total": total_s},
    }
    print(report(figures))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


def report(f: dict) -> str:
    est = f["estimate_gib"]
    loss = f["loss"]
    measured = (
        f"peak allocated {f['peak_allocated_gib']:.2f} GiB, reserved {f['peak_reserved_gib']:.2f} "
        f"GiB; planner estimate {est['total']:.2f} GiB "
        f"(allocated / estimate {f['peak_allocated_gib'] / est['total']:.2f})"
        if f["peak_allocated_gib"]
        else f"peak GPU memory: n/a on {f['device']}; planner estimate {est['total']:.3f} GiB"
    )
    terms = ", ".join(f"{k} {v:.3f}" for k, v in est.items() if k != "total")
    lines = [
        f"gpu_check: ladder {f['size']} ({f['params']:,} parameters) on {f['device']}, "
        f"{f['dtype']} (TransformerEngine: {'yes' if f['transformer_engine'] else 'no'}), "
        f"{f['steps']} steps of {f['batch']}",
        f"throughput: {f['tokens_per_s']:,.0f} tokens/s, {f['step_s'] * 1e3:.1f} ms/step, "
        f"MFU {f['mfu']:.1%} of {f['peak_flops']:.3g} FLOP/s",
        f"memory: {measured}",
        f"  estimate by term (GiB): {terms}",
        f"loss: {f['dtype']} {loss['final_fast']:.4f} vs {f['reference_dtype']} "
        f"{loss['final_reference']:.4f} at step {loss['steps']} (relative "
        f"{loss['rel_diff_final']:+.2e}); max |diff| {loss['max_abs_diff']:.4f}, mean diff over "
        f"the last fifth {loss['mean_diff_last_fifth']:+.4f}; first loss {f['loss_first']:.3f}, "
        f"ln(vocab) {f['ln_vocab']:.3f}",
        f"wall: {f['wall_s']['bf16']:.0f} s {f['dtype']}, {f['wall_s']['fp32']:.0f} s "
        f"{f['reference_dtype']}, {f['wall_s']['total']:.0f} s in all with start-up",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
