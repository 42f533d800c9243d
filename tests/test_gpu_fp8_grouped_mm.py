"""The experts' FP8 forward/dgrad kernels on Triton (``triton_fp8_grouped_mm.py``) and, precise over a long K, Gluon
(``gluon_fp8_grouped_mm.py``) on an H100 (skipped without CUDA, triton or SM 9.0): CUTLASS's bits
(``torch._scaled_grouped_mm`` on the same E4M3 operands and scales) with both accumulations and the default tiles, at
uneven experts (empty ones, rows off the tiles' boundaries, a tail past the last expert), K short and long; and
``_ScaledGroupedMM``'s outputs and gradients the same with and without them."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.modules import fp8_grouped_kernels as k

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or not k.available(
    torch.device("cuda")), reason="needs CUDA and SM 9.0")]
tg = pytest.importorskip("lightning_moe.modules.triton_fp8_grouped_mm")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _offs(M_valid: int, L: int, g) -> torch.Tensor:
    w = torch.rand(L, generator=g, device="cuda") ** 2
    w[torch.randperm(L, generator=g, device="cuda")[:max(1, L // 8)]] = 0
    counts = (w / w.sum() * M_valid).floor().long()
    counts[int(w.argmax())] += M_valid - counts.sum()
    return counts.cumsum(0).to(torch.int32)


def _operands(M, K, N, L, seed):
    """Uneven offsets with 64 tail rows, and bf16 x (M, K), w (L, K, N), dy (M, N)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    offs = _offs(M - 64, L, g)
    return (offs, torch.randn(M, K, generator=g, device="cuda").bfloat16(),
            (torch.randn(L, K, N, generator=g, device="cuda") * 0.02).bfloat16(),
            torch.randn(M, N, generator=g, device="cuda").bfloat16())


def _quantized(M, K, N, L, seed):
    """Uneven offsets with 37 tail rows, and E4M3 a (M, K), b (L, N, K) with their dequantization scales."""
    from lightning_moe.modules import triton_fp8_quant as tq
    g = torch.Generator(device="cuda").manual_seed(seed)
    offs = _offs(M - 37, L, g)
    aq, sa = tq.rowwise_quant(torch.randn(M, K, generator=g, device="cuda").bfloat16())
    bq, sb = tq.rowwise_quant((torch.randn(L * N, K, generator=g, device="cuda") * 0.02).bfloat16())
    return offs, aq, bq.view(L, N, K), sa.reciprocal().reshape(M), sb.reciprocal().reshape(L, N)


@pytest.mark.parametrize("M,K,N,L", [(131072, 2048, 1536, 128), (131072, 768, 2048, 128), (16384, 4096, 2048, 8),
                                     (3000, 272, 208, 7)])
@pytest.mark.parametrize("fast", [False, True])
def test_matches_cutlass(M, K, N, L, fast):
    offs, aq, bq, sa, sb = _quantized(M, K, N, L, seed=M + N)
    ref = torch._scaled_grouped_mm(aq, bq.transpose(1, 2), sa, sb, offs=offs, out_dtype=torch.bfloat16,
                                   use_fast_accum=fast)
    got = tg.grouped_mm(aq, bq, sa, sb, offs, fast)
    v = int(offs[-1])
    assert torch.equal(got[:v], ref[:v]), _rel(got[:v], ref[:v])


@pytest.mark.parametrize("M,K,N,L", [(16384, 4096, 2048, 8), (8192, 4224, 208, 5), (3000, 272, 208, 7),
                                     (4096, 14336, 512, 1)])
def test_gluon_precise_gemm_matches_cutlass(M, K, N, L):
    """``gluon_fp8_grouped_mm``: CUTLASS's bits with the precise accumulation, at uneven experts (empty ones, a tail),
    an odd number of 128-deep blocks (K = 4,224 and 272: a zero block added), N off the tiles (208), one expert."""
    gm = pytest.importorskip("lightning_moe.modules.gluon_fp8_grouped_mm")
    offs, aq, bq, sa, sb = _quantized(M, K, N, L, seed=M + K)
    ref = torch._scaled_grouped_mm(aq, bq.transpose(1, 2), sa, sb, offs=offs, out_dtype=torch.bfloat16,
                                   use_fast_accum=False)
    got = gm.grouped_mm(aq, bq, sa, sb, offs)
    v = int(offs[-1])
    assert torch.equal(got[:v], ref[:v]), _rel(got[:v], ref[:v])


def test_precise_gemms_over_a_long_k_run_on_gluon(monkeypatch):
    """``_rows_gemm`` with ``LMOE_FP8_GLUON_GEMM=1`` takes the Gluon kernel for the precise accumulation from K = MIN_K
    on, triton's below and for the fast one; the same bits either way."""
    gm = pytest.importorskip("lightning_moe.modules.gluon_fp8_grouped_mm")
    from lightning_moe.modules import triton_fp8_quant as tq
    monkeypatch.setattr(k, "GLUON_GEMM", True)
    calls = []
    real = gm.grouped_mm
    monkeypatch.setattr(gm, "grouped_mm", lambda *a, **kw: calls.append(a[0].shape[1]) or real(*a, **kw))
    g = torch.Generator(device="cuda").manual_seed(0)
    for K in (gm.MIN_K - 128, gm.MIN_K):
        offs = _offs(2000, 4, g)
        aq, sa = tq.rowwise_quant(torch.randn(2048, K, generator=g, device="cuda").bfloat16())
        bq, sb = tq.rowwise_quant((torch.randn(4 * 256, K, generator=g, device="cuda") * 0.02).bfloat16())
        b = bq.view(4, 256, K).transpose(1, 2)  # (L, K, N) column-major, as _rows_gemm takes it
        sa, sb = sa.reciprocal().reshape(-1), sb.reciprocal().reshape(4, 256)
        for fast in (False, True):
            got = k._rows_gemm(aq, b, sa, sb, offs, fast)
            ref = torch._scaled_grouped_mm(aq, b, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=fast)
            assert torch.equal(got[:2000], ref[:2000]), (K, fast)
    assert calls == [gm.MIN_K]


@pytest.mark.parametrize("fast_accum", ["none", "fprop", "all"])
def test_scaled_grouped_mm_with_and_without_the_triton_gemm(fast_accum, monkeypatch):
    from lightning_moe.modules.fp8_linear import FP8Spec
    offs, x, w, dy = _operands(8192, 512, 768, 16, seed=1)
    outs, v = {}, int(offs[-1])
    for on in (False, True):
        monkeypatch.setattr(k, "TRITON_GEMM", on)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = k.scaled_grouped_mm(xg, wg, offs, FP8Spec("rowwise", fast_accum=fast_accum))
        y.backward(dy)
        outs[on] = (y[:v], xg.grad[:v], wg.grad)
    for a, b, name in zip(outs[True], outs[False], ("y", "dx", "dw")):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("defer", [False, True])
def test_unquantized_wgrad_into_main_grads(defer):
    """``FP8Spec(fp8_wgrad=False)`` under GradSync's gradient-accumulation fusion: the experts' wgrad from the
    unquantized bf16 operands, accumulated in fp32 into the main grad over two micro-batches (float64's up to the
    summation order), at each micro-batch or (``defer``) once over both at the armed backward; the dgrad that of the
    FP8 wgrad's run, bit for bit."""
    from lightning_moe.modules.fp8_grouped import fp8_grouped_mm
    from lightning_moe.modules.fp8_linear import FP8Spec
    from lightning_moe.strategy.grad_sync import GradSync
    from lightning_moe.strategy.parallel_context import ParallelContext
    offs, x, w, dy = _operands(4096, 512, 768, 8, seed=3)
    p = torch.nn.Parameter(w.clone())
    p.wgrad_fusable = True
    sync = GradSync([p], ParallelContext.single(), main_grads=True, fuse_wgrad=True)
    dxs = []
    for i, scale in enumerate((1.0, 2.0)):
        if i == 1:
            sync.arm()
        xg = x.clone().requires_grad_()
        fp8_grouped_mm(xg, p, offs, FP8Spec("rowwise", fp8_wgrad=False, defer_wgrad=defer)).backward(dy * scale)
        dxs.append(xg.grad)
        assert len(sync.held(p)) == (defer and i == 0)
    sync.finish()
    xf = x.clone().requires_grad_()
    fp8_grouped_mm(xf, w.clone().requires_grad_(), offs, FP8Spec("rowwise")).backward(dy)
    v = int(offs[-1])
    assert torch.equal(dxs[0][:v], xf.grad[:v])
    ends = [0] + offs.tolist()
    ref = torch.stack([3 * x[s:e].double().t() @ dy[s:e].double() for s, e in zip(ends[:-1], ends[1:])])
    assert _rel(p.main_grad.double(), ref) < 1e-5
