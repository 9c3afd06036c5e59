"""``collapse stage NAME``: the one call each Snakemake rule makes after training.

Each stage is a thin adapter from a rule's inputs/outputs to the library function that does the
work (``collapse.analysis``, ``collapse.predict``/``collapse.sweep``, ``collapse.evaluate``,
``collapse.report``); the rules stay free of logic and the functions stay usable without Snakemake.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from collapse.evaluate import DEFAULT_BATCH_SIZE
from collapse.roles import Role


def _reference(args: argparse.Namespace) -> int:
    from collapse.analysis import build_reference

    reference = build_reference(
        args.curves, args.runs, [s for s in args.sizes.split(",") if s], args.out
    )
    print(f"reference of sizes {args.sizes} (band TPP {args.band}): {len(reference.t_hat)} points")
    return 0


def _gate(args: argparse.Namespace) -> int:
    from collapse.analysis import gate_run
    from collapse.gates import GatePolicy

    given = json.loads(args.policy)
    enforce = given.get("enforce", True) and not args.allow_fail
    policy = GatePolicy.model_validate({**given, "enforce": enforce})
    verdict = gate_run(args.curve, args.reference, args.runs, policy, args.out, args.plot)
    print(verdict.message)
    return 0  # the verdict is the output; downstream rules refuse a failed one


def _collapse(args: argparse.Namespace) -> int:
    from collapse.analysis import family_statistics

    stats = family_statistics(args.curves, args.runs, args.out, reference=args.reference)
    print(f"band TPP {args.band}, reference sizes {args.sizes or 'none given'}:")
    print(json.dumps({"supercollapse": stats.to_dict().get("supercollapse")}))
    return 0


def _share(args: argparse.Namespace) -> int:
    """A run the plan found to train exactly like a family run (plan column ``same_as``): its
    outputs are that run's, relabelled with its own name, so the compute is spent once."""
    import pandas as pd

    from collapse.train import CURVE_FILE, META_FILE, VALID_FILE

    args.out.mkdir(parents=True, exist_ok=True)
    for name in (CURVE_FILE, VALID_FILE):
        frame = pd.read_parquet(args.source / name).assign(run=args.run)
        tmp = args.out / (name + ".tmp")
        frame.to_parquet(tmp, index=False)
        tmp.replace(args.out / name)
    meta = json.loads((args.source / META_FILE).read_text())
    meta |= {"run": args.run, "same_as": meta["run"]}
    tmp = args.out / (META_FILE + ".tmp")  # written last: its presence marks a finished run
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    tmp.replace(args.out / META_FILE)
    print(f"{args.run}: the outputs of {meta['same_as']} (the same training, trained once)")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    """Predict every variant against the small runs of its own tau (the seeds' mean curve);
    metrics where truth is known.

    docs/method.md §5: the reference of a setting is a small model trained with the same
    controls (schedule, tau, TPP). The plan adds one such run per distinct tau of the grid.
    The family's own sizes among the curves (``sweep_drift.drift_fit_runs``) give the size
    drift, which the "drift" method applies to every variant; drift.json says what it assumed,
    or why it could not be fitted.
    """
    import numpy as np
    import pandas as pd

    from collapse.curves import read_curves, resample, smooth
    from collapse.predict import predict_runs
    from collapse.reference import reference_curve
    from collapse.sweep import sweep_metrics, truth_from_predictions, write_sweep_report
    from collapse.sweep_drift import (
        ASSUMPTION,
        drift_fit_runs,
        fit_sweep_drift,
        predict_sweep_drift,
    )

    curves = smooth(read_curves(args.curves, args.runs))
    runs = pd.read_csv(args.runs).set_index("run")
    mine = runs.loc[[r for r in curves.runs if r in runs.index]]
    references = mine[mine.role == Role.SWEEP_REFERENCE]
    variants = mine[mine.role == Role.SWEEP]
    if references.empty or variants.empty:
        raise SystemExit("error: a sweep needs its variants and its sweep_reference runs")
    sweeps = variants["sweep"].astype(str).unique()
    fit_runs = [r for s in sweeps for r in drift_fit_runs(runs, s)]
    fit, note = fit_sweep_drift(curves, fit_runs)
    tables, drifted = [], []
    for tau, group in variants.groupby("tau"):
        distance = np.abs(references["tau"].to_numpy() - tau)
        ref_runs = list(references.index[np.isclose(distance, distance.min())])  # its seeds
        reference = reference_curve(resample(curves.select(ref_runs)))
        table = predict_runs(curves, reference, args.fractions, runs=list(group.index))
        tables.append(table.assign(reference_run=",".join(ref_runs)))
        if fit is None:
            continue
        try:
            found = predict_sweep_drift(curves, fit, ref_runs, list(group.index), args.fractions)
        except ValueError as err:  # every variant by the drift, or none: one selection
            fit, note = None, f"the size drift cannot be applied ({err}); the paper's method only"
            continue
        drifted.append(found.assign(reference_run=",".join(ref_runs)))
    table = pd.concat(tables + (drifted if fit is not None else []), ignore_index=True)
    table["sweep"] = table["run"].map(runs["sweep"]).astype(str)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "predictions.csv", index=False, float_format="%.6g")
    drift = {"fitted": fit is not None, "note": note, "fit_runs": fit_runs}
    if fit is not None:
        drift |= {"assumption": ASSUMPTION} | fit.to_dict()
    (out / "drift.json").write_text(json.dumps(drift, indent=2) + "\n")
    print(note)
    truth = truth_from_predictions(table)
    truth["flops"] = truth["run"].map(runs["flops"])
    metrics = sweep_metrics(table, truth)
    metrics.to_csv(out / "metrics.csv", index=False, float_format="%.6g")
    write_sweep_report(metrics, out)
    chosen = metrics[metrics.method.isin(["collapse", "drift"])].sort_values("fraction")
    for _, row in chosen.iterrows():
        print(f"at {row.fraction:.0%} of training: {row.method} selects {row.selected_run}")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from collapse.evaluate import evaluate_run
    from collapse.gates import GateFailed, require_passed

    try:
        require_passed(args.gate)
    except GateFailed as err:
        print(f"error: {err}", file=sys.stderr)
        print("(allow it with family.gates.allow_fail=[<run>] to evaluate anyway)", file=sys.stderr)
        return 3
    tasks = [t for t in args.tasks.split(",") if t]
    chosen = {"tasks": tasks} if tasks else {}
    if args.batch_size is not None:
        chosen["batch_size"] = args.batch_size
    evaluate_run(args.spec, args.out, limit=args.limit, **chosen)
    return 0


def _report(args: argparse.Namespace) -> int:
    from collapse.report import build_report

    paths = build_report(Path(args.root), Path(args.out).parent)
    print(f"report: {len(paths)} files in {Path(args.out).parent}")
    return 0


def _detect(args: argparse.Namespace) -> int:
    from collapse.config import DetectorSpec
    from collapse.detect import run_experiment, summary_lines
    from collapse.gates import GatePolicy
    from collapse.runspec import RunSpec

    specs = [RunSpec.load(path) for path in args.specs]
    policy = GatePolicy.model_validate(json.loads(args.policy))
    detectors = DetectorSpec.model_validate_json(args.detectors)
    detections = run_experiment(specs, policy, detectors, args.out, args.runs)
    print("\n".join(summary_lines(detections)))
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    stage = subparsers.add_parser(
        "stage",
        help="run one workflow stage (what the Snakemake rules call)",
        description="The workflow's stages after training, one per Snakemake rule. Users "
        "normally run `snakemake`; `collapse analyze` and `collapse predict` are the stand-alone "
        "commands for curves from anywhere.",
    )
    sub = stage.add_subparsers(dest="stage", metavar="STAGE", required=True)

    p = sub.add_parser("reference", help="reference curve of one TPP band")
    p.add_argument("curves", nargs="+", type=Path, help="curve.parquet of the reference runs")
    p.add_argument("--runs", type=Path, required=True, help="plan/runs.csv (run metadata)")
    p.add_argument("--sizes", required=True, help="reference sizes, comma-separated")
    p.add_argument("--band", required=True, help="the TPP band (for the log)")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.set_defaults(func=_reference)

    p = sub.add_parser("gate", help="one run's residual against its reference: verdict + plot")
    p.add_argument("--curve", type=Path, required=True, help="the run's curve.parquet")
    p.add_argument("--reference", type=Path, required=True, help="reference.csv")
    p.add_argument("--runs", type=Path, required=True, help="plan/runs.csv")
    p.add_argument(
        "--policy",
        default="{}",
        help="gate policy as JSON (family.gates; default: {}, the defaults)",
    )
    p.add_argument("--allow-fail", action="store_true", help="record a failure, do not block")
    p.add_argument("--out", type=Path, required=True, help="verdict JSON")
    p.add_argument("--plot", type=Path, required=True, help="evidence PNG")
    p.set_defaults(func=_gate)

    p = sub.add_parser("collapse", help="Delta vs sigma and the supercollapse verdict of a band")
    p.add_argument("curves", nargs="+", type=Path, help="curve.parquet of the band's runs")
    p.add_argument("--runs", type=Path, required=True, help="plan/runs.csv (run metadata)")
    p.add_argument("--sizes", default="", help="reference sizes, comma-separated (for the log)")
    p.add_argument("--band", required=True, help="the TPP band (for the log)")
    p.add_argument("--reference", type=Path, default=None, help="reference.csv")
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.set_defaults(func=_collapse)

    p = sub.add_parser("share", help="a run's outputs from the family run it duplicates")
    p.add_argument("--run", required=True, help="the run's own name")
    p.add_argument("--source", type=Path, required=True, help="the family run's folder")
    p.add_argument("--out", type=Path, required=True, help="the run's folder")
    p.set_defaults(func=_share)

    p = sub.add_parser("sweep", help="predict a sweep's final losses from partial runs")
    p.add_argument(
        "curves",
        nargs="+",
        type=Path,
        help="variants, their sweep_reference runs, and the family runs the size drift is "
        "fitted on (collapse.sweep_drift.drift_fit_runs)",
    )
    p.add_argument("--runs", type=Path, required=True, help="plan/runs.csv (run metadata)")
    p.add_argument(
        "--fractions",
        type=float,
        nargs="+",
        required=True,
        help="fractions of training to predict from (family.sweeps' fractions)",
    )
    p.add_argument("--out", type=Path, required=True, help="output directory")
    p.set_defaults(func=_sweep)

    p = sub.add_parser("evaluate", help="held-out loss and downstream tasks of a gated run")
    p.add_argument("--spec", type=Path, required=True, help="the run's spec (plan/runs/<run>.json)")
    p.add_argument("--gate", type=Path, required=True, help="the run's gate verdict")
    p.add_argument("--limit", type=int, default=None, help="examples per task (CPU)")
    p.add_argument(
        "--tasks",
        default="",
        help="task names, comma-separated (unlike `collapse evaluate --tasks`, which takes them "
        "space-separated; default: all seven)",
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help=f"scoring windows per forward pass (default {DEFAULT_BATCH_SIZE}; the plan sizes it "
        "to the GPU)",
    )
    p.add_argument("--out", type=Path, required=True, help="the run's evaluation JSON")
    p.set_defaults(func=_evaluate)

    p = sub.add_parser(
        "detect", help="fault-detection experiment: collapse monitor vs raw-loss detectors"
    )
    p.add_argument("--policy", required=True, help="the family's gates block (JSON)")
    p.add_argument("--detectors", required=True, help="the faults.detectors block (JSON)")
    p.add_argument("--runs", type=Path, default=None, help="plan/runs.csv (own-size reference)")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("specs", nargs="+", type=Path, help="run specs: fault runs and clean seeds")
    p.set_defaults(func=_detect)

    p = sub.add_parser("report", help="every figure and table of a family")
    p.add_argument("--root", type=Path, required=True, help="results/<family>")
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="path of the report's index.md (its folder receives every file)",
    )
    p.set_defaults(func=_report)
