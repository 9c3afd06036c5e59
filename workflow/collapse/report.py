"""The family's report: the paper's figures and tables, regenerated from results/<family>/.

``build_report`` reads whatever the stages have written (see ``collapse.layout`` and
workflow/rules/*.smk) and writes into one folder: figures as PNG and PDF, tables as CSV and
Markdown, and ``index.md`` linking all of them. A stage that has not run yet (no sweeps, no
evals) is skipped with a line in index.md that says what is missing, never an error, so the
report can be rebuilt at any point of a family's life. Every figure and table is registered
once in ``collapse.artifacts`` (file, section, captions); the report writes the long captions
as captions/<name>.rst for Snakemake's ``--report``.

The letters that name this module's parts: (a) collapse curves, (b) Delta against sigma,
(c) gates, (d) sweeps, (e) downstream accuracy against FLOPs, (f) the family table.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.ticker import NullFormatter

from collapse import curves as C
from collapse.artifacts import ARTIFACTS, SECTIONS, artifact, section
from collapse.layout import FamilyLayout
from collapse.plotting import Figure, draw_collapse_curves, size_colours, visible_limits
from collapse.reference import ALIGN_WINDOW, ReferenceCurve, aligned_residuals
from collapse.roles import Role

PUBLISHED_RESULTS = Path(__file__).resolve().parent / "data" / "published_results.csv"
CELERITY_OVERRIDES = ("family=celerity", "cluster=slurm_h100")
CELERITY_RELEASED_TPP = (
    234.0  # the released Celerity models are the 234-TPP band (docs/method.md §8)
)
TASK_COLUMNS = ("arc_c", "arc_e", "boolq", "hellaswag", "piqa", "siqa", "winogrande")
# lm-eval task names (as the evaluation writes them) -> published_results.csv columns
TASK_ALIASES = {"arc_challenge": "arc_c", "arc_easy": "arc_e", "social_iqa": "siqa"}


@dataclass
class _Report:
    """What build_report has written and what it had to skip, in index.md order."""

    out: Path
    files: list[Path] = field(default_factory=list)
    figures: dict[str, tuple[Path, Path]] = field(default_factory=dict)  # name -> (png, pdf)
    tables: dict[str, Path] = field(default_factory=dict)  # name -> markdown
    sections: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def figure(self, fig: Figure, name: str) -> None:
        artifact(name, "figure")  # only registered figures are written
        paths = [self.out / f"{name}.{ext}" for ext in ("png", "pdf")]
        for path in paths:
            fig.savefig(path, dpi=130)
        self.files += paths
        self.figures[name] = (paths[0], paths[1])

    def copied_figure(self, png: Path, pdf: Path, name: str) -> None:
        """A figure another stage drew (its PNG and, if there is one, its PDF)."""
        artifact(name, "figure")
        copy = Path(shutil.copy2(png, self.out / f"{name}.png"))
        copy_pdf = Path(shutil.copy2(pdf, self.out / f"{name}.pdf")) if pdf.is_file() else copy
        self.files += [copy] + ([copy_pdf] if copy_pdf != copy else [])
        self.figures[name] = (copy, copy_pdf)

    def table(
        self,
        frame: pd.DataFrame,
        name: str,
        shown: pd.DataFrame | None = None,
        markdown: str | None = None,
    ) -> None:
        """<name>.csv of ``frame`` and <name>.md of ``shown`` (or the ``markdown`` given)."""
        artifact(name, "table")
        csv, md = self.out / f"{name}.csv", self.out / f"{name}.md"
        frame.to_csv(csv, index=False, float_format="%.10g")
        if markdown is None:
            markdown = _markdown(frame if shown is None else shown) + "\n"
        md.write_text(markdown)
        self.files += [csv, md]
        self.tables[name] = md

    def copied_table(self, csv: Path, md: Path, name: str) -> None:
        """A table another stage wrote (CSV and Markdown)."""
        artifact(name, "table")
        copies = [Path(shutil.copy2(src, self.out / f"{name}{src.suffix}")) for src in (md, csv)]
        self.files += copies
        self.tables[name] = copies[0]

    def add_section(self, key: str, extra: str = "") -> None:
        """The section's figures, then its tables, as registered and as written."""
        lines = [f"## {section(key).title}", ""]
        for a in ARTIFACTS:
            if a.section == key and a.kind == "figure" and a.name in self.figures:
                png, pdf = self.figures[a.name]
                lines += [
                    f"![{a.summary}]({png.name})",
                    "",
                    f"*{a.summary}* ([PDF]({pdf.name}))",
                    "",
                ]
        for a in ARTIFACTS:
            if a.section == key and a.kind == "table" and a.name in self.tables:
                md = self.tables[a.name]
                lines += [
                    f"**{a.summary}** ([CSV]({a.name}.csv), [Markdown]({md.name}))",
                    "",
                    md.read_text().rstrip(),
                    "",
                ]
        self.sections.append("\n".join(lines) + extra)

    def captions(self) -> None:
        """captions/<name>.rst: the caption of every artifact Snakemake's --report shows."""
        folder = self.out / "captions"
        folder.mkdir(exist_ok=True)
        for a in ARTIFACTS:
            if a.category:
                path = folder / f"{a.name}.rst"
                path.write_text(a.caption + "\n")
                self.files.append(path)


# ---------------------------------------------------------------- formatting


def _si(x) -> str:
    """1.2e9 -> 1.2G: parameters, tokens and FLOPs read at a glance in tables."""
    if x is None or not np.isfinite(x):
        return ""
    for unit, scale in (("E", 1e18), ("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def _fixed(digits: int):
    return lambda x: "" if x is None or pd.isna(x) else f"{x:.{digits}f}"


def _markdown(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "(no rows)"
    return frame.astype(object).where(frame.notna(), "").to_markdown(index=False)


def _percent(acc) -> float:
    """Accuracy in %: lm-eval writes fractions (0-1), Table 10 percent; an average over the
    seven tasks is never below 1 %, so a value <= 1 is a fraction."""
    if acc is None or pd.isna(acc):
        return np.nan
    return 100.0 * float(acc) if float(acc) <= 1.0 else float(acc)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _band_label(band: float) -> str:
    return f"{band:g}"


# ---------------------------------------------------------------- loading


def load_runs(layout: FamilyLayout) -> pd.DataFrame | None:
    """The plan's runs.csv (RUNS_COLUMNS), or None before the plan exists."""
    path = layout.plan_dir / "runs.csv"
    if not path.is_file():
        return None
    runs = pd.read_csv(path)
    runs["sweep"] = runs["sweep"].fillna("").astype(str)
    return runs


def load_curve_matrix(layout: FamilyLayout, runs: pd.DataFrame) -> C.CurveMatrix | None:
    """Smoothed curves of every run that has a curve.parquet, on the common t_hat grid."""
    from collapse.analysis import load_matrix

    paths = [layout.curve(r) for r in runs["run"] if layout.curve(r).is_file()]
    if not paths:
        return None
    return load_matrix(paths, layout.plan_dir / "runs.csv")


def load_reference(layout: FamilyLayout, band: float) -> tuple[ReferenceCurve, dict] | None:
    """reference.csv of a band with its summary (sizes, offset, align window), if built."""
    folder = layout.reference_dir / f"tpp{_band_label(band)}"
    if not (folder / "reference.csv").is_file():
        return None
    summary = _read_json(folder / "reference.json") or {}
    curve = ReferenceCurve.read_csv(folder / "reference.csv")
    curve = ReferenceCurve(**{**curve.__dict__, "sizes": summary.get("reference_sizes", [])})
    return curve, summary


def load_gates(layout: FamilyLayout, runs: pd.DataFrame | None = None) -> dict[str, dict]:
    """Every gate verdict JSON under gates/, by run, in the plan's order where known."""
    verdicts = {}
    for path in sorted((layout.root / "gates").glob("*.json")):
        verdict = _read_json(path)
        if verdict and "run" in verdict:
            verdicts[verdict["run"]] = verdict | {"_png": path.with_suffix(".png")}
    order = {run: i for i, run in enumerate(runs["run"])} if runs is not None else {}
    return dict(sorted(verdicts.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))


def load_evals(layout: FamilyLayout) -> dict[str, dict]:
    """Every evals/<run>.json (collapse.evaluate), by run."""
    evals = {}
    for path in sorted((layout.root / "evals").glob("*.json")):
        result = _read_json(path)
        if result is not None:
            evals[result.get("run", path.stem)] = result
    return evals


def _size_order(runs: pd.DataFrame) -> list[str]:
    return list(runs.groupby("size")["params"].median().sort_values().index.astype(str))


# ---------------------------------------------------------------- (a) collapse curves


@dataclass
class _Band:
    band: float
    matrix: C.CurveMatrix  # the band's family runs that have curves
    reference: ReferenceCurve | None
    offset: float
    align_window: tuple[float, float]
    residual: np.ndarray | None  # early-aligned r = ell_run - ell_ref, per run
    ell: np.ndarray  # own L(T) for complete runs, early-aligned L(T) for partial ones


def _bands(layout: FamilyLayout, runs: pd.DataFrame, matrix: C.CurveMatrix) -> list[_Band]:
    family = runs[runs["role"] == Role.FAMILY]
    out = []
    for band in sorted(family["tpp_band"].unique()):
        names = set(family.loc[family["tpp_band"] == band, "run"])
        mask = matrix.meta.index.isin(names)
        if not mask.any():
            continue
        part = matrix.select(mask)
        loaded = load_reference(layout, band)
        reference, summary = loaded if loaded else (None, {})
        offset = float(summary.get("offset", 0.0) or 0.0)
        window = tuple(summary.get("align_window", ALIGN_WINDOW))
        final = part.meta["final_loss"].to_numpy(float)
        residual = None
        if reference is not None:
            residual, aligned = aligned_residuals(part, reference.at(part.grid), window, offset)
            final = np.where(np.isfinite(final), final, aligned)
        ell = C.normalize(part.loss, final, offset)
        out.append(_Band(float(band), part, reference, offset, window, residual, ell))
    return out


def plot_collapse_curves(
    bands: list[_Band], sizes: list[str], thresholds: dict[float, float]
) -> Figure:
    """Figure (a): one column per band; normalized curves on top, residuals below."""
    colours = size_colours(sizes)
    n = len(bands)
    fig = Figure(figsize=(5.2 * n + 1.0, 7.2), layout="constrained")
    axes = fig.subplots(2, n, sharex=True, squeeze=False, gridspec_kw=dict(height_ratios=[3, 2]))
    for k, b in enumerate(bands):
        top, bottom = axes[0, k], axes[1, k]
        labels = C.size_labels(b.matrix.meta).to_numpy()
        complete = np.isfinite(b.matrix.meta["final_loss"].to_numpy(float))
        draw_collapse_curves(
            top,
            b.matrix.grid,
            b.ell,
            labels,
            colours,
            reference=b.reference,
            complete=complete,
            offset=b.offset,
        )
        top.set_title(
            f"TPP {_band_label(b.band)}: {len(labels)} runs, {len(set(labels))} sizes", fontsize=11
        )
        _draw_band_residuals(bottom, b, labels, complete, colours, thresholds.get(b.band))
    fig.suptitle("Collapse of the normalized training loss across sizes", fontsize=12)
    return fig


def _draw_band_residuals(ax, b: _Band, labels, complete, colours, threshold: float | None):
    """The band's early-aligned residuals, with the gate threshold and the align window."""
    ax.set_ylabel("residual ℓ_run − ℓ_ref (early-aligned)")
    ax.set_xlabel("fraction of training t̂ = step / total steps")
    ax.grid(alpha=0.3)
    ax.set_xlim(0, 1)
    if b.residual is None:
        ax.text(
            0.5,
            0.5,
            "no reference curve for this band yet",
            ha="center",
            va="center",
            transform=ax.transAxes,
        )
        return
    for i, size in enumerate(labels):
        style = dict(color=colours.get(size, "C3"), lw=1.1, alpha=0.85)
        ax.plot(b.matrix.grid, b.residual[i], ls="-" if complete[i] else ":", **style)
    ax.axhline(0, color="k", lw=0.8)
    limit = visible_limits(np.abs(b.residual), b.matrix.grid, 0.0)[1]
    if threshold is not None:
        for sign in (1, -1):
            ax.axhline(
                sign * threshold,
                color="C3",
                ls="--",
                lw=1,
                label=f"gate threshold ±{threshold:.3g}" if sign > 0 else None,
            )
        limit = max(limit, threshold)
        ax.legend(fontsize=8, loc="upper left")
    ax.set_ylim(-1.25 * limit, 1.25 * limit)
    ax.axvspan(*b.align_window, color="C2", alpha=0.08)
    ax.text(
        np.mean(b.align_window),
        0.04,
        "align window",
        transform=ax.get_xaxis_transform(),
        ha="center",
        fontsize=7,
        color="C2",
    )


# ---------------------------------------------------------------- (b) Delta vs sigma


def load_collapse_stats(layout: FamilyLayout, bands: list[float]) -> dict[float, dict]:
    """collapse/tpp<band>/collapse.json per band (from analysis.family_statistics)."""
    stats = {}
    for band in bands:
        folder = layout.root / "collapse" / f"tpp{_band_label(band)}"
        payload = _read_json(folder / "collapse.json")
        if payload is None and (folder / "delta_sigma.csv").is_file():  # the table alone
            table = pd.read_csv(folder / "delta_sigma.csv")
            sigma_cols = [c for c in table.columns if c.startswith("sigma_") and c != "sigma_mean"]
            payload = {
                "t_hat": table["t_hat"].tolist(),
                "delta": table["delta"].tolist(),
                "sigma": {c.removeprefix("sigma_"): table[c].tolist() for c in sigma_cols},
                "sigma_mean": table.get("sigma_mean", pd.Series(dtype=float)).tolist(),
            }
        if payload is not None and payload.get("t_hat"):
            stats[band] = payload
    return stats


def _arr(values) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def plot_delta_sigma(stats: dict[float, dict], sizes: list[str]) -> Figure:
    """Figure (b): Delta(t_hat) and sigma(t_hat) per band, log scale, in percent."""
    colours = size_colours(sizes)
    n = len(stats)
    fig = Figure(figsize=(5.2 * n + 1.0, 4.4), layout="constrained")
    axes = fig.subplots(1, n, squeeze=False, sharey=True)[0]
    verdicts = {True: "supercollapse", False: "no supercollapse", None: "no seed noise floor"}
    for ax, (band, s) in zip(axes, stats.items(), strict=True):
        t = _arr(s["t_hat"])
        keep = t < 1.0 - 1e-9  # at t_hat = 1 every ell is 1: Delta is 0 by construction
        ax.plot(t[keep], 100 * _arr(s["delta"])[keep], "k", lw=1.8, label="Δ across sizes, seeds")
        for size, sigma in (s.get("sigma") or {}).items():
            ax.plot(
                t[keep],
                100 * _arr(sigma)[keep],
                ls="--",
                lw=1.1,
                color=colours.get(size, "C1"),
                label=f"σ seed noise, {size}",
            )
        if "late_window" in s:
            ax.axvspan(*s["late_window"], color="C1", alpha=0.07, label="late window")
        ax.set_yscale("log")
        ax.set_xlim(0, 1)
        ax.set_xlabel("fraction of training t̂")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        title = f"TPP {_band_label(band)}"
        if "score" in s:
            title += f": score {s['score']:.4f}, {verdicts.get(s.get('supercollapse'))}"
        ax.set_title(title, fontsize=10)
    axes[0].set_ylabel("relative spread of the loss (%)")
    fig.suptitle("Collapse deviation Δ against the seed noise floor σ", fontsize=12)
    return fig


def collapse_summary(stats: dict[float, dict]) -> pd.DataFrame:
    rows = [
        {
            "tpp_band": band,
            "runs": len(s.get("runs", [])) or None,
            "sizes": ", ".join(s.get("sizes", [])),
            "score_mean_delta": s.get("score"),
            "delta_over_sigma_late": s.get("delta_over_sigma"),
            "supercollapse": s.get("supercollapse"),
            "excluded_incomplete": ", ".join(s.get("excluded_incomplete", [])),
        }
        for band, s in stats.items()
    ]
    return pd.DataFrame(rows)


# ---------------------------------------------------------------- (c) gates


def gates_table(gates: dict[str, dict], runs: pd.DataFrame | None) -> pd.DataFrame:
    info = runs.set_index("run") if runs is not None else pd.DataFrame()
    rows = []
    for run, v in gates.items():
        rows.append(
            {
                "run": run,
                "size": info["size"].get(run) if "size" in info else None,
                "tpp_band": info["tpp_band"].get(run) if "tpp_band" in info else None,
                "status": v.get("status"),
                "max_abs_residual": v.get("max_abs_residual"),
                "at_t_hat": v.get("at_t_hat"),
                "first_crossing_t_hat": v.get("first_crossing_t_hat"),
                "threshold": v.get("threshold"),
                "evidence": f"gates/{run}.png" if v["_png"].is_file() else "",
                "message": v.get("message", ""),
            }
        )
    return pd.DataFrame(rows)


def plot_gate_summary(table: pd.DataFrame) -> Figure:
    """Figure (c): max |r| over the gate window / threshold per run; 1 is the threshold."""
    ratio = (table["max_abs_residual"] / table["threshold"]).to_numpy(float)
    colour = {"pass": "C0", "fail": "C3", "overridden": "C1", "undetermined": "0.7"}
    fig = Figure(figsize=(7.5, 1.2 + 0.32 * len(table)), layout="constrained")
    ax = fig.subplots()
    y = np.arange(len(table))
    ax.barh(y, np.nan_to_num(ratio), color=[colour.get(s, "0.5") for s in table["status"]])
    ax.set_yticks(y, [f"{r}  [{s}]" for r, s in zip(table["run"], table["status"], strict=True)])
    ax.invert_yaxis()
    ax.axvline(1.0, color="C3", ls="--", lw=1.2, label="gate threshold")
    ax.set_xlabel("max |residual| over the gate window / threshold")
    ax.set_title("Collapse gates: how close each run came to its threshold", fontsize=11)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, axis="x")
    return fig


# ---------------------------------------------------------------- (d) sweeps


def load_sweeps(layout: FamilyLayout) -> tuple[pd.DataFrame, pd.DataFrame]:
    """All sweeps' predictions.csv and metrics.csv, each with a ``sweep`` column."""
    from collapse.sweep import sweep_metrics, truth_from_predictions

    predictions, metrics = [], []
    for folder in sorted(p for p in (layout.root / "sweeps").glob("*") if p.is_dir()):
        pred_path, metrics_path = folder / "predictions.csv", folder / "metrics.csv"
        if not pred_path.is_file():
            continue
        pred = pd.read_csv(pred_path)
        pred["sweep"] = folder.name
        predictions.append(pred)
        if metrics_path.is_file():  # blank run names (the random baseline) must stay strings
            met = pd.read_csv(metrics_path, dtype={"selected_run": str, "best_run": str})
            met[["selected_run", "best_run"]] = met[["selected_run", "best_run"]].fillna("")
        else:  # predictions without metrics: derive them (the sweep module's own rule)
            met = sweep_metrics(pred, truth_from_predictions(pred))
        met["sweep"] = folder.name
        metrics.append(met)
    if not predictions:
        return pd.DataFrame(), pd.DataFrame()
    return pd.concat(predictions, ignore_index=True), pd.concat(metrics, ignore_index=True)


def _variant_label(run: str, sweep: str, size: str | None) -> str:
    """sweep-tau-d128-tau0.1-s0 -> tau0.1: the varied setting, what a legend needs."""
    label = run.removeprefix(f"sweep-{sweep}-")
    if size and label.startswith(f"{size}-"):
        label = label.removeprefix(f"{size}-")
    return re.sub(r"-s\d+$", "", label)


def plot_sweep_predictions(predictions: pd.DataFrame, runs: pd.DataFrame | None) -> Figure:
    """Figure (d): predicted final loss vs fraction trained; one row per sweep, one column per
    method, one colour per variant, its true final loss as a horizontal line."""
    sizes = runs.set_index("run")["size"].astype(str) if runs is not None else pd.Series()
    sweeps = list(pd.unique(predictions["sweep"]))
    methods = list(pd.unique(predictions["method"]))
    fig = Figure(figsize=(4.3 * len(methods) + 1.0, 3.8 * len(sweeps)), layout="constrained")
    axes = fig.subplots(len(sweeps), len(methods), squeeze=False, sharey="row")
    for i, sweep in enumerate(sweeps):
        rows = predictions[predictions["sweep"] == sweep]
        variants = list(pd.unique(rows["run"]))
        for j, method in enumerate(methods):
            ax = axes[i, j]
            for k, run in enumerate(variants):
                r = rows[(rows["run"] == run) & (rows["method"] == method)].sort_values("fraction")
                colour = f"C{k % 10}"
                label = _variant_label(run, sweep, sizes.get(run))
                x = 100 * r["fraction"].to_numpy(float)
                y = r["predicted_final_loss"].to_numpy(float)
                if {"lower", "upper"} <= set(r.columns):
                    err = np.vstack([y - r["lower"].to_numpy(float), r["upper"] - y])
                    ax.errorbar(
                        x,
                        y,
                        yerr=np.clip(err, 0, None),
                        color=colour,
                        marker="o",
                        ms=4,
                        capsize=3,
                        lw=1.2,
                        label=label,
                    )
                else:
                    ax.plot(x, y, "o-", color=colour, ms=4, label=label)
                truth = r["true_final_loss"].dropna() if "true_final_loss" in r else []
                if len(truth):
                    ax.axhline(float(truth.iloc[0]), color=colour, ls="--", lw=0.9, alpha=0.8)
            ax.set_title(f"sweep {sweep}: {method}", fontsize=10)
            ax.set_xlabel("training stopped at (% of the full run)")
            ax.grid(alpha=0.3)
            if j == 0:
                ax.set_ylabel("predicted final loss (nats/token)")
                ax.legend(fontsize=8, title="variant (dashed: true)", title_fontsize=8)
    fig.suptitle("Early stopping: final loss predicted from partial curves", fontsize=12)
    return fig


def sweep_predictions_table(predictions: pd.DataFrame) -> pd.DataFrame:
    """One row per sweep, run and fraction; one predicted-loss column per method."""
    wide = predictions.pivot_table(
        index=["sweep", "run", "fraction"],
        columns="method",
        values="predicted_final_loss",
        aggfunc="first",
    )
    wide.columns = [f"predicted_{m}" for m in wide.columns]
    truth = predictions.groupby(["sweep", "run"])["true_final_loss"].first()
    wide = wide.reset_index()
    wide["true_final_loss"] = [truth.get((s, r)) for s, r in zip(wide.sweep, wide.run, strict=True)]
    return wide


# ---------------------------------------------------------------- (e) downstream vs FLOPs


def read_published(path: Path = PUBLISHED_RESULTS) -> pd.DataFrame:
    """Table 10 of the paper: accuracies in %, params, tokens and training FLOPs."""
    return pd.read_csv(path, comment="#")


def celerity_table(celerity_plan=None) -> pd.DataFrame:
    """Celerity's released sizes (234 TPP) with the planner's params, tokens and FLOPs.

    ``celerity_plan``: a ``collapse.plan.Plan`` or its runs table; None plans the celerity
    family spec (config/family/celerity.yaml on the H100 cluster spec, a second of CPU).
    """
    if celerity_plan is None:
        from collapse.config import load_config
        from collapse.plan import plan_family

        celerity_plan = plan_family(load_config(list(CELERITY_OVERRIDES)), corpus_tokens=0)
    table = getattr(celerity_plan, "table", celerity_plan)
    released = np.isclose(table["tpp_band"], CELERITY_RELEASED_TPP)
    rows = table[(table["role"] == Role.FAMILY) & released]
    rows = rows.groupby("size", sort=False)[["params", "tokens", "flops"]].first().reset_index()
    rows["model"] = "Celerity-" + rows["size"].astype(str)
    return rows


def pareto_frontier(flops: np.ndarray, accuracy: np.ndarray) -> np.ndarray:
    """Mask of the points no cheaper-or-equal model beats: accuracy above every point with
    fewer or equal training FLOPs (the frontier of max accuracy at <= FLOPs)."""
    flops, accuracy = np.asarray(flops, float), np.asarray(accuracy, float)
    on = np.zeros(len(flops), dtype=bool)
    valid = np.isfinite(flops) & np.isfinite(accuracy)
    best = -np.inf
    for i in sorted(np.flatnonzero(valid), key=lambda i: (flops[i], -accuracy[i])):
        if accuracy[i] > best:
            on[i], best = True, accuracy[i]
    return on


def downstream_table(
    published: pd.DataFrame,
    celerity: pd.DataFrame | None,
    evals: dict[str, dict],
    runs: pd.DataFrame | None,
    family_name: str,
) -> pd.DataFrame:
    """Every model of the accuracy figure: open models, Celerity, this family's evaluated runs."""
    pub = published.copy()
    pub["group"] = np.where(pub["family"] == "Celerity", "Celerity", "open model")
    pub["flops_source"] = "Table 10 (arXiv 2509.25087)"
    if celerity is not None:
        cel = celerity.set_index("model")
        is_cel = pub["model"].isin(cel.index)
        for col in ("params", "tokens", "flops"):
            pub.loc[is_cel, col] = pub.loc[is_cel, "model"].map(cel[col]).astype(float)
        pub.loc[is_cel, "flops_source"] = (
            f"planner: celerity spec, TPP {CELERITY_RELEASED_TPP:g} (Table 9 FLOPs)"
        )
    pub = pub.rename(columns={"avg": "avg_acc_pct"})
    info = runs.set_index("run") if runs is not None else pd.DataFrame()
    own = []
    for run, e in evals.items():
        tasks = e.get("tasks") or {}
        row = {
            "model": run,
            "size": e.get("size", info["size"].get(run) if "size" in info else None),
            "family": family_name,
            "group": "this family",
            "params": e.get("params", info["params"].get(run) if "params" in info else None),
            "tokens": e.get("tokens", info["tokens"].get(run) if "tokens" in info else None),
            "flops": e.get("flops", info["flops"].get(run) if "flops" in info else None),
            "flops_source": "planner: this family's spec",
            "avg_acc_pct": _percent(e.get("average_acc")),
            "eval_limit": e.get("limit"),
            "eval_tasks": len(tasks),
        }
        for name, result in tasks.items():  # "acc", the metric average_acc averages
            row[TASK_ALIASES.get(name, name)] = _percent((result or {}).get("acc"))
        own.append(row)
    table = pd.concat([pub, pd.DataFrame(own)], ignore_index=True) if own else pub
    table["on_frontier"] = pareto_frontier(table["flops"], table["avg_acc_pct"])
    first = ["model", "family", "group", "params", "tokens", "flops", "avg_acc_pct"]
    rest = [c for c in table.columns if c not in first]
    return table[first + rest]


def _spread_labels(y: np.ndarray, gap: float) -> np.ndarray:
    """Label heights at least ``gap`` apart, as close to ``y`` (ascending) as allowed."""
    out = np.array(y, dtype=float)
    for i in range(1, len(out)):
        out[i] = max(out[i], out[i - 1] + gap)
    return out


def _own_label(row: pd.Series) -> str:
    size = row.get("size")
    return size if isinstance(size, str) and size else str(row["model"])


def plot_downstream(table: pd.DataFrame) -> Figure:
    """Figure (e): average accuracy against training FLOPs, log x, with the Pareto frontier.

    A family far below the published models' compute (a CPU demo) gets its own panel on the
    left, so the published range is not squeezed into a corner of a 12-decade axis.
    """
    shown = table[np.isfinite(table["flops"].astype(float)) & table["avg_acc_pct"].notna()].copy()
    shown["flops"] = shown["flops"].astype(float)
    own = shown[shown["group"] == "this family"]
    others = shown[shown["group"] != "this family"]
    split = len(own) and len(others) and own["flops"].max() < others["flops"].min() / 100
    fig = Figure(figsize=(12.5 if split else 10, 6.4), layout="constrained")
    if split:
        ax_own, ax = fig.subplots(1, 2, sharey=True, gridspec_kw=dict(width_ratios=[1, 3]))
        panels = [(ax_own, own), (ax, others)]
    else:
        ax = fig.subplots()
        panels = [(ax, shown)]
    front = shown[shown["on_frontier"]].sort_values("flops")
    for panel, points in panels:
        _draw_downstream_points(panel, points)
        if len(front):
            _draw_frontier(panel, front, points)
        panel.set_xscale("log")
        panel.xaxis.set_minor_formatter(NullFormatter())  # 2x10^12, 3x10^12, ... would overlap
        panel.set_xlabel("training FLOPs")
        panel.grid(alpha=0.3, which="both")
    acc_span = float(shown["avg_acc_pct"].max() - shown["avg_acc_pct"].min()) if len(shown) else 1
    _name_frontier_models(ax, front, acc_span)
    panels[0][0].set_ylabel("average accuracy over 7 tasks (%)")
    if split:
        ax_own.set_title("this family", fontsize=10)
        ax.set_title("published open models and Celerity", fontsize=10)
    handles, labels = [], []
    for panel, _ in panels:
        for h, lab in zip(*panel.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    ax.legend(handles, labels, fontsize=8, loc="lower right")
    fig.suptitle(
        "Downstream accuracy against training compute (arc_c 25-shot, arc_e, boolq, "
        "hellaswag 10-shot, piqa, siqa, winogrande 5-shot)",
        fontsize=11,
    )
    return fig


_DOWNSTREAM_STYLES = {  # group -> (marker style, legend label)
    "open model": (dict(marker="o", color="0.6", ms=6, ls="none"), "open models (Table 10)"),
    "Celerity": (dict(marker="*", color="C1", ms=13, ls="-", lw=1), "Celerity (planner FLOPs)"),
    "this family": (dict(marker="s", color="C0", ms=7, ls="none"), "this family"),
}


def _draw_downstream_points(panel, points: pd.DataFrame) -> None:
    """Each group's models, with Celerity's sizes and this family's sizes named."""
    for group, (style, label) in _DOWNSTREAM_STYLES.items():
        rows = points[points["group"] == group].sort_values("flops")
        if rows.empty:
            continue
        if group == "this family" and rows["eval_limit"].notna().any():
            label += f" (subsampled: {int(rows['eval_limit'].dropna().iloc[0])} examples/task)"
        if group == "this family" and (rows["eval_tasks"] < len(TASK_COLUMNS)).any():
            label += f" ({int(rows['eval_tasks'].min())} of {len(TASK_COLUMNS)} tasks)"
        panel.plot(rows["flops"], rows["avg_acc_pct"], label=label, zorder=3, **style)
        if group == "Celerity":
            for _, r in rows.iterrows():
                panel.annotate(
                    str(r["model"]).removeprefix("Celerity-"),
                    (r["flops"], r["avg_acc_pct"]),
                    xytext=(6, -12),
                    textcoords="offset points",
                    fontsize=8,
                    color="C1",
                )
        if group == "this family":  # one label per size: seeds share the FLOPs
            for _, r in rows.groupby(rows.apply(_own_label, axis=1)).first().iterrows():
                panel.annotate(
                    _own_label(r),
                    (r["flops"], r["avg_acc_pct"]),
                    xytext=(6, -4),
                    textcoords="offset points",
                    fontsize=8,
                    color="C0",
                )


def _draw_frontier(panel, front: pd.DataFrame, points: pd.DataFrame) -> None:
    """The Pareto frontier as a step line across the panel's FLOPs range."""
    lo, hi = points["flops"].min() / 2, points["flops"].max() * 2
    x = np.append(front["flops"].to_numpy(float), hi)
    y = np.append(front["avg_acc_pct"].to_numpy(float), front["avg_acc_pct"].iloc[-1])
    panel.step(
        x,
        y,
        where="post",
        color="k",
        lw=1.3,
        zorder=2,
        label="Pareto frontier: best accuracy at ≤ FLOPs",
    )
    panel.set_xlim(lo, hi)


def _name_frontier_models(ax, front: pd.DataFrame, acc_span: float) -> None:
    """Frontier open models: names to the left, spread so they never overlap."""
    named = front[front["group"] == "open model"]
    if not len(named):
        return
    heights = _spread_labels(named["avg_acc_pct"].to_numpy(float), 0.028 * acc_span)
    for (_, r), h in zip(named.iterrows(), heights, strict=True):
        ax.annotate(
            r["model"],
            (r["flops"], r["avg_acc_pct"]),
            xytext=(r["flops"] / 2.2, h),
            textcoords="data",
            ha="right",
            va="center",
            fontsize=7,
            arrowprops=dict(arrowstyle="-", color="0.5", lw=0.5),
        )


# ---------------------------------------------------------------- (f) family table


def _heldout_loss(layout: FamilyLayout, run: str, evals: dict[str, dict]) -> float:
    """Held-out loss: the evaluation's, else the last one logged in training."""
    if evals.get(run, {}).get("heldout_loss") is not None:
        return float(evals[run]["heldout_loss"])
    meta = _read_json(layout.meta(run)) or {}
    if meta.get("final_valid_loss") is not None:
        return float(meta["final_valid_loss"])
    if layout.valid_curve(run).is_file():
        valid = pd.read_parquet(layout.valid_curve(run)).sort_values("step")
        if len(valid):
            return float(valid["valid_loss"].iloc[-1])
    return np.nan


def family_table(
    layout: FamilyLayout,
    runs: pd.DataFrame,
    matrix: C.CurveMatrix | None,
    evals: dict[str, dict],
    gates: dict[str, dict],
) -> pd.DataFrame:
    """Table (f): one row per planned family run, blank where a stage has not run yet."""
    family = runs[runs["role"] == Role.FAMILY]
    meta = matrix.meta if matrix is not None else pd.DataFrame(columns=["final_loss", "t_hat_max"])
    rows = []
    for _, r in family.iterrows():
        run = r["run"]
        e = evals.get(run, {})
        rows.append(
            {
                "run": run,
                "size": r["size"],
                "tpp_band": r["tpp_band"],
                "seed": r["seed"],
                "params": r["params"],
                "tokens": r["tokens"],
                "epochs": r.get("epochs", np.nan),  # > 1: the run repeats tokens (plan warns)
                "flops": r["flops"],
                "trained_fraction": meta["t_hat_max"].get(run, np.nan),
                "final_train_loss": meta["final_loss"].get(run, np.nan),
                "heldout_loss": _heldout_loss(layout, run, evals),
                "heldout_ppl": e.get("heldout_ppl", np.nan),
                "downstream_avg_acc_pct": _percent(e.get("average_acc")),
                "gate": gates.get(run, {}).get("status", ""),
            }
        )
    return pd.DataFrame(rows)


def _family_markdown(table: pd.DataFrame) -> pd.DataFrame:
    shown = table.copy()
    for col in ("params", "tokens", "flops"):
        shown[col] = shown[col].map(_si)
    shown["tpp_band"] = shown["tpp_band"].map("{:g}".format)
    shown["trained_fraction"] = shown["trained_fraction"].map(_fixed(2))
    shown["epochs"] = shown["epochs"].map(_fixed(2))
    for col in ("final_train_loss", "heldout_loss", "heldout_ppl"):
        shown[col] = shown[col].map(_fixed(4 if "loss" in col else 2))
    shown["downstream_avg_acc_pct"] = shown["downstream_avg_acc_pct"].map(_fixed(2))
    return shown.rename(
        columns={
            "trained_fraction": "trained (t̂)",
            "final_train_loss": "final train loss (nats/token)",
            "heldout_loss": "held-out loss (nats/token)",
            "heldout_ppl": "held-out ppl",
            "downstream_avg_acc_pct": "downstream avg (%)",
        }
    )


# ---------------------------------------------------------------- the report


@dataclass
class _Inputs:
    """What the stages have written so far, read once for every section."""

    layout: FamilyLayout
    runs: pd.DataFrame | None  # None before the plan exists
    matrix: C.CurveMatrix | None  # None before any run has a curve
    gates: dict[str, dict]
    evals: dict[str, dict]
    sizes: list[str]
    celerity_plan: object = None

    @property
    def family_bands(self) -> list[float]:
        if self.runs is None:
            return []
        return sorted(self.runs.loc[self.runs.role == Role.FAMILY, "tpp_band"].unique())


def build_report(family_root: Path, out_dir: Path, *, celerity_plan=None) -> list[Path]:
    """Regenerate every figure and table of a family from results/<family>/ into ``out_dir``.

    Returns the files written (index.md last). ``celerity_plan``: a Plan (or runs table) of the
    celerity family for the accuracy figure; None plans it from config/family/celerity.yaml.
    """
    layout = FamilyLayout(Path(family_root))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rep = _Report(out)
    runs = load_runs(layout)
    if runs is None:
        rep.missing.append(f"no plan: {layout.plan_dir / 'runs.csv'} does not exist (run `plan`)")
    matrix = load_curve_matrix(layout, runs) if runs is not None else None
    if runs is not None and matrix is None:
        rep.missing.append("no loss curves yet: no runs/<run>/curve.parquet (run training)")
    sizes = _size_order(runs) if runs is not None else []
    inputs = _Inputs(
        layout, runs, matrix, load_gates(layout, runs), load_evals(layout), sizes, celerity_plan
    )
    for s in SECTIONS:
        _BUILDERS[s.key](inputs, rep)
    rep.captions()
    index = out / "index.md"
    index.write_text(_index(layout.root.name, layout, rep))
    return [*rep.files, index]


def _family_section(inputs: _Inputs, rep: _Report) -> None:
    """(f) the family table first: it is the overview."""
    if inputs.runs is None:
        return
    table = family_table(inputs.layout, inputs.runs, inputs.matrix, inputs.evals, inputs.gates)
    rep.table(table, "family_table", _family_markdown(table))
    rep.add_section("family")


def _collapse_section(inputs: _Inputs, rep: _Report) -> None:
    """(a) normalized curves and residuals per band."""
    if inputs.matrix is None:
        return
    bands = _bands(inputs.layout, inputs.runs, inputs.matrix)
    if not bands:
        rep.missing.append("collapse figure: no family run has a curve yet")
        return
    thresholds = {}
    band_of = inputs.runs.set_index("run")["tpp_band"]
    for run, v in inputs.gates.items():
        band = band_of.get(run)
        if band is not None and v.get("threshold") is not None:
            thresholds.setdefault(float(band), float(v["threshold"]))
    rep.figure(plot_collapse_curves(bands, inputs.sizes, thresholds), "collapse_curves")
    no_ref = [_band_label(b.band) for b in bands if b.reference is None]
    if no_ref:
        rep.missing.append(
            f"no reference curve for TPP band(s) {', '.join(no_ref)}: residual panels empty"
        )
    rep.add_section("collapse")


def _delta_sigma_section(inputs: _Inputs, rep: _Report) -> None:
    """(b) Delta against sigma per band, and the collapse summary."""
    stats = load_collapse_stats(inputs.layout, inputs.family_bands)
    if not stats:
        rep.missing.append(
            "Delta vs sigma: no collapse/tpp<band>/collapse.json yet (collapse_stats)"
        )
        return
    rep.figure(plot_delta_sigma(stats, inputs.sizes), "delta_sigma")
    summary = collapse_summary(stats)
    shown = summary.assign(
        score_mean_delta=summary["score_mean_delta"].map(_fixed(5)),
        delta_over_sigma_late=summary["delta_over_sigma_late"].map(_fixed(2)),
    )
    rep.table(summary, "collapse_summary", shown)
    rep.add_section("delta_sigma")
    lacking = [_band_label(b) for b in inputs.family_bands if b not in stats]
    if lacking:
        rep.missing.append(f"no collapse statistics for TPP band(s) {', '.join(lacking)}")


def _gates_section(inputs: _Inputs, rep: _Report) -> None:
    """(c) every gated run: the summary figure, the table and each run's evidence plot."""
    gates = inputs.gates
    if not gates:
        rep.missing.append("gates: no gates/<run>.json yet (gate rule)")
        return
    table = gates_table(gates, inputs.runs)
    (rep.out / "gates").mkdir(exist_ok=True)
    for run, v in gates.items():
        if v["_png"].is_file():
            rep.files.append(Path(shutil.copy2(v["_png"], rep.out / "gates" / f"{run}.png")))
    rep.figure(plot_gate_summary(table), "gate_summary")
    rep.table(table, "gates", _gates_markdown(table))
    evidence = "\n".join(  # failures shown inline, passes linked
        f"- {run} ({v.get('status')}): ![gate {run}](gates/{run}.png)"
        if v.get("status") in ("fail", "overridden")
        else f"- {run} ({v.get('status')}): [evidence](gates/{run}.png)"
        for run, v in gates.items()
        if v["_png"].is_file()
    )
    rep.add_section("gates", "\n### Evidence per run\n\n" + evidence + "\n" if evidence else "")


def _contrast_section(inputs: _Inputs, rep: _Report) -> None:
    """Family against its contrast (family.contrast), measured by the same statistics and
    gates: the method holds tau fixed; the contrast holds lambda fixed and lets tau drift."""
    from collapse.compare import comparison_figure, comparison_table, family_row
    from collapse.plan import contrast_members

    layout = inputs.layout
    if not (layout.contrast_dir / "collapse").is_dir():
        return
    contrast = family_row(layout.root, "lambda held fixed: tau drifts with size", Role.CONTRAST)
    if not contrast:
        rep.missing.append("contrast: no contrast/collapse/tpp<band>/collapse.json yet")
        return
    bands = {row["band"] for row in contrast}
    family = [
        r for r in family_row(layout.root, "tau held fixed (the method)") if r["band"] in bands
    ]
    rows = pd.DataFrame(family + contrast)
    rep.figure(comparison_figure(rows), "contrast")
    table = comparison_table(rows)
    shown = table.copy()
    digits = {"score_mean_delta": 5, "delta_over_sigma_late": 2}
    digits |= {"worst_abs_residual": 4, "threshold": 4}
    digits |= dict.fromkeys(["final_loss_smallest", "final_loss_largest"], 3)
    digits |= dict.fromkeys(["ell_half_smallest", "ell_half_largest"], 3)
    for col, n in digits.items():
        shown[col] = shown[col].map(_fixed(n))
    rep.table(table, "contrast", shown)
    runs = pd.read_csv(layout.plan_dir / "runs.csv")
    taus = contrast_members(runs).groupby("size", sort=False)["tau"].first()
    drift = ", ".join(f"{size} {tau:.3f}" for size, tau in taus.items())
    rep.add_section("contrast", f"\nThe contrast's tau by size: {drift}.\n")


def _sweeps_section(inputs: _Inputs, rep: _Report) -> None:
    """(d) early-stopped sweeps: predictions and how well each method selects."""
    predictions, metrics = load_sweeps(inputs.layout)
    if not len(predictions):
        rep.missing.append("sweeps: no sweeps/<name>/predictions.csv (no sweep run yet, or none)")
        return
    from collapse.sweep import metrics_markdown, plot_sweep_metrics

    rep.figure(plot_sweep_predictions(predictions, inputs.runs), "sweep_predictions")
    rep.figure(plot_sweep_metrics(metrics), "sweep_metrics")
    rep.table(metrics, "sweep_metrics", markdown=metrics_markdown(metrics))
    rep.table(sweep_predictions_table(predictions), "sweep_predictions")
    rep.add_section("sweeps")


def _faults_section(inputs: _Inputs, rep: _Report) -> None:
    """The fault-detection experiment (when the family has one), as the detect rule drew it."""
    faults = inputs.layout.faults_dir
    if not ((faults / "detections.csv").is_file() and (faults / "detections.png").is_file()):
        return
    rep.copied_figure(faults / "detections.png", faults / "detections.pdf", "fault_detection")
    rep.copied_table(faults / "detections.csv", faults / "detections.md", "detections")
    rep.add_section("faults")


def _downstream_section(inputs: _Inputs, rep: _Report) -> None:
    """(e) downstream accuracy against FLOPs, with the published models and Celerity."""
    if not inputs.evals:
        rep.missing.append("downstream: no evals/<run>.json yet; the figure shows published models")
    try:
        celerity = celerity_table(inputs.celerity_plan)
    except Exception as err:  # a missing config must not cost the rest of the report
        celerity = None
        rep.missing.append(f"Celerity FLOPs not computed (planner failed: {err}); not plotted")
    family_name = inputs.layout.root.name
    table = downstream_table(read_published(), celerity, inputs.evals, inputs.runs, family_name)
    rep.figure(plot_downstream(table), "downstream_vs_flops")
    rep.table(table, "downstream", _downstream_markdown(table))
    rep.add_section("downstream")


# section key (collapse.artifacts.SECTIONS) -> the function that writes it
_BUILDERS = {
    "family": _family_section,
    "collapse": _collapse_section,
    "delta_sigma": _delta_sigma_section,
    "gates": _gates_section,
    "contrast": _contrast_section,
    "sweeps": _sweeps_section,
    "faults": _faults_section,
    "downstream": _downstream_section,
}


def _gates_markdown(table: pd.DataFrame) -> pd.DataFrame:
    shown = table.drop(columns=["message"]).copy()
    for col in ("max_abs_residual", "threshold"):
        shown[col] = shown[col].map(_fixed(4))
    for col in ("at_t_hat", "first_crossing_t_hat"):
        shown[col] = shown[col].map(_fixed(3))
    shown["evidence"] = [f"[png]({e})" if e else "" for e in shown["evidence"]]
    return shown


def _downstream_markdown(table: pd.DataFrame) -> pd.DataFrame:
    shown = table.sort_values("flops", na_position="last").copy()
    for col in ("params", "tokens", "flops"):
        shown[col] = shown[col].astype(float).map(_si)
    for col in ("avg_acc_pct", *[c for c in TASK_COLUMNS if c in shown.columns]):
        shown[col] = shown[col].astype(float).map(_fixed(2))
    shown["on_frontier"] = shown["on_frontier"].map({True: "yes", False: ""})
    keep = ["model", "group", "params", "tokens", "flops", "avg_acc_pct", "on_frontier"]
    return shown[keep + ["flops_source"]]


def _index(family: str, layout: FamilyLayout, rep: _Report) -> str:
    lines = [f"# Report: family `{family}`", "", f"Regenerated from `{layout.root}`.", ""]
    if rep.missing:
        lines += ["## Missing", ""] + [f"- {m}" for m in rep.missing] + [""]
    return "\n".join(lines + rep.sections) + "\n"


# ---------------------------------------------------------------- CLI


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="every figure and table of a family, from results/<family>",
        description="Regenerate the family's figures (PNG, PDF), tables (CSV, Markdown) and "
        "index.md from whatever exists under results/<family>: collapse curves with residuals, "
        "Delta vs sigma, gate evidence, sweep predictions, downstream accuracy against training "
        "FLOPs (with the published open models and Celerity) and the family table. Missing "
        "stages are listed in index.md.",
    )
    p.add_argument("--root", type=Path, required=True, help="results/<family>")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default <root>/report); a path ending in .md names index.md",
    )
    p.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    if not args.root.is_dir():
        print(f"error: {args.root} is not a directory; give results/<family>", file=sys.stderr)
        return 2
    out = args.out or FamilyLayout(args.root).report_dir
    if out.suffix == ".md":
        out = out.parent
    paths = build_report(args.root, out)
    print(f"report: {len(paths)} files in {out}; see {out / 'index.md'}")
    return 0
