"""The warp-specialized persistent Gluon FP8 grouped GEMM (``gluon_fp8_grouped_ws.py``) on an H100 (skipped without
CUDA, triton or SM 9.0): the bits of ``triton_fp8_grouped_mm``'s fast accumulation at uneven experts (empty ones,
rows off the tiles' boundaries, a tail past the last expert), K short and long, N off the tiles, one expert, fewer
programs than tiles; and the rows past an expert's end that a cut tile never writes."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.modules import fp8_grouped_kernels as k

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or not k.available(
    torch.device("cuda")), reason="needs CUDA and SM 9.0")]
tg = pytest.importorskip("lightning_moe.modules.triton_fp8_grouped_mm")
gw = pytest.importorskip("lightning_moe.modules.gluon_fp8_grouped_ws")


def _quantized(M, K, N, L, seed, tail=37):
    """Uneven offsets (some experts empty) with ``tail`` rows past the last expert, E4M3 operands and scales."""
    from lightning_moe.modules import triton_fp8_quant as tq
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.rand(L, generator=g, device="cuda") ** 2
    w[torch.randperm(L, generator=g, device="cuda")[:max(1, L // 8)]] = 0 if L > 1 else 1
    counts = (w / w.sum() * (M - tail)).floor().long()
    counts[int(w.argmax())] += M - tail - counts.sum()
    offs = counts.cumsum(0).to(torch.int32)
    aq, sa = tq.rowwise_quant(torch.randn(M, K, generator=g, device="cuda").bfloat16())
    bq, sb = tq.rowwise_quant((torch.randn(L * N, K, generator=g, device="cuda") * 0.02).bfloat16())
    return offs, aq, bq.view(L, N, K), sa.reciprocal().reshape(M), sb.reciprocal().reshape(L, N)


SHIFTED = [(128, 256, 8, 4, 1, 1), (128, 128, 4, 4, 2, 1)]  # cut tiles moved up to their expert's end


@pytest.mark.parametrize("M,K,N,L", [(131072 // 4, 2048, 1536, 128), (16384, 4096, 2048, 8), (3000, 272, 208, 7),
                                     (4096, 1024, 512, 1)])
@pytest.mark.parametrize("config", [None, (128, 128, 4, 5, 2)] + SHIFTED)
def test_gluon_ws_gemm_gives_the_triton_bits(M, K, N, L, config):
    offs, aq, bq, sa, sb = _quantized(M, K, N, L, seed=M + K)
    ref = tg.grouped_mm(aq, bq, sa, sb, offs, True)
    got = gw.grouped_mm(aq, bq, sa, sb, offs, config, programs=37)
    v = int(offs[-1])
    assert torch.equal(got[:v], ref[:v])


@pytest.mark.parametrize("config", [None] + SHIFTED)
def test_a_cut_tile_leaves_the_next_experts_rows(config):
    """Two experts of 100 and 300 rows: the first's only tile is cut at row 100; the second's rows are its own
    product, whichever tile finished last (shifted: its last tile covers rows 272-400, over its second's)."""
    from lightning_moe.modules import triton_fp8_quant as tq
    g = torch.Generator(device="cuda").manual_seed(3)
    offs = torch.tensor([100, 400], device="cuda", dtype=torch.int32)
    aq, sa = tq.rowwise_quant(torch.randn(400, 256, generator=g, device="cuda").bfloat16())
    bq, sb = tq.rowwise_quant((torch.randn(2 * 512, 256, generator=g, device="cuda") * 0.02).bfloat16())
    args = (aq, bq.view(2, 512, 256), sa.reciprocal().reshape(400), sb.reciprocal().reshape(2, 512), offs)
    for _ in range(5):
        assert torch.equal(gw.grouped_mm(*args, config), tg.grouped_mm(*args, True))


@pytest.mark.parametrize("fast_accum", ["fprop", "all"])
def test_scaled_grouped_mm_with_and_without_the_gluon_kernels(fast_accum, monkeypatch):
    """The experts' FP8 GEMMs through ``_ScaledGroupedMM`` (forward, dgrad, wgrad) with the Gluon kernels (this GEMM
    on, and ``triton_fp8_wgrad.GLUON``) and with triton's alone: the same output and gradients, bit for bit."""
    from lightning_moe.modules import triton_fp8_wgrad as tw
    from lightning_moe.modules.fp8_linear import FP8Spec
    g = torch.Generator(device="cuda").manual_seed(5)
    offs = torch.tensor([700, 700, 2000, 4000], device="cuda", dtype=torch.int32)  # one empty expert, cut tiles
    x = torch.randn(4096, 512, generator=g, device="cuda").bfloat16()
    w = (torch.randn(4, 512, 768, generator=g, device="cuda") * 0.02).bfloat16()
    dy = torch.randn(4096, 768, generator=g, device="cuda").bfloat16()
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(k, "GLUON_WS_GEMM", on)
        monkeypatch.setattr(k, "GLUON_WS_NARROW", on)
        monkeypatch.setattr(tw, "GLUON", on)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = k.scaled_grouped_mm(xg, wg, offs, FP8Spec("rowwise", fast_accum=fast_accum))
        y.backward(dy)
        outs[on] = (y[:4000], xg.grad[:4000], wg.grad)
    for a, b, name in zip(outs[True], outs[False], ("y", "dx", "dw")):
        assert torch.equal(a, b), name
