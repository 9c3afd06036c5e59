"""A rank that stops answering: the others' collective times out after the configured timeout,
and rank 0 names the silent rank with its node and pid (collapse.hangs), on real gloo ranks."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

PROBE = Path(__file__).with_name("hang_probe.py")


def test_the_rank_that_stopped_answering_is_named_with_its_node_and_pid():
    timeout_min = 0.05  # 3 s
    env = dict(os.environ, OMP_NUM_THREADS="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    began = time.monotonic()
    done = subprocess.run(
        [*torchrun, "--nproc_per_node=3", str(PROBE), str(timeout_min)],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    took = time.monotonic() - began
    reports = sorted(line for line in done.stdout.splitlines() if line.startswith("report: "))
    assert done.returncode != 0
    assert len(reports) == 2, done.stdout + done.stderr[-3000:]
    host = socket.gethostname()
    first = next(r for r in reports if r.startswith("report: rank 0 "))
    assert re.search(
        rf"rank 2 \(node {re.escape(host)}, pid \d+\) did not answer within 0.05 min", first
    ), first
    assert "a collective found no answer within 0.05 min (cluster.distributed_timeout_min)" in first
    other = next(r for r in reports if r.startswith("report: rank 1 "))
    assert "rank 0 (node" in other and "its log names the rank" in other, other
    assert took < 120
