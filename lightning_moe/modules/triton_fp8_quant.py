"""Triton kernels for the rowwise FP8 recipe's quantization on ``torch._scaled_grouped_mm`` (``fp8_grouped_kernels``):
the same bits as the torch code (``fp8.scale_of``, ``fp8.saturate``, ``expert_padding.scatter_rows``) in fewer passes.

rowwise_quant      q = sat(x * 448 / max(amax_row, 1e-12))          one read of x, one write (x forward, dy dgrad)
grouped_col_amax   amax[e, k] = max over expert e's rows of |x[:, k]|  one read; rows past offs[-1] never read
rowwise_quant_col_amax
                   both of the above from the same read of x           one read, one write
quant_t_padded     q^T in the wgrad layout: expert e's rows at its 16-aligned padded start, transposed to (X, P),
                   zeros in the padding                                one read, one write
colwise_quant_t    rowwise_quant(x^T) without the transposed copy: the column amax, then a transposed pass that
                   computes the scales (the dense linear's wgrad operands)   two reads, one write

dequant_packed     x = q / scale of the FP8 dispatch's packed rows (``fp8_dispatch.unpack``)  one read, one write

The experts' wgrad operand is a column amax and quant_t_padded with the scale (and any amax reduction over ranks) in
between. Bit-exactness: products are single fp32 multiplies, the scale torch's correctly rounded reciprocal times FMAX,
the clamp keeps NaNs as torch's does, and the cast rounds to nearest even as torch's does.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from lightning_moe.modules.fp8 import _TINY, FORMATS, scale_of
from lightning_moe.modules.kernels import interpreting
from lightning_moe.modules.triton_swiglu import swiglu_grad_math, swiglu_math
from lightning_moe.modules.triton_launch import launch


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)  # torch's amax keeps NaNs


# On an NVIDIA GPU the FP8 cast that follows ``_sat`` is the hardware's (cvt.rn.satfinite: nearest even, finite
# values past FMAX and infinities to +-FMAX, NaN to NaN: torch's clamp-then-cast bytes), so ``_sat`` leaves the values
# alone there (the clamp cost four instructions a value, a quarter of a memory-bound pass's). ROCm's cast is not known
# to saturate: there the clamp stays. The interpreter's own fp8 rounding is not torch's, so there ``_sat`` clamps and
# rounds in fp32 first.
_ROUND_IN_FP32 = tl.constexpr(interpreting())
_CLAMP = tl.constexpr(interpreting() or torch.version.hip is not None)


@triton.jit
def _sat(v, FMAX: tl.constexpr):
    """torch's clamp(-FMAX, FMAX) (NaN stays NaN), for the FP8 cast that the caller makes at once: NVIDIA's saturating
    cast clamps by itself; elsewhere the values are clamped here (and rounded, under the interpreter)."""
    if _CLAMP:
        v = tl.where(v > FMAX, FMAX, tl.where(v < -FMAX, -FMAX, v))
    if _ROUND_IN_FP32:
        v = _rne_e4m3(v)
    return v


@triton.jit
def _rne_e4m3(v):
    """``v`` (saturated) rounded to the nearest E4M3 value, ties to even, in fp32: the cast that follows is then exact
    on any backend (the interpreter's own fp8 rounding is not torch's). Normals keep 3 mantissa bits; subnormals
    are multiples of 2^-9, which adding and removing 2^14 (whose ulp that is) rounds to."""
    bits = v.to(tl.int32, bitcast=True)
    normal = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    sub = ((tl.abs(v) + 16384.0) - 16384.0).to(tl.int32, bitcast=True) | ((bits >> 31) << 31)  # keeps -0
    return tl.where(tl.abs(v) < 0.015625, sub, normal).to(tl.float32, bitcast=True)


@triton.jit
def _scale(amax, FMAX: tl.constexpr, TINY: tl.constexpr, BLOCK: tl.constexpr):
    """``fp8.scale_of``: torch's ``FMAX / t`` is ``t.reciprocal() * FMAX`` (two roundings), the reciprocal exact."""
    return tl.math.div_rn(tl.full((BLOCK,), 1.0, tl.float32), _max_nan(amax, TINY)) * FMAX


@triton.jit
def _stored(scale, INV: tl.constexpr, BLOCK: tl.constexpr):
    """The scale, or with INV the GEMMs' dequantization scale: torch's ``scale.reciprocal()`` (correctly rounded)."""
    if INV:
        return tl.math.div_rn(tl.full((BLOCK,), 1.0, tl.float32), scale)
    return scale


@triton.jit
def _rowwise_kernel(x_ptr, q_ptr, s_ptr, M, K, FMAX: tl.constexpr, TINY: tl.constexpr, ONE_PASS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, INV: tl.constexpr = False):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    base = rows.to(tl.int64)[:, None] * K
    cols = tl.arange(0, BLOCK_K)
    if ONE_PASS:  # the rows fit in registers: read once
        mask = rmask[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + base + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        amax = tl.reduce(tl.abs(x), 1, _max_nan)
        scale = _scale(amax, FMAX, TINY, BLOCK_M)
        q = _sat(x * scale[:, None], FMAX)
        tl.store(q_ptr + base + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    else:  # wide rows: the second read comes from L2
        amax = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = rmask[:, None] & (k0 + cols < K)[None, :]
            x = tl.load(x_ptr + base + k0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = _max_nan(amax, tl.reduce(tl.abs(x), 1, _max_nan))
        scale = _scale(amax, FMAX, TINY, BLOCK_M)
        for k0 in range(0, K, BLOCK_K):
            mask = rmask[:, None] & (k0 + cols < K)[None, :]
            x = tl.load(x_ptr + base + k0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            q = _sat(x * scale[:, None], FMAX)
            tl.store(q_ptr + base + k0 + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + rows, _stored(scale, INV, BLOCK_M), mask=rmask)


@triton.jit
def _col_amax_kernel(x_ptr, offs_ptr, gid_ptr, amax_ptr, M, X, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_X: tl.constexpr, ONE_GROUP: tl.constexpr = False):
    """A chunk of CHUNK rows (usually within one expert) x BLOCK_X columns; atomic max into the zeroed (L, X)
    amaxes (exact and order-free: a max). The running max is a whole tile, reduced over its rows once per expert:
    the loop is then loads and elementwise maxes, without a cross-thread reduction per block (1.5-1.7x as fast on an
    H100, docs/PERFORMANCE.md). ``ONE_GROUP``: every row in one group (the dense linear's), no offsets or groups read."""
    r0 = tl.program_id(0) * CHUNK
    r1 = tl.minimum(r0 + CHUNK, M)
    cols = tl.program_id(1) * BLOCK_X + tl.arange(0, BLOCK_X)
    cmask = cols < X
    rr = tl.arange(0, BLOCK_M)
    if ONE_GROUP:
        g0 = 0
        g1 = 0
    else:
        g0 = tl.load(gid_ptr + r0)
        g1 = tl.load(gid_ptr + r1 - 1)
    for e in range(g0, g1 + 1):
        if ONE_GROUP:
            start = 0
            end = M
        else:
            start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)), 0)
            end = tl.load(offs_ptr + e)  # rows past offs[-1] (tail) belong to no expert
        lo, hi = tl.maximum(start, r0), tl.minimum(end, r1)
        acc = tl.zeros((BLOCK_M, BLOCK_X), tl.float32)
        for r in range(lo, hi, BLOCK_M):
            rows = r + rr
            mask = (rows < hi)[:, None] & cmask[None, :]
            x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * X + cols[None, :], mask=mask, other=0.0)
            acc = _max_nan(acc, tl.abs(x.to(tl.float32)))
        if lo < hi:
            tl.atomic_max(amax_ptr + e * X + cols, tl.reduce(acc, 0, _max_nan), mask=cmask)


@triton.jit
def _rowwise_col_amax_kernel(x_ptr, q_ptr, s_ptr, offs_ptr, gid_ptr, amax_ptr, M, K, L, CHUNK, FMAX: tl.constexpr,
                             TINY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NKB: tl.constexpr,
                             STAGES: tl.constexpr, KEEP: tl.constexpr, INV: tl.constexpr = False,
                             SOURCE: tl.constexpr = 0, h_ptr=None, g_ptr=None, p_ptr=None, gp_ptr=None,
                             HAS_P: tl.constexpr = False, ACC_BF16: tl.constexpr = False):
    """``_rowwise_kernel``'s rows and ``_col_amax_kernel``'s amaxes from one read: a chunk of CHUNK rows, walked in
    blocks of BLOCK_M whole rows (NKB blocks of BLOCK_K columns), each expert's part of the chunk in turn, then its
    tail rows (past offs[-1]: quantized, in no amax). The column maxes are NKB running tiles in registers (a tuple:
    Triton cannot index one tensor by a loop's block), reduced over their rows and merged with one atomic max per
    column per expert part. The row block's tiles stay in registers between its amax and its quantization (KEEP,
    always for NKB = 1), else the second read comes from L2 (wide rows). The maxes run in fp32 (exact).

    ``SOURCE`` 1 and 2 make x instead of reading it, and write it to ``x_ptr``: the SwiGLU of ``h`` (weighted by
    ``p`` with HAS_P; x is (M, F)), or SwiGLU's input gradient from ``g`` and ``h`` (x is (M, 2F), the row weights'
    gradient into ``gp``), with ``triton_swiglu``'s math and roundings. Their F is a multiple of BLOCK_K.
    ``ACC_BF16`` (SOURCE 1 and 2, bf16 x only) keeps the column maxes in bf16 instead, exact for bf16 values too, in
    half the registers."""
    r0 = tl.program_id(0) * CHUNK
    r1 = tl.minimum(r0 + CHUNK, M)
    rr = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    g0 = tl.load(gid_ptr + r0)
    g1 = tl.load(gid_ptr + r1 - 1)
    tail = tl.load(offs_ptr + L - 1)
    for e in range(g0, g1 + 2):  # e = g1 + 1: the tail rows
        ee = tl.minimum(e, g1)
        start = tl.where(e > g1, tail, tl.where(ee > 0, tl.load(offs_ptr + tl.maximum(ee - 1, 0)), 0))
        end = tl.where(e > g1, M, tl.load(offs_ptr + ee))
        lo, hi = tl.maximum(start, r0), tl.minimum(end, r1)
        accs = ()
        for kb in tl.static_range(NKB):
            if ACC_BF16:
                accs = accs + (tl.zeros((BLOCK_M, BLOCK_K), tl.bfloat16),)
            else:
                accs = accs + (tl.zeros((BLOCK_M, BLOCK_K), tl.float32),)
        for r in tl.range(lo, hi, BLOCK_M, num_stages=STAGES):  # STAGES > 1: later blocks' loads in flight
            rows = r + rr
            rmask = rows < hi
            base = rows.to(tl.int64)[:, None] * K
            amax = tl.zeros((BLOCK_M,), tl.float32)
            new, xs = (), ()
            if SOURCE == 0:
                for kb in tl.static_range(NKB):
                    mask = rmask[:, None] & (kb * BLOCK_K + cols < K)[None, :]
                    x = tl.load(x_ptr + base + kb * BLOCK_K + cols[None, :], mask=mask, other=0.0)
                    ax = tl.abs(x.to(tl.float32))  # fp32 maxes: Triton 3.6 reduces bf16 maxes through fp32
                    amax = _max_nan(amax, tl.reduce(ax, 1, _max_nan))
                    new = new + (_max_nan(accs[kb], ax),)
                    if KEEP or NKB == 1:
                        xs = xs + (x,)
            else:
                amax, new, xs = _swiglu_tiles(x_ptr, h_ptr, g_ptr, p_ptr, gp_ptr, rows, rmask, base, cols, K, accs,
                                              SOURCE, HAS_P, BLOCK_M, BLOCK_K, NKB, KEEP, ACC_BF16)
            accs = new
            scale = _scale(amax, FMAX, TINY, BLOCK_M)
            for kb in tl.static_range(NKB):
                mask = rmask[:, None] & (kb * BLOCK_K + cols < K)[None, :]
                if KEEP or (NKB == 1 and SOURCE == 0):
                    x = xs[kb]
                else:
                    x = tl.load(x_ptr + base + kb * BLOCK_K + cols[None, :], mask=mask, other=0.0)
                q = _sat(x.to(tl.float32) * scale[:, None], FMAX)
                tl.store(q_ptr + base + kb * BLOCK_K + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
            tl.store(s_ptr + rows, _stored(scale, INV, BLOCK_M), mask=rmask)
        if (lo < hi) & (e <= g1):
            for kb in tl.static_range(NKB):
                kc = kb * BLOCK_K + cols
                cmax = tl.reduce(accs[kb].to(tl.float32), 0, _max_nan)
                # |x| >= 0 or NaN is ordered as its int32 bits (the one atomic of tl.atomic_max's fp32 pair that
                # acts); a NaN as fp32's canonical one, grouped_col_amax's on a GPU (bf16's, widened, is not)
                cmax_bits = tl.where(cmax != cmax, 0x7FFFFFFF, cmax.to(tl.int32, bitcast=True))
                tl.atomic_max(amax_ptr + e * K + kc, cmax_bits, mask=kc < K, sem="relaxed")


@triton.jit
def _swiglu_tiles(x_ptr, h_ptr, g_ptr, p_ptr, gp_ptr, rows, rmask, base, cols, K, accs, SOURCE: tl.constexpr,
                  HAS_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, NKB: tl.constexpr,
                  KEEP: tl.constexpr, ACC_BF16: tl.constexpr):
    """``_rowwise_col_amax_kernel``'s row block made (SOURCE 1: SwiGLU; 2: its input gradient): ``(row amax, column
    max tiles, the tiles kept)``. Each F block of h (and g) is read once; the backward's gate and up halves are tiles b
    and NKB / 2 + b. x is written here (measured faster than with the quantization's stores), and without KEEP the
    quantization reads it back, after a barrier."""
    NF: tl.constexpr = NKB if SOURCE == 1 else NKB // 2
    F = K if SOURCE == 1 else K // 2
    r64 = rows.to(tl.int64)[:, None]
    p = 1.0
    if HAS_P:
        p = tl.load(p_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    amax = tl.zeros((BLOCK_M,), tl.float32)
    dot = tl.zeros((BLOCK_M,), tl.float32)
    new, xs, new_up, xs_up = (), (), (), ()
    for fb in tl.static_range(NF):
        fc = fb * BLOCK_K + cols
        mask = rmask[:, None] & (fc < F)[None, :]
        gate = tl.load(h_ptr + r64 * 2 * F + fc[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + r64 * 2 * F + F + fc[None, :], mask=mask, other=0.0).to(tl.float32)
        if SOURCE == 1:
            x = swiglu_math(gate, up, p, HAS_P).to(x_ptr.dtype.element_ty)
            tl.store(x_ptr + base + fc[None, :], x, mask=mask)
            ax = tl.abs(x.to(tl.float32))
            amax = _max_nan(amax, tl.reduce(ax, 1, _max_nan))
            new = new + (_max_nan(accs[fb], tl.abs(x)).to(tl.bfloat16) if ACC_BF16 else _max_nan(accs[fb], ax),)
            if KEEP:
                xs = xs + (x,)
        else:
            g = tl.load(g_ptr + r64 * F + fc[None, :], mask=mask, other=0.0).to(tl.float32)
            d_gate, d_up, terms = swiglu_grad_math(g, gate, up, p, HAS_P)
            if HAS_P:
                dot += tl.sum(terms, 1)
            dg, du = d_gate.to(x_ptr.dtype.element_ty), d_up.to(x_ptr.dtype.element_ty)
            tl.store(x_ptr + base + fc[None, :], dg, mask=mask)
            tl.store(x_ptr + base + F + fc[None, :], du, mask=mask)
            ag, au = tl.abs(dg.to(tl.float32)), tl.abs(du.to(tl.float32))
            amax = _max_nan(amax, _max_nan(tl.reduce(ag, 1, _max_nan), tl.reduce(au, 1, _max_nan)))
            if ACC_BF16:
                new = new + (_max_nan(accs[fb], tl.abs(dg)).to(tl.bfloat16),)
                new_up = new_up + (_max_nan(accs[NF + fb], tl.abs(du)).to(tl.bfloat16),)
            else:
                new, new_up = new + (_max_nan(accs[fb], ag),), new_up + (_max_nan(accs[NF + fb], au),)
            if KEEP:
                xs, xs_up = xs + (dg,), xs_up + (du,)
    if SOURCE == 2:
        new, xs = new + new_up, xs + xs_up
        if HAS_P:
            tl.store(gp_ptr + rows, dot, mask=rmask)
    if not KEEP:
        tl.debug_barrier()  # the quantization reads back what other threads of the block wrote
    return amax, new, xs


@triton.jit
def _quant_t_one_group_kernel(x_ptr, amax_ptr, q_ptr, s_ptr, inv_ptr, M, X, FMAX: tl.constexpr, TINY: tl.constexpr,
                              BLOCK_P: tl.constexpr, BLOCK_X: tl.constexpr, INV: tl.constexpr):
    """``_quant_t_kernel`` for one group of every row (the dense linear's wgrad operands, no padding): the scales
    computed here from the column amaxes (``_scale``: ``scale_of``'s bits), and written, with their reciprocals
    (``INV``), by the first row of programs."""
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    cols = tl.program_id(1) * BLOCK_X + tl.arange(0, BLOCK_X)
    pmask, cmask = p < M, cols < X
    s = _scale(tl.load(amax_ptr + cols, mask=cmask, other=1.0), FMAX, TINY, BLOCK_X)
    x = tl.load(x_ptr + p.to(tl.int64)[:, None] * X + cols[None, :], mask=pmask[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)
    q = _sat(x * s[None, :], FMAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + cols.to(tl.int64)[:, None] * M + p[None, :], tl.trans(q), mask=cmask[:, None] & pmask[None, :])
    if tl.program_id(0) == 0:
        tl.store(s_ptr + cols, s, mask=cmask)
        if INV:
            tl.store(inv_ptr + cols, _stored(s, True, BLOCK_X), mask=cmask)


@triton.jit
def expert_rows(p0, p, pmask, gid_ptr, offs_ptr, poffs_ptr, BLOCK_EXPERT: tl.constexpr):
    """``(expert, its first row, its end row, its first padded position)`` of the padded positions ``p`` (``p0``
    the block's first): per position, or with ``BLOCK_EXPERT`` (the block is one expert's) once, as scalars."""
    if BLOCK_EXPERT:
        g = tl.load(gid_ptr + p0)
        start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
        end = tl.load(offs_ptr + g)
        pstart = tl.load(poffs_ptr + g - 1, mask=g > 0, other=0)
    else:
        g = tl.load(gid_ptr + p, mask=pmask, other=0)
        first = pmask & (g > 0)
        start = tl.load(offs_ptr + g - 1, mask=first, other=0)
        end = tl.load(offs_ptr + g, mask=pmask, other=0)
        pstart = tl.load(poffs_ptr + g - 1, mask=first, other=0)
    return g, start, end, pstart


@triton.jit
def _quant_t_kernel(x_ptr, scale_ptr, offs_ptr, poffs_ptr, gid_ptr, q_ptr, P, X, Q_STRIDE, FMAX: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_EXPERT: tl.constexpr = False):
    """BLOCK_P padded positions x BLOCK_X columns: each position's expert (gid), its source row, a transposed
    store. Padding positions (past their expert's rows, or past the last expert) read zeros. ``BLOCK_EXPERT``: the
    padded ends are multiples of BLOCK_P, so the block is one expert's: its ends and scales are read once, not
    gathered per position."""
    p0 = tl.program_id(0) * BLOCK_P
    p = p0 + tl.arange(0, BLOCK_P)
    cols = tl.program_id(1) * BLOCK_X + tl.arange(0, BLOCK_X)
    pmask, cmask = p < P, cols < X
    g, start, end, pstart = expert_rows(p0, p, pmask, gid_ptr, offs_ptr, poffs_ptr, BLOCK_EXPERT)
    if BLOCK_EXPERT:  # padding rows are zeros times their expert's scale, as in the torch layout
        s = tl.load(scale_ptr + g.to(tl.int64) * X + cols, mask=cmask, other=1.0)[None, :]
    else:
        s = tl.load(scale_ptr + g.to(tl.int64)[:, None] * X + cols[None, :], mask=pmask[:, None] & cmask[None, :],
                    other=1.0)
    src = start + (p - pstart)
    valid = pmask & (src < end)
    x = tl.load(x_ptr + src.to(tl.int64)[:, None] * X + cols[None, :], mask=valid[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)
    q = _sat(x * s, FMAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + cols.to(tl.int64)[:, None] * Q_STRIDE + p[None, :], tl.trans(q),
             mask=cmask[:, None] & pmask[None, :])


def rowwise_quant(x_MK: torch.Tensor, fmt: str = "e4m3", inverse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q_MK, scale_M1)``: ``fp8._cast(x, abs_amax(x, 1), fmt)``'s bits, in one pass. ``inverse``: the scales'
    reciprocals instead (``scale.reciprocal()``'s bits), which the GEMMs multiply by."""
    dtype, fmax = FORMATS[fmt]
    x_MK = x_MK.contiguous()
    M, K = x_MK.shape
    q = torch.empty(M, K, device=x_MK.device, dtype=dtype)
    s = torch.empty(M, 1, device=x_MK.device, dtype=torch.float32)
    one = K <= 8192
    BLOCK_K = triton.next_power_of_2(K) if one else 4096
    BLOCK_M = max(1, 8192 // BLOCK_K)
    if M:  # no FMA (enable_fp_fusion=False): torch's roundings
        launch(_rowwise_kernel, (triton.cdiv(M, BLOCK_M),), x_MK, q, s, M, K, FMAX=fmax, TINY=_TINY, ONE_PASS=one,
               BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, INV=inverse, num_warps=8, enable_fp_fusion=False)
    return q, s


@triton.jit
def _e4m3_to_f32(bits):
    """The E4M3 (fn) byte's value, exactly, from integer ops: torch's ``q.float()``. Normals are rebuilt as fp32
    bits, subnormals are multiples of 2^-9, 0x7F / 0xFF is NaN (the format has no infinities)."""
    sign, e, m = (bits >> 7) & 1, (bits >> 3) & 15, bits & 7
    normal = ((sign << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125 * (1.0 - 2.0 * sign.to(tl.float32))
    return tl.where((e == 15) & (m == 7), float("nan"), tl.where(e == 0, sub, normal))


@triton.jit
def _dequant_packed_kernel(p_ptr, s_ptr, out_ptr, D, B, S_ROW, BLOCK_D: tl.constexpr):
    """Row ``row`` of the packed rows (``fp8_dispatch.pack``: D E4M3 bytes, then the fp32 scale at float ``S_ROW``
    of the float32 view of the row, then padding): q / scale, divided as torch divides (correctly rounded), in out's
    dtype."""
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(s_ptr + row * (B // 4) + S_ROW)
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        mask = offs < D
        bits = tl.load(p_ptr + row * B + offs, mask=mask, other=0).to(tl.int32)
        v = tl.math.div_rn(_e4m3_to_f32(bits), tl.zeros((BLOCK_D,), tl.float32) + scale)
        tl.store(out_ptr + row * D + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


def dequant_packed(packed_NB: torch.Tensor, dtype: torch.dtype, D: int) -> torch.Tensor:
    """``fp8_dispatch.unpack``'s values in one pass: ``(q.float() / scale).to(dtype)`` of each packed row (D E4M3
    bytes, 4 scale bytes, padding; D and the row a multiple of 4, so that each row's scale is 4-byte aligned)."""
    N, B = packed_NB.shape
    if D % 4 or B % 4 or B < D + 4:
        raise ValueError(f"dequant_packed: rows of {B} bytes cannot hold {D} values (a multiple of 4) and a scale")
    packed_NB = packed_NB.contiguous()
    if packed_NB.storage_offset() % 4:  # the float32 view below needs 4-byte aligned rows
        packed_NB = packed_NB.clone()
    out = torch.empty(N, D, device=packed_NB.device, dtype=dtype)
    if N:
        launch(_dequant_packed_kernel, (N,), packed_NB, packed_NB.view(torch.float32), out, D, B, D // 4,
               BLOCK_D=min(4096, triton.next_power_of_2(D)), num_warps=8)
    return out


def grouped_col_amax(x_MX: torch.Tensor, offs_L: torch.Tensor, gid_M: torch.Tensor,
                     config: tuple = (256, 64, 128, 4)) -> torch.Tensor:
    """``(L, X)`` fp32: the max of |x| over each expert's rows (0 for an empty expert), ``_segment_amax``'s values.
    ``gid_M``: each row's expert (``fp8_grouped.expert_of_rows``). ``config``: (CHUNK, BLOCK_M, BLOCK_X, warps); the
    default was the fastest of a sweep on one H100 (``benchmarks/bench_fp8_quant.py``)."""
    x_MX = x_MX.contiguous()
    M, X = x_MX.shape
    L = offs_L.numel()
    amax = torch.zeros(L, X, device=x_MX.device, dtype=torch.float32)
    CHUNK, BLOCK_M, BLOCK_X, warps = config
    if M:
        launch(_col_amax_kernel, (triton.cdiv(M, CHUNK), triton.cdiv(X, BLOCK_X)), x_MX,
               offs_L.to(torch.int32).contiguous(), gid_M.to(torch.int32).contiguous(), amax, M, X, CHUNK=CHUNK,
               BLOCK_M=BLOCK_M, BLOCK_X=BLOCK_X, num_warps=warps)
    return amax


@functools.lru_cache(maxsize=256)  # called per GEMM with the same few shapes: its arithmetic is host time
def fused_config(M: int, K: int) -> tuple:
    """``rowwise_quant_col_amax``'s (CHUNK, BLOCK_M, BLOCK_K, warps, stages, keep) for M rows of K: column blocks of
    the largest power of two dividing K (at most 4096), so that no lanes are padding; row blocks of about 4096 values,
    whole rows kept in registers up to 16384 values, wider rows read twice; chunks giving about 512 programs (4 per
    SM), at most 256 rows; warps and stages from a sweep on one H100 (``benchmarks/bench_fp8_quant.py``)."""
    full = triton.next_power_of_2(K)
    BLOCK_K = min(K & -K, 4096)
    if BLOCK_K < 128:  # K with a small power-of-two factor: padded blocks instead of many small ones
        BLOCK_K = min(full, 4096)
    row = triton.cdiv(K, BLOCK_K) * BLOCK_K
    BLOCK_M = max(1, triton.next_power_of_2(4096 // row + 1) // 2)  # the largest power of two <= 4096 // row
    keep = BLOCK_M * row <= 16384
    warps = min(32, max(4, triton.next_power_of_2(BLOCK_M * row // 512)))
    if not keep:
        BLOCK_K = 4096
    CHUNK = max(BLOCK_M, min(256, triton.next_power_of_2(triton.cdiv(M, 512))))
    # measured on one H100 (bench_fp8_quant.py): one warpgroup and three stages of row-block loads in flight win
    # wherever the rows stay in registers (1.4-1.6x the two kernels' time); wide rows read twice want 16 warps
    warps = 4 if keep else 16
    return CHUNK, BLOCK_M, BLOCK_K, warps, 3, int(keep)


def rowwise_quant_col_amax(x_MK: torch.Tensor, offs_L: torch.Tensor, gid_M: torch.Tensor, fmt: str = "e4m3",
                           config: tuple | None = None, inverse: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_MK, scale_M1, amax_LK)``: ``rowwise_quant(x_MK, fmt)``'s and ``grouped_col_amax(x_MK, offs_L, gid_M)``'s
    bits (a NaN amax as fp32's canonical NaN) from one read of x. Bytes moved per bf16 value: 2 read and 1 written
    from and to HBM (3, against 3 + 2 for the two kernels), plus 4 per row (the scales) and 4 per column for each
    expert's part of each chunk of CHUNK rows (one atomic max each, in L2). Rows past offs[-1] are quantized as
    ``rowwise_quant`` quantizes them and are in no amax. ``config``: (CHUNK, BLOCK_M, BLOCK_K, warps, stages, keep),
    ``fused_config``'s by default. Rows wider than BLOCK_K go in K blocks: with keep, a row block's blocks stay in
    registers from its amax to its quantization; without, they are read again (from L2: 2 more bytes per value
    through L2, none from HBM while the block stays there). stages > 1 pipelines the chunk's row-block loads.
    ``inverse``: the scales' reciprocals instead, as ``rowwise_quant``."""
    dtype, fmax = FORMATS[fmt]
    x_MK = x_MK.contiguous()
    M, K = x_MK.shape
    L = offs_L.numel()
    amax = torch.zeros(L, K, device=x_MK.device, dtype=torch.float32)
    if not (M and K and L):  # no rows, or no experts (every row a tail row): nothing to reduce
        return (*rowwise_quant(x_MK, fmt, inverse), amax)
    CHUNK, BLOCK_M, BLOCK_K, warps, stages, keep = config or fused_config(M, K)
    BLOCK_K = min(BLOCK_K, triton.next_power_of_2(K))
    q = torch.empty(M, K, device=x_MK.device, dtype=dtype)
    s = torch.empty(M, 1, device=x_MK.device, dtype=torch.float32)
    launch(_rowwise_col_amax_kernel, (triton.cdiv(M, CHUNK),), x_MK, q, s, offs_L.to(torch.int32).contiguous(),
           gid_M.to(torch.int32).contiguous(), amax.view(torch.int32), M, K, L, CHUNK, FMAX=fmax, TINY=_TINY,
           BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, NKB=triton.cdiv(K, BLOCK_K), STAGES=stages, KEEP=bool(keep), INV=inverse,
           num_warps=warps, enable_fp_fusion=False)  # no FMA: torch's roundings
    return q, s, amax


def quant_t_padded(x_MX: torch.Tensor, scale_LX: torch.Tensor, offs_L: torch.Tensor, poffs_L: torch.Tensor,
                   gid_P: torch.Tensor, P: int, fmt: str = "e4m3", config: tuple = (128, 64, 4),
                   out: Optional[torch.Tensor] = None, align: int = 1) -> torch.Tensor:
    """``(X, P)``: ``saturate_rows_t(scatter_rows(x, dest, P), scale_LX, gid_P)``'s bits for the rows of experts
    (``poffs_L``/``gid_P``: ``padded_layout``'s ends and ``expert_of_rows(P, poffs_L)``); zeros elsewhere.
    ``config``: (BLOCK_P, BLOCK_X, warps). ``out``: an (X, P) view to write into instead, its rows strided (columns of
    a wider buffer: the deferred wgrad's micro-batches side by side). ``align``: the padded ends' alignment; a multiple
    of BLOCK_P makes each block one expert's (the Triton wgrad's 128-row layout), whose ends and scales are then read
    once per block (the same bits)."""
    dtype, fmax = FORMATS[fmt]
    x_MX = x_MX.contiguous()
    X = x_MX.shape[1]
    if out is not None and (out.shape != (X, P) or out.dtype != dtype or (P and out.stride(1) != 1)):
        raise ValueError(f"quant_t_padded: out {tuple(out.shape)} {out.dtype} with strides {out.stride()}: want "
                         f"({X}, {P}) {dtype} with unit column stride")
    q = torch.empty(X, P, device=x_MX.device, dtype=dtype) if out is None else out
    BLOCK_P, BLOCK_X, warps = config
    if P and X:
        launch(_quant_t_kernel, (triton.cdiv(P, BLOCK_P), triton.cdiv(X, BLOCK_X)), x_MX, scale_LX.float().contiguous(),
               offs_L.to(torch.int32).contiguous(), poffs_L.to(torch.int32).contiguous(),
               gid_P.to(torch.int32).contiguous(), q, P, X, q.stride(0), FMAX=fmax, BLOCK_P=BLOCK_P, BLOCK_X=BLOCK_X,
               BLOCK_EXPERT=align % BLOCK_P == 0, num_warps=warps, enable_fp_fusion=False)
    return q


def colwise_quant_t(x_MK: torch.Tensor, fmt: str = "e4m3", amax_K1: Optional[torch.Tensor] = None,
                    inverse: bool = False) -> tuple:
    """``(q_KM, scale_K1)``: ``rowwise_quant(x_MK.t().contiguous(), fmt)``'s bits without that bf16 copy: the column
    amaxes (``grouped_col_amax``'s kernel over one group), then the values quantized straight into the transposed
    layout, the scales computed in that pass (``_scale``, ``scale_of``'s roundings, as ``rowwise_quant``'s). Three
    launches, none of them the torch ops of a scale. ``amax_K1``: the column amaxes to scale by instead (reduced over
    the ranks that hold other tokens): ``fp8.quantize``'s bits. ``inverse``: ``(q_KM, scale_K1, inv_K1)``, with the
    GEMM's dequantization scales (``scale.reciprocal()``'s bits)."""
    dtype, fmax = FORMATS[fmt]
    x_MK = x_MK.contiguous()
    M, K = x_MK.shape
    dev = x_MK.device
    if amax_K1 is None:
        amax_K = torch.zeros(K, device=dev, dtype=torch.float32)
        CHUNK, BLOCK_M, BLOCK_X, warps = 256, 64, 128, 4  # grouped_col_amax's default
        if M and K:
            launch(_col_amax_kernel, (triton.cdiv(M, CHUNK), triton.cdiv(K, BLOCK_X)), x_MK, amax_K, amax_K, amax_K, M,
                   K, CHUNK=CHUNK, BLOCK_M=BLOCK_M, BLOCK_X=BLOCK_X, ONE_GROUP=True, num_warps=warps)
    else:
        amax_K = amax_K1.float().reshape(K).contiguous()
    q = torch.empty(K, M, device=dev, dtype=dtype)
    if not (M and K):  # no programs to write the scales
        scale_K1 = scale_of(amax_K, fmt).reshape(K, 1)
        return (q, scale_K1, scale_K1.reciprocal()) if inverse else (q, scale_K1)
    s_K1 = torch.empty(K, 1, device=dev, dtype=torch.float32)
    inv_K1 = torch.empty(K, 1, device=dev, dtype=torch.float32) if inverse else s_K1
    BLOCK_P, BLOCK_X = 128, 64  # quant_t_padded's default
    launch(_quant_t_one_group_kernel, (triton.cdiv(M, BLOCK_P), triton.cdiv(K, BLOCK_X)), x_MK, amax_K, q, s_K1, inv_K1,
           M, K, FMAX=fmax, TINY=_TINY, BLOCK_P=BLOCK_P, BLOCK_X=BLOCK_X, INV=inverse, num_warps=4,
           enable_fp_fusion=False)
    return (q, s_K1, inv_K1) if inverse else (q, s_K1)
