"""``ModelConfig.expert_rows_align`` (Megatron's --moe-router-padding-for-fp8) changes the experts' input layout, never
the numbers: every dispatcher on one process gives the same output and gradients as without padding. The all-to-all
dispatcher at EP = 1 once handed the experts the unpadded counts of a padded layout (found by the torchao FP8 work)."""

from __future__ import annotations

import pytest
import torch

from tests.modules.test_moe_layer import cfg_, make_layer


@pytest.mark.parametrize("dispatcher", ["alltoall", "alltoall_dedup", "allgather"])
@pytest.mark.parametrize("capacity", [None, 1.0])
def test_padding_changes_no_number(dispatcher, capacity):
    x = torch.randn(3, 20, 16, generator=torch.Generator().manual_seed(0))
    out = []
    for align in (1, 16):
        kw = dict(dispatcher=dispatcher, expert_rows_align=align, num_experts=8)
        if capacity:
            kw["capacity_factor"] = capacity
        layer = make_layer(cfg_(**kw))
        xi = x.clone().requires_grad_()
        y, aux = layer(xi)
        (y.square().sum() + aux).backward()
        out.append((y.detach(), xi.grad, layer.experts.w13.grad))
    (y1, gx1, gw1), (y16, gx16, gw16) = out
    torch.testing.assert_close(y16, y1, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(gx16, gx1, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(gw16, gw1, rtol=2e-5, atol=2e-5)
