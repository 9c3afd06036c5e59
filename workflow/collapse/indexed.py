"""Megatron indexed datasets (.bin/.idx) read in place: header, counts and token-id checks.

A prefix names the pair ``<prefix>.bin`` / ``<prefix>.idx`` that Megatron-Core's
``IndexedDatasetBuilder`` writes. ``inspect_prefix`` reads only the index (header and arrays) and
the .bin size, so a plan can count tokens in milliseconds; ``max_token_id`` scans the .bin through
a memory map in fixed-size chunks, so its memory does not grow with the dataset.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
SCAN_CHUNK_TOKENS = 1 << 24  # tokens per chunk of the id scan (32-128 MB of the .bin)


class IndexedDatasetError(ValueError):
    """A .bin/.idx pair is missing, truncated, corrupt or holds ids the model cannot embed."""


@dataclass(frozen=True)
class PrefixInfo:
    prefix: str
    dtype: str
    sequences: int
    documents: int
    tokens: int
    bin_bytes: int
    idx_bytes: int


def _paths(prefix: str | Path) -> tuple[Path, Path]:
    return Path(f"{prefix}.idx"), Path(f"{prefix}.bin")


def read_header(prefix: str | Path) -> PrefixInfo:
    """Counts from the .idx header and the .bin size only (no arrays read): for the plan.

    Raises IndexedDatasetError, naming the file, for a missing file, a header that is not
    Megatron's, an .idx of the wrong size or a .bin whose size is not a whole number of tokens.
    """
    idx_path, bin_path = _paths(prefix)
    for path in (idx_path, bin_path):
        if not path.is_file():
            raise IndexedDatasetError(
                f"{path}: file missing. Fix: correct the prefix (a path without .bin/.idx)"
            )
    idx_size, bin_size = idx_path.stat().st_size, bin_path.stat().st_size
    with idx_path.open("rb") as handle:
        header = handle.read(INDEX_HEADER.size)
    if len(header) < INDEX_HEADER.size:
        raise IndexedDatasetError(
            f"{idx_path}: truncated ({idx_size} bytes, shorter than a header)"
        )
    magic, version, code, sequences, documents = INDEX_HEADER.unpack(header)
    if magic != INDEX_MAGIC or version != 1 or code not in DTYPES:
        raise IndexedDatasetError(f"{idx_path}: not a Megatron indexed-dataset index (bad header)")
    expected = INDEX_HEADER.size + sequences * 12 + documents * 8
    if idx_size not in (expected, expected + sequences):  # + sequence modes (multimodal)
        raise IndexedDatasetError(
            f"{idx_path}: truncated or corrupt ({idx_size} bytes, the header says {expected})"
        )
    itemsize = np.dtype(DTYPES[code]).itemsize
    if bin_size % itemsize:
        raise IndexedDatasetError(
            f"{bin_path}: {bin_size} bytes is not a whole number of {np.dtype(DTYPES[code]).name} "
            "tokens (truncated?)"
        )
    return PrefixInfo(
        prefix=str(prefix),
        dtype=np.dtype(DTYPES[code]).name,
        sequences=sequences,
        documents=max(documents - 1, 0),  # the document index starts with a 0
        tokens=bin_size // itemsize,
        bin_bytes=bin_size,
        idx_bytes=idx_size,
    )


def inspect_prefix(prefix: str | Path) -> PrefixInfo:
    """``read_header`` plus the index arrays: pointers and lengths must span the .bin exactly."""
    info = read_header(prefix)
    idx_path, bin_path = _paths(prefix)
    if info.sequences == 0:
        raise IndexedDatasetError(f"{idx_path}: holds no sequences (an empty dataset)")
    offset = INDEX_HEADER.size
    n = info.sequences
    lengths = np.fromfile(idx_path, dtype=np.int32, count=n, offset=offset)
    pointers = np.fromfile(idx_path, dtype=np.int64, count=n, offset=offset + 4 * n)
    doc_index = np.fromfile(
        idx_path, dtype=np.int64, count=info.documents + 1, offset=offset + 12 * n
    )
    itemsize = np.dtype(info.dtype).itemsize
    if np.any(lengths < 0):
        raise IndexedDatasetError(f"{idx_path}: negative sequence lengths (corrupt)")
    ends = np.cumsum(lengths, dtype=np.int64) * itemsize
    if pointers[0] != 0 or not np.array_equal(pointers[1:], ends[:-1]):
        raise IndexedDatasetError(f"{idx_path}: sequence pointers do not match the lengths")
    if doc_index[0] != 0 or doc_index[-1] != n or np.any(np.diff(doc_index) < 0):
        raise IndexedDatasetError(f"{idx_path}: the document index does not cover the sequences")
    if ends[-1] != info.bin_bytes:
        raise IndexedDatasetError(
            f"{bin_path}: truncated or inconsistent ({info.bin_bytes} bytes, the index says "
            f"{int(ends[-1])})"
        )
    return info


def max_token_id(prefix: str | Path, chunk_tokens: int = SCAN_CHUNK_TOKENS) -> tuple[int, int]:
    """(largest, smallest) token id of the .bin, read through a memory map chunk by chunk."""
    info = read_header(prefix)
    _, bin_path = _paths(prefix)
    if info.tokens == 0:
        return -1, 0
    data = np.memmap(bin_path, dtype=info.dtype, mode="r")
    largest, smallest = None, None
    for start in range(0, info.tokens, chunk_tokens):
        chunk = data[start : start + chunk_tokens]
        high, low = int(chunk.max()), int(chunk.min())
        largest = high if largest is None else max(largest, high)
        smallest = low if smallest is None else min(smallest, low)
    del data
    return largest, smallest


def check_prefix(prefix: str | Path, vocab_size: int) -> tuple[PrefixInfo, int]:
    """Everything a training job relies on: whole files, ids in [0, vocab_size).

    Returns the counts and the largest token id."""
    info = inspect_prefix(prefix)
    largest, smallest = max_token_id(prefix)
    _, bin_path = _paths(prefix)
    if largest >= vocab_size:
        raise IndexedDatasetError(
            f"{bin_path}: token id {largest} >= the model's vocabulary size {vocab_size}. Fix: "
            "set family.arch.vocab_size to the tokenizer's (padded) size, or use the dataset "
            "made with this model's tokenizer"
        )
    if smallest < 0:
        raise IndexedDatasetError(f"{bin_path}: negative token id {smallest} (corrupt)")
    return info, largest
