"""Loss curves from anywhere: read, attach per-run metadata, smooth, resample, normalize.

Every analysis stage (reference, gates, family statistics, early-stopping prediction) works on
the same two shapes:

- ``Curves``: the long table (one row per logged step and run) plus one metadata row per run;
- ``CurveMatrix``: smoothed loss resampled onto a common t_hat grid, one row per run, so the
  family statistics are plain numpy reductions over axis 0.

Input formats (see ``read_curves``): this project's run directories
(``results/<family>/runs/<run>/curve.parquet`` with ``layout.CURVE_COLUMNS`` and the plan's
``runs.csv``), or any CSV/Parquet with columns ``run, step, loss`` (optionally ``tokens``,
``t_hat``) plus per-run metadata columns such as ``size`` or ``params``, ``tpp``, ``tau``,
``schedule``, ``seed``, ``steps`` (absent ones are simply not used).
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd

from collapse import validate as V

REQUIRED_COLUMNS = V.REQUIRED_COLUMNS
# Per-step columns of the long table; any other column constant within a run is metadata.
STEP_COLUMNS = ("run", "step", "tokens", "t_hat", "loss", "loss_smooth")
# Metadata the analysis understands (others are carried along untouched).
# A run counts as complete when its last point reaches this fraction of its full length.
COMPLETE_T_HAT = 1.0 - 1e-3
# Paper (docs/method.md §2): moving average over 100 steps; capped for short runs (below).
PAPER_WINDOW_STEPS = 100
SHORT_RUN_WINDOW_FRACTION = 0.02


@contextlib.contextmanager
def nan_columns_expected():
    """Silence numpy's warnings about columns with fewer than two finite values.

    Grid points before a run's first logged step are NaN by design, and so is every statistic
    over them; numpy's "empty slice" and "degrees of freedom" warnings would only alarm the user.
    """
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def default_grid(n_points: int = 200) -> np.ndarray:
    """Common t_hat grid (1/n, 2/n, ..., 1): ends exactly at t_hat = 1 where ell = 1."""
    return np.arange(1, n_points + 1, dtype=float) / n_points


@dataclass(frozen=True)
class Curves:
    """Long per-step table ``data`` (sorted by run, step) and per-run ``meta`` (index ``run``).

    ``meta`` always has ``t_hat_max`` (how far the run got) and ``complete`` (reached t_hat 1);
    ``data`` always has ``t_hat``.
    """

    data: pd.DataFrame
    meta: pd.DataFrame

    @property
    def runs(self) -> list[str]:
        return list(self.meta.index)

    def select(self, runs: Iterable[str]) -> Curves:
        wanted = set(runs)
        keep = [run for run in self.meta.index if run in wanted]  # keep the rows' order
        data = self.data[self.data["run"].isin(keep)]
        if isinstance(data["run"].dtype, pd.CategoricalDtype):
            data = data.assign(run=data["run"].cat.set_categories(keep))
        return Curves(data, self.meta.loc[keep])


@dataclass(frozen=True)
class CurveMatrix:
    """Smoothed loss on a common t_hat grid: ``loss[i]`` belongs to run ``meta.index[i]``.

    ``loss`` is NaN where a run has no data (a partial run beyond its last step).
    ``meta["final_loss"]`` is L(T), the smoothed loss at t_hat = 1 (NaN for partial runs).
    """

    grid: np.ndarray
    loss: np.ndarray
    meta: pd.DataFrame

    def select(self, mask: np.ndarray | Sequence[bool]) -> CurveMatrix:
        mask = np.asarray(mask, dtype=bool)
        return CurveMatrix(self.grid, self.loss[mask], self.meta[mask])

    def normalized(self, offset: float = 0.0) -> np.ndarray:
        """ell = (L - L0) / (L(T) - L0) for every run (docs/method.md §2)."""
        return normalize(self.loss, self.meta["final_loss"].to_numpy(float), offset)


# ---------------------------------------------------------------- reading


def read_table(path: str | Path) -> pd.DataFrame:
    """One CSV (optionally compressed) or Parquet file as a DataFrame; unreadable: InputError."""
    path = Path(path)
    suffixes = "".join(path.suffixes).lower()
    try:
        if ".parquet" in suffixes or ".pq" in suffixes:
            return pd.read_parquet(path)
        if ".csv" in suffixes or ".tsv" in suffixes:
            return pd.read_csv(path, sep="\t" if ".tsv" in suffixes else ",")
        if ".yaml" in suffixes or ".yml" in suffixes:  # a runs table (collapse.logreaders)
            from collapse.logreaders import read_sidecar

            return read_sidecar(path)
    except pd.errors.EmptyDataError:
        raise V.fail(
            "the file is empty", "give a table with a header line and rows", str(path)
        ) from None
    except (OSError, ValueError, pd.errors.ParserError) as err:
        if not path.exists():
            raise V.fail("no such file", "check the path", str(path)) from None
        raise V.fail(
            f"cannot be read ({type(err).__name__}: {str(err).splitlines()[0]})",
            "give a well-formed CSV or Parquet file",
            str(path),
        ) from None
    raise V.fail(
        "unknown file type",
        "give a .csv, .csv.gz, .tsv, .parquet (or a .yaml runs) file",
        str(path),
    )


def _expand_source(source: Path) -> tuple[list[Path], Path | None]:
    """Curve files and the plan's runs.csv (if any) behind one path given on the command line."""
    if source.is_file():
        return [source], None
    if not source.is_dir():
        raise V.fail("no such file or directory", "check the path", str(source))
    if (source / "curve.parquet").is_file():  # one run directory
        runs_csv = source.parent.parent / "plan" / "runs.csv"
        return [source / "curve.parquet"], runs_csv if runs_csv.is_file() else None
    runs_csv = source / "plan" / "runs.csv"  # a family directory, results/<family>
    files = sorted(source.glob("runs/*/curve.parquet")) or sorted(source.glob("*/curve.parquet"))
    if not files:
        files = sorted(source.glob("**/curve.parquet"))
    if not files:
        raise V.fail(
            "no curve.parquet, TensorBoard event files or W&B runs below this directory",
            "give curve files, a results/<family> directory or a log directory",
            str(source),
        )
    if not runs_csv.is_file() and (source.parent / "plan" / "runs.csv").is_file():
        runs_csv = source.parent / "plan" / "runs.csv"  # results/<family>/runs was given
    return files, runs_csv if runs_csv.is_file() else None


def read_curves(
    sources: str | Path | Sequence[str | Path],
    runs_csv: str | Path | pd.DataFrame | None = None,
    loss_tag: str | None = None,
) -> Curves:
    """Curves from files or directories, with per-run metadata attached and checked.

    ``sources``: CSV/Parquet files with ``run, step, loss`` (+ optional ``tokens``, ``t_hat``
    and per-run metadata columns), run directories holding ``curve.parquet``, or a
    ``results/<family>`` directory; or other stacks' logs (TensorBoard event directories, W&B
    run folders and history exports: ``collapse.logreaders``, whose loss is ``loss_tag`` or the
    first known tag). ``runs_csv``: a table with one row per ``run`` (the plan's ``runs.csv``,
    or a sidecar of the logs' runs); found automatically next to a family directory when not
    given. Input that breaks the curve contract (``collapse.validate``) raises ``InputError``.
    """
    if isinstance(sources, (str, Path)):
        sources = [sources]
    from collapse import logreaders

    is_log = [logreaders.is_log_source(s) for s in sources]
    logs = [s for s, log in zip(sources, is_log, strict=True) if log]
    sources = [s for s, log in zip(sources, is_log, strict=True) if not log]
    files, frames, found_meta = [], [], []
    runs_name = "runs table"
    if isinstance(runs_csv, (str, Path)):
        runs_name, runs_csv = str(runs_csv), read_table(runs_csv)
    if logs:
        runs_csv, logs_of = logreaders.split_log_column(runs_csv, runs_name)
        frames, labels = logreaders.read_logs(logs, loss_tag, logs_of)
        files = [Path(label) for label in labels]
    for source in sources:
        found, meta_path = _expand_source(Path(source))
        files += found
        frames += [read_table(f) for f in found]
        if meta_path is not None:
            found_meta.append(meta_path)
    if runs_csv is None and found_meta:
        runs_name, runs_csv = str(found_meta[0]), read_table(found_meta[0])
    origin = V.Origin.of_files(files, [len(f) for f in frames])
    for path, frame in zip(files, frames, strict=True):
        V.check_columns(frame, V.Origin.of_files([path], [len(frame)]))
    return curves_from_frame(pd.concat(frames, ignore_index=True), runs_csv, origin, runs_name)


def _run_names(column: pd.Series, origin: V.Origin) -> tuple[np.ndarray, np.ndarray]:
    """(integer code per row, run names), runs numbered in order of first appearance."""
    if isinstance(column.dtype, pd.CategoricalDtype):
        codes, names = column.cat.codes.to_numpy(), column.cat.categories.astype(str).to_numpy()
    else:
        codes, names = pd.factorize(column, sort=False)
        names = pd.Index(names).astype(str).to_numpy()
    if (codes < 0).any():
        raise V.fail(
            "the row has no run name",
            "fill the run column on every row",
            origin.where(np.flatnonzero(codes < 0)),
        )
    return codes.astype(np.int64), names


def _constant_within(column: pd.Series, new_run: np.ndarray) -> bool:
    """Whether ``column`` (rows grouped by run) holds one value per run; NaN counts as a value.

    Compares each row with the row before it inside a run; strings go through their
    factorized codes (no Python objects for millions of rows).
    """
    if pd.api.types.is_numeric_dtype(column.dtype) or pd.api.types.is_bool_dtype(column.dtype):
        values = column.to_numpy()
    else:
        values = pd.factorize(column, use_na_sentinel=False)[0]
    same = values[1:] == values[:-1]
    if values.dtype.kind == "f":
        same |= np.isnan(values[1:]) & np.isnan(values[:-1])
    return bool(same[~new_run[1:]].all())


def run_codes(data: pd.DataFrame, runs: Sequence[str] | pd.Index) -> np.ndarray:
    """Position in ``runs`` of every row's run (rows must be grouped in that order)."""
    column = data["run"]
    if isinstance(column.dtype, pd.CategoricalDtype) and list(column.cat.categories) == list(runs):
        return column.cat.codes.to_numpy()
    return pd.Categorical(column, categories=list(runs)).codes


def curves_from_frame(
    df: pd.DataFrame,
    runs_meta: pd.DataFrame | None = None,
    origin: V.Origin | None = None,
    runs_name: str = "runs table",
) -> Curves:
    """Check a long table against the curve contract, split off per-run metadata, add t_hat.

    t_hat = step / full length of the run (docs/method.md §2): taken from a ``t_hat`` column
    when present, else from a ``steps`` (total steps) metadata column, else from the run's
    largest step (then the run is assumed complete). A partial run with known length stays
    partial, so it is never normalized by a loss that is not its final one.
    ``origin`` names the files the rows came from (for the errors of ``collapse.validate``).
    Vectorized (one factorization of the run names, integer sorts): millions of rows in seconds.
    Runs keep the order in which they first appear; ``data["run"]`` is categorical, its
    categories the run names in that order (``meta.index``).
    """
    origin = origin or V.Origin.of_frame()
    V.check_columns(df, origin)
    codes, names = _run_names(df["run"], origin)
    step, loss = V.check_rows(df, codes, names, origin)
    V.check_identity_constant(df, codes, names, origin)
    if "t_hat" in df.columns:
        V.check_t_hat(df["t_hat"], codes, names, origin)
    lowest = int(step.min())
    key = codes * int(step.max() - lowest + 1) + (step - lowest)  # sorts by run, then step
    if (np.diff(key) > 0).all():
        order = None  # rows already grouped by run, steps increasing: no copy of the table
        position = np.arange(len(key))
    else:
        order = np.argsort(key, kind="stable")
        codes, step, loss, position = codes[order], step[order], loss[order], order
    V.check_sorted_runs(codes, names, step, loss, position, origin)

    def column(name: str) -> pd.Series:
        values = df[name].reset_index(drop=True)
        return values if order is None else values.take(order).reset_index(drop=True)

    counts = np.bincount(codes, minlength=len(names))
    if (counts == 0).any():
        names, counts = names[counts > 0], counts[counts > 0]
        codes = np.searchsorted(np.flatnonzero(np.bincount(codes) > 0), codes)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    ends = starts + counts - 1

    new_run = np.zeros(len(codes), dtype=bool)
    new_run[starts] = True
    data = {
        "run": pd.Categorical.from_codes(codes, categories=names),
        "step": step,
        "loss": loss,
    }
    meta = pd.DataFrame(index=pd.Index(names, name="run"))
    for name in df.columns:
        if name in ("run", "step", "loss"):
            continue
        values = column(name)
        if name not in STEP_COLUMNS and _constant_within(values, new_run):
            meta[name] = values.iloc[starts].to_numpy()
        else:
            data[name] = values.to_numpy()
    data = pd.DataFrame(data)
    if runs_meta is not None:
        extra = V.check_runs_table(runs_meta, runs_name).set_index("run")
        meta = meta.join(extra[[c for c in extra.columns if c not in meta.columns]], how="left")
    meta.index.name = "run"
    V.check_meta(meta, step[ends], position[starts], position[ends], origin)

    if "t_hat" not in data.columns or data["t_hat"].isna().all():
        if "steps" in meta.columns and meta["steps"].notna().all():
            total = meta["steps"].to_numpy(float)
        else:
            total = step[ends].astype(float)
        if (total <= 0).any():
            run = names[np.flatnonzero(total <= 0)[0]]
            raise V.fail(
                f"run {run} ends at step 0, so t_hat = step / total steps is undefined",
                "give the run's total steps (a steps column) or log steps from 1",
                origin.row(position[ends][np.flatnonzero(total <= 0)[0]]),
            )
        data["t_hat"] = step / np.repeat(total, counts)
    else:
        data["t_hat"] = pd.to_numeric(data["t_hat"]).astype(float)
    meta["t_hat_max"] = np.fmax.reduceat(data["t_hat"].to_numpy(), starts)
    meta["complete"] = meta["t_hat_max"] >= COMPLETE_T_HAT
    return Curves(data, meta)


# ---------------------------------------------------------------- smoothing


def default_window_steps(total_steps: int | np.ndarray) -> np.ndarray:
    """Smoothing window in steps: the paper's 100 (docs/method.md §2), at most 2 % of a run.

    The cap keeps the window the same fraction of training for short runs, so runs of different
    length lag their raw loss by the same t_hat.
    """
    total = np.asarray(total_steps, dtype=float)
    return np.clip(np.round(SHORT_RUN_WINDOW_FRACTION * total), 1, PAPER_WINDOW_STEPS).astype(int)


def trailing_mean(
    values: np.ndarray, steps: np.ndarray, groups: np.ndarray, window_steps: np.ndarray
) -> np.ndarray:
    """Trailing moving average over the last ``window_steps`` steps, within each group.

    Vectorized over all runs at once with cumulative sums; causal (only past steps enter), so
    the online monitor sees exactly what the offline analysis sees. A NaN inside a window makes
    that window NaN (a diverged run must not look smooth). Rows come grouped by ``groups``,
    steps increasing within a group.
    """
    values = np.asarray(values, dtype=float)
    n = len(values)
    if n == 0:
        return values.copy()
    bad = ~np.isfinite(values)
    any_bad = bool(bad.any())
    csum = np.concatenate([[0.0], np.cumsum(np.where(bad, 0.0, values) if any_bad else values)])
    cbad = np.concatenate([[0], np.cumsum(bad)]) if any_bad else None
    steps = np.asarray(steps, dtype=np.int64)
    window_steps = np.asarray(window_steps, dtype=np.int64)
    end = np.arange(1, n + 1)
    groups = np.asarray(groups)
    new_group = np.concatenate([[True], groups[1:] != groups[:-1]])
    if (np.diff(steps)[~new_group[1:]] == 1).all():  # every step logged: index arithmetic
        group_start = np.maximum.accumulate(np.where(new_group, np.arange(n), 0))
        start = np.maximum(group_start, end - window_steps)
        return _window_means(csum, cbad, start, end)
    # sparse logging: one sortable key per row that never reaches into the previous group
    span = int(steps.max() - min(steps.min(), 0) + np.max(window_steps) + 1)
    group_code = np.cumsum(new_group) - 1  # ascending in row order, whatever the labels
    key = group_code * span + steps
    start = np.searchsorted(key, key - window_steps + 1, side="left")
    return _window_means(csum, cbad, start, end)


def _window_means(
    csum: np.ndarray, cbad: np.ndarray | None, start: np.ndarray, end: np.ndarray
) -> np.ndarray:
    """Mean of rows start..end-1 from cumulative sums; NaN where a non-finite value lies."""
    mean = (csum[1:] - csum[start]) / (end - start)  # end is 1..n
    if cbad is not None:
        mean[(cbad[1:] - cbad[start]) > 0] = np.nan
    return mean


def smooth(
    curves: Curves,
    window_steps: int | None = None,
    window_seqs: int | None = None,
) -> Curves:
    """Add ``loss_smooth``: the trailing mean of ``loss`` (docs/method.md §2).

    The window is given in steps, or in sequences (converted per run with the ``batch_seqs``
    metadata column, so runs with different batch sizes average the same amount of data);
    by default ``default_window_steps`` of each run's length.
    """
    data, meta = curves.data, curves.meta
    if window_steps is not None and window_seqs is not None:
        raise ValueError("give the smoothing window in steps or in sequences, not both")
    if window_seqs is not None:
        if "batch_seqs" not in meta.columns or meta["batch_seqs"].isna().any():
            raise ValueError(
                "a smoothing window in sequences needs the per-run metadata column batch_seqs "
                "(sequences per step); add it or give the window in steps"
            )
        per_run = np.maximum(1, np.ceil(window_seqs / meta["batch_seqs"].astype(float)))
    elif window_steps is not None:
        if window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {window_steps}")
        per_run = pd.Series(window_steps, index=meta.index)
    else:
        if "steps" in meta.columns and meta["steps"].notna().all():
            total = meta["steps"]
        else:
            codes = run_codes(data, meta.index)
            last = np.zeros(len(meta), dtype=np.int64)
            np.maximum.at(last, codes, data["step"].to_numpy())
            total = pd.Series(last, index=meta.index)
        per_run = pd.Series(default_window_steps(total.to_numpy()), index=total.index)
    codes = run_codes(data, meta.index)
    window = per_run.reindex(meta.index).to_numpy(dtype=np.int64)[codes]
    smoothed = trailing_mean(data["loss"].to_numpy(), data["step"].to_numpy(), codes, window)
    out = data.assign(loss_smooth=smoothed)
    return replace(curves, data=out, meta=meta.assign(window_steps=per_run.astype(int)))


# ---------------------------------------------------------------- resampling, normalization


def resample(
    curves: Curves, grid: np.ndarray | None = None, column: str = "loss_smooth"
) -> CurveMatrix:
    """Interpolate each run's ``column`` onto the common t_hat ``grid`` (NaN outside its range).

    ``column`` defaults to the smoothed loss (call ``smooth`` first). The run's final loss
    L(T) is its value at t_hat = 1, defined only for complete runs.
    """
    grid = default_grid() if grid is None else np.asarray(grid, dtype=float)
    if column not in curves.data.columns:
        raise ValueError(f"curves have no column {column!r}; call smooth() before resample()")
    data = curves.data
    runs = curves.meta.index
    codes = run_codes(data, runs)
    bounds = np.searchsorted(codes, np.arange(len(runs) + 1))
    t_all = data["t_hat"].to_numpy(float)
    y_all = data[column].to_numpy(float)
    out = np.full((len(runs), len(grid)), np.nan)
    final = np.full(len(runs), np.nan)
    for i in range(len(runs)):
        t, y = t_all[bounds[i] : bounds[i + 1]], y_all[bounds[i] : bounds[i + 1]]
        if len(t) == 0:
            continue
        last = 1.0 if t[-1] >= COMPLETE_T_HAT else t[-1]  # complete: the grid reaches 1
        inside = (grid >= t[0]) & (grid <= last + 1e-12)
        out[i, inside] = np.interp(grid[inside], t, y)
        if t[-1] >= COMPLETE_T_HAT:
            final[i] = y[-1]
    meta = curves.meta.assign(final_loss=final)
    return CurveMatrix(grid, out, meta)


def normalize(loss: np.ndarray, final_loss: np.ndarray | float, offset: float = 0.0) -> np.ndarray:
    """ell = (L - L0) / (L(T) - L0); L0 = 0 is the collapse paper's choice, Qiu et al. fit one.

    Source: docs/method.md §2. ``final_loss`` broadcasts per row (one L(T) per run).
    """
    final = np.asarray(final_loss, dtype=float)
    if final.ndim == 1 and np.ndim(loss) == 2:
        final = final[:, None]
    return (np.asarray(loss, dtype=float) - offset) / (final - offset)


# ---------------------------------------------------------------- sizes

_SIZE_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _size_number(size: str) -> float:
    match = re.search(r"(\d+(?:\.\d+)?)\s*([kmbgt]?)", str(size).lower())
    return float(match.group(1)) * _SIZE_SUFFIX[match.group(2)] if match else np.inf


def size_labels(meta: pd.DataFrame) -> pd.Series:
    """Each run's size label: the ``size`` column, else ``params``, else the run itself."""
    if "size" in meta.columns and meta["size"].notna().all():
        return meta["size"].astype(str)
    if "params" in meta.columns and meta["params"].notna().all():
        return meta["params"].astype(np.int64).astype(str)
    return pd.Series(meta.index.astype(str), index=meta.index)


def ordered_sizes(meta: pd.DataFrame) -> list[str]:
    """Size labels from smallest to largest: by median ``params`` when known, else by the number
    in the label ("d64", "300M", "1.8B"), else alphabetically."""
    labels = size_labels(meta)
    if "params" in meta.columns and meta["params"].notna().all():
        key = meta["params"].astype(float).groupby(labels).median()
    else:
        key = pd.Series({s: _size_number(s) for s in labels.unique()})
    return sorted(labels.unique(), key=lambda s: (key[s], s))
