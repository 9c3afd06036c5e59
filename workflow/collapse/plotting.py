"""The package's one plotting idiom, and the one function that draws collapse curves.

Every figure is a ``matplotlib.figure.Figure`` made directly, never through pyplot: it renders
with the Agg canvas, needs no display and no global backend switch (``matplotlib.use``), and is
freed like any object, so no module holds figures open. ``save`` writes one.

``draw_collapse_curves`` draws normalized loss curves coloured by size over a reference curve
and its band: the analysis' collapse.png and the report's collapse_curves figure both call it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

SHOW_FROM_T_HAT = 0.2  # curves are scaled to t_hat >= this: before it ell is far above 1

__all__ = ["Figure", "draw_collapse_curves", "save", "size_colours", "visible_limits"]


def save(fig: Figure, path: str | Path, dpi: int = 110, *, pdf: bool = False) -> Path:
    """Write ``fig`` to ``path`` (creating its folder), and beside it as PDF if ``pdf``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    if pdf:
        fig.savefig(path.with_suffix(".pdf"))
    return path


def size_colours(sizes: list[str]) -> dict[str, tuple]:
    """One viridis colour per size, smallest dark, largest light (never the pale yellow end)."""
    cmap = colormaps["viridis"]
    return {s: cmap(x) for s, x in zip(sizes, np.linspace(0.0, 0.85, len(sizes)), strict=True)}


def visible_limits(values: np.ndarray, grid: np.ndarray, pad: float) -> tuple[float, float]:
    """Axis limits that show ``values`` from SHOW_FROM_T_HAT on, padded by ``pad`` of the span."""
    shown = values[:, grid >= SHOW_FROM_T_HAT]
    shown = shown[np.isfinite(shown)]
    if not len(shown):
        return 0.0, 1.0
    lo, hi = float(shown.min()), float(shown.max())
    span = max(hi - lo, 1e-3)
    return lo - pad * span, hi + pad * span


def draw_collapse_curves(
    ax: Axes,
    grid: np.ndarray,
    ell: np.ndarray,
    labels: np.ndarray,
    colours: dict[str, tuple],
    *,
    reference=None,
    complete: np.ndarray | None = None,
    offset: float = 0.0,
) -> None:
    """Normalized curves ``ell`` (one row per run, size label in ``labels``) on ``ax``.

    ``reference`` (a ReferenceCurve): its mean ± 2 std band in grey and its curve dashed black.
    ``complete``: False marks runs still in progress, drawn dotted (normalized by the L(T) that
    early-align fits). One legend entry per size; y limits show t_hat >= SHOW_FROM_T_HAT.
    """
    complete = np.ones(len(ell), dtype=bool) if complete is None else np.asarray(complete)
    if reference is not None:
        ax.fill_between(reference.t_hat, reference.lower, reference.upper, color="0.88", lw=0)
        names = ", ".join(reference.sizes) or "reference sizes"
        ax.plot(
            reference.t_hat, reference.ell, "k--", lw=1.6, zorder=5, label=f"reference ({names})"
        )
    seen = set()
    for i, size in enumerate(labels):
        ax.plot(
            grid,
            ell[i],
            color=colours.get(size, "C3"),
            lw=1.1,
            alpha=0.85,
            ls="-" if complete[i] else ":",
            label=None if size in seen else f"{size}",
        )
        seen.add(size)
    ax.set_ylim(*visible_limits(ell, grid, 0.08))
    ax.set_ylabel("normalized loss ℓ = L / L(T)" if offset == 0 else "ℓ = (L−L0)/(L(T)−L0)")
    ax.grid(alpha=0.3)
    handles, names = ax.get_legend_handles_labels()
    if not complete.all():
        handles.append(Line2D([], [], color="0.4", ls=":"))
        names.append("in progress (early-aligned L(T))")
    ax.legend(handles, names, fontsize=8, title="size", title_fontsize=8)
