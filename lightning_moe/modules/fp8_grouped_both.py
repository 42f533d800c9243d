"""The experts' FP8 GEMMs with one scale per expert (the tensorwise and delayed recipes in E4M3): each operand in both
layouts from one pass (``triton_fp8_both``).

With one scale per expert, the forward's x and the wgrad's x^T (and the dgrad's dy and the wgrad's dy^T) are the same
FP8 values in two layouts. So the forward quantizes x once into both and keeps x^T (FP8, half the bytes of x) for
the wgrad; backward does the same with dy. The expert's weight is quantized once into both layouts too (cached once
per optimizer step under FP8Training, its delayed amax history then advancing once per step). Delayed scaling takes
the scale from the operand's history before reading it and records the current amax in the same pass; on first use,
and under tensorwise (current) scaling, the amax comes first from a pass of its own. Each GEMM's bits are those of the
separate passes (``fp8_grouped_kernels``' other path, with the same scales). Forwards without a backward
(validation) take this path too: one weight copy and one push per operand, as in training. The wgrad's x^T has x's
scale (one history, ``x``, as Transformer Engine's), where the emulation also keeps ``x_t``, pushed in backward only:
the two differ where a forward runs without its backward (validation). A recomputation's replay scales as its first
pass did and pushes nothing (``fp8.Recomputed``).

Shapes: M routed rows (sorted by expert), K input features, N output features, L local experts, P padded rows.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from lightning_moe.modules.expert_padding import fp8_rows_layout
from lightning_moe.modules.fp8 import FORMATS, Tiling, abs_amax, saturate, scale_of
from lightning_moe.modules.fp8_grouped import _reduced, _segment_amax, history, reduce_groups, weights_amax
from lightning_moe.modules.fp8_linear import FP8Spec
from lightning_moe.modules.kernels import interpreting, load

ENABLED = os.environ.get("LMOE_FP8_BOTH", "1") != "0"  # 0: the separate passes, for comparisons
# fc1's GEMM makes the SwiGLU's FP8 copies in its epilogue (``gluon_fp8_fc1_swiglu``, bit-identical) where it runs;
# 0: the separate pass (``triton_fp8_both.swiglu_both``), for comparisons. At Qwen3's experts 4-6 % faster than the
# GEMM and the pass on an H100, within 2 % either way on an H200 (docs/PERFORMANCE.md)
FC1_SWIGLU = os.environ.get("LMOE_FP8_FC1_SWIGLU", "1") != "0"
_DTYPES = (torch.bfloat16, torch.float16)  # triton_fp8_both.DTYPES (fp32 operands: the separate passes)


def kernels(spec: FP8Spec, t: torch.Tensor):
    """``triton_fp8_both`` where this GEMM's operands go through it: one scale per expert in E4M3, an FP8 wgrad on
    ``triton_fp8_wgrad`` (whose 128-row layout the transposed copies take), on CUDA, 16-bit operands; else None."""
    if (not ENABLED or spec.recipe not in ("tensorwise", "delayed") or spec.formats() != ("e4m3", "e4m3")
            or not spec.fp8_wgrad or not t.is_cuda or interpreting() or t.dtype not in _DTYPES):
        return None
    from lightning_moe.modules import fp8_grouped_kernels as gk
    if not gk.TRITON_WGRAD or load("triton_fp8_wgrad", t) is None:
        return None
    return load("triton_fp8_both", t)


def amaxes(spec: FP8Spec, name: str, x_MX, offs: torch.Tensor, split: bool) -> tuple:
    """``(amax_HL, push)``: the amaxes operand ``name``'s per-expert scale is the max of (delayed scaling: its
    history's ring), and whether the pass's current amax must still enter the history (not in a recomputation's
    replay, which gets its first pass's ring). Otherwise (tensorwise; a history's first use) the current amax from a
    pass of its own over ``x_MX`` (or what it returns, where callable), reduced over the ranks as
    ``fp8_grouped.rows_amax`` does, as (1, L)."""
    ring = history(spec, name).ring() if spec.recipe == "delayed" else None
    if ring is not None:
        return ring
    x_MX = x_MX() if callable(x_MX) else x_MX
    amax_L = _segment_amax(abs_amax(x_MX.detach(), 1).squeeze(1), offs)
    return _reduced(amax_L, spec, name, split, tokens=True).reshape(1, -1), False


def _quantize(tb, spec: FP8Spec, name: str, x_MX: torch.Tensor, offs, layout: tuple, split: bool,
              out: Optional[torch.Tensor] = None) -> tuple:
    """``(q_MX, qT_XP, dequantization scales per row (M,) and per expert (L,))`` of operand ``name`` in one pass
    (after its amax, where needed); qT into ``out`` where given."""
    poffs_L, P, gid_P, align = layout
    amax_HL, push = amaxes(spec, name, x_MX, offs, split)
    q, qT, inv_M, inv_L, amax_L = tb.quant_both(x_MX, amax_HL, offs, poffs_L, gid_P, P, spec.formats()[0], out=out,
                                                align=align)
    if push:
        record(spec, name, amax_L, split)
    return q, qT, inv_M, inv_L


def record(spec: FP8Spec, name: str, amax_L: torch.Tensor, split: bool) -> None:
    """A pass's current per-expert amax into operand ``name``'s delayed history, reduced over the ranks first."""
    history(spec, name).push(reduce_groups(amax_L, spec, split, tokens=True))


def _handoff(spec: FP8Spec) -> tuple:
    """``spec.handoff`` where it is the per-expert one (``fp8_swiglu.Handoff.both``); else (None, None)."""
    if spec.handoff is None or spec.handoff[0].both is None:
        return None, None
    return spec.handoff


def _weights(w_LKN: torch.Tensor, spec: FP8Spec, col: bool, row: bool) -> tuple:
    """``(forward copy (L, N, K), dgrad copy (L, K, N), the forward's and the dgrad's dequantization scales (L, N) and
    (L, K))``, one scale per expert."""
    from lightning_moe.modules.fp8_grouped_kernels import saturate_t
    fmt = spec.formats()[0]
    dtype, fmax = FORMATS[fmt]
    L, K, N = w_LKN.shape
    s_L11 = scale_of(weights_amax(w_LKN, "K", Tiling(None, None), spec, "w", col or row, row), fmt)
    inv_L1 = s_L11.reshape(L, 1).reciprocal()
    return (saturate_t(w_LKN, s_L11, fmax, dtype), saturate(w_LKN, s_L11, fmax, dtype),
            inv_L1.expand(L, N).contiguous(), inv_L1.expand(L, K).contiguous())


def forward(ctx, x_MK: torch.Tensor, w_LKN: torch.Tensor, offs: torch.Tensor, spec: FP8Spec, sync
            ) -> torch.Tensor:
    from lightning_moe.modules import fp8_grouped_kernels as gk
    tb = ctx.both
    L, K, N = w_LKN.shape
    M = x_MK.shape[0]
    col, row = spec.split == "out", spec.split == "in"
    align = load("triton_fp8_wgrad", x_MK).T
    gid_M, poffs_L, P, gid_P = fp8_rows_layout(offs, M, align)
    layout = (poffs_L, P, gid_P, align)
    hand, side = _handoff(spec)
    probs = None
    if side == "fc1":  # for the fused SwiGLU, whose dh handoff left from before is stale
        hand.rows, hand.backward, hand.premade = (M, offs, gid_M, layout), None, None
        probs, hand.probs = hand.probs, None
    pre = hand.take("forward", x_MK) if side == "fc2" else None  # a, quantized by the fused SwiGLU
    xq, xT, x_inv_M, x_inv_L = pre if pre is not None else _quantize(tb, spec, "x", x_MK.contiguous(), offs,
                                                                      layout, row)
    # both copies made once, the dgrad's kept for backward even uncached (a delayed history pushes once)
    wq_LNK, wt_LKN, w_inv_LN, w_inv_LK = spec.cached_weight("w_both_per_expert", w_LKN,
                                                            lambda: _weights(w_LKN, spec, col, row))
    # the SwiGLU takes fc1's copies only where h or p needs a gradient (_fp8_swiglu_both)
    grad = x_MK.requires_grad or w_LKN.requires_grad or (probs is not None and probs[0] is not None
                                                         and probs[0].requires_grad)
    epi = _fc1_swiglu(spec, hand, probs, x_MK, M, K, N, L, layout) if probs is not None and grad else None
    if epi is not None:  # the SwiGLU's FP8 copies made in fc1's epilogue, for the SwiGLU to take (fp8_swiglu)
        fk, (amax_HL, push) = epi
        y, *a_copies, amax_L = fk.fc1_swiglu(xq, wq_LNK, x_inv_M, w_inv_LN, offs, probs[0], amax_HL, layout[1],
                                             spec.formats()[0])
        hand.put("premade", y, (probs[0], tuple(a_copies), amax_L, push))
    else:
        y = gk._rows_gemm(xq, wq_LNK.transpose(1, 2), x_inv_M, w_inv_LN, offs, spec.fast("fprop"))
    ctx.save_for_backward(xT, x_inv_L, w_LKN, offs)
    ctx.layout, ctx.w_t, ctx.spec, ctx.dtype = layout, (wt_LKN, w_inv_LK), spec, x_MK.dtype
    ctx.sync, ctx.param = sync, w_LKN if sync is not None else None
    return y.to(x_MK.dtype)


def _fc1_swiglu(spec: FP8Spec, hand, probs: tuple, x_MK: torch.Tensor, M: int, K: int, N: int, L: int,
                layout: tuple):
    """``(gluon_fp8_fc1_swiglu, (the amaxes a's delayed scale is the max of, whether a's amax must enter the
    history))`` where fc1's forward makes the SwiGLU's FP8 copies in its epilogue: the SwiGLU asked for them before
    fc1 (``fp8_swiglu.prepare``), fc2's input history holds a past amax (a first use takes the current one, from a
    pass of its own), bf16 h, and fc1's GEMM would be the warp-specialized one the kernel extends (fast
    accumulation, fine-grained experts), the wgrad's rows padded to its 128-row tiles; else None."""
    from lightning_moe.modules import fp8_grouped_kernels as gk
    spec2 = hand.both[1]
    if (not FC1_SWIGLU or not x_MK.is_cuda or interpreting() or x_MK.dtype != torch.bfloat16
            or not spec.fast("fprop") or not gk.TRITON_GEMM or not (gk.GLUON_WS_GEMM or gk.GLUON_WS_NARROW)
            or spec2.recipe != "delayed" or hand.both[2].shape[1] * 2 != N or layout[3] != 128):
        return None
    fk = load("gluon_fp8_fc1_swiglu", x_MK)
    if fk is None or not fk.fits(M, K, N // 2, L):
        return None
    ring = history(spec2, "x").ring()  # last: a recomputation's replay takes it in the order its first pass did
    return (fk, ring) if ring is not None else None


def backward(ctx, dy_MN: torch.Tensor) -> tuple:
    """``(dx, dw)``."""
    from lightning_moe.modules import fp8_grouped_kernels as gk
    xT, x_inv_L, w_LKN, offs = ctx.saved_tensors
    spec, tb = ctx.spec, ctx.both
    L, K, N = w_LKN.shape
    col = spec.split == "out"
    hand, side = _handoff(spec)
    # a deferred wgrad's operands go side by side into the GEMM's arenas (``_held_slots``; None where they do not fit:
    # the window concatenates them): dy's transposed copy quantized there, x's (from forward) copied, its own freed
    defer = ctx.sync is not None and spec.defer_wgrad and ctx.needs_input_grad[1]
    x_at, dy_at = gk._held_slots(spec, ctx.sync.held(ctx.param), K, N, ctx.layout[1]) if defer else (None, None)
    pre = hand.take("backward", dy_MN) if side == "fc1" else None  # dh, quantized by the fused SwiGLU
    dyq, dyT, dy_inv_M, dy_inv_L = pre if pre is not None else _quantize(tb, spec, "dy", dy_MN.contiguous(), offs,
                                                                         ctx.layout, col, dy_at)
    if dy_at is not None:
        dyT = dy_at.copy_(dyT) if pre is not None else dy_at
    if x_at is not None:
        xT = x_at.copy_(xT)
    wt_LKN, w_inv_LK = ctx.w_t
    ctx.w_t = None
    dx = gk._rows_gemm(dyq, wt_LKN.transpose(1, 2), dy_inv_M, w_inv_LK, offs, spec.fast("dgrad"))
    if not ctx.needs_input_grad[1]:
        return dx.to(ctx.dtype), None
    wk = load("triton_fp8_wgrad", dy_MN)
    dw = gk.triton_wgrad(ctx, wk, (xT, x_inv_L.unsqueeze(1).expand(L, K)), (dyT, dy_inv_L.unsqueeze(1).expand(L, N)),
                         ctx.layout[0], w_LKN, defer)
    return dx.to(ctx.dtype), dw
