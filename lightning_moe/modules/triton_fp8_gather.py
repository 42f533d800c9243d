"""The permutes' row gather fused with the rowwise FP8 quantization of the rows it gathers (CUDA, or the Triton
interpreter in tests), for the experts' FP8 GEMMs on either side of the permutes:

  gather_quant   out[r] = x[src[r]] (zeros where src[r] is -1), q[r] = sat(out[r] * 448 / max(amax_r, tiny)), s[r]

The dispatch gathers each token's copies into expert order, and in backward the combine gathers each token's output
gradient back into the same rows. Each gathered row is the experts' GEMM operand as it is (fc1's input, fc2's output
gradient), so its rowwise quantization can be made from the registers that gathered it, instead of by a pass that
reads the gathered rows back (``triton_fp8_quant.rowwise_quant``). The bits are ``triton_permute.gather``'s and
``rowwise_quant``'s of its output: the same loads, products, roundings and saturation (``fp8_swiglu.Handoff`` hands
them to the GEMMs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_moe.modules.fp8 import _TINY, FORMATS
from lightning_moe.modules.triton_fp8_quant import _max_nan, _sat, _scale, _stored
from lightning_moe.modules.triton_launch import launch


@triton.jit
def _gather_quant_kernel(x_ptr, src_ptr, out_ptr, q_ptr, s_ptr, R, D, FMAX: tl.constexpr, TINY: tl.constexpr,
                         ONE_PASS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, INV: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    src = tl.load(src_ptr + rows, mask=rmask, other=-1).to(tl.int64)
    read = rmask & (src >= 0)  # a hole (-1) reads zeros
    src_base = src[:, None] * D
    out_base = rows.to(tl.int64)[:, None] * D
    cols = tl.arange(0, BLOCK_D)
    if ONE_PASS:  # the rows fit in registers: one read
        cmask = (cols < D)[None, :]
        x = tl.load(x_ptr + src_base + cols[None, :], mask=read[:, None] & cmask, other=0.0)
        tl.store(out_ptr + out_base + cols[None, :], x, mask=rmask[:, None] & cmask)
        xf = x.to(tl.float32)
        scale = _scale(tl.reduce(tl.abs(xf), 1, _max_nan), FMAX, TINY, BLOCK_R)
        q = _sat(xf * scale[:, None], FMAX)
        tl.store(q_ptr + out_base + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=rmask[:, None] & cmask)
    else:  # wide rows: gather and take the amax, then quantize from the source rows again (from L2)
        amax = tl.zeros((BLOCK_R,), tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cmask = (d0 + cols < D)[None, :]
            x = tl.load(x_ptr + src_base + d0 + cols[None, :], mask=read[:, None] & cmask, other=0.0)
            tl.store(out_ptr + out_base + d0 + cols[None, :], x, mask=rmask[:, None] & cmask)
            amax = _max_nan(amax, tl.reduce(tl.abs(x.to(tl.float32)), 1, _max_nan))
        scale = _scale(amax, FMAX, TINY, BLOCK_R)
        for d0 in range(0, D, BLOCK_D):
            cmask = (d0 + cols < D)[None, :]
            x = tl.load(x_ptr + src_base + d0 + cols[None, :], mask=read[:, None] & cmask, other=0.0)
            q = _sat(x.to(tl.float32) * scale[:, None], FMAX)
            tl.store(q_ptr + out_base + d0 + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=rmask[:, None] & cmask)
    tl.store(s_ptr + rows, _stored(scale, INV, BLOCK_R), mask=rmask)


def gather_quant(x_TD: torch.Tensor, src_R: torch.Tensor, fmt: str = "e4m3", inverse: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out_RD, q_RD, scale_R1)``: ``triton_permute.gather(x_TD, src_R)`` and ``rowwise_quant(out_RD, fmt,
    inverse)`` in one pass (``inverse``: the dequantization scales, which the GEMMs multiply by)."""
    dtype, fmax = FORMATS[fmt]
    x_TD, src_R = x_TD.contiguous(), src_R.contiguous()
    R, D = src_R.numel(), x_TD.shape[1]
    out = torch.empty(R, D, device=x_TD.device, dtype=x_TD.dtype)
    q = torch.empty(R, D, device=x_TD.device, dtype=dtype)
    s = torch.empty(R, 1, device=x_TD.device, dtype=torch.float32)
    one = D <= 8192  # rowwise_quant's blocks: the same rows per program
    BLOCK_D = triton.next_power_of_2(D) if one else 4096
    BLOCK_R = max(1, 8192 // BLOCK_D)
    if R:  # no FMA (enable_fp_fusion=False): torch's roundings, as rowwise_quant
        launch(_gather_quant_kernel, (triton.cdiv(R, BLOCK_R),), x_TD, src_R, out, q, s, R, D, FMAX=fmax, TINY=_TINY,
               ONE_PASS=one, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, INV=inverse, num_warps=8, enable_fp_fusion=False)
    return out, q, s
