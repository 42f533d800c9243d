"""Per-expert FP8 quantization into both layouts (``triton_fp8_both``) on the GPU (skipped without CUDA): the bytes of
torch's formula with each expert's scale, row-major and in the wgrad's padded transposed layout, exact amaxes, and
the SwiGLU kernels' bits (with the GPU's FMA contraction) for the fused forward and backward."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _layout(counts, tail: int, align: int):
    from lightning_moe.modules.expert_padding import fp8_rows_layout
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    M = sum(counts) + tail
    gid_M, poffs, P, gid_P = fp8_rows_layout(offs, M, align)
    return offs, M, gid_M, poffs, P, gid_P


def _check(x_MX, q, qt, amax, scale_L, offs, poffs, gid_M):
    from lightning_moe.modules.fp8 import _saturate
    end = int(offs[-1])
    ref = _saturate(x_MX[:end], scale_L[gid_M[:end].long()].unsqueeze(1), 448.0, torch.float8_e4m3fn)
    assert torch.equal(q[:end].view(torch.uint8), ref.view(torch.uint8))
    want = torch.zeros(qt.shape, dtype=torch.uint8, device="cuda")
    starts, pstarts = [0] + offs[:-1].tolist(), [0] + poffs[:-1].tolist()
    for e, (s0, s1, p0) in enumerate(zip(starts, offs.tolist(), pstarts)):
        want[:, p0:p0 + s1 - s0] = ref[s0:s1].view(torch.uint8).t()
        assert float(amax[e]) == (float(x_MX[s0:s1].float().abs().max()) if s1 > s0 else 0.0), e
    assert torch.equal(qt.view(torch.uint8), want)


CASES = [([300, 0, 1024, 77], 5, 128), ([1024] * 6, 0, 128), ([40, 0, 300, 17], 3, 16)]


@pytest.mark.parametrize("counts,tail,align", CASES)
@pytest.mark.parametrize("X", [2048, 768])
def test_quant_both_gives_the_formula(counts, tail, align, X):
    from lightning_moe.modules import triton_fp8_both as tb
    offs, M, gid_M, poffs, P, gid_P = _layout(counts, tail, align)
    x = (torch.randn(M, X, device="cuda") * torch.logspace(-3, 2, M, device="cuda").unsqueeze(1)).to(torch.bfloat16)
    x[int(offs[-1]):] = float("nan")
    scale = torch.rand(len(counts), device="cuda") * 300 + 0.5
    q, qt, amax = tb.quant_both(x, scale, offs, poffs, gid_P, P, align=align)
    _check(x, q, qt, amax, scale, offs, poffs, gid_M)


@pytest.mark.parametrize("counts,tail,align", CASES)
@pytest.mark.parametrize("weighted", [False, True])
def test_swiglu_both_gives_the_swiglu_kernels_bits(counts, tail, align, weighted):
    from lightning_moe.modules import triton_fp8_both as tb
    from lightning_moe.modules import triton_swiglu
    F = 768
    offs, M, gid_M, poffs, P, gid_P = _layout(counts, tail, align)
    g = torch.Generator("cuda").manual_seed(M)
    h = (torch.randn(M, 2 * F, device="cuda", generator=g) * 2).to(torch.bfloat16)
    dy = (torch.randn(M, F, device="cuda", generator=g) * 1e-2).to(torch.bfloat16)
    p = torch.rand(M, device="cuda", generator=g) if weighted else None
    scale = torch.rand(len(counts), device="cuda", generator=g) * 300 + 0.5
    q, qt, amax = tb.swiglu_both(h, p, scale, offs, poffs, gid_P, P, align=align)
    _check(triton_swiglu.forward(h, p), q, qt, amax, scale, offs, poffs, gid_M)
    q, qt, amax, gp = tb.swiglu_backward_both(dy, h, p, scale, offs, poffs, gid_P, P, align=align)
    dh, rgp = triton_swiglu.backward(dy, h, p)
    _check(dh, q, qt, amax, scale, offs, poffs, gid_M)
    if weighted:
        end = int(offs[-1])
        torch.testing.assert_close(gp[:end], rgp[:end], rtol=1e-5, atol=1e-6)
