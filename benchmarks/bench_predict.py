"""Benchmark: how well, and how fast, the final loss is predicted from 10-30 % of a curve.

    python benchmarks/bench_predict.py                       # synthetic D2Z family
    python benchmarks/bench_predict.py --curves CURVES --reference-sizes S1,S2 [--sweep]

The synthetic family draws Eq. 4 curves (docs/method.md §5) under warmup + decay to zero with
per-step batch noise and a slow per-seed drift, so the numbers show what the method can do when
collapse holds. With --curves it runs the same prediction on real curves (any file `collapse
predict` reads) and, with --sweep, prints the sweep metrics table (issue 5, item 6). Prints only.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pandas as pd

from collapse.curves import curves_from_frame, read_curves, smooth
from collapse.predict import predict_runs, reference_from_sizes
from collapse.surrogate import synthetic_loss
from collapse.sweep import metrics_markdown, sweep_metrics, truth_from_predictions

FRACTIONS = (0.1, 0.2, 0.3)


def synthetic_family(steps: int, noise_rel: float, wiggle_rel: float) -> pd.DataFrame:
    """Reference sizes s1, s2 (two seeds each) and eight larger runs, one shape (b 0.12, q 1)."""
    t_hat = np.arange(1, steps + 1) / steps
    runs = [(f"s1_{k}", "s1", 4.0) for k in range(2)] + [(f"s2_{k}", "s2", 3.6) for k in range(2)]
    runs += [(f"s3_{k}", "s3", loss) for k, loss in enumerate(np.linspace(2.6, 3.3, 8))]
    frames = []
    for seed, (run, size, final_loss) in enumerate(runs):
        rng = np.random.default_rng(seed)
        loss = synthetic_loss(t_hat, final_loss, 0.12, 1.0, 0.1, noise_rel, wiggle_rel, rng)
        frames.append(pd.DataFrame({"run": run, "step": np.arange(1, steps + 1), "loss": loss}))
        frames[-1]["size"] = size
    return pd.concat(frames, ignore_index=True)


def report(curves, sizes: list[str], with_sweep: bool) -> None:
    smoothed = smooth(curves)
    start = time.perf_counter()
    reference, reference_runs = reference_from_sizes(smoothed, sizes)
    targets = [r for r in smoothed.runs if r not in set(reference_runs)]
    table = predict_runs(smoothed, reference, FRACTIONS, runs=targets)
    seconds = time.perf_counter() - start
    print(f"{len(targets)} runs x {len(FRACTIONS)} fractions x 3 methods in {seconds:.2f} s")
    complete = table.dropna(subset=["true_final_loss"])
    if complete.empty:
        print("no complete run: no errors to report")
        return
    inside = (complete["lower"] <= complete["true_final_loss"]) & (
        complete["true_final_loss"] <= complete["upper"]
    )
    summary = complete.assign(truth_inside_bounds_pct=100 * inside).pivot_table(
        ["abs_error_pct", "truth_inside_bounds_pct"], "fraction", "method", aggfunc="mean"
    )
    print("mean absolute error (%) and share of runs whose truth lies inside [lower, upper]:")
    print(summary.round(2).to_string())
    if with_sweep:
        print(metrics_markdown(sweep_metrics(table, truth_from_predictions(complete))))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--curves", nargs="+", help="real curves (default: a synthetic family)")
    parser.add_argument("--reference-sizes", default="s1,s2")
    parser.add_argument("--sweep", action="store_true", help="print the sweep metrics table")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--noise", type=float, default=0.02, help="per-step relative noise")
    parser.add_argument("--wiggle", type=float, default=0.003, help="per-seed slow drift")
    args = parser.parse_args(argv)
    if args.curves:
        curves = read_curves(args.curves)
    else:
        print(f"synthetic D2Z family: {args.steps} steps, noise {args.noise}, drift {args.wiggle}")
        curves = curves_from_frame(synthetic_family(args.steps, args.noise, args.wiggle))
    report(curves, args.reference_sizes.split(","), args.sweep)


if __name__ == "__main__":
    main()
