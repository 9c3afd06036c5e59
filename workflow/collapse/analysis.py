"""Family-level collapse analysis and the ``collapse analyze`` command (docs/method.md §§2-4).

Pure statistics (``collapse_statistics``: Delta, sigma, supercollapse, score; ``gate_matrix``:
every run's gate at once) and the entry points the Snakemake rules call, one per rule:

- ``build_reference(curve_paths, runs_csv, reference_sizes, out_dir)``: reference.csv,
  reference.json (summary), surrogate.json (Eq. 4 fit), reference.png;
- ``gate_run(curve_path, reference, runs_csv, policy, out_json, out_png)``: one run's verdict;
- ``family_statistics(curve_paths, runs_csv, out_dir)``: collapse.json, delta_sigma.csv,
  collapse.png;
- ``analyze(sources, out_dir)``: all of the above for curves from anywhere.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from pydantic import ValidationError

from collapse import curves as C
from collapse import validate as V
from collapse.gates import GatePolicy, GateVerdict, blocks, evaluate_gate, plot_gate
from collapse.outputs import staged_folder
from collapse.plotting import Figure, draw_collapse_curves, save, size_colours
from collapse.reference import (
    ALIGN_WINDOW,
    ReferenceCurve,
    aligned_residuals,
    reference_curve,
)
from collapse.surrogate import WARMUP_FRACTION, SurrogateFit, fit_surrogate
from collapse.validate import InputError

LATE_WINDOW = (0.5, 1.0)  # docs/method.md §2: supercollapse late in training, delta up to 0.5
SCORE_WINDOW = (0.2, 1.0)  # the score ignores the first 20 % (as the paper's fits do)
SUPERCOLLAPSE_FRACTION = 0.9  # share of late-window points where Delta < sigma must hold


# ---------------------------------------------------------------- statistics


@dataclass(frozen=True)
class FamilyStats:
    """Collapse of one family (docs/method.md §2, after Qiu et al. 2025)."""

    t_hat: np.ndarray
    delta: np.ndarray  # std/mean of ell over all sizes and seeds
    sigma: dict[str, np.ndarray]  # per size with >= 2 seeds: std/mean of L - L0 over seeds
    sigma_mean: np.ndarray  # mean of sigma over those sizes (NaN if none)
    supercollapse: bool | None  # None: undetermined (one size, or no size with two seeds)
    score: float  # mean Delta over SCORE_WINDOW: lower collapses better
    delta_over_sigma: float | None  # mean Delta/sigma_mean over the late window
    late_window: tuple[float, float]
    sizes: list[str]
    runs: list[str]
    excluded: list[str] = field(default_factory=list)  # incomplete runs: no L(T) to normalize
    supercollapse_reason: str = ""  # why the verdict is undetermined (empty when decided)

    def table(self) -> pd.DataFrame:
        cols = {"t_hat": self.t_hat, "delta": self.delta}
        cols |= {f"sigma_{size}": values for size, values in self.sigma.items()}
        cols["sigma_mean"] = self.sigma_mean
        return pd.DataFrame(cols)

    def to_dict(self) -> dict:
        return {
            "t_hat": self.t_hat.tolist(),
            "delta": self.delta.tolist(),
            "sigma": {size: values.tolist() for size, values in self.sigma.items()},
            "sigma_mean": self.sigma_mean.tolist(),
            "supercollapse": self.supercollapse,
            "supercollapse_reason": self.supercollapse_reason or None,
            "score": self.score,
            "score_definition": f"mean Delta(t_hat) over t_hat {list(SCORE_WINDOW)}",
            "delta_over_sigma": self.delta_over_sigma,
            "late_window": list(self.late_window),
            "sizes": self.sizes,
            "runs": self.runs,
            "excluded_incomplete": self.excluded,
        }


def _in(grid: np.ndarray, window: tuple[float, float], include_end: bool = True) -> np.ndarray:
    hi = grid <= window[1] if include_end else grid < window[1] - 1e-9
    return (grid >= window[0]) & hi


def collapse_statistics(
    matrix: C.CurveMatrix,
    offset: float = 0.0,
    late_window: tuple[float, float] = LATE_WINDOW,
    supercollapse_fraction: float = SUPERCOLLAPSE_FRACTION,
) -> FamilyStats:
    """Delta(t_hat), sigma(t_hat) per size, the supercollapse verdict and the family's score.

    Source: docs/method.md §2. Delta = std_{sizes,seeds}[ell] / mean[ell] (ddof 1) over the
    complete runs; sigma_size = std_seeds[L - L0] / mean_seeds[L - L0] on the raw smoothed loss.
    Supercollapse: Delta < mean sigma at >= ``supercollapse_fraction`` of the late-window
    points (t_hat = 1 left out: there every ell is 1 by construction). Undetermined (None, with
    ``supercollapse_reason``) where the curves cannot decide it: one size (Delta is then seed
    noise, not a collapse across sizes) or no size with two seeds (no noise floor).
    """
    complete = np.isfinite(matrix.meta["final_loss"].to_numpy(float))
    excluded = list(matrix.meta.index[~complete])
    matrix = matrix.select(complete)
    if len(matrix.meta) < 2:
        raise InputError(
            "collapse statistics compare runs: they need at least two complete runs (reaching "
            f"t_hat 1 with a finite loss), the curves have {len(matrix.meta)}"
            + (f" (incomplete or diverged: {', '.join(excluded[:5])})" if excluded else "")
            + "; give the curves of more runs, or the steps column if runs are marked partial"
        )
    ell = matrix.normalized(offset)
    labels = C.size_labels(matrix.meta).to_numpy()
    sizes = [s for s in C.ordered_sizes(matrix.meta)]
    sigma = {}
    grid = matrix.grid
    late = _in(grid, late_window, include_end=False)
    with C.nan_columns_expected():
        delta = np.nanstd(ell, axis=0, ddof=1) / np.nanmean(ell, axis=0)
        for size in sizes:
            rows = matrix.loss[labels == size] - offset
            if len(rows) >= 2:
                sigma[size] = np.nanstd(rows, axis=0, ddof=1) / np.nanmean(rows, axis=0)
        reason = ""
        if sigma:
            sigma_mean = np.nanmean(np.vstack(list(sigma.values())), axis=0)
            ratio = delta[late] / sigma_mean[late]
            delta_over_sigma = float(np.nanmean(ratio)) if np.isfinite(ratio).any() else None
        else:
            sigma_mean = np.full_like(grid, np.nan)
            delta_over_sigma = None
        if len(sizes) < 2:
            reason = (
                f"one size ({sizes[0]}): Delta over one size is seed noise, not a collapse "
                "across sizes; give runs of two or more sizes"
            )
        elif not sigma:
            reason = "no size has two seeds, so there is no seed-noise floor sigma to compare with"
        elif delta_over_sigma is None:
            reason = f"no finite Delta/sigma in the late window t_hat {list(late_window)}"
        if reason:
            supercollapse = None
        else:
            below = delta[late] < sigma_mean[late]
            supercollapse = bool(below.mean() >= supercollapse_fraction)
    score = float(np.nanmean(delta[_in(grid, SCORE_WINDOW, include_end=False)]))
    return FamilyStats(
        t_hat=grid,
        delta=delta,
        sigma=sigma,
        sigma_mean=sigma_mean,
        supercollapse=supercollapse,
        score=score,
        delta_over_sigma=delta_over_sigma,
        late_window=late_window,
        sizes=sizes,
        runs=list(matrix.meta.index),
        excluded=excluded,
        supercollapse_reason=reason,
    )


def _reference_on(grid: np.ndarray, reference: ReferenceCurve) -> np.ndarray:
    if len(grid) == len(reference.t_hat) and np.allclose(grid, reference.t_hat):
        return reference.ell
    return reference.at(grid)


def gate_matrix(
    matrix: C.CurveMatrix,
    reference: ReferenceCurve,
    policy: GatePolicy,
    offset: float = 0.0,
    plot_paths: dict[str, str] | None = None,
) -> tuple[list[GateVerdict], np.ndarray]:
    """Every run's gate at once: (verdicts, early-aligned residual matrix)."""
    ref_ell = _reference_on(matrix.grid, reference)
    residual, aligned = aligned_residuals(matrix, ref_ell, policy.align_window, offset)
    plot_paths = plot_paths or {}
    points = matrix.meta["align_points"].to_numpy() if "align_points" in matrix.meta else None
    verdicts = [
        evaluate_gate(
            run,
            matrix.grid,
            residual[i],
            reference,
            policy,
            aligned_final_loss=aligned[i],
            final_loss=matrix.meta["final_loss"].iloc[i],
            t_hat_max=matrix.meta["t_hat_max"].iloc[i],
            align_points=int(points[i]) if points is not None else None,
            plot=plot_paths.get(run, ""),
        )
        for i, run in enumerate(matrix.meta.index)
    ]
    return verdicts, residual


# ---------------------------------------------------------------- loading helpers


def load_matrix(
    sources: str | Path | Sequence[str | Path] | pd.DataFrame,
    runs_csv: str | Path | pd.DataFrame | None = None,
    window_steps: int | None = None,
    window_seqs: int | None = None,
    grid: np.ndarray | None = None,
    align_window: tuple[float, float] = ALIGN_WINDOW,
    loss_tag: str | None = None,
) -> C.CurveMatrix:
    """Read, check, smooth and resample curves (see collapse.curves for the input formats).

    ``meta`` gains ``min_loss`` (smallest finite logged loss, to check an offset against) and
    ``align_points`` (finite logged points inside ``align_window``: too few leave a gate
    undetermined).
    """
    if isinstance(sources, pd.DataFrame):
        meta = C.read_table(runs_csv) if isinstance(runs_csv, (str, Path)) else runs_csv
        curves = C.curves_from_frame(sources, meta)
    else:
        curves = C.read_curves(sources, runs_csv, loss_tag)
    data = curves.data
    finite = np.isfinite(data["loss"].to_numpy(float))
    inside = finite & data["t_hat"].between(*align_window).to_numpy()
    by_run = pd.DataFrame(
        {"run": data["run"], "inside": inside, "loss": data["loss"].where(finite)}
    )
    grouped = by_run.groupby("run", observed=True, sort=False)
    meta = curves.meta.assign(
        min_loss=grouped["loss"].min().reindex(curves.meta.index),
        align_points=grouped["inside"].sum().reindex(curves.meta.index).fillna(0).astype(int),
    )
    curves = C.Curves(data, meta)
    return C.resample(C.smooth(curves, window_steps, window_seqs), grid)


def default_reference_sizes(sizes: list[str]) -> list[str]:
    """Without a choice: the two smallest sizes, leaving at least one size to test."""
    return sizes[: max(1, min(2, len(sizes) - 1))]


def _check_sizes(requested: Sequence[str], available: list[str]) -> list[str]:
    requested = [str(s) for s in requested]
    unknown = [s for s in requested if s not in available]
    if unknown or not requested:
        raise InputError(
            f"reference size(s) {unknown} not among the sizes in the curves {available}; "
            "give sizes exactly as they appear in the size column"
        )
    return requested


def _jsonable(obj):
    """NaN/inf become null: JSON has no NaN."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return _jsonable(obj.item())
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    return obj


def write_json(path: str | Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(payload), indent=2, allow_nan=False) + "\n")
    return path


def fit_reference_surrogate(matrix: C.CurveMatrix, offset: float = 0.0) -> SurrogateFit | None:
    """Eq. 4 fitted on the complete runs given, if they carry ``tau`` and ``tpp`` metadata."""
    meta = matrix.meta
    if not {"tau", "tpp"} <= set(meta.columns) or meta[["tau", "tpp"]].isna().any().any():
        return None
    warmup = WARMUP_FRACTION
    if {"warmup_steps", "steps"} <= set(meta.columns):
        warmup = float((meta["warmup_steps"] / meta["steps"]).median())
    return fit_surrogate(
        matrix.grid,
        matrix.normalized(offset),
        meta["tau"].to_numpy(float),
        meta["tpp"].to_numpy(float),
        warmup_fraction=warmup,
    )


# ---------------------------------------------------------------- plots


def plot_collapse(
    path: str | Path,
    matrix: C.CurveMatrix,
    stats: FamilyStats,
    reference: ReferenceCurve | None = None,
    offset: float = 0.0,
) -> Path:
    """Normalized curves coloured by size over the reference band; Delta and sigma below."""
    complete = np.isfinite(matrix.meta["final_loss"].to_numpy(float))
    matrix = matrix.select(complete)
    colours = size_colours(stats.sizes)
    fig = Figure(figsize=(8, 8), layout="tight")
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw=dict(height_ratios=[3, 2]))
    draw_collapse_curves(
        top,
        matrix.grid,
        matrix.normalized(offset),
        C.size_labels(matrix.meta).to_numpy(),
        colours,
        reference=reference,
        offset=offset,
    )
    verdict = {True: "supercollapse", False: "no supercollapse", None: "no seed noise floor"}
    top.set_title(
        f"collapse score {stats.score:.4f} (mean Δ over t̂ ≥ 0.2); {verdict[stats.supercollapse]}",
        fontsize=10,
    )
    bottom.plot(
        stats.t_hat,
        100 * stats.delta,
        color="k",
        lw=1.5,
        label="Δ: spread of ℓ over sizes and seeds",
    )
    for size, sigma in stats.sigma.items():
        bottom.plot(
            stats.t_hat,
            100 * sigma,
            color=colours.get(size, "C1"),
            ls="--",
            lw=1,
            label=f"σ seed noise, size {size}",
        )
    bottom.axvspan(*stats.late_window, color="C1", alpha=0.06, label="late window")
    bottom.set_yscale("log")
    bottom.set_xlabel("fraction of training t̂ = step / total steps")
    bottom.set_ylabel("relative spread (%)")
    bottom.legend(fontsize=8, ncol=2)
    bottom.grid(alpha=0.3, which="both")
    bottom.set_xlim(0, 1)
    return save(fig, path)


def plot_residuals(
    path: str | Path, grid: np.ndarray, residual: np.ndarray, verdicts: list[GateVerdict]
) -> Path:
    """Every run's early-aligned residual against the threshold; failed runs in red."""
    fig = Figure(figsize=(8, 4.5), layout="tight")
    ax = fig.subplots()
    failed = [v.status in ("fail", "overridden") for v in verdicts]
    for row, bad in zip(residual, failed, strict=True):
        ax.plot(
            grid,
            row,
            color="C3" if bad else "0.55",
            lw=1.0 if bad else 0.6,
            alpha=0.9 if bad else 0.5,
            zorder=3 if bad else 2,
        )
    passed = sum(v.status == "pass" for v in verdicts)
    ax.plot([], [], color="0.55", label=f"passed ({passed}) or undetermined")
    ax.plot([], [], color="C3", label=f"failed ({sum(failed)})")
    if verdicts:
        thr = verdicts[0].threshold
        ax.axhline(thr, color="C1", ls="--", lw=1, label=f"threshold ±{thr:.4f}")
        ax.axhline(-thr, color="C1", ls="--", lw=1)
        ax.axvspan(*verdicts[0].window, color="C1", alpha=0.05, label="gate window")
        finite = residual[:, _in(grid, verdicts[0].window)]
        finite = finite[np.isfinite(finite)]
        if len(finite):
            span = max(np.abs(finite).max(), thr)
            ax.set_ylim(-1.2 * span, 1.2 * span)
    ax.set_xlabel("fraction of training t̂ = step / total steps")
    ax.set_ylabel("residual r = ℓ_run − ℓ_ref (early-aligned)")
    ax.set_xlim(0, 1)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save(fig, path)


def plot_reference(
    path: str | Path,
    reference: ReferenceCurve,
    fit: SurrogateFit | None,
    controls: list[tuple[float, float]],
) -> Path:
    """The reference curve and band, with the Eq. 4 surrogate at the reference controls."""
    fig = Figure(figsize=(7, 4.5), layout="tight")
    ax = fig.subplots()
    ax.fill_between(
        reference.t_hat, reference.lower, reference.upper, color="0.85", label="band (mean ± 2 std)"
    )
    ax.plot(
        reference.t_hat,
        reference.ell,
        color="k",
        lw=1.5,
        label=f"reference ({', '.join(reference.sizes)})",
    )
    if fit is not None:
        for tau, tpp in controls:
            ax.plot(
                reference.t_hat,
                fit.params.ell(reference.t_hat, tau, tpp),
                ls="--",
                lw=1,
                label=f"Eq. 4 surrogate τ={tau:g}, TPP={tpp:g} (MAE {fit.mae:.4f})",
            )
    window = reference.upper[_in(reference.t_hat, SCORE_WINDOW)]
    ax.set_ylim(0.98, 1.02 * np.nanmax(window))
    ax.set_xlim(0, 1)
    ax.set_xlabel("fraction of training t̂ = step / total steps")
    ax.set_ylabel("normalized loss ℓ = L / L(T)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save(fig, path)


# ---------------------------------------------------------------- rule entry points


def _reference_part(matrix: C.CurveMatrix, reference_sizes: Sequence[str]) -> C.CurveMatrix:
    labels = C.size_labels(matrix.meta)
    sizes = _check_sizes(reference_sizes, C.ordered_sizes(matrix.meta))
    part = matrix.select(labels.isin(sizes).to_numpy())
    complete = np.isfinite(part.meta["final_loss"].to_numpy(float))
    if not complete.any():
        raise InputError(
            f"reference size(s) {list(sizes)} have no complete run (reaching t_hat 1 with a "
            "finite loss); choose other --reference-sizes"
        )
    return part.select(complete)


def _build_reference(
    matrix: C.CurveMatrix,
    reference_sizes: Sequence[str],
    out_dir: Path,
    offset: float,
    align_window: tuple[float, float],
    smoothing: dict,
) -> tuple[ReferenceCurve, SurrogateFit | None, dict]:
    part = _reference_part(matrix, reference_sizes)
    reference = reference_curve(part, offset, align_window)
    reference = ReferenceCurve(**{**reference.__dict__, "sizes": [str(s) for s in reference_sizes]})
    fit = fit_reference_surrogate(part, offset)
    out_dir.mkdir(parents=True, exist_ok=True)
    reference.write_csv(out_dir / "reference.csv")
    controls = []
    if fit is not None:
        fit.write_json(out_dir / "surrogate.json")
        controls = sorted({(float(a), float(b)) for a, b in part.meta[["tau", "tpp"]].to_numpy()})
    plot_reference(out_dir / "reference.png", reference, fit, controls[:4])
    summary = {
        "reference_sizes": list(reference.sizes),
        "runs": list(part.meta.index),
        "offset": offset,
        "align_window": list(align_window),
        "smoothing": smoothing,
        "seed_std_max": float(np.nanmax(reference.seed_std))
        if np.isfinite(reference.seed_std).any()
        else None,
        "surrogate": fit.to_dict() if fit is not None else None,
        "surrogate_note": None if fit is not None else "no tau/tpp metadata: surrogate not fitted",
        "controls": _controls(part.meta),
        "files": {"reference_csv": "reference.csv", "plot": "reference.png"},
    }
    write_json(out_dir / "reference.json", summary)
    return reference, fit, summary


def _controls(meta: pd.DataFrame) -> dict:
    """The reference runs' controls (median over them), for the controls audit of the runs
    compared with it (collapse.controls); empty without tau/tpp metadata."""
    out = {}
    for name in ("tau", "tpp"):
        if name in meta.columns:
            values = pd.to_numeric(meta[name], errors="coerce").dropna()
            if len(values):
                out[name] = float(values.median())
    return out


def build_reference(
    curve_paths: Sequence[str | Path],
    runs_csv: str | Path | None,
    reference_sizes: Sequence[str],
    out_dir: str | Path,
    offset: float = 0.0,
    window_steps: int | None = None,
    window_seqs: int | None = None,
    align_window: tuple[float, float] = ALIGN_WINDOW,
) -> ReferenceCurve:
    """Rule ``reference``: reference.csv (+ reference.json, surrogate.json, reference.png).

    ``curve_paths`` may hold more runs than the reference sizes; only complete runs of
    ``reference_sizes`` (labels of the ``size`` column) enter.
    """
    matrix = load_matrix(curve_paths, runs_csv, window_steps, window_seqs)
    smoothing = {"window_steps": window_steps, "window_seqs": window_seqs}
    reference, _, _ = _build_reference(
        matrix, reference_sizes, Path(out_dir), offset, align_window, smoothing
    )
    return reference


def _reference_context(reference: str | Path) -> tuple[ReferenceCurve, dict]:
    path = Path(reference)
    csv = path / "reference.csv" if path.is_dir() else path
    if not csv.is_file():
        raise FileNotFoundError(f"{csv}: no reference.csv; build the reference first")
    summary_path = csv.parent / "reference.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    curve = ReferenceCurve.read_csv(csv)
    curve = ReferenceCurve(**{**curve.__dict__, "sizes": summary.get("reference_sizes", [])})
    return curve, summary


def gate_run(
    curve_path: str | Path,
    reference: str | Path,
    runs_csv: str | Path | None,
    policy: GatePolicy,
    out_json: str | Path,
    out_png: str | Path | None,
    run: str | None = None,
    offset: float | None = None,
    window_steps: int | None = None,
) -> GateVerdict:
    """Rule ``gate``: one run's verdict JSON and evidence plot; never raises on a failed gate.

    ``reference``: reference.csv or its directory (with reference.json, whose offset and
    smoothing the run is analysed with unless given). Use ``gates.require_passed`` downstream.
    """
    ref, summary = _reference_context(reference)
    offset = summary.get("offset", 0.0) if offset is None else offset
    smoothing = summary.get("smoothing", {}) or {}
    window_steps = window_steps or smoothing.get("window_steps")
    matrix = load_matrix(
        curve_path, runs_csv, window_steps, smoothing.get("window_seqs"), grid=ref.t_hat
    )
    if run is None:
        if len(matrix.meta) != 1:
            raise ValueError(
                f"{curve_path} holds {len(matrix.meta)} runs; name the one to gate (run=...)"
            )
        run = matrix.meta.index[0]
    matrix = matrix.select(matrix.meta.index == run)
    plot = str(out_png) if out_png else ""
    verdicts, residual = gate_matrix(matrix, ref, policy, offset, {run: plot})
    verdict = verdicts[0]
    verdict.write_json(out_json)
    if out_png:
        plot_gate(out_png, verdict, matrix.grid, residual[0] + ref.ell, ref)
    return verdict


def family_statistics(
    curve_paths: Sequence[str | Path],
    runs_csv: str | Path | None,
    out_dir: str | Path,
    offset: float = 0.0,
    reference: str | Path | None = None,
    window_steps: int | None = None,
    window_seqs: int | None = None,
    late_window: tuple[float, float] = LATE_WINDOW,
) -> FamilyStats:
    """Rule ``collapse_stats``: collapse.json, delta_sigma.csv and collapse.png in ``out_dir``."""
    out_dir = Path(out_dir)
    matrix = load_matrix(curve_paths, runs_csv, window_steps, window_seqs)
    stats = collapse_statistics(matrix, offset, late_window)
    ref = _reference_context(reference)[0] if reference is not None else None
    out_dir.mkdir(parents=True, exist_ok=True)
    stats.table().to_csv(out_dir / "delta_sigma.csv", index=False, float_format="%.8g")
    plot_collapse(out_dir / "collapse.png", matrix, stats, ref, offset)
    write_json(
        out_dir / "collapse.json", {**stats.to_dict(), "offset": offset, "plot": "collapse.png"}
    )
    return stats


def managed_root(path: str | Path) -> Path | None:
    """The workflow's family folder ``path`` lies in (itself or a parent), or None.

    ``path`` itself is one if it holds ``plan/``; a parent if it holds ``plan/runs.csv`` or
    ``runs/<run>/curve.parquet`` (collapse.layout), so a stray ``plan`` folder higher up does
    not count. Its reference/, collapse/ and gates/ are the workflow's outputs, which an
    ad-hoc analysis must not replace.
    """
    path = Path(path).resolve()
    if (path / "plan").is_dir():
        return path
    for folder in (path, *path.parents):
        if (folder / "plan" / "runs.csv").is_file() or next(
            folder.glob("runs/*/curve.parquet"), None
        ):
            return folder
    return None


def _output_mode(out: Path, sources: Sequence, force: bool) -> str:
    """How analyze may write ``out``: "replace" (the whole folder) or "merge" (file by file).

    Checked before any work. Replacing drops stale files of an earlier analysis, so it is only
    done to a new or empty folder or an earlier analysis (collapse.json); anything else needs
    --force and is then written into, never deleted.
    """
    if out.exists() and not out.is_dir():
        raise InputError(f"--out {out}: is a file; give a folder")
    root = managed_root(out)
    if root is not None:
        if not force:
            raise InputError(
                f"--out {out}: lies in the workflow's family folder {root} (it has plan/ or "
                "runs/), whose outputs analyze would overwrite; give a folder outside it, or "
                "--force to write there anyway"
            )
        return "merge"
    earlier = not out.exists() or not any(out.iterdir()) or (out / "collapse.json").is_file()
    if not earlier:
        if not force:
            raise InputError(
                f"--out {out}: the folder holds files that are not an earlier analysis (no "
                "collapse.json); give a new or empty folder, or --force to write beside them"
            )
        return "merge"
    inside = [
        src
        for src in sources
        if isinstance(src, (str, Path)) and Path(src).resolve().is_relative_to(out.resolve())
    ]
    if inside:
        raise InputError(
            f"--out {out}: holds the input {inside[0]}, which replacing the folder would "
            "delete; give another --out"
        )
    return "replace"


def check_offset(meta: pd.DataFrame, offset: float) -> None:
    """L0 must lie below every loss: ell = (L - L0)/(L(T) - L0) needs L - L0 > 0."""
    if not np.isfinite(offset):
        raise InputError(f"--offset {offset}: give a finite number")
    lowest = meta["min_loss"].astype(float)
    if (lowest <= offset).any():
        run = lowest.idxmin()
        raise InputError(
            f"--offset {offset:g} is not below every loss: run {run} reaches {lowest[run]:.6g}; "
            "the irreducible loss L0 lies below the losses, so lower --offset (0 is the "
            "paper's choice)"
        )


def analyze(
    sources: str | Path | Sequence[str | Path] | pd.DataFrame,
    out_dir: str | Path,
    reference_sizes: Sequence[str] | None = None,
    offset: float = 0.0,
    runs_csv: str | Path | pd.DataFrame | None = None,
    policy: GatePolicy | None = None,
    window_steps: int | None = None,
    window_seqs: int | None = None,
    late_window: tuple[float, float] = LATE_WINDOW,
    plots: str = "failed",
    force: bool = False,
    loss_tag: str | None = None,
) -> dict:
    """``collapse analyze``: statistics, reference, surrogate and every run's gate in ``out_dir``.

    ``plots``: per-run gate plots for "failed" runs (default), "all" runs or "none"; the
    family plots (collapse.png, residuals.png, reference.png) are always written.
    Input is checked before anything is written, and the outputs are staged beside
    ``out_dir`` and moved into place at the end: a failed call leaves ``out_dir`` untouched, a
    repeated one leaves no stale files. A folder of the workflow's (``managed_root``) or one
    holding other files needs ``force`` (then files are written into it, nothing is deleted).
    """
    out = Path(out_dir)
    listed = [sources] if isinstance(sources, (str, Path)) else sources
    mode = _output_mode(out, [] if isinstance(sources, pd.DataFrame) else listed, force)
    policy = policy or GatePolicy()
    matrix = load_matrix(
        sources,
        runs_csv,
        window_steps,
        window_seqs,
        align_window=policy.align_window,
        loss_tag=loss_tag,
    )
    check_offset(matrix.meta, offset)
    sizes = C.ordered_sizes(matrix.meta)
    reference_sizes = _check_sizes(reference_sizes or default_reference_sizes(sizes), sizes)
    _reference_part(matrix, reference_sizes)  # a reference to build, before writing anything
    stats = collapse_statistics(matrix, offset, late_window)
    with staged_folder(out, mode) as work:
        return _write_analysis(
            work, out, matrix, stats, reference_sizes, offset, policy, window_steps, window_seqs,
            plots,
        )  # fmt: skip


def _write_analysis(
    work: Path,
    out: Path,
    matrix: C.CurveMatrix,
    stats: FamilyStats,
    reference_sizes: list[str],
    offset: float,
    policy: GatePolicy,
    window_steps: int | None,
    window_seqs: int | None,
    plots: str,
) -> dict:
    """Every output of ``analyze`` written into ``work``; paths inside them name ``out``."""
    smoothing = {"window_steps": window_steps, "window_seqs": window_seqs}
    reference, fit, ref_summary = _build_reference(
        matrix, reference_sizes, work, offset, policy.align_window, smoothing
    )
    stats.table().to_csv(work / "delta_sigma.csv", index=False, float_format="%.8g")

    verdicts, residual = gate_matrix(matrix, reference, policy, offset)
    verdicts = _write_gates(work, out, verdicts, residual, matrix.grid, reference, plots)
    plot_residuals(work / "residuals.png", matrix.grid, residual, verdicts)
    plot_collapse(work / "collapse.png", matrix, stats, reference, offset)

    meta = matrix.meta.assign(
        size_label=C.size_labels(matrix.meta),
        in_reference=C.size_labels(matrix.meta).isin(reference_sizes),
        aligned_final_loss=[v.aligned_final_loss for v in verdicts],
        gate=[v.status for v in verdicts],
        max_abs_residual=[v.max_abs_residual for v in verdicts],
        first_crossing_t_hat=[v.first_crossing_t_hat for v in verdicts],
    )
    meta.to_csv(work / "runs.csv", float_format="%.8g")
    summary = {
        **stats.to_dict(),
        "offset": offset,
        "reference_sizes": reference_sizes,
        "reference": ref_summary,
        "policy": policy.model_dump(mode="json"),
        "threshold": verdicts[0].threshold if verdicts else None,
        "gates": {v.run: v.model_dump(mode="json") for v in verdicts},
        "failed_gates": [v.run for v in verdicts if v.status in ("fail", "overridden")],
        "undetermined_gates": [v.run for v in verdicts if v.status == "undetermined"],
        "files": {
            "reference_csv": "reference.csv",
            "delta_sigma_csv": "delta_sigma.csv",
            "runs_csv": "runs.csv",
            "plots": ["collapse.png", "residuals.png", "reference.png"],
        },
    }
    write_json(work / "collapse.json", summary)
    return summary


def _write_gates(
    work: Path,
    out: Path,
    verdicts: list[GateVerdict],
    residual: np.ndarray,
    grid: np.ndarray,
    reference: ReferenceCurve,
    plots: str,
) -> list[GateVerdict]:
    """gates/<run>.json for every run and, as ``plots`` asks, gates/<run>.png; a verdict
    names its evidence plot (its own, else residuals.png)."""
    written = []
    for i, verdict in enumerate(verdicts):
        failed = verdict.status in ("fail", "overridden")
        if plots == "all" or (plots == "failed" and failed):
            png = out / "gates" / f"{verdict.run}.png"
            verdict = verdict.model_copy(
                update={"plot": str(png), "message": f"{verdict.message}; evidence: {png}"}
            )
            plot_gate(
                work / "gates" / png.name, verdict, grid, residual[i] + reference.ell, reference
            )
        else:
            verdict = verdict.model_copy(update={"plot": str(out / "residuals.png")})
        written.append(verdict)
        verdict.write_json(work / "gates" / f"{verdict.run}.json")
    return written


# ---------------------------------------------------------------- command line

INPUT_HELP = """\
input: CURVES are CSV/Parquet files, run directories or results/<family> directories, or
  other stacks' logs: TensorBoard event directories, W&B offline run folders and W&B history
  exports (docs/curves.md; the loss tag: --loss-tag, metadata the logs lack: --runs).
  A curve table has one row per logged step with columns run, step, loss:
    run   (str)   run name
    step  (int)   optimizer step
    loss  (float) training loss of the step (nats/token)
  optional per-step columns: tokens, t_hat (step / total steps of the full-length schedule);
  optional per-run columns (constant within a run, or given in --runs): size (or params),
  seed, tpp, tau, schedule, steps (total steps: marks runs that stopped early), batch_seqs,
  warmup_steps. Absent ones are not used: without size every run is its own size; without
  t_hat or steps a run's largest step is taken as its full length.
  This project's runs: results/<family>/runs/<run>/curve.parquet, metadata from
  results/<family>/plan/runs.csv (found automatically when the family directory is given).

outputs in DIR: collapse.json (t_hat, delta, sigma per size, supercollapse, score, gate
  verdicts), reference.csv (t_hat, ell, lower, upper, seed_std, n_curves), reference.json,
  surrogate.json (Eq. 4 fit, when tau and tpp are known), delta_sigma.csv, runs.csv,
  gates/<run>.json, and the plots collapse.png, residuals.png, reference.png, gates/<run>.png.
  They are written beside DIR first and replace it only when all are done. DIR must be new,
  empty or an earlier analysis; a folder of the workflow's (results/<family>/...) needs --force.

checks: a curve that breaks the contract above (non-numeric, zero or negative loss, a finite
  loss after a NaN, negative, fractional or repeated steps, steps past the run's steps,
  t_hat outside [0, 1], a size/seed/tpp/tau that changes within a run, two runs with the
  same size and seed) is refused with the file, line, run and fix. NaN/inf from some step to
  the end of a run is training that diverged: its gate fails.
  Verdicts the curves cannot decide are "undetermined", with the reason: supercollapse with
  one size or without two seeds of a size; the gate of a run with too few points in the
  align window.

exit status: 0 done; 2 bad input or flags (one "error:" line); 1 a failure inside the
  analysis; 3 with --strict, a gate failed.
"""


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="collapse statistics, reference curve and gates for a set of loss curves",
        description="Normalize loss curves (ell = (L - L0)/(L(T) - L0)), measure how well a "
        "family collapses (Delta vs the seed noise sigma), build the reference curve from the "
        "reference sizes and gate every run against it (arXiv 2509.25087).",
        epilog=INPUT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("curves", nargs="+", metavar="CURVES", help="curve files or directories")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument(
        "--reference-sizes",
        metavar="S1,S2,...",
        default=None,
        help="sizes (as in the size column) that build the reference; default: the two smallest",
    )
    parser.add_argument(
        "--offset",
        type=V.finite,
        default=0.0,
        metavar="L0",
        help="irreducible loss L0 subtracted before normalizing (Qiu et al.); "
        "default 0, the collapse paper's choice",
    )
    parser.add_argument(
        "--runs",
        default=None,
        metavar="TABLE",
        help="per-run metadata table (CSV/Parquet/YAML with a run column): size, params, seed, "
        "tpp, tau, steps, schedule, batch_seqs, warmup_steps of runs read from logs that lack "
        "them",
    )
    parser.add_argument(
        "--loss-tag",
        default=None,
        metavar="TAG",
        help="the loss's tag in TensorBoard/W&B logs (default: the first of 'lm loss', "
        "'loss_metrics/global_avg_loss', 'train/CE loss', 'reduced_train_loss', 'train/loss' "
        "a run logs)",
    )
    smoothing = parser.add_mutually_exclusive_group()
    smoothing.add_argument(
        "--window-steps",
        type=V.positive_int,
        default=None,
        help="smoothing window in steps (default: 100, at most 2%% of a run)",
    )
    smoothing.add_argument(
        "--window-seqs",
        type=V.positive_int,
        default=None,
        help="smoothing window in sequences (needs batch_seqs per run)",
    )
    parser.add_argument(
        "--threshold",
        type=V.positive,
        default=None,
        help="fixed gate threshold on |r| (ell units); default: calibrated",
    )
    parser.add_argument(
        "--k-sigma",
        type=V.positive,
        default=GatePolicy().k_sigma,
        help="calibrated threshold = K x reference seed std (default %(default)s)",
    )
    parser.add_argument(
        "--floor",
        type=V.non_negative,
        default=GatePolicy().floor,
        help="lowest calibrated threshold (default %(default)s)",
    )
    parser.add_argument(
        "--gate-window",
        type=V.t_hat_window,
        default=GatePolicy().window,
        metavar="START,END",
        help="t_hat span the gate checks (default 0.2,1)",
    )
    parser.add_argument(
        "--align-window",
        type=V.t_hat_window,
        default=ALIGN_WINDOW,
        metavar="START,END",
        help="early-align span (default 0.25,0.5)",
    )
    parser.add_argument(
        "--late-window",
        type=V.t_hat_window,
        default=LATE_WINDOW,
        metavar="START,END",
        help="supercollapse span (default 0.5,1)",
    )
    parser.add_argument(
        "--plots",
        choices=("failed", "all", "none"),
        default="failed",
        help="per-run gate plots (default: failed runs only)",
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit with status 3 when a gate fails"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="write into a folder of the workflow's (results/<family>/...) or one holding other "
        "files; files are then written beside the ones there, nothing is deleted",
    )
    parser.set_defaults(func=_run_cli)


def _run_cli(args: argparse.Namespace) -> int:
    """Exit status: 0 done, 2 bad input or flags (one line on stderr), 3 --strict and a gate
    blocked; a failure inside the analysis propagates (status 1, see collapse.cli)."""
    try:
        policy = GatePolicy(
            k_sigma=args.k_sigma,
            floor=args.floor,
            threshold=args.threshold,
            window=args.gate_window,
            align_window=args.align_window,
        )
    except ValidationError as err:
        raise InputError(err.errors()[0]["msg"]) from None
    sizes = None
    if args.reference_sizes is not None:
        sizes = [s.strip() for s in args.reference_sizes.split(",") if s.strip()]
        if not sizes:
            raise InputError("--reference-sizes is empty: give sizes as S1,S2")
    summary = analyze(
        args.curves,
        args.out,
        reference_sizes=sizes,
        offset=args.offset,
        runs_csv=args.runs,
        policy=policy,
        window_steps=args.window_steps,
        window_seqs=args.window_seqs,
        late_window=args.late_window,
        plots=args.plots,
        force=args.force,
        loss_tag=args.loss_tag,
    )
    decided = {True: "yes", False: "no"}
    verdict = decided.get(
        summary["supercollapse"], f"undetermined ({summary['supercollapse_reason']})"
    )
    print(
        f"{len(summary['runs'])} complete runs, sizes {summary['sizes']}, reference "
        f"{summary['reference_sizes']}"
    )
    print(
        f"collapse score (mean Delta, t_hat >= 0.2): {summary['score']:.4f}; "
        f"supercollapse: {verdict}"
    )
    gates = summary["gates"].values()
    failed = [summary["gates"][run] for run in summary["failed_gates"]]
    undetermined = [summary["gates"][run] for run in summary["undetermined_gates"]]
    print(
        f"gates: {sum(v['status'] == 'pass' for v in gates)} passed, {len(failed)} failed, "
        f"{len(undetermined)} undetermined (threshold {summary['threshold']:.4f})"
    )
    for v in failed:
        print(f"  FAIL {v['message']}")
    for v in undetermined:
        print(f"  UNDETERMINED {v['message']}")
    print(f"wrote {Path(args.out) / 'collapse.json'}")
    return 3 if args.strict and any(blocks(GateVerdict(**v)) for v in failed) else 0
