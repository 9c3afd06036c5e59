"""The loss-curve contract, checked once for every reader (analyze, predict, the rules).

A curve table that breaks the contract is an input error, never a verdict: a loss written as
text, a negative step or a size that changes within a run would otherwise come out as a
"diverged" run or a family of one-run sizes. Every check is vectorized (pandas/numpy), and
every error names the file, the line or row, the run and the fix, as one ``InputError``.

Contract (one row per logged step):

- ``run``: a name on every row;
- ``step``: whole numbers >= 0, each at most once per run, at most the run's ``steps``;
- ``loss``: numbers > 0; NaN/inf only from some step to the end of a run (training diverged
  there), never followed by a finite loss;
- ``t_hat`` (optional): within [0, 1];
- per-run columns (``size``, ``params``, ``seed``, ``tpp``, ``tau``, ``steps``, ``schedule``):
  one value per run; ``size``/``params`` given for every run or for none;
- at least ``MIN_RUN_POINTS`` finite losses per run; no two runs with the same size, seed and
  controls (the same run under two names).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

REQUIRED_COLUMNS = ("run", "step", "loss")
# Per-run columns that identify a run's setting: one value per run, or the run is ill-defined.
IDENTITY_COLUMNS = ("size", "params", "seed", "tpp", "tau", "steps", "schedule")
# Columns that tell two runs of the same size and seed apart (a sweep, a fault, a contrast).
DISTINGUISHING_COLUMNS = (
    "tpp", "tau", "schedule", "steps", "batch_seqs", "lr_peak", "weight_decay", "warmup_steps",
    "role", "sweep", "fault", "tpp_band", "stop_fraction",
)  # fmt: skip
MIN_RUN_POINTS = 2  # one point is no curve: nothing to smooth, align or normalize
T_HAT_TOLERANCE = 1e-9


class InputError(ValueError):
    """Input the command cannot use (a malformed curve, a bad flag): exit status 2, no traceback.

    A ValueError so callers that already treat ValueError as bad input keep working.
    """


def fail(problem: str, fix: str, where: str | None = None) -> InputError:
    """An InputError reading ``where: problem; fix``."""
    prefix = f"{where}: " if where else ""
    return InputError(f"{prefix}{problem}; {fix}")


@dataclass(frozen=True)
class Origin:
    """Where each row of a concatenated table came from, to name it in errors.

    ``labels[i]`` covers rows ``starts[i]`` to ``starts[i + 1] - 1``; CSV rows are named by line
    (the header is line 1), Parquet and in-memory rows by their 1-based row number.
    """

    labels: tuple[str, ...]
    starts: tuple[int, ...]
    csv: tuple[bool, ...]

    @classmethod
    def of_frame(cls, name: str = "curve table") -> Origin:
        return cls((name,), (0,), (False,))

    @classmethod
    def of_files(cls, files: Sequence[Path], lengths: Sequence[int]) -> Origin:
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int)
        csv = tuple(".csv" in "".join(f.suffixes).lower() or ".tsv" in f.name for f in files)
        return cls(tuple(str(f) for f in files), tuple(int(s) for s in starts), csv)

    def row(self, position: int) -> str:
        i = int(np.searchsorted(self.starts, position, side="right") - 1)
        n = int(position) - self.starts[i]
        return f"{self.labels[i]} line {n + 2}" if self.csv[i] else f"{self.labels[i]} row {n + 1}"

    def where(self, positions: np.ndarray, runs: np.ndarray | None = None) -> str:
        """The first offending row (and its run), plus how many more there are."""
        positions = np.asarray(positions)
        text = self.row(int(positions[0]))
        if runs is not None:
            text += f" (run {runs[0]})"
        if len(positions) > 1:
            text += f" and {len(positions) - 1} more row{'s' * (len(positions) > 2)}"
        return text


def show(value) -> str:
    """A cell as the user wrote it: 0, not np.int64(0)."""
    return repr(value.item() if isinstance(value, np.generic) else value)


def _unparsable(column: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """(numbers, mask of cells that hold something that is not a number)."""
    if pd.api.types.is_bool_dtype(column.dtype):
        return column.to_numpy(dtype=float), np.ones(len(column), dtype=bool)
    if pd.api.types.is_numeric_dtype(column.dtype):
        return column.to_numpy(dtype=float), np.zeros(len(column), dtype=bool)
    numbers = pd.to_numeric(column, errors="coerce")
    bad = (column.notna() & numbers.isna()).to_numpy()
    return numbers.to_numpy(dtype=float), bad


def check_columns(df: pd.DataFrame, origin: Origin) -> None:
    missing = [c for c in REQUIRED_COLUMNS if c not in df.columns]
    if missing:
        raise fail(
            f"lacks column(s) {missing} (has {list(map(str, df.columns))})",
            "a curve table needs one row per logged step with columns run, step, loss: rename "
            "yours to these names",
            ", ".join(dict.fromkeys(origin.labels)),
        )
    if len(df) == 0:
        raise fail(
            "the curve table has a header but no rows",
            "give a table with one row per logged step",
            ", ".join(dict.fromkeys(origin.labels)),
        )


def check_rows(
    df: pd.DataFrame, codes: np.ndarray, names: np.ndarray, origin: Origin
) -> tuple[np.ndarray, np.ndarray]:
    """Parse and check ``step`` and ``loss`` row by row: (step as int64, loss as float)."""
    runs = names[codes]

    def bad(mask: np.ndarray, problem: str, fix: str, values: np.ndarray | None = None):
        if mask.any():
            at = np.flatnonzero(mask)
            shown = f" ({show(values[at[0]])})" if values is not None else ""
            raise fail(problem + shown, fix, origin.where(at, runs[at]))

    raw_step, raw_loss = df["step"].to_numpy(), df["loss"].to_numpy()
    step, unparsable = _unparsable(df["step"])
    bad(unparsable, "step is not a number", "write optimizer steps as whole numbers", raw_step)
    bad(np.isnan(step), "step is empty", "give every row its optimizer step")
    bad(~np.isfinite(step), "step is infinite", "give every row its optimizer step", raw_step)
    bad(step != np.round(step), "step is not a whole number", "steps count optimizer updates: "
        "write whole numbers (a t_hat column holds fractions of training)", raw_step)  # fmt: skip
    bad(step < 0, "step is negative", "steps count optimizer updates from 0 or 1", raw_step)
    loss, unparsable = _unparsable(df["loss"])
    bad(
        unparsable,
        "loss is not a number",
        "write the training loss as a number (nats/token); a diverged step may be nan or inf",
        raw_loss,
    )
    bad(
        np.isfinite(loss) & (loss <= 0),
        "loss is not positive",
        "a training loss (cross-entropy, nats/token) is > 0: give the loss itself, not its "
        "logarithm or a difference",
        raw_loss,
    )
    return step.astype(np.int64), loss


def check_sorted_runs(
    codes: np.ndarray,
    names: np.ndarray,
    step: np.ndarray,
    loss: np.ndarray,
    position: np.ndarray,
    origin: Origin,
) -> None:
    """Per-run checks on rows grouped by run, steps increasing (``position``: row in the file)."""
    new_run = np.concatenate([[True], codes[1:] != codes[:-1]])
    repeat = ~new_run & np.concatenate([[False], step[1:] == step[:-1]])
    if repeat.any():
        at = np.flatnonzero(repeat)
        raise fail(
            f"duplicate step {step[at[0]]} (also at {origin.row(position[at[0] - 1])})",
            "keep one row per logged step (a resumed run must not log a step twice)",
            origin.where(position[at], names[codes[at]]),
        )
    nonfinite = pd.Series(~np.isfinite(loss))
    diverged_before = nonfinite.groupby(codes).cummax().to_numpy()
    recovered = diverged_before & np.isfinite(loss)
    if recovered.any():
        after = int(np.flatnonzero(recovered)[0])
        bad = int(np.flatnonzero((codes == codes[after]) & nonfinite.to_numpy())[0])
        raise fail(
            f"loss is empty, NaN or infinite, yet finite losses follow (from "
            f"{origin.row(position[after])})",
            "training does not recover from a non-finite loss: fill the missing loss, or cut "
            "the run at the step where it diverged",
            origin.where(position[[bad]], names[codes[[bad]]]),
        )
    finite = np.bincount(codes[np.isfinite(loss)], minlength=len(names))
    present = np.bincount(codes, minlength=len(names)) > 0
    short = np.flatnonzero(present & (finite < MIN_RUN_POINTS))
    if len(short):
        run = short[0]
        first = position[np.flatnonzero(codes == run)[0]]
        raise fail(
            f"run {names[run]} has {finite[run]} finite loss point(s); a curve needs at least "
            f"{MIN_RUN_POINTS}",
            "log the loss at more steps, or drop the run",
            origin.row(first),
        )


def check_identity_constant(
    df: pd.DataFrame, codes: np.ndarray, names: np.ndarray, origin: Origin
) -> None:
    """One size, seed, TPP, tau, ... per run: a value changing within a run is a bad merge."""
    for column in (c for c in IDENTITY_COLUMNS if c in df.columns):
        values = pd.Series(pd.factorize(df[column], use_na_sentinel=False)[0])
        per_run = values.groupby(codes).nunique()
        if (per_run > 1).any():
            run = int(per_run.index[np.flatnonzero(per_run.to_numpy() > 1)[0]])
            rows = np.flatnonzero(codes == run)
            first = df[column].iloc[rows[0]]
            other = rows[np.flatnonzero(values.to_numpy()[rows] != values.iloc[rows[0]])[0]]
            raise fail(
                f"{column} changes within run {names[run]}: {show(first)} at "
                f"{origin.row(rows[0])}, {show(df[column].iloc[other])} here",
                f"a run has one {column}: give each setting its own run name, or fix the "
                f"{column} column",
                origin.row(other),
            )


def check_t_hat(t_hat: pd.Series, codes: np.ndarray, names: np.ndarray, origin: Origin) -> None:
    values, unparsable = _unparsable(t_hat)
    runs = names[codes]
    if unparsable.any() or (np.isnan(values).any() and not np.isnan(values).all()):
        at = np.flatnonzero(unparsable | np.isnan(values))
        raise fail(
            "t_hat is empty or not a number",
            "give t_hat (step / total steps) on every row, or drop the column",
            origin.where(at, runs[at]),
        )
    outside = (values < 0) | (values > 1 + T_HAT_TOLERANCE)
    if outside.any():
        at = np.flatnonzero(outside)
        raise fail(
            f"t_hat {values[at[0]]:g} lies outside [0, 1]",
            "t_hat is step / total steps of the full schedule: check the total you divided by",
            origin.where(at, runs[at]),
        )


def check_meta(
    meta: pd.DataFrame,
    last_step: np.ndarray,
    first_row: np.ndarray,
    last_row: np.ndarray,
    origin: Origin,
) -> None:
    """Per-run checks once the metadata (from the curves or a runs table) is attached.

    ``last_step``, ``first_row``, ``last_row``: each run's largest step and the file positions
    of its first and last rows, in the order of ``meta.index``.
    """
    runs = meta.index.to_numpy()
    for column in ("size", "params"):
        if column in meta.columns and meta[column].isna().any() and meta[column].notna().any():
            at = np.flatnonzero(meta[column].isna().to_numpy())
            raise fail(
                f"run {runs[at[0]]} has no {column} (and {len(at) - 1} more runs)"
                if len(at) > 1
                else f"run {runs[at[0]]} has no {column}",
                f"give every run its {column}, or none (then each run is its own size)",
                origin.row(first_row[at[0]]),
            )
    for column in ("steps", "tpp", "tau", "params", "batch_seqs"):
        if column not in meta.columns:
            continue
        values, unparsable = _unparsable(meta[column])
        wrong = unparsable | (np.isfinite(values) & (values <= 0)) | np.isinf(values)
        if column == "steps":
            wrong |= np.isfinite(values) & (values != np.round(values))
        if wrong.any():
            at = np.flatnonzero(wrong)
            raise fail(
                f"run {runs[at[0]]}: {column} {show(meta[column].iloc[at[0]])} is not a positive "
                "number",
                f"give {column} as a number > 0 for every run, or leave it empty",
                origin.row(first_row[at[0]]),
            )
        if column == "steps":
            beyond = np.isfinite(values) & (last_step > values)
            if beyond.any():
                at = np.flatnonzero(beyond)
                raise fail(
                    f"run {runs[at[0]]} logs step {last_step[at[0]]}, beyond its declared "
                    f"total steps {values[at[0]]:g}",
                    "steps is the full length of the schedule: correct it, or drop the rows "
                    "past it",
                    origin.row(last_row[at[0]]),
                )
    _check_duplicate_runs(meta, first_row, origin)


def _check_duplicate_runs(meta: pd.DataFrame, first_row: np.ndarray, origin: Origin) -> None:
    """Two runs with the same size, seed and controls are one run under two names."""
    size = "size" if "size" in meta.columns else "params" if "params" in meta.columns else None
    if size is None or "seed" not in meta.columns or meta[[size, "seed"]].isna().any().any():
        return
    key = [size, "seed", *(c for c in DISTINGUISHING_COLUMNS if c in meta.columns)]
    dup = meta.duplicated(subset=key, keep=False).to_numpy()
    if dup.any():
        at = np.flatnonzero(dup)
        first = meta.iloc[at[0]]
        same = meta.index[at][
            (meta.iloc[at][key].astype(str) == first[key].astype(str)).all(axis=1).to_numpy()
        ]
        raise fail(
            f"runs {', '.join(map(str, same))} have the same {size} {show(first[size])} and "
            f"seed {show(first['seed'])} (and the same {', '.join(key[2:]) or 'controls'})",
            "a seed is one run: drop the duplicate, or give it its own seed",
            origin.row(first_row[at[0]]),
        )


def check_runs_table(table: pd.DataFrame, name: str) -> pd.DataFrame:
    """The per-run metadata table (``--runs``, plan/runs.csv): one row per run."""
    origin = Origin((name,), (0,), (".csv" in name.lower() or ".tsv" in name.lower(),))
    if "run" not in table.columns:
        raise fail(
            "no column run", "a runs table has one row per run, named in a column 'run'", name
        )
    table = table.assign(run=table["run"].astype(str))
    dup = table.duplicated(keep=False).to_numpy()
    conflict = table.duplicated(subset="run", keep=False).to_numpy() & ~dup
    if conflict.any():
        at = np.flatnonzero(conflict)
        raise fail(
            f"run {table['run'].iloc[at[0]]} has two rows with different values",
            "keep one row per run",
            origin.where(at),
        )
    return table.drop_duplicates(subset="run")


# ---------------------------------------------------------------- flags


def positive(text: str) -> float:
    """argparse type: a finite number > 0."""
    value = _number(text)
    if not value > 0:
        raise _arg_error(f"{text!r}: give a number > 0")
    return value


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    value = _number(text)
    if value != round(value) or value < 1:
        raise _arg_error(f"{text!r}: give a whole number >= 1")
    return int(value)


def non_negative(text: str) -> float:
    value = _number(text)
    if not value >= 0:
        raise _arg_error(f"{text!r}: give a number >= 0")
    return value


def finite(text: str) -> float:
    return _number(text)


def t_hat_window(text: str) -> tuple[float, float]:
    """argparse type: START,END with 0 <= START < END <= 1 (a span of t_hat)."""
    parts = text.split(",")
    if len(parts) != 2:
        raise _arg_error(f"{text!r}: give two numbers, START,END")
    lo, hi = (_number(p) for p in parts)
    if not 0.0 <= lo < hi <= 1.0:
        raise _arg_error(f"{text!r}: need 0 <= START < END <= 1 (fractions of training)")
    return lo, hi


def check_fractions(values: Sequence[float], flag: str) -> None:
    """Fractions of training to cut at: each strictly inside (0, 1), each once."""
    for value in values:
        if not 0.0 < value < 1.0:
            raise fail(
                f"{flag} {value:g} lies outside (0, 1)",
                f"give {flag} as fractions of training between 0 and 1 (exclusive)",
            )
    seen = [v for i, v in enumerate(values) if v in values[:i]]
    if seen:
        raise fail(f"{flag} {seen[0]:g} is given twice", f"give each {flag} once")


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _arg_error(f"{text!r} is not a number") from None
    if not np.isfinite(value):
        raise _arg_error(f"{text!r}: give a finite number")
    return value


def _arg_error(message: str):
    import argparse

    return argparse.ArgumentTypeError(message)
