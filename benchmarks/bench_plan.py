"""Benchmark: plan + `snakemake -n` for the Celerity family at full breadth (prints figures).

Three TPP bands, three seeds for every size, and a 20-point tau sweep at 1.8B: hundreds of jobs.
Target (issue 2): under 10 s on a 2-core machine for plan + dry run together.

    python benchmarks/bench_plan.py
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from collapse.config import load_config
from collapse.plan import plan_family, write_plan

ROOT = Path(__file__).resolve().parents[1]
TAUS = [round(0.02 * 1.15**i, 4) for i in range(20)]
OVERRIDES = [
    "family=celerity",
    "cluster=slurm_h100",
    "family.seeds=[0,1,2]",
    "family.reference.seeds=[0,1,2]",
    "+family.sweeps=[{name: tau, size: 1.8B, tpp: 80, grid: {tau: ["
    + ",".join(map(str, TAUS))
    + "]}}]",
]


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results"
        t0 = time.perf_counter()
        cfg = load_config([*OVERRIDES, f"results={results}"])
        t_config = time.perf_counter() - t0
        plan = plan_family(cfg)
        t_plan = time.perf_counter() - t0 - t_config
        write_plan(plan)
        t_write = time.perf_counter() - t0 - t_config - t_plan

        overrides = " ".join(o.replace(" ", "") for o in OVERRIDES[2:])
        cmd = [
            sys.executable, "-m", "snakemake", "-n", "--quiet", "rules", "--cores", "1",
            "--directory", str(ROOT), "--snakefile", str(ROOT / "Snakefile"),
            "--config", "family=celerity", "cluster=slurm_h100", f"results={results}",
            f"overrides={overrides}",
        ]  # fmt: skip
        t1 = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        t_dry = time.perf_counter() - t1
        if out.returncode:
            print(out.stdout, out.stderr, file=sys.stderr)
            return 1
        total = re.search(r"^total\s+(\d+)", out.stdout + out.stderr, re.M)
    jobs = int(total.group(1)) if total else -1
    print(f"runs planned:           {len(plan.runs)}")
    print(f"jobs in the dry run:    {jobs}")
    print(f"compose + validate:     {t_config:6.2f} s")
    print(f"plan (pure):            {t_plan:6.2f} s")
    print(f"write plan:             {t_write:6.2f} s")
    print(f"snakemake -n:           {t_dry:6.2f} s")
    print(f"plan + dry run:         {t_config + t_plan + t_write + t_dry:6.2f} s  (target < 10 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
