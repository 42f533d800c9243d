"""The experts' SwiGLU fused with the FP8 quantization of what it makes, for the FP8 GEMMs on either side
(``FP8Training`` swaps it into ``experts.act`` where both of the experts' GEMMs quantize on the Triton kernels):

  dispatch       x gathered into expert order, and x's rowwise FP8 copy and scales  -> Handoff.input
  fc1 forward    takes them for its input, instead of a pass over x; the rows' experts -> Handoff.rows
  act forward    a = SwiGLU(h), and a's rowwise FP8 copy, scales, column amaxes    -> Handoff.forward
  fc2 forward    takes them for its input, instead of a pass over a
  combine bwd    dy gathered back into expert order, and dy's rowwise FP8 copy and scales -> Handoff.grad_out
  fc2 backward   takes them for its output gradient, instead of a pass over dy
  act backward   dh, and dh's rowwise FP8 copy, scales, column amaxes              -> Handoff.backward
  fc1 backward   takes them for its output gradient, instead of a pass over dh

Each fused kernel reads SwiGLU's inputs once (``triton_fp8_swiglu``): a and dh are no longer read back by a separate
quantization pass. The permutes' gathers (``triton_fp8_gather``; the dispatcher's ``fp8_rows``, where its gathered
rows are the experts' own input and its combine's gather their output gradient: one rank, no masked tail) quantize
the rows they gather, so x and dy are not read back either; their column amaxes (an FP8 wgrad's) then come from a pass
of their own in backward. a, dh, x, dy, their FP8 copies, scales and amaxes are the unfused path's bits; the row
weights' gradient (the router's, through ``probs_in_experts``) sums the same terms in another order, so it may differ
in its last bits.
A GEMM takes a handoff only for the very tensor it was made for (same storage, shape, strides and version; inference
tensors have no version); anything else (another caller, an in-place change) quantizes as before. One ``Handoff`` per
experts module holds at most one of each, dropped when taken or replaced.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Optional

import torch

from lightning_moe.modules import kernels

ENABLED = os.environ.get("LMOE_FP8_FUSED_SWIGLU", "1") != "0"  # 0: the unfused passes, for comparisons
PERMUTE = os.environ.get("LMOE_FP8_FUSED_PERMUTE", "1") != "0"  # 0: the permutes do not quantize, for comparisons


def tensor_key(t: torch.Tensor) -> tuple:
    # an inference tensor (Lightning's evaluation loops run under inference_mode) tracks no version
    return t.data_ptr(), t.shape, t.stride(), t.dtype, None if t.is_inference() else t._version


class Handoff:
    """What the experts' SwiGLU, their two FP8 GEMMs and the MoE layer's permutes pass each other (above). No parallel
    state: one per experts module, referenced by its activation, as ``(handoff, "fc1" | "fc2")`` by its GEMMs'
    ``FP8Spec.handoff``, and as ``fp8_rows`` by the layer's dispatcher."""

    def __init__(self, both: Optional[tuple] = None):
        self.input: Optional[tuple] = None  # (x, its key, (q, dequantization scales, None)): the dispatch's
        self.grad_out: Optional[tuple] = None  # (dy, its key, ...): the combine's backward
        self.rows: Optional[tuple] = None  # (M, offs_L int32, gid_M int32[, layout]) of fc1's last forward
        self.forward: Optional[tuple] = None  # (a, its key, (q, dequantization scales, column amaxes))
        self.backward: Optional[tuple] = None  # (dh, its key, ...)
        # (spec_fc1, spec_fc2, w2) where the GEMMs quantize per expert into both layouts (``fp8_grouped_both``, the
        # delayed recipe): a and dh are then handed over as (q, qT, dequantization scales) and never written
        self.both = both
        self.probs: Optional[tuple] = None  # (p,): the rows' weights for fc1's epilogue (``prepare``), taken by fc1
        self.premade: Optional[tuple] = None  # (h, its key, (p, (q, qT, ...), amax)): a made by fc1's epilogue

    def put(self, which: str, t: torch.Tensor, quantized: tuple, unwritten: bool = False) -> None:
        # t itself is held too: while the handoff lives, no other tensor can take its memory and match its key
        setattr(self, which, (t, tensor_key(t), quantized, unwritten))

    def take(self, which: str, t: torch.Tensor) -> Optional[tuple]:
        """The quantization made with ``t``, if ``t`` is what it was made for; dropped either way. A tensor handed
        over ``unwritten`` (only its quantization holds its values) that reaches another tensor's GEMM is an error,
        not a silent read of memory never written."""
        held = getattr(self, which)
        setattr(self, which, None)
        if held is not None and held[1] == tensor_key(t):
            return held[2]
        if held is not None and held[3]:
            raise RuntimeError(f"fp8_swiglu: the fused SwiGLU's {which} output was never written (its FP8 copies "
                               "stand for it) and a GEMM got another tensor; set LMOE_FP8_FUSED_SWIGLU=0")
        return None

    def take_rows(self, M: int) -> Optional[tuple]:
        rows, self.rows = self.rows, None
        return rows[1:] if rows is not None and rows[0] == M else None


class _FP8SwiGLU(torch.autograd.Function):
    """``experts._SwiGLU`` (``triton_swiglu``'s bits, but for the row weights' gradient, summed in another order),
    quantizing its output in forward and its input gradient in backward for the neighbouring FP8 GEMMs. Keeps h, p and
    the rows' experts."""

    @staticmethod
    def forward(ctx, h_M2F, p_M, offs_L, gid_M, hand: Handoff, fmt: str):
        from lightning_moe.modules import triton_fp8_swiglu as tsw
        a_MF, q, inv, amax = tsw.swiglu_quant(h_M2F, p_M, offs_L, gid_M, fmt)
        hand.put("forward", a_MF, (q, inv, amax))
        ctx.save_for_backward(h_M2F, p_M, offs_L, gid_M)
        ctx.hand, ctx.fmt = hand, fmt
        return a_MF

    @staticmethod
    def backward(ctx, g_MF):
        from lightning_moe.modules import triton_fp8_swiglu as tsw
        h_M2F, p_M, offs_L, gid_M = ctx.saved_tensors
        # fc2 has run: a forward handoff left now was never taken (another caller of act), nor a grad_out one
        ctx.hand.forward = ctx.hand.grad_out = None
        if not ctx.needs_input_grad[0]:  # no dh wanted (fc1 runs no backward to take it): the row weights' only
            from lightning_moe.modules import triton_swiglu
            return None, triton_swiglu.backward(g_MF, h_M2F, p_M)[1], None, None, None, None
        dh, gp, q, inv, amax = tsw.swiglu_backward_quant(g_MF.contiguous(), h_M2F, p_M, offs_L, gid_M, ctx.fmt)
        ctx.hand.put("backward", dh, (q, inv, amax))
        return dh, (gp if ctx.needs_input_grad[1] else None), None, None, None, None


class _FP8SwiGLUBoth(torch.autograd.Function):
    """``_FP8SwiGLU`` for the per-expert GEMMs (``fp8_grouped_both``): a and dh quantized in both layouts with the
    delayed scales of fc2's input and fc1's output gradient (their histories' amaxes recorded in the same pass), and
    never written: the returned a and dh are placeholders that only the GEMMs' handoffs stand for. Keeps h, p."""

    @staticmethod
    def forward(ctx, h_M2F, p_M, offs_L, layout: tuple, hand: Handoff, fmt: str, pre: Optional[tuple] = None):
        from lightning_moe.modules import triton_fp8_both as tb
        from lightning_moe.modules import triton_swiglu
        from lightning_moe.modules.fp8_grouped_both import record
        spec2 = hand.both[1]
        if pre is not None and pre[0] is p_M:  # made by fc1's epilogue, with these weights
            (q, qT, inv_M, inv_L), amax_L, push = pre[1:]
            if push:  # not in a recomputation's replay
                record(spec2, "x", amax_L, spec2.split == "in")
        else:
            amax_HL, push = _amaxes(spec2, "x", spec2.split == "in", offs_L,
                                    lambda: triton_swiglu.forward(h_M2F, p_M))
            poffs_L, P, gid_P, align = layout
            q, qT, inv_M, inv_L, amax_L = tb.swiglu_both(h_M2F, p_M, amax_HL, offs_L, poffs_L, gid_P, P, fmt,
                                                         align=align)
            push(amax_L)
        a_MF = h_M2F.new_empty(h_M2F.shape[0], h_M2F.shape[1] // 2)
        hand.put("forward", a_MF, (q, qT, inv_M, inv_L), unwritten=True)
        ctx.save_for_backward(h_M2F, p_M, offs_L)
        ctx.layout, ctx.hand, ctx.fmt = layout, hand, fmt
        return a_MF

    @staticmethod
    def backward(ctx, g_MF):
        from lightning_moe.modules import triton_fp8_both as tb
        from lightning_moe.modules import triton_swiglu
        h_M2F, p_M, offs_L = ctx.saved_tensors
        hand = ctx.hand
        hand.forward = hand.grad_out = None
        if not ctx.needs_input_grad[0]:  # no dh wanted (fc1 runs no backward to take it): the row weights' only
            return None, triton_swiglu.backward(g_MF.contiguous(), h_M2F, p_M)[1], None, None, None, None, None
        spec1 = hand.both[0]
        amax_HL, push = _amaxes(spec1, "dy", spec1.split == "out", offs_L,
                                lambda: triton_swiglu.backward(g_MF.contiguous(), h_M2F, p_M)[0])
        poffs_L, P, gid_P, align = ctx.layout
        q, qT, inv_M, inv_L, amax_L, gp = tb.swiglu_backward_both(g_MF, h_M2F, p_M, amax_HL, offs_L, poffs_L, gid_P,
                                                                  P, ctx.fmt, align=align)
        push(amax_L)
        dh = torch.empty_like(h_M2F)
        hand.put("backward", dh, (q, qT, inv_M, inv_L), unwritten=True)
        return dh, (gp if ctx.needs_input_grad[1] else None), None, None, None, None, None


def _amaxes(spec, name: str, split: bool, offs_L, make) -> tuple:
    """``fp8_grouped_both.amaxes`` for operand ``name``, made by the fused pass: ``(amax_HL, push)``, ``push`` taking
    the pass's amax into the history (nothing to push on the history's first use, whose amax comes from ``make()``,
    the operand itself). The same kernels run either way: a recomputed forward saves what the first one saved."""
    from lightning_moe.modules.fp8_grouped_both import amaxes, record
    amax_HL, push = amaxes(spec, name, make, offs_L, split)
    return amax_HL, (lambda amax_L: record(spec, name, amax_L, split)) if push else (lambda amax_L: None)


def _fp8_swiglu_both(h_M2F, p_M, hand: Handoff, fused: bool, rows: tuple, fmt: str, pre: Optional[tuple]
                     ) -> torch.Tensor:
    """``fp8_swiglu`` for the per-expert GEMMs, where fc2 will take a's copies (it makes a wgrad); else plain (fc2
    then quantizes a itself). a's copies come from fc1's epilogue where it made them for this h (``premade``)."""
    from lightning_moe.modules.experts import swiglu
    _, spec2, w2 = hand.both
    if (not torch.is_grad_enabled() or not w2.requires_grad
            or not (h_M2F.requires_grad or (p_M is not None and p_M.requires_grad))):
        return swiglu(h_M2F, p_M, fused)
    offs_L, _, layout = rows
    return _FP8SwiGLUBoth.apply(h_M2F, p_M, offs_L, layout, hand, fmt, pre)


def prepare(p_M: Optional[torch.Tensor], hand: Handoff) -> None:
    """``SwiGLUActivation.prepare`` under the per-expert GEMMs: fc1 may make a's FP8 copies in its epilogue
    (``fp8_grouped_both``) where the SwiGLU will take them (``_fp8_swiglu_both``'s conditions, as far as known
    before fc1: fc1's forward runs without grad mode)."""
    hand.probs = (p_M,) if torch.is_grad_enabled() and hand.both[2].requires_grad else None


def fp8_swiglu(h_M2F: torch.Tensor, p_M: Optional[torch.Tensor], hand: Handoff, fused: bool = True,
               fmt: str = "e4m3") -> torch.Tensor:
    """``experts.swiglu(h, p, fused)``, fused with the quantization for the FP8 GEMMs around it where it can be: the
    Triton kernels run for h, F is a multiple of 128, and fc1's forward just recorded these rows' experts. A rebuild
    in backward (``Recompute(["moe_act"])``: no grad, inside backward) has no fc2 to take its quantization: plain."""
    from lightning_moe.modules.experts import swiglu
    hand.input = hand.probs = None  # fc1 has run: an input handoff left now was never taken
    pre = hand.take("premade", h_M2F) if hand.premade is not None else None  # dropped unless this path takes it
    rows = hand.take_rows(h_M2F.shape[0]) if h_M2F.ndim == 2 else None
    tsw = kernels.load("triton_fp8_swiglu", h_M2F, fused) if rows is not None else None
    rebuild = not torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1
    if hand.both is not None and rows is not None and len(rows) == 3 and not rebuild:
        return _fp8_swiglu_both(h_M2F, p_M, hand, fused, rows, fmt, pre)
    if tsw is None or rebuild or not tsw.fuses(h_M2F.shape[1] // 2) or len(rows) != 2:
        return swiglu(h_M2F, p_M, fused)
    offs_L, gid_M = rows
    if not torch.is_grad_enabled() or not (h_M2F.requires_grad or (p_M is not None and p_M.requires_grad)):
        a_MF, q, inv, amax = tsw.swiglu_quant(h_M2F, p_M, offs_L, gid_M, fmt)
        hand.put("forward", a_MF, (q, inv, amax))
        return a_MF
    return _FP8SwiGLU.apply(h_M2F, p_M, offs_L, gid_M, hand, fmt)


def attach(experts, spec_fc1, spec_fc2, device: torch.device) -> Optional[Handoff]:
    """Fuse ``experts``' SwiGLU (a ``GroupedExperts``) with its FP8 GEMMs' quantization where both of them quantize
    on the Triton kernels with nothing reduced over ranks (the rowwise recipe in E4M3, no ETP, on the kernel) and
    its FFN width fuses: swaps ``experts.act._act`` and sets both specs' ``handoff``. Returns the handoff, or None
    (nothing changed). ``detach`` undoes it."""
    from lightning_moe.modules import fp8_grouped_both as both
    from lightning_moe.modules import fp8_grouped_kernels as gk
    from lightning_moe.modules.experts import SwiGLUActivation
    if not ENABLED or device.type != "cuda" or not isinstance(getattr(experts, "act", None), SwiGLUActivation):
        return None
    for spec, w in ((spec_fc1, experts.w13), (spec_fc2, experts.w2)):
        if spec.emulate or spec.group is not None or spec.formats() != ("e4m3", "e4m3") or \
                not gk.eligible(spec.recipe, w.shape[1], w.shape[2], device):
            return None
    probe = torch.empty(0, device=device)
    half = probe.bfloat16()  # the per-expert path takes 16-bit operands (fc1 decides per call; fp32: plain SwiGLU)
    if spec_fc1.recipe == "delayed" and experts.act.fused and both.kernels(spec_fc1, half) is not None \
            and both.kernels(spec_fc2, half) is not None:  # one scale per expert, known before a and dh are made
        hand = Handoff(both=(spec_fc1, spec_fc2, experts.w2))
        spec_fc1.handoff, spec_fc2.handoff = (hand, "fc1"), (hand, "fc2")
        experts.act._act = partial(fp8_swiglu, hand=hand, fused=experts.act.fused)
        experts.act.prepare = partial(prepare, hand=hand)
        return hand
    tsw = kernels.load("triton_fp8_swiglu", probe, experts.act.fused)
    if tsw is None or gk._quant_kernels(spec_fc1, probe) is None or not tsw.fuses(experts.w2.shape[1]):
        return None
    hand = Handoff()
    spec_fc1.handoff, spec_fc2.handoff = (hand, "fc1"), (hand, "fc2")
    experts.act._act = partial(fp8_swiglu, hand=hand, fused=experts.act.fused)
    return hand


def detach(experts, spec_fc1, spec_fc2) -> None:
    experts.act.__dict__.pop("_act", None)
    experts.act.__dict__.pop("prepare", None)
    spec_fc1.handoff = spec_fc2.handoff = None
