"""Benchmark (prints): curves read from TensorBoard event files and offline W&B runs.

Writes a family of runs (``--runs`` runs of ``--steps`` steps, the loss and ``--tags`` - 1
other scalars per step, as a training stack logs them) with torch's SummaryWriter and, with
``--wandb``, with wandb in offline mode; then times ``read_curves`` on each, as ``collapse
analyze`` reads them, and one poll of ``collapse watch`` on the TensorBoard directory. Writing
is not timed.

    python benchmarks/bench_logreaders.py [--runs 8] [--steps 20000] [--tags 4] [--wandb]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from collapse import curves as C
from collapse import logreaders as L

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from logwriters import write_wandb_runs  # noqa: E402  (the tests' offline W&B writer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--tags", type=int, default=4)
    parser.add_argument("--wandb", action="store_true")
    args = parser.parse_args()
    from torch.utils.tensorboard import SummaryWriter

    steps = np.arange(1, args.steps + 1)
    loss = 2.5 + 3.0 * steps**-0.3
    others = [f"other/{i}" for i in range(args.tags - 1)]
    points = args.runs * args.steps * args.tags
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for r in range(args.runs):
            writer = SummaryWriter(str(root / "tb" / f"run{r}"), max_queue=10_000)
            for s, v in zip(steps.tolist(), loss.tolist(), strict=True):
                writer.add_scalar("lm loss", v, s)
                for tag in others:
                    writer.add_scalar(tag, v, s)
            writer.close()
        size = sum(f.stat().st_size for f in (root / "tb").rglob("*tfevents*"))
        start = time.perf_counter()
        curves = C.read_curves(root / "tb")
        took = time.perf_counter() - start
        assert len(curves.data) == args.runs * args.steps
        print(
            f"TensorBoard: {args.runs} runs x {args.steps} steps x {args.tags} tags "
            f"({points / 1e6:.2f} M scalars, {size / 2**20:.1f} MiB): read_curves {took:.2f} s "
            f"({points / took / 1e3:.0f} k scalars/s)"
        )
        start = time.perf_counter()
        tb = L.TensorBoardDir(root / "tb")
        tb.poll()
        first = time.perf_counter() - start
        start = time.perf_counter()
        tb.poll()
        again = time.perf_counter() - start
        print(f"watch poll: first {first:.2f} s, then {again * 1e3:.1f} ms with nothing new")
        if args.wandb:
            runs = {
                f"run{r}": {"config": {}, "steps": steps.tolist(), "loss": loss.tolist()}
                for r in range(args.runs)
            }
            os.environ.setdefault("WANDB_SILENT", "true")
            write_wandb_runs(root / "wb", runs)
            size = sum(f.stat().st_size for f in (root / "wb").rglob("*.wandb"))
            start = time.perf_counter()
            curves = C.read_curves(root / "wb")
            took = time.perf_counter() - start
            assert len(curves.data) == args.runs * args.steps
            print(
                f"W&B offline: {args.runs} runs x {args.steps} steps x 2 keys "
                f"({size / 2**20:.1f} MiB of .wandb): read_curves {took:.2f} s"
            )


if __name__ == "__main__":
    main()
