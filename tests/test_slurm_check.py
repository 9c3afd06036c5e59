"""The pre-submission check of partition, account and node count, against stub Slurm commands
that print what Slurm 22.05 prints (the real cluster: tests/test_slurm_multinode.py)."""

from __future__ import annotations

import pytest

from collapse.slurm_check import check_requests

PARTITION = (
    "PartitionName=gpu AllowGroups=ALL AllowAccounts=physics,chem AllowQos=ALL "
    "AllocNodes=ALL Default=NO MaxNodes=4 MaxTime=2-00:00:00 Nodes=g[01-16] State=UP "
    "TotalCPUs=1024 TotalNodes=16 DenyAccounts=(null)"
)


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    """scontrol knows partition 'gpu'; sinfo lists gpu and debug; sacctmgr as given."""

    def install(sacctmgr: str = "exit 1"):
        for name, body in {
            "scontrol": (
                f'if [ "$4" = gpu ]; then echo "{PARTITION}"; '
                'else echo "Partition $4 not found" >&2; exit 1; fi'
            ),
            "sinfo": "echo gpu; echo debug",
            "sacctmgr": sacctmgr,
        }.items():
            stub = tmp_path / name
            stub.write_text(f"#!/bin/sh\n{body}\n")
            stub.chmod(0o755)
        monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")

    return install


def test_a_request_the_partition_allows_passes(slurm):
    slurm()
    assert check_requests("gpu", "physics", [("a", 1), ("b", 4)]) == []


def test_each_refusal_names_its_setting(slurm):
    slurm()
    (unknown,) = check_requests("gpux", "physics", [("a", 1)])
    assert unknown.startswith("cluster.partition='gpux': Slurm has no such partition")
    assert "sinfo lists: debug, gpu" in unknown
    (account,) = check_requests("gpu", "bio", [("a", 1)])
    assert account.startswith("cluster.account='bio'") and "physics,chem" in account
    (nodes,) = check_requests("gpu", "physics", [("small", 2), ("big", 8)])
    assert nodes.startswith("nodes per run: big (8)") and "MaxNodes=4" in nodes
    assert "cluster.max_nodes" in nodes and "at most 4" in nodes


def test_an_account_without_association_is_refused_where_accounting_runs(slurm):
    slurm(sacctmgr="echo physics")
    assert check_requests("gpu", "physics", [("a", 1)]) == []
    slurm(sacctmgr="echo chem")
    (account,) = check_requests("gpu", "physics", [("a", 1)])
    assert "no association" in account and "sacctmgr lists: chem" in account


def test_without_a_reachable_slurm_nothing_is_checked(tmp_path, monkeypatch):
    stub = tmp_path / "scontrol"
    stub.write_text(
        "#!/bin/sh\necho 'fatal: Could not establish a configuration source' >&2\nexit 1\n"
    )
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    assert check_requests("gpu", "", [("a", 64)]) == []
    monkeypatch.setenv("PATH", "/nonexistent")
    assert check_requests("gpu", "", [("a", 64)]) == []
