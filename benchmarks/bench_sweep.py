"""Benchmark: a family's early-stopped sweep, validated to the end.

    python benchmarks/bench_sweep.py                      # the tiny family's tau sweep
    python benchmarks/bench_sweep.py --family smoke --cores 2
    python benchmarks/bench_sweep.py --overrides 'family.sweeps.0.reference_seeds=[0]'

Runs (or finds already run) the sweep's Snakemake target with every variant trained to the end
(``validate_full``, switched on here when the family stops its sweep early: the variants then
resume from their last checkpoint), then prints, per method and stopping fraction, the mean
absolute error of the predicted final loss, the selection regret and the compute spent, and
checks the targets: MAE at 30 % of training at most 1 %, and a zero-regret selection
after at most 30 % of the sweep's full compute. The small full-length reference runs (one per
tau and reference seed) are counted separately, those the family trains anyway left out.
Prints only.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

from collapse.config import load_config

REPO = Path(__file__).resolve().parents[1]
MAE_TARGET_PCT = 1.0
COMPUTE_TARGET = 0.30


def run_sweep(
    family: str, sweep: str, cores: int, workdir: Path, results: str, overrides: str
) -> float:
    """Snakemake's sweep target (nothing to do when it is complete); seconds it took."""
    cmd = [
        sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"),
        "--directory", str(workdir), "--cores", str(cores),
        f"{results}/{family}/sweeps/{sweep}/metrics.csv", "--config", f"family={family}",
        f"overrides={overrides}",
    ]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="tiny")
    parser.add_argument("--sweep", default=None, help="sweep name (default: the family's first)")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=REPO, help="holds results/ (default: repo)")
    parser.add_argument(
        "--overrides",
        default="",
        metavar="'A=1 B=2'",
        help="more Hydra overrides, space-separated, "
        "e.g. 'family.sweeps.0.reference_seeds=[0]' (one seed per sweep reference)",
    )
    args = parser.parse_args(argv)
    cfg = load_config([f"family={args.family}"])
    if not cfg.family.sweeps:
        parser.error(f"family {args.family!r} has no sweep")
    index = next(
        (i for i, s in enumerate(cfg.family.sweeps) if s.name == (args.sweep or s.name)), None
    )
    if index is None:
        parser.error(f"no sweep {args.sweep!r} in family {args.family!r}")
    sweep = cfg.family.sweeps[index]
    overrides = f"family.sweeps.{index}.validate_full=true {args.overrides}".strip()  # the truth
    seconds = run_sweep(
        cfg.family.name, sweep.name, args.cores, args.workdir, cfg.results, overrides
    )
    root = args.workdir / cfg.results / cfg.family.name
    metrics = pd.read_csv(root / "sweeps" / sweep.name / "metrics.csv")
    runs = pd.read_csv(root / "plan" / "runs.csv")
    mine = runs[runs["sweep"] == sweep.name]
    variants = mine[mine["role"] == "sweep"]
    refs = mine[mine["role"] == "sweep_reference"]
    own = refs[refs["same_as"].fillna("") == ""]  # the others are family runs, trained anyway
    ref_share = own["flops"].sum() / variants["flops"].sum()
    print(f"family {cfg.family.name}, sweep {sweep.name}: {len(variants)} variants of "
          f"{variants['size'].iloc[0]} ({', '.join(variants['run'])}); "
          f"{len(refs)} reference runs of {', '.join(sorted(set(refs['size'])))}, "
          f"{len(own)} of them trained for the sweep alone = {ref_share:.1%} of the full "
          f"sweep's FLOPs; snakemake {seconds:.0f} s")  # fmt: skip
    shown = metrics[metrics["method"] != "random"].pivot_table(
        ["mean_abs_error_pct", "regret_loss"], "fraction", "method"
    )
    print("\nmean absolute error of the predicted final loss (%) and selection regret (nats):")
    print(shown.round(4).to_string())
    best = variants.set_index("run").loc[metrics["best_run"].iloc[0]]
    print(f"\ntrue best: {metrics['best_run'].iloc[0]} (tau {best['tau']:.3g})")
    for method in ("collapse", "drift"):
        if (metrics["method"] == method).any():
            print_targets(metrics, method, ref_share)


def print_targets(metrics: pd.DataFrame, method: str, ref_share: float) -> None:
    """The sweep's targets for one method: MAE at 30 % and a zero-regret pick within 30 %."""
    rows = metrics[metrics["method"] == method].set_index("fraction").sort_index()
    at = rows.index[rows.index <= 0.3 + 1e-9]
    mae = rows.loc[at.max(), "mean_abs_error_pct"] if len(at) else float("nan")
    print(f"{method}: target MAE at {at.max():.0%} of training <= {MAE_TARGET_PCT:g} %: "
          f"{mae:.2f} % -> {'met' if mae <= MAE_TARGET_PCT else 'NOT met'}")  # fmt: skip
    zero = rows[rows["regret_loss"] <= 0]
    if zero.empty:
        print(
            f"{method}: target zero regret within the sweep: NOT met (no fraction picks the best)"
        )
        return
    first = zero.index.min()
    spent = zero.loc[first, "compute_fraction_of_full_sweep"]
    print(f"{method}: target zero-regret selection after <= {COMPUTE_TARGET:.0%} of the full "
          f"sweep's compute: first at fraction {first:g}, {spent:.0%} of the compute "
          f"({spent + ref_share:.0%} with the reference runs) -> "
          f"{'met' if spent <= COMPUTE_TARGET else 'NOT met'}")  # fmt: skip
    others = metrics[
        (metrics["method"].isin(["current", "powerlaw"])) & (metrics["fraction"] == first)
    ]
    picked = ", ".join(
        f"{r.method} {'found' if r.found_best else 'missed'}" for r in others.itertuples()
    )
    print(f"{method}: baselines at fraction {first:g}: {picked}")


if __name__ == "__main__":
    main()
