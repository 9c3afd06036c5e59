"""Malformed family and cluster specs through ``collapse plan``, as a user meets them: exit 2, one
``error:`` line naming the field and the fix, no traceback, and a plan already written stays as
it was (checksums before and after). The model-level cases are in tests/test_config.py."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from collapse.cli import main

REPO_CONFIG = Path(__file__).resolve().parents[1] / "config"

# (case, Hydra overrides after family=tiny, words the message must hold)
CASES = [
    ("duplicate tpp", ["family.tpp=[5,5]"], ["tpp: 5 listed twice", "list each value once"]),
    ("duplicate seeds", ["family.seeds=[0,0]"], ["seeds: 0 listed twice"]),
    ("no seeds", ["family.seeds=[]"], ["family.seeds", "at least 1 item"]),
    ("no sizes", ["family.sizes=[]"], ["family.sizes", "at least 1 item"]),
    ("tau not a number", ["family.tau=abc"], ["family.tau", "valid list"]),
    ("tpp below range", ["family.tpp=[0.01]"], ["family.tpp[0]", "0.5"]),
    ("unknown family key", ["+family.foo=1"], ["family.foo: unknown key", "remove it"]),
    ("negative memory", ["cluster.mem_gb=-1"], ["cluster.mem_gb", "greater than 0"]),
    ("unknown family", ["family=nosuch"], ["no config named 'nosuch'", "available: "]),
    ("unknown cluster", ["cluster=nosuch"], ["no config named 'nosuch'", "local"]),
    ("unset field without +", ["cluster.cpus_per_task=0"], ["prefix it with '+'"]),
    ("override syntax", ["family.tpp=[5"], ["config overrides", "[5"]),
    ("vocabulary mismatch", ["family.data.vocab_size=1024"], ["data.vocab_size", "differs"]),
    ("slurm without partition", ["cluster.executor=slurm"], ["cluster", "partition"]),
]


def checksums(path: Path) -> dict[str, str]:
    return {
        str(p): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Path:
    """A good plan of tiny already on disk, which no failed call may touch."""
    out = tmp_path_factory.mktemp("plan") / "plan"
    assert main(["plan", "family=tiny", "--out", str(out), "--config-dir", str(REPO_CONFIG)]) == 0
    return out


def plan_cli(argv: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    try:
        code = main(["plan", *argv])
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case, overrides, words", CASES, ids=[c[0] for c in CASES])
def test_bad_spec_exits_2_names_the_field_and_changes_nothing(
    planned, case, overrides, words, capsys
):
    before = checksums(planned)
    argv = ["family=tiny", *overrides, "--out", str(planned), "--config-dir", str(REPO_CONFIG)]
    code, err = plan_cli(argv, capsys)
    assert code == 2, f"{case}: exit {code}\n{err}"
    assert err.startswith("error: ") and "Traceback" not in err, err
    for word in words:
        assert word in err, f"{case}: {word!r} not in:\n{err}"
    assert checksums(planned) == before, f"{case}: the earlier plan changed"


def test_yaml_syntax_error_names_file_and_line(planned, tmp_path, capsys):
    config = tmp_path / "config"
    shutil.copytree(REPO_CONFIG, config)
    family = config / "family" / "tiny.yaml"
    lines = family.read_text().splitlines()
    family.write_text("\n".join([*lines, "tpp: [5", "  oops: 1"]) + "\n")
    before = checksums(planned)
    code, err = plan_cli(
        ["family=tiny", "--out", str(planned), "--config-dir", str(config)], capsys
    )
    assert code == 2, err
    assert "not valid YAML" in err and str(family) in err and f"line {len(lines) + 2}" in err, err
    assert "Traceback" not in err
    assert checksums(planned) == before
