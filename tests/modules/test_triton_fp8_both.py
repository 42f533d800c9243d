"""Per-expert FP8 quantization into both layouts in one pass (``triton_fp8_both``) on CPU under the Triton
interpreter, against torch's formula (``fp8._saturate`` with each expert's scale), the transposed padded layout of
``quant_t_padded`` and the SwiGLU kernels whose output it quantizes without writing. Bytes bit for bit, amaxes
exactly; uneven and empty experts, NaN tail rows past offs[-1] (never read), blocks of one expert and blocks across
experts, a strided ``out``. Skipped without triton (CI). Run in a fresh process with ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.modules.interpreted import INSIDE, run_interpreted  # noqa: E402


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_kernels_under_the_interpreter():
    run_interpreted(__file__, timeout=600, passed=12)


inside = pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")

# (counts, tail rows, width, layout alignment, config): one expert per block (align a multiple of BLOCK_P) or not;
# a program over LOOP column blocks (the last program's past the width: 96 columns are three blocks of 32), or
# over one in straight-line code (LOOP 0)
CASES = [([5, 0, 9, 3], 2, 96, 16, (16, 32, 4)), ([5, 0, 9, 3], 2, 96, 16, (32, 32, 4)),
         ([40, 7, 0, 21], 0, 64, 128, None), ([3], 1, 80, 16, (16, 64, 4)),
         ([5, 0, 9, 3], 2, 96, 16, (16, 32, 4, 2, 2)), ([40, 7, 0, 21], 0, 96, 32, (32, 32, 4, 2, 3)),
         ([5, 0, 9, 3], 2, 96, 16, (16, 32, 4, 0, 1))]


def _layout(counts, tail: int, align: int):
    from lightning_moe.modules.expert_padding import fp8_rows_layout
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    M = int(offs[-1]) + tail
    gid_M, poffs, P, gid_P = fp8_rows_layout(offs, M, align)
    return offs, M, gid_M, poffs, P, gid_P


def _amaxes(L: int, seed: int, H: int = 3) -> torch.Tensor:
    """A delayed history's amaxes (H, L): an expert's scale comes from their max."""
    return torch.rand(H, L, generator=torch.Generator().manual_seed(seed)) * 300 + 0.5


def _check(x_MX, out: tuple, amax_HL, offs, poffs, gid_M):
    """q's rows of experts (torch's formula with the expert's scale: ``scale_of`` of the max of its amaxes), qT
    (each expert's q rows transposed at its padded start, zeros elsewhere), the dequantization scales per row and per
    expert (torch's reciprocals; 1 for an empty expert), amax (each expert's max |x|)."""
    from lightning_moe.modules.fp8 import _saturate, scale_of
    q, qt, inv_M, inv_L, amax = out
    scale_L = scale_of(amax_HL.amax(0), "e4m3")
    end = int(offs[-1])
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    assert torch.equal(inv_M[:end], scale_L.reciprocal()[gid_M[:end].long()])
    assert torch.equal(inv_L, torch.where(counts > 0, scale_L.reciprocal(), 1.0))
    ref = _saturate(x_MX[:end], scale_L[gid_M[:end].long()].unsqueeze(1), 448.0, torch.float8_e4m3fn)
    assert torch.equal(q[:end].view(torch.uint8), ref.view(torch.uint8))
    want = torch.zeros(qt.shape, dtype=torch.uint8, device=qt.device)
    starts = [0] + offs[:-1].tolist()
    pstarts = [0] + poffs[:-1].tolist()
    for e, (s0, s1, p0) in enumerate(zip(starts, offs.tolist(), pstarts)):
        want[:, p0:p0 + s1 - s0] = ref[s0:s1].view(torch.uint8).t()
        rows = x_MX[s0:s1].float().abs()
        assert float(amax[e]) == (float(rows.max()) if s1 > s0 else 0.0), e
    end_p = int(poffs[-1])  # past it: never written, never read
    assert torch.equal(qt[:, :end_p].view(torch.uint8), want[:, :end_p])


@inside
@pytest.mark.parametrize("counts,tail,X,align,cfg", CASES)
def test_quant_both_gives_the_formula_in_both_layouts(counts, tail, X, align, cfg):
    from lightning_moe.modules import triton_fp8_both as tb
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules.fp8 import scale_of
    offs, M, gid_M, poffs, P, gid_P = _layout(counts, tail, align)
    g = torch.Generator().manual_seed(X + M)
    x = (torch.randn(M, X, generator=g) * torch.logspace(-3, 2, M).unsqueeze(1)).to(torch.bfloat16)
    x[int(offs[-1]):] = float("nan")
    if M > 3:
        x[2, :5] = 1e6  # saturates
    hist = _amaxes(len(counts), seed=X)
    out = tb.quant_both(x, hist, offs, poffs, gid_P, P, align=align, cfg=cfg)
    _check(x, out, hist, offs, poffs, gid_M)
    qt = out[1]
    scale = scale_of(hist.amax(0), "e4m3")
    ref_t = tq.quant_t_padded(x, scale.unsqueeze(1).expand(-1, X), offs, poffs, gid_P, P, align=align)
    end_p = int(poffs[-1])
    assert torch.equal(qt[:, :end_p].view(torch.uint8), ref_t[:, :end_p].view(torch.uint8))


@inside
def test_quant_both_writes_into_a_strided_out():
    from lightning_moe.modules import triton_fp8_both as tb
    offs, M, gid_M, poffs, P, gid_P = _layout([5, 0, 9, 3], 2, 16)
    x = torch.randn(M, 48, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    arena = torch.full((48, P + 40), 7, dtype=torch.uint8).view(torch.float8_e4m3fn)
    out = arena[:, 24:24 + P]
    res = tb.quant_both(x, _amaxes(4, 2, H=1), offs, poffs, gid_P, P, out=out, align=16, cfg=(16, 16, 4))
    assert res[1].data_ptr() == out.data_ptr()
    _check(x, res, _amaxes(4, 2, H=1), offs, poffs, gid_M)
    assert (arena.view(torch.uint8)[:, :24] == 7).all() and (arena.view(torch.uint8)[:, 24 + P:] == 7).all()
    with pytest.raises(ValueError, match="want"):
        tb.quant_both(x, _amaxes(4, 2), offs, poffs, gid_P, P, out=arena[:, :P + 1], align=16)
    with pytest.raises(ValueError, match="float32 operands are not supported"):  # wrong on an H100: refused
        tb.quant_both(x.float(), _amaxes(4, 2), offs, poffs, gid_P, P, align=16)


def _swiglu_inputs(counts, tail: int, F: int, weighted: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    M = sum(counts) + tail
    h = (torch.randn(M, 2 * F, generator=g) * torch.logspace(-2, 1, M).unsqueeze(1)).to(torch.bfloat16)
    dy = (torch.randn(M, F, generator=g) * 1e-3).to(torch.bfloat16)
    h[sum(counts):] = float("nan")
    return h, dy, torch.rand(M, generator=g) if weighted else None


@inside
@pytest.mark.parametrize("weighted,align,cfg", [(False, 16, (16, 32, 4)), (True, 16, (32, 32, 4)),
                                                (True, 128, None),
                                                (True, 16, (16, 32, 4, 2, 2)), (False, 16, (16, 32, 4, 0, 1))])
def test_swiglu_both_quantizes_the_swiglu_kernels_output(weighted, align, cfg):
    from lightning_moe.modules import triton_fp8_both as tb
    from lightning_moe.modules import triton_swiglu
    counts, F = [5, 0, 9, 3], 96
    offs, M, gid_M, poffs, P, gid_P = _layout(counts, 2, align)
    h, _, p = _swiglu_inputs(counts, 2, F, weighted, seed=F)
    hist = _amaxes(4, seed=3)
    out = tb.swiglu_both(h, p, hist, offs, poffs, gid_P, P, align=align, cfg=cfg)
    _check(triton_swiglu.forward(h, p), out, hist, offs, poffs, gid_M)


@inside
@pytest.mark.parametrize("weighted,align,cfg", [(False, 16, (16, 32, 4)), (True, 16, (32, 32, 4)),
                                                (True, 128, None),
                                                (True, 16, (16, 32, 4, 2, 2)), (False, 16, (16, 32, 4, 0, 1))])
def test_swiglu_backward_both_quantizes_the_swiglu_gradient(weighted, align, cfg):
    from lightning_moe.modules import triton_fp8_both as tb
    from lightning_moe.modules import triton_swiglu
    counts, F = [5, 0, 9, 3], 96
    offs, M, gid_M, poffs, P, gid_P = _layout(counts, 2, align)
    h, dy, p = _swiglu_inputs(counts, 2, F, weighted, seed=2 * F)
    hist = _amaxes(4, seed=4)
    *out, gp = tb.swiglu_backward_both(dy, h, p, hist, offs, poffs, gid_P, P, align=align, cfg=cfg)
    dh, rgp = triton_swiglu.backward(dy, h, p)
    _check(dh, out, hist, offs, poffs, gid_M)
    if weighted:
        end = int(offs[-1])
        torch.testing.assert_close(gp[:end], rgp[:end], rtol=1e-5, atol=1e-7)
    else:
        assert gp is None and rgp is None


@inside
def test_dense_path_validation_shares_the_weight_copy_and_histories(monkeypatch):
    """The dense linear on ``fp8_linear_both`` (forced here: the interpreter runs its pass, ``torch._scaled_mm`` runs
    on the CPU): a forward without grad between training steps (validation) takes the same path, so the weight's
    delayed history advances once per step and one weight copy is cached; the results are the separate passes' bits
    while no validation intervenes."""
    from lightning_moe.modules import fp8_linear_both
    from lightning_moe.modules import triton_fp8_both as tb
    from lightning_moe.modules.fp8_linear import FP8Spec, fp8_linear
    monkeypatch.setattr(fp8_linear_both, "kernels", lambda spec, t: tb if spec.formats() == ("e4m3", "e4m3") else None)
    torch.manual_seed(0)
    x0, w0 = torch.randn(256, 64).bfloat16(), (torch.randn(96, 64) * 0.05).bfloat16()
    runs = {}
    for both in (True, False):
        if not both:
            monkeypatch.setattr(fp8_linear_both, "kernels", lambda spec, t: None)
        spec = FP8Spec("delayed", fp8_format="e4m3", history=4)
        out = []
        for step in range(3):
            spec.step = step
            x, w = (x0 * (step + 1)).requires_grad_(), w0.clone().requires_grad_()
            y = fp8_linear(x, w, spec)
            y.float().square().sum().backward()
            out.append((y.detach(), x.grad, w.grad))
        runs[both] = out
        if both:
            assert spec.histories["w"].pushed == 3 and list(spec.weights) == ["w_both"]
            with torch.no_grad():  # validation at the last step: the cached copy, no new push
                fp8_linear(x0, w, spec)
            assert spec.histories["w"].pushed == 3 and spec.histories["x"].pushed == 4
    for a, b in zip(runs[True], runs[False]):
        assert all(torch.equal(p, q) for p, q in zip(a, b))
