"""The experts' FP8 grouped GEMM: the emulation against float64, and the kernel path (``fp8_grouped_kernels``) with a
CPU stand-in for ``torch._scaled_grouped_mm`` (the kernel's layouts, scales and alignment checked per group) against
the emulation: same quantized operands, so they agree to float32 summation order. The real kernel against the
emulation is ``tests/test_gpu_fp8.py``."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.modules import fp8_grouped_kernels as kernels
from lightning_moe.modules.fp8_grouped import fp8_grouped_mm
from lightning_moe.modules.fp8_linear import FP8Spec

L, K, N = 4, 64, 96
OFFS = [13, 13, 50, 70]  # uneven, one empty expert; 74 rows: 4 tail rows past the last expert


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(74, K, generator=g) * torch.logspace(-1, 1, K)
    w = torch.randn(L, K, N, generator=g) * 0.05
    dy = torch.randn(74, N, generator=g) * torch.logspace(-2, 0, N)
    x[70:], dy[70:] = float("nan"), float("nan")  # tail rows (dropped or foreign copies) hold anything
    return x, w, dy


def _run(x, w, dy, spec):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_grouped_mm(x, w, torch.tensor(OFFS, dtype=torch.int32), spec)
    y.backward(dy)
    return y.detach()[:70], x.grad[:70], w.grad


def _reference(x, w, dy):
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    starts = [0] + OFFS[:-1]
    y = torch.cat([xd[s:e] @ wd[g] for g, (s, e) in enumerate(zip(starts, OFFS))])
    y.backward(dy[:70].double())
    return y.detach(), xd.grad[:70], wd.grad


def _scaled_grouped_mm_on_cpu(a, b, scale_a, scale_b, offs, out_dtype, use_fast_accum):
    """``torch._scaled_grouped_mm``'s contract: E4M3, A row-major, B column-major, fp32 dequantization scales per
    row of A and column of B, groups over A's rows (2d x 3d) or over the contraction (2d x 2d, 16-aligned)."""
    assert a.dtype == b.dtype == torch.float8_e4m3fn and out_dtype == torch.bfloat16
    assert a.stride(-1) == 1 and b.stride(-2) == 1, "A row-major, B column-major"
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[2])
        assert scale_a.shape == (a.shape[0],) and scale_b.shape == (b.shape[0], b.shape[2])
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = (a[s:e].float() * scale_a[s:e, None]) @ (b[g].float() * scale_b[g][None])
        return out  # float32: the comparison sees the quantization only, not the bf16 output rounding
    m, n = a.shape[0], b.shape[1]
    assert scale_a.shape == (len(ends) * m,) and scale_b.shape == (len(ends) * n,)
    assert all(s % 16 == 0 for s in starts), "groups of the contraction start on 16-byte boundaries"
    return torch.stack([(a[:, s:e].float() * scale_a[g * m:(g + 1) * m, None])
                        @ (b[s:e].float() * scale_b[g * n:(g + 1) * n][None])
                        for g, (s, e) in enumerate(zip(starts, ends))])


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed", "rowwise", "blockwise"])
def test_emulated_grouped_against_float64(recipe):
    x, w, dy = _data()
    if recipe == "blockwise":
        x, w = torch.nn.functional.pad(x, (0, 64)), torch.nn.functional.pad(w, (0, 32, 0, 64))
        dy = torch.nn.functional.pad(dy, (0, 32))
    got = _run(x, w, dy, FP8Spec(recipe, emulate=True))
    for g, ref, bound in zip(got, _reference(x, w, dy), (0.04, 0.08, 0.08)):
        err = ((g.double() - ref).norm() / ref.norm()).item()
        assert err < bound, (recipe, err)


@pytest.mark.parametrize("recipe,fmt", [("tensorwise", "e4m3"), ("delayed", "e4m3"), ("rowwise", None),
                                        ("tensorwise", "hybrid")])
def test_kernel_path_matches_the_emulation(monkeypatch, recipe, fmt):
    """Forward, dgrad and wgrad through the kernel's layouts (transposes, 16-row padding of each expert's tokens,
    per-row and per-column scales) equal the emulation; with E5M2 gradients the backward stays emulated."""
    calls = []
    monkeypatch.setattr(kernels, "available", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm",
                        lambda *a, **kw: calls.append(a[1].dim()) or _scaled_grouped_mm_on_cpu(*a, **kw),
                        raising=False)
    x, w, dy = _data()
    for step in range(2):  # delayed: the second step's scales come from the history
        emulated = _run(x * (1 + step), w, dy, FP8Spec(recipe, emulate=True, fp8_format=fmt))
        kernel = _run(x * (1 + step), w, dy, FP8Spec(recipe, fp8_format=fmt))
        for a, b in zip(kernel, emulated):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert calls == ([3, 3, 2] if fmt != "hybrid" else [3]) * 2  # forward, dgrad, wgrad kernels per step


@pytest.mark.parametrize("path", ["emulated", "kernel"])
def test_unquantized_wgrad(monkeypatch, path):
    """``FP8Spec(fp8_wgrad=False)`` (Megatron's ``fp8_wgrad``): forward and dgrad bit for bit as with the FP8 wgrad;
    the weight gradient that of the unquantized operands (float32: float64's up to the summation order; the NaN tail
    rows never read), where the FP8 wgrad differs from it by its quantization."""
    if path == "kernel":
        monkeypatch.setattr(kernels, "available", lambda device: True)
        monkeypatch.setattr(torch, "_scaled_grouped_mm", _scaled_grouped_mm_on_cpu, raising=False)
    x, w, dy = _data()
    emulate = path == "emulated"
    y1, dx1, dw1 = _run(x, w, dy, FP8Spec("rowwise", emulate=emulate))
    y0, dx0, dw0 = _run(x, w, dy, FP8Spec("rowwise", emulate=emulate, fp8_wgrad=False))
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    ref = _reference(x, w, dy)[2]
    rel = [((dw.double() - ref).norm() / ref.norm()).item() for dw in (dw0, dw1)]
    assert rel[0] < 1e-6 and rel[1] > 1e-3, rel


@pytest.mark.parametrize("which", ["fp8-blockwise", "nvfp4"])
def test_runs_under_a_bf16_default_dtype(which):
    """``bf16-true`` makes bf16 the default dtype: the quantizers' own buffers (amaxes, scales, padded copies, random
    numbers of stochastic rounding) must stay fp32 (a bf16 buffer breaks a scatter, or coarsens the rounding)."""
    from lightning_moe.modules.nvfp4_linear import NVFP4Spec, make_hadamard, nvfp4_grouped_mm
    x, w, dy = (t.bfloat16() for t in _data())
    if which == "fp8-blockwise":
        x, w = torch.nn.functional.pad(x, (0, 64)), torch.nn.functional.pad(w, (0, 32, 0, 64))
        dy = torch.nn.functional.pad(dy, (0, 32))
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        x, w = x.requires_grad_(), w.requires_grad_()
        offs = torch.tensor(OFFS, dtype=torch.int32)
        y = (fp8_grouped_mm(x, w, offs, FP8Spec("blockwise")) if which == "fp8-blockwise"
             else nvfp4_grouped_mm(x, w, offs, NVFP4Spec(make_hadamard(0))))
        y.backward(dy)
    finally:
        torch.set_default_dtype(before)
    ref = _reference(x.detach().float(), w.detach().float(), dy.float())
    for g, r in zip((y.detach()[:70], x.grad[:70], w.grad), ref):
        assert ((g.double() - r).norm() / r.norm()).item() < 0.3
