"""Every figure and table of the family's report, registered once: file, section and captions.

``collapse.report`` writes each of them (one builder per section, in ``SECTIONS`` order) and
links them from index.md with their ``summary``; workflow/rules/report.smk declares the ones
with a ``category`` as outputs of the ``report`` rule for Snakemake's ``--report``, whose
caption is the ``caption`` text, which the report stage writes as captions/<name>.rst. This
module imports nothing heavy: the Snakefile reads it when it parses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["figure", "table"]
# What a family must have for a section to be written; "" is every family.
Needs = Literal["", "sweeps", "faults", "contrast"]


@dataclass(frozen=True)
class Section:
    """A section of index.md, in the order the report writes them."""

    key: str
    title: str
    needs: Needs = ""


@dataclass(frozen=True)
class Artifact:
    """One figure (<name>.png and .pdf) or table (<name>.csv and .md) of the report folder."""

    name: str
    kind: Kind
    section: str  # Section.key
    summary: str  # the line under it in index.md
    caption: str = ""  # Snakemake --report's caption (reStructuredText); "" when not reported
    category: str = ""  # Snakemake --report's category; "" keeps it out of --report

    @property
    def file(self) -> str:
        """The file Snakemake's --report shows: the PNG of a figure, the CSV of a table."""
        return f"{self.name}.{'png' if self.kind == 'figure' else 'csv'}"


SECTIONS = (
    Section("family", "Family"),
    Section("collapse", "Collapse"),
    Section("delta_sigma", "Delta against sigma"),
    Section("gates", "Gates"),
    Section("contrast", "Contrast: tau not held fixed", needs="contrast"),
    Section("sweeps", "Sweeps (early stopping)", needs="sweeps"),
    Section("faults", "Fault detection", needs="faults"),
    Section("downstream", "Downstream accuracy"),
)

ARTIFACTS = (
    Artifact(
        "family_table",
        "table",
        "family",
        "Every run of the family: size, parameters, tokens, FLOPs, losses, downstream average "
        "and gate.",
        caption=(
            "Every planned run of the family: size, TPP band, seed, parameters, training "
            "tokens and FLOPs (Table 9 accounting), the fraction of training done, the final "
            "smoothed training loss and the held-out loss (nats/token), held-out perplexity, "
            "the downstream average (%) and the gate verdict. Blank cells: not trained, "
            "evaluated or gated yet."
        ),
        category="tables",
    ),
    Artifact(
        "collapse_curves",
        "figure",
        "collapse",
        "Normalized training loss by size for each TPP band (top) and the residual against the "
        "band's reference curve (bottom).",
        caption=(
            "Normalized training-loss curves of every size, one column per TPP band (Bergsma "
            "et al. 2025, arXiv 2509.25087). Top: ℓ(t̂) = L(t̂·T) / L(T), the smoothed "
            "training loss divided by the run's final loss (runs still in progress, dotted, "
            "are divided by the L(T) that early-align fits over the align window); the dashed "
            "black line and grey band are the band's reference curve (mean ± 2 std of the "
            "reference sizes). Curves that fall on one line are the collapse. Bottom: the "
            "residual ℓ_run − ℓ_ref with each run early-aligned, as the gates compute it; red "
            "dashed lines are the gate threshold. A run whose residual leaves the band late "
            "in training has a problem the raw loss does not show yet."
        ),
        category="collapse",
    ),
    Artifact(
        "delta_sigma",
        "figure",
        "delta_sigma",
        "Collapse deviation Delta (spread of normalized curves across sizes and seeds) against "
        "the seed noise floor sigma, per TPP band.",
        caption=(
            "Collapse deviation per TPP band (after Qiu et al. 2025): Δ(t̂), the standard "
            "deviation of the normalized curves across sizes and seeds divided by their mean "
            "(solid black), against the seed noise floor σ(t̂) of each size with several "
            "seeds (dashed), log scale, in percent. Δ below σ over the late window (shaded) "
            "is supercollapse: the sizes agree as well as seeds of one size do. The title "
            "gives the collapse score (mean Δ over t̂ ≥ 0.2; lower is better) and the "
            "verdict."
        ),
        category="collapse",
    ),
    Artifact(
        "collapse_summary",
        "table",
        "delta_sigma",
        "Collapse per TPP band: score, Delta/sigma late in training, supercollapse verdict.",
    ),
    Artifact(
        "gate_summary",
        "figure",
        "gates",
        "Largest residual of each gated run relative to its gate threshold.",
        caption=(
            "Collapse gates: for every gated run, the largest absolute residual against its "
            "band's reference curve over the gate window, divided by the gate threshold "
            "(calibrated from the reference sizes' seed noise, never below the policy floor). "
            "Bars past 1 (red) are failed gates; their per-run evidence plots and messages "
            "(where the divergence starts, by how much) are in the gates table."
        ),
        category="collapse",
    ),
    Artifact("gates", "table", "gates", "Gate verdict of every gated run."),
    Artifact(
        "contrast",
        "figure",
        "contrast",
        "Delta (solid) and seed noise sigma (dotted) of the family, which holds tau fixed, and "
        "of its contrast, whose sizes share one weight decay so that tau drifts.",
        caption=(
            "The family against its contrast (``family.contrast``): the same sizes, seeds and "
            "tokens, but every size keeps the weight decay of the smallest size (as "
            "Llama-style recipes hold lambda fixed), so tau = B/(eta lambda D) drifts with "
            "size. Solid: Delta, the spread of the normalized curves across sizes; dotted: "
            "sigma, the seed noise, of each. Collapse is Delta/sigma below 1 late in "
            "training; the table gives both sets' Delta/sigma, gate verdicts and curve "
            "shapes."
        ),
        category="collapse",
    ),
    Artifact(
        "contrast",
        "table",
        "contrast",
        "The family against its contrast: Delta/sigma late, gates, final losses and the "
        "normalized loss at t_hat 0.5 of the smallest and the largest size.",
    ),
    Artifact(
        "sweep_predictions",
        "figure",
        "sweeps",
        "Predicted final loss of each sweep variant against the fraction of training it ran, "
        "per prediction method; horizontal lines: true final losses.",
        caption=(
            "Early stopping in a hyperparameter sweep (docs/method.md §5): the final loss of "
            "each variant predicted from its curve cut at 10-30 % of training, one column per "
            "method: collapse (the divisor L(T) that aligns the partial curve with the "
            "reference), current (the loss reached so far) and powerlaw (a fitted power law "
            "extrapolated to the end). Error bars: each method's uncertainty band. Dashed "
            "lines: the variants' true final losses where they were trained to the end. A "
            "good method lands on the dashed line of its colour early."
        ),
        category="collapse",
    ),
    Artifact(
        "sweep_metrics",
        "figure",
        "sweeps",
        "Prediction error against training fraction and selection regret against compute, per "
        "method.",
        caption=(
            "How well each method tunes the sweep: left, mean absolute error of the predicted "
            "final loss against the fraction of training; right, the selection regret (true "
            "final loss of the chosen variant minus the best one, nats/token) against the "
            "compute spent, with a random choice as the baseline."
        ),
        category="collapse",
    ),
    Artifact(
        "sweep_metrics",
        "table",
        "sweeps",
        "Early-stopping metrics per sweep, method and training fraction.",
    ),
    Artifact(
        "sweep_predictions",
        "table",
        "sweeps",
        "Predicted final loss per sweep variant, fraction and method.",
    ),
    Artifact(
        "fault_detection",
        "figure",
        "faults",
        "Injected faults in one size: raw loss (top) and residual against the reference "
        "(bottom), with the fault start and each detector's first alarm.",
        caption=(
            "The fault-detection experiment (``family.faults``): each injected fault runs in "
            "one size, next to clean seeds of that size. Top: the raw training loss (grey: a "
            "clean seed). Bottom: the residual of the run's normalized curve against the "
            "family's reference, with the gate threshold (dotted). Dashed: the fault's first "
            "step; coloured lines: the first alarm of the collapse monitor against the "
            "family's reference (red) and against the size's own clean seeds (purple), the "
            "raw-loss spike detector (blue, OLMo-core's rule), the smoothed-rise detector "
            "(green) and the controls audit (orange: the AdamW rate eta*lambda the optimizer "
            "applied, off the reference runs' tau). The table lists every alarm with its "
            "outcome; a clean run's alarm is a false alarm."
        ),
        category="collapse",
    ),
    Artifact(
        "detections",
        "table",
        "faults",
        "First alarm of each detector on every fault run and clean seed.",
    ),
    Artifact(
        "downstream_vs_flops",
        "figure",
        "downstream",
        "Average downstream accuracy (7 tasks) against training FLOPs: this family, Celerity "
        "and published open models, with the Pareto frontier.",
        caption=(
            "Average accuracy over the paper's seven tasks (lm-evaluation-harness: "
            "arc_challenge 25-shot, arc_easy, boolq, hellaswag 10-shot, piqa, siqa, "
            "winogrande 5-shot) against training FLOPs, log scale. Grey: open models as "
            "published in Table 10 of arXiv 2509.25087; orange stars: Celerity's released "
            "sizes (234 tokens per parameter) at the FLOPs this project's planner computes "
            "from the celerity family spec; blue squares: this family's evaluated runs (a "
            "subsample of each task when the legend says so). Black: the Pareto frontier, the "
            "best accuracy reached at or below each compute; named points are on it. A family "
            "far below the published compute gets its own panel."
        ),
        category="collapse",
    ),
    Artifact(
        "downstream",
        "table",
        "downstream",
        "Downstream accuracy (%) and training FLOPs of every model in the accuracy figure; "
        "on_frontier marks the Pareto frontier.",
    ),
)


def artifact(name: str, kind: Kind) -> Artifact:
    """The registered figure or table ``name``; a KeyError names the unregistered one."""
    for a in ARTIFACTS:
        if a.name == name and a.kind == kind:
            return a
    raise KeyError(f"{kind} {name!r} is not registered in collapse.artifacts.ARTIFACTS")


def section(key: str) -> Section:
    for s in SECTIONS:
        if s.key == key:
            return s
    raise KeyError(f"section {key!r} is not registered in collapse.artifacts.SECTIONS")


def reported(*, sweeps: bool, faults: bool, contrast: bool) -> list[Artifact]:
    """The artifacts Snakemake's --report shows for a family with these parts: every one with
    a category whose section the family writes."""
    has = {"": True, "sweeps": sweeps, "faults": faults, "contrast": contrast}
    return [a for a in ARTIFACTS if a.category and has[section(a.section).needs]]
