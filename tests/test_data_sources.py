"""The data stage's three kinds of source: raw shards tokenized in jobs, a Megatron blend used in
place, the package corpus (tests/test_data.py). Real files, a tokenizer trained here, Megatron's
own builder and reader; every bad input fails naming its file."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from collapse import shards
from collapse.config import load_config
from collapse.data import (
    META_NAME,
    TRAIN_PREFIX_NAME,
    VALID_PREFIX_NAME,
    DatasetError,
    MegatronDataConfig,
    ShardsDataConfig,
    build_blend,
    estimate_corpus_tokens,
    load_data_config,
    stage_outputs,
    training_blend,
    verify_training_data,
)
from collapse.indexed import IndexedDatasetError, check_prefix, read_header
from collapse.tokenizer import train_tokenizer

WORDS = [
    "the",
    "a",
    "river",
    "stone",
    "light",
    "keeper",
    "ship",
    "night",
    "delta",
    "silt",
    "wheat",
    "autumn",
    "summer",
    "over",
    "under",
    "house",
    "café",
    "naïve",
    "żółw",
]


def _doc(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 120))) + "."


def _write_inputs(root: Path, seed: int = 0) -> list[str]:
    """Five files of four formats; returns every document in file order."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    docs = {name: [_doc(rng) for _ in range(n)] for name, n in (("a", 300), ("b", 60), ("c", 60))}
    docs["d"] = [_doc(rng) for _ in range(60)]
    docs["e"] = [_doc(rng)]

    def lines(items):
        return "".join(json.dumps({"text": t}) + "\n" for t in items)

    (root / "a.jsonl").write_text(lines(docs["a"]))
    with gzip.open(root / "b.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.write(lines(docs["b"]))
    (root / "c.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(lines(docs["c"]).encode())
    )
    pq.write_table(pa.table({"text": docs["d"]}), root / "d.parquet", row_group_size=10)
    (root / "e.txt").write_text(docs["e"][0])
    return [t for name in "abcde" for t in docs[name]]


def _user_tokenizer(path: Path, texts: list[str], vocab: int = 384) -> Path:
    train_tokenizer(texts, vocab).save(str(path))
    return path


def _cfg(root: Path, **extra) -> ShardsDataConfig:
    raw = dict(kind="shards", files=[f"{root}/in/*"], vocab_size=512, valid_fraction=0.1)
    return ShardsDataConfig(**(raw | extra))


def _items(prefix: Path) -> list[np.ndarray]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(prefix))
    return [np.array(dataset[i]) for i in range(len(dataset))]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    docs = _write_inputs(root / "in")
    return root, docs


@pytest.fixture(scope="module")
def built(raw):
    """A user tokenizer and a build cut into many small shards."""
    root, docs = raw
    tokenizer = _user_tokenizer(root / "user_tokenizer.json", docs)
    cfg = _cfg(root, tokenizer=str(tokenizer), vocab_size=384, shard_bytes=20_000)
    meta = shards.run_step(cfg, root / "out", "all")
    return cfg, root / "out", meta, docs


def test_shards_build_every_document_once_with_the_users_tokenizer(built):
    from tokenizers import Tokenizer

    cfg, out, meta, docs = built
    assert meta.shards >= 5 and meta.documents_read == len(docs)
    assert meta.train.documents + meta.valid.documents == len(docs)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    decoded = []
    for name in (TRAIN_PREFIX_NAME, VALID_PREFIX_NAME):
        for ids in _items(out / name):
            assert ids[-1] == meta.eod_id
            decoded.append(tokenizer.decode(ids[:-1].tolist()))
    assert sorted(decoded) == sorted(docs)  # every document exactly once, decodes back exactly
    verify_training_data(str(out / TRAIN_PREFIX_NAME), str(out / VALID_PREFIX_NAME))
    assert estimate_corpus_tokens(cfg, out) == meta.train.tokens  # from meta.json, not the text


def test_split_is_by_document_hash_and_sharding_changes_no_token(built, raw, tmp_path):
    cfg, out, meta, docs = built
    valid = {d for d in docs if shards.is_valid_document(d.encode(), cfg.seed, 0.1)}
    assert meta.valid.documents == len(valid) and 0 < len(valid) < len(docs) // 4
    one = cfg.model_copy(update={"shard_bytes": 10**9})
    assert len(shards.plan_shards(one)) == 1
    shards.run_step(one, tmp_path / "one", "all")
    for name in (TRAIN_PREFIX_NAME, VALID_PREFIX_NAME):
        for ext in (".bin", ".idx"):
            assert _sha(tmp_path / "one" / f"{name}{ext}") == _sha(out / f"{name}{ext}")


def test_a_large_jsonl_is_cut_at_line_boundaries(built):
    cfg, *_ = built
    pieces = [p for shard in shards.plan_shards(cfg) for p in shard if p.path.endswith("a.jsonl")]
    assert len(pieces) > 2 and all(p.end - p.start <= cfg.shard_bytes for p in pieces)
    texts = [t for p in pieces for t, _ in shards.read_documents([p], cfg)]
    whole = [t for t, _ in shards.read_documents([shards.Piece(pieces[0].path)], cfg)]
    assert texts == whole


def test_compressed_jsonl_and_parquet_are_cut_and_change_no_token(built, tmp_path):
    """Small shards cut .jsonl.gz and .jsonl.zst by estimated text bytes (each piece reads the
    stream up to its end) and Parquet by row groups (d.parquet: 6 groups of 10 rows); every
    document is read once, named by its real line or row, and the dataset's bytes are those
    of the coarser build."""
    cfg, out, *_ = built
    small = cfg.model_copy(update={"shard_bytes": 4_000})
    pieces = [p for shard in shards.plan_shards(small) for p in shard]
    for name, unit in (
        ("b.jsonl.gz", "text"),
        ("c.jsonl.zst", "text"),
        ("d.parquet", "row_groups"),
    ):
        cut = [p for p in pieces if p.path.endswith(name)]
        assert len(cut) > 2 and {p.unit for p in cut} == {unit}, cut
        assert [p.start for p in cut[1:]] == [p.end for p in cut[:-1]]
        assert cut[-1].end == (-1 if unit == "text" else 6)  # a text size is estimated
        read = [d for p in cut for d in shards.read_documents([p], small)]
        whole = list(shards.read_documents([shards.Piece(cut[0].path)], small))
        assert read == whole  # the same texts and the same line/row names, once each
    parquet = [p for p in pieces if p.path.endswith("d.parquet")]
    assert [(p.start, p.end) for p in parquet][:2] == [(0, 1), (1, 2)]  # a group is > 4,000 B
    assert read[-1][1].endswith("(row 60)") and whole[0][1].endswith("(row 1)")
    gz_lines = [w for p in pieces if p.path.endswith("b.jsonl.gz")
                for _, w in shards.read_documents([p], small)]  # fmt: skip
    assert gz_lines == [f"{cfg.files[0][:-1]}b.jsonl.gz:{i}" for i in range(1, 61)]
    # the build at 10,000 bytes (still cutting all three files), to keep the test short
    coarser = cfg.model_copy(update={"shard_bytes": 10_000})
    assert all(
        len([p for s in shards.plan_shards(coarser) for p in s if p.path.endswith(name)]) > 1
        for name in ("b.jsonl.gz", "c.jsonl.zst", "d.parquet")
    )
    meta = shards.run_step(coarser, tmp_path / "small", "all")
    assert meta.shards > len(shards.plan_shards(cfg))
    for name in (TRAIN_PREFIX_NAME, VALID_PREFIX_NAME):
        for ext in (".bin", ".idx"):
            assert _sha(tmp_path / "small" / f"{name}{ext}") == _sha(out / f"{name}{ext}")


def test_a_compressed_piece_past_the_end_of_its_stream_is_empty(built):
    """The text size of a compressed file is estimated (3x for gzip): a piece that starts past
    the real end reads nothing, and the open last piece reads whatever lies beyond."""
    cfg, *_ = built
    path = next(p for p in shards.input_files(cfg) if p.name == "b.jsonl.gz")
    text = gzip.decompress(path.read_bytes())
    past = shards.Piece(str(path), len(text) + 10, -1, "text")
    assert list(shards.read_documents([past], cfg)) == []
    middle = text.index(b"\n", len(text) // 2) + 1  # a line starts here
    tail = list(shards.read_documents([shards.Piece(str(path), middle, -1, "text")], cfg))
    assert [t for t, _ in tail] == [json.loads(x)["text"] for x in text[middle:].splitlines()]


def test_a_rerun_redoes_only_missing_shards(built, tmp_path):
    import shutil

    cfg, out, *_ = built
    work = tmp_path / "work"
    shutil.copytree(out, work)
    (work / META_NAME).unlink()
    shards.shard_files(work, 2)["json"].unlink()  # as if its job had been killed
    before = {i: shards.shard_files(work, i)["json"].stat().st_mtime_ns for i in (0, 1, 3)}
    shards.run_step(cfg, work, "all")
    after = {i: shards.shard_files(work, i)["json"].stat().st_mtime_ns for i in (0, 1, 3)}
    assert before == after and shards.shard_files(work, 2)["json"].is_file()
    assert _sha(work / f"{TRAIN_PREFIX_NAME}.bin") == _sha(out / f"{TRAIN_PREFIX_NAME}.bin")


def test_an_input_that_disappears_mid_run_fails_naming_it(built, tmp_path):
    """A file gone after the build started: a job reading it names it, and every later step
    (a shard job, the merge) stops on the plan the build started from, naming the file, so
    no shard changes meaning and nothing complete-looking is left."""
    import shutil

    cfg, out, *_ = built
    inputs = tmp_path / "in"
    shutil.copytree(Path(cfg.files[0]).parent, inputs)
    moved = cfg.model_copy(update={"files": [f"{inputs}/*"]})
    work = tmp_path / "work"
    shards.run_step(moved, work, "tokenizer")
    planned = shards.plan_shards(moved)
    index = next(i for i, s in enumerate(planned) if s[0].path.endswith("b.jsonl.gz"))
    shards.run_step(moved, work, "shard", 0)
    (inputs / "b.jsonl.gz").unlink()
    with pytest.raises(shards.ShardError, match="b.jsonl.gz: cannot be read"):
        list(shards.read_documents(planned[index], moved))
    for step, shard in (("shard", index), ("shard", 1), ("merge", None)):
        with pytest.raises(shards.ShardError, match=r"changed since .*b\.jsonl\.gz: gone"):
            shards.run_step(moved, work, step, shard)
    assert not (work / META_NAME).exists()
    assert not shards.shard_files(work, index)["json"].exists()
    (inputs / "a.jsonl").write_text("")  # restored b, but a changed size: named too
    shutil.copy(Path(cfg.files[0]).parent / "b.jsonl.gz", inputs / "b.jsonl.gz")
    with pytest.raises(shards.ShardError, match=r"a\.jsonl: [0-9,]+ bytes then, 0 now"):
        shards.run_step(moved, work, "merge")


def test_the_familys_own_bpe_is_trained_on_a_sample(raw, tmp_path):
    root, docs = raw
    cfg = _cfg(root, tokenizer_sample_bytes=5_000)
    meta = shards.run_step(cfg, tmp_path / "out", "all")
    assert meta.eod_id == 0 and meta.encoder == "tiktoken"
    assert meta.train.documents + meta.valid.documents == len(docs)


def test_blend_is_checked_in_place_and_reaches_training(built, tmp_path):
    _, out, meta, _ = built
    train, valid = str(out / TRAIN_PREFIX_NAME), str(out / VALID_PREFIX_NAME)
    cfg = MegatronDataConfig(
        kind="megatron",
        train=[{"prefix": train, "weight": 3}, {"prefix": valid, "weight": 1}],
        valid=[{"prefix": valid}],
        vocab_size=384,
    )
    data = tmp_path / "data"
    summary = build_blend(cfg, data)
    assert summary.train["tokens"] == meta.train.tokens + meta.valid.tokens
    assert not (data / f"{TRAIN_PREFIX_NAME}.bin").exists()  # nothing copied
    blend = training_blend(str(data / TRAIN_PREFIX_NAME), str(data / VALID_PREFIX_NAME))
    assert blend[0] == ([str(Path(train).resolve()), str(Path(valid).resolve())], [3.0, 1.0])
    assert blend[1] == ([str(Path(valid).resolve())], None)
    verify_training_data(str(data / TRAIN_PREFIX_NAME), str(data / VALID_PREFIX_NAME))
    # The plan's count: tokens before any part repeats, from the headers alone.
    expected = int(min(meta.train.tokens / 0.75, meta.valid.tokens / 0.25))
    assert estimate_corpus_tokens(cfg) == expected
    outputs = stage_outputs(cfg, data)
    assert outputs == {"outputs": [str(data / META_NAME)], "train_inputs": [str(data / META_NAME)]}


BLEND_GPT_SCRIPT = """
import os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
import torch
torch.distributed.init_process_group("gloo")
from collapse.runspec import RunSpec
from collapse import train
spec = RunSpec.load(sys.argv[1])
train_set, valid_set = train.build_datasets(spec)
print("OK", type(train_set).__name__, len(train_set), train.train_tokens_in_dataset(train_set))
"""


def test_megatron_builds_the_blended_dataset_for_a_run(built, tmp_path):
    from collapse.plan import plan_family

    _, out, meta, _ = built
    train, valid = str(out / TRAIN_PREFIX_NAME), str(out / VALID_PREFIX_NAME)
    data_cfg = load_data_config(_yaml(tmp_path, train, valid))
    data = tmp_path / "results" / "tiny" / "data"
    build_blend(data_cfg, data)
    cfg = load_config(["family=tiny", f"results={tmp_path / 'results'}"])
    cfg = cfg.model_copy(update={"family": cfg.family.model_copy(update={"data": data_cfg})})
    plan = plan_family(cfg)
    spec = plan.runs[0].model_copy(update={"checkpoint_dir": str(tmp_path / "ckpt")})
    spec = spec.model_copy(
        update={"optim": spec.optim.model_copy(update={"steps": 4, "batch_seqs": 2})}
    )
    (tmp_path / "spec.json").write_text(spec.to_json())
    script = tmp_path / "blend_gpt.py"
    script.write_text(BLEND_GPT_SCRIPT)
    port = str(31000 + random.Random().randrange(2000))
    result = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "spec.json"), port],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ok, kind, _, tokens = result.stdout.split()[-4:]
    assert ok == "OK" and kind == "BlendedDataset"
    assert int(tokens) == meta.train.tokens + meta.valid.tokens


def _yaml(tmp_path: Path, train: str, valid: str) -> Path:
    path = tmp_path / "blend.yaml"
    path.write_text(
        "kind: megatron\n"
        f"train:\n  - {{prefix: {train}, weight: 0.7}}\n  - {{prefix: {valid}, weight: 0.3}}\n"
        f"valid:\n  - {{prefix: {valid}}}\n"
        "vocab_size: 384\n"
    )
    return path


# ------------------------------------------------------------------------------ bad input
def _copy_prefix(src: Path, dst: Path) -> Path:
    for ext in (".bin", ".idx"):
        Path(f"{dst}{ext}").write_bytes(Path(f"{src}{ext}").read_bytes())
    return dst


def _truncate(path: Path, by: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-by])


PREFIX_CASES = [
    ("missing .idx", lambda p: Path(f"{p}.idx").unlink(), ".idx", "file missing"),
    ("missing .bin", lambda p: Path(f"{p}.bin").unlink(), ".bin", "file missing"),
    ("truncated .idx", lambda p: _truncate(Path(f"{p}.idx"), 7), ".idx", "truncated"),
    ("truncated .bin", lambda p: _truncate(Path(f"{p}.bin"), 2), ".bin", "truncated"),
    ("odd .bin", lambda p: _truncate(Path(f"{p}.bin"), 1), ".bin", "whole number"),
    (
        "bad magic",
        lambda p: Path(f"{p}.idx").write_bytes(b"XXXX" + Path(f"{p}.idx").read_bytes()[4:]),
        ".idx",
        "bad header",
    ),
]


@pytest.mark.parametrize(
    "case,damage,suffix,problem", PREFIX_CASES, ids=[c[0] for c in PREFIX_CASES]
)
def test_damaged_prefixes_fail_naming_the_file(built, tmp_path, case, damage, suffix, problem):
    _, out, *_ = built
    prefix = _copy_prefix(out / VALID_PREFIX_NAME, tmp_path / "part")
    damage(prefix)
    with pytest.raises(IndexedDatasetError, match=problem) as info:
        check_prefix(prefix, 384)
    assert f"{prefix}{suffix}" in str(info.value)
    cfg = MegatronDataConfig(
        kind="megatron",
        train=[{"prefix": str(prefix)}],
        valid=[{"prefix": str(prefix)}],
        vocab_size=384,
    )
    with pytest.raises(DatasetError, match=problem):
        build_blend(cfg, tmp_path / "data")
    assert not (tmp_path / "data" / META_NAME).exists()


def test_a_token_id_beyond_the_vocabulary_fails_naming_the_bin(built, tmp_path):
    _, out, meta, _ = built
    prefix = _copy_prefix(out / VALID_PREFIX_NAME, tmp_path / "part")
    largest = check_prefix(prefix, 384)[1]
    with pytest.raises(IndexedDatasetError, match=f"token id {largest} >= .* 300") as info:
        check_prefix(prefix, 300)
    assert f"{prefix}.bin" in str(info.value)
    assert read_header(prefix).tokens == meta.valid.tokens  # counts need no scan


@pytest.mark.parametrize(
    "weights,problem",
    [([-1.0, 2.0], "must be >= 0"), ([0.0, 0.0], "sum to zero"), ([float("nan"), 1.0], ">= 0")],
)
def test_bad_blend_weights_fail_at_validation(weights, problem):
    entries = [{"prefix": f"/data/p{i}", "weight": w} for i, w in enumerate(weights)]
    with pytest.raises(ValidationError, match=problem):
        MegatronDataConfig(kind="megatron", train=entries, valid=entries[:1])


def _bad_inputs(root: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, what the error says)."""
    good = json.dumps({"text": "fine words here"}) + "\n"
    cases = {
        "empty document": ("e.jsonl", (good + json.dumps({"text": "  "}) + "\n").encode(), "empty"),
        "not utf-8": ("u.jsonl", good.encode() + b'{"text": "caf\xe9"}\n', "not UTF-8"),
        "not json": ("j.jsonl", (good + "{oops\n").encode(), "not a JSON object"),
        "missing field": ("f.jsonl", (good + '{"body": "x"}\n').encode(), "field 'text'"),
        "truncated gzip": ("t.jsonl.gz", gzip.compress(good.encode() * 50)[:-12], "cannot be read"),
        "unknown format": ("x.csv", b"a,b\n", "cannot tell its format"),
        "text not utf-8": ("n.txt", b"abc \xff\xfe", "not UTF-8"),
    }
    out = {}
    for name, (file, data, problem) in cases.items():
        folder = root / name.replace(" ", "_")
        folder.mkdir(parents=True)
        (folder / file).write_bytes(data)
        out[name] = (folder / file, problem)
    return out


BAD_INPUTS = [
    "empty document",
    "not utf-8",
    "not json",
    "missing field",
    "truncated gzip",
    "unknown format",
    "text not utf-8",
]


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_raw_input_fails_naming_the_file_and_leaves_no_shard(built, tmp_path, case):
    cfg, out, *_ = built
    path, problem = _bad_inputs(tmp_path)[case]
    bad = cfg.model_copy(update={"files": [str(path)]})
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tokenizer.json").write_bytes((out / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match=problem) as info:
        shards.run_step(bad, tmp_path / "out", "shard", 0) if case != "unknown format" else (
            shards.plan_shards(bad)
        )
    assert str(path) in str(info.value)
    leftovers = list((tmp_path / "out").glob("shards/*")) if (tmp_path / "out").exists() else []
    assert [p.name for p in leftovers if p.name != shards.PLAN_NAME] == []  # the inputs' record


def test_empty_documents_can_be_skipped(built, tmp_path):
    cfg, out, *_ = built
    path, _ = _bad_inputs(tmp_path)["empty document"]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "tokenizer.json").write_bytes((out / "tokenizer.json").read_bytes())
    summary = shards.run_step(
        cfg.model_copy(update={"files": [str(path)], "skip_empty": True}),
        tmp_path / "out",
        "shard",
        0,
    )
    assert summary.empty_skipped == 1 and summary.documents_read == 2


@pytest.mark.parametrize("vocab,problem", [(512, "has 3.. tokens but .* 512"), (256, "too small")])
def test_a_tokenizer_that_does_not_fit_the_model_fails_before_any_shard(
    built, tmp_path, vocab, problem
):
    cfg, *_ = built
    with pytest.raises((ValueError, ValidationError), match=problem) as info:
        bad = (
            cfg.model_copy(update={"vocab_size": vocab})
            if vocab >= 257
            else _cfg(tmp_path, vocab_size=vocab)
        )
        shards.build_tokenizer(bad, tmp_path / "out")
    if vocab >= 257:
        assert cfg.tokenizer in str(info.value)
    assert not (tmp_path / "out" / "shards").exists()


def test_a_tokenizer_without_the_eod_token_fails(built, tmp_path):
    cfg, *_ = built
    bad = cfg.model_copy(update={"eod_token": "</s>"})
    with pytest.raises(ValueError, match="no token '</s>'"):
        shards.build_tokenizer(bad, tmp_path / "out")


def test_unmatched_glob_names_the_field(tmp_path):
    cfg = _cfg(tmp_path)
    with pytest.raises(ValueError, match=r"data.files\[0\]: no file matches"):
        shards.plan_shards(cfg)


def test_the_default_kind_is_the_package_corpus():
    cfg = load_config(["family=tiny"])
    assert cfg.family.data.kind == "corpus"
    assert "kind" not in json.loads(cfg.family.data.model_dump_json(exclude={"kind"}))
    assert stage_outputs(cfg.family.data, Path("d"))["train_inputs"] == [
        f"d/{n}.{e}" for n in (TRAIN_PREFIX_NAME, VALID_PREFIX_NAME) for e in ("bin", "idx")
    ]


@pytest.mark.parametrize("family", ["celerity", "ladder"])
def test_shipped_blend_placeholder_plans_and_stops_the_data_job(family, tmp_path, capsys):
    from collapse import cli
    from collapse.plan import plan_family

    cfg = load_config([f"family={family}", "cluster=slurm_h100"])
    assert cfg.family.data.kind == "megatron"
    [warning] = [w for w in plan_family(cfg).warnings() if "corpus" in w]
    assert "family.data.train[0].prefix is the placeholder" in warning
    config = tmp_path / "data.json"
    config.write_text(cfg.family.data.model_dump_json())
    assert cli.main(["data", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    assert "is the placeholder" in capsys.readouterr().err
    assert not (tmp_path / "out" / META_NAME).exists()


def test_dedup_keeps_the_first_copy_across_shards(raw, built, tmp_path):
    root, docs = raw
    cfg, out, meta, _ = built
    folder = tmp_path / "in"
    folder.mkdir()
    for name in ("a.jsonl", "b.jsonl.gz"):  # the same documents twice, and a.jsonl's in b too
        (folder / name).write_bytes((root / "in" / name).read_bytes())
    (folder / "z.jsonl").write_bytes((root / "in" / "a.jsonl").read_bytes())
    data = tmp_path / "out"
    data.mkdir()
    (data / "tokenizer.json").write_bytes((out / "tokenizer.json").read_bytes())
    both = cfg.model_copy(update={"files": [f"{folder}/*"]})
    kept = shards.run_step(both.model_copy(update={"dedup": True}), data, "all")
    unique = len(set(docs[:360]))
    assert kept.train.documents + kept.valid.documents == unique
    assert kept.duplicates_dropped == 660 - unique
    # Dropping z.jsonl's later copies gives the very tokens of a build without it.
    (folder / "z.jsonl").unlink()
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "tokenizer.json").write_bytes((out / "tokenizer.json").read_bytes())
    shards.run_step(both, tmp_path / "plain", "all")
    for name in (TRAIN_PREFIX_NAME, VALID_PREFIX_NAME):
        for ext in (".bin", ".idx"):
            assert _sha(data / f"{name}{ext}") == _sha(tmp_path / "plain" / f"{name}{ext}")


def test_compact_index_writes_megatrons_exact_bytes(tmp_path):
    """The shard and merge steps keep the index in typed arrays; the files must not change."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 500, rng.integers(1, 50)).astype(np.uint16) for _ in range(300)]
    ours = shards._builder(tmp_path / "a.bin", np.uint16)
    theirs = IndexedDatasetBuilder(str(tmp_path / "b.bin"), dtype=np.uint16)
    for doc in docs:
        for builder in (ours, theirs):
            builder.add_item(torch.from_numpy(doc))
            builder.end_document()
    shards._finalize(ours, tmp_path / "a.idx")
    theirs.finalize(str(tmp_path / "b.idx"))
    merged = shards._builder(tmp_path / "c.bin", np.uint16)
    reference = IndexedDatasetBuilder(str(tmp_path / "d.bin"), dtype=np.uint16)
    for builder in (merged, reference):
        builder.add_index(str(tmp_path / "a"))
        builder.add_index(str(tmp_path / "b"))
    shards._finalize(merged, tmp_path / "c.idx")
    reference.finalize(str(tmp_path / "d.idx"))
    for ext in (".bin", ".idx"):
        assert _sha(tmp_path / f"a{ext}") == _sha(tmp_path / f"b{ext}")
        assert _sha(tmp_path / f"c{ext}") == _sha(tmp_path / f"d{ext}")
