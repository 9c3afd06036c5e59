"""The sweep stage's prediction with and without the size drift, on synthetic tau sweeps.

Each case draws a family from Eq. 4 (``collapse.surrogate.synthetic_loss``) with a known offset
L0 and a known slope of the shape exponent in log parameters: three seeds of s96, one of s128
and s160 at the family's tau 0.2 (tiny's widths and parameter counts), a tau sweep (0.1, 0.2,
0.4, final losses 1.025 / 1 / 0.99 times the size's, so tau 0.4 wins) at the sweep's size, each
variant trained to the end, and one s96 reference run per tau. It runs `collapse stage sweep`
on them and prints, per method, the mean absolute error of the predicted final losses (%) at
10 / 20 / 30 % of training, averaged over noise draws, and how often the true winner was picked.

Cases: "offset+exponent" (the test's family), "offset", "exponent", "tau-dependent" (the
exponent's slope differs by tau: the assumption of ``collapse.sweep_drift`` broken), and
"beyond" (the sweep at s224, larger than every family size: the drift extrapolated).

    python benchmarks/bench_sweep_drift.py [--draws 5]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from collapse.cli import main as cli_main
from collapse.surrogate import SurrogateParams, synthetic_loss

PARAMS = {"s96": 322_176.0, "s128": 527_872.0, "s160": 784_000.0, "s224": 1_474_000.0}
FINAL = {"s96": 3.0, "s128": 2.78, "s160": 2.63, "s224": 2.45}
TAU_FACTOR = {0.1: 1.025, 0.2: 1.0, 0.4: 0.99}
SURROGATE = SurrogateParams(b_c=0.3, b_e=0.5, q_c=1.0, q_e=-0.2)
STEPS = 1500
CASES = {  # L0, exponent slope per tau, the sweep's size
    "offset+exponent": (1.0, {0.1: 0.6, 0.2: 0.6, 0.4: 0.6}, "s128"),
    "offset": (1.5, {0.1: 0.0, 0.2: 0.0, 0.4: 0.0}, "s128"),
    "exponent": (0.0, {0.1: 0.5, 0.2: 0.5, 0.4: 0.5}, "s128"),
    "tau-dependent": (1.0, {0.1: 0.3, 0.2: 0.6, 0.4: 0.9}, "s128"),
    "beyond": (1.0, {0.1: 0.6, 0.2: 0.6, 0.4: 0.6}, "s224"),
}


def curve(final, tau, offset, slope, size, rng) -> np.ndarray:
    step = np.arange(1, STEPS + 1)
    b, q = float(SURROGATE.b(tau)), float(SURROGATE.q(20.0))
    ell = synthetic_loss(step / STEPS, 1.0, b, q, SURROGATE.warmup_fraction, 0.01, 0.001, rng)
    exponent = 1.0 + slope * np.log(PARAMS[size] / PARAMS["s96"])
    return offset + (final - offset) * ell**exponent


def write_inputs(folder: Path, offset: float, slopes: dict, sweep_size: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    frames, rows = [], []

    def add(run, role, size, tau, final, sweep=""):
        loss = curve(final, tau, offset, slopes[tau], size, rng)
        step = np.arange(1, STEPS + 1)
        frames.append(pd.DataFrame({"run": run, "step": step, "loss": loss, "steps": STEPS}))
        rows.append(
            {"run": run, "role": role, "sweep": sweep, "size": size, "tpp_band": 20.0}
            | {"tau": tau, "params": PARAMS[size], "flops": 120 * PARAMS[size] ** 2}
            | {"stop_fraction": 1.0}
        )

    for size in ("s96", "s128", "s160"):
        for s in range(3 if size == "s96" else 1):
            add(f"{size}-s{s}", "family", size, 0.2, FINAL[size] * (1 + 0.003 * rng.normal()))
    for tau, factor in TAU_FACTOR.items():
        add(
            f"sweep-tau-{sweep_size}-tau{tau:g}",
            "sweep",
            sweep_size,
            tau,
            FINAL[sweep_size] * factor,
            "tau",
        )
        add(
            f"sweepref-tau-s96-tau{tau:g}",
            "sweep_reference",
            "s96",
            tau,
            FINAL["s96"] * factor,
            "tau",
        )
    pd.concat(frames).to_csv(folder / "curves.csv", index=False)
    pd.DataFrame(rows).to_csv(folder / "runs.csv", index=False)


def run_case(offset, slopes, sweep_size, seed) -> pd.DataFrame:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_inputs(folder, offset, slopes, sweep_size, seed)
        args = ["stage", "sweep", str(folder / "curves.csv"), "--runs", str(folder / "runs.csv")]
        args += ["--fractions", "0.1", "0.2", "0.3", "--out", str(folder / "out")]
        with contextlib.redirect_stdout(io.StringIO()):
            assert cli_main(args) == 0
        return pd.read_csv(folder / "out" / "metrics.csv")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draws", type=int, default=5, help="noise draws per case")
    args = parser.parse_args()
    start = time.time()
    print(f"{'case':16s} {'method':9s} MAE % at 10/20/30 %      winner picked")
    for name, (offset, slopes, size) in CASES.items():
        metrics = pd.concat(run_case(offset, slopes, size, seed) for seed in range(args.draws))
        metrics = metrics[metrics.method != "random"]
        for method, rows in metrics.groupby("method", sort=False):
            mae = rows.groupby("fraction").mean_abs_error_pct.mean()
            picked = rows.found_best.astype(str).eq("True").sum()
            print(
                f"{name:16s} {method:9s} {' / '.join(f'{v:.2f}' for v in mae):20s}"
                f"     {picked}/{len(rows)}"
            )
    print(f"({args.draws} draws per case, {time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
