"""Stand-in for collapse.train in launcher tests: every rank joins, all-reduces, reports.

``python -m dist_probe --out DIR`` (tests/slurm on PYTHONPATH) writes DIR/rank<r>.json with
the rank, world size, host and the GPUs Slurm made visible, so a test can count processes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    launched = "RANK" in os.environ  # by torchrun
    if launched:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if launched else 0
    world = dist.get_world_size() if launched else 1
    ones = torch.ones(1)
    if launched:
        dist.all_reduce(ones)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "rank": rank,
        "world": world,
        "all_reduce_sum": ones.item(),
        "host": socket.gethostname(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(record) + "\n")
    if launched:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
