"""Triton SwiGLU, optionally weighted per row (Megatron's fused (weighted) bias-SwiGLU; ``experts.py`` falls back to
torch elsewhere).

forward    out[r] = silu(gate[r]) * up[r] * p[r]                 one pass: reads [gate | up] (and p), writes out
backward   d_gate = g * p * up * silu'(gate),  d_up = g * p * silu(gate),  d_p[r] = <g[r], silu(gate[r]) * up[r]>
           one pass per row over the features, no atomics; silu(gate) is recomputed, as the torch path does

The math runs in float32 and rounds once per output, where torch rounds after each op: close to the torch
reference, not bit-identical to it (tests/test_gpu_fused.py bounds the difference).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from lightning_moe.modules.triton_launch import launch


@triton.jit
def swiglu_math(gate, up, p, HAS_P: tl.constexpr):
    """The forward's fp32 value (``gate``, ``up`` fp32; ``p`` the row weight, read only with HAS_P): shared with the
    FP8 quantizer that fuses it (``triton_fp8_quant``), so that both give the same bits."""
    a = gate * tl.sigmoid(gate) * up
    if HAS_P:
        a = a * p
    return a


@triton.jit
def swiglu_grad_math(g, gate, up, p, HAS_P: tl.constexpr):
    """``(d_gate, d_up, g * silu(gate) * up)`` in fp32 (the last: the row weight's gradient terms), shared as
    ``swiglu_math``."""
    sig = tl.sigmoid(gate)
    silu = gate * sig
    gp = g
    if HAS_P:
        gp = g * p
    return gp * up * sig * (1.0 + gate * (1.0 - sig)), gp * silu, g * silu * up


@triton.jit
def _fwd_kernel(h_ptr, p_ptr, out_ptr, F, HAS_P: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < F
    gate = tl.load(h_ptr + r * 2 * F + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + r * 2 * F + F + offs, mask=mask, other=0.0).to(tl.float32)
    p = 1.0
    if HAS_P:
        p = tl.load(p_ptr + r).to(tl.float32)
    tl.store(out_ptr + r * F + offs, swiglu_math(gate, up, p, HAS_P).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(g_ptr, h_ptr, p_ptr, gh_ptr, gp_ptr, F, HAS_P: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    p = 1.0
    if HAS_P:  # resolved at compile time
        p = tl.load(p_ptr + r).to(tl.float32)
    dot = tl.zeros((BLOCK,), dtype=tl.float32)
    for f0 in range(0, F, BLOCK):
        offs = f0 + tl.arange(0, BLOCK)
        mask = offs < F
        g = tl.load(g_ptr + r * F + offs, mask=mask, other=0.0).to(tl.float32)
        gate = tl.load(h_ptr + r * 2 * F + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + r * 2 * F + F + offs, mask=mask, other=0.0).to(tl.float32)
        d_gate, d_up, terms = swiglu_grad_math(g, gate, up, p, HAS_P)
        if HAS_P:
            dot += terms
        tl.store(gh_ptr + r * 2 * F + offs, d_gate.to(gh_ptr.dtype.element_ty), mask=mask)
        tl.store(gh_ptr + r * 2 * F + F + offs, d_up.to(gh_ptr.dtype.element_ty), mask=mask)
    if HAS_P:
        tl.store(gp_ptr + r, tl.sum(dot, axis=0))


def _block(F: int) -> int:
    return min(1024, triton.next_power_of_2(F))


def forward(h_M2F: torch.Tensor, p_M: Optional[torch.Tensor]) -> torch.Tensor:
    """``h``: [gate | up] along the last dim, any leading dims (rows); ``p_M``: one weight per row, or None."""
    lead, F = h_M2F.shape[:-1], h_M2F.shape[-1] // 2
    h_M2F = h_M2F.reshape(-1, 2 * F).contiguous()
    M = h_M2F.shape[0]
    out = torch.empty(M, F, device=h_M2F.device, dtype=h_M2F.dtype)
    if M:
        B = _block(F)
        launch(_fwd_kernel, (M, triton.cdiv(F, B)), h_M2F, p_M.contiguous() if p_M is not None else h_M2F, out, F,
               HAS_P=p_M is not None, BLOCK=B, num_warps=4)
    return out.view(*lead, F)


def backward(g_MF: torch.Tensor, h_M2F: torch.Tensor,
             p_M: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    shape, F = h_M2F.shape, h_M2F.shape[-1] // 2
    h_M2F = h_M2F.reshape(-1, 2 * F).contiguous()
    M = h_M2F.shape[0]
    gh = torch.empty_like(h_M2F)
    gp = torch.empty(M, device=h_M2F.device, dtype=torch.float32) if p_M is not None else None
    if M:
        launch(_bwd_kernel, (M,), g_MF.reshape(M, F).contiguous(), h_M2F,
               p_M.contiguous() if p_M is not None else h_M2F, gh, gp if gp is not None else gh, F,
               HAS_P=p_M is not None, BLOCK=_block(F), num_warps=4)
    return gh.view(shape), gp
