"""Benchmark (prints): reference + gates + Delta/sigma for 600 curves of 20k steps each.

Target: under 10 s on the 2-core development machine, vectorized. The synthetic
family (10 sizes x 60 seeds, Eq. 4 curves with noise) is built first and not timed; the timed
part is what ``collapse analyze`` does short of writing plots: validate the long table and
split its metadata, smooth every curve, resample onto the t_hat grid, build the reference,
early-align and gate every run, and compute Delta, sigma and the supercollapse verdict.

With ``--cli``, the same family is also written to a CSV and ``collapse analyze`` runs on it
in a subprocess, as a user would run it (reading, checking, every output and plot): its wall
time and peak memory are printed.

    python benchmarks/bench_analysis.py [--runs 600] [--steps 20000] [--cli]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from collapse import analysis as A
from collapse import curves as C
from collapse.gates import GatePolicy
from collapse.reference import reference_curve

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from synthetic import synthetic_family  # noqa: E402  (the test suite's family generator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=600)
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--sizes", type=int, default=10)
    parser.add_argument("--cli", action="store_true", help="also time `collapse analyze` on a CSV")
    args = parser.parse_args()
    seeds = args.runs // args.sizes
    finals = {f"s{2**i}": 3.5 - 0.15 * i for i in range(args.sizes)}
    t0 = time.perf_counter()
    df = synthetic_family(finals, seeds=seeds, steps=args.steps, rng_seed=0)
    print(
        f"built {df['run'].nunique()} curves x {args.steps} steps = {len(df):,} rows "
        f"in {time.perf_counter() - t0:.1f} s (not timed)"
    )

    timings = {}
    start = last = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal last
        now = time.perf_counter()
        timings[name] = now - last
        last = now

    curves = C.curves_from_frame(df)
    lap("validate + metadata")
    curves = C.smooth(curves)
    lap("smooth (trailing mean)")
    matrix = C.resample(curves)
    lap("resample to t_hat grid")
    ref_sizes = A.default_reference_sizes(C.ordered_sizes(matrix.meta))
    reference = reference_curve(matrix.select(matrix.meta["size"].isin(ref_sizes).to_numpy()))
    lap("reference curve")
    verdicts, _ = A.gate_matrix(matrix, reference, GatePolicy())
    lap("early-align + gates")
    stats = A.collapse_statistics(matrix)
    lap("Delta / sigma / supercollapse")
    total = time.perf_counter() - start

    for name, seconds in timings.items():
        print(f"  {name:<32s} {seconds:6.2f} s")
    failed = sum(not v.passed for v in verdicts)
    print(
        f"total: {total:.2f} s for {len(matrix.meta)} curves "
        f"(target < 10 s); gates failed: {failed}; supercollapse: {stats.supercollapse}; "
        f"score {stats.score:.4f}; max |r| {max(v.max_abs_residual for v in verdicts):.4f} "
        f"vs threshold {verdicts[0].threshold:.4f}"
    )
    assert np.isfinite(stats.delta[:-1]).all()
    if args.cli:
        analyze_cli(df)


def analyze_cli(df) -> None:
    """``collapse analyze`` on the family as one CSV: wall time and the child's peak RSS."""
    with tempfile.TemporaryDirectory(prefix="bench_analysis_") as folder:
        path = Path(folder) / "curves.csv"
        df.to_csv(path, index=False)
        size_mb = path.stat().st_size / 1e6
        start = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "collapse.cli", "analyze", str(path), "--out",
             str(Path(folder) / "out")],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        seconds = time.perf_counter() - start
    peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e6  # KiB on Linux
    print(
        f"collapse analyze on a {size_mb:.0f} MB CSV of {df['run'].nunique()} runs: "
        f"{seconds:.1f} s, peak RSS {peak_gb:.2f} GB"
    )


if __name__ == "__main__":
    main()
