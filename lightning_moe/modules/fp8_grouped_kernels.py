"""The experts' FP8 grouped GEMMs on Hopper's rowwise-scaled CUTLASS kernel, ``torch._scaled_grouped_mm``.

The quantization is the emulation's (``fp8_grouped.py``): the same amaxes, reductions, scales and saturation, so the
two paths differ only in how they accumulate. The kernel multiplies E4M3 operands with one fp32 scale per row of A
and one per column of B, which covers the tensorwise, delayed and rowwise recipes (per-expert scales are broadcast
onto those rows and columns):

  GEMM     A (row-major)                        B (column-major)                      groups over
  forward  x (M, K), per row                    W (L, K, N), per expert and column    rows (M)
  dgrad    dy (M, N), per row                   W^T (L, N, K), per expert and row     rows (M)
  wgrad    x^T (K, P), per expert and feature   dy (P, N), per expert and feature     tokens (P, padded)

The wgrad GEMM reduces over each expert's tokens with 16-byte loads, so every expert's tokens start on a 16-row
boundary (``expert_padding.py``: on the device, no host sync). Where the rowwise recipe's operands come from the Triton
quantizers, the wgrad instead runs on ``triton_fp8_wgrad`` (the same operands and scales, each expert's tokens on a
128-row boundary for its TMA blocks; written with fast accumulation, on its warp-specialized Gluon kernel,
``gluon_fp8_wgrad``, with the same bits). Under GradSync's gradient-accumulation fusion (bf16 weights with fp32 main
grads, no autocast) it writes or adds into the fp32 main grad, where the CUTLASS kernel writes a bf16 gradient that
GradSync then adds; otherwise it writes the gradient in the weight's dtype (``LMOE_FP8_TRITON_WGRAD=0``: the CUTLASS
kernel, for comparisons). With ``FP8Training(defer_expert_wgrad=True)`` the main grad's wgrad waits for the step's last
backward (``GradSync.defer_wgrad``), which runs it once over every micro-batch's held FP8 operands
(``triton_fp8_wgrad.wgrad_segments_into``, the same bits): the fp32 main grad is written once per step instead of read,
added and written at every micro-batch (once per N micro-batches with ``defer_expert_wgrad=N``). The forward and
dgrad GEMMs run on ``triton_fp8_grouped_mm`` where triton is installed, with CUTLASS's bits and faster, above all at
fine-grained experts with the precise accumulation (``LMOE_FP8_TRITON_GEMM=0``: CUTLASS's, for comparisons); the
precise ones over K >= 4,096 on ``gluon_fp8_grouped_mm`` with ``LMOE_FP8_GLUON_GEMM=1``, the fast ones on the
warp-specialized persistent ``gluon_fp8_grouped_ws`` at fine-grained experts (``LMOE_FP8_GLUON_WS_GEMM=1``: everywhere,
``0``: nowhere; the same bits). There is
no grouped kernel for E5M2 operands (the hybrid format's gradients) nor for blockwise scales on Hopper: those GEMMs run
emulated.

The tensorwise and delayed recipes in E4M3 with an FP8 wgrad and 16-bit operands go through ``fp8_grouped_both``
instead: one scale per expert, so one pass writes each operand's forward (or dgrad) copy and its wgrad copy
(``LMOE_FP8_BOTH=0``: the path below, for comparisons).

The rowwise recipe quantizes on Triton kernels (``triton_fp8_quant.py``: the same bits in one or two passes instead
of about six; ``triton_fp8_weights.py``: both weight copies in two passes instead of four) where triton is installed
and no amax is reduced over the ETP group; ``LMOE_FP8_TRITON_QUANT=0`` (or ``FUSED_QUANT = False``) keeps the torch
code, for comparisons.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from lightning_moe.modules import fp8_grouped_both as both
from lightning_moe.modules import wgrad_fusion
from lightning_moe.modules.expert_padding import fp8_rows_layout, padded_layout, scatter_rows
from lightning_moe.modules.fp8 import FORMATS, fused, scale_of, tiling
from lightning_moe.modules.fp8_grouped import (_cast, _reduced, _wgrad, emulated_dgrad, emulated_wgrad,
                                               expert_of_rows, rows_amax, tokens_amax, weights_amax)
from lightning_moe.modules.fp8_linear import FP8Spec, _capability
from lightning_moe.modules.kernels import interpreting, load

ALIGN = 16  # rows: 16 bytes of E4M3
FUSED_QUANT = os.environ.get("LMOE_FP8_TRITON_QUANT", "1") != "0"
TRITON_WGRAD = os.environ.get("LMOE_FP8_TRITON_WGRAD", "1") != "0"
TRITON_GEMM = os.environ.get("LMOE_FP8_TRITON_GEMM", "1") != "0"
# opt-in: the Gluon precise GEMM gained 1-2 % on Mixtral's model (docs/PERFORMANCE.md), on triton's experimental API
GLUON_GEMM = os.environ.get("LMOE_FP8_GLUON_GEMM", "0") == "1"
# the fast accumulation on the warp-specialized persistent Gluon kernel (``gluon_fp8_grouped_ws``: the same bits):
# everywhere with 1, never with 0; by default at fine-grained experts (its NARROW_ROWS rows per expert or fewer: 1.04-
# 1.06x Qwen3's FP8 block; no faster at Mixtral's, docs/PERFORMANCE.md, fourth session of 2026-11-27)
GLUON_WS_GEMM = os.environ.get("LMOE_FP8_GLUON_WS_GEMM", "") == "1"
GLUON_WS_NARROW = os.environ.get("LMOE_FP8_GLUON_WS_GEMM", "") != "0"


def available(device: torch.device) -> bool:
    """Whether ``torch._scaled_grouped_mm``'s rowwise kernel runs here (SM 9.0)."""
    return (device.type == "cuda" and hasattr(torch, "_scaled_grouped_mm")
            and _capability(device.index) == (9, 0))  # cached: asked at every GEMM


def eligible(recipe: str, K: int, N: int, device: torch.device) -> bool:
    """Whether a K x N expert GEMM runs on the kernel: Hopper, a recipe with row/column scales, 16-byte dims."""
    return recipe != "blockwise" and K % ALIGN == 0 and N % ALIGN == 0 and available(device)


def runs(spec: FP8Spec, x_MK: torch.Tensor, w_LKN: torch.Tensor) -> bool:
    return eligible(spec.recipe, *w_LKN.shape[1:], x_MK.device)


def _gemm(a, b, inv_a, inv_b, offs, fast: bool) -> torch.Tensor:
    """The kernel multiplies the product by dequantization scales (``inv_*``): the reciprocals of the quantization
    scales."""
    return torch._scaled_grouped_mm(a, b, inv_a.contiguous(), inv_b.contiguous(), offs=offs, out_dtype=torch.bfloat16,
                                    use_fast_accum=fast)


def _rows_gemm(a, b, inv_a, inv_b, offs, fast: bool) -> torch.Tensor:
    """The forward or dgrad GEMM, rows grouped by expert: ``_gemm``'s product (``b`` (L, K, N) column-major) and bits,
    on ``triton_fp8_grouped_mm`` (faster, above all at fine-grained experts with the precise accumulation); with
    ``GLUON_GEMM``, the precise accumulation over a long K on ``gluon_fp8_grouped_mm`` (promotion overlapping MMAs);
    the fast one at fine-grained experts (or everywhere with ``GLUON_WS_GEMM``) on ``gluon_fp8_grouped_ws``."""
    tg = load("triton_fp8_grouped_mm", a, TRITON_GEMM) if not interpreting() else None  # interpreter: no FP8 dot
    if tg is None:
        return _gemm(a, b, inv_a, inv_b, offs, fast)
    gm = load("gluon_fp8_grouped_mm", a, GLUON_GEMM and not fast)
    if gm is not None and a.shape[1] >= gm.MIN_K:
        return gm.grouped_mm(a, b.transpose(1, 2), inv_a, inv_b, offs)
    ws = load("gluon_fp8_grouped_ws", a, (GLUON_WS_GEMM or GLUON_WS_NARROW) and fast)
    if ws is not None and ws.fits(b.shape[2]) and (GLUON_WS_GEMM or ws.narrow(a.shape[0], b.shape[0])):
        return ws.grouped_mm(a, b.transpose(1, 2), inv_a, inv_b, offs)
    return tg.grouped_mm(a, b.transpose(1, 2), inv_a, inv_b, offs, fast)


def _with_inverse(q, scale) -> tuple:
    """A quantized weight with its dequantization scales, made once with the cached copy."""
    return q, scale.reciprocal()


def _saturate_t(x_LRC, scale, fmax: float, dtype):
    """Quantized and laid out transposed (the last two dimensions swapped in memory), in one pass."""
    return (x_LRC.float() * scale).clamp(-fmax, fmax).to(dtype).transpose(-2, -1).contiguous()


def _saturate_rows_t(x_PX, scale_LX, gid_P, fmax: float, dtype):
    """Rows scaled by their expert's scales (per expert, or per expert and feature), quantized, transposed."""
    return (x_PX.float() * scale_LX[gid_P]).clamp(-fmax, fmax).to(dtype).t().contiguous()


saturate_t, saturate_rows_t = fused(_saturate_t), fused(_saturate_rows_t)


def _by_expert_t(x_MX, amax_LX, dest_M, gid_P, P: int, fmt: str):
    """The wgrad operand: ``x``'s rows at their padded places, quantized with per-expert (L, 1) or per-expert-and-
    feature (L, X) scales, transposed to (X, P); and the scales as (L, X)."""
    dtype, fmax = FORMATS[fmt]
    scale_LX = scale_of(amax_LX, fmt)
    x_PX = scatter_rows(x_MX, dest_M, P)
    return saturate_rows_t(x_PX, scale_LX, gid_P, fmax, dtype), scale_LX.expand(-1, x_MX.shape[1])


def _quant_kernels(spec: FP8Spec, t: torch.Tensor):
    """``triton_fp8_quant`` where it quantizes ``t``'s operands (rowwise recipe, E4M3 on both sides); else None."""
    if not FUSED_QUANT or spec.recipe != "rowwise" or spec.formats() != ("e4m3", "e4m3"):
        return None
    return load("triton_fp8_quant", t)


def _weight_kernels(spec: FP8Spec, w_LKN: torch.Tensor):
    """``triton_fp8_weights`` where it makes the rowwise weight copies: the Triton quantizers' recipe, no amax reduced
    over an ETP group, no FP8 parameter all-gather amaxes to reuse; else None."""
    if _quant_kernels(spec, w_LKN) is None or spec.group is not None or spec.weight_amax(w_LKN) is not None:
        return None
    return load("triton_fp8_weights", w_LKN)


def _triton_wgrad(tq, t: torch.Tensor):
    """``triton_fp8_wgrad`` where it takes the wgrad: the Triton quantizers' operands (``tq``), on CUDA (the
    interpreter's dot has no FP8); else None (CUTLASS's)."""
    if tq is None or not TRITON_WGRAD or not t.is_cuda or interpreting():
        return None
    return load("triton_fp8_wgrad", t)


def _wgrad_align(wk) -> int:
    """The rows' alignment of the wgrad's padded operands: the Triton wgrad's token blocks, or CUTLASS's 16 bytes."""
    return wk.T if wk is not None else ALIGN


def _rows_and_amax(tq, x_MK, offs, gid_M, spec: FP8Spec, role: str, name: str, split_k: bool, fmt: str, amax: bool):
    """``(q, dequantization scales, amax)``: the operand quantized along K per row (one fused pass, unless ETP splits
    K: the amax is then all-reduced first) and, with ``amax``, the wgrad operand's per-expert column amax from the
    same read (``rowwise_quant_col_amax``) where the rows need no amax reduced over ranks; else None for it."""
    if tq is not None and not (split_k and spec.group is not None):
        if amax:
            return tq.rowwise_quant_col_amax(x_MK, offs, gid_M, fmt, inverse=True)
        return (*tq.rowwise_quant(x_MK, fmt, inverse=True), None)
    q, scale = _cast(x_MK, rows_amax(x_MK, offs, gid_M, tiling(spec.recipe, role), spec, name, split_k), fmt)
    return q, scale.reciprocal(), None


def _by_expert_t_fused(tq, x_MX, offs, gid_M, poffs_L, gid_P, P: int, spec: FP8Spec, name: str, fmt: str,
                       amax_LX=None, out=None, align: int = 1):
    """``_by_expert_t`` with rowwise scales in two passes: amax (or ``amax_LX``, taken with the rowwise pass), its
    reduction over the expert's data-parallel ranks (as ``tokens_amax``), then quantized straight into the transposed
    padded layout (into ``out``, an (X, P) view, where given; ``align``: the layout's)."""
    amax_LX = tq.grouped_col_amax(x_MX, offs, gid_M) if amax_LX is None else amax_LX
    scale_LX = scale_of(_reduced(amax_LX, spec, name, False, tokens=True), fmt)
    return tq.quant_t_padded(x_MX, scale_LX, offs, poffs_L, gid_P, P, fmt, out=out, align=align), scale_LX


def _handoff(spec: FP8Spec, tq) -> tuple:
    """``spec.handoff`` (``fp8_swiglu``) where its quantization is this GEMM's: the Triton quantizers', no amax
    reduced over an ETP group; else (None, None)."""
    if tq is None or spec.handoff is None or spec.group is not None:
        return None, None
    return spec.handoff


class _ScaledGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_LKN, offs_L, spec: FP8Spec, sync, wgrad: bool):
        """``sync``: the GradSync that takes the wgrad into w's main grad (the Triton wgrad's epilogue), or None;
        ``wgrad``: the backward will make an FP8 wgrad (its operand's column amax then comes with the rowwise pass)."""
        L, K, N = w_LKN.shape
        M = x_MK.shape[0]
        offs = offs_L.to(torch.int32)
        # with or without a backward to come (validation: the same weight copies and histories as training)
        ctx.both = both.kernels(spec, x_MK)
        if ctx.both is not None:  # one scale per expert: both layouts of each operand in one pass
            return both.forward(ctx, x_MK, w_LKN, offs, spec, sync)
        tq = _quant_kernels(spec, x_MK)
        ctx.padded = None
        if tq is not None:  # the rows' experts, and the wgrad's padded layout, in one launch (int32, as kernels read)
            align = _wgrad_align(_triton_wgrad(tq, x_MK)) if wgrad else 0
            gid_M, pends_L, P, gid_P = fp8_rows_layout(offs, M, align)
            ctx.padded = (align, pends_L, P, gid_P) if wgrad else None
        else:
            gid_M = expert_of_rows(M, offs, x_MK.device)
        ctx.save_for_backward(x_MK, w_LKN, offs, gid_M)
        ctx.spec = spec
        fwd, _ = spec.formats()
        col, row = spec.split == "out", spec.split == "in"
        hand, side = _handoff(spec, tq)
        if side == "fc1":  # for the fused SwiGLU's column amaxes; a dh handoff left from before is stale
            hand.rows, hand.backward = (M, offs, gid_M), None
        # a, quantized by the fused SwiGLU; x, by the dispatch's gather (no column amax: backward takes its own)
        pre = hand.take("forward" if side == "fc2" else "input", x_MK) if side is not None else None
        if pre is not None:
            xq, xs_inv, x_amax = pre
            ctx.x_amax = x_amax if wgrad else None
        else:
            xq, xs_inv, ctx.x_amax = _rows_and_amax(tq, x_MK, offs, gid_M, spec, "input", "x", row, fwd, wgrad)
        def quantize_w():
            ws = scale_of(weights_amax(w_LKN, "K", tiling(spec.recipe, "weight"), spec, "w", col or row, row), fwd)
            dtype, fmax = FORMATS[fwd]
            return _with_inverse(saturate_t(w_LKN, ws, fmax, dtype).transpose(1, 2), ws)  # column-major, as B

        tw = _weight_kernels(spec, w_LKN)
        ctx.w_t = None
        if tw is not None:  # both copies in two passes, the dgrad's kept for backward: made once even uncached
            (wq_LNK, ws_inv), ctx.w_t = spec.cached_weight(
                "w_both", w_LKN, lambda: tuple(_with_inverse(*c) for c in tw.quantize_both(w_LKN, fwd)))
            w_cm = wq_LNK.transpose(1, 2)
        else:
            w_cm, ws_inv = spec.cached_weight("w", w_LKN, quantize_w)
        ctx.sync, ctx.param = sync, w_LKN if sync is not None else None
        y = _rows_gemm(xq, w_cm, xs_inv.reshape(M), ws_inv.expand(L, 1, N).reshape(L, N), offs, spec.fast("fprop"))
        return y.to(x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN):
        if ctx.both is not None:
            return (*both.backward(ctx, dy_MN), None, None, None, None)
        x_MK, w_LKN, offs, gid_M = ctx.saved_tensors
        spec = ctx.spec
        fwd, bwd = spec.formats()
        if bwd != "e4m3":  # E5M2 gradients: no grouped kernel
            return (emulated_dgrad(dy_MN, w_LKN, offs, gid_M, spec).to(x_MK.dtype),
                    emulated_wgrad(x_MK, dy_MN, offs, gid_M, spec).to(w_LKN.dtype), None, None, None, None)
        L, K, N = w_LKN.shape
        M = x_MK.shape[0]
        col, row = spec.split == "out", spec.split == "in"
        t_in, t_grad, t_w = (tiling(spec.recipe, r) for r in ("input", "grad", "weight"))
        dy_MN = dy_MN.contiguous()
        # dgrad: dy along N per row; W along N per (expert, row k); W^T column-major is W row-major
        tq = _quant_kernels(spec, dy_MN)
        fp8_wgrad = ctx.needs_input_grad[1] and spec.fp8_wgrad
        hand, side = _handoff(spec, tq)
        # dh, quantized by the fused SwiGLU; dy, by the combine's gather in backward (no column amax, as above)
        pre = hand.take("backward" if side == "fc1" else "grad_out", dy_MN) if side is not None else None
        if pre is not None:
            dyq, dys_inv, dy_amax = pre
        else:
            dyq, dys_inv, dy_amax = _rows_and_amax(tq, dy_MN, offs, gid_M, spec, "grad", "dy", col, bwd, fp8_wgrad)
        wq, ws_inv = ctx.w_t or spec.cached_weight("w_t", w_LKN, lambda: _with_inverse(*_cast(
            w_LKN, weights_amax(w_LKN, "N", t_w, spec, "w_t", col or row, col), fwd)))
        ctx.w_t = None
        dx = _rows_gemm(dyq, wq.transpose(1, 2), dys_inv.reshape(M), ws_inv.expand(L, K, 1).reshape(L, K), offs,
                        spec.fast("dgrad"))
        if not ctx.needs_input_grad[1]:  # frozen experts: no wgrad operands, no wgrad
            return dx.to(x_MK.dtype), None, None, None, None, None
        if not spec.fp8_wgrad:  # Megatron's fp8_wgrad=False: the unquantized operands on bf16 tensor cores
            dw = _wgrad_unquantized(ctx, x_MK, dy_MN, offs, gid_M, w_LKN)
            return dx.to(x_MK.dtype), dw, None, None, None, None
        # wgrad: both along each expert's tokens, laid out on 16-row boundaries (128 for the Triton kernel's blocks)
        wk = _triton_wgrad(tq, dy_MN)
        align = _wgrad_align(wk)
        padded, ctx.padded = ctx.padded, None
        if tq is not None and padded is not None and padded[0] == align:
            _, poffs_L, P, gid_P = padded  # forward's (the kernels place each row from the padded ends)
        elif tq is not None:
            _, poffs_L, P, gid_P = fp8_rows_layout(offs, M, align)
        else:
            dest_M, poffs_L, _, P = padded_layout(offs, M, align)
            gid_P = expert_of_rows(P, poffs_L, x_MK.device)
        defer = ctx.sync is not None and spec.defer_wgrad and wk is not None
        if tq is not None:
            x_at, dy_at = _held_slots(spec, ctx.sync.held(ctx.param), K, N, P) if defer else (None, None)
            xT_KP, xs_LK = _by_expert_t_fused(tq, x_MK, offs, gid_M, poffs_L, gid_P, P, spec, "x_t", fwd, ctx.x_amax,
                                              x_at, align)
            dyT_NP, ds_LN = _by_expert_t_fused(tq, dy_MN, offs, gid_M, poffs_L, gid_P, P, spec, "dy_t", bwd, dy_amax,
                                               dy_at, align)
            ctx.x_amax = None
        else:
            xT_KP, xs_LK = _by_expert_t(x_MK, tokens_amax(x_MK, offs, t_in, spec, "x_t", row), dest_M, gid_P, P,
                                        fwd)
            dyT_NP, ds_LN = _by_expert_t(dy_MN, tokens_amax(dy_MN, offs, t_grad, spec, "dy_t", col), dest_M,
                                         gid_P, P, bwd)
        if wk is None:
            dw = _gemm(xT_KP, dyT_NP.t(), xs_LK.reshape(L * K).reciprocal(), ds_LN.reshape(L * N).reciprocal(),
                       poffs_L.to(torch.int32), spec.fast("wgrad"))
            return dx.to(x_MK.dtype), dw.to(w_LKN.dtype), None, None, None, None
        dw = triton_wgrad(ctx, wk, (xT_KP, xs_LK.reciprocal()), (dyT_NP, ds_LN.reciprocal()), poffs_L, w_LKN, defer)
        return dx.to(x_MK.dtype), dw, None, None, None, None


def triton_wgrad(ctx, wk, a: tuple, b: tuple, poffs_L: torch.Tensor, w_LKN: torch.Tensor, defer: bool):
    """The FP8 wgrad on ``triton_fp8_wgrad`` from its operands ``a = (aT (K, P), dequantization scales (L, K))`` and
    ``b`` likewise (N): into the main grad under GradSync's fusion (held until the step's last backward with
    ``defer``), else a new gradient. Returns what autograd gets for the weight."""
    spec, fast = ctx.spec, ctx.spec.fast("wgrad")
    # never read under the fusion: it only fires GradSync's hook, which drops it
    dw = ctx.sync.placeholder(ctx.param) if ctx.sync is not None else torch.empty_like(w_LKN)
    if defer:  # held until the step's last backward
        ctx.sync.defer_wgrad(ctx.param, (a, b, poffs_L),
                             lambda main, first, helds: _wgrad_of_micro_batches(wk, main, first, helds, fast, spec),
                             spec.defer_window)
    elif ctx.sync is not None:
        ctx.sync.accumulate_wgrad(ctx.param, lambda main, first: wk.wgrad_into(main, a, b, poffs_L, first,
                                                                             per_expert=True, fast=fast))
    else:
        wk.wgrad_into(dw, a, b, poffs_L, True, per_expert=True, fast=fast)
    ctx.sync = ctx.param = None
    return dw


def _held_slots(spec: FP8Spec, helds: list, K: int, N: int, P: int) -> tuple:
    """Where this micro-batch's held wgrad operands go: columns [base, base + P) of the GEMM's arenas ((K, C) and
    (N, C) E4M3, ``spec.wgrad_arena``, kept from step to step), after the micro-batches held before it, so that the
    deferred wgrad finds them side by side; (None, None), new tensors, where they do not fit (the first step, a longer
    one), and the deferred wgrad concatenates them into the next step's arenas."""
    arena, base = spec.wgrad_arena, sum(a[0].shape[1] for a, _, _ in helds)
    if arena is None or arena[0].shape[0] != K or arena[1].shape[0] != N or arena[0].shape[1] < base + P:
        return None, None
    return arena[0][:, base:base + P], arena[1][:, base:base + P]


def _side_by_side(ts: list):
    """The (X, P_i) operands as one (X, sum P_i) view where they lie side by side in one buffer (``_held_slots``);
    else None."""
    first, width = ts[0], 0
    for t in ts:
        if (t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.stride() != first.stride()
                or t.storage_offset() != first.storage_offset() + width):
            return None
        width += t.shape[1]
    return first.as_strided((first.shape[0], width), first.stride(), first.storage_offset())


def _wgrad_of_micro_batches(wk, main_LKN, first: bool, helds: list, fast: bool, spec: FP8Spec) -> None:
    """``FP8Training(defer_expert_wgrad=True)``: the wgrad of every held micro-batch ((aT, sa), (bT, sb), padded
    offsets) in one pass over the main grad, their operands side by side (``triton_fp8_wgrad.wgrad_segments_into``:
    the bits of one kernel per micro-batch in order): in the arenas where ``_held_slots`` put them, else concatenated
    into new arenas for the next step."""
    if len(helds) == 1:  # no accumulation: the usual kernel
        a, b, poffs_L = helds.pop()
        wk.wgrad_into(main_LKN, a, b, poffs_L, first, per_expert=True, fast=fast)
        return
    starts, ends, base = [], [], 0
    for (aT, _), _, poffs_L in helds:  # each micro-batch's expert ranges, shifted to its place (no host sync)
        offs_L = poffs_L.to(torch.int32)
        starts.append(F.pad(offs_L[:-1], (1, 0)) + base)
        ends.append(offs_L + base)
        base += aT.shape[1]
    starts_SL, ends_SL = torch.stack(starts), torch.stack(ends)
    sa, sb = torch.stack([h[0][1] for h in helds]), torch.stack([h[1][1] for h in helds])
    aT, bT = _side_by_side([h[0][0] for h in helds]), _side_by_side([h[1][0] for h in helds])
    if aT is None or bT is None:
        aT, bT = torch.cat([h[0][0] for h in helds], 1), torch.cat([h[1][0] for h in helds], 1)
        spec.wgrad_arena = (aT, bT)
    helds.clear()
    wk.wgrad_segments_into(main_LKN, (aT, sa), (bT, sb), starts_SL, ends_SL, first, fast=fast)


def _wgrad_unquantized(ctx, x_MK, dy_MN, offs, gid_M, w_LKN) -> torch.Tensor:
    """The wgrad from the unquantized operands (rows past the last expert's are never read): into the main grad under
    GradSync's fusion, else a new gradient."""
    sync, param = ctx.sync, ctx.param
    ctx.sync = ctx.param = None
    if sync is None:
        return _wgrad(x_MK, dy_MN, offs, gid_M).to(w_LKN.dtype)
    spec = ctx.spec  # FP8Training(defer_expert_wgrad)'s deferral, else MoEFoldStrategy(defer_expert_wgrad)'s
    defer = (spec.defer_wgrad, spec.defer_window) if spec.defer_wgrad else sync.expert_deferral
    wgrad_fusion.grouped_wgrad(sync, param, x_MK, dy_MN, offs, *defer)
    return sync.placeholder(param)  # never read: it only fires GradSync's hook, which drops it


def scaled_grouped_mm(x_MK: torch.Tensor, w_LKN: torch.Tensor, offs_L: torch.Tensor, spec: FP8Spec
                      ) -> torch.Tensor:
    """``y_g = x_g W_g`` for each expert, forward, dgrad and wgrad on FP8 kernels."""
    # under GradSync's fusion the Triton wgrad goes into the main grad (decided here: grad mode is off in forward)
    triton_wgrad = spec.formats()[1] == "e4m3" and (_triton_wgrad(_quant_kernels(spec, x_MK), x_MK) is not None
                                                    or both.kernels(spec, x_MK) is not None)
    unquantized = not spec.fp8_wgrad and spec.formats()[1] == "e4m3"  # E5M2: the emulated backward's wgrad
    sync = wgrad_fusion.sink_for(w_LKN, x_MK, grouped=True) if triton_wgrad or unquantized else None
    wgrad = torch.is_grad_enabled() and w_LKN.requires_grad and spec.fp8_wgrad
    return _ScaledGroupedMM.apply(x_MK, w_LKN, offs_L, spec, sync, wgrad)
