"""Per-expert FP8 quantization into both layouts in one pass: the tensorwise and delayed recipes' expert operands.

With one scale per expert (the tensorwise and delayed recipes), an operand's row-major copy for the forward or dgrad
GEMM and its transposed copy for the wgrad GEMM hold the same values: the wgrad's scale along the expert's tokens is
the forward's scale along the features. Where that scale is known before the operand is read (delayed scaling: the
amax history's), one read of the operand writes both copies and records its current amax for the history:

  quant_both             x (M, X) -> q (M, X), qT (X, P), amax (L,)            x forward, dy dgrad
  swiglu_both            h (M, 2F) -> a = SwiGLU(h) quantized as above        fc2's input
  swiglu_backward_both   g (M, F), h -> dh = SwiGLU's input gradient, as above (and the row weights' gradient)

against the rowwise recipe's four passes per operand (its row amax, the column amax, then the transposed copy: 1.5x
the bytes). qT is the wgrad's padded layout (``quant_t_padded``'s: expert e's rows at its aligned start, zeros in the
padding; columns past the last expert's padded end are not written); rows past the last expert's end are not
written in q. Bits: ``fp8._saturate``'s (one fp32 multiply, torch's clamp, nearest-even cast), of the operand in its
own dtype (SwiGLU's output and gradient rounded to it first, as the separate kernels store them).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from lightning_moe.modules.fp8 import FORMATS
from lightning_moe.modules.fp8 import _TINY
from lightning_moe.modules.triton_fp8_quant import _max_nan, _sat, _scale, _stored, expert_rows
from lightning_moe.modules.triton_launch import launch
from lightning_moe.modules.triton_swiglu import swiglu_grad_math, swiglu_math


# the operands' dtypes: from fp32 ones the transposed FP8 store (``tl.trans`` of a tile laid out for fp32 loads) wrote
# wrong bytes on an H100 with triton 3.6 (docs/PERFORMANCE.md), so they take the separate passes
DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _store_both(v, s, q_ptr, qt_ptr, r64, src_ok, p, pmask, cols, cmask, X, QT_STRIDE, FMAX: tl.constexpr):
    """``v`` (fp32, zeros where ``src_ok`` is false) quantized by ``s``, stored at its rows of q (valid rows) and
    transposed into qT (every padded position: zeros past the expert's rows)."""
    q = _sat(v * s, FMAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + r64 * X + cols[None, :], q, mask=src_ok[:, None] & cmask[None, :])
    tl.store(qt_ptr + cols.to(tl.int64)[:, None] * QT_STRIDE + p[None, :], tl.trans(q),
             mask=cmask[:, None] & pmask[None, :])


@triton.jit
def _amax_bits(a):
    """|x| >= 0 or NaN, ordered as its int32 bits for one atomic max (NaN: fp32's canonical one)."""
    return tl.where(a != a, 0x7FFFFFFF, a.to(tl.int32, bitcast=True))


@triton.jit
def _load_block(x_ptr, h_ptr, g_ptr, r64, cols, m2, W, SOURCE: tl.constexpr):
    """A block's source in fp32: (x, x, x) (SOURCE 0), (gate, up, up) (1) or (gate, up, g) (2)."""
    if SOURCE == 0:
        a = tl.load(x_ptr + r64 * W + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        b = a
        c = a
    else:
        a = tl.load(h_ptr + r64 * 2 * W + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        b = tl.load(h_ptr + r64 * 2 * W + W + cols[None, :], mask=m2, other=0.0).to(tl.float32)
        c = b
        if SOURCE == 2:
            c = tl.load(g_ptr + r64 * W + cols[None, :], mask=m2, other=0.0).to(tl.float32)
    return a, b, c


@triton.jit
def _expert_scale(hist_ptr, g, gv, pmask, L, H, FMAX: tl.constexpr, TINY: tl.constexpr, BLOCK_P: tl.constexpr,
                  BLOCK_EXPERT: tl.constexpr, BLOCK_H: tl.constexpr):
    """Each position's scale: ``_scale`` of the max of its expert's H amaxes in ``hist`` (H, L), read in one load."""
    hs = tl.arange(0, BLOCK_H)
    if BLOCK_EXPERT:
        used = tl.reduce(tl.load(hist_ptr + hs * L + g, mask=hs < H, other=0.0), 0, _max_nan) + tl.zeros(
            (BLOCK_P,), tl.float32)
    else:
        used = tl.reduce(tl.load(hist_ptr + hs[None, :] * L + gv[:, None], mask=pmask[:, None] & (hs < H)[None, :],
                                 other=0.0), 1, _max_nan)
    return _scale(used, FMAX, TINY, BLOCK_P)


@triton.jit
def _store_inverses(s_P, inv_m_ptr, inv_l_ptr, src, ok, gv, p, pmask, pstart, BLOCK_P: tl.constexpr):
    """The dequantization scales (the scales' reciprocals) per row and, from each expert's first position, per expert:
    by the first column program."""
    if tl.program_id(1) == 0:
        inv = _stored(s_P, True, BLOCK_P)
        tl.store(inv_m_ptr + src, inv, mask=ok)
        tl.store(inv_l_ptr + gv, inv, mask=pmask & (p == pstart))


@triton.jit
def _quant_block(a, b, c, s, pr, h_ptr, q_ptr, qt_ptr, gp_ptr, src, r64, ok, p, pmask, cols, cmask, m2, xb, W,
                 QT_STRIDE, FMAX: tl.constexpr, SOURCE: tl.constexpr, HAS_P: tl.constexpr, BLOCK_X: tl.constexpr):
    """A block's values (``_load_block``'s) quantized by ``s`` into q and qT (and its row weights' partial gradient);
    returns each row's amax."""
    if SOURCE == 0:
        _store_both(a, s, q_ptr, qt_ptr, r64, ok, p, pmask, cols, cmask, W, QT_STRIDE, FMAX)
        am = tl.abs(a)
    elif SOURCE == 1:  # rounded to the activation's dtype, as the SwiGLU kernel stores it
        v = swiglu_math(a, b, pr, HAS_P).to(h_ptr.dtype.element_ty).to(tl.float32)
        _store_both(v, s, q_ptr, qt_ptr, r64, ok, p, pmask, cols, cmask, W, QT_STRIDE, FMAX)
        am = tl.abs(v)
    else:
        d_gate, d_up, terms = swiglu_grad_math(c, a, b, pr, HAS_P)
        dg = d_gate.to(h_ptr.dtype.element_ty).to(tl.float32)
        du = d_up.to(h_ptr.dtype.element_ty).to(tl.float32)
        _store_both(dg, s, q_ptr, qt_ptr, r64, ok, p, pmask, cols, cmask, 2 * W, QT_STRIDE, FMAX)
        _store_both(du, s, q_ptr + W, qt_ptr + W.to(tl.int64) * QT_STRIDE, r64, ok, p, pmask, cols, cmask, 2 * W,
                    QT_STRIDE, FMAX)
        if HAS_P:  # per column block, as the host sums them
            tl.store(gp_ptr + src.to(tl.int64) * tl.cdiv(W, BLOCK_X) + xb, tl.sum(tl.where(m2, terms, 0.0), 1),
                     mask=ok & (p * 0 + xb * BLOCK_X < W))
        am = _max_nan(tl.abs(dg), tl.abs(du))
    return tl.reduce(am, 1, _max_nan)


@triton.jit
def _both_kernel(x_ptr, h_ptr, g_ptr, p_ptr, gp_ptr, hist_ptr, offs_ptr, poffs_ptr, gid_ptr, q_ptr, qt_ptr,
                 amax_ptr, inv_m_ptr, inv_l_ptr, P, W, L, H, QT_STRIDE, FMAX: tl.constexpr, TINY: tl.constexpr,
                 SOURCE: tl.constexpr, HAS_P: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_X: tl.constexpr,
                 BLOCK_EXPERT: tl.constexpr, BLOCK_H: tl.constexpr, LOOP: tl.constexpr, STAGES: tl.constexpr):
    """BLOCK_P padded positions x LOOP blocks (LOOP 0: one, in straight-line code) of BLOCK_X columns of the W-wide
    source: x (SOURCE 0, q is (M, W)),
    SwiGLU of h (1: W = F, q is (M, F)) or its input gradient from g and h (2: W = F, q is (M, 2F): both halves from
    one read, the row weights' partial gradient per column block into ``gp``). Each position's expert and source row,
    looked up once for the LOOP blocks (whose loads run STAGES deep: a program of one block waited on its lookups'
    dependent loads, then on its source, with little else in flight); its expert's scale from the max of the H amaxes
    ``hist`` (H, L) holds for it (``_scale``: ``scale_of``'s bits), its dequantization scale written per row and per
    expert by the first column program. ``BLOCK_EXPERT``: the padded ends are multiples of BLOCK_P, so the block is
    one expert's (its bounds read once, one atomic for its amax)."""
    p0 = tl.program_id(0) * BLOCK_P
    if p0 >= tl.load(poffs_ptr + L - 1):  # past the last expert's padded end: the GEMMs read nothing there
        return
    p = p0 + tl.arange(0, BLOCK_P)
    pmask = p < P
    g, start, end, pstart = expert_rows(p0, p, pmask, gid_ptr, offs_ptr, poffs_ptr, BLOCK_EXPERT)
    gv = g + tl.zeros((BLOCK_P,), tl.int32)  # each position's expert (one for all under BLOCK_EXPERT)
    src = start + (p - pstart)
    ok = pmask & (src < end)
    r64 = src.to(tl.int64)[:, None]
    pr = 1.0
    if LOOP == 0:
        # one block, its source's loads issued before the history's: each load's latency under the other's (a loop
        # over the history's rows, or the history first, waited for each in turn: the SwiGLU's gradient at Qwen3 took
        # 0.58 and 0.55 ms against 0.42 on an H100)
        xb = tl.program_id(1)
        cols = xb * BLOCK_X + tl.arange(0, BLOCK_X)
        cmask = cols < W
        m2 = ok[:, None] & cmask[None, :]
        a, b, c = _load_block(x_ptr, h_ptr, g_ptr, r64, cols, m2, W, SOURCE)
        if HAS_P:
            pr = tl.load(p_ptr + src, mask=ok, other=0.0).to(tl.float32)[:, None]
        s_P = _expert_scale(hist_ptr, g, gv, pmask, L, H, FMAX, TINY, BLOCK_P, BLOCK_EXPERT, BLOCK_H)
        _store_inverses(s_P, inv_m_ptr, inv_l_ptr, src, ok, gv, p, pmask, pstart, BLOCK_P)
        amax_P = _quant_block(a, b, c, s_P[:, None], pr, h_ptr, q_ptr, qt_ptr, gp_ptr, src, r64, ok, p, pmask, cols,
                              cmask, m2, xb, W, QT_STRIDE, FMAX, SOURCE, HAS_P, BLOCK_X)
    else:
        if HAS_P:
            pr = tl.load(p_ptr + src, mask=ok, other=0.0).to(tl.float32)[:, None]
        s_P = _expert_scale(hist_ptr, g, gv, pmask, L, H, FMAX, TINY, BLOCK_P, BLOCK_EXPERT, BLOCK_H)
        _store_inverses(s_P, inv_m_ptr, inv_l_ptr, src, ok, gv, p, pmask, pstart, BLOCK_P)
        amax_P = tl.zeros((BLOCK_P,), tl.float32)
        for i in tl.range(0, LOOP, num_stages=STAGES):
            xb = tl.program_id(1) * LOOP + i
            cols = xb * BLOCK_X + tl.arange(0, BLOCK_X)
            cmask = cols < W
            m2 = ok[:, None] & cmask[None, :]
            a, b, c = _load_block(x_ptr, h_ptr, g_ptr, r64, cols, m2, W, SOURCE)
            amax_P = _max_nan(amax_P, _quant_block(a, b, c, s_P[:, None], pr, h_ptr, q_ptr, qt_ptr, gp_ptr, src, r64,
                                                   ok, p, pmask, cols, cmask, m2, xb, W, QT_STRIDE, FMAX, SOURCE,
                                                   HAS_P, BLOCK_X))
    if BLOCK_EXPERT:
        tl.atomic_max(amax_ptr + g, _amax_bits(tl.reduce(amax_P, 0, _max_nan)), sem="relaxed")
    else:
        tl.atomic_max(amax_ptr + g, _amax_bits(amax_P), mask=ok, sem="relaxed")


@functools.lru_cache(maxsize=64)
def config(W: int, source: int) -> tuple:
    """(BLOCK_P, BLOCK_X, warps, LOOP, STAGES), measured on an H100 (docs/PERFORMANCE.md):
    - x: 64 positions (half a token block of the wgrad: one expert's) by 256 columns, 8 warps, a program taking 4
      column blocks three loads deep (0.399 ms at Qwen3 against 0.411 for one 64 x 128 block a program; OLMoE -1 %);
    - the SwiGLU: 64 x 128, one block in the loop's form (96 registers, 0.238 ms; straight-line: 255, 0.263);
    - its gradient: 32 x 128 (two halves stored), one block in straight-line code, its source's loads ahead of the
      history's (Qwen3: 0.414 ms, the loop's form 0.473, ``benchmarks/bench_fp8_both.py``)."""
    return (32, 128, 4, 0, 1) if source == 2 else (64, 128, 4, 1, 1) if source == 1 else (64, 256, 8, 4, 3)


def _launch(source: int, x, h, g, p, amax_HL, offs_L, poffs_L, gid_P, P: int, W: int, q_cols: int, fmt: str,
            out: Optional[torch.Tensor], align: int, cfg) -> tuple:
    dtype, fmax = FORMATS[fmt]
    src = x if x is not None else h
    if src.dtype not in DTYPES:
        raise ValueError(f"triton_fp8_both: {src.dtype} operands are not supported (only {DTYPES}): from fp32 ones "
                         "the transposed copy came out wrong on an H100 with triton 3.6; quantize them separately")
    M, dev, L = src.shape[0], src.device, offs_L.numel()
    q = torch.empty(M, q_cols, device=dev, dtype=dtype)
    if out is not None and (out.shape != (q_cols, P) or out.dtype != dtype or (P and out.stride(1) != 1)):
        raise ValueError(f"FP8 both layouts: out {tuple(out.shape)} {out.dtype} with strides {out.stride()}: want "
                         f"({q_cols}, {P}) {dtype} with unit column stride")
    qt = torch.empty(q_cols, P, device=dev, dtype=dtype) if out is None else out
    amax_bits = torch.zeros(L, device=dev, dtype=torch.int32)
    inv_M = torch.empty(M, device=dev, dtype=torch.float32)
    inv_L = torch.ones(L, device=dev, dtype=torch.float32)  # an empty expert's: no row writes it
    amax_HL = amax_HL.float().reshape(-1, L).contiguous()
    BLOCK_P, BLOCK_X, warps, loop, stages = (*(cfg or config(W, source)), 1, 1)[:5]  # (BP, BX, warps): LOOP 1
    nxb = triton.cdiv(W, BLOCK_X)
    gp = torch.zeros(M, nxb, device=dev, dtype=torch.float32) if source == 2 and p is not None else None
    if P and W and L:
        launch(_both_kernel, (triton.cdiv(P, BLOCK_P), triton.cdiv(nxb, max(loop, 1))), src,
               src if h is None else h, src if g is None else g, src if p is None else p,
               amax_bits if gp is None else gp, amax_HL,
               offs_L.to(torch.int32).contiguous(), poffs_L.to(torch.int32).contiguous(),
               gid_P.to(torch.int32).contiguous(), q, qt, amax_bits, inv_M, inv_L, P, W, L, amax_HL.shape[0],
               qt.stride(0), FMAX=fmax, TINY=_TINY, SOURCE=source,
               HAS_P=p is not None, BLOCK_P=BLOCK_P, BLOCK_X=BLOCK_X, BLOCK_EXPERT=align % BLOCK_P == 0,
               BLOCK_H=max(16, triton.next_power_of_2(amax_HL.shape[0])), LOOP=loop, STAGES=stages, num_warps=warps,
               enable_fp_fusion=True)  # triton_swiglu's contraction; the quantization has no add
    return q, qt, inv_M, inv_L, amax_bits.view(torch.float32), gp


def quant_both(x_MX: torch.Tensor, amax_HL: torch.Tensor, offs_L: torch.Tensor, poffs_L: torch.Tensor,
               gid_P: torch.Tensor, P: int, fmt: str = "e4m3", out: Optional[torch.Tensor] = None, align: int = 1,
               cfg: Optional[tuple] = None) -> tuple:
    """``(q_MX, qT_XP, inv_M, inv_L, amax_L)``: x's rows quantized by their expert's scale, ``scale_of`` of the max of
    the H amaxes ``amax_HL`` (H, L) holds for it (a delayed history, or (1, L) the current amaxes), row-major and in
    the wgrad's padded transposed layout (``poffs_L``/``gid_P``/``P``: ``fp8_rows_layout``'s; into ``out``, an (X, P)
    view, where given; ``align``: its alignment); the dequantization scales (the scales' reciprocals) per row of an
    expert (others undefined) and per expert (1 for an empty one); and each expert's amax of |x| over its rows (fp32;
    0 for an empty expert)."""
    x_MX = x_MX.contiguous()
    X = x_MX.shape[1]
    return _launch(0, x_MX, None, None, None, amax_HL, offs_L, poffs_L, gid_P, P, X, X, fmt, out, align, cfg)[:5]


def swiglu_both(h_M2F: torch.Tensor, p_M: Optional[torch.Tensor], amax_HL: torch.Tensor, offs_L: torch.Tensor,
                poffs_L: torch.Tensor, gid_P: torch.Tensor, P: int, fmt: str = "e4m3",
                out: Optional[torch.Tensor] = None, align: int = 1, cfg: Optional[tuple] = None) -> tuple:
    """``quant_both(swiglu(h, p))`` without writing the SwiGLU: ``(q_MF, qT_FP, inv_M, inv_L, amax_L)``."""
    h_M2F = h_M2F.contiguous()
    F = h_M2F.shape[1] // 2
    p_M = p_M.reshape(-1).contiguous() if p_M is not None else None
    return _launch(1, None, h_M2F, None, p_M, amax_HL, offs_L, poffs_L, gid_P, P, F, F, fmt, out, align, cfg)[:5]


def swiglu_backward_both(g_MF: torch.Tensor, h_M2F: torch.Tensor, p_M: Optional[torch.Tensor],
                         amax_HL: torch.Tensor, offs_L: torch.Tensor, poffs_L: torch.Tensor, gid_P: torch.Tensor,
                         P: int, fmt: str = "e4m3", out: Optional[torch.Tensor] = None, align: int = 1,
                         cfg: Optional[tuple] = None) -> tuple:
    """``quant_both`` of SwiGLU's input gradient (``g`` the output's gradient) without writing it: ``(q_M2F, qT_2FP,
    inv_M, inv_L, amax_L, gp_M)``, ``gp`` the row weights' gradient (None without ``p``; rows past the last expert's
    undefined)."""
    h_M2F, g_MF = h_M2F.contiguous(), g_MF.contiguous()
    F = h_M2F.shape[1] // 2
    p_M = p_M.reshape(-1).contiguous() if p_M is not None else None
    *res, gp = _launch(2, None, h_M2F, g_MF, p_M, amax_HL, offs_L, poffs_L, gid_P, P, F, 2 * F, fmt, out, align, cfg)
    return (*res, gp.sum(1) if gp is not None else None)
