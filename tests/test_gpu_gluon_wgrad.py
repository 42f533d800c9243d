"""The warp-specialized Gluon FP8 wgrad (``gluon_fp8_wgrad.py``) on an H100 (skipped without CUDA, triton or SM 9.0):
the bits of ``triton_fp8_wgrad``'s one-tile kernel with fast accumulation, written, into bf16 and fp32, at uneven
experts (empty ones, one with a single block), N off the tiles' boundaries, more tiles than programs; and
``wgrad_into``'s choice of it."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.modules import fp8_grouped_kernels as k

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or not k.available(
    torch.device("cuda")), reason="needs CUDA and SM 9.0")]
tw = pytest.importorskip("lightning_moe.modules.triton_fp8_wgrad")
gw = pytest.importorskip("lightning_moe.modules.gluon_fp8_wgrad")


def _operands(blocks: list, K: int, N: int, seed: int):
    """E4M3 aT (K, P), bT (N, P) with each expert's ``blocks[l]`` 128-token blocks, per-expert scales, offsets."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    offs = (torch.tensor(blocks, device="cuda") * 128).cumsum(0).to(torch.int32)
    P = int(offs[-1]) + 128  # a tail past the last expert, never read
    aT = (torch.randn(K, P, generator=g, device="cuda") * 8).to(torch.float8_e4m3fn)
    bT = (torch.randn(N, P, generator=g, device="cuda") * 8).to(torch.float8_e4m3fn)
    L = len(blocks)
    sa = torch.rand(L, K, generator=g, device="cuda") + 0.5
    sb = torch.rand(L, N, generator=g, device="cuda") + 0.5
    return aT, sa, bT, sb, offs


@pytest.mark.parametrize("blocks,K,N", [([16, 0, 3, 1, 8], 256, 1024), ([2, 5], 384, 520), ([1], 128, 8),
                                        ([4] * 8, 1024, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("config", [None, (128, 128, 8, 4), (128, 128, 4, 5, 2), (64, 256, 4, 4, 2)])
def test_gluon_wgrad_gives_the_triton_bits(blocks, K, N, dtype, config):
    aT, sa, bT, sb, offs = _operands(blocks, K, N, seed=len(blocks) + K)
    L = len(blocks)
    ref = torch.full((L, K, N), float("nan"), device="cuda", dtype=dtype)
    tw.wgrad_into(ref, (aT, sa), (bT, sb), offs, True, per_expert=True, fast=True, persistent=False)
    out = torch.full_like(ref, float("nan"))
    gw.wgrad(out, aT, sa, bT, sb, offs, config=config, programs=3)  # fewer programs than tiles: each loops
    assert torch.equal(out, ref)
    if 0 in blocks:
        assert out[blocks.index(0)].abs().sum() == 0  # the empty expert's zeros


def test_wgrad_into_takes_gluon_where_it_fits(monkeypatch):
    """Fast, written, per expert, K a multiple of 128 and no config: the Gluon kernel (same bits); otherwise the
    triton kernels."""
    calls = []
    real = gw.wgrad
    monkeypatch.setattr(gw, "wgrad", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    monkeypatch.setattr(tw, "GLUON", True)
    aT, sa, bT, sb, offs = _operands([3, 2], 256, 512, seed=0)
    out = torch.empty(2, 256, 512, device="cuda", dtype=torch.bfloat16)
    tw.wgrad_into(out, (aT, sa), (bT, sb), offs, True, per_expert=True, fast=True)
    assert calls == [(2, 256, 512)]
    for kw in (dict(fast=False), dict(persistent=True), dict(config=(128, 128, 8, 3))):
        tw.wgrad_into(out, (aT, sa), (bT, sb), offs, True, per_expert=True, **{"fast": True, **kw})
    tw.wgrad_into(out, (aT, sa), (bT, sb), offs, False, per_expert=True, fast=True)  # adding
    aT2, sa2, bT2, sb2, offs2 = _operands([3, 2], 200, 512, seed=1)  # K off 128
    out2 = torch.empty(2, 200, 512, device="cuda", dtype=torch.bfloat16)
    tw.wgrad_into(out2, (aT2, sa2), (bT2, sb2), offs2, True, per_expert=True, fast=True)
    assert calls == [(2, 256, 512)]
