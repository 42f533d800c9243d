"""The SwiGLU fused with the rowwise FP8 quantization (``triton_fp8_swiglu``) on CPU under the Triton interpreter,
against the kernels it fuses: ``triton_swiglu``'s forward and backward, then ``triton_fp8_quant.rowwise_quant_col_amax``
of their output. Values, FP8 bytes, scales and per-expert column amaxes bit for bit; the row weights' gradient (summed
in another order) within fp32 rounding. Weighted and not, uneven and empty experts, NaN tail rows past offs[-1], row
blocks kept in registers and read back (wide rows), column blocks of 128 and 256. Skipped without triton (CI). Run in a
fresh process with ``TRITON_INTERPRET=1``, as ``test_fused_interpret.py`` explains."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.modules.interpreted import INSIDE, run_interpreted  # noqa: E402
from tests.modules.test_triton_fp8_quant_col_amax import _same_amax, _same_bits  # noqa: E402


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_kernels_under_the_interpreter():
    run_interpreted(__file__, timeout=600, passed=17)


inside = pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")

# config tuples: rows kept (column maxes in bf16), and read back from what the kernel wrote (under a register cap)
KEPT, READ_BACK = (8, 2, 128, 4, 3, True, True, None), (8, 2, 128, 4, 1, False, False, 64)
READ_BACK_BF16 = (8, 1, 128, 4, 1, False, True, None)
CASES = [([5, 0, 9, 3], 2, 256, False, None), ([5, 0, 9, 3], 2, 256, True, None), ([7, 11], 0, 384, True, None),
         ([4, 6, 0, 7], 3, 256, True, KEPT), ([4, 6, 0, 7], 3, 256, True, READ_BACK),
         ([4, 6, 0, 7], 3, 256, False, READ_BACK_BF16)]


def _inputs(counts, tail: int, F: int, weighted: bool, seed: int):
    from lightning_moe.modules.fp8_grouped import expert_of_rows
    g = torch.Generator().manual_seed(seed)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    end = int(offs[-1])
    M = end + tail
    h = (torch.randn(M, 2 * F, generator=g) * torch.logspace(-2, 1, M).unsqueeze(1)).to(torch.bfloat16)
    dy = (torch.randn(M, F, generator=g) * 1e-3).to(torch.bfloat16)
    if M > 2:
        h[1] = 0  # an all-zero row: scale from the tiny floor
    h[end:] = float("nan")
    p = torch.rand(M, generator=g) if weighted else None
    return h, dy, p, offs, expert_of_rows(M, offs, h.device)


@inside
@pytest.mark.parametrize("counts,tail,F,weighted,cfg", CASES)
def test_forward_gives_the_two_kernels_bits(counts, tail, F, weighted, cfg):
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules import triton_fp8_swiglu as ts
    from lightning_moe.modules import triton_swiglu
    h, _, p, offs, gid = _inputs(counts, tail, F, weighted, seed=F + len(counts))
    a, q, s, amax = ts.swiglu_quant(h, p, offs, gid, cfg=cfg)
    ra = triton_swiglu.forward(h, p)
    rq, rs, ramax = tq.rowwise_quant_col_amax(ra, offs, gid, inverse=True)
    _same_bits(a, ra)
    _same_bits(q, rq)
    _same_bits(s, rs)
    _same_amax(amax, ramax)


@inside
@pytest.mark.parametrize("counts,tail,F,weighted,cfg", CASES)
def test_backward_gives_the_two_kernels_bits(counts, tail, F, weighted, cfg):
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules import triton_fp8_swiglu as ts
    from lightning_moe.modules import triton_swiglu
    h, dy, p, offs, gid = _inputs(counts, tail, F, weighted, seed=3 * F + len(counts))
    dh, gp, q, s, amax = ts.swiglu_backward_quant(dy, h, p, offs, gid, cfg=cfg)
    rdh, rgp = triton_swiglu.backward(dy, h, p)
    rq, rs, ramax = tq.rowwise_quant_col_amax(rdh, offs, gid, inverse=True)
    _same_bits(dh, rdh)
    _same_bits(q, rq)
    _same_bits(s, rs)
    _same_amax(amax, ramax)
    if weighted:
        end = int(offs[-1])  # tail rows: NaN in both
        torch.testing.assert_close(gp[:end], rgp[:end], rtol=1e-5, atol=1e-7)
        assert gp[end:].isnan().all() and rgp[end:].isnan().all()
    else:
        assert gp is None and rgp is None


@inside
@pytest.mark.parametrize("weighted", [False, True])
def test_fused_swiglu_hands_its_quantization_over(weighted):
    """``fp8_swiglu`` (the autograd function): ``swiglu``'s values and gradients, bit for bit, and the handoffs hold
    the rowwise quantization of exactly its output and of its input gradient."""
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules.experts import swiglu
    from lightning_moe.modules.fp8_swiglu import Handoff, fp8_swiglu
    h, dy, p, offs, gid = _inputs([5, 0, 9, 3], 2, 256, weighted, seed=11)
    h = h.nan_to_num()  # finite tail rows: the gradients are compared whole
    hand = Handoff()
    outs = []
    for fused in (False, True):
        hh = h.clone().requires_grad_()
        pp = p.clone().requires_grad_() if weighted else None
        if fused:
            hand.rows = (h.shape[0], offs, gid)
            a = fp8_swiglu(hh, pp, hand)
            q, inv, amax = hand.take("forward", a)
            for got, want in zip((q, inv, amax), tq.rowwise_quant_col_amax(a.detach(), offs, gid, inverse=True)):
                _same_bits(got, want)
        else:
            a = swiglu(hh, pp)
        a.backward(dy)
        if fused:  # h.grad is a copy of what the handoff holds (AccumulateGrad clones a gradient held elsewhere)
            dh = hand.backward[0]
            _same_bits(dh, hh.grad)
            q, inv, amax = hand.take("backward", dh)
            for got, want in zip((q, inv, amax), tq.rowwise_quant_col_amax(hh.grad, offs, gid, inverse=True)):
                _same_bits(got, want)
        outs.append((a.detach(), hh.grad, pp.grad if weighted else None))
    _same_bits(outs[0][0], outs[1][0])
    _same_bits(outs[0][1], outs[1][1])
    if weighted:
        torch.testing.assert_close(outs[1][2], outs[0][2], rtol=1e-5, atol=1e-7)
    assert hand.rows is None and hand.forward is None and hand.backward is None


@inside
def test_a_rebuild_in_backward_hands_nothing_over():
    """Recompute's rebuild (no grad, inside backward) runs the plain SwiGLU: no fc2 would take a handoff."""
    from lightning_moe.modules.fp8_swiglu import Handoff, fp8_swiglu
    h, _, _, offs, gid = _inputs([5, 9], 0, 256, False, seed=12)
    hand, seen = Handoff(), []

    class Rebuild(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            hand.rows = (h.shape[0], offs, gid)
            with torch.no_grad():
                fp8_swiglu(h, None, hand)
            seen.append(hand.forward)
            return g

    Rebuild.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [None]
    hand.rows = (h.shape[0], offs, gid)
    with torch.no_grad():  # evaluation, outside backward: fc2 follows, so it is handed over
        a = fp8_swiglu(h, None, hand)
    assert hand.take("forward", a) is not None


@inside
def test_evaluation_under_inference_mode_hands_over():
    """Lightning evaluates under ``torch.inference_mode()``: its tensors have no version to key the handoff with."""
    from lightning_moe.modules.fp8_swiglu import Handoff, fp8_swiglu
    h, _, p, offs, gid = _inputs([5, 9], 0, 256, True, seed=13)
    hand = Handoff()
    with torch.inference_mode():
        hand.rows = (h.shape[0], offs, gid)
        a = fp8_swiglu(h, p, hand)
        assert hand.take("forward", a) is not None


@inside
def test_without_an_input_gradient_nothing_is_handed_back():
    """Frozen h (only the row weights train): the row weights' gradient, and no dh handoff that no fc1 would take."""
    from lightning_moe.modules.experts import swiglu
    from lightning_moe.modules.fp8_swiglu import Handoff, fp8_swiglu
    h, dy, p, offs, gid = _inputs([5, 9], 0, 256, True, seed=14)
    hand = Handoff()
    hand.rows = (h.shape[0], offs, gid)
    pp, rp = p.clone().requires_grad_(), p.clone().requires_grad_()
    fp8_swiglu(h, pp, hand).backward(dy)
    swiglu(h, rp).backward(dy)
    assert hand.backward is None
    _same_bits(pp.grad, rp.grad)  # the plain kernel's, here
