"""Benchmark: training throughput and memory of the Megatron path against a plain PyTorch GPT.

Prints figures; not a test. The Megatron path is what ``collapse.train`` runs:
``build_stack`` (the project's GPTModel, Megatron DDP, ``get_megatron_optimizer`` with the µP
group overrides, ``get_forward_backward_func``) and ``train_step``. The reference is
``plain_gpt.PlainGPT`` (nanoGPT-style, SDPA attention, torch AdamW, grad clipping) of the same
shape: ~10.9M parameters, 6 layers, d 384, seq 256, batch 8, fp32, 2 threads. Target: the
Megatron path at >= 0.9x the plain model's tokens/s.

Throughput: both models live in one process and train in alternating blocks of steps on the
same fixed batch, so machine noise hits both; wall-clock tokens/s and tokens per CPU-second of
the process (``time.process_time``, all threads), which other jobs on the machine disturb less.
Memory: each model alone in a fresh process, ``ru_maxrss`` (the RSS high-water mark) after the
imports, after building model and optimizer, and after the training steps. ``--profile`` adds a
cProfile of the Megatron steps (where the time goes, by function) and a torch.profiler table of
the operators of both.

    python benchmarks/bench_train.py [--rounds 8] [--block 2] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

from plain_gpt import PlainGPT, plain_optimizer, plain_step  # noqa: E402
from test_train_support import tiny_spec  # noqa: E402

from collapse.scaling import mup_parameterization  # noqa: E402

THREADS = 2
LAYERS, D_MODEL, HEADS, SEQ, BATCH = 6, 384, 6, 256, 8


def bench_spec(root: Path):
    """The benchmark's RunSpec: µP of docs/method.md §7, learned positions (as nanoGPT)."""
    base = tiny_spec(
        root,
        run="bench",
        d_model=D_MODEL,
        n_layers=LAYERS,
        n_heads=HEADS,
        seq_len=SEQ,
        batch_seqs=BATCH,
        micro_batch_seqs=BATCH,
        positions="learned",
    )
    mup = mup_parameterization(
        base.model,
        kind="mup",
        d_base=128,
        depth_base=LAYERS,
        sigma_base=8.67e-2,
        eta_base=1.62e-2,
        alpha_input=9.17,
        alpha_output=1.095,
        beta1=0.9,
        beta2=0.95,
        eps=1e-8,
    )
    optim = base.optim.model_copy(update={"lr_peak": mup.lr_hidden, "steps": 100_000})
    return base.model_copy(update={"mup": mup, "optim": optim})


def fixed_batch(vocab: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    seq = torch.randint(1, vocab, (BATCH, SEQ + 1), generator=gen)
    return {
        "tokens": seq[:, :-1].contiguous(),
        "labels": seq[:, 1:].contiguous(),
        "loss_mask": torch.ones(BATCH, SEQ),
        "position_ids": torch.arange(SEQ).expand(BATCH, SEQ).contiguous(),
    }


def megatron_runner(spec):
    """A world of one and the training stack, exactly as collapse.train builds them."""
    import megatron_patches

    megatron_patches.apply()
    from collapse.train import build_stack, init_distributed, train_step

    init_distributed(spec)
    stack = build_stack(spec)
    batch = fixed_batch(spec.model.vocab_size)

    def step() -> float:
        loss, _, _ = train_step(stack, [batch], spec)
        return loss

    return step, stack.params_counted


def plain_runner(spec):
    torch.manual_seed(spec.optim.seed)
    model = PlainGPT(spec)
    optimizer = plain_optimizer(model, spec)
    batch = fixed_batch(spec.model.vocab_size)

    def step() -> float:
        return plain_step(model, optimizer, batch, spec.optim.grad_clip)

    return step, sum(p.numel() for p in model.parameters())


RUNNERS = {"megatron": megatron_runner, "plain": plain_runner}


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def memory_alone(which: str, steps: int) -> dict:
    """RSS high-water mark per phase of one model in this (fresh) process."""
    torch.set_num_threads(THREADS)
    if which == "megatron":  # its imports belong to the import phase, not to the build
        import megatron.core.distributed  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.optimizer  # noqa: F401

        import collapse.train  # noqa: F401
    out = {"imports": maxrss_mib()}
    with tempfile.TemporaryDirectory() as tmp:
        step, params = RUNNERS[which](bench_spec(Path(tmp)))
        out["build"] = maxrss_mib()
        for _ in range(steps):
            step()
        out["train"] = maxrss_mib()
    out["params"] = params
    return out


def memory_table(steps: int) -> dict:
    table = {}
    for which in RUNNERS:
        cmd = [sys.executable, __file__, "--alone", which, "--block", str(steps)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
        table[which] = json.loads(done.stdout.strip().splitlines()[-1])
    return table


def interleaved(rounds: int, block: int, warmup: int, profile: bool) -> dict:
    """tokens/s of both models, alternating blocks of `block` steps for `rounds` rounds."""
    torch.set_num_threads(THREADS)
    with tempfile.TemporaryDirectory() as tmp:
        spec = bench_spec(Path(tmp))
        runners = {name: make(spec) for name, make in RUNNERS.items()}
        for step, _ in runners.values():
            for _ in range(warmup):
                step()
        seconds = {name: [] for name in runners}
        cpu_seconds = {name: [] for name in runners}
        for r in range(rounds):
            order = list(runners) if r % 2 == 0 else list(reversed(runners))
            for name in order:
                step = runners[name][0]
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(block):
                    step()
                seconds[name].append(time.perf_counter() - t0)
                cpu_seconds[name].append(time.process_time() - c0)
        if profile:
            run_profiles(runners, block)
    tokens = block * BATCH * SEQ
    return {
        "params": {name: runners[name][1] for name in runners},
        "tokens_per_s": {name: len(s) * tokens / sum(s) for name, s in seconds.items()},
        "tokens_per_cpu_s": {name: len(s) * tokens / sum(s) for name, s in cpu_seconds.items()},
        "block_ratio": [m / p for m, p in zip(seconds["plain"], seconds["megatron"], strict=True)],
    }


def run_profiles(runners: dict, steps: int) -> None:
    """Where the Megatron step's time goes: by Python function, and by operator for both."""
    step = runners["megatron"][0]
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    print(f"\ncProfile of {steps} Megatron steps (by own time)")
    print("\n".join(text.getvalue().splitlines()[4:]))
    from torch.profiler import ProfilerActivity, profile

    for name, (step, _) in runners.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        print(f"\ntorch.profiler, {name}, {steps} steps (by self CPU time)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8, help="blocks per model")
    parser.add_argument("--block", type=int, default=2, help="steps per block")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per model")
    parser.add_argument("--profile", action="store_true", help="also profile (cProfile, torch)")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory processes")
    parser.add_argument("--alone", choices=sorted(RUNNERS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.alone:  # internal: one model in a fresh process, for its RSS high-water marks
        print(json.dumps(memory_alone(args.alone, args.block)))
        return 0
    memory = None if args.no_memory else memory_table(args.block)
    result = interleaved(args.rounds, args.block, args.warmup, args.profile)
    tps = result["tokens_per_s"]
    ratio = tps["megatron"] / tps["plain"]
    print(
        f"\nshape: {LAYERS} layers, d {D_MODEL}, {HEADS} heads, seq {SEQ}, batch {BATCH}, fp32, "
        f"{THREADS} threads; {args.rounds} interleaved blocks of {args.block} steps per model"
    )
    cpu = result["tokens_per_cpu_s"]
    for name in ("plain", "megatron"):
        print(
            f"{name:9} {result['params'][name]:>11,} params  {tps[name]:8.0f} tokens/s (wall)"
            f"  {cpu[name]:8.0f} tokens per CPU-second"
        )
    blocks = sorted(result["block_ratio"])
    median = statistics.median(blocks)
    print(f"ratio megatron/plain: {ratio:.3f}x overall, {median:.3f}x median of block pairs")
    print(f"  (target 0.9x); block pairs sorted: {' '.join(f'{r:.2f}' for r in blocks)}")
    cpu_ratio = cpu["megatron"] / cpu["plain"]
    print(f"ratio by CPU time (less sensitive to other jobs): {cpu_ratio:.3f}x")
    if memory:
        print("\npeak RSS (ru_maxrss high-water, MiB), each model alone in a fresh process")
        print(f"{'':9} {'imports':>8} {'built':>8} {'trained':>8}")
        for name in ("plain", "megatron"):
            m = memory[name]
            print(f"{name:9} {m['imports']:8.0f} {m['build']:8.0f} {m['train']:8.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
