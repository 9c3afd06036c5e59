"""The roll call before torchrun (collapse.rendezvous), as separate processes on this machine:
the launchers of a job's nodes, one of which is missing or cannot reach the first node."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

NODES = "node-a,node-b,node-c"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher(node: str, port: int, timeout_s: float, nodes: str = NODES) -> subprocess.Popen:
    args = ["--node", node, "--nodes", nodes, "--head", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen(
        [sys.executable, "-m", "collapse.rendezvous", *args, "--timeout", str(timeout_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


def test_every_node_arrives_and_all_go_on():
    port = free_port()
    began = time.monotonic()
    # the others start first: they wait for the first node to listen
    procs = [launcher(n, port, 20) for n in ("node-c", "node-b")]
    time.sleep(0.5)
    procs.append(launcher("node-a", port, 20))
    results = [finish(p) for p in procs]
    assert [code for code, _ in results] == [0, 0, 0], results
    assert "all 3 nodes arrived on node-a" in results[2][1]
    assert time.monotonic() - began < 15


def test_a_node_that_never_arrives_is_named_by_the_first_node():
    port = free_port()
    head = launcher("node-a", port, 3)
    other = launcher("node-b", port, 3)  # node-c never starts its launcher
    (head_code, head_err), (other_code, other_err) = finish(head), finish(other)
    assert head_code == 1 and other_code == 1
    assert "node(s) node-c did not reach the rendezvous on node-a" in head_err, head_err
    assert "within 3 s (cluster.rendezvous_timeout_s)" in head_err
    assert "2 of 3 nodes arrived" in head_err
    assert "ended the rendezvous without every node" in other_err, other_err


def test_a_node_that_cannot_reach_the_first_node_names_itself_and_the_address():
    port = free_port()  # nobody listens there: the first node never came up
    code, err = finish(launcher("node-b", port, 2))
    assert code == 1
    assert (
        f"node node-b could not complete the rendezvous with the first node at 127.0.0.1:{port}"
        in err
    )
    assert "within 2 s (cluster.rendezvous_timeout_s)" in err


def test_a_node_outside_the_job_is_refused():
    code, err = finish(launcher("node-z", free_port(), 1))
    assert code == 1 and "'node-z' is not among the job's nodes" in err
