"""The dense FP8 linear with one scale per tensor (the tensorwise and delayed recipes in E4M3): each operand in both
layouts from one pass, as ``fp8_grouped_both`` does for the experts (``triton_fp8_both`` over one group).

x's copy for the forward and x^T's for the wgrad share x's scale, as dy's for the dgrad and dy^T's for the wgrad
share dy's: one read of each operand writes both, and backward keeps x^T (FP8) instead of x. The weight's two copies
come from one scale, cached once per optimizer step under FP8Training. The GEMMs are ``torch._scaled_mm``'s with the
separate passes' operands and scales, so the same bits; forwards without a backward (validation) take the same path,
so that they share the weight copies and push the same histories. Delayed scaling's x^T is scaled by x's history, as
Transformer Engine does; the emulation keeps an ``x_t`` history too, pushed in backward only, so the two differ where
a forward runs without its backward (validation); a recomputation's replay scales as its first pass did and pushes
nothing (``fp8.Recomputed``). The wgrad's reduction over tokens is padded to a multiple of 128 with zero columns.

Shapes: M tokens, K input features, N output features, P tokens padded.
"""

from __future__ import annotations

import functools
import os

import torch

from lightning_moe.modules.fp8 import FORMATS, AmaxHistory, Tiling, fp8_mm, saturate, scale_of
from lightning_moe.modules.fp8_grouped import reduce_groups  # over data_group: the ranks holding other tokens
from lightning_moe.modules.fp8_linear import FP8Spec
from lightning_moe.modules.kernels import interpreting, load

ENABLED = os.environ.get("LMOE_FP8_BOTH", "1") != "0"  # 0: the separate passes, for comparisons
ALIGN = 128  # the wgrad's padded tokens: whole blocks of the pass, one group
_TENSOR = Tiling(None, None)


def kernels(spec: FP8Spec, t: torch.Tensor):
    """``triton_fp8_both`` where this linear's operands go through it: one scale per tensor in E4M3, an FP8 wgrad,
    no TP group to reduce an amax over, 16-bit operands, on CUDA (SM 8.9 or later); else None."""
    from lightning_moe.modules.fp8_linear import _capability
    if (not ENABLED or spec.recipe not in ("tensorwise", "delayed") or spec.formats() != ("e4m3", "e4m3")
            or not spec.fp8_wgrad or spec.group is not None or spec.emulate or not t.is_cuda or interpreting()
            or t.dtype not in (torch.bfloat16, torch.float16) or _capability(t.device.index) < (8, 9)):
        return None  # fp32 operands: the separate passes (triton_fp8_both.DTYPES)
    return load("triton_fp8_both", t)


@functools.lru_cache(maxsize=16)  # a few token counts per model; bounded for variable-length batches
def _layout(M: int, device: torch.device) -> tuple:
    """The one group's bounds on the device, made once per token count: (offs, poffs, gid_P, P)."""
    P = -(-M // ALIGN) * ALIGN
    with torch.inference_mode(False):  # read by training too
        return (torch.full((1,), M, dtype=torch.int32, device=device),
                torch.full((1,), P, dtype=torch.int32, device=device),
                torch.zeros(P, dtype=torch.int32, device=device), P)


def _quantize(tb, spec: FP8Spec, name: str, x_MK: torch.Tensor) -> tuple:
    """``((q_MK, None, inv), (qT_KP, None, inv))``: operand ``name`` for ``fp8_mm`` in both layouts, one pass (after
    its amax, where needed: tensorwise, a history's first use)."""
    M = x_MK.shape[0]
    offs, poffs, gid_P, P = _layout(M, x_MK.device)
    hist = spec.histories.setdefault(name, AmaxHistory(spec.history)) if spec.recipe == "delayed" else None
    ring = hist.ring() if hist is not None else None  # a recomputation's replay: its first pass's, no push
    push = ring is not None and ring[1]
    if ring is not None:
        amax_HL = ring[0].reshape(-1, 1)
    else:
        amax = reduce_groups(x_MK.detach().abs().amax().float().reshape(1), spec, False, tokens=True)
        amax_HL = (hist.amax(amax) if hist is not None else amax).reshape(1, 1)
    q, qT, _, inv_L, amax_L = tb.quant_both(x_MK, amax_HL, offs, poffs, gid_P, P, spec.formats()[0], align=ALIGN)
    if push:
        hist.push(reduce_groups(amax_L, spec, False, tokens=True))
    inv = inv_L.reshape(1, 1)
    return (q, None, inv), (qT, None, inv)


def _weights(w_NK: torch.Tensor, spec: FP8Spec) -> tuple:
    """The weight's forward (N, K) and dgrad (K, N) copies, one scale (its history's under delayed scaling)."""
    fmt = spec.formats()[0]
    dtype, fmax = FORMATS[fmt]
    amax = spec.weight_amax(w_NK)  # the FP8 parameter all-gather's: its bytes back
    if amax is None:
        amax = spec.amax("w", w_NK, _TENSOR, None, None)
    amax = w_NK.detach().abs().amax().float().reshape(1, 1) if amax is None else amax.float().reshape(1, 1)
    s = scale_of(amax, fmt)
    inv = s.reciprocal()
    return (saturate(w_NK, s, fmax, dtype), None, inv), (saturate(w_NK.t(), s, fmax, dtype).contiguous(), None, inv)


def forward(ctx, tb, x: torch.Tensor, w_NK: torch.Tensor, spec: FP8Spec) -> torch.Tensor:
    x_MK = x.reshape(-1, x.shape[-1]).contiguous()
    x_q, xT_q = _quantize(tb, spec, "x", x_MK)
    w_q, wt_q = spec.cached_weight("w_both", w_NK, lambda: _weights(w_NK, spec))
    y = fp8_mm(x_MK, None, _TENSOR, _TENSOR, "e4m3", "e4m3", x.dtype, False, None, None, spec.fast("fprop"),
               b_q=w_q, a_q=x_q)
    ctx.save_for_backward(xT_q[0], xT_q[2], w_NK)
    ctx.w_t, ctx.x_shape, ctx.x_dtype = wt_q, x.shape, x.dtype
    return y.reshape(*x.shape[:-1], w_NK.shape[0])


def backward(ctx, tb, dy: torch.Tensor) -> tuple:
    """``(dx, dw)``."""
    xT, x_inv, w_NK = ctx.saved_tensors
    spec = ctx.spec
    dy_MN = dy.reshape(-1, dy.shape[-1]).contiguous()
    dy_q, dyT_q = _quantize(tb, spec, "dy", dy_MN)
    wt_q, ctx.w_t = ctx.w_t, None
    dx = fp8_mm(dy_MN, None, _TENSOR, _TENSOR, "e4m3", "e4m3", ctx.x_dtype, False, None, None, spec.fast("dgrad"),
                b_q=wt_q, a_q=dy_q)
    dw = fp8_mm(dyT_q[0], None, _TENSOR, _TENSOR, "e4m3", "e4m3", w_NK.dtype, False, None, None, spec.fast("wgrad"),
                b_q=(xT, None, x_inv), a_q=dyT_q)
    return dx.reshape(ctx.x_shape), dw
