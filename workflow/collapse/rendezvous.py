"""A roll call of a multi-node job's nodes before torchrun: a node that never arrives is named.

torchrun's c10d rendezvous, when a node does not join, waits its ``join_timeout`` and fails
with ``RendezvousTimeoutError`` and no word of which node is missing. Before each node starts
torchrun, its launcher (``collapse.launch.multinode_command``) runs this roll call: the first
node listens on a port of the job, every other node connects to it at the address torchrun
will use and gives its Slurm node name, and the first node answers all of them once every node
of the allocation has arrived. When the cluster's ``rendezvous_timeout_s`` passes first, the
first node names the nodes that did not arrive and every launcher exits non-zero (srun's
``--kill-on-bad-exit`` then ends the job); a node that cannot reach the first node says so
with the address it tried. Standard library only, so it costs a fraction of a second.

    python -m collapse.rendezvous --node NAME --nodes A,B,... --head ADDR --port P --timeout S
"""

from __future__ import annotations

import argparse
import socket
import sys
import time

EXIT_MISSING = 1
ANSWER_GRACE_S = 5.0  # a member waits this much past its timeout for the first node
GO = b"go\n"


def log(message: str) -> None:
    print(f"rendezvous: {message}", file=sys.stderr, flush=True)


def _read_line(conn: socket.socket, deadline: float) -> str:
    data = b""
    while not data.endswith(b"\n"):
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = conn.recv(256)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def head(nodes: list[str], me: str, port: int, timeout_s: float) -> int:
    """The first node: wait for every other node of ``nodes``, then let them all go."""
    deadline = time.monotonic() + timeout_s
    expected = [n for n in nodes if n != me]
    arrived: dict[str, socket.socket] = {}
    try:
        server = socket.create_server(("", port))
    except OSError as err:
        log(f"the first node {me} cannot listen on port {port}: {err}")
        return EXIT_MISSING
    with server:
        while len(arrived) < len(expected):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            server.settimeout(left)
            try:
                conn, _ = server.accept()
            except TimeoutError:
                break
            try:
                name = _read_line(conn, deadline)
            except OSError:
                conn.close()
                continue
            if name in expected:
                arrived[name] = conn
            else:
                log(f"ignored a caller that is not a node of this job: {name!r}")
                conn.close()
        missing = [n for n in expected if n not in arrived]
        for conn in arrived.values():
            with conn:
                if not missing:
                    conn.sendall(GO)
    if missing:
        log(
            f"node(s) {', '.join(missing)} did not reach the rendezvous on {me} (port {port}) "
            f"within {timeout_s:g} s (cluster.rendezvous_timeout_s); "
            f"{len(arrived) + 1} of {len(nodes)} nodes arrived. Check those nodes (their slurmd "
            "log, the launcher's environment) or raise cluster.rendezvous_timeout_s"
        )
        return EXIT_MISSING
    log(f"all {len(nodes)} nodes arrived on {me}")
    return 0


def member(me: str, head_addr: str, port: int, timeout_s: float) -> int:
    """Any other node: reach the first node, say who it is, wait for everyone."""
    deadline = time.monotonic() + timeout_s
    error: Exception | None = None
    while time.monotonic() < deadline:  # the first node may not listen yet
        try:
            left = max(0.1, deadline - time.monotonic())
            with socket.create_connection((head_addr, port), timeout=min(5.0, left)) as conn:
                conn.sendall(f"{me}\n".encode())
                try:  # the first node decides; its answer may come a little after our deadline
                    answer = _read_line(conn, deadline + ANSWER_GRACE_S)
                except TimeoutError:
                    answer = None
            if answer is None:
                log(
                    f"node {me} reached the first node at {head_addr}:{port} but had no answer "
                    f"within {timeout_s:g} s (cluster.rendezvous_timeout_s); the first node's "
                    "log names the nodes that did not arrive"
                )
                return EXIT_MISSING
            if answer == GO.decode().strip():
                return 0
            log(
                f"node {me}: the first node at {head_addr}:{port} ended the rendezvous without "
                "every node (its log names the missing ones)"
            )
            return EXIT_MISSING
        except OSError as err:  # refused (not listening yet), timed out, reset
            error = err
            time.sleep(0.2)
    log(
        f"node {me} could not complete the rendezvous with the first node at {head_addr}:{port} "
        f"within {timeout_s:g} s (cluster.rendezvous_timeout_s): {error}. Check that this node "
        "reaches the first node at that address"
    )
    return EXIT_MISSING


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m collapse.rendezvous", description=__doc__)
    parser.add_argument("--node", required=True, help="this node's name (SLURMD_NODENAME)")
    parser.add_argument("--nodes", required=True, help="every node of the job, the first first")
    parser.add_argument("--head", required=True, help="the first node's address")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--timeout", type=float, required=True, help="seconds")
    args = parser.parse_args(argv)
    nodes = [n for n in args.nodes.replace(",", " ").split() if n]
    if not nodes or args.node not in nodes:
        log(f"node {args.node!r} is not among the job's nodes {nodes}")
        return EXIT_MISSING
    if args.node == nodes[0]:
        return head(nodes, args.node, args.port, args.timeout)
    return member(args.node, args.head, args.port, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
