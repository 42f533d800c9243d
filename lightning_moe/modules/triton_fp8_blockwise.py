"""Triton kernels for the blockwise FP8 recipe on DeepGEMM (``fp8_deepgemm.py``): the torch reference's bits
(``fp8_deepgemm.tiles_reference``, ``weight_blocks_reference``) in one pass each.

tiles     an activation laid out by expert in 128-row groups (row p reads source row src[p]; -1: a zero row; without
          src, row p itself, zero past the M rows), in
          128 x 128 tiles: q with one scale per row of a tile (1 x 128, for the GEMM that reduces over the features),
          the dequantization scales as (K / 128, P) (DeepGEMM's MN-major layout), and optionally the wgrad operand:
          each tile's columns quantized over its 128 rows (128 x 1: the expert's token tiles) and dequantized to bf16
weights   each expert weight's 128 x 128 blocks: q in the (L, K, N) layout and transposed to (L, N, K), and the
          dequantization scales (L, K / 128, N / 128); the FP8 parameter all-gather's amaxes where it gave them

Roundings: the scales as ``triton_fp8_quant`` (correctly rounded divisions, no FMA); the casts by the GPU's
round-to-nearest-even conversions, or under the interpreter in fp32 bit arithmetic, which gives the same bits.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from lightning_moe.modules.fp8 import _TINY, BLOCK, FORMATS
from lightning_moe.modules.kernels import interpreting
from lightning_moe.modules.triton_fp8_quant import _max_nan, _sat, _scale
from lightning_moe.modules.triton_launch import launch

ROWS = 32  # rows of a 128 x 128 tile in registers at a time


@triton.jit
def _rne_bf16(v):
    """fp32 ``v`` rounded to the nearest bf16, ties to even, still in fp32 (the cast after it is exact anywhere)."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(v, FMAX: tl.constexpr):
    """``v`` saturated (NaN stays) and cast to E4M3, rounded to nearest even (``_sat``: the GPU's saturating cast, or
    fp32 bit arithmetic under the interpreter, whose own rounding is not torch's)."""
    return _sat(v, FMAX).to(tl.float8e4nv)


@triton.jit
def _bf16(v, HW: tl.constexpr):
    if HW:
        return v.to(tl.bfloat16)
    return _rne_bf16(v).to(tl.bfloat16)


@triton.jit
def _rows(x_ptr, src_ptr, p, cols, M, K, SRC: tl.constexpr):
    """Places ``p``'s values at columns ``cols`` in fp32: rows ``src[p]`` (-1: zeros), or rows p (past M: zeros)."""
    if SRC:
        src = tl.load(src_ptr + p).to(tl.int64)
        ok = src >= 0
    else:
        src = p.to(tl.int64)
        ok = p < M
    return tl.load(x_ptr + src[:, None] * K + cols[None, :], mask=ok[:, None], other=0.0).to(tl.float32)


@triton.jit
def _tiles_kernel(x_ptr, src_ptr, end_ptr, q_ptr, sf_ptr, w_ptr, sc_ptr, P, M, K, FMAX: tl.constexpr,
                  TINY: tl.constexpr, WGRAD: tl.constexpr, WGRAD_FP8: tl.constexpr, SRC: tl.constexpr,
                  HW: tl.constexpr, T: tl.constexpr, R: tl.constexpr):
    """One 128 x 128 tile in chunks of R rows: the column amaxes over all its rows first (the chunks' second read
    comes from L2), then each chunk's row tiles and column-quantized values (``WGRAD_FP8``: as E4M3 transposed to
    (K, P), with the dequantization scales (P / 128, K); else dequantized to bf16). Tiles past the last expert's
    padded end (no GEMM reads them) are left alone."""
    p0 = tl.program_id(0) * T
    if p0 < tl.load(end_ptr):
        cols = tl.program_id(1) * T + tl.arange(0, T)
        if WGRAD:
            amax_c = tl.zeros((T,), tl.float32)
            for r in range(0, T, R):
                x = _rows(x_ptr, src_ptr, p0 + r + tl.arange(0, R), cols, M, K, SRC)
                amax_c = _max_nan(amax_c, tl.reduce(tl.abs(x), 0, _max_nan))
            scale_c = _scale(amax_c, FMAX, TINY, T)
            inv_c = tl.math.div_rn(tl.full((T,), 1.0, tl.float32), scale_c)
        for r in range(0, T, R):
            p = p0 + r + tl.arange(0, R)
            x = _rows(x_ptr, src_ptr, p, cols, M, K, SRC)
            at = p.to(tl.int64)[:, None] * K + cols[None, :]
            scale_r = _scale(tl.reduce(tl.abs(x), 1, _max_nan), FMAX, TINY, R)
            tl.store(q_ptr + at, _e4m3(x * scale_r[:, None], FMAX))
            tl.store(sf_ptr + tl.program_id(1).to(tl.int64) * P + p,
                     tl.math.div_rn(tl.full((R,), 1.0, tl.float32), scale_r))
            if WGRAD_FP8:  # K-major for the wgrad GEMM, which reduces over the places
                tl.store(w_ptr + cols.to(tl.int64)[:, None] * P + p[None, :],
                         tl.trans(_e4m3(x * scale_c[None, :], FMAX)))
            elif WGRAD:  # dequantized as the GEMMs do: times the reciprocal scale
                tl.store(w_ptr + at, _bf16(_e4m3(x * scale_c[None, :], FMAX).to(tl.float32) * inv_c[None, :], HW))
        if WGRAD_FP8:
            tl.store(sc_ptr + tl.program_id(0).to(tl.int64) * K + cols, inv_c)


def tiles(x_MK: torch.Tensor, src_P: Optional[torch.Tensor], end: torch.Tensor, fmt: str, wgrad: bool,
          P: Optional[int] = None, wgrad_fp8: bool = False) -> tuple:
    """``fp8_deepgemm.tiles_reference(x_MK, src_P, fmt, wgrad, torch.bfloat16)``'s values (E4M3: the recipe's) in the
    places before ``end`` (a one-element tensor: the last expert's padded end); undefined after it. Without ``src_P``,
    ``P`` places (a multiple of 128, at least M) read rows 0..P-1, zeros past M. ``wgrad_fp8``: the wgrad operand as
    (its E4M3 values transposed (K, P), their dequantization scales (P / 128, K)) for ``triton_fp8_wgrad``."""
    assert fmt == "e4m3", "the rounding is E4M3's"
    dtype, fmax = FORMATS[fmt]
    x_MK = x_MK.contiguous()
    M, K = x_MK.shape
    P = src_P.numel() if src_P is not None else P
    q = torch.empty(P, K, device=x_MK.device, dtype=dtype)
    sf = torch.empty(K // BLOCK, P, device=x_MK.device, dtype=torch.float32)
    w = sc = None
    if wgrad and wgrad_fp8:
        w = torch.empty(K, P, device=x_MK.device, dtype=dtype)
        sc = torch.empty(P // BLOCK, K, device=x_MK.device, dtype=torch.float32)
    elif wgrad:
        w = torch.empty(P, K, device=x_MK.device, dtype=torch.bfloat16)
    if P:
        launch(_tiles_kernel, (P // BLOCK, K // BLOCK), x_MK, src_P if src_P is not None else end, end, q, sf,
               w if wgrad else q, sc if sc is not None else sf, P, M, K, FMAX=fmax, TINY=_TINY, WGRAD=wgrad,
               WGRAD_FP8=sc is not None, SRC=src_P is not None, HW=not interpreting(), T=BLOCK, R=ROWS, num_warps=4,
               enable_fp_fusion=False)
    return q, sf, (w, sc) if sc is not None else w


@triton.jit
def _weights_kernel(w_ptr, amax_ptr, q_ptr, qt_ptr, sf_ptr, K, N, FMAX: tl.constexpr, TINY: tl.constexpr,
                    PRESET: tl.constexpr, T: tl.constexpr, R: tl.constexpr):
    """One 128 x 128 block in chunks of R rows: its amax (unless preset), then each chunk quantized and stored in
    both layouts."""
    e, kb, nb = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    cols = nb * T + tl.arange(0, T)
    base = e * K * N
    block = (e * (K // T) + kb) * (N // T) + nb
    lane = tl.arange(0, T)
    if PRESET:
        amax = tl.load(amax_ptr + block + lane * 0)
    else:
        m = tl.zeros((T,), tl.float32)
        for r in range(0, T, R):
            rows = kb * T + r + tl.arange(0, R)
            x = tl.load(w_ptr + base + rows.to(tl.int64)[:, None] * N + cols[None, :]).to(tl.float32)
            m = _max_nan(m, tl.reduce(tl.abs(x), 0, _max_nan))
        amax = tl.zeros((T,), tl.float32) + tl.reduce(m, 0, _max_nan)
    scale = _scale(amax, FMAX, TINY, T)  # the block's one scale, in every lane
    for r in range(0, T, R):
        rows = kb * T + r + tl.arange(0, R)
        x = tl.load(w_ptr + base + rows.to(tl.int64)[:, None] * N + cols[None, :]).to(tl.float32)
        q = _e4m3(x * scale[None, :], FMAX)
        tl.store(q_ptr + base + rows.to(tl.int64)[:, None] * N + cols[None, :], q)
        tl.store(qt_ptr + base + cols.to(tl.int64)[:, None] * K + rows[None, :], tl.trans(q))
    tl.store(sf_ptr + block + lane * 0, tl.math.div_rn(tl.full((T,), 1.0, tl.float32), scale), mask=lane == 0)


def weight_blocks(w_LKN: torch.Tensor, fmt: str, amax: Optional[torch.Tensor] = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fp8_deepgemm.weight_blocks_reference(w_LKN, fmt, amax)``'s values (E4M3)."""
    assert fmt == "e4m3", "the rounding is E4M3's"
    dtype, fmax = FORMATS[fmt]
    w_LKN = w_LKN.contiguous()
    L, K, N = w_LKN.shape
    q = torch.empty(L, K, N, device=w_LKN.device, dtype=dtype)
    qt = torch.empty(L, N, K, device=w_LKN.device, dtype=dtype)
    sf = torch.empty(L, K // BLOCK, N // BLOCK, device=w_LKN.device, dtype=torch.float32)
    preset = amax is not None
    amax = amax.float().contiguous() if preset else sf
    if L:
        launch(_weights_kernel, (L, K // BLOCK, N // BLOCK), w_LKN, amax, q, qt, sf, K, N, FMAX=fmax, TINY=_TINY,
               PRESET=preset, T=BLOCK, R=ROWS, num_warps=4, enable_fp_fusion=False)
    return q, qt, sf
