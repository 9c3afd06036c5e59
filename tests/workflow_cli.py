"""Snakemake as the end-to-end tests run it: this repository's workflow, in a scratch directory,
so that a test's results/ never touch the checkout's."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def snakemake_cmd(workdir: Path, *args: str, cores: int = 2) -> list[str]:
    """``python -m snakemake`` on the repo's Snakefile in ``workdir``; ``args`` follow (targets
    before any ``--config``, which takes every value after it up to the next option)."""
    return [
        sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"),
        "--directory", str(workdir), "--cores", str(cores), *args,
    ]  # fmt: skip


def run_snakemake(workdir: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """Run it to the end; a failure shows the tail of Snakemake's output."""
    out = subprocess.run(
        snakemake_cmd(workdir, *args), capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out
