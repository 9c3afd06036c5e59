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

Published schedule sweeps (``--schedules NAME=PKL``): Qiu et al.'s logs/c5m_schedules.pkl and
logs/mlp_schedules.pkl (github.com/shikaiqiu/supercollapse, not shipped; a pickle can run code
when loaded: give only files from that source) train several widths on one token budget with
five learning-rate schedules each (constant; linear and multi-cosine decay, over the last 20 %
or all of training). Each width w but the smallest becomes a sweep over the schedules, each
variant referenced by the smallest width at its schedule, and the drift is fitted on the other
widths at the family's schedule (linear decay over all of training). The schedule is written
into the ``tau`` column, the key the stage pairs variants with references by: the drift is
assumed not to depend on the schedule, as the stage assumes it does not depend on tau.

    python benchmarks/bench_sweep_drift.py --draws 0 --schedules c5m=c5m_schedules.pkl \
        --schedules mlp=mlp_schedules.pkl
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
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


FAMILY_SCHEDULE = ("linear", 1.0)  # decay to zero over all of training, as in their families


def schedule_runs(path: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Curves and per-run metadata of a published schedule sweep, on its most common budget."""
    logs = pd.read_pickle(path)
    logs = logs[logs["T"] == logs["T"].mode().iloc[0]]
    smallest = logs[logs["D"] == logs["D"].min()]  # the schedules every sweep has a reference of
    keys = sorted({(r.schedule, float(r.decay_frac)) for r in smallest.itertuples()})
    logs = logs[[(r.schedule, float(r.decay_frac)) in keys for r in logs.itertuples()]]
    frames, rows = [], []
    for r in logs.itertuples():
        key = (r.schedule, float(r.decay_frac))
        history = r.history[r.history["step"] >= 1]
        run = f"d{r.D}-{r.schedule}{r.decay_frac:g}"
        steps = int(history["step"].max())
        frames.append(
            pd.DataFrame({"run": run, "step": history["step"].astype(int)}).assign(
                loss=history["test_loss"].to_numpy(float), steps=steps
            )
        )
        rows.append(
            {"run": run, "width": int(r.D), "size": f"d{r.D}", "params": float(r.num_params)}
            | {"tau": 1.0 + keys.index(key), "schedule": f"{r.schedule} {r.decay_frac:g}"}
            | {"is_family": key == FAMILY_SCHEDULE, "tpp_band": 1.0, "stop_fraction": 1.0}
            | {"flops": float(history["compute"].max())}
        )
    return pd.concat(frames, ignore_index=True), pd.DataFrame(rows)


def run_schedule_sweeps(name: str, path: str) -> None:
    curves, meta = schedule_runs(path)
    smallest = meta["width"].min()
    complete = meta.groupby("width")["tau"].nunique()
    for width in sorted(meta["width"].unique()):
        if width == smallest or complete[width] < complete[smallest]:
            continue
        role = np.select(
            [meta["width"] == width, meta["width"] == smallest, meta["is_family"]],
            ["sweep", "sweep_reference", "family"],
            "",
        )
        runs = meta.assign(role=role, sweep=np.where(role == "sweep", "schedule", ""))
        runs = runs[runs["role"] != ""]
        # the smallest width at the family's schedule is also a family run (like tiny's d96)
        twin = meta[(meta["width"] == smallest) & meta["is_family"]]
        twin = twin.assign(run=twin["run"] + "-family", role="family", sweep="")
        runs = pd.concat([runs, twin], ignore_index=True)
        curves_twin = curves[curves["run"].isin(twin["run"].str.removesuffix("-family"))]
        curves_in = pd.concat(
            [
                curves[curves["run"].isin(runs["run"])],
                curves_twin.assign(run=lambda c: c.run + "-family"),
            ]
        )
        family_sizes = sorted(runs[runs.role == "family"]["width"].unique())
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            curves_in.to_csv(folder / "curves.csv", index=False)
            runs.drop(columns=["is_family", "width"]).to_csv(folder / "runs.csv", index=False)
            args = ["stage", "sweep", str(folder / "curves.csv"), "--runs"]
            args += [str(folder / "runs.csv"), "--fractions", "0.1", "0.2", "0.3"]
            with contextlib.redirect_stdout(io.StringIO()):
                assert cli_main([*args, "--out", str(folder / "out")]) == 0
            metrics = pd.read_csv(folder / "out" / "metrics.csv")
            drift = json.loads((folder / "out" / "drift.json").read_text())
        fitted = [w for w in family_sizes if w != width]
        where = "inside" if min(fitted) < width < max(fitted) else "beyond"
        print(
            f"{name} sweep at d{width} (drift fitted on d{', d'.join(map(str, fitted))}: "
            f"{where}; L0 {drift.get('offset_L0', float('nan')):.3f}):"
        )
        for method, rows in metrics[metrics.method != "random"].groupby("method", sort=False):
            rows = rows.sort_values("fraction")
            mae = " / ".join(f"{v:.3f}" for v in rows.mean_abs_error_pct)
            regret = " / ".join(f"{v:.4f}" for v in rows.regret_loss)
            print(f"  {method:9s} MAE % {mae:22s} regret {regret}")
        random = metrics[metrics.method == "random"].regret_loss.iloc[0]
        print(f"  best: {metrics.best_run.iloc[0]}; random regret {random:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draws", type=int, default=5, help="noise draws per synthetic case")
    parser.add_argument(
        "--schedules",
        action="append",
        default=[],
        metavar="NAME=PKL",
        help="a published schedule sweep (see above); repeatable",
    )
    args = parser.parse_args()
    start = time.time()
    if args.draws > 0:
        print(f"{'case':16s} {'method':9s} MAE % at 10/20/30 %      winner picked")
    for name, (offset, slopes, size) in CASES.items() if args.draws > 0 else ():
        metrics = pd.concat(run_case(offset, slopes, size, seed) for seed in range(args.draws))
        metrics = metrics[metrics.method != "random"]
        for method, rows in metrics.groupby("method", sort=False):
            mae = rows.groupby("fraction").mean_abs_error_pct.mean()
            picked = rows.found_best.astype(str).eq("True").sum()
            print(
                f"{name:16s} {method:9s} {' / '.join(f'{v:.2f}' for v in mae):20s}"
                f"     {picked}/{len(rows)}"
            )
    for spec in args.schedules:
        name, _, path = spec.partition("=")
        run_schedule_sweeps(name, path)
    print(f"({args.draws} draws per synthetic case, {time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
