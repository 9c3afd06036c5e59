"""Byte-level BPE tokenizer (Hugging Face ``tokenizers``) with ``<|endoftext|>`` fixed at id 0.

The training job relies on EOD id 0 (documents end with it in the indexed dataset), so the special
token is the first entry of the trainer's vocabulary and ``load_tokenizer`` refuses any file where
it is not. Byte-level means every UTF-8 string encodes and decodes back exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
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


def encode_documents(
    tokenizer: Tokenizer, docs: list[str], dtype: type[np.integer], batch_docs: int = 512
) -> Iterator[np.ndarray]:
    """Token ids of each document with EOD appended; ``encode_batch`` uses all cores.

    A literal "<|endoftext|>" inside a document is encoded as text, never as the EOD id.
    """
    tokenizer.encode_special_tokens = True
    for start in range(0, len(docs), batch_docs):
        for encoding in tokenizer.encode_batch(docs[start : start + batch_docs]):
            ids = np.empty(len(encoding.ids) + 1, dtype=dtype)
            ids[:-1] = encoding.ids
            ids[-1] = EOD_ID
            yield ids
