"""The blockwise recipe's expert GEMMs on DeepGEMM (``fp8_deepgemm.py``), on the GPU: skipped without CUDA, SM 9.0
and an importable ``deep_gemm`` (``benchmarks/prepare_deepgemm.sh`` and ``build_deepgemm.sh``, then
``PYTHONPATH=.deepgemm/src``). The real kernel against the emulation (the same quantized operands: they differ by
accumulation order and the bf16 outputs) for the experts' grouped GEMMs and a dense linear, the Triton quantizers
against their torch references bit for bit, and FP8 training steps (experts and dense layers on DeepGEMM) with no
host-device sync."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.modules import fp8_deepgemm as dgm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
deepgemm = pytest.mark.skipif(not torch.cuda.is_available() or not dgm.available(torch.device("cuda")),
                              reason="needs SM 9.0 and deep_gemm")


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _data(L=8, K=512, N=768, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    counts = torch.tensor([300, 0, 17, 513, 128, 77, 1, 1000], device="cuda")[:L]  # uneven, one empty, unaligned
    offs = counts.cumsum(0).to(torch.int32)
    M = int(counts.sum()) + 5  # 5 tail rows past the last expert
    x = (torch.randn(M, K, device="cuda", generator=g) * torch.logspace(-1, 1, K, device="cuda")).bfloat16()
    w = (torch.randn(L, K, N, device="cuda", generator=g) * 0.05).bfloat16()
    dy = (torch.randn(M, N, device="cuda", generator=g) * 1e-3).bfloat16()
    return x, w, dy, offs, int(offs[-1])


def _grouped(spec, x, w, dy, offs, valid):
    from lightning_moe.modules.fp8_grouped import fp8_grouped_mm
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_grouped_mm(x, w, offs, spec)
    y.backward(dy)
    return y[:valid], x.grad[:valid], w.grad


@deepgemm
def test_deepgemm_matches_emulation():
    from lightning_moe.modules.fp8_linear import FP8Spec
    x, w, dy, offs, valid = _data()
    calls = []
    dg = dgm.deep_gemm()
    real = dg.m_grouped_fp8_gemm_nt_contiguous
    try:
        dg.m_grouped_fp8_gemm_nt_contiguous = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        for _ in range(2):
            ref = _grouped(FP8Spec("blockwise", emulate=True), x, w, dy, offs, valid)
            got = _grouped(FP8Spec("blockwise"), x, w, dy, offs, valid)
            errs = [_rel(a, b) for a, b in zip(got, ref)]
            assert all(e < 1e-2 for e in errs), errs  # bf16 outputs: ~2^-9 per element
            ends = offs.tolist()  # per expert too: an error confined to a small expert hides in the whole
            for s, e in zip([0] + ends[:-1], ends):
                if e > s:
                    errs = [_rel(a[s:e], b[s:e]) for a, b in zip(got[:2], ref[:2])]
                    assert all(v < 1e-2 for v in errs), (s, e, errs)
    finally:
        dg.m_grouped_fp8_gemm_nt_contiguous = real
    assert calls == [1, 1] * 2  # forward and dgrad on DeepGEMM


@deepgemm
@pytest.mark.parametrize("tokens", [1000, 1024])
def test_dense_deepgemm_matches_emulation(tokens):
    """bf16 dense linears run as one expert of the grouped path (in place for 2048 tokens, padded for 2000); fp32
    ones on the dense kernel (wgrad only: its forward and dgrad write bf16)."""
    from lightning_moe.modules.fp8_linear import FP8Spec, fp8_linear
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(2, tokens, 1024, device="cuda", generator=g).bfloat16()
    w = (torch.randn(1536, 1024, device="cuda", generator=g) * 0.05).bfloat16()
    dy = (torch.randn(2, tokens, 1536, device="cuda", generator=g) * 1e-3).bfloat16()
    calls = []
    dg = dgm.deep_gemm()
    real, real_grouped = dg.fp8_gemm_nt, dg.m_grouped_fp8_gemm_nt_contiguous
    try:
        dg.fp8_gemm_nt = lambda *a, **kw: calls.append(kw.get("recipe")) or real(*a, **kw)
        dg.m_grouped_fp8_gemm_nt_contiguous = lambda *a, **kw: calls.append("grouped") or real_grouped(*a, **kw)
        for dtype, want in ((torch.bfloat16, ["grouped", "grouped"]), (torch.float32, [(1, 1, 128)])):
            out = []
            for emulate in (True, False):
                calls.clear()
                xx, ww = x.to(dtype).clone().requires_grad_(), w.to(dtype).clone().requires_grad_()
                y = fp8_linear(xx, ww, FP8Spec("blockwise", emulate=emulate))
                y.backward(dy.to(dtype))
                out.append((y, xx.grad, ww.grad))
            assert calls == want, (dtype, calls)
            errs = [_rel(a, b) for a, b in zip(out[1], out[0])]
            assert all(e < 1e-2 for e in errs), (dtype, errs)
    finally:
        dg.fp8_gemm_nt, dg.m_grouped_fp8_gemm_nt_contiguous = real, real_grouped


@deepgemm
def test_triton_quantizers_match_references_on_gpu():
    from lightning_moe.modules import triton_fp8_blockwise as tk
    x, w, _, offs, _ = _data(K=1024, N=512, seed=1)
    rows = dgm.rows_of(offs, x.shape[0])
    end = int(rows.poffs_L[-1])
    got = tk.tiles(x, rows.src_P, rows.poffs_L[-1:], "e4m3", True)
    ref = dgm.tiles_reference(x, rows.src_P, "e4m3", True, torch.bfloat16)
    assert torch.equal(got[0][:end].view(torch.uint8), ref[0][:end].view(torch.uint8))
    assert torch.equal(got[1][:, :end], ref[1][:, :end])
    assert torch.equal(got[2][:end].view(torch.int16), ref[2][:end].view(torch.int16))
    got, ref = tk.weight_blocks(w, "e4m3"), dgm.weight_blocks_reference(w, "e4m3")
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got[:2], ref[:2]))
    assert torch.equal(got[2], ref[2])


@deepgemm
def test_aligned_rows_match_the_scattered_path():
    """``rows_align=128`` (the experts' input already on DeepGEMM's 128-row boundaries) gives the scattered path's
    results on the real kernels: the same tiles, the same GEMMs."""
    from lightning_moe.modules.fp8_linear import FP8Spec
    x, w, dy, offs, valid = _data()
    counts = torch.diff(offs, prepend=offs.new_zeros(1)).long()
    sizes = (counts + 127) // 128 * 128
    dest = dgm.rows_of(offs, x.shape[0]).dest_M[:valid]  # rows_of's places are this layout's
    Ma = int(sizes.sum()) + 5
    xa, dya = x.new_zeros(Ma, x.shape[1]), dy.new_zeros(Ma, dy.shape[1])
    xa[dest], dya[dest] = x[:valid], dy[:valid]
    ref = _grouped(FP8Spec("blockwise"), x, w, dy, offs, valid)
    got = _grouped(FP8Spec("blockwise", rows_align=128), xa, w, dya, sizes.cumsum(0).to(torch.int32), Ma)
    assert torch.equal(got[0][dest], ref[0]) and torch.equal(got[1][dest], ref[1])
    assert _rel(got[2], ref[2]) < 1e-5, _rel(got[2], ref[2])  # the bf16 wgrad may split its sums otherwise


@deepgemm
@pytest.mark.parametrize("align,bf16", [(1, False), (128, False), (128, True)])
def test_blockwise_step_on_deepgemm_has_no_host_sync(align, bf16):
    """Autocast (the dense linears on the dense kernel) or bf16 weights (one expert of the grouped path)."""
    from tests.test_gpu_fp8 import _model, _train_step

    from lightning_moe import FP8Training
    lm = _model(FP8Training("blockwise"), expert_rows_align=align)
    model = lm.model.bfloat16() if bf16 else lm.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    tokens = torch.randint(0, 512, (4, 257), device="cuda")
    calls, dense = [], []
    dg = dgm.deep_gemm()
    real, real_dense = dg.m_grouped_fp8_gemm_nt_contiguous, dg.fp8_gemm_nt

    def step():
        return _train_step(model, opt, tokens)

    try:
        dg.m_grouped_fp8_gemm_nt_contiguous = lambda *a, **kw: calls.append(1) or real(*a, **kw)
        dg.fp8_gemm_nt = lambda *a, **kw: dense.append(1) or real_dense(*a, **kw)
        losses = [step() for _ in range(3)]  # warm up: DeepGEMM compiles its kernels on first use
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            losses.append(step())
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        dg.m_grouped_fp8_gemm_nt_contiguous, dg.fp8_gemm_nt = real, real_dense
    assert calls and (dense or bf16) and all(torch.isfinite(v).item() for v in losses)
    assert losses[-1].item() < losses[0].item()


@deepgemm
def test_fp8_wgrad_matches_the_bf16_wgrad(monkeypatch):
    """The wgrad on FP8 tensor cores (``triton_fp8_wgrad``: E4M3 operands, each 128-token block promoted with its
    scales, the experts' offsets read on the device) against the bf16 GEMM of the same operands dequantized: they
    differ by the bf16 rounding of those operands. Experts (scattered and aligned), the dense linear, and both into the
    main grads over two micro-batches; forward and dgrad are untouched."""
    from lightning_moe.modules.fp8_linear import FP8Spec, fp8_linear
    from lightning_moe.strategy.grad_sync import GradSync
    from lightning_moe.strategy.parallel_context import ParallelContext
    x, w, dy, offs, valid = _data()
    ends = [0] + offs.tolist()

    def main_grads(gemm, w0, xs, dys):
        p = torch.nn.Parameter(w0.clone())
        p.wgrad_fusable = True
        sync = GradSync([p], ParallelContext.single(), main_grads=True, fuse_wgrad=True)
        for i, (xi, dyi) in enumerate(zip(xs, dys)):
            if i == len(xs) - 1:
                sync.arm()
            gemm(xi.clone().requires_grad_(), p).backward(dyi)
        sync.finish()
        return p.main_grad.clone()

    got = {}
    for on in (False, True):
        monkeypatch.setattr(dgm, "FP8_WGRAD", on)
        assert dgm.fp8_wgrad(x) == on
        got[on] = (_grouped(FP8Spec("blockwise"), x, w, dy, offs, valid),
                   main_grads(lambda xi, p: dgm.grouped_mm(xi, p, offs, FP8Spec("blockwise")), w, [x, 2 * x],
                              [dy, dy]),
                   main_grads(lambda xi, p: fp8_linear(xi, p, FP8Spec("blockwise")), w[0].t().contiguous(),
                              [x[:1000], x[1000:2000]], [dy[:1000], dy[1000:2000]]))
    (y1, dx1, dw1), mg1, dense1 = got[True][0], got[True][1], got[True][2]
    (y0, dx0, dw0), mg0, dense0 = got[False][0], got[False][1], got[False][2]
    assert torch.equal(y1, y0) and torch.equal(dx1, dx0)
    for e in range(w.shape[0]):  # each expert: an error in one expert's token range hides in the whole
        if ends[e + 1] > ends[e]:
            assert _rel(dw1[e], dw0[e]) < 1e-2, (e, _rel(dw1[e], dw0[e]))
            assert _rel(mg1[e], mg0[e]) < 1e-2, (e, _rel(mg1[e], mg0[e]))
        else:
            assert not dw1[e].any() and not mg1[e].any()
    assert _rel(dense1, dense0) < 1e-2, _rel(dense1, dense0)
