"""Benchmark: how long planning takes, in process and through Snakemake (prints figures).

Celerity at full breadth on slurm_h100 (three TPP bands, three seeds for every size and a
20-point tau sweep at 1.8B) and the default tiny, each planned from an empty results/:

- in process: compose + validate, plan, write the plan (`collapse plan` without its imports);
- `snakemake -n`: the whole DAG, nothing run;
- `snakemake --cores all plan`: the specs and the plan's tables, written by the workflow;
- Celerity again over a 1 TiB blend of Megatron datasets (64 prefixes; sparse files, so the
  benchmark needs no disk): the plan counts tokens from each .idx header and .bin size only;
- Snakefile parse time of every shipped family (`snakemake --list-rules`), beside Snakemake's
  own start-up (`snakemake --version`), since every call and every Slurm job's own Snakemake
  parses the workflow again.

Targets: the written plan under 10 s for Celerity and 5 s for tiny, parse under 2 s. Nothing is
asserted here; the figures are for the README's planning table.

    python benchmarks/bench_plan.py               # everything
    python benchmarks/bench_plan.py --only blend  # one part: families, blend or parse
"""

from __future__ import annotations

import argparse
import re
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from collapse.config import config_options, load_config
from collapse.plan import plan_family, write_plan

ROOT = Path(__file__).resolve().parents[1]
TAUS = [round(0.02 * 1.15**i, 4) for i in range(20)]
CELERITY_FULL = [
    "family=celerity",
    "cluster=slurm_h100",
    "family.seeds=[0,1,2]",
    "family.reference.seeds=[0,1,2]",
    "+family.sweeps=[{name: tau, size: 1.8B, tpp: 80, grid: {tau: ["
    + ",".join(map(str, TAUS))
    + "]}}]",
]
# The warning Celerity's plan prints (its corpus repeats): once per call, not once per job.
WARNING = "warning: the corpus is seen more than once"


BLEND_BYTES = 1 << 40  # 1 TiB of int32 tokens, the scale of a real pretraining blend
BLEND_PARTS = 64
SEQUENCE_TOKENS = 1 << 30


def sparse_blend(folder: Path, total_bytes: int = BLEND_BYTES, parts: int = BLEND_PARTS) -> list:
    """A blend of ``parts`` Megatron prefixes holding ``total_bytes`` of int32 tokens in all: a
    valid .idx (header, lengths, pointers, document index) beside a sparse .bin of that size."""
    folder.mkdir(parents=True, exist_ok=True)
    tokens = total_bytes // 4 // parts
    lengths = [SEQUENCE_TOKENS] * (tokens // SEQUENCE_TOKENS)
    if tokens % SEQUENCE_TOKENS:
        lengths.append(tokens % SEQUENCE_TOKENS)
    pointers = [4 * sum(lengths[:i]) for i in range(len(lengths))]
    n = len(lengths)
    index = struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 4, n, n + 1)  # dtype 4: int32
    index += struct.pack(f"<{n}i", *lengths) + struct.pack(f"<{n}q", *pointers)
    index += struct.pack(f"<{n + 1}q", *range(n + 1))  # one document per sequence
    blend = []
    for part in range(parts):
        prefix = folder / f"part{part:03d}_text_document"
        Path(f"{prefix}.idx").write_bytes(index)
        with open(f"{prefix}.bin", "wb") as handle:
            handle.truncate(4 * tokens)
        blend.append(f"{{prefix:{prefix},weight:1.0}}")
    return blend


def snakemake(*args: str, results: Path, overrides: list[str]) -> tuple[float, str]:
    """Run Snakemake on this workflow; its wall time and what it printed."""
    family, cluster, *rest = overrides
    config = [family, cluster, f"results={results}"]
    if rest:
        config.append("overrides=" + " ".join(o.replace(" ", "") for o in rest))
    cmd = [
        sys.executable, "-m", "snakemake", *args, "--directory", str(ROOT),
        "--snakefile", str(ROOT / "Snakefile"), "--config", *config,
    ]  # fmt: skip
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if out.returncode:
        sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")
    return wall, out.stdout + out.stderr


def in_process(overrides: list[str], results: Path) -> dict[str, float]:
    t0 = time.perf_counter()
    cfg = load_config([*overrides, f"results={results}"])
    t1 = time.perf_counter()
    plan = plan_family(cfg)
    t2 = time.perf_counter()
    write_plan(plan)
    t3 = time.perf_counter()
    return {"runs": len(plan.runs), "compose": t1 - t0, "plan": t2 - t1, "write": t3 - t2}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["families", "blend", "parse"], help="one part only")
    only = parser.parse_args().only
    if only in (None, "families"):
        plan_families()
    if only in (None, "blend"):
        plan_blend()
    if only in (None, "parse"):
        parse_times()
    return 0


def plan_families() -> None:
    rows = []
    for name, overrides in [
        ("celerity, slurm_h100, 3 bands x 3 seeds + 20-point sweep", CELERITY_FULL),
        ("tiny, local", ["family=tiny", "cluster=local"]),
    ]:
        with tempfile.TemporaryDirectory() as tmp:
            fig = in_process(overrides, Path(tmp) / "in-process")
            dry, dry_out = snakemake("-n", results=Path(tmp) / "dry", overrides=overrides)
            jobs = re.search(r"^total\s+(\d+)", dry_out, re.M)
            planned, plan_out = snakemake(
                "--cores", "all", "plan", results=Path(tmp) / "wf", overrides=overrides
            )
            again, _ = snakemake(
                "--cores", "all", "plan", results=Path(tmp) / "wf", overrides=overrides
            )
            specs = len(list((Path(tmp) / "wf").glob("*/plan/runs/*.json")))
        rows.append((name, fig, jobs.group(1) if jobs else "?", dry, planned, again, specs))
        print(f"\n{name}")
        print(f"  runs planned:                         {fig['runs']}")
        print(f"  jobs in the dry run:                  {rows[-1][2]}")
        print(f"  in process: compose + validate        {fig['compose']:6.2f} s")
        print(f"  in process: plan (pure)               {fig['plan']:6.2f} s")
        print(f"  in process: write plan                {fig['write']:6.2f} s")
        print(f"  snakemake -n                          {dry:6.2f} s")
        print(f"  snakemake --cores all plan (empty)    {planned:6.2f} s  ({specs} spec files)")
        print(f"  the same call again (nothing to do)   {again:6.2f} s")
        print(f"  '{WARNING}' lines in that call: {plan_out.count(WARNING)}")


def plan_blend() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        blend = sparse_blend(Path(tmp) / "blend")
        overrides = [*CELERITY_FULL, f"family.data.train=[{','.join(blend)}]"]
        t0 = time.perf_counter()
        tokens = plan_family(load_config([*overrides, f"results={tmp}/p"])).table.tokens.sum()
        planned = time.perf_counter() - t0
        dry, dry_out = snakemake("-n", results=Path(tmp) / "dry", overrides=overrides)
        placeholder, _ = snakemake("-n", results=Path(tmp) / "ph", overrides=CELERITY_FULL)
    epochs = re.search(r"seen more than once[^\n]*", dry_out)
    print(f"\ncelerity over a {BLEND_BYTES / 2**40:g} TiB blend ({BLEND_PARTS} prefixes)")
    print(
        f"  in process: compose + plan            {planned:6.2f} s  ({tokens:.3g} tokens trained)"
    )
    print(f"  snakemake -n                          {dry:6.2f} s")
    ratio = dry / placeholder
    print(f"  snakemake -n, placeholder blend       {placeholder:6.2f} s  (ratio {ratio:.2f})")
    print(f"  repeated-data warning: {epochs.group(0) if epochs else 'none (one pass or less)'}")


def parse_times() -> None:
    print("\nSnakefile parse time (snakemake --list-rules), every shipped family")
    with tempfile.TemporaryDirectory() as tmp:
        start, _ = snakemake("--version", results=Path(tmp), overrides=["x=1", "y=1"])
        print(f"  Snakemake's own start-up (--version)  {start:6.2f} s")
        for family in config_options(ROOT / "config", "family"):
            parse, _ = snakemake(
                "--list-rules",
                results=Path(tmp),
                overrides=[f"family={family}", "cluster=local"],
            )
            print(f"  {family:<28}          {parse:6.2f} s")


if __name__ == "__main__":
    sys.exit(main())
