"""How well early stopping tunes a sweep: error, selection regret and compute, per method.

Source: docs/method.md §5. Each variant of a sweep trains to a fraction of its full-length
schedule; a method predicts every variant's final loss and the lowest prediction is selected.
With the true final losses (a validated sweep trains every variant to the end) this module
measures, per method and fraction, the mean absolute error of the predictions, the regret of
the selection (true final loss of the chosen variant minus the best one's) and the compute
spent against training every variant fully. "random" is the paper's third baseline: its regret
is the expected one of a uniformly random choice.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from collapse.plotting import Figure

PREDICTION_COLUMNS = ("run", "fraction", "method", "predicted_final_loss")
TRUTH_COLUMNS = ("run", "true_final_loss")
METRIC_COLUMNS = (
    "sweep",
    "method",
    "fraction",
    "n_variants",
    "mean_abs_error_pct",
    "selected_run",
    "best_run",
    "selected_true_final_loss",
    "best_true_final_loss",
    "regret_loss",  # nats/token, like the loss
    "found_best",
    "compute_fraction_of_full_sweep",  # partial runs only, over every variant trained fully
    "compute_fraction_incl_finishing_selected",  # plus training the chosen variant to the end
)
REPORT_NAME = "sweep_metrics"


def _require(frame: pd.DataFrame, columns, name: str) -> None:
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise ValueError(
            f"{name} lacks column(s) {', '.join(missing)}: expected at least {', '.join(columns)}"
        )


def truth_from_predictions(predictions: pd.DataFrame) -> pd.DataFrame:
    """The true final losses carried by a predictions.csv of fully trained runs."""
    _require(predictions, ("run", "true_final_loss"), "predictions")
    keys = [c for c in ("sweep", "run") if c in predictions.columns]
    extra = [c for c in ("flops",) if c in predictions.columns]
    return predictions[[*keys, "true_final_loss", *extra]].drop_duplicates(keys)


def _one_group(sweep: str, method: str, fraction: float, group: pd.DataFrame) -> dict:
    """Metrics of one method at one fraction of one sweep (one row per variant in ``group``)."""
    cost = group["flops"] if "flops" in group.columns else pd.Series(1.0, index=group.index)
    complete = bool(group["true_final_loss"].notna().all())
    best = group.loc[group["true_final_loss"].idxmin()] if complete else None
    partial_compute = fraction  # every variant trained to the same fraction of its schedule
    row = {
        "sweep": sweep,
        "method": method,
        "fraction": fraction,
        "n_variants": len(group),
        "best_run": best["run"] if complete else "",
        "best_true_final_loss": float(best["true_final_loss"]) if complete else np.nan,
        "compute_fraction_of_full_sweep": partial_compute,
    }
    if method == "random":  # expected outcome of a uniform choice
        expected = float(group["true_final_loss"].mean()) if complete else np.nan
        return row | {
            "mean_abs_error_pct": np.nan,
            "selected_run": "",
            "selected_true_final_loss": expected,
            "regret_loss": expected - row["best_true_final_loss"],
            "found_best": None,  # a random pick has no single choice
            "compute_fraction_incl_finishing_selected": float(
                partial_compute + (1 - fraction) * cost.mean() / cost.sum()
            ),
        }
    error_pct = 100 * (group["predicted_final_loss"] - group["true_final_loss"]).abs()
    chosen = group.loc[group["predicted_final_loss"].idxmin()]
    return row | {
        "mean_abs_error_pct": float((error_pct / group["true_final_loss"]).mean()),
        "selected_run": chosen["run"],
        "selected_true_final_loss": float(chosen["true_final_loss"]),
        "regret_loss": float(chosen["true_final_loss"]) - row["best_true_final_loss"],
        "found_best": chosen["run"] == row["best_run"] if complete else None,
        "compute_fraction_incl_finishing_selected": float(
            partial_compute + (1 - fraction) * cost[chosen.name] / cost.sum()
        ),
    }


def sweep_metrics(predictions: pd.DataFrame, truth: pd.DataFrame) -> pd.DataFrame:
    """Per sweep, method and fraction: error, selected variant, regret and compute spent.

    predictions: one row per run x fraction x method with ``run, fraction, method,
    predicted_final_loss`` (and ``sweep`` when several sweeps are mixed; else one sweep "").
    truth: ``run, true_final_loss`` (optionally ``sweep``, and ``flops`` per fully trained
    variant; without it every variant costs the same). Runs missing from truth count in the
    selection but not in the error; regret needs every variant's truth.
    """
    _require(predictions, PREDICTION_COLUMNS, "predictions")
    _require(truth, TRUTH_COLUMNS, "truth")
    preds = predictions.drop(columns=["true_final_loss", "flops"], errors="ignore").copy()
    keys = ["sweep", "run"] if "sweep" in preds.columns and "sweep" in truth.columns else ["run"]
    if "sweep" not in preds.columns:
        preds["sweep"] = ""
    extra = [c for c in ("flops",) if c in truth.columns]
    truth_cols = truth[[*keys, "true_final_loss", *extra]].drop_duplicates(keys)
    merged = preds.merge(truth_cols, on=keys, how="left", validate="many_to_one")
    rows = []
    for (sweep, fraction), at_fraction in merged.groupby(["sweep", "fraction"], sort=True):
        for method, group in at_fraction.groupby("method", sort=False):
            rows.append(_one_group(sweep, method, float(fraction), group.reset_index(drop=True)))
        variants = at_fraction.drop_duplicates("run").reset_index(drop=True)
        rows.append(_one_group(sweep, "random", float(fraction), variants))
    return pd.DataFrame(rows, columns=list(METRIC_COLUMNS))


def metrics_markdown(metrics: pd.DataFrame) -> str:
    """The metrics as a GitHub Markdown table (losses in nats/token, fractions in %)."""
    shown = pd.DataFrame(
        {
            "sweep": metrics["sweep"],
            "method": metrics["method"],
            "trained (%)": (100 * metrics["fraction"]).map("{:.0f}".format),
            "variants": metrics["n_variants"],
            "mean abs error (%)": metrics["mean_abs_error_pct"].map("{:.2f}".format),
            "selected": metrics["selected_run"].fillna("").astype(str),
            "best": metrics["best_run"].fillna("").astype(str),
            "regret (nats/token)": metrics["regret_loss"].map("{:.4f}".format),
            "found best": metrics["found_best"]
            .map({True: "yes", False: "no", "True": "yes", "False": "no"})
            .fillna(""),
            "compute (% of full sweep)": (100 * metrics["compute_fraction_of_full_sweep"]).map(
                "{:.0f}".format
            ),
        }
    ).astype(str)
    shown = shown.replace("nan", "")
    lines = ["| " + " | ".join(shown.columns) + " |", "|" + "---|" * len(shown.columns)]
    lines += ["| " + " | ".join(row) + " |" for row in shown.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def plot_sweep_metrics(metrics: pd.DataFrame):
    """Figure: prediction error against training fraction, regret against compute spent."""
    fig = Figure(figsize=(10, 4), layout="tight")
    ax_err, ax_regret = fig.subplots(1, 2)
    several = metrics["sweep"].nunique() > 1
    methods = list(pd.unique(metrics["method"]))
    for (sweep, method), rows in metrics.groupby(["sweep", "method"], sort=False):
        rows = rows.sort_values("fraction")
        label = f"{sweep}: {method}" if several else method
        k = methods.index(method)  # shrinking markers keep coinciding points visible
        style = dict(
            marker="osD^v"[k % 5], ms=9 - 1.5 * (k % 5), ls=":" if method == "random" else "-"
        )
        style["label"] = label
        if rows["mean_abs_error_pct"].notna().any():
            ax_err.plot(100 * rows["fraction"], rows["mean_abs_error_pct"], **style)
        ax_regret.plot(100 * rows["compute_fraction_of_full_sweep"], rows["regret_loss"], **style)
    ax_err.set_xlabel("training stopped at (% of each run)")
    ax_err.set_ylabel("mean absolute error of predicted final loss (%)")
    ax_err.set_ylim(bottom=0)
    ax_regret.set_xlabel("compute spent (% of training every variant fully)")
    ax_regret.set_ylabel("selection regret (nats/token)")
    ax_regret.axhline(0, color="grey", lw=0.8)
    for ax in (ax_err, ax_regret):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def write_sweep_report(metrics: pd.DataFrame, out_dir) -> list[Path]:
    """Write sweep_metrics.csv, .md, .png and .pdf under out_dir; returns the paths."""
    _require(metrics, METRIC_COLUMNS, "metrics")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{REPORT_NAME}.{ext}" for ext in ("csv", "md", "png", "pdf")]
    metrics.to_csv(paths[0], index=False)
    paths[1].write_text(metrics_markdown(metrics))
    fig = plot_sweep_metrics(metrics)
    for path in paths[2:]:
        fig.savefig(path, dpi=120)
    return paths
