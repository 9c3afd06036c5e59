"""Byte-level BPE tokenizer (Hugging Face ``tokenizers``) with ``<|endoftext|>`` fixed at id 0.

The training job relies on EOD id 0 (documents end with it in the indexed dataset), so the special
token is the first entry of the trainer's vocabulary and ``load_tokenizer`` refuses any file where
it is not. Byte-level means every UTF-8 string encodes and decodes back exactly.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOD_TOKEN = "<|endoftext|>"
EOD_ID = 0
MIN_VOCAB_SIZE = 257  # 256 byte tokens + EOD


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE of at most ``vocab_size`` tokens (fewer when the text runs out)."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least "
            f"{MIN_VOCAB_SIZE} (256 bytes + {EOD_TOKEN}). Fix: raise vocab_size"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOD_TOKEN],  # first special token -> id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    check_eod(tokenizer, "the trained tokenizer")
    return tokenizer


def check_eod(tokenizer: Tokenizer, where: str) -> None:
    eod = tokenizer.token_to_id(EOD_TOKEN)
    if eod != EOD_ID:
        raise ValueError(
            f"{where}: {EOD_TOKEN} has id {eod}, but the training job needs id {EOD_ID}. "
            "Fix: rebuild the tokenizer with the data rule"
        )


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load tokenizer.json and check that EOD is id 0."""
    tokenizer = Tokenizer.from_file(str(path))
    check_eod(tokenizer, str(path))
    return tokenizer


def token_dtype(vocab_size: int) -> type[np.integer]:
    """The narrowest dtype Megatron's indexed dataset supports for these ids."""
    return np.uint16 if vocab_size < 65536 else np.int32


# The regex of tokenizers' ByteLevel pre-tokenizer (use_regex=True), the GPT-2 split.
_BYTE_LEVEL_SPLIT = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (how byte-level BPE stores tokens)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def fast_encoder(tokenizer: Tokenizer):
    """The same BPE as a ``tiktoken.Encoding`` (about 10x faster here), or None if not convertible.

    Byte-level BPE ids trained by ``tokenizers`` are in merge order, so an id is a valid tiktoken
    merge rank. Only plain byte-level BPE (no normalizer) converts; ``encode_documents`` also
    checks that both give identical ids before relying on it.
    """
    import tiktoken

    config = json.loads(tokenizer.to_str())
    if config.get("normalizer") or config["model"].get("type") != "BPE":
        return None
    pre = config.get("pre_tokenizer") or {}
    if (
        pre.get("type") != "ByteLevel"
        or not pre.get("use_regex", True)
        or pre.get("add_prefix_space")
    ):
        return None  # another split than GPT-2's: tiktoken's pattern would not match it
    to_byte = {char: byte for byte, char in _byte_to_unicode().items()}
    specials = {t["content"] for t in config.get("added_tokens", [])}
    try:
        ranks = {
            bytes(to_byte[char] for char in token): rank
            for token, rank in config["model"]["vocab"].items()
            if token not in specials
        }
    except KeyError:  # a token outside the byte alphabet: not byte-level
        return None
    return tiktoken.Encoding(
        name="collapse_bpe", pat_str=_BYTE_LEVEL_SPLIT, mergeable_ranks=ranks, special_tokens={}
    )


def batch_encoder(
    tokenizer: Tokenizer, sample: list[str], one_thread: bool = False
) -> tuple[str, Callable[[list[str]], list[list[int]]]]:
    """The fastest encoder that gives ``tokenizer``'s ids on ``sample``: (name, encode a batch).

    ``one_thread``: tiktoken encodes document by document in the calling thread (a job per
    core, as the shard jobs run, spends about a third less CPU than through its thread pool).
    A literal "<|endoftext|>" inside a document is encoded as text by both, never as the EOD id.
    """
    tokenizer.encode_special_tokens = True

    def slow(batch: list[str]) -> list[list[int]]:
        return [e.ids for e in tokenizer.encode_batch(batch, add_special_tokens=False)]

    encoder = fast_encoder(tokenizer)
    if encoder is not None and encoder.encode_ordinary_batch(sample) == slow(sample):
        if one_thread:
            encode = encoder.encode_ordinary
            return "tiktoken", lambda batch: [encode(text) for text in batch]
        return "tiktoken", encoder.encode_ordinary_batch
    return "tokenizers", slow


def encode_documents(
    encode: Callable[[list[str]], list[list[int]]],
    docs: list[str],
    dtype: type[np.integer],
    batch_docs: int = 512,
) -> Iterator[np.ndarray]:
    """Token ids of each document with EOD appended, ``batch_docs`` documents per call."""
    for start in range(0, len(docs), batch_docs):
        for token_ids in encode(docs[start : start + batch_docs]):
            ids = np.empty(len(token_ids) + 1, dtype=dtype)
            ids[:-1] = token_ids
            ids[-1] = EOD_ID
            yield ids
