"""``collapse compare``: several families' collapse side by side (the search for a CPU family).

Finding a family that collapses on a CPU means changing one thing at a time and measuring
Delta against sigma each time (docs/experiments.md records such a search). Each attempt is a
family of its own under results/ (a config, or tiny with Hydra overrides and its own
``family.name``); this command reads what their collapse_stats and gate rules wrote and puts
them in one table and one figure:
``comparison.csv`` / ``comparison.md`` and ``comparison.png`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import rcParams

from collapse import curves as C
from collapse.layout import FamilyLayout
from collapse.plan import contrast_members
from collapse.plotting import Figure, save
from collapse.roles import Role

COMPARISON_COLUMNS = (
    "family", "band", "change", "delta_over_sigma_late", "supercollapse", "score_mean_delta",
    "gates_passed", "gates", "worst_gate_run", "worst_abs_residual", "threshold",
    "final_loss_smallest", "final_loss_largest", "ell_half_smallest", "ell_half_largest",
)  # fmt: skip


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def family_row(root: Path, change: str = "", role: Role = Role.FAMILY) -> list[dict]:
    """One row per TPP band of the family under ``root`` (results/<family>); with role
    ``Role.CONTRAST``, of its contrast runs (analysis under ``contrast/``, family.contrast)."""
    layout = FamilyLayout(Path(root))
    runs = pd.read_csv(layout.plan_dir / "runs.csv")
    family = contrast_members(runs) if role == Role.CONTRAST else runs[runs.role == role]
    analysis = layout.contrast_dir if role == Role.CONTRAST else layout.root
    label = layout.root.name + (" (contrast)" if role == Role.CONTRAST else "")
    rows = []
    for band in sorted(family.tpp_band.unique()):
        stats = _json(analysis / "collapse" / f"tpp{band:g}" / "collapse.json")
        if stats is None:
            continue
        mine = family[family.tpp_band == band]
        gates = {r: _json(analysis / "gates" / f"{r}.json") for r in mine.run}
        gates = {r: g for r, g in gates.items() if g is not None}
        worst = max(gates.items(), key=lambda kv: kv[1].get("max_abs_residual") or 0, default=None)
        sizes = C.ordered_sizes(mine.set_index("run"))
        ell = _ell_half(layout, mine, sizes)
        finals = _final_losses(layout, mine, sizes)
        rows.append(
            {
                "family": label,
                "band": band,
                "change": change,
                "delta_over_sigma_late": stats.get("delta_over_sigma"),
                "supercollapse": stats.get("supercollapse"),
                "score_mean_delta": stats.get("score"),
                "gates_passed": sum(bool(g.get("passed")) for g in gates.values()),
                "gates": len(gates),
                "worst_gate_run": worst[0] if worst else "",
                "worst_abs_residual": worst[1].get("max_abs_residual") if worst else None,
                "threshold": worst[1].get("threshold") if worst else None,
                "final_loss_smallest": finals[0],
                "final_loss_largest": finals[-1],
                "ell_half_smallest": ell[0],
                "ell_half_largest": ell[-1],
                "_stats": stats,
            }
        )
    return rows


def _size_runs(runs: pd.DataFrame, size: str) -> list[str]:
    return list(runs[runs["size"] == size].run)


def _final_losses(layout: FamilyLayout, runs: pd.DataFrame, sizes: list[str]) -> list[float]:
    out = []
    for size in (sizes[0], sizes[-1]):
        metas = [_json(layout.meta(r)) for r in _size_runs(runs, size)]
        values = [m["final_loss"] for m in metas if m and m.get("final_loss") is not None]
        out.append(float(np.mean(values)) if values else float("nan"))
    return out


def _ell_half(layout: FamilyLayout, runs: pd.DataFrame, sizes: list[str]) -> list[float]:
    """Mean normalized loss at t_hat 0.5 of the smallest and the largest size (the shape)."""
    paths = [layout.curve(r) for r in runs.run if layout.curve(r).is_file()]
    if not paths:
        return [float("nan"), float("nan")]
    from collapse.analysis import load_matrix

    matrix = load_matrix(paths, layout.plan_dir / "runs.csv")
    ell = matrix.normalized(0.0)
    labels = C.size_labels(matrix.meta).to_numpy()
    i = int(np.argmin(np.abs(matrix.grid - 0.5)))
    return [
        float(np.nanmean(ell[labels == size, i])) if (labels == size).any() else float("nan")
        for size in (sizes[0], sizes[-1])
    ]


def compare(roots: list[Path], changes: list[str], out: Path) -> pd.DataFrame:
    rows = []
    for root, change in zip(roots, changes, strict=True):
        if not (Path(root) / "plan" / "runs.csv").is_file():
            raise FileNotFoundError(f"{root}: no plan/runs.csv; give results/<family> folders")
        rows += family_row(Path(root), change)
    if not rows:
        raise FileNotFoundError("no collapse/tpp<band>/collapse.json under any family given")
    out.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame(rows)
    plot_comparison(table, out / "comparison.png")
    table = comparison_table(table)
    table.to_csv(out / "comparison.csv", index=False, float_format="%.6g")
    (out / "comparison.md").write_text(table.to_markdown(index=False, floatfmt=".4g") + "\n")
    return table


def comparison_table(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows of family_row, without the plot's data, in COMPARISON_COLUMNS order."""
    return rows.drop(columns=["_stats"])[list(COMPARISON_COLUMNS)]


def plot_comparison(table: pd.DataFrame, path: Path) -> Path:
    return save(comparison_figure(table), path)


def comparison_figure(table: pd.DataFrame) -> Figure:
    """Delta (solid) against the seed noise sigma (dotted) of each row's family and band."""
    fig = Figure(figsize=(7.5, 4.2), layout="tight")
    ax = fig.subplots()
    colours = rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (_, row) in enumerate(table.iterrows()):
        stats, colour = row["_stats"], colours[i % len(colours)]
        t = np.asarray(stats["t_hat"], dtype=float)
        keep = (t >= 0.2) & (t < 1.0)
        label = (
            f"{row['family']} (TPP {row['band']:g}): Δ/σ late {row['delta_over_sigma_late']:.2f}"
        )
        ax.plot(t[keep], np.asarray(stats["delta"], dtype=float)[keep], color=colour, label=label)
        sigma = np.asarray(stats["sigma_mean"], dtype=float)
        ax.plot(t[keep], sigma[keep], color=colour, ls=":", lw=1)
    ax.set_xlabel("t̂ (fraction of training)")
    ax.set_ylabel("Δ (solid) and seed noise σ (dotted)")
    ax.set_title("Collapse deviation of each family against its seed noise")
    ax.legend(fontsize=8)
    return fig


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "compare",
        help="several families' collapse side by side (Delta/sigma, gates, curve shape)",
        description="Put several families' collapse side by side: what their collapse and gate "
        "jobs wrote (Delta against sigma, the supercollapse verdict, gates passed, the worst "
        "residual), in comparison.csv, comparison.md and comparison.png under --out. Each "
        "family is a folder results/<family> of its own, e.g. tiny with one change made by a "
        "Hydra override and its own family.name; docs/experiments.md records such a search.",
    )
    p.add_argument("roots", nargs="+", type=Path, help="results/<family> folders")
    p.add_argument(
        "--changes",
        default=None,
        help="what each family changes, ';'-separated in the order of the folders",
    )
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.set_defaults(func=_cli)


def _cli(args: argparse.Namespace) -> int:
    changes = args.changes.split(";") if args.changes else [""] * len(args.roots)
    if len(changes) != len(args.roots):
        print(
            f"error: --changes has {len(changes)} entries for {len(args.roots)} folders; give "
            "one per folder, ';'-separated",
            file=sys.stderr,
        )
        return 2
    try:
        table = compare(args.roots, changes, args.out)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(table.to_markdown(index=False, floatfmt=".4g"))
    return 0
