"""The fault-detection experiment: when does each detector see an injected fault?

docs/method.md §4 claims that a run's residual against the family's reference shows a fault
long before the raw loss does. This stage measures that on the family's own runs: every fault
run of the experiment (``family.faults``) and the clean seeds of the same size are replayed
through five detectors, each with its policy fixed before looking at the runs:

- ``collapse``: the online collapse monitor (collapse.monitor) with the gate policy of the
  family, checked every ``detectors.monitor_every_steps`` logged steps (default: every step, as
  the raw-loss rules are), against the family's reference (its reference sizes: the paper's
  method);
- ``collapse_own_size``: the same monitor against a reference built from the clean seeds of the
  faulted size other than the faults' own seed (a previous clean run of the same recipe, which
  needs no collapse across sizes; those seeds are marked "in reference", not counted);
- ``spike``: a raw-loss spike detector as in OLMo-core's stability monitor (a loss above the
  mean of the previous ``spike_window_steps`` losses by more than ``spike_k_sigma`` std);
- ``rise``: a smoothed raw-loss rise (the ``rise_window_steps`` trailing mean above its running
  minimum by more than ``rise_margin``);
- ``controls``: the controls audit (collapse.controls): the AdamW rate eta_t * lambda the run's
  optimizer applied against the one the reference runs' tau implies, off by more than
  ``controls_tolerance``. It reads the optimizer log, not the loss: it is there for the fault
  the loss cannot show at this scale (a weight decay that was not rescaled).

A non-finite loss fires every detector. An alarm before a fault's first step is a false alarm,
as is any alarm on a clean run. Outputs: ``detections.csv`` (one row per run and detector),
``detections.md`` (one row per run) and ``detections.png`` (raw loss and residual per run with
the fault and every alarm marked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from collapse import controls
from collapse.config import DetectorSpec
from collapse.curves import trailing_mean
from collapse.gates import GatePolicy
from collapse.monitor import OnlineMonitor
from collapse.runspec import RunSpec

DETECTORS = ("collapse", "collapse_own_size", "spike", "rise", "controls")
DETECTIONS_COLUMNS = (
    "run", "fault", "kind", "seed", "fault_t_hat", "detector", "alarm_t_hat", "alarm_step",
    "delay", "outcome", "peak_residual", "threshold", "detail",
)  # fmt: skip
COLLAPSE_DETECTORS = ("collapse", "collapse_own_size")


@dataclass(frozen=True)
class Alarm:
    """The first alarm of one detector on one run (index None: it never fired)."""

    index: int | None
    detail: str = ""
    peak_residual: float | None = None  # collapse monitors: the largest |r| they checked
    threshold: float | None = None


def first_true(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if len(hits) else None


def spike_alarm(loss: np.ndarray, window: int, k_sigma: float) -> Alarm:
    """OLMo-core's rule: loss > mean + k std of the previous ``window`` losses (full windows)."""
    series = pd.Series(np.asarray(loss, dtype=float))
    previous = series.shift(1).rolling(window, min_periods=window)
    mean, std = previous.mean().to_numpy(), previous.std(ddof=0).to_numpy()
    values = series.to_numpy()
    with np.errstate(invalid="ignore"):
        spike = values > mean + k_sigma * std
    i = first_true(~np.isfinite(values) | spike)
    if i is None:
        return Alarm(None)
    if not math.isfinite(values[i]):
        return Alarm(i, "non-finite loss")
    return Alarm(i, f"loss {values[i]:.4f} > {mean[i]:.4f} + {k_sigma:g} x {std[i]:.4f}")


def rise_alarm(loss: np.ndarray, steps: np.ndarray, window: int, margin: float) -> Alarm:
    """The trailing-mean loss above its running minimum by more than ``margin`` (relative)."""
    values = np.asarray(loss, dtype=float)
    smooth = trailing_mean(values, steps, np.zeros(len(values)), np.full(len(values), window))
    full = np.arange(len(values)) >= window - 1  # only full windows count
    smooth = np.where(full, smooth, np.nan)
    running_min = pd.Series(smooth).cummin().to_numpy()
    with np.errstate(invalid="ignore"):
        rise = smooth > running_min * (1 + margin)
    i = first_true(~np.isfinite(values) | rise)
    if i is None:
        return Alarm(None)
    if not math.isfinite(values[i]):
        return Alarm(i, "non-finite loss")
    return Alarm(i, f"smoothed {smooth[i]:.4f} > {1 + margin:g} x minimum {running_min[i]:.4f}")


def collapse_alarm(
    spec: RunSpec, curve: pd.DataFrame, policy: GatePolicy, every_steps: int, log: Path
) -> tuple[Alarm, OnlineMonitor]:
    """Replay the curve through the online monitor, checking every ``every_steps`` rows until
    its first alarm and once more at the end (the log's last line covers the rest of the run;
    the residuals for the figure and the peak do not depend on the checks)."""
    log.unlink(missing_ok=True)
    monitor = OnlineMonitor(spec, log, policy)
    steps = curve["step"].to_numpy()
    found = Alarm(None)
    for i, (step, t_hat, loss) in enumerate(curve[["step", "t_hat", "loss"]].itertuples(False)):
        monitor.observe(int(step), float(t_hat), float(loss))
        due = (i + 1) % every_steps == 0 or not math.isfinite(loss)
        if (due and found.index is None) or i == len(steps) - 1:
            verdict = monitor.check()
            if verdict.alarm and found.index is None:
                found = Alarm(i, verdict.message)
    return replace(found, **_peak(monitor, policy)), monitor


def _peak(monitor: OnlineMonitor, policy: GatePolicy) -> dict:
    """The largest finite |residual| inside the gate window, and the threshold it is held to:
    how far a missed fault stayed below the alarm, and how close the clean runs came to it."""
    t, r = monitor.residuals()
    inside = (t >= policy.window[0]) & (t <= policy.window[1]) & np.isfinite(r)
    peak = float(np.abs(r[inside]).max()) if inside.any() else None
    return {"peak_residual": peak, "threshold": monitor.threshold}


def outcome(alarm_t: float | None, fault_t: float | None) -> str:
    if fault_t is None:  # a clean run
        return "quiet" if alarm_t is None else "false alarm"
    if alarm_t is None:
        return "missed"
    return "detected" if alarm_t >= fault_t - 1e-9 else "false alarm (before the fault)"


def fault_t_hat(spec: RunSpec) -> float | None:
    """First faulty t_hat (0 for wrong_tau, a fault from the start); None for a clean run."""
    kind = spec.fault.kind
    if kind == "none":
        return None
    if kind == "wrong_tau":
        return 0.0
    step = max(1, round(spec.fault.at_fraction * spec.optim.steps))
    return step / spec.optim.steps


def own_size_reference(clean: list[RunSpec], runs_csv: Path, out_dir: Path) -> Path | None:
    """reference.csv from the clean seeds of the faulted size (None: no such seed)."""
    if not clean:
        return None
    from collapse.analysis import build_reference

    folder = out_dir / "own_size_reference"
    paths = [Path(s.run_dir) / "curve.parquet" for s in clean]
    build_reference(paths, runs_csv, [clean[0].size], folder)
    return folder / "reference.csv"


def detect_run(
    spec: RunSpec,
    policy: GatePolicy,
    detectors: DetectorSpec,
    out_dir: Path,
    own_reference: Path | None = None,
    in_own_reference: bool = False,
    reference_tau: float | None = None,
) -> tuple[list[dict], dict]:
    """The detectors on one run: detection rows, plus what the figure needs."""
    curve = pd.read_parquet(Path(spec.run_dir) / "curve.parquet").sort_values("step")
    steps, t_hat = curve["step"].to_numpy(), curve["t_hat"].to_numpy()
    loss = curve["loss"].to_numpy(float)
    log = out_dir / "monitor" / f"{spec.run}.jsonl"
    log.parent.mkdir(parents=True, exist_ok=True)
    found = {}
    found["collapse"], monitor = collapse_alarm(
        spec, curve, policy, detectors.monitor_every_steps, log
    )
    if own_reference is not None:
        own = spec.model_copy(
            update={
                "monitor": spec.monitor.model_copy(update={"reference_csv": str(own_reference)})
            }
        )
        own_log = out_dir / "monitor" / f"{spec.run}.own_size.jsonl"
        found["collapse_own_size"], _ = collapse_alarm(
            own, curve, policy, detectors.monitor_every_steps, own_log
        )
    found["spike"] = spike_alarm(loss, detectors.spike_window_steps, detectors.spike_k_sigma)
    found["rise"] = rise_alarm(loss, steps, detectors.rise_window_steps, detectors.rise_margin)
    if reference_tau is not None:
        checked = controls.audit(
            curve,
            spec.optim.warmup_steps,
            spec.optim.steps,
            reference_tau,
            detectors.controls_tolerance,
        )
        found["controls"] = Alarm(
            checked.index, checked.detail(steps), checked.peak_deviation, checked.tolerance
        )
    at = fault_t_hat(spec)
    name = spec.fault.name or ("clean" if spec.fault.kind == "none" else spec.fault.kind)
    rows = []
    for detector in DETECTORS:
        if detector not in found:
            continue
        alarm = found[detector]
        alarm_t = None if alarm.index is None else float(t_hat[alarm.index])
        verdict = outcome(alarm_t, at)
        if detector == "collapse_own_size" and in_own_reference:
            verdict = "in reference"
        rows.append(
            {
                "run": spec.run,
                "fault": name,
                "kind": spec.fault.kind,
                "seed": spec.optim.seed,
                "fault_t_hat": at,
                "detector": detector,
                "alarm_t_hat": alarm_t,
                "alarm_step": None if alarm.index is None else int(steps[alarm.index]),
                "delay": None if alarm_t is None or at is None else alarm_t - at,
                "outcome": verdict,
                "peak_residual": alarm.peak_residual,
                "threshold": alarm.threshold,
                "detail": alarm.detail,
            }
        )
    r_t, r = monitor.residuals()
    panel = {
        "run": spec.run,
        "fault": name,
        "t_hat": t_hat,
        "loss": loss,
        "residual_t_hat": r_t,
        "residual": r,
        "threshold": monitor.threshold,
        "fault_t_hat": at,
        "alarms": {row["detector"]: row["alarm_t_hat"] for row in rows},
    }
    return rows, panel


def detection_table(detections: pd.DataFrame) -> pd.DataFrame:
    """One row per run: the fault, where it starts, and each detector's alarm t_hat/outcome."""
    rows = []
    for run, group in detections.groupby("run", sort=False):
        first = group.iloc[0]
        row = {"run": run, "fault": first["fault"], "fault_t_hat": first["fault_t_hat"]}
        for _, d in group.iterrows():
            at = "never" if pd.isna(d["alarm_t_hat"]) else f"{d['alarm_t_hat']:.3f}"
            peak = "" if pd.isna(d["peak_residual"]) else f"; peak {d['peak_residual']:.3f}"
            row[d["detector"]] = f"{at} ({d['outcome']}{peak})"
        rows.append(row)
    table = pd.DataFrame(rows)
    table["fault_t_hat"] = table["fault_t_hat"].map(lambda x: "" if pd.isna(x) else f"{x:.3f}")
    return table


def summary_lines(detections: pd.DataFrame) -> list[str]:
    """The targets, in words: every fault detected, no false alarm, collapse first for a-c."""
    lines = []
    faults = detections[detections["kind"] != "none"]
    clean = detections[detections["kind"] == "none"]
    for detector in DETECTORS:
        if not (detections["detector"] == detector).any():
            continue
        mine = faults[faults["detector"] == detector]
        caught = (mine["outcome"] == "detected").sum()
        false = (clean[clean["detector"] == detector]["outcome"] == "false alarm").sum()
        false += (mine["outcome"] == "false alarm (before the fault)").sum()
        lines.append(
            f"- {detector}: {caught} of {len(mine)} faults detected; {false} false alarm(s) "
            f"({len(clean[clean['detector'] == detector])} clean runs)"
        )
        if detector in COLLAPSE_DETECTORS:
            lines.append(_margin_line(detections[detections["detector"] == detector]))
    lines.append(_first_line(faults))
    return lines


def _first_line(faults: pd.DataFrame) -> str:
    """Which detector saw each fault first: the detectors as one suite."""
    firsts = []
    for _, rows in faults.groupby("run", sort=False):
        hits = rows[rows["outcome"] == "detected"].sort_values("alarm_t_hat", kind="stable")
        label = rows["fault"].iloc[0]
        if len(hits):
            first = hits.iloc[0]
            firsts.append(f"{label} by {first['detector']} at {first['alarm_t_hat']:.3f}")
        else:
            firsts.append(f"{label} missed")
    caught = sum(not f.endswith("missed") for f in firsts)
    total = faults["run"].nunique()
    listed = "; ".join(firsts)
    return f"- all detectors together: {caught} of {total} faults detected ({listed})"


def _margin_line(rows: pd.DataFrame) -> str:
    """Peak |residual| of the clean runs and the missed faults against the threshold: a missed
    fault whose peak lies among the clean runs' is below this family's noise, not just late."""
    threshold = rows["threshold"].dropna()
    clean = rows[(rows["kind"] == "none") & (rows["outcome"] != "in reference")]
    clean_peaks = clean["peak_residual"].dropna()
    missed = rows[rows["outcome"] == "missed"].dropna(subset=["peak_residual"])
    parts = [f"threshold {threshold.iloc[0]:.3f}" if len(threshold) else "no threshold"]
    if len(clean_peaks):
        lo, hi = f"{clean_peaks.min():.3f}", f"{clean_peaks.max():.3f}"
        parts.append(f"clean runs' peak |r| {lo}" + ("" if lo == hi else f"-{hi}"))
    if len(missed):
        parts.append(
            "missed: "
            + ", ".join(
                f"{f} peak {p:.3f}"
                for f, p in zip(missed["fault"], missed["peak_residual"], strict=True)
            )
        )
    return "  - " + "; ".join(parts)


def plot_detections(panels: list[dict], path: Path) -> Path:
    from matplotlib.lines import Line2D

    from collapse.plotting import Figure, save

    n = len(panels)
    fig = Figure(figsize=(3.2 * n + 0.8, 5.6))
    axes = fig.subplots(2, n, sharex=True, squeeze=False)
    colours = {
        "collapse": "tab:red",
        "collapse_own_size": "tab:purple",
        "spike": "tab:blue",
        "rise": "tab:green",
        "controls": "tab:orange",
    }
    clean = next((p for p in panels if p["fault_t_hat"] is None), None)
    for j, p in enumerate(panels):
        top, bottom = axes[0, j], axes[1, j]
        if clean is not None and p is not clean:
            top.plot(clean["t_hat"], clean["loss"], color="0.7", lw=0.8, label=clean["run"])
        top.plot(p["t_hat"], p["loss"], color="black", lw=0.8, label=p["run"])
        bottom.plot(p["residual_t_hat"], p["residual"], color="black", lw=1.0)
        bottom.axhline(p["threshold"], color="tab:red", ls=":", lw=0.8)
        bottom.axhline(-p["threshold"], color="tab:red", ls=":", lw=0.8)
        bottom.axhline(0, color="0.6", lw=0.5)
        for ax in (top, bottom):
            if p["fault_t_hat"] is not None:
                ax.axvline(p["fault_t_hat"], color="black", ls="--", lw=0.9)
            for detector, at in p["alarms"].items():
                if at is not None:
                    ax.axvline(at, color=colours[detector], lw=1.2, alpha=0.8)
        finite = p["loss"][np.isfinite(p["loss"])]
        if len(finite):
            lo, hi = np.percentile(finite, [0.5, 99.5])
            top.set_ylim(lo - 0.05 * (hi - lo), hi + 0.1 * (hi - lo))
        finite_r = p["residual"][np.isfinite(p["residual"])]
        if len(finite_r):
            bound = max(2.5 * p["threshold"], float(np.abs(finite_r).max()) * 1.1)
            bottom.set_ylim(-bound, bound)
        start = "" if p["fault_t_hat"] is None else f" from t̂ {p['fault_t_hat']:.2f}"
        top.set_title(f"{p['fault']}{start}", fontsize=9)
        bottom.set_xlabel("t̂ (fraction of training)")
    axes[0, 0].set_ylabel("raw training loss (nats/token)")
    axes[1, 0].set_ylabel("residual r = ℓ_run − ℓ_ref")
    shown = {d for p in panels for d in p["alarms"]}
    handles = [
        Line2D([], [], color=c, lw=1.2, label=f"{d} alarm")
        for d, c in colours.items()
        if d in shown
    ] + [
        Line2D([], [], color="black", ls="--", lw=0.9, label="fault starts"),
        Line2D([], [], color="tab:red", ls=":", lw=0.8, label="gate threshold"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=7, fontsize=8, frameon=False)
    fig.suptitle("Fault detection: collapse monitor vs raw-loss detectors (grey: clean seed)")
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    return save(fig, path, pdf=True)


def run_experiment(
    specs: list[RunSpec],
    policy: GatePolicy,
    detectors: DetectorSpec,
    out_dir: Path,
    runs_csv: Path | None = None,
) -> pd.DataFrame:
    """detections.csv, detections.md and detections.png in ``out_dir``; returns the rows.

    With ``runs_csv`` (the plan's runs.csv) the own-size reference is built from the clean
    seeds that are not the faults' seed, and ``collapse_own_size`` runs too."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, panels = [], []
    clean_first = sorted(specs, key=lambda s: (s.fault.kind != "none", s.optim.seed, s.run))
    fault_seeds = {s.optim.seed for s in specs if s.fault.kind != "none"}
    others = [s for s in specs if s.fault.kind == "none" and s.optim.seed not in fault_seeds]
    own = own_size_reference(others, runs_csv, out_dir) if runs_csv is not None else None
    for spec in clean_first:
        mine, panel = detect_run(
            spec,
            policy,
            detectors,
            out_dir,
            own,
            in_own_reference=spec in others,
            reference_tau=controls.reference_tau(spec.monitor.reference_csv, runs_csv),
        )
        rows += mine
        panels.append(panel)
    detections = pd.DataFrame(rows, columns=DETECTIONS_COLUMNS)
    detections.to_csv(out_dir / "detections.csv", index=False, float_format="%.6g")
    table = detection_table(detections)
    text = [
        "Alarm t̂ of each detector (first alarm; 'never': it did not fire) and its outcome.",
        "",
        table.to_markdown(index=False),
        "",
        *summary_lines(detections),
        "",
    ]
    (out_dir / "detections.md").write_text("\n".join(text))
    plot_detections(panels, out_dir / "detections.png")
    return detections
