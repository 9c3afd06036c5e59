"""Which rank went silent, once a collective has timed out.

A rank that hangs (a stuck kernel, a frozen process, a node that stalls) makes every other rank
wait in its next collective. After the cluster's ``distributed_timeout_min`` the process
group's timeout ends that wait with an error ("Timed out waiting ... for recv"), which names
no rank. ``RollCall``, made at the start of training, exchanges every rank's node and pid; after
a timeout each rank still alive checks in at the job's key-value store (the one the ranks met
through, which torchrun's agent on the first node holds, outside any rank) and waits, up to the
timeout again, for the others. Each surviving rank then logs the ranks that never checked in,
with their nodes and pids, and the job fails instead of hanging until its time limit: within
twice the timeout of the hang.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch.distributed as dist

TIMEOUT_MARKERS = ("Timed out", "timed out", "Timeout", "timeout")
# the job's exit code after a collective timeout: the workflow's retry resumes the run
EXIT_COLLECTIVE_TIMEOUT = 6
ROLL_CALL_KEY = "collapse/roll_call"


def is_collective_timeout(err: BaseException) -> bool:
    """True for the error a collective raises when its process group's timeout passes."""
    kinds = (RuntimeError, getattr(dist, "DistBackendError", RuntimeError))
    return isinstance(err, kinds) and any(m in str(err) for m in TIMEOUT_MARKERS)


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


class RollCall:
    """Every rank's node and pid (exchanged at the start over a gloo group of its own), and
    the roll call that finds the ranks that went silent.

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
        """After a collective timed out: the ranks that do not check in at the store within
        the timeout (every surviving rank finds the same)."""
        from torch.distributed.distributed_c10d import _get_default_store

        world = len(self.where)
        try:
            store = _get_default_store()
            store.set(f"{ROLL_CALL_KEY}/{self.rank}", "here")
            deadline = time.monotonic() + self.timeout.total_seconds()
            while True:
                absent = [r for r in range(world) if not store.check([f"{ROLL_CALL_KEY}/{r}"])]
                if not absent or time.monotonic() >= deadline:
                    break
                time.sleep(1.0)
        except Exception as err:  # the store's host (the first node) is gone too
            return (
                "the job's store on the first node does not answer either "
                f"({str(err).splitlines()[0][:200]}): the first node is the likely one gone"
            )
        if not absent:
            return "every rank checked in after the timeout (a transient stall)"
        return (
            ", ".join(self.describe(r) for r in absent)
            + f" did not answer within {self.timeout_min:g} min"
        )

    def report(self, err: BaseException) -> str:
        """One line for this rank's log after ``err``, a collective timeout."""
        return (
            f"{self.describe(self.rank)}: a collective found no answer within "
            f"{self.timeout_min:g} min (cluster.distributed_timeout_min); {self.missing()}"
        )
