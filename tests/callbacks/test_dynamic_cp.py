"""DynamicContextParallel's choice and refusals (its parity with static CP and one process: tests/parallel)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_moe import DynamicContextParallel
from lightning_moe.callbacks.dynamic_cp import choose_cp


def _quadratic(n):  # attention-dominated work
    return n * n


def test_choice_follows_the_balance():
    # four rows of short documents, equal work: whole rows per rank are balanced, no K/V exchange needed
    assert choose_cp([[8, 8]] * 4, 4, [1, 2, 4], _quadratic, 0.1) == 1
    # one row of a single long document among short ones: on its own rank it would do ~7x the balanced share
    skewed = [[64], [8] * 8, [8] * 8, [8] * 8]
    assert choose_cp(skewed, 4, [1, 2, 4], _quadratic, 0.1) == 4
    # a milder skew that pairs of ranks absorb
    mild = [[24, 8], [16, 16], [16, 16], [24, 8]]
    assert choose_cp(mild, 4, [1, 2, 4], _quadratic, 0.1) == 2
    assert choose_cp(mild, 4, [1, 2, 4], _quadratic, 1.0) == 1  # more slack, fewer ranks per row
    assert choose_cp(skewed, 4, [1, 2], _quadratic, 0.1) == 2  # the largest allowed when none is balanced enough


def _module(cp=2, tp=1, pp=1, balancing=False):
    ctx = SimpleNamespace(cp=cp, tp=tp, pp=pp)
    config = SimpleNamespace(load_balancing="seq_aux_loss" if balancing else "aux_loss")
    return SimpleNamespace(parallel_context=ctx, model=None, config=config)  # setup runs before configure_model


def test_refusals():
    with pytest.raises(ValueError, match=r"DynamicContextParallel\(sizes=\[3\]\): \[3\] do not divide "
                                         r"context_parallel_size=4; valid: \[1, 2, 4\]"):
        DynamicContextParallel(sizes=[3]).setup(None, _module(cp=4), "fit")
    with pytest.raises(ValueError, match="needs tensor_parallel_size=1"):
        DynamicContextParallel().setup(None, _module(tp=2), "fit")
    with pytest.raises(ValueError, match="load_balancing='seq_aux_loss' counts each sequence"):
        DynamicContextParallel().setup(None, _module(balancing=True), "fit")
    with pytest.raises(ValueError, match="slack=-1"):
        DynamicContextParallel(slack=-1)
    cb = DynamicContextParallel()
    cb.setup(None, _module(cp=1), "fit")  # nothing to choose: the run stays as it is
    cb.on_train_batch_start(None, None, {}, 0)
