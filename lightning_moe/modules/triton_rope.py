"""Triton RoPE, optionally after a per-head RMSNorm (Qwen3's q/k norms): Megatron's ``--apply-rope-fusion``, with the
norm folded in (``attention.py`` falls back to torch elsewhere).

Rows are head vectors of ``Dh`` (``x`` of (..., heads, Dh), copied when not contiguous); row ``r`` belongs to token
``r // heads``,
whose cos/sin row is ``token % len(cos)`` (shared positions (S, Dh) or each row's own (B * S, Dh)).

forward    y = x * rstd * w (rounded to x's dtype, as the norm's output is), out = y * cos + rotate_half(y) * sin
           one pass: reads x, writes out (and rstd, one float per row, for backward)
backward   dy = g * cos + rotate_half^T(g * sin);  dx = rstd * (dy * w - x_hat * mean(dy * w * x_hat)),
           dw = sum over rows of dy * x_hat (a float32 partial per program of 16 rows, summed after)

The math runs in float32 and rounds at the norm's output and at the end, where torch rounds after each op: close to
the torch reference, not bit-identical to it (tests/modules/test_triton_rope.py bounds the difference).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from lightning_moe.modules.triton_launch import launch


@triton.jit
def _fwd_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, rstd_ptr, R, heads, pos_rows, eps,
                HALF: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    rmask, cmask = rows < R, cols < HALF
    mask = rmask[:, None] & cmask[None, :]
    base = rows.to(tl.int64)[:, None] * (2 * HALF) + cols[None, :]
    x1 = tl.load(x_ptr + base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + base + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
        tl.store(rstd_ptr + rows, rstd, mask=rmask)
        w1 = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        x1 = (x1 * rstd[:, None] * w1[None, :]).to(dt).to(tl.float32)  # the norm's output, in x's dtype
        x2 = (x2 * rstd[:, None] * w2[None, :]).to(dt).to(tl.float32)
    pos = ((rows // heads) % pos_rows).to(tl.int64)[:, None] * (2 * HALF) + cols[None, :]
    c1 = tl.load(cos_ptr + pos, mask=mask, other=0.0)
    c2 = tl.load(cos_ptr + pos + HALF, mask=mask, other=0.0)
    s1 = tl.load(sin_ptr + pos, mask=mask, other=0.0)
    s2 = tl.load(sin_ptr + pos + HALF, mask=mask, other=0.0)
    tl.store(out_ptr + base, (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + base + HALF, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(g_ptr, x_ptr, w_ptr, cos_ptr, sin_ptr, rstd_ptr, dx_ptr, dw_ptr, R, heads, pos_rows,
                HALF: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_H)
    rmask, cmask = rows < R, cols < HALF
    mask = rmask[:, None] & cmask[None, :]
    base = rows.to(tl.int64)[:, None] * (2 * HALF) + cols[None, :]
    pos = ((rows // heads) % pos_rows).to(tl.int64)[:, None] * (2 * HALF) + cols[None, :]
    g1 = tl.load(g_ptr + base, mask=mask, other=0.0).to(tl.float32)
    g2 = tl.load(g_ptr + base + HALF, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + pos, mask=mask, other=0.0)
    c2 = tl.load(cos_ptr + pos + HALF, mask=mask, other=0.0)
    s1 = tl.load(sin_ptr + pos, mask=mask, other=0.0)
    s2 = tl.load(sin_ptr + pos + HALF, mask=mask, other=0.0)
    d1 = g1 * c1 + g2 * s2  # the rotation's transpose
    d2 = g2 * c2 - g1 * s1
    if HAS_NORM:
        w1 = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + cols, mask=cmask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        xh1 = tl.load(x_ptr + base, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
        xh2 = tl.load(x_ptr + base + HALF, mask=mask, other=0.0).to(tl.float32) * rstd[:, None]
        # the weight's gradient: one float32 partial per program, summed after (no atomics: deterministic)
        tl.store(dw_ptr + pid * (2 * HALF) + cols, tl.sum(d1 * xh1, axis=0), mask=cmask)
        tl.store(dw_ptr + pid * (2 * HALF) + HALF + cols, tl.sum(d2 * xh2, axis=0), mask=cmask)
        d1, d2 = d1 * w1[None, :], d2 * w2[None, :]
        mean = (tl.sum(d1 * xh1, axis=1) + tl.sum(d2 * xh2, axis=1)) / (2 * HALF)
        d1 = rstd[:, None] * (d1 - xh1 * mean[:, None])
        d2 = rstd[:, None] * (d2 - xh2 * mean[:, None])
    tl.store(dx_ptr + base, d1.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + base + HALF, d2.to(dx_ptr.dtype.element_ty), mask=mask)


BLOCK_R = 16  # rows (head vectors) per program
NUM_WARPS = 4
# Fixed, not autotuned: the row sums (rstd, the norm's backward) and the weight gradient's per-program sum are laid out
# over threads by the tile shape and the warps, so another config would sum in another order, and a run-to-run
# timing difference must not change the numbers


def _rows(x: torch.Tensor, cos: torch.Tensor):
    Dh, heads = x.shape[-1], x.shape[-2]
    if Dh % 2:
        raise ValueError(f"rope: the head dim must be even, got {Dh}")
    return x.contiguous().view(-1, Dh), heads, cos.reshape(-1, Dh).contiguous().float()


def forward(x: torch.Tensor, w: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``x``: (..., heads, Dh) (copied when not contiguous); ``w``: the norm's weight (Dh), or None for RoPE alone;
    ``cos``/``sin``: (S, Dh) or (B, S, Dh), float32. Returns the rotated output and the per-row rstd (None without
    the norm)."""
    x_RD, heads, cos_PD = _rows(x, cos)
    sin_PD = sin.reshape(-1, x.shape[-1]).contiguous().float()
    R, Dh = x_RD.shape
    out = torch.empty_like(x_RD)
    rstd = torch.empty(R, device=x.device, dtype=torch.float32) if w is not None else None
    if R:
        half, args = Dh // 2, (x_RD, w if w is not None else x_RD, cos_PD, sin_PD, out,
                               rstd if rstd is not None else out, R, heads, cos_PD.shape[0], eps)
        launch(_fwd_kernel, (triton.cdiv(R, BLOCK_R),), *args, HALF=half, HAS_NORM=w is not None, BLOCK_R=BLOCK_R,
               BLOCK_H=triton.next_power_of_2(half), num_warps=NUM_WARPS)
    return out.view(x.shape), rstd


def backward(g: torch.Tensor, x: Optional[torch.Tensor], w: Optional[torch.Tensor], cos: torch.Tensor,
             sin: torch.Tensor, rstd: Optional[torch.Tensor],
             shape: Optional[torch.Size] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The input's gradient and the weight's (None without the norm). Without the norm the input itself is not
    needed (``x=None``, its ``shape`` given)."""
    shape = x.shape if x is not None else shape
    Dh, heads = shape[-1], shape[-2]
    x_RD = x.contiguous().view(-1, Dh) if x is not None else None
    cos_PD = cos.reshape(-1, Dh).contiguous().float()
    sin_PD = sin.reshape(-1, Dh).contiguous().float()
    g_RD = g.contiguous().view(-1, Dh)
    R = g_RD.shape[0]
    dx = torch.empty_like(g_RD)
    nprog = triton.cdiv(R, BLOCK_R)
    dw = torch.empty(nprog, Dh, device=g.device, dtype=torch.float32) if w is not None else None
    if R:
        launch(_bwd_kernel, (nprog,), g_RD, x_RD if x_RD is not None else g_RD, w if w is not None else g_RD, cos_PD,
               sin_PD, rstd if rstd is not None else dx, dx, dw if dw is not None else dx, R, heads, cos_PD.shape[0],
               HALF=Dh // 2, HAS_NORM=w is not None, BLOCK_R=BLOCK_R, BLOCK_H=triton.next_power_of_2(Dh // 2),
               num_warps=NUM_WARPS)
    return dx.view(shape), (dw.sum(0).to(w.dtype) if w is not None else None)
