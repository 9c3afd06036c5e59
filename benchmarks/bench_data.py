"""Memory and speed of the data stage's raw-shards path on synthetic text.

For each input size it writes JSON-lines files of synthetic words, runs the stage's steps as the
workflow does (one process per step: tokenizer, each shard, merge) and prints the peak RSS of the
largest step, and the pipeline's bytes/s per core (input bytes over the CPU seconds of the
shard steps) against the tokenizer's own ``encode_batch`` on the same text, one thread.

    python benchmarks/bench_data.py                         # 0.2, 1 and 4 GB (long)
    python benchmarks/bench_data.py --sizes-gb 0.02 0.1 0.4 --shard-mb 32
    python benchmarks/bench_data.py --sizes-gb 0.2 --shard-mb 25 --jobs 1 2   # scaling

With --read-rates, the first size's first file is compressed with gzip and zstd and read through
to its end as a piece of a cut compressed file reads up to its start (``shards._skip_to``):
MB/s of text, against the pipeline's MB/s per core.

With --jobs, the shard steps of the first size run again, N at a time as parallel workflow
jobs would, and the wall-clock MB/s of each N is printed with its speedup over the first.

Targets: peak RSS at the largest size within 1.2x of the smallest; pipeline >= 0.8x the encoder.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = [
    "the", "a", "of", "river", "stone", "light", "keeper", "ship", "night", "delta", "silt",
    "wheat", "autumn", "summer", "over", "under", "house", "counted", "every", "carried",
    "settles", "into", "new", "land", "winter", "sown", "harvested", "early", "and", "where",
]  # fmt: skip
FILE_BYTES = 64_000_000


def write_inputs(folder: Path, total_bytes: int, seed: int = 0) -> int:
    """JSON-lines files of about FILE_BYTES each, documents of 50-800 words; returns bytes."""
    done = folder / "written_bytes"
    if done.is_file():  # made by an earlier run into the same --work folder
        return int(done.read_text())
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    written, index = 0, 0
    while written < total_bytes:
        lines, size = [], 0
        while size < min(FILE_BYTES, total_bytes - written):
            text = " ".join(rng.choices(WORDS, k=rng.randint(50, 800))) + "."
            line = json.dumps({"text": text}) + "\n"
            lines.append(line)
            size += len(line)
        (folder / f"part-{index:04d}.jsonl").write_text("".join(lines))
        written += size
        index += 1
    done.write_text(str(written))
    return written


def run_step(config: Path, out: Path, step: str, shard: int | None = None) -> tuple[int, float]:
    """(peak RSS in bytes, CPU seconds) of one step run as its own process."""
    cmd = [sys.executable, "-m", "collapse.data", "--config", str(config), "--out", str(out)]
    cmd += ["--step", step] + ([] if shard is None else ["--shard", str(shard)])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    stderr = proc.stderr.read().decode()
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{step} {shard}: {stderr[-2000:]}")
    return usage.ru_maxrss * 1024, usage.ru_utime + usage.ru_stime


def encoder_baseline(tokenizer_path: Path, files: list[Path], limit_bytes: int) -> float:
    """Bytes/s of the tokenizer's own encode_batch, one thread, CPU time."""
    os.environ["RAYON_NUM_THREADS"] = "1"
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    texts, size = [], 0
    for path in files:
        for line in path.open():
            texts.append(json.loads(line)["text"])
            size += len(texts[-1].encode())
            if size >= limit_bytes:
                break
        if size >= limit_bytes:
            break
    start = resource.getrusage(resource.RUSAGE_SELF)
    for i in range(0, len(texts), 256):
        tokenizer.encode_batch(texts[i : i + 256], add_special_tokens=False)
    end = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (end.ru_utime - start.ru_utime) + (end.ru_stime - start.ru_stime)
    return size / cpu


def bench(size_gb: float, work: Path, shard_mb: int, vocab: int) -> dict:
    from collapse import shards
    from collapse.data import load_data_config

    inputs = work / f"in-{size_gb:g}"
    total = write_inputs(inputs, int(size_gb * 1e9))
    config = work / f"data-{size_gb:g}.json"
    config.write_text(
        json.dumps(
            {
                "kind": "shards",
                "files": [f"{inputs}/*.jsonl"],
                "vocab_size": vocab,
                "shard_bytes": shard_mb * 1_000_000,
                "tokenizer_sample_bytes": 20_000_000,
            }
        )
    )
    out = work / f"out-{size_gb:g}"
    wall = time.perf_counter()
    rss, cpu = {}, 0.0
    rss["tokenizer"], _ = run_step(config, out, "tokenizer")
    count = len(shards.plan_shards(load_data_config(config)))
    shard_rss = 0
    for index in range(count):
        peak, seconds = run_step(config, out, "shard", index)
        shard_rss, cpu = max(shard_rss, peak), cpu + seconds
    rss["shard"] = shard_rss
    rss["merge"], _ = run_step(config, out, "merge")
    meta = json.loads((out / "meta.json").read_text())
    return {
        "size_gb": round(total / 1e9, 3),
        "shards": count,
        "peak_rss_mb": round(max(rss.values()) / 1e6, 1),
        "rss_mb_by_step": {k: round(v / 1e6, 1) for k, v in rss.items()},
        "pipeline_mb_per_core_s": round(total / cpu / 1e6, 2),
        "encoder": meta["encoder"],
        "tokens": meta["train"]["tokens"] + meta["valid"]["tokens"],
        "wall_s": round(time.perf_counter() - wall, 1),
        "tokenizer": str(out / "tokenizer.json"),
        "files": sorted(inputs.glob("*.jsonl")),
    }


def shard_scaling(config: Path, out: Path, total: int, jobs: list[int]) -> list[tuple]:
    """(jobs, wall MB/s, speedup) of the shard steps run ``jobs`` at a time, from scratch."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    from collapse import shards
    from collapse.data import load_data_config

    count = len(shards.plan_shards(load_data_config(config)))
    rows = []
    for n in jobs:
        shutil.rmtree(out / shards.SHARDS_DIR, ignore_errors=True)
        (out / "meta.json").unlink(missing_ok=True)
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=n) as pool:
            list(pool.map(lambda i: run_step(config, out, "shard", i), range(count)))
        rate = total / (time.perf_counter() - start) / 1e6
        rows.append((n, round(rate, 2), round(rate / rows[0][1], 2) if rows else 1.0))
    return rows


def compressed_read_rates(files: list[Path], work: Path) -> dict[str, float]:
    """MB/s of text at which a piece of a cut .jsonl.gz / .jsonl.zst skips to its start."""
    import gzip

    import zstandard

    from collapse import shards

    text = files[0].read_bytes()
    rates = {}
    for name, compress in (
        ("gzip", lambda b: gzip.compress(b, 6)),
        ("zstd", lambda b: zstandard.ZstdCompressor(level=3).compress(b)),
    ):
        path = work / f"read-rate.jsonl.{'gz' if name == 'gzip' else 'zst'}"
        path.write_bytes(compress(text))
        piece = shards.Piece(str(path), len(text) + 1, -1, "text")  # past the end: reads it all
        with shards._open_binary(path) as handle:
            start = time.perf_counter()
            shards._skip_to(handle, piece)
            rates[name] = len(text) / (time.perf_counter() - start) / 1e6
        path.unlink()
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-gb", type=float, nargs="+", default=[0.2, 1.0, 4.0])
    parser.add_argument("--shard-mb", type=int, default=256)  # the stage's default
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--work", type=Path, help="scratch folder (default: a temporary one)")
    parser.add_argument("--jobs", type=int, nargs="+", help="shard jobs at a time, to compare")
    parser.add_argument(
        "--read-rates", action="store_true", help="reading through compressed streams, MB/s"
    )
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="bench_data-"))
    results = [bench(size, work, args.shard_mb, args.vocab) for size in args.sizes_gb]
    first = results[0]
    baseline = encoder_baseline(Path(first["tokenizer"]), first["files"], 50_000_000)
    print(f"{'input GB':>9} {'shards':>6} {'peak RSS MB':>11} {'by step (MB)':<44} "
          f"{'MB/s/core':>9} {'vs encode_batch':>15}")  # fmt: skip
    for r in results:
        ratio = r["pipeline_mb_per_core_s"] * 1e6 / baseline
        steps = ", ".join(f"{k} {v:g}" for k, v in r["rss_mb_by_step"].items())
        print(
            f"{r['size_gb']:>9g} {r['shards']:>6} {r['peak_rss_mb']:>11g} {steps:<44} "
            f"{r['pipeline_mb_per_core_s']:>9g} {ratio:>14.2f}x"
        )
    growth = results[-1]["peak_rss_mb"] / results[0]["peak_rss_mb"]
    print(
        f"tokenizer encode_batch (1 thread): {baseline / 1e6:.2f} MB/s/core; pipeline encoder: "
        f"{results[0]['encoder']}; peak RSS growth {growth:.2f}x (target <= 1.2x)"
    )
    if args.read_rates:
        rates = compressed_read_rates(first["files"], work)
        print(
            f"reading through a compressed stream ({first['files'][0].stat().st_size / 1e6:.0f} MB "
            f"of text): gzip {rates['gzip']:.0f} MB/s, zstd {rates['zstd']:.0f} MB/s"
        )
    if args.jobs:
        size = args.sizes_gb[0]
        config, out = work / f"data-{size:g}.json", work / f"out-{size:g}"
        total = int(first["size_gb"] * 1e9)
        print(f"shard steps of {first['size_gb']:g} GB in {first['shards']} shards, "
              f"{os.cpu_count()} cores:")  # fmt: skip
        for n, rate, speedup in shard_scaling(config, out, total, args.jobs):
            print(f"  {n} job(s) at a time: {rate:g} MB/s wall, {speedup:.2f}x")


if __name__ == "__main__":
    main()
