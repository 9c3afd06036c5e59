"""Which rank stopped answering, once a collective has timed out.

A rank that hangs (a stuck kernel, a frozen process, a node that stalls) makes every other rank
wait in its next collective. After the cluster's ``distributed_timeout_min`` the process
group's timeout ends that wait with an error ("Timed out waiting ... for recv"), which names
no rank. ``RollCall``, made at the start of training, exchanges every rank's node and pid over a
gloo group of its own; after a timeout the ranks still alive meet in
``torch.distributed.monitored_barrier`` on that group, and rank 0 learns which ranks did not
come (gloo's "Ranks 3 failed to pass monitoredBarrier"). Each surviving rank logs what it
knows, rank 0 the missing ranks with their nodes and pids, and the job fails instead of hanging
until its time limit: within twice the timeout of the hang.
"""

from __future__ import annotations

import os
import re
import socket
from datetime import timedelta

import torch.distributed as dist

TIMEOUT_MARKERS = ("Timed out", "timed out", "Timeout", "timeout")
# the job's exit code after a collective timeout: the workflow's retry resumes the run
EXIT_COLLECTIVE_TIMEOUT = 6


def is_collective_timeout(err: BaseException) -> bool:
    """True for the error a collective raises when its process group's timeout passes."""
    kinds = (RuntimeError, getattr(dist, "DistBackendError", RuntimeError))
    return isinstance(err, kinds) and any(m in str(err) for m in TIMEOUT_MARKERS)


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class RollCall:
    """Every rank's node and pid, and a gloo group to find the ranks that stopped answering.

    Made by every rank at the same point (the group and the exchange are collectives)."""

    def __init__(self, timeout_min: float):
        self.timeout = timedelta(minutes=timeout_min)
        self.timeout_min = timeout_min
        self.rank = dist.get_rank()
        self.group = dist.new_group(backend="gloo", timeout=self.timeout)
        self.where: list = [None] * dist.get_world_size()
        dist.all_gather_object(self.where, (node_name(), os.getpid()), group=self.group)

    def describe(self, rank: int) -> str:
        node, pid = self.where[rank]
        return f"rank {rank} (node {node}, pid {pid})"

    def missing(self) -> str:
        """After a collective timed out: which ranks do not answer (rank 0 knows; the others
        say so). Waits up to the timeout for the ranks still alive to come."""
        try:
            dist.monitored_barrier(group=self.group, timeout=self.timeout, wait_all_ranks=True)
        except RuntimeError as err:
            found = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(err))
            if found:
                ranks = [int(r) for r in re.findall(r"\d+", found.group(1))]
                return (
                    ", ".join(self.describe(r) for r in ranks)
                    + f" did not answer within {self.timeout_min:g} min"
                )
            if self.rank != 0:
                return (
                    f"{self.describe(0)} collects the roll call; its log names the rank that "
                    f"stopped answering ({str(err).splitlines()[0][:200]})"
                )
            return f"the roll call failed: {str(err).splitlines()[0][:300]}"
        return "every rank answered the roll call after the timeout (a transient stall)"

    def report(self, err: BaseException) -> str:
        """One line for this rank's log after ``err``, a collective timeout."""
        return (
            f"{self.describe(self.rank)}: a collective found no answer within "
            f"{self.timeout_min:g} min (cluster.distributed_timeout_min); {self.missing()}"
        )
