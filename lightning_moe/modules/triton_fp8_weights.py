"""The rowwise recipe's two E4M3 copies of an expert weight w (L, K, N), in two passes over w instead of four:

    forward  (L, N, K), K contiguous: each (expert, column n) scaled by 448 / max over k |w[l, k, n]|
    dgrad    (L, K, N), N contiguous: each (expert, row k) scaled by 448 / max over n |w[l, k, n]|

The first pass takes both amaxes of every tile (one atomic max per tile column and per tile row into zeroed buffers:
exact and order-free), the second quantizes the tile both ways and stores it twice, once transposed. That moves 6
bytes per weight element where the torch code (``fp8_grouped_kernels``: two amax reductions, two saturating casts)
moves 10. The bits are the torch code's (``fp8.scale_of``, ``fp8.saturate``): the same scale, product, clamp and
rounding as ``triton_fp8_quant``. A NaN in w makes its amaxes NaN in torch but not here (the atomic max drops it):
such a weight has no meaningful FP8 copy either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_moe.modules.fp8 import _TINY, FORMATS
from lightning_moe.modules.triton_fp8_quant import _max_nan, _sat, _scale
from lightning_moe.modules.triton_launch import launch


@triton.jit
def _amax_kernel(w_ptr, col_ptr, row_ptr, K, N, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    l = tl.program_id(1).to(tl.int64)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rk = (tl.program_id(0) // tiles_n) * BLOCK_K + tl.arange(0, BLOCK_K)
    rn = (tl.program_id(0) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask, nmask = rk < K, rn < N
    x = tl.abs(tl.load(w_ptr + l * K * N + rk.to(tl.int64)[:, None] * N + rn[None, :],
                       mask=kmask[:, None] & nmask[None, :], other=0.0).to(tl.float32))
    tl.atomic_max(col_ptr + l * N + rn, tl.reduce(x, 0, _max_nan), mask=nmask)
    tl.atomic_max(row_ptr + l * K + rk, tl.reduce(x, 1, _max_nan), mask=kmask)


@triton.jit
def _quant_kernel(w_ptr, col_ptr, row_ptr, qf_ptr, qd_ptr, K, N, FMAX: tl.constexpr, TINY: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    l = tl.program_id(1).to(tl.int64)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rk = (tl.program_id(0) // tiles_n) * BLOCK_K + tl.arange(0, BLOCK_K)
    rn = (tl.program_id(0) % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask, nmask = rk < K, rn < N
    mask = kmask[:, None] & nmask[None, :]
    x = tl.load(w_ptr + l * K * N + rk.to(tl.int64)[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    s_col = _scale(tl.load(col_ptr + l * N + rn, mask=nmask, other=1.0), FMAX, TINY, BLOCK_N)
    s_row = _scale(tl.load(row_ptr + l * K + rk, mask=kmask, other=1.0), FMAX, TINY, BLOCK_K)
    qf = _sat(x * s_col[None, :], FMAX).to(qf_ptr.dtype.element_ty)
    tl.store(qf_ptr + l * N * K + rn.to(tl.int64)[:, None] * K + rk[None, :], tl.trans(qf),
             mask=nmask[:, None] & kmask[None, :])
    qd = _sat(x * s_row[:, None], FMAX).to(qd_ptr.dtype.element_ty)
    tl.store(qd_ptr + l * K * N + rk.to(tl.int64)[:, None] * N + rn[None, :], qd, mask=mask)


@torch.no_grad()
def quantize_both(w_LKN: torch.Tensor, fmt: str = "e4m3", config: tuple = (128, 64, 4)):
    """``((q_LNK, scale_L1N), (q_LKN, scale_LK1))``: the forward copy (transposed, per-column scales) and the dgrad
    copy (per-row scales) of ``w``, the bits of ``saturate_t(w, scale_of(abs_amax(w, 1)))`` and
    ``saturate(w, scale_of(abs_amax(w, 2)))``. ``config``: (BLOCK_K, BLOCK_N, warps); the default was the fastest of
    four on one H100, 2.0-2.6x torch's time at the presets' expert weights (``benchmarks/bench_fp8_weights.py``)."""
    dtype, fmax = FORMATS[fmt]
    w_LKN = w_LKN.contiguous()
    L, K, N = w_LKN.shape
    col_LN = torch.zeros(L, N, device=w_LKN.device, dtype=torch.float32)
    row_LK = torch.zeros(L, K, device=w_LKN.device, dtype=torch.float32)
    qf = torch.empty(L, N, K, device=w_LKN.device, dtype=dtype)
    qd = torch.empty(L, K, N, device=w_LKN.device, dtype=dtype)
    bk, bn, warps = config
    if w_LKN.numel():
        grid = (triton.cdiv(K, bk) * triton.cdiv(N, bn), L)
        launch(_amax_kernel, grid, w_LKN, col_LN, row_LK, K, N, BLOCK_K=bk, BLOCK_N=bn, num_warps=warps)
        launch(_quant_kernel, grid, w_LKN, col_LN, row_LK, qf, qd, K, N, FMAX=fmax, TINY=_TINY, BLOCK_K=bk, BLOCK_N=bn,
               num_warps=warps, enable_fp_fusion=False)  # no FMA: torch's roundings
    col_L1N, row_LK1 = col_LN.unsqueeze(1), row_LK.unsqueeze(2)
    return (qf, fmax / col_L1N.clamp_min(_TINY)), (qd, fmax / row_LK1.clamp_min(_TINY))
