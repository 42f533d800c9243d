"""Triton kernels for the FP8 parameter all-gather (``strategy/fp8_param_gather.py``): a flat slice of a weight
quantized with, or dequantized by, the scale of each element's block, one pass each, whatever rows and columns the
slice cuts. Element i of the slice ``[lo, lo + n)`` of an (R, C) weight sits at row ``(lo + i) // C`` and column
``(lo + i) % C``: in block ``(row // h, column // w)`` of the scale grid (C / w blocks per grid row).

quantize_slice     q = sat(x * scale), rounded to nearest even E4M3   (fp8.quantize's bits)
dequantize_slice   out = q / scale, correctly rounded, to nearest even bf16   (fp8.dequantize, then .to(bf16))

The roundings are done in fp32 bit arithmetic (``triton_fp8_quant``'s helpers), so the interpreter gives the GPU's
bits too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_moe.modules.fp8 import FORMATS
from lightning_moe.modules.triton_fp8_quant import _e4m3_to_f32, _sat

BLOCK = 4096


@triton.jit
def _block_of(offs, lo, C, h, w, GW):
    i = lo + offs
    r = i // C
    return (r // h) * GW + (i - r * C) // w


@triton.jit
def _rne_bf16(v):
    """``v`` rounded to the nearest bf16 value, ties to even, in fp32 (finite values): the cast that follows is exact
    on any backend."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)


@triton.jit
def _quant_kernel(x_ptr, s_ptr, q_ptr, n, lo, C, h, w, GW, FMAX: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s = tl.load(s_ptr + _block_of(offs, lo, C, h, w, GW), mask=mask, other=1.0)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(q_ptr + offs, _sat(x * s, FMAX).to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, out_ptr, n, lo, C, h, w, GW, BF16: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s = tl.load(s_ptr + _block_of(offs, lo, C, h, w, GW), mask=mask, other=1.0)
    bits = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.int32)
    v = tl.math.div_rn(_e4m3_to_f32(bits), s)
    if BF16:
        v = _rne_bf16(v)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


def _grid(n: int):
    return (triton.cdiv(n, BLOCK),)


def quantize_slice(q: torch.Tensor, x: torch.Tensor, s_G: torch.Tensor, lo: int, C: int, h: int, w: int) -> None:
    """``q`` (E4M3, flat) = the slice ``x`` (elements ``[lo, lo + x.numel())`` of an (R, C) weight) quantized with
    the fp32 block scales ``s_G`` (R / h, C / w)."""
    n = x.numel()
    if n:
        _quant_kernel[_grid(n)](x, s_G.contiguous(), q.view(torch.uint8).view(FORMATS["e4m3"][0]), n, lo, C, h, w,
                                C // w, FMAX=FORMATS["e4m3"][1], BLOCK=BLOCK, num_warps=8, enable_fp_fusion=False)


def dequantize_slice(out: torch.Tensor, q: torch.Tensor, s_G: torch.Tensor, lo: int, C: int, h: int, w: int) -> None:
    """``out`` (flat, the weight's dtype) = ``q / scale`` of the slice at ``lo`` (as ``quantize_slice``)."""
    n = q.numel()
    if n:
        _dequant_kernel[_grid(n)](q.view(torch.uint8), s_G.contiguous(), out, n, lo, C, h, w, C // w,
                                  BF16=out.dtype == torch.bfloat16, BLOCK=BLOCK, num_warps=8)
