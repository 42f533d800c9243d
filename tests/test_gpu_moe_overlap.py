"""GPU (skipped without CUDA): shared experts on a side stream (ModelConfig.shared_expert_overlap) change no number."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.modules.init import init_weights
from lightning_moe.modules.moe_layer import MoELayer
from lightning_moe.strategy.parallel_context import ParallelContext
from tests.modules.test_moe_layer import cfg_

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run(overlap: bool):
    cfg = cfg_(hidden_size=512, num_experts=8, topk=2, moe_ffn_hidden_size=1024, shared_expert_ffn_size=2048,
               shared_expert_overlap=overlap)
    layer = MoELayer(cfg, ParallelContext.single(), out_std=0.02)
    init_weights(layer, 0)
    layer = layer.cuda().to(torch.bfloat16)
    x = torch.randn(4, 512, 512, device="cuda", dtype=torch.bfloat16, generator=torch.Generator("cuda").manual_seed(0))
    x.requires_grad_(True)
    for _ in range(2):  # twice: the second call reuses the side stream and the allocator's blocks
        x.grad = None
        layer.zero_grad(set_to_none=True)
        y, aux = layer(x)
        (y.float().square().mean() + aux).backward()
    torch.cuda.synchronize()
    streams = [k for k in layer.ctx.comm_buffers if k[0] == "shared_expert_stream"]
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}, streams


def test_shared_expert_overlap_is_bit_identical():
    y0, gx0, g0, s0 = _run(False)
    y1, gx1, g1, s1 = _run(True)
    assert not s0 and len(s1) == 1  # the side stream was used only when asked for
    assert torch.equal(y0, y1) and torch.equal(gx0, gx1)
    assert all(torch.equal(g0[n], g1[n]) for n in g0), [n for n in g0 if not torch.equal(g0[n], g1[n])]
