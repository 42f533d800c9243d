"""Isolation between tests that run a Trainer with ``moe_fold`` in the pytest process itself: Lightning leaves the
process group and its launcher environment (MASTER_ADDR/PORT, NODE_RANK, LOCAL_RANK) behind, and a later subprocess
would inherit them; a benchmark launched with ``LOCAL_RANK`` set, for one, believes its ranks were started for it and
waits for them. Per test, and per module for module-scoped fixtures (the parity references train in-process)."""

import os

import pytest
import torch.distributed as dist


def _restore(env: dict) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key in set(os.environ) - set(env):
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


@pytest.fixture(autouse=True, scope="module")
def _fresh_distributed_state_per_module():
    env = dict(os.environ)
    yield
    _restore(env)


@pytest.fixture(autouse=True)
def _fresh_distributed_state():
    env = dict(os.environ)
    yield
    _restore(env)
