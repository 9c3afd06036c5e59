"""Check a family's Slurm requests against the cluster before anything is submitted.

Slurm refuses a partition it does not know at submission, but a job asking for more nodes than
its partition's MaxNodes (without EnforcePartLimits) waits in the queue for ever with the reason
PartitionNodeLimit, and an account the partition does not allow, or one the accounting database
has no association for, fails only job by job. ``check_requests`` asks the controller first
(``scontrol show partition``; ``sacctmgr`` where accounting runs) and names the cluster-config
setting to change. Where no Slurm controller answers (a dry run on a laptop) nothing is checked.
"""

from __future__ import annotations

import getpass
import shutil
import subprocess
from collections.abc import Iterable

TIMEOUT_S = 20


class SlurmRequestError(ValueError):
    """A request the cluster would refuse or never start."""


def _run(*cmd: str) -> subprocess.CompletedProcess | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None


def _fields(line: str) -> dict[str, str]:
    """``Key=Value`` words of one ``scontrol -o`` line (values without spaces)."""
    return dict(w.split("=", 1) for w in line.split() if "=" in w)


def partition_facts(partition: str) -> dict[str, str] | None:
    """scontrol's fields of ``partition``; {} if Slurm does not know it; None if no controller."""
    shown = _run("scontrol", "-o", "show", "partition", partition)
    if shown is None:
        return None
    if shown.returncode == 0 and shown.stdout.strip():
        return _fields(shown.stdout.splitlines()[0])
    if "not found" in (shown.stderr + shown.stdout).lower():
        return {}
    return None  # no controller, no config: cannot tell


def partitions() -> list[str]:
    listed = _run("sinfo", "-h", "-o", "%R")
    return sorted(set(listed.stdout.split())) if listed and listed.returncode == 0 else []


def _accounts(value: str) -> set[str]:
    return {a for a in value.split(",") if a and a != "(null)"}


def associated_accounts(user: str) -> set[str] | None:
    """Accounts the accounting database associates with ``user``; None without slurmdbd."""
    shown = _run("sacctmgr", "-n", "-P", "show", "assoc", f"user={user}", "format=account")
    if shown is None or shown.returncode != 0:
        return None
    return {line.strip() for line in shown.stdout.splitlines() if line.strip()}


def check_requests(
    partition: str, account: str, nodes_by_run: Iterable[tuple[str, int]]
) -> list[str]:
    """Problems of the requests, each naming the setting; [] if fine or Slurm cannot be asked."""
    facts = partition_facts(partition)
    if facts is None:
        return []
    if not facts:
        known = ", ".join(partitions()) or "none"
        return [
            f"cluster.partition={partition!r}: Slurm has no such partition (sinfo lists: "
            f"{known}). Fix: set cluster.partition to one of them"
        ]
    problems = []
    if facts.get("State", "UP") not in ("UP",):
        problems.append(
            f"cluster.partition={partition!r} is {facts['State']}: jobs would wait until an "
            "administrator sets it UP. Fix: choose another partition"
        )
    allowed = facts.get("AllowAccounts", "ALL")
    denied = _accounts(facts.get("DenyAccounts", ""))
    if allowed != "ALL" and account not in _accounts(allowed):
        problems.append(
            f"cluster.account={account!r}: partition {partition!r} allows only the accounts "
            f"{allowed}. Fix: set cluster.account to one of them"
        )
    elif account in denied:
        problems.append(
            f"cluster.account={account!r}: partition {partition!r} denies it. Fix: set "
            "cluster.account to another account"
        )
    elif account:
        user = getpass.getuser()
        mine = associated_accounts(user)
        if mine is not None and account not in mine:
            problems.append(
                f"cluster.account={account!r}: Slurm's accounting has no association of user "
                f"{user!r} with it (sacctmgr lists: {', '.join(sorted(mine)) or 'none'}). "
                "Fix: set cluster.account to one of them"
            )
    limit = facts.get("MaxNodes", "UNLIMITED")
    total = int(facts["TotalNodes"]) if facts.get("TotalNodes", "").isdigit() else None
    cap = min(
        [n for n in (int(limit) if limit.isdigit() else None, total) if n is not None],
        default=None,
    )
    if cap is not None:
        over = [(run, n) for run, n in nodes_by_run if n > cap]
        if over:
            runs = ", ".join(f"{run} ({n})" for run, n in over[:5])
            more = f" and {len(over) - 5} more" if len(over) > 5 else ""
            problems.append(
                f"nodes per run: {runs}{more} ask for more nodes than partition {partition!r} "
                f"gives one job (MaxNodes={limit}, TotalNodes={facts.get('TotalNodes', '?')}); "
                "Slurm would keep them pending for ever. Fix: lower cluster.max_nodes (GPU "
                "clusters) or cluster.nodes_per_run (CPU clusters) to at most "
                f"{cap}, or set cluster.partition to a partition with more nodes"
            )
    return problems
