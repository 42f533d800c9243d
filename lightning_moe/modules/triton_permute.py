"""Triton kernels for the unpermute side of MoE dispatch (CUDA only; permute.py falls back to torch elsewhere).

combine forward    out[t]  = sum_k p[t,k] * y[rows[t,k]]              one pass over the T*K expert rows
combine backward   gy[rows[t,k]] = p[t,k] * g[t];  gp[t,k] = <y[rows[t,k]], g[t]>   one pass, no atomics
gather-sum         out[t]  = sum_k g[rows[t,k]]   (the dispatch gather's backward: combine with p = 1)
gather             out[r]  = x[src[r]], 0 where src[r] is -1      (the dispatch gather: padded layouts' holes
                   are written as zeros here instead of gathering from a copy of x with a zero row appended)

The torch versions materialise a T x K x D copy and run a batched GEMV with M = 1; at the Qwen3 shape these
kernels replace ~6 passes over T*K*D with 1-2. Copies with keep[t,k] = False are never read (their rows may hold
undefined memory) and their gradient rows are written as 0.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from lightning_moe.modules.triton_launch import launch


@triton.jit
def _combine_fwd_kernel(y_ptr, rows_ptr, probs_ptr, keep_ptr, out_ptr, D, K: tl.constexpr, HAS_PROBS: tl.constexpr,
                        HAS_KEEP: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for k in tl.static_range(K):
        r = tl.load(rows_ptr + t * K + k).to(tl.int64)
        m = mask
        if HAS_KEEP:  # the flag as a vector, as masks are (the interpreter takes no scalar ones)
            m = m & ((tl.load(keep_ptr + t * K + k) + tl.zeros((BLOCK_D,), tl.int32)) != 0)
        v = tl.load(y_ptr + r * D + offs, mask=m, other=0.0).to(tl.float32)
        if HAS_PROBS:
            v = v * tl.load(probs_ptr + t * K + k).to(tl.float32)
        acc += v
    tl.store(out_ptr + t.to(tl.int64) * D + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_bwd_kernel(g_ptr, y_ptr, rows_ptr, probs_ptr, keep_ptr, gy_ptr, gp_ptr, D, K: tl.constexpr,
                        HAS_KEEP: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    for k in tl.static_range(K):
        r = tl.load(rows_ptr + t * K + k).to(tl.int64)
        p = tl.load(probs_ptr + t * K + k).to(tl.float32)
        if HAS_KEEP:  # the flag as a vector, as masks are (the interpreter takes no scalar ones)
            keep = (tl.load(keep_ptr + t * K + k) + tl.zeros((BLOCK_D,), tl.int32)) != 0
        else:
            keep = tl.zeros((BLOCK_D,), tl.int32) == 0
        dot = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            mask = offs < D
            g = tl.load(g_ptr + t.to(tl.int64) * D + offs, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(y_ptr + r * D + offs, mask=mask & keep, other=0.0).to(tl.float32)
            dot += g * y
            gy = tl.where(keep, p * g, 0.0)
            tl.store(gy_ptr + r * D + offs, gy.to(gy_ptr.dtype.element_ty), mask=mask)
        tl.store(gp_ptr + t * K + k, tl.sum(tl.where(keep, dot, 0.0), axis=0))


@triton.jit
def _gather_kernel(x_ptr, src_ptr, out_ptr, D, BLOCK_D: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    src = tl.load(src_ptr + r) + tl.zeros((BLOCK_D,), tl.int64)  # as a vector: the mask is one too
    mask = offs < D
    v = tl.load(x_ptr + src * D + offs, mask=mask & (src >= 0), other=0.0)
    tl.store(out_ptr + r.to(tl.int64) * D + offs, v, mask=mask)


def _block(D: int) -> int:
    return min(1024, triton.next_power_of_2(D))


def combine_fwd(y_ND: torch.Tensor, rows_TK: torch.Tensor, probs_TK: Optional[torch.Tensor],
                keep_TK: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    T, K = rows_TK.shape
    D = y_ND.shape[1]
    out = torch.empty(T, D, device=y_ND.device, dtype=out_dtype)
    BLOCK_D = _block(D)
    launch(_combine_fwd_kernel, (T, triton.cdiv(D, BLOCK_D)), y_ND.contiguous(), rows_TK.contiguous(),
           probs_TK.contiguous() if probs_TK is not None else rows_TK,
           keep_TK.contiguous() if keep_TK is not None else rows_TK, out, D, K=K, HAS_PROBS=probs_TK is not None,
           HAS_KEEP=keep_TK is not None, BLOCK_D=BLOCK_D, num_warps=4)
    return out


def combine_bwd(g_TD: torch.Tensor, y_ND: torch.Tensor, rows_TK: torch.Tensor, probs_TK: torch.Tensor,
                keep_TK: Optional[torch.Tensor], permutation: bool) -> tuple[torch.Tensor, torch.Tensor]:
    T, K = rows_TK.shape
    N, D = y_ND.shape
    # a permutation writes every row; padded layouts leave empty slots (zeros) and a spare row N for dropped copies
    gy = torch.empty(N, D, device=y_ND.device, dtype=y_ND.dtype) if permutation else \
        torch.zeros(N + 1, D, device=y_ND.device, dtype=y_ND.dtype)
    gp = torch.empty(T, K, device=y_ND.device, dtype=torch.float32)
    launch(_combine_bwd_kernel, (T,), g_TD.contiguous(), y_ND.contiguous(), rows_TK.contiguous(), probs_TK.contiguous(),
           keep_TK.contiguous() if keep_TK is not None else rows_TK, gy, gp, D, K=K, HAS_KEEP=keep_TK is not None,
           BLOCK_D=_block(D), num_warps=4)
    return gy[:N], gp


def gather(x_TD: torch.Tensor, src_R: torch.Tensor) -> torch.Tensor:
    R, D = src_R.numel(), x_TD.shape[1]
    out = torch.empty(R, D, device=x_TD.device, dtype=x_TD.dtype)
    BLOCK_D = _block(D)
    if R:
        launch(_gather_kernel, (R, triton.cdiv(D, BLOCK_D)), x_TD.contiguous(), src_R.contiguous(), out, D,
               BLOCK_D=BLOCK_D, num_warps=4)
    return out
