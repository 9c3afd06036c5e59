"""Run under torchrun: the last rank goes silent; the others' collective times out, and
collapse.hangs names it. Prints each surviving rank's report line; argv[1]: the timeout (min)."""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from collapse.hangs import EXIT_COLLECTIVE_TIMEOUT, RollCall, is_collective_timeout

timeout_min = float(sys.argv[1])
dist.init_process_group("gloo", timeout=timedelta(minutes=timeout_min))
roll_call = RollCall(timeout_min)
if dist.get_rank() == dist.get_world_size() - 1:
    time.sleep(600)  # hangs: the others time out; torchrun ends it once they exit
try:
    dist.all_reduce(torch.ones(4))
except RuntimeError as err:
    assert is_collective_timeout(err), err
    # one write of the whole line: unbuffered (PYTHONUNBUFFERED), print writes the text and its
    # newline apart, and two ranks' lines can interleave on the shared pipe
    sys.stdout.write(f"report: {roll_call.report(err)}\n")
    sys.stdout.flush()
    os._exit(EXIT_COLLECTIVE_TIMEOUT)
