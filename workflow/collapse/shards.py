"""Raw documents in files -> tokenized shards (parallel jobs) -> one Megatron dataset per split.

The ``kind: shards`` data source (``collapse.data.ShardsDataConfig``) in three steps, each a
Snakemake job (``workflow/rules/data.smk``) or, for a quick local build, one call of
``run_step(cfg, out, "all")``:

1. ``tokenizer``: check and copy the user's tokenizer.json, or train the family's byte-level BPE
   on the first ``tokenizer_sample_bytes`` of the train documents.
2. ``shard`` (one job per shard, in parallel): stream the shard's documents, send each to the
   train or valid split by a keyed hash of its bytes (``is_valid_document``), encode them in
   batches and write ``shards/NNNNN.{train,valid}.{bin,idx}`` with Megatron-Core's
   ``IndexedDatasetBuilder``, then ``NNNNN.json`` (its counts) last. Memory is bounded by a
   shard's size, never the corpus's. A file larger than ``shard_bytes`` is cut into pieces:
   JSON lines at line boundaries (a compressed one by its estimated text size, each piece
   decompressing the stream up to its own end), Parquet at row-group boundaries; small files
   are grouped.
3. ``merge``: concatenate the shards with ``IndexedDatasetBuilder.add_index`` into
   ``train_text_document`` / ``valid_text_document``, check them, write meta.json last.

Every file is written under a temporary name and renamed into place, so a killed job leaves no
output that looks complete, and a rerun redoes only the shards whose ``NNNNN.json`` is missing.
"""

from __future__ import annotations

import glob as globlib
import gzip
import hashlib
import io
import json
import os
import shutil
import sys
import time
import warnings
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from collapse.data import (
    META_NAME,
    TOKENIZER_NAME,
    TRAIN_PREFIX_NAME,
    VALID_PREFIX_NAME,
    DatasetError,
    ShardsDataConfig,
    SplitSummary,
    _versions,
    check_tokenizer_file,
    verify_dataset,
)

SHARDS_DIR = "shards"
SPLITS = ("train", "valid")
BATCH_BYTES = 1 << 20  # text encoded per call of the encoder
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_COMPRESSED = {".gz": "gzip", ".zst": "zstd"}
# Uncompressed text bytes per compressed byte, for the plan's estimate before a build only.
_EXPANSION = {"gzip": 3.0, "zstd": 3.5, None: 1.0}


class ShardError(ValueError):
    """A raw input cannot be used; the message names the file (and line) and the fix."""


def _log(message: str) -> None:
    print(f"[data] {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ inputs
def input_files(cfg: ShardsDataConfig) -> list[Path]:
    """The files ``cfg.files`` match, sorted within each glob; an unmatched glob is an error."""
    files: list[Path] = []
    for index, pattern in enumerate(cfg.files):
        matched = sorted(
            Path(p) for p in globlib.glob(pattern, recursive=True) if os.path.isfile(p)
        )
        if not matched:
            raise ShardError(
                f"data.files[{index}]: no file matches {pattern!r}. Fix: correct the path or glob"
            )
        files.extend(matched)
    return files


def compression(path: Path) -> str | None:
    return _COMPRESSED.get(path.suffix)


def file_format(path: Path, declared: str = "auto") -> str:
    """jsonl, parquet or text: ``declared`` unless auto, else from the name (before .gz/.zst)."""
    if declared != "auto":
        return declared
    name = path.name[: -len(path.suffix)] if compression(path) else path.name
    suffix = Path(name).suffix
    if suffix in _JSONL_SUFFIXES:
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    if suffix in (".txt", ".md", ".text"):
        return "text"
    raise ShardError(
        f"{path}: cannot tell its format from the name. Fix: name it .jsonl[.gz|.zst], "
        ".parquet or .txt, or set data.format"
    )


@dataclass(frozen=True)
class Piece:
    """A part of one input file: ``[start, end)`` in the file's bytes (``unit`` "bytes"), in its
    decompressed text ("text") or in its Parquet row groups ("row_groups"); end -1: to the end.
    A line or row belongs to the piece its first byte (or row group) lies in."""

    path: str
    start: int = 0
    end: int = -1
    unit: str = "bytes"


def _ranges(total: int, step: int, open_end: bool) -> list[tuple[int, int]]:
    """[start, end) ranges of ``step`` covering ``total``; the last one open (-1) if asked."""
    ranges = [(start, min(start + step, total)) for start in range(0, total, step)]
    if open_end:
        ranges[-1] = (ranges[-1][0], -1)
    return ranges


def _pieces(path: Path, cfg: ShardsDataConfig) -> list[Piece]:
    """The file whole, or cut into pieces of about ``shard_bytes`` of text where it can be."""
    size = path.stat().st_size
    fmt = file_format(path, cfg.format)
    kind = compression(path)
    if fmt == "jsonl" and kind is None and size > cfg.shard_bytes:
        return [Piece(str(path), a, b) for a, b in _ranges(size, cfg.shard_bytes, False)]
    if fmt == "jsonl" and size * _EXPANSION[kind] > cfg.shard_bytes:
        # the text size is an estimate: the last piece takes whatever the stream holds beyond
        text = int(size * _EXPANSION[kind])
        return [Piece(str(path), a, b, "text") for a, b in _ranges(text, cfg.shard_bytes, True)]
    if fmt == "parquet" and size > cfg.shard_bytes:
        return [Piece(str(path), a, b, "row_groups") for a, b in _row_group_ranges(path, cfg)]
    return [Piece(str(path))]


def _row_group_ranges(path: Path, cfg: ShardsDataConfig) -> list[tuple[int, int]]:
    """Consecutive row groups of a Parquet file, about ``shard_bytes`` of data each (footer)."""
    import pyarrow.parquet as pq

    try:
        metadata = pq.ParquetFile(path).metadata
    except Exception as err:  # pyarrow raises ArrowInvalid and OSError subclasses
        raise ShardError(f"{path}: not a readable Parquet file ({err})") from None
    ranges, start, size = [], 0, 0
    for group in range(metadata.num_row_groups):
        size += metadata.row_group(group).total_byte_size
        if size >= cfg.shard_bytes:
            ranges.append((start, group + 1))
            start, size = group + 1, 0
    if start < metadata.num_row_groups or not ranges:
        ranges.append((start, metadata.num_row_groups))
    return ranges


def plan_shards(cfg: ShardsDataConfig) -> list[list[Piece]]:
    """The shards, each a list of pieces of files, from file names, sizes and Parquet footers.

    A file that ``_pieces`` cuts gives one shard per piece; other files stay whole and are
    grouped, in order, until a shard holds ``shard_bytes``.
    """
    shards: list[list[Piece]] = []
    group: list[Piece] = []
    group_bytes = 0
    for path in input_files(cfg):
        pieces = _pieces(path, cfg)
        if len(pieces) > 1:
            if group:
                shards.append(group)
                group, group_bytes = [], 0
            shards.extend([piece] for piece in pieces)
            continue
        group.append(pieces[0])
        group_bytes += path.stat().st_size
        if group_bytes >= cfg.shard_bytes:
            shards.append(group)
            group, group_bytes = [], 0
    if group:
        shards.append(group)
    return shards


PLAN_NAME = "plan.json"


def recorded_plan(cfg: ShardsDataConfig, out_dir: Path) -> list[list[Piece]]:
    """``plan_shards``, checked against the plan the build started with (``shards/plan.json``,
    written by its first step), so that an input that disappears, appears or changes size
    mid-build stops the job, naming the file, instead of shifting which shard is which."""
    shards = plan_shards(cfg)
    files = dict.fromkeys(piece.path for shard in shards for piece in shard)  # in file order
    record = {
        "config_fingerprint": cfg.fingerprint(),
        "files": {path: os.path.getsize(path) for path in files},
    }
    path = Path(out_dir) / SHARDS_DIR / PLAN_NAME
    if path.is_file():
        before = json.loads(path.read_text())
        if before.get("config_fingerprint") == record["config_fingerprint"]:
            old, new = before["files"], record["files"]
            changes = [f"{f}: gone" for f in old if f not in new]
            changes += [f"{f}: new" for f in new if f not in old]
            changes += [
                f"{f}: {old[f]:,} bytes then, {new[f]:,} now"
                for f in new
                if old.get(f, new[f]) != new[f]
            ]
            if changes:
                raise ShardError(
                    f"data.files changed since the shards were planned ({path}): "
                    f"{'; '.join(changes[:5])}. Fix: restore the inputs, or delete "
                    f"{path.parent} and rerun the data rules to tokenize them as they are now"
                )
            return shards
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
    return shards


def estimate_text_bytes(cfg: ShardsDataConfig) -> int:
    """Text bytes of the inputs from their sizes (compressed files by a typical ratio)."""
    total = 0.0
    for path in input_files(cfg):
        total += path.stat().st_size * _EXPANSION[compression(path)]
    return int(total)


def _open_binary(path: Path):
    kind = compression(path)
    if kind == "gzip":
        return gzip.open(path, "rb")
    if kind == "zstd":
        import zstandard

        return io.BufferedReader(zstandard.open(path, "rb"))
    return path.open("rb")


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ShardError(
            f"{where}: not UTF-8 (byte {err.start}: {raw[err.start : err.start + 1]!r}). "
            "Fix: re-encode the file as UTF-8"
        ) from None


def _skip_to(handle, piece: Piece) -> tuple[int, int | None]:
    """Move ``handle`` to the first line that starts at or after ``piece.start``: its offset
    and the number of lines before it (None where a seek skipped them uncounted).

    Uncompressed files seek; a compressed stream is read up to there (it cannot seek)."""
    if piece.start == 0:
        return 0, 0
    if piece.unit == "bytes":
        handle.seek(piece.start - 1)
        return piece.start - 1 + len(handle.readline()), None  # the line started before
    position = lines = 0
    while position < piece.start:
        line = handle.readline()
        if not line:
            break
        position, lines = position + len(line), lines + 1
    return position, lines


def _jsonl_documents(piece: Piece, field: str) -> Iterator[tuple[str, str]]:
    path = Path(piece.path)
    with _open_binary(path) as handle:
        position, lineno = _skip_to(handle, piece)
        while piece.end < 0 or position < piece.end:
            line = handle.readline()
            if not line:
                break
            if lineno is None:
                where = f"{path} (line at byte {position})"
            else:
                lineno += 1
                where = f"{path}:{lineno}"
            position += len(line)
            if not line.strip():
                continue
            text = _decode(line, where)
            try:
                record = json.loads(text)
                value = record[field]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ShardError(
                    f"{where}: not a JSON object with a field {field!r} ({err!r}). Fix: correct "
                    "the file, or set data.field to the key that holds the text"
                ) from None
            if not isinstance(value, str):
                raise ShardError(
                    f"{where}: field {field!r} is {type(value).__name__}, not a string. Fix: "
                    "set data.field to the text key"
                )
            yield value, where


def _parquet_documents(piece: Piece, field: str) -> Iterator[tuple[str, str]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(piece.path)
    except Exception as err:  # pyarrow raises ArrowInvalid and OSError subclasses
        raise ShardError(f"{piece.path}: not a readable Parquet file ({err})") from None
    if field not in parquet.schema_arrow.names:
        raise ShardError(
            f"{piece.path}: no column {field!r} (columns: {parquet.schema_arrow.names}). Fix: "
            "set data.field to the column that holds the text"
        )
    groups = list(range(parquet.metadata.num_row_groups))
    if piece.unit == "row_groups":
        groups = groups[piece.start : None if piece.end < 0 else piece.end]
    row = sum(parquet.metadata.row_group(g).num_rows for g in range(groups[0] if groups else 0))
    for batch in parquet.iter_batches(batch_size=1024, columns=[field], row_groups=groups):
        for value in batch.column(0).to_pylist():
            row += 1
            yield ("" if value is None else value), f"{piece.path} (row {row})"


def _text_document(piece: Piece) -> Iterator[tuple[str, str]]:
    with _open_binary(Path(piece.path)) as handle:
        yield _decode(handle.read(), piece.path), piece.path


def read_documents(shard: list[Piece], cfg: ShardsDataConfig) -> Iterator[tuple[str, str]]:
    """(text, where) of each document of a shard, in file order; ``where`` names file and line."""
    for piece in shard:
        fmt = file_format(Path(piece.path), cfg.format)
        try:
            if fmt == "jsonl":
                yield from _jsonl_documents(piece, cfg.field)
            elif fmt == "parquet":
                yield from _parquet_documents(piece, cfg.field)
            else:
                yield from _text_document(piece)
        except (EOFError, OSError) as err:  # a truncated .gz, a corrupt .zst
            raise ShardError(f"{piece.path}: cannot be read to the end ({err})") from None
        except Exception as err:
            if type(err).__name__ == "ZstdError":
                raise ShardError(f"{piece.path}: corrupt zstd stream ({err})") from None
            raise


# Per document of a shard split, in item order: its digest and UTF-8 size (``NNNNN.<split>.docs``).
DOC_RECORD = np.dtype([("digest", "V16"), ("bytes", "<u8")])


def document_digest(data: bytes, seed: int) -> bytes:
    """BLAKE2b-128 of the document's UTF-8 bytes, keyed by the seed: its split and dedup key."""
    return hashlib.blake2b(data, digest_size=16, key=seed.to_bytes(8, "little")).digest()


def is_valid_digest(digest: bytes, fraction: float) -> bool:
    return int.from_bytes(digest[:8], "little") < fraction * 2**64


def is_valid_document(data: bytes, seed: int, fraction: float) -> bool:
    """Held out when the document's digest (``document_digest``), its first 8 bytes read as a
    little-endian number over 2^64, is below ``fraction``.

    Deterministic per document: the split does not depend on the order of files or shards,
    and two equal documents always land in the same split.
    """
    return is_valid_digest(document_digest(data, seed), fraction)


# ------------------------------------------------------------------------------ steps
def shard_name(index: int) -> str:
    return f"{index:05d}"


def shard_files(out_dir: Path, index: int) -> dict[str, Path]:
    base = Path(out_dir) / SHARDS_DIR / shard_name(index)
    files = {f"{s}.{e}": Path(f"{base}.{s}.{e}") for s in SPLITS for e in ("bin", "idx", "docs")}
    return files | {"json": Path(f"{base}.json")}


def _tokenizer_path(out_dir: Path) -> Path:
    return Path(out_dir) / TOKENIZER_NAME


def build_tokenizer(cfg: ShardsDataConfig, out_dir: Path) -> Path:
    """tokenizer.json in ``out_dir``: the user's, checked, or a BPE trained on a sample."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = _tokenizer_path(out_dir)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    if cfg.tokenizer is not None:
        check_tokenizer_file(cfg.tokenizer, cfg.vocab_size, cfg.eod_token)
        shutil.copyfile(cfg.tokenizer, tmp)
    else:
        from collapse.tokenizer import train_tokenizer

        def sample() -> Iterator[str]:
            taken = 0
            for shard in plan_shards(cfg):
                for text, _ in read_documents(shard, cfg):
                    data = text.encode("utf-8", "replace")
                    if not text or is_valid_document(data, cfg.seed, cfg.valid_fraction):
                        continue
                    yield text
                    taken += len(data)
                    if taken >= cfg.tokenizer_sample_bytes:
                        return

        tick = time.perf_counter()
        tokenizer = train_tokenizer(sample(), cfg.vocab_size)
        tokenizer.save(str(tmp))
        _log(
            f"tokenizer: vocab {tokenizer.get_vocab_size()} (asked {cfg.vocab_size}) trained in "
            f"{time.perf_counter() - tick:.1f} s"
        )
    recorded_plan(cfg, out_dir)  # the build's first step: the inputs it starts from
    os.replace(tmp, target)
    return target


def _encoder(cfg: ShardsDataConfig, out_dir: Path, sample: list[str]):
    from collapse.tokenizer import batch_encoder, token_dtype

    path = _tokenizer_path(out_dir)
    if not path.is_file():
        raise DatasetError(f"{path}: missing. Fix: run the tokenizer step (data_tokenizer) first")
    trained = cfg.tokenizer is None
    tokenizer, eod = check_tokenizer_file(path, cfg.vocab_size, cfg.eod_token, trained)
    name, encode = batch_encoder(tokenizer, sample, one_thread=True)  # a job per core
    return name, encode, eod, token_dtype(cfg.vocab_size)


class ShardSummary(BaseModel):
    shard: str
    config_fingerprint: str
    pieces: list[dict]
    documents_read: int
    empty_skipped: int
    bytes: dict[str, int]
    documents: dict[str, int]
    tokens: dict[str, int]
    encoder: str
    encode_s: float
    build_s: float


def _builder(path: Path, dtype):
    """Megatron's IndexedDatasetBuilder, its index kept in typed arrays instead of lists.

    The builder appends one length and one document boundary per document; as Python ints in
    lists those cost about 70 bytes a document, as int32/int64 arrays 12. Finish it with
    ``_finalize``.
    """
    with warnings.catch_warnings():  # megatron.core warns on import that TE/Apex are absent
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(str(path), dtype=dtype)
    builder.sequence_lengths = array("i")  # C int: int32, the .idx's length type
    builder.document_indices = array("q", [0])
    return builder


def _finalize(builder, idx_path: Path) -> None:
    """``builder.finalize`` with the sequence pointers computed by numpy (Megatron's writer
    builds them as a list of Python ints, about 40 bytes a document); same .idx bytes."""
    from megatron.core.datasets.indexed_dataset import _IndexWriter

    builder.data_file.close()
    lengths = np.frombuffer(builder.sequence_lengths, dtype=np.int32)
    documents = np.frombuffer(builder.document_indices, dtype=np.int64)
    itemsize = np.dtype(builder.dtype).itemsize

    def pointers(_lengths) -> np.ndarray:
        out = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=out[1:])
        return out * itemsize

    with _IndexWriter(str(idx_path), builder.dtype) as writer:
        writer._sequence_pointers = pointers
        writer.write(lengths, None, documents)


def _batches(cfg: ShardsDataConfig, shard: list[Piece], counts: dict) -> Iterator[list]:
    """Batches of (split, text, bytes, digest) of about BATCH_BYTES, every document checked."""
    batch, size = [], 0
    for text, where in read_documents(shard, cfg):
        counts["read"] += 1
        if not text.strip():
            if cfg.skip_empty:
                counts["empty"] += 1
                continue
            raise ShardError(
                f"{where}: an empty document. Fix: remove it, or set data.skip_empty: true"
            )
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as err:  # a lone surrogate from a JSON \\ud800 escape
            raise ShardError(f"{where}: text that is not valid Unicode ({err.reason})") from None
        digest = document_digest(data, cfg.seed)
        split = "valid" if is_valid_digest(digest, cfg.valid_fraction) else "train"
        batch.append((split, text, len(data), digest))
        size += len(data)
        if size >= BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def tokenize_shard(cfg: ShardsDataConfig, out_dir: Path, index: int) -> ShardSummary:
    """Encode shard ``index`` into its train/valid .bin/.idx pairs, then write its .json."""
    import torch

    start = time.perf_counter()
    out_dir = Path(out_dir)
    shards = recorded_plan(cfg, out_dir)
    if not 0 <= index < len(shards):
        raise DatasetError(f"shard {index} does not exist: the inputs make {len(shards)} shards")
    shard = shards[index]
    files = shard_files(out_dir, index)
    files["json"].parent.mkdir(parents=True, exist_ok=True)
    files["json"].unlink(missing_ok=True)
    tmp = {key: path.with_name(f".{path.name}.tmp-{os.getpid()}") for key, path in files.items()}
    counts = {"read": 0, "empty": 0}
    nbytes = dict.fromkeys(SPLITS, 0)
    ndocs = dict.fromkeys(SPLITS, 0)
    ntokens = dict.fromkeys(SPLITS, 0)
    encoder, encode_s, last_report = "", 0.0, start
    builders = {}
    records = {split: bytearray() for split in SPLITS}  # DOC_RECORD rows, 24 bytes a document
    try:
        for batch in _batches(cfg, shard, counts):
            if not builders:
                sample = [item[1] for item in batch[:64]]
                encoder, encode, eod, dtype = _encoder(cfg, out_dir, sample)
                builders = {s: _builder(tmp[f"{s}.bin"], dtype) for s in SPLITS}
            tick = time.perf_counter()
            encoded = encode([item[1] for item in batch])
            for (split, _, size, digest), ids in zip(batch, encoded, strict=True):
                array = np.empty(len(ids) + 1, dtype=dtype)
                array[:-1] = ids
                array[-1] = eod
                builders[split].add_item(torch.from_numpy(array))
                builders[split].end_document()
                records[split] += digest + size.to_bytes(8, "little")
                nbytes[split] += size
                ndocs[split] += 1
                ntokens[split] += len(array)
            encode_s += time.perf_counter() - tick
            now = time.perf_counter()
            if now - last_report > 10.0:
                last_report = now
                _log(
                    f"shard {shard_name(index)}: {sum(ndocs.values()):,} documents, "
                    f"{sum(nbytes.values()) / max(now - start, 1e-9) / 1e6:.1f} MB/s"
                )
        if not builders:  # no documents: empty pairs still mark the shard as done
            from collapse.tokenizer import token_dtype

            builders = {s: _builder(tmp[f"{s}.bin"], token_dtype(cfg.vocab_size)) for s in SPLITS}
        for split in SPLITS:
            _finalize(builders[split], tmp[f"{split}.idx"])
            tmp[f"{split}.docs"].write_bytes(bytes(records[split]))
        summary = ShardSummary(
            shard=shard_name(index),
            config_fingerprint=cfg.fingerprint(),
            pieces=[vars(p) for p in shard],
            documents_read=counts["read"],
            empty_skipped=counts["empty"],
            bytes=nbytes,
            documents=ndocs,
            tokens=ntokens,
            encoder=encoder,
            encode_s=round(encode_s, 3),
            build_s=round(time.perf_counter() - start, 3),
        )
        tmp["json"].write_text(json.dumps(summary.model_dump(), indent=2) + "\n")
        for key in (*(k for k in files if k != "json"), "json"):  # the .json last
            os.replace(tmp[key], files[key])
    finally:
        for path in tmp.values():
            path.unlink(missing_ok=True)
    _log(
        f"shard {summary.shard}: {sum(ndocs.values()):,} documents, {sum(ntokens.values()):,} "
        f"tokens in {summary.build_s:.1f} s ({sum(nbytes.values()) / 1e6:.1f} MB)"
    )
    return summary


class ShardsSummary(BaseModel):
    """meta.json of a ``kind: shards`` source."""

    kind: str = "shards"
    config_fingerprint: str
    config: ShardsDataConfig
    vocab_size: int
    eod_id: int
    dtype: str
    tokenizer: str
    train: SplitSummary
    valid: SplitSummary
    bytes_per_token: float
    shards: int
    documents_read: int
    empty_skipped: int
    duplicates_dropped: int  # with dedup: later copies of a document (by digest)
    versions: dict[str, str]
    build_s: float  # of the merge; the shards' own times are in shards/*.json
    encoder: str
    encode_tokens_per_s: float


def _first_occurrences(out_dir: Path, count: int, split: str) -> list[np.ndarray]:
    """Per shard, a mask of the documents whose digest no earlier document of the split has.

    Holds 24 bytes a document of the split (the digests and sizes), not the text."""
    records = [
        np.fromfile(shard_files(out_dir, i)[f"{split}.docs"], dtype=DOC_RECORD)
        for i in range(count)
    ]
    digests = np.concatenate([r["digest"] for r in records]) if records else np.array([])
    keep = np.zeros(len(digests), dtype=bool)
    keep[np.unique(digests, return_index=True)[1]] = True
    bounds = np.cumsum([0, *(len(r) for r in records)])
    return [keep[bounds[i] : bounds[i + 1]] for i in range(count)]


def _add_kept(builder, prefix: str, keep: np.ndarray) -> int:
    """Copy the kept documents of one shard split into ``builder``; returns their text bytes."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    sizes = np.fromfile(f"{prefix}.docs", dtype=DOC_RECORD)["bytes"]
    dataset = IndexedDataset(prefix)
    for item in np.flatnonzero(keep):
        builder.add_item(torch.from_numpy(np.array(dataset[int(item)])))
        builder.end_document()
    del dataset
    return int(sizes[keep].sum())


def merge_shards(cfg: ShardsDataConfig, out_dir: Path) -> ShardsSummary:
    """Concatenate every shard into the two split datasets; meta.json (written last) marks them."""
    from collapse.indexed import inspect_prefix
    from collapse.tokenizer import token_dtype

    start = time.perf_counter()
    out_dir = Path(out_dir)
    (out_dir / META_NAME).unlink(missing_ok=True)
    shards = recorded_plan(cfg, out_dir)
    summaries = []
    for index in range(len(shards)):
        path = shard_files(out_dir, index)["json"]
        if not path.is_file():
            raise DatasetError(f"{path}: missing. Fix: run its shard step (data_shard) first")
        summary = ShardSummary.model_validate_json(path.read_text())
        if summary.config_fingerprint != cfg.fingerprint() or summary.pieces != [
            vars(p) for p in shards[index]
        ]:
            raise DatasetError(
                f"{path}: made from another data config or other inputs. Fix: delete "
                f"{out_dir / SHARDS_DIR} and rerun the data rules"
            )
        summaries.append(summary)
    dtype = token_dtype(cfg.vocab_size)
    _, eod = check_tokenizer_file(
        _tokenizer_path(out_dir), cfg.vocab_size, cfg.eod_token, cfg.tokenizer is None
    )
    staging = out_dir / f".merging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        splits, dropped = {}, 0
        for split, name in (("train", TRAIN_PREFIX_NAME), ("valid", VALID_PREFIX_NAME)):
            builder = _builder(staging / f"{name}.bin", dtype)
            keep = _first_occurrences(out_dir, len(summaries), split) if cfg.dedup else None
            split_bytes = 0
            for index, summary in enumerate(summaries):
                if not summary.documents[split]:
                    continue
                base = str(shard_files(out_dir, index)[f"{split}.bin"])[: -len(".bin")]
                if keep is None or keep[index].all():
                    builder.add_index(base)
                    split_bytes += summary.bytes[split]
                else:
                    split_bytes += _add_kept(builder, base, keep[index])
                    dropped += int((~keep[index]).sum())
            _finalize(builder, staging / f"{name}.idx")
            documents = sum(s.documents[split] for s in summaries)
            if documents == 0:
                raise DatasetError(
                    f"{out_dir}: no document fell in the {split} split "
                    f"({sum(s.documents_read for s in summaries)} read). Fix: add documents"
                    + (" or raise data.valid_fraction" if split == "valid" else "")
                )
            info = inspect_prefix(staging / name)
            splits[split] = SplitSummary(
                prefix=name,
                documents=info.documents,
                bytes=split_bytes,
                tokens=info.tokens,
                bin_bytes=info.bin_bytes,
                idx_bytes=info.idx_bytes,
            )
        tokens = sum(sum(s.tokens.values()) for s in summaries)
        encode_s = sum(s.encode_s for s in summaries)
        meta = ShardsSummary(
            config_fingerprint=cfg.fingerprint(),
            config=cfg,
            vocab_size=cfg.vocab_size,
            eod_id=eod,
            dtype=np.dtype(dtype).name,
            tokenizer=TOKENIZER_NAME,
            train=splits["train"],
            valid=splits["valid"],
            bytes_per_token=round(splits["train"].bytes / splits["train"].tokens, 4),
            shards=len(summaries),
            documents_read=sum(s.documents_read for s in summaries),
            empty_skipped=sum(s.empty_skipped for s in summaries),
            duplicates_dropped=dropped,
            versions=_versions(),
            build_s=round(time.perf_counter() - start, 3),
            encoder=summaries[0].encoder if summaries else "",
            encode_tokens_per_s=round(tokens / max(encode_s, 1e-9), 1),
        )
        (staging / META_NAME).write_text(json.dumps(meta.model_dump(mode="json"), indent=2) + "\n")
        for name in (TRAIN_PREFIX_NAME, VALID_PREFIX_NAME):
            verify_dataset(staging / name)
        for name in (VALID_PREFIX_NAME, TRAIN_PREFIX_NAME):
            for ext in ("bin", "idx"):
                os.replace(staging / f"{name}.{ext}", out_dir / f"{name}.{ext}")
        os.replace(staging / META_NAME, out_dir / META_NAME)  # last: marks a complete build
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _log(
        f"merged {meta.shards} shards: train {meta.train.tokens:,} tokens, valid "
        f"{meta.valid.tokens:,} tokens, {meta.bytes_per_token:.3f} bytes/token -> {out_dir}"
    )
    return meta


def run_step(cfg: ShardsDataConfig, out_dir: Path, step: str, shard: int | None = None):
    """One step of the build (what one workflow job runs), or ``all`` of them in order."""
    out_dir = Path(out_dir)
    if step == "tokenizer":
        return build_tokenizer(cfg, out_dir)
    if step == "shard":
        if shard is None:
            raise ValueError("--step shard needs --shard N")
        return tokenize_shard(cfg, out_dir, shard)
    if step == "merge":
        return merge_shards(cfg, out_dir)
    build_tokenizer(cfg, out_dir)
    for index in range(len(recorded_plan(cfg, out_dir))):
        if not shard_files(out_dir, index)["json"].is_file():
            tokenize_shard(cfg, out_dir, index)
    return merge_shards(cfg, out_dir)


def shard_markers(cfg: ShardsDataConfig, out_dir: str | Path) -> list[str]:
    """Each shard job's last output (its .json), for the merge job's inputs."""
    return [str(shard_files(Path(out_dir), i)["json"]) for i in range(len(plan_shards(cfg)))]
