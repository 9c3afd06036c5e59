"""A rank that goes silent: the others' collective times out after the configured timeout,
and every surviving rank names the silent one with its node and pid (collapse.hangs), on real
gloo ranks."""

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
    # each report starts with "report: "; split on it, so lines that ran together still count
    reports = sorted("report: " + r.strip() for r in done.stdout.split("report: ")[1:])
    assert done.returncode != 0
    assert len(reports) == 2, done.stdout + done.stderr[-3000:]
    host = socket.gethostname()
    for report in reports:  # every surviving rank names the silent one, its node and pid
        assert re.search(
            rf"rank 2 \(node {re.escape(host)}, pid \d+\) did not answer within 0.05 min", report
        ), report
        assert "a collective found no answer within 0.05 min (cluster.distributed_timeout_min)" in (
            report
        )
    assert {r.split()[2] for r in reports} == {"0", "1"}
    assert took < 120
