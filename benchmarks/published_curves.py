"""Convert Qiu et al.'s published training logs into a curve table `collapse predict` reads.

    python benchmarks/published_curves.py LOGS.pkl OUT.csv.gz

Source: the logs of Qiu et al. (2025, "Scaling collapse reveals universal dynamics in
compute-optimally trained neural networks", arXiv 2507.02119), github.com/shikaiqiu/supercollapse,
files logs/c5m.pkl (CIFAR-5M) and logs/chess.pkl, µP transformers of widths 768-2048, and
logs/mlp.pkl, µP MLPs of widths 384-2048 regressing synthetic power-law data: 8 widths x 5
seeds, linear decay to zero, each trained to its compute-optimal horizon; a pickled DataFrame
with one row per run (width ``D``, parameters ``P``, ``seed``) and a ``history`` DataFrame of
step, compute (PFLOPs), test_loss, lr. The data are not part of this repository: fetch them
from that repository. A pickle can run code when loaded: convert only files from that source.

Output columns: run (d<width>_s<seed>), step, loss (the logged test loss), lr, size
(d<width>), params, seed, steps (the run's last step), flops (its total training FLOPs).
Then: python benchmarks/bench_predict.py --family c5m=OUT.csv.gz:d768,d896
"""

from __future__ import annotations

import argparse

import pandas as pd


def curve_table(logs: pd.DataFrame) -> pd.DataFrame:
    """One curve per (width, seed); logs/mlp.pkl lists 16 of its 40 runs twice, identically."""
    frames = []
    seen: dict[tuple[int, int], pd.Series] = {}
    for _, row in logs.iterrows():
        history = row["history"]
        key = (int(row["D"]), int(row["seed"]))
        if key in seen:
            if not seen[key].equals(history["test_loss"]):
                raise SystemExit(f"width {key[0]} seed {key[1]} is logged twice, differently")
            continue
        seen[key] = history["test_loss"]
        history = history[history["step"] >= 1]  # step 0 is the initial loss; steps are 1-based
        width, seed = int(row["D"]), int(row["seed"])
        frames.append(
            pd.DataFrame(
                {
                    "run": f"d{width}_s{seed}",
                    "step": history["step"].astype(int),
                    "loss": history["test_loss"].astype(float),
                    "lr": history["lr"].astype(float),
                    "size": f"d{width}",
                    "params": int(row["P"]),
                    "seed": seed,
                    "steps": int(history["step"].max()),
                    "flops": float(history["compute"].max()) * 1e15,
                }
            )
        )
    return pd.concat(frames, ignore_index=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "logs", help="logs/c5m.pkl, chess.pkl or mlp.pkl of Qiu et al.'s repository"
    )
    parser.add_argument("out", help="curve table to write (.csv, .csv.gz)")
    args = parser.parse_args(argv)
    table = curve_table(pd.read_pickle(args.logs))
    table.to_csv(args.out, index=False)
    print(f"{table['run'].nunique()} runs, {len(table)} rows -> {args.out}")


if __name__ == "__main__":
    main()
