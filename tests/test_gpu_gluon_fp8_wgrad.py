"""The experts' precise FP8 wgrad on Gluon (``gluon_fp8_wgrad.py``) on an H100 (skipped without CUDA, triton or
SM 9.0): the Triton kernels' bits (``triton_fp8_wgrad``'s segments kernel over several micro-batches, and its one-tile
and persistent kernels for one), written and added into fp32 main grads, with empty experts, segments without
tokens, partial tiles and an odd number of steps, in each config; and ``fp8_grouped_kernels``' routing of one
micro-batch's wgrad through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.modules import fp8_grouped_kernels as k

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or not k.available(
    torch.device("cuda")), reason="needs CUDA and SM 9.0")]
gw = pytest.importorskip("lightning_moe.modules.gluon_fp8_wgrad")
tw = pytest.importorskip("lightning_moe.modules.triton_fp8_wgrad")

CONFIGS = [None, (128, 128, 8, 3), (64, 128, 4, 4), (128, 64, 4, 4)]


def _segments(counts, K, N, seed):
    """Side-by-side E4M3 operands of len(counts) micro-batches, each with its own per-expert scales and tokens
    (multiples of 128, as the padded layout gives); and each micro-batch's own operands and offsets."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    L = len(counts[0])
    segs, base, starts, ends = [], 0, [], []
    for c in counts:
        offs = torch.tensor(c, device="cuda").cumsum(0).to(torch.int32)
        P = sum(c)
        segs.append(((torch.randn(K, P, device="cuda", generator=g) * 4).to(torch.float8_e4m3fn),
                     torch.rand(L, K, device="cuda", generator=g) + 0.5,
                     (torch.randn(N, P, device="cuda", generator=g) * 4).to(torch.float8_e4m3fn),
                     torch.rand(L, N, device="cuda", generator=g) * 1e-3, offs))
        starts.append(F.pad(offs[:-1], (1, 0)) + base)
        ends.append(offs + base)
        base += P
    a = (torch.cat([s[0] for s in segs], 1), torch.stack([s[1] for s in segs]))
    b = (torch.cat([s[2] for s in segs], 1), torch.stack([s[3] for s in segs]))
    return segs, a, b, torch.stack(starts), torch.stack(ends)


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("shape", ["partial_tiles", "wide"])
def test_segments_give_the_triton_kernels_bits(first, shape):
    if shape == "partial_tiles":  # 3 micro-batches; an empty expert, a segment with one expert; partial tiles
        K, N, counts = 320, 704, [[384, 0, 128, 1024, 256, 640], [128, 256, 128, 0, 384, 128], [0, 0, 0, 0, 0, 512]]
    else:  # 4 micro-batches of 8 experts, odd and even step counts
        K, N = 1024, 2048
        g = torch.Generator().manual_seed(7)
        counts = [(torch.randint(0, 9, (8,), generator=g) * 128).tolist() for _ in range(4)]
    segs, a, b, starts, ends = _segments(counts, K, N, seed=3)
    start = torch.randn(len(counts[0]), K, N, device="cuda")
    ref = start.clone()
    tw.wgrad_segments_into(ref, a, b, starts, ends, first, fast=False)
    for config in CONFIGS:
        for unroll in (2, 3):
            got = start.clone()
            gw.wgrad_segments_into(got, a, b, starts, ends, first, config=config, unroll=unroll)
            assert torch.equal(got, ref), (first, config, unroll, (got - ref).abs().max().item())


@pytest.mark.parametrize("first", [True, False])
def test_one_micro_batch_through_the_kernels_routing(first, monkeypatch):
    """``fp8_grouped_kernels._wgrad_into`` with ``GLUON_WGRAD``: one segment on Gluon, the bits of the one-tile kernel
    (writing) and the persistent one (adding), as ``wgrad_into`` picks them by default."""
    segs, *_ = _segments([[384, 0, 128, 1024, 256, 640]], 320, 704, seed=4)
    aT, sa, bT, sb, offs = segs[0]
    start = torch.randn(6, 320, 704, device="cuda")
    ref, got = start.clone(), start.clone()
    tw.wgrad_into(ref, (aT, sa), (bT, sb), offs, first, per_expert=True, fast=False)
    monkeypatch.setattr(k, "GLUON_WGRAD", True)
    k._wgrad_into(tw, got, (aT, sa), (bT, sb), offs, first, fast=False)
    assert torch.equal(got, ref)
    monkeypatch.setattr(k, "GLUON_WGRAD", False)
    assert k._gluon_wgrad(got, False) is None and k._gluon_wgrad(got, True) is None


def test_no_tokens_writes_zeros_or_leaves_out():
    segs, a, b, starts, ends = _segments([[0, 0, 0]], 64, 128, seed=5)
    out = torch.randn(3, 64, 128, device="cuda")
    keep = out.clone()
    gw.wgrad_segments_into(out, a, b, starts, ends, False)
    assert torch.equal(out, keep)
    gw.wgrad_segments_into(out, a, b, starts, ends, True)
    assert torch.equal(out, torch.zeros_like(out))
