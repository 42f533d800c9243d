"""NVFP4 quantization with NVIDIA's training recipe, emulated (Hopper has no FP4 tensor cores).

A value is E2M1 (one of 0, 0.5, 1, 1.5, 2, 3, 4, 6, signed) times its block's E4M3 scale, times one fp32 scale per
tensor. Blocks are 16 consecutive elements along the GEMM's reduction dimension (1 x 16), or 16 x 16 tiles for
weights. The tensor scale ``448 * 6 / amax`` lets the block scales, ``block amax / 6`` in tensor-scaled units, use
E4M3's whole range. Gradients round stochastically (unbiased); the wgrad GEMM's two operands first go through the same
random Hadamard transform along their shared reduction dimension (in 16-element chunks), which spreads outliers
across a block and leaves the exact product unchanged.

Shapes: R rows of an operand, K its reduction dimension.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_MAX, SCALE_MAX = 6.0, 448.0
BLOCK = 16
_EVEN = (True, False, True, False, True, False, True, False)  # E2M1 codes whose last mantissa bit is 0


def _grid(device) -> torch.Tensor:
    return torch.tensor(E2M1, device=device, dtype=torch.float32)


def round_e2m1(v: torch.Tensor, stochastic: bool = False, generator: Optional[torch.Generator] = None
               ) -> torch.Tensor:
    """``v`` (already scaled) onto the E2M1 grid, saturating at 6: to nearest with ties to even, or stochastically
    (up with probability equal to the distance from the lower neighbour, so the expectation is ``v``)."""
    grid = _grid(v.device)
    a = v.abs().float().clamp(max=FP4_MAX)
    i = torch.bucketize(a, grid, right=True).clamp(1, len(E2M1) - 1) - 1  # grid[i] <= a < grid[i + 1]
    lo, hi = grid[i], grid[(i + 1).clamp(max=len(E2M1) - 1)]
    frac = torch.where(hi > lo, (a - lo) / (hi - lo), torch.zeros_like(a))
    if stochastic:
        up = torch.rand(a.shape, generator=generator, device=a.device, dtype=torch.float32) < frac
    else:
        even_lo = torch.tensor(_EVEN, device=v.device)[i]
        up = (frac > 0.5) | ((frac == 0.5) & ~even_lo)
    return torch.where(up, hi, lo).copysign(v.float())


def tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """The fp32 per-tensor encoding scale ``448 * 6 / amax``."""
    return (SCALE_MAX * FP4_MAX) / x.detach().abs().amax().float().clamp_min(1e-12)


def _tiles(x_RK: torch.Tensor, square: bool) -> tuple[int, int]:
    R, K = x_RK.shape
    rb = BLOCK if square else 1
    if K % BLOCK or R % rb:
        raise ValueError(f"NVFP4: a {R} x {K} operand does not split into {rb} x {BLOCK} blocks (dimensions must be "
                         f"multiples of {BLOCK})")
    return rb, BLOCK


def quantize(x_RK: torch.Tensor, square: bool = False, stochastic: bool = False,
             generator: Optional[torch.Generator] = None, ts: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(E2M1 values as float, E4M3 block scales as float, the fp32 tensor scale)``: ``x ~ q * block / tensor``.
    ``square``: 16 x 16 blocks (weights), else 1 x 16. ``ts``: the tensor scale(s) to use, one for all or one per row
    (e.g. per expert; a 16 x 16 block's rows must share theirs)."""
    R, K = x_RK.shape
    rb, cb = _tiles(x_RK, square)
    ts = tensor_scale(x_RK) if ts is None else ts.float()
    xs = x_RK.float() * ts
    amax = xs.abs().reshape(R // rb, rb, K // cb, cb).amax(dim=(1, 3))
    block = (amax / FP4_MAX).clamp(max=SCALE_MAX).to(torch.float8_e4m3fn).float()  # stored in E4M3
    block_RK = block.repeat_interleave(rb, 0).repeat_interleave(cb, 1)
    q = round_e2m1(torch.where(block_RK > 0, xs / block_RK, torch.zeros_like(xs)), stochastic, generator)
    return q, block, ts


def dequantize(q_RK: torch.Tensor, block: torch.Tensor, ts: torch.Tensor) -> torch.Tensor:
    rb, cb = q_RK.shape[0] // block.shape[0], q_RK.shape[1] // block.shape[1]
    return q_RK * block.repeat_interleave(rb, 0).repeat_interleave(cb, 1) / ts


def fake_quantize(x_RK: torch.Tensor, square: bool = False, stochastic: bool = False,
                  generator: Optional[torch.Generator] = None, ts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Quantize then dequantize (the emulation on hardware without FP4 tensor cores), in ``x``'s dtype."""
    return dequantize(*quantize(x_RK, square, stochastic, generator, ts)).to(x_RK.dtype)


def hadamard(n: int = BLOCK, device=None) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix of size ``n`` (a power of two)."""
    if n & (n - 1):
        raise ValueError(f"hadamard: size must be a power of two, got {n}")
    h = torch.ones(1, 1, device=device, dtype=torch.float32)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def random_hadamard(signs_16: torch.Tensor) -> torch.Tensor:
    """``H · diag(signs)``: a random orthogonal 16 x 16 transform (``signs`` of +-1, drawn once per model)."""
    return hadamard(signs_16.numel(), signs_16.device) * signs_16.to(torch.float32).unsqueeze(0)


def apply_along_rows(x_RK: torch.Tensor, t_16: torch.Tensor) -> torch.Tensor:
    """Apply the 16 x 16 transform to each 16-element chunk of every column, along the R dimension (the wgrad GEMM's
    reduction dimension when the operand is (tokens x features))."""
    R, K = x_RK.shape
    if R % t_16.shape[0]:
        raise ValueError(f"random Hadamard transform: {R} rows do not split into chunks of {t_16.shape[0]}")
    x = x_RK.float().reshape(R // t_16.shape[0], t_16.shape[0], K)
    return torch.einsum("ij,cjk->cik", t_16, x).reshape(R, K)
