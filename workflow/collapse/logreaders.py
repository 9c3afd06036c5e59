"""Loss curves straight from other stacks' logs: TensorBoard event files and W&B runs.

Every reader returns the long table of ``collapse.curves`` (one row per logged step: ``run``,
``step``, ``loss``, plus per-run metadata columns where the log holds them), so ``collapse
analyze``, ``collapse predict`` and ``collapse watch`` treat these runs like their own.

Sources
-------
- TensorBoard: a directory holding ``events.out.tfevents.*`` files (at any depth). Every
  folder with event files is one run, named by its path below the directory given (the
  directory's own name when the files lie in it). Records are decoded with TensorBoard's own
  protobuf classes (``EventTail``); a record still being written is left for the next read.
- W&B offline runs: a ``wandb/offline-run-*`` (or ``run-*``) folder, or any directory above
  such folders, holding ``run-<id>.wandb``. The file is W&B's record log (a LevelDB-style log of
  ``wandb_internal_pb2.Record`` protobufs, decoded with wandb's own protobuf classes); a run is
  named by its display name, else its id. Its config gives the run's ``size``, ``params``,
  ``tpp``, ``tau``, ``steps``, ``seed``, ``schedule``, ``batch_seqs``, ``warmup_steps`` where it
  holds them under those names.
- W&B history exports (CSV, TSV, JSON array or JSON lines): ``run.history()`` /
  ``run.scan_history()`` tables with a ``_step`` column (one run per file, named by the file
  stem, unless a ``run`` or ``name`` column names them), or the W&B web UI's "Export CSV" of a
  chart (a ``Step`` column and one ``<run> - <metric>`` column per run).

Loss tag
--------
Without ``loss_tag`` the first of ``LOSS_TAGS`` a run logs is its loss. The defaults, checked
against each project's source:

- ``lm loss``: Megatron-LM, the ``report`` dict of ``loss_func`` in ``pretrain_gpt.py``, written
  per iteration by ``training_log`` in ``megatron/training/training.py`` (TensorBoard and W&B);
- ``loss_metrics/global_avg_loss``: torchtitan, ``MetricsProcessor.log`` in
  ``torchtitan/components/metrics.py`` (TensorBoard and W&B loggers, per logged step);
- ``train/CE loss``: OLMo-core, ``TRAIN_CE_LOSS_METRIC`` in ``src/olmo_core/train/common.py``;
- ``reduced_train_loss``: NeMo, logged by ``MegatronGPTModel.training_step`` in
  ``nemo/collections/nlp/models/language_modeling/megatron_gpt_model.py`` (Lightning loggers,
  at the global step);
- ``train/loss``: this project's own runs (``collapse.tracking``).

Per-run metadata the logs lack (size, TPP, tau, total steps) comes from a sidecar table: the
``--runs`` table of the CLIs (CSV, Parquet or YAML with a ``run`` column or a mapping run ->
values). Its optional ``log`` column gives a run the log folders a stack started per job
(``split_log_column``); the folders of a resumed W&B run (one run id) are joined without it.

Bad input
---------
- no run logs the loss tag: an error lists the tags present;
- a step counter that goes back (a job resumed from a checkpoint) is stitched the way
  TensorBoard does: what the earlier job logged from the resumed step on is dropped; one that
  goes back to the run's first step or before is refused (two attempts in one folder);
- two runs with the same name: an error naming both sources;
- a W&B run or export with missing steps: a ``LogGapWarning`` lists the gaps.
"""

from __future__ import annotations

import json
import math
import re
import struct
import warnings
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from collapse import validate as V

# (tag, the stack that logs it); the first a run holds is its loss
LOSS_TAGS: tuple[tuple[str, str], ...] = (
    ("lm loss", "Megatron-LM"),
    ("loss_metrics/global_avg_loss", "torchtitan"),
    ("train/CE loss", "OLMo-core"),
    ("reduced_train_loss", "NeMo"),
    ("train/loss", "collapse"),
)
# per-run metadata a W&B config may hold under these names
META_KEYS = (
    "size", "params", "tpp", "tau", "steps", "seed", "schedule", "batch_seqs", "warmup_steps",
)  # fmt: skip
EVENT_GLOB = "*tfevents*"
WANDB_GLOB = "run-*.wandb"
EXPORT_SUFFIXES = (".csv", ".tsv", ".json", ".jsonl")
MAX_GAPS_SHOWN = 5


class LogNote(UserWarning):
    """Something about a log the user should know; the command goes on (``note:`` line)."""


class LogGapWarning(LogNote):
    """A run whose log misses steps between its logged ones."""


class LogStitchWarning(LogNote):
    """A run whose step counter went back (resumed from a checkpoint) and was stitched."""


@dataclass
class RunLog:
    """One run's scalars as logged: ``scalars[tag]`` is a list of (step, value) in write order."""

    name: str
    source: Path
    kind: str  # "tensorboard", "wandb" or "wandb export"
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    run_id: str = ""  # W&B's run id: the folders of one resumed W&B run share it

    def add(self, tag: str, step: int, value: float) -> None:
        self.scalars.setdefault(tag, []).append((int(step), float(value)))


# ---------------------------------------------------------------- what a path holds


def _event_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob(EVENT_GLOB) if p.is_file())


def _wandb_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob(WANDB_GLOB) if p.is_file())


def _export_columns(path: Path) -> list[str] | None:
    """The columns of a W&B history export, or None when the file is not one."""
    suffixes = "".join(path.suffixes).lower()
    if not any(s in suffixes for s in EXPORT_SUFFIXES) or ".parquet" in suffixes:
        return None
    try:
        if ".json" in suffixes:
            with path.open() as handle:
                head = handle.read(65536).lstrip()
            if head.startswith("["):
                rows = json.loads(path.read_text())
                return list(rows[0]) if rows and isinstance(rows[0], dict) else None
            first = json.loads(head.splitlines()[0]) if head else None
            return list(first) if isinstance(first, dict) else None
        sep = "\t" if ".tsv" in suffixes else ","
        columns = list(pd.read_csv(path, sep=sep, nrows=0).columns)
    except (OSError, ValueError, pd.errors.ParserError):
        return None
    if {"run", "step", "loss"} <= set(columns):
        return None  # the curve table of collapse.curves
    if "_step" in columns or "Step" in columns:
        return columns
    return None


def is_log_source(path: str | Path) -> bool:
    """Whether ``path`` is a TensorBoard log dir, a W&B run folder or a W&B history export."""
    path = Path(path)
    if path.is_dir():
        if (path / "curve.parquet").is_file() or any(path.glob("runs/*/curve.parquet")):
            return False
        return bool(_event_files(path) or _wandb_files(path))
    if path.is_file():
        if ".tfevents" in path.name or path.name.endswith(".wandb"):
            return True
        return _export_columns(path) is not None
    return False


# ---------------------------------------------------------------- TensorBoard


_DT_FLOAT, _DT_DOUBLE = 1, 2  # tensorflow DataType


def _scalar(value) -> float | None:
    """A summary value's scalar: ``simple_value`` (torch's SummaryWriter, tensorboardX) or a
    one-element tensor (TensorFlow 2's tf.summary.scalar); None for anything else."""
    kind = value.WhichOneof("value")
    if kind == "simple_value":
        return float(value.simple_value)
    if kind != "tensor" or value.tensor.tensor_shape.dim:
        return None
    tensor = value.tensor
    if len(tensor.float_val) == 1:
        return float(tensor.float_val[0])
    if len(tensor.double_val) == 1:
        return float(tensor.double_val[0])
    if tensor.dtype == _DT_FLOAT and len(tensor.tensor_content) == 4:
        return struct.unpack("<f", tensor.tensor_content)[0]
    if tensor.dtype == _DT_DOUBLE and len(tensor.tensor_content) == 8:
        return struct.unpack("<d", tensor.tensor_content)[0]
    return None


class EventTail:
    """One event file read incrementally: each ``read`` returns the scalars of the complete
    records written since the previous one; a record still being written is left for later.

    The file is a TFRecord stream (uint64 length, masked CRC-32C of the length, the serialized
    ``Event`` of TensorBoard's own protobuf, masked CRC-32C of it). Each record's header CRC is
    checked with TensorBoard's own ``masked_crc32c``; the payload's is not (TensorBoard's
    pure-Python CRC would cost ten times the parse): a garbled payload fails the protobuf parse,
    and a bad header stops the read with a note, never an exception.
    """

    HEADER = struct.Struct("<QI")

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0
        self.broken = False

    def read(self) -> list[tuple[str, int, float]]:
        from tensorboard.compat.proto import event_pb2
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

        if self.broken:
            return []
        with self.path.open("rb") as handle:
            handle.seek(self.offset)
            data = handle.read()
        out, pos, header = [], 0, self.HEADER
        while len(data) - pos >= header.size:
            length, crc = header.unpack_from(data, pos)
            if masked_crc32c(data[pos : pos + 8]) != crc:
                self.broken = True
                warnings.warn(
                    f"{self.path}: a record header fails its checksum at byte "
                    f"{self.offset + pos}; the file is read up to there",
                    LogGapWarning,
                    stacklevel=2,
                )
                break
            end = pos + header.size + length + 4
            if end > len(data):
                break  # the writer has not finished this record
            try:
                event = event_pb2.Event.FromString(data[pos + header.size : end - 4])
            except Exception:  # noqa: BLE001 - a garbled record: skip it
                event = None
            pos = end
            if event is None or not event.HasField("summary"):
                continue
            for value in event.summary.value:
                scalar = _scalar(value)
                if scalar is not None:
                    out.append((value.tag, event.step, scalar))
        self.offset += pos
        return out


class TensorBoardDir:
    """The runs of a TensorBoard log directory, read incrementally (``poll``)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.tails: dict[Path, EventTail] = {}
        self.runs: dict[str, RunLog] = {}

    def run_name(self, folder: Path) -> str:
        if folder == self.root:
            return self.root.resolve().name
        return folder.relative_to(self.root).as_posix()

    def poll(self) -> set[str]:
        """Read what was appended since the last poll; the names of the runs that grew."""
        grew = set()
        files = [self.root] if self.root.is_file() else _event_files(self.root)
        for path in files:
            if path not in self.tails:
                self.tails[path] = EventTail(path)
            folder = path.parent
            name = self.run_name(folder) if not self.root.is_file() else self.root.parent.name
            run = self.runs.setdefault(name, RunLog(name, folder, "tensorboard"))
            for tag, step, value in self.tails[path].read():
                run.add(tag, step, value)
                grew.add(name)
        return grew


# ---------------------------------------------------------------- W&B offline runs

_WANDB_HEADER = struct.Struct("<4sHB")  # ":W&B", magic 0xBEE1, version
_RECORD_HEADER = struct.Struct("<IHB")  # crc32 (seeded with the type byte), length, type
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> Iterable[bytes]:
    """The complete records of a ``.wandb`` file, in order; stops at a half-written one."""
    data = path.read_bytes()
    if len(data) < _WANDB_HEADER.size:
        return
    ident, magic, _ = _WANDB_HEADER.unpack_from(data)
    if ident != b":W&B" or magic != 0xBEE1:
        raise V.fail("not a W&B run file (bad header)", "give a run-<id>.wandb file", str(path))
    pos, pending = _WANDB_HEADER.size, None
    while True:
        left = _BLOCK - pos % _BLOCK
        if left < _RECORD_HEADER.size:
            pos += left  # block trailer
            continue
        if pos + _RECORD_HEADER.size > len(data):
            return
        crc, length, kind = _RECORD_HEADER.unpack_from(data, pos)
        start = pos + _RECORD_HEADER.size
        payload = data[start : start + length]
        if kind == 0 or len(payload) < length:
            return  # zero padding or a record still being written
        if zlib.crc32(payload, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            return
        pos = start + length
        if kind == _FULL:
            yield payload
        elif kind == _FIRST:
            pending = payload
        elif kind == _MIDDLE and pending is not None:
            pending += payload
        elif kind == _LAST and pending is not None:
            yield pending + payload
            pending = None


def _json_value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def read_wandb_run(path: Path) -> RunLog:
    """One offline W&B run (its ``run-<id>.wandb`` file): history scalars, name and config."""
    from wandb.proto import wandb_internal_pb2 as pb

    run = RunLog(path.stem.removeprefix("run-"), path.parent, "wandb")
    config: dict = {}
    for payload in wandb_records(path):
        record = pb.Record()
        try:
            record.ParseFromString(payload)
        except Exception:  # noqa: BLE001 - a record this wandb cannot decode: skip it
            continue
        which = record.WhichOneof("record_type")
        if which == "run":
            run.name = record.run.display_name or record.run.run_id or run.name
            run.run_id = record.run.run_id
            for item in record.run.config.update:
                config[item.key or ".".join(item.nested_key)] = _json_value(item.value_json)
        elif which == "config":
            for item in record.config.update:
                config[item.key or ".".join(item.nested_key)] = _json_value(item.value_json)
        elif which == "history":
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or ".".join(item.nested_key)  # W&B shows nested keys as a.b
                if key.startswith("_"):
                    continue
                value = _json_value(item.value_json)
                if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "infinity"):
                    value = float(value)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    run.add(key, step, value)
    run.meta = {
        k: (v.get("value") if isinstance(v, dict) and "value" in v else v)
        for k, v in config.items()
        if k in META_KEYS
    }
    run.meta = {k: v for k, v in run.meta.items() if isinstance(v, (int, float, str))}
    return run


class WandbDir:
    """The W&B runs below a folder (offline, or the local copy an online run keeps), re-read
    when their ``.wandb`` file grows (``poll``), for ``collapse watch``."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.sizes: dict[Path, int] = {}
        self.runs: dict[str, RunLog] = {}
        self.names: dict[Path, str] = {}

    def poll(self) -> set[str]:
        grew = set()
        files = [self.root] if self.root.is_file() else _wandb_files(self.root)
        for path in files:
            size = path.stat().st_size
            if self.sizes.get(path) == size:
                continue
            self.sizes[path] = size
            run = read_wandb_run(path)
            if self.names.get(path, run.name) != run.name:
                run.name = self.names[path]  # keep the name the run was first watched under
            self.names[path] = run.name
            other = self.runs.get(run.name)
            if other is not None and other.source != run.source:
                check_unique([other, run])
            self.runs[run.name] = run
            grew.add(run.name)
        return grew


# ---------------------------------------------------------------- W&B history exports

_UI_COLUMN = re.compile(r"^(?P<run>.+?) - (?P<metric>.+)$")


def _read_export_rows(path: Path) -> pd.DataFrame:
    """The export as strings (an empty cell is a missing value, ``NaN`` a logged NaN)."""
    suffixes = "".join(path.suffixes).lower()
    if ".json" in suffixes:
        text = path.read_text()
        if text.lstrip().startswith("["):
            rows = json.loads(text)
        else:
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        columns = list(dict.fromkeys(key for row in rows for key in row))
        return pd.DataFrame(
            {c: ["" if row.get(c) is None else str(row[c]) for row in rows] for c in columns},
            dtype=object,
        )
    sep = "\t" if ".tsv" in suffixes else ","
    return pd.read_csv(path, sep=sep, dtype=str, keep_default_na=False, na_values=[])


def _number(values: pd.Series) -> pd.Series:
    return pd.to_numeric(values.replace("", np.nan), errors="coerce")


def read_wandb_export(path: Path) -> list[RunLog]:
    """The runs of one W&B history export (see the module docstring for the two layouts)."""
    frame = _read_export_rows(path)
    runs: dict[str, RunLog] = {}
    if "_step" in frame.columns:
        step = _number(frame["_step"])
        name_col = next((c for c in ("run", "name", "Name") if c in frame.columns), None)
        names = frame[name_col] if name_col else pd.Series(path.stem, index=frame.index)
        metrics = [c for c in frame.columns if not c.startswith("_") and c != name_col]
        for column in metrics:
            logged = frame[column].astype(str) != ""
            values = _number(frame[column])
            for name, s, v, ok in zip(names, step, values, logged, strict=True):
                if ok and math.isfinite(s):
                    run = runs.setdefault(str(name), RunLog(str(name), path, "wandb export"))
                    run.add(column, int(s), v)
    else:  # the web UI's chart export: Step, "<run> - <metric>" (+ __MIN / __MAX)
        step = _number(frame["Step"])
        for column in frame.columns:
            match = _UI_COLUMN.match(column)
            if not match or column.endswith(("__MIN", "__MAX")):
                continue
            name, metric = match["run"], match["metric"]
            logged = frame[column].astype(str) != ""
            values = _number(frame[column])
            run = runs.setdefault(name, RunLog(name, path, "wandb export"))
            for s, v, ok in zip(step, values, logged, strict=True):
                if ok and math.isfinite(s):
                    run.add(metric, int(s), v)
    return list(runs.values())


# ---------------------------------------------------------------- from logs to curves


def split_log_column(
    table: pd.DataFrame | None, name: str
) -> tuple[pd.DataFrame | None, dict[str, str]]:
    """(the runs table without its ``log`` column, log folder -> run).

    A ``log`` column names, per row, a log folder (as the reader names it: the folder's path
    below the directory given, or a W&B run's name) that belongs to the row's run; several rows
    may give one run several folders (a stack that starts a new folder per job, as torchtitan
    does), which are stitched in the order of the rows.
    """
    if table is None or "log" not in table.columns:
        return table, {}
    if "run" not in table.columns:
        raise V.fail("no column run", "name each log folder's run in a column 'run'", name)
    logs = table["log"].astype(str)
    dup = logs.duplicated(keep=False).to_numpy()
    if dup.any():
        raise V.fail(
            f"log folder {logs[dup].iloc[0]!r} is given to more than one row",
            "give each log folder once",
            name,
        )
    logs_of = dict(zip(logs, table["run"].astype(str), strict=True))
    return table.drop(columns="log").drop_duplicates(), logs_of


def _assign_logs(runs: list[RunLog], logs_of: dict[str, str]) -> list[RunLog]:
    """Rename log folders to their runs and stitch a run's folders in the table's order."""
    order = {log: i for i, log in enumerate(logs_of)}
    named = sorted((run for run in runs if run.name in logs_of), key=lambda run: order[run.name])
    out = [run for run in runs if run.name not in logs_of]
    merged: dict[str, RunLog] = {}
    for run in named:
        target = logs_of[run.name]
        if target not in merged:
            merged[target] = RunLog(target, run.source, run.kind, meta=dict(run.meta))
            out.append(merged[target])
        for tag, points in run.scalars.items():
            merged[target].scalars.setdefault(tag, []).extend(points)
    return out


def collect(sources: Sequence[str | Path], logs_of: dict[str, str] | None = None) -> list[RunLog]:
    """Every run behind the given log sources (log folders renamed and joined by ``logs_of``,
    see ``split_log_column``); two runs with the same name are refused."""
    runs: list[RunLog] = []
    for source in map(Path, sources):
        if source.is_file() and source.name.endswith(".wandb"):
            runs.append(read_wandb_run(source))
        elif source.is_file() and ".tfevents" not in source.name:
            runs += read_wandb_export(source)
        else:
            if source.is_file() or _event_files(source):
                tb = TensorBoardDir(source)
                tb.poll()
                runs += tb.runs.values()
            if source.is_dir():
                runs += [read_wandb_run(f) for f in _wandb_files(source)]
    runs = merge_resumed(runs)
    if logs_of:
        runs = _assign_logs(runs, logs_of)
    check_unique(runs)
    return runs


def merge_resumed(runs: Sequence[RunLog]) -> list[RunLog]:
    """One run from the folders of a resumed W&B run (same run id; a folder per job, in the
    order their names sort: by start time); its steps are stitched like any restart."""
    out: list[RunLog] = []
    by_id: dict[str, RunLog] = {}
    for run in sorted(runs, key=lambda r: (r.kind != "wandb", str(r.source))):
        first = by_id.get(run.run_id) if run.kind == "wandb" and run.run_id else None
        if first is None:
            out.append(run)
            if run.kind == "wandb" and run.run_id:
                by_id[run.run_id] = run
            continue
        _append_resumed(first, run)
    return out


def _append_resumed(first: RunLog, later: RunLog) -> None:
    """A later job's folder continues ``first``: from its first step on, its values replace what
    the earlier jobs logged (a resumed job retrains from its checkpoint, and may log again the
    steps before it, which a job killed without warning may not have written)."""
    starts = [min(p[0] for p in points) for points in later.scalars.values() if points]
    start = min(starts) if starts else None
    logged = [p[0] for points in first.scalars.values() for p in points]
    if start is not None and logged and start <= max(logged):
        warnings.warn(
            f"run {first.name}: the step counter goes back (resumed from a checkpoint, first "
            f"at step {start}, in {later.source}): stitched, the later job's values replace "
            "what the earlier one logged from there on",
            LogStitchWarning,
            stacklevel=3,
        )
    for tag, points in later.scalars.items():
        kept = [p for p in first.scalars.get(tag, []) if start is None or p[0] < start]
        first.scalars[tag] = kept + list(points)
    first.meta = {**first.meta, **later.meta}


def check_unique(runs: Sequence[RunLog]) -> None:
    seen: dict[str, RunLog] = {}
    for run in runs:
        if run.name in seen:
            other = seen[run.name]
            raise V.fail(
                f"two runs are named {run.name!r}: {other.kind} {other.source} and "
                f"{run.kind} {run.source}",
                "rename one (its folder or its W&B name), or give the sources in separate commands",
            )
        seen[run.name] = run


def _known_tags_text() -> str:
    return ", ".join(f"{tag!r} ({stack})" for tag, stack in LOSS_TAGS)


def loss_tag_of(run: RunLog, loss_tag: str | None) -> str | None:
    if loss_tag is not None:
        return loss_tag if loss_tag in run.scalars else None
    return next((tag for tag, _ in LOSS_TAGS if tag in run.scalars), None)


def choose_runs(runs: Sequence[RunLog], loss_tag: str | None) -> list[tuple[RunLog, str]]:
    """(run, its loss tag) for every run that logs one; none at all: an error with the tags."""
    chosen = [(run, loss_tag_of(run, loss_tag)) for run in runs]
    found = [(run, tag) for run, tag in chosen if tag is not None]
    if not found:
        present = sorted({tag for run in runs for tag in run.scalars})
        where = ", ".join(sorted({str(run.source) for run in runs})) or "the sources"
        looked = repr(loss_tag) if loss_tag is not None else f"any of {_known_tags_text()}"
        raise V.fail(
            f"no run logs the loss tag {looked}; scalar tags present: "
            f"{', '.join(map(repr, present)) or 'none'}",
            "name the loss with --loss-tag TAG",
            where,
        )
    skipped = [run.name for run, tag in chosen if tag is None]
    if skipped:
        warnings.warn(
            f"{len(skipped)} folder(s) without the loss tag are not runs here and are left out: "
            f"{', '.join(skipped[:MAX_GAPS_SHOWN])}{' ...' * (len(skipped) > MAX_GAPS_SHOWN)}",
            LogNote,
            stacklevel=2,
        )
    return found


def stitch(run: RunLog, points: list[tuple[int, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Steps and values in step order, a resumed job's values replacing the earlier job's.

    Like TensorBoard's purge on resume: when the step goes back to s, what was logged at steps
    >= s before is dropped. A counter that goes back to the run's first step or before is two
    attempts in one folder (or a counter that restarted): refused.
    """
    steps = np.array([p[0] for p in points], dtype=np.int64)
    values = np.array([p[1] for p in points], dtype=float)
    back = np.flatnonzero(np.diff(steps) <= 0) + 1
    if not len(back):
        return steps, values
    keep = np.ones(len(steps), dtype=bool)
    first = steps[0]
    for i in back:
        restart = steps[i]
        previous = steps[:i][keep[:i]]
        if restart <= first:
            raise V.fail(
                f"run {run.name}: its step counter goes back from {int(previous.max())} to "
                f"{int(restart)}, at or before its first logged step {int(first)}: two "
                "attempts in one folder, or a counter that restarted with the job",
                "move the abandoned attempt's event files out of the run's folder (or log the "
                "global step, not the step of the job)",
                str(run.source),
            )
        keep[:i] &= steps[:i] < restart
    warnings.warn(
        f"run {run.name}: the step counter goes back {len(back)} time(s) (resumed from a "
        f"checkpoint, first at step {int(steps[back[0]])}): stitched, the later job's values "
        "replace what the earlier one logged from there on",
        LogStitchWarning,
        stacklevel=2,
    )
    return steps[keep], values[keep]


def gaps(steps: np.ndarray) -> tuple[int, list[tuple[int, int]]]:
    """(logging interval, missing step ranges): the interval is the most common step difference."""
    if len(steps) < 3:
        return 1, []
    diff = np.diff(steps)
    values, counts = np.unique(diff, return_counts=True)
    interval = int(values[np.argmax(counts)])
    at = np.flatnonzero(diff > interval)
    return interval, [(int(steps[i] + interval), int(steps[i + 1] - interval)) for i in at]


def report_gaps(run: RunLog, steps: np.ndarray) -> None:
    interval, missing = gaps(steps)
    if not missing:
        return
    total = sum((b - a) // interval + 1 for a, b in missing)
    shown = ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in missing[:MAX_GAPS_SHOWN])
    more = f" and {len(missing) - MAX_GAPS_SHOWN} more" if len(missing) > MAX_GAPS_SHOWN else ""
    warnings.warn(
        f"run {run.name} ({run.kind} {run.source}): {total} logged step(s) missing "
        f"(every {interval} steps otherwise), at steps {shown}{more}; an export from the W&B web "
        "UI samples long runs: export the full history with run.scan_history() instead",
        LogGapWarning,
        stacklevel=2,
    )


def run_frame(run: RunLog, tag: str) -> pd.DataFrame:
    """One run's curve rows (``run, step, loss`` + metadata from its log)."""
    steps, values = stitch(run, run.scalars[tag])
    if run.kind != "tensorboard":
        report_gaps(run, steps)
    frame = pd.DataFrame({"run": run.name, "step": steps, "loss": values})
    for key, value in run.meta.items():
        frame[key] = value
    return frame


def read_logs(
    sources: Sequence[str | Path],
    loss_tag: str | None = None,
    logs_of: dict[str, str] | None = None,
) -> tuple[list[pd.DataFrame], list[str]]:
    """(one curve frame per run, a label per frame naming its source and tag)."""
    found = choose_runs(collect(sources, logs_of), loss_tag)
    frames = [run_frame(run, tag) for run, tag in found]
    labels = [f"{run.kind} run {run.name} ({run.source}, tag {tag!r})" for run, tag in found]
    return frames, labels


def read_sidecar(path: str | Path) -> pd.DataFrame:
    """Per-run metadata from YAML: a list of rows with ``run``, or a mapping run -> values."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise V.fail(f"not valid YAML ({err})", "fix the file", str(path)) from None
    if isinstance(data, dict) and all(isinstance(v, dict) for v in data.values()):
        return pd.DataFrame([{"run": str(k), **v} for k, v in data.items()])
    if isinstance(data, list) and all(isinstance(v, dict) for v in data):
        return pd.DataFrame(data)
    raise V.fail(
        "a runs table in YAML is a list of rows with a run key, or a mapping run -> values",
        "write e.g. 'd64: {size: d64, tpp: 20, steps: 4000}'",
        str(path),
    )
