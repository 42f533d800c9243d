"""The FP8 parameter all-gather on one GPU (skipped without CUDA): a bucket's pack, gather and unpack under a one-rank
NCCL group give the bytes and bf16 values of ``fp8.quantize`` on the whole tensors, the published amaxes quantize the
dequantized weights back to the gathered bytes, and none of it synchronises with the host. The multi-rank numbers:
``tests/parallel/test_fp8_param_gather.py`` (over NCCL with ``LMOE_PARITY_ACCELERATOR=gpu``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_moe.modules.fp8 import Tiling, dequantize, quantize
from lightning_moe.strategy import fp8_param_gather as g
from lightning_moe.strategy.flat_shards import bucket_layout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture
def group(tmp_path_factory):
    if not dist.is_initialized():
        store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "s"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    pg = dist.new_group([0])  # a communicator per test: the sync check must not touch another test's
    yield pg
    torch.cuda.synchronize()
    dist.destroy_process_group(pg)


@pytest.mark.parametrize("recipe", g.RECIPES)
def test_bucket_round_trip_exact_and_sync_free(group, recipe):
    torch.manual_seed(0)
    shapes = [((16, 512, 768), True), ((384, 512), False), ((8, 384, 512), True)]
    offsets, total = bucket_layout([torch.Size(s).numel() for s, _ in shapes], 1)
    flat = torch.zeros(total, device="cuda", dtype=torch.bfloat16)
    params = []
    for (shape, _), off in zip(shapes, offsets):
        view = flat[off:off + torch.Size(shape).numel()].view(shape)
        view.copy_(torch.randn(shape, device="cuda") * torch.rand(shape, device="cuda") ** 3)
        params.append(torch.nn.Parameter(view, requires_grad=False))
    before = [p.detach().clone() for p in params]
    fp8 = {i: g.FP8Weight(p, g.weight_blocks(tuple(p.shape), recipe, grouped))
           for i, (p, (_, grouped)) in enumerate(zip(params, shapes)) if i != 1 or recipe == "blockwise"}
    plan = g.plan_bucket(params, offsets, total, 1, fp8, 2, group)
    amaxes = g.WeightAmaxes()
    g.reduce_amaxes([plan], [flat], [0])  # first use: the kernels compile (with host syncs), once
    g.start(plan, flat, 0, 1).wait()
    g.finish(plan, flat, amaxes)
    for p, old in zip(params, before):
        p.detach().copy_(old)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        g.reduce_amaxes([plan], [flat], [0])
        g.start(plan, flat, 0, 1).wait()
        g.finish(plan, flat, amaxes)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for i, (p, old) in enumerate(zip(params, before)):
        if i not in fp8:  # travelled as bf16
            assert torch.equal(p, old)
            continue
        b = fp8[i].blocks
        t = Tiling(b.h, b.w)
        q, s = quantize(old.reshape(b.R, b.C), "e4m3", t)
        assert torch.equal(p.reshape(b.R, b.C), dequantize(q, s, t).to(torch.bfloat16))
        q_back, _ = quantize(p.reshape(b.R, b.C), "e4m3", t, amax=amaxes.get(p))
        assert torch.equal(q_back.view(torch.uint8), q.view(torch.uint8))
