"""Benchmark: CPU threads per training process, and one job at a time against two at once.

On a CPU the local cluster config (``config/cluster/local.yaml``, ``threads_per_proc``) decides
both how many intra-op threads each training process gets and, through Snakemake's ``--cores``,
how many training jobs run side by side. This measures the three ways to use two cores for a
family's real run specs (its sizes, batch and micro-batch from the plan), with the training
step ``collapse.train`` runs (``build_stack`` + ``train_step``) on random tokens:

- ``alone@2``: one process, two threads (one job at a time, ``threads_per_proc: 2``);
- ``alone@1``: one process, one thread;
- ``pair@1``: two one-thread processes at once (``threads_per_proc: 1``, two jobs at a time);
  its figure is the two processes' summed tokens/s.

Each scenario runs in fresh processes, in alternating order over the rounds so that machine
noise hits all of them; the ratios against ``alone@2`` are the figures to compare.

    python benchmarks/bench_threads.py [--family tiny] [--sizes d96,d192] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = {"alone@2": (2, 1), "alone@1": (1, 1), "pair@1": (1, 2)}  # threads, processes


def family_specs(family: str, sizes: list[str], out: Path) -> dict[str, Path]:
    """Seed-0 run spec of each size, from the family's plan (run_dir in a scratch folder)."""
    from collapse.config import load_config
    from collapse.plan import plan_family
    from collapse.roles import Role

    plan = plan_family(load_config([f"family={family}"]), corpus_tokens=10**12)
    found = {}
    for spec in plan.runs:
        if spec.size in sizes and spec.size not in found and spec.role != Role.SWEEP:
            spec = spec.model_copy(update={"run_dir": str(out / spec.run)})
            path = out / f"{spec.size}.json"
            path.write_text(spec.to_json())
            found[spec.size] = path
    missing = sorted(set(sizes) - set(found))
    if missing:
        known = sorted({s.size for s in plan.runs})
        raise SystemExit(f"--sizes: {missing} not in family {family} (sizes: {known})")
    return found


def worker(spec_path: Path, threads: int, steps: int, warmup: int) -> dict:
    """Build the training stack of one spec and time ``steps`` optimizer steps."""
    import torch

    torch.set_num_threads(threads)
    import megatron_patches

    megatron_patches.apply()
    from collapse.runspec import RunSpec
    from collapse.train import build_stack, init_distributed, train_step

    spec = RunSpec.model_validate_json(spec_path.read_text())
    init_distributed(spec)
    stack = build_stack(spec)
    micro, seq = spec.parallel.micro_batch_seqs, spec.model.seq_len
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, spec.model.vocab_size, (micro, seq + 1), generator=gen)
    batch = {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": torch.ones(micro, seq),
        "position_ids": torch.arange(seq).expand(micro, seq).contiguous(),
    }
    batches = [batch] * spec.parallel.grad_accum
    for _ in range(warmup):
        train_step(stack, batches, spec)
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step(stack, batches, spec)
    seconds = time.perf_counter() - t0
    return {"tokens_per_s": steps * spec.optim.batch_seqs * seq / seconds}


def scenario(spec: Path, threads: int, processes: int, steps: int, warmup: int) -> float:
    """Summed tokens/s of ``processes`` workers started together."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, __file__, "--worker", str(spec), "--threads", str(threads)]
    cmd += ["--steps", str(steps), "--warmup", str(warmup)]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) for _ in range(processes)
    ]
    total = 0.0
    for proc in procs:
        out, _ = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"worker failed ({proc.returncode}): {' '.join(cmd)}")
        total += json.loads(out.strip().splitlines()[-1])["tokens_per_s"]
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="tiny", help="family config (default tiny)")
    parser.add_argument("--sizes", default="d96,d192", help="comma-separated sizes")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of all scenarios")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.threads, args.steps, args.warmup)))
        return
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        specs = family_specs(args.family, sizes, Path(tmp))
        print(f"{args.family}: {args.steps} timed steps per process, {args.rounds} rounds")
        print(f"{'size':6s} " + " ".join(f"{s:>12s}" for s in SCENARIOS) + "   ratios to alone@2")
        for size, spec in specs.items():
            figures = {name: [] for name in SCENARIOS}
            for r in range(args.rounds):
                order = list(SCENARIOS) if r % 2 == 0 else list(reversed(SCENARIOS))
                for name in order:
                    threads, processes = SCENARIOS[name]
                    rate = scenario(spec, threads, processes, args.steps, args.warmup)
                    figures[name].append(rate)
            mean = {name: statistics.mean(v) for name, v in figures.items()}
            ratios = " ".join(
                f"{name} {mean[name] / mean['alone@2']:.2f}x"
                for name in SCENARIOS
                if name != "alone@2"
            )
            cells = " ".join(f"{mean[name]:>8,.0f} t/s" for name in SCENARIOS)
            print(f"{size:6s} {cells}   {ratios}", flush=True)


if __name__ == "__main__":
    main()
