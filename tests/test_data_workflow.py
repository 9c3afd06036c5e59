"""The raw-shards path as a user runs it: the README's example, and Snakemake's parallel shard
jobs with a rerun that redoes only an unfinished shard."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from workflow_cli import REPO, run_snakemake

from collapse.data import META_NAME, TRAIN_PREFIX_NAME, VALID_PREFIX_NAME, verify_training_data


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def _workdir(tmp_path: Path) -> Path:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "data").symlink_to(REPO / "tests" / "data")
    return tmp_path


def test_readme_shards_example_runs(tmp_path):
    readme = (REPO / "README.md").read_text()
    block = re.search(r"<!-- shards-example -->\n```bash\n(.*?)```", readme, re.S).group(1)
    work = _workdir(tmp_path)
    result = subprocess.run(
        ["bash", "-e", "-c", block], cwd=work, env=_env(), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    data = work / "results" / "sonnets" / "data"
    verify_training_data(str(data / TRAIN_PREFIX_NAME), str(data / VALID_PREFIX_NAME))
    assert "merged 1 shards" in result.stderr


SHARDS = "~family.data +family.data={kind:shards,files:[tests/data/sonnets.jsonl],vocab_size:512,shard_bytes:30000}"  # noqa: E501


def _jobs(output: str, rule: str) -> int:
    """Jobs of ``rule`` in Snakemake's job-stats table (0 when absent)."""
    match = re.search(rf"^{rule}\s+(\d+)\s*$", output, re.M)
    return int(match.group(1)) if match else 0


@pytest.mark.slow
def test_snakemake_tokenizes_shards_in_jobs_and_resumes_one(tmp_path):
    work = _workdir(tmp_path)
    target = "results/tiny/data/meta.json"
    first = run_snakemake(work, target, "--config", f"overrides={SHARDS}", timeout=900)
    text = first.stdout + first.stderr
    assert _jobs(text, "data_shard") == 4 and _jobs(text, "data_tokenizer") == 1
    data = work / "results" / "tiny" / "data"
    verify_training_data(str(data / TRAIN_PREFIX_NAME), str(data / VALID_PREFIX_NAME))
    before = (data / f"{TRAIN_PREFIX_NAME}.bin").read_bytes()
    (data / "shards" / "00002.json").unlink()  # killed in shard 2, before the merge
    (data / META_NAME).unlink()
    again = run_snakemake(work, target, "--config", f"overrides={SHARDS}", timeout=900)
    text = again.stdout + again.stderr
    assert _jobs(text, "data_shard") == 1 and _jobs(text, "data_tokenizer") == 0
    assert (data / f"{TRAIN_PREFIX_NAME}.bin").read_bytes() == before
    assert (data / META_NAME).is_file()
