"""Triton kernels for the FP8 parameter all-gather (``strategy/fp8_param_gather.py``): a weight's slice quantized
with, or dequantized by, the scale of each element's block (h x w elements of an (R, C) weight), one pass each.

Whole rows ``[r0, r0 + nr)`` (the bulk of a slice) go in tiles of TR x TC elements that each lie in one block, so a
tile reads its scale once:
rows_amax          amax[block] = max(amax[block], max |x|)          one read (an atomic max per tile)
rows_quantize      q = sat(x * scale), rounded to nearest even E4M3   (fp8.quantize's bits)
rows_dequantize    out = table[block, q]: the block's 256 values q / scale in out's dtype, made by torch
                   (``dequant_table``: fp8.dequantize's bits by construction; a gather from cache, not a division)
A part of one row (at most one at each end of a slice) goes flat, element i at column ``c0 + i``:
quantize_slice, dequantize_slice.

The quantization rounds in fp32 bit arithmetic (``triton_fp8_quant``'s helpers), so the interpreter gives the GPU's
bits too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_moe.modules.fp8 import FORMATS
from lightning_moe.modules.triton_fp8_quant import _max_nan, _sat
from lightning_moe.modules.triton_launch import launch

BLOCK = 4096
TR, TC = 32, 128  # a tile of whole rows: inside one block where w is C or a multiple of TC and TR divides h
WARPS = 4


def tiles_fit(nr: int, r0: int, C: int, h: int, w: int) -> bool:
    """Whether whole rows ``[r0, r0 + nr)`` split into tiles that each lie in one block."""
    one_block_row = r0 // h == (r0 + nr - 1) // h
    return (w == C or w % TC == 0) and (one_block_row or (h % TR == 0 and r0 % TR == 0))


@triton.jit
def _tile(pid_r, pid_c, nr, C, TR: tl.constexpr, TC: tl.constexpr):
    rows = pid_r * TR + tl.arange(0, TR)
    cols = pid_c * TC + tl.arange(0, TC)
    mask = (rows < nr)[:, None] & (cols < C)[None, :]
    return rows.to(tl.int64)[:, None] * C + cols[None, :], mask


@triton.jit
def _tile_block(pid_r, pid_c, r0, h, w, GW, TR: tl.constexpr, TC: tl.constexpr):
    return ((r0 + pid_r * TR) // h) * GW + (pid_c * TC) // w


@triton.jit
def _rows_amax_kernel(x_ptr, amax_ptr, nr, C, r0, h, w, GW, TR: tl.constexpr, TC: tl.constexpr):
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    at, mask = _tile(pid_r, pid_c, nr, C, TR, TC)
    x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
    m = tl.reduce(tl.reduce(tl.abs(x), 1, _max_nan), 0, _max_nan)  # NaN stays, as in torch's amax
    # non-negative floats order as their bits, NaN above inf: an integer atomic max keeps NaN too
    tl.atomic_max(amax_ptr + _tile_block(pid_r, pid_c, r0, h, w, GW, TR, TC), m.to(tl.int32, bitcast=True))


@triton.jit
def _rows_quant_kernel(x_ptr, s_ptr, q_ptr, nr, C, r0, h, w, GW, FMAX: tl.constexpr, TR: tl.constexpr,
                       TC: tl.constexpr):
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    at, mask = _tile(pid_r, pid_c, nr, C, TR, TC)
    s = tl.load(s_ptr + _tile_block(pid_r, pid_c, r0, h, w, GW, TR, TC))
    x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + at, _sat(x * s, FMAX).to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rows_dequant_kernel(q_ptr, t_ptr, out_ptr, nr, C, r0, h, w, GW, TR: tl.constexpr, TC: tl.constexpr):
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    at, mask = _tile(pid_r, pid_c, nr, C, TR, TC)
    table = t_ptr + _tile_block(pid_r, pid_c, r0, h, w, GW, TR, TC).to(tl.int64) * 256  # 256 values: in cache
    bits = tl.load(q_ptr + at, mask=mask, other=0).to(tl.int32)
    tl.store(out_ptr + at, tl.load(table + bits, mask=mask), mask=mask)


def _rows_grid(nr: int, C: int):
    return (triton.cdiv(nr, TR), triton.cdiv(C, TC))


def rows_amax(x: torch.Tensor, amax_G: torch.Tensor, r0: int, C: int, h: int, w: int) -> None:
    """Max |x| of whole rows ``[r0, r0 + nr)`` (``x`` flat, nr * C elements) into the fp32 grid ``amax_G`` (its
    values non-negative)."""
    nr = x.numel() // C
    if nr:
        launch(_rows_amax_kernel, _rows_grid(nr, C), x, amax_G.view(torch.int32), nr, C, r0, h, w, C // w, TR=TR, TC=TC,
               num_warps=WARPS)


def rows_quantize(q: torch.Tensor, x: torch.Tensor, s_G: torch.Tensor, r0: int, C: int, h: int, w: int) -> None:
    nr = x.numel() // C
    if nr:
        launch(_rows_quant_kernel, _rows_grid(nr, C), x, s_G, q, nr, C, r0, h, w, C // w, FMAX=FORMATS["e4m3"][1],
               TR=TR, TC=TC, num_warps=WARPS, enable_fp_fusion=False)


def rows_dequantize(out: torch.Tensor, q: torch.Tensor, table: torch.Tensor, r0: int, C: int, h: int, w: int
                    ) -> None:
    nr = q.numel() // C
    if nr:
        launch(_rows_dequant_kernel, _rows_grid(nr, C), q.view(torch.uint8), table, out, nr, C, r0, h, w, C // w, TR=TR,
               TC=TC, num_warps=WARPS)


@triton.jit
def _block_of(offs, lo, C, h, w, GW):
    i = lo + offs
    r = i // C
    return (r // h) * GW + (i - r * C) // w


def dequant_table(s_G: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(blocks, 256): each block's value of every E4M3 byte, ``(q.float() / scale).to(dtype)`` as torch computes it."""
    q = torch.arange(256, dtype=torch.int32, device=s_G.device).to(torch.uint8).view(FORMATS["e4m3"][0]).float()
    return (q.unsqueeze(0) / s_G.reshape(-1, 1)).to(dtype).contiguous()


@triton.jit
def _quant_kernel(x_ptr, s_ptr, q_ptr, n, lo, C, h, w, GW, FMAX: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s = tl.load(s_ptr + _block_of(offs, lo, C, h, w, GW), mask=mask, other=1.0)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + offs, _sat(x * s, FMAX).to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(q_ptr, t_ptr, out_ptr, n, lo, C, h, w, GW, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    bits = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.int64)
    v = tl.load(t_ptr + _block_of(offs, lo, C, h, w, GW) * 256 + bits, mask=mask)
    tl.store(out_ptr + offs, v, mask=mask)


def _grid(n: int):
    return (triton.cdiv(n, BLOCK),)


def quantize_slice(q: torch.Tensor, x: torch.Tensor, s_G: torch.Tensor, lo: int, C: int, h: int, w: int) -> None:
    """``q`` (E4M3, flat) = the slice ``x`` (elements ``[lo, lo + x.numel())`` of an (R, C) weight) quantized with
    the fp32 block scales ``s_G`` (R / h, C / w)."""
    n = x.numel()
    if n:
        launch(_quant_kernel, _grid(n), x, s_G.contiguous(), q.view(torch.uint8).view(FORMATS["e4m3"][0]), n, lo, C, h,
               w, C // w, FMAX=FORMATS["e4m3"][1], BLOCK=BLOCK, num_warps=8, enable_fp_fusion=False)


def dequantize_slice(out: torch.Tensor, q: torch.Tensor, table: torch.Tensor, lo: int, C: int, h: int, w: int
                     ) -> None:
    """``out`` (flat, the weight's dtype) = ``q / scale`` of the slice at ``lo`` (as ``quantize_slice``), from the
    blocks' ``dequant_table`` (in out's dtype)."""
    n = q.numel()
    if n:
        launch(_dequant_kernel, _grid(n), q.view(torch.uint8), table, out, n, lo, C, h, w, C // w, BLOCK=BLOCK,
               num_warps=8)
