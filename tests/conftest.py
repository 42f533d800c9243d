"""Isolation between tests that run a Trainer with ``moe_fold`` in the pytest process itself: Lightning leaves the
process group and its MASTER_PORT/RANK environment behind, and a later subprocess would inherit the port."""

import os

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def _fresh_distributed_state():
    env = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key in set(os.environ) - set(env):
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
