"""Fixtures shared by the callback tests."""

import numpy as np
import pytest
import torch

from lightning_moe.data import write_tokens


@pytest.fixture(autouse=True)
def one_thread():
    """The model is tiny: one intra-op thread is as fast, and immune to spin-wait slowdowns on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    tokens = np.random.default_rng(0).integers(0, 256, 20_000)
    return write_tokens(str(tmp_path_factory.mktemp("tok") / "tok.bin"), tokens, "uint16")


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """A learnable token file (tests/parallel/parity.py's), once per module."""
    from tests.parallel.parity import make_tokens
    return make_tokens(str(tmp_path_factory.mktemp("tokens") / "t.bin"))
