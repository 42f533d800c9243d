"""Triton RoPE for MLA's heads (Megatron's ``fused_apply_mla_rope_for_q`` / ``_for_kv``; ``mla.py`` falls back to
torch elsewhere). A head vector is ``[nope (N) | rope (R)]``; only the rope part rotates (rotate-half layout).

q   forward   out = [q_nope | rope(q_rope)]                    one pass: reads q, writes out
    backward  dq  = [g_nope | rope^T(g_rope)]                  one pass
k   forward   k[b, s, h] = [kv_nope[b, s, h] | rope(k_rope[b, s])]   the shared rope key broadcast to every head, the
              nope part read from the up-projection's output in place (no split, no cat)
    backward  d_kv_nope = g_nope (a view of the gradient), d_k_rope = rope^T(sum over heads of g_rope)

Sources are addressed by their (batch, sequence, head) strides, so views (the rope key inside the down-projection's
output, a transposed gradient) are read where they lie; outputs are contiguous. The math runs in float32 and rounds
once per output, as torch's ``apply_rope`` does (tests/modules/test_triton_mla_rope.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lightning_moe.modules.triton_launch import launch

BLOCK_R = 16  # head vectors per program
NUM_WARPS = 4


@triton.jit
def _kernel(nope_ptr, rope_ptr, out_ptr, cos_ptr, sin_ptr, rows, S, H, pos_rows, nb, ns, nh, rb, rs, rh,
            NOPE: tl.constexpr, HALF: tl.constexpr, INVERSE: tl.constexpr, BLOCK_R: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < rows
    h = (r % H).to(tl.int64)
    t = (r // H).to(tl.int64)  # the token: b * S + s
    s = t % S
    b = t // S
    out_row = r.to(tl.int64)[:, None] * (NOPE + 2 * HALF)
    cn = tl.arange(0, BLOCK_N)
    nmask = rmask[:, None] & (cn < NOPE)[None, :]
    x = tl.load(nope_ptr + (b * nb + s * ns + h * nh)[:, None] + cn[None, :], mask=nmask, other=0.0)
    tl.store(out_ptr + out_row + cn[None, :], x, mask=nmask)
    ch = tl.arange(0, BLOCK_H)
    cmask = ch < HALF
    mask = rmask[:, None] & cmask[None, :]
    src = (b * rb + s * rs + h * rh)[:, None] + ch[None, :]
    x1 = tl.load(rope_ptr + src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(rope_ptr + src + HALF, mask=mask, other=0.0).to(tl.float32)
    pos = (t % pos_rows)[:, None] * (2 * HALF) + ch[None, :]
    c1 = tl.load(cos_ptr + pos, mask=mask, other=0.0)
    c2 = tl.load(cos_ptr + pos + HALF, mask=mask, other=0.0)
    s1 = tl.load(sin_ptr + pos, mask=mask, other=0.0)
    s2 = tl.load(sin_ptr + pos + HALF, mask=mask, other=0.0)
    if INVERSE:  # the rotation's transpose
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + out_row + NOPE + ch[None, :], y1.to(dt), mask=mask)
    tl.store(out_ptr + out_row + NOPE + HALF + ch[None, :], y2.to(dt), mask=mask)


def _tables(cos: torch.Tensor, sin: torch.Tensor, R: int):
    return cos.reshape(-1, R).contiguous().float(), sin.reshape(-1, R).contiguous().float()


def _launch(nope: torch.Tensor, rope: torch.Tensor, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            inverse: bool) -> torch.Tensor:
    """``nope`` (B, S, H, N) and ``rope`` (B, S, H or 1, R) views, ``out`` (B, S, H, N + R) contiguous."""
    B, S, H, N = nope.shape
    R = rope.shape[-1]
    if R % 2:
        raise ValueError(f"MLA rope: the rope dim must be even, got {R}")
    if nope.stride(-1) != 1 or rope.stride(-1) != 1:
        nope, rope = nope.contiguous(), rope.contiguous()
    cos_PR, sin_PR = _tables(cos, sin, R)
    rows = B * S * H
    if rows:
        rh = rope.stride(2) if rope.shape[2] > 1 else 0  # the shared rope key: every head reads the same row
        launch(_kernel, (triton.cdiv(rows, BLOCK_R),), nope, rope, out, cos_PR, sin_PR, rows, S, H, cos_PR.shape[0],
               *nope.stride()[:3], rope.stride(0), rope.stride(1), rh, NOPE=N, HALF=R // 2, INVERSE=inverse,
               BLOCK_R=BLOCK_R, BLOCK_N=triton.next_power_of_2(N), BLOCK_H=triton.next_power_of_2(R // 2),
               num_warps=NUM_WARPS)
    return out


def rope_q(q_BSHK: torch.Tensor, nope: int, cos: torch.Tensor, sin: torch.Tensor,
           inverse: bool = False) -> torch.Tensor:
    """``[q_nope | rope(q_rope)]`` (``inverse``: the backward's ``rope^T``), a new contiguous tensor."""
    out = torch.empty(q_BSHK.shape, device=q_BSHK.device, dtype=q_BSHK.dtype)
    return _launch(q_BSHK[..., :nope], q_BSHK[..., nope:], out, cos, sin, inverse)


def rope_k(k_nope_BSHN: torch.Tensor, k_rope_BSR: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``[k_nope | rope(k_rope)]`` with the rope key broadcast to every head, a new contiguous tensor."""
    B, S, H, N = k_nope_BSHN.shape
    out = torch.empty(B, S, H, N + k_rope_BSR.shape[-1], device=k_nope_BSHN.device, dtype=k_nope_BSHN.dtype)
    return _launch(k_nope_BSHN, k_rope_BSR.unsqueeze(2), out, cos, sin, inverse=False)


def rope_k_backward(g_BSHK: torch.Tensor, nope: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The shared rope key's gradient: ``rope^T`` of the heads' rope gradients summed (in float32; the rotation is the
    same for every head of a token, so it commutes with the sum). (B, S, R), in the gradient's dtype."""
    g = g_BSHK[..., nope:].sum(dim=2, dtype=torch.float32)
    R = g.shape[-1]
    cos_PR, sin_PR = _tables(cos, sin, R)
    B, S = g.shape[:2]
    pos = torch.arange(B * S, device=g.device) % cos_PR.shape[0]
    c, s_ = cos_PR[pos].view(B, S, R), sin_PR[pos].view(B, S, R)
    g1, g2 = g.chunk(2, dim=-1)
    c1, c2 = c.chunk(2, dim=-1)
    s1, s2 = s_.chunk(2, dim=-1)
    return torch.cat([g1 * c1 + g2 * s2, g2 * c2 - g1 * s1], dim=-1).to(g_BSHK.dtype)
