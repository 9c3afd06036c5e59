"""Fixtures shared by several test files."""

import os
import socket
from pathlib import Path

import pytest
import torch

# The repository's config/, wherever pytest is started (a user's default is the working
# directory's config/; tests that check that unset this).
os.environ.setdefault("COLLAPSE_CONFIG_DIR", str(Path(__file__).resolve().parents[1] / "config"))


@pytest.fixture(scope="module")
def megatron_world():
    """Patches applied, a gloo world of one, Megatron's model-parallel groups (TP=PP=1)."""
    import megatron_patches

    megatron_patches.apply()
    from megatron.core import parallel_state, tensor_parallel

    torch.set_num_threads(1)
    created = not torch.distributed.is_initialized()
    if created:
        with socket.socket() as sock:  # a free port of its own: a fixed one can be taken
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
        )
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    yield
    parallel_state.destroy_model_parallel()
    if created:
        torch.distributed.destroy_process_group()
