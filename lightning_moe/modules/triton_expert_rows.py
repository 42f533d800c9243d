"""The FP8 expert GEMMs' row layout in one launch (``expert_padding.fp8_rows_layout`` is the interface and the torch
reference): each row's expert, the experts' padded cumulative ends and each padded position's expert, which the
torch code builds in about a dozen small launches (arange, bucketize, clamp, diff, cumsum, ...) per GEMM.

Every program recomputes the padded ends from the L offsets in registers; program 0 stores them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lightning_moe.modules.expert_padding import padded_length
from lightning_moe.modules.triton_launch import launch


@triton.jit
def _rows_layout_kernel(offs_ptr, gid_ptr, pends_ptr, gidp_ptr, M, P, L, ALIGN, PADDED: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr):
    e = tl.arange(0, BLOCK_L)
    emask = e < L
    ends = tl.load(offs_ptr + e, mask=emask, other=0)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    # bucketize(rows, ends, right=True): how many ends are <= the row; the last expert past the last end
    past = emask[None, :] & (ends[None, :] <= rows[:, None])
    tl.store(gid_ptr + rows, tl.minimum(tl.sum(past.to(tl.int32), 1), L - 1), mask=rows < M)
    if PADDED:
        starts = tl.load(offs_ptr + e - 1, mask=emask & (e > 0), other=0)
        padded = (ends - starts + ALIGN - 1) // ALIGN * ALIGN
        pends = tl.cumsum(tl.where(emask, padded, 0), 0)
        if tl.program_id(0) == 0:
            tl.store(pends_ptr + e, pends, mask=emask)
        past = emask[None, :] & (pends[None, :] <= rows[:, None])
        tl.store(gidp_ptr + rows, tl.minimum(tl.sum(past.to(tl.int32), 1), L - 1), mask=rows < P)


def rows_layout(offs_L: torch.Tensor, M: int, align: int = 0):
    """``(gid_M, pends_L, P, gid_P)``, int32, ``expert_padding.fp8_rows_layout``'s values; without ``align``, the rows'
    experts alone (the others None)."""
    L = offs_L.numel()
    dev = offs_L.device
    offs_L = offs_L.to(torch.int32).contiguous()
    gid_M = torch.empty(M, device=dev, dtype=torch.int32)
    pends_L = gid_P = P = None
    if align:
        P = padded_length(M, L, align)
        pends_L = torch.empty(L, device=dev, dtype=torch.int32)
        gid_P = torch.empty(P, device=dev, dtype=torch.int32)
    BLOCK_L = max(16, triton.next_power_of_2(L))
    BLOCK_R = max(16, 8192 // BLOCK_L)
    rows = max(M, P or 0, 1)
    launch(_rows_layout_kernel, (triton.cdiv(rows, BLOCK_R),), offs_L, gid_M, pends_L if align else gid_M,
           gid_P if align else gid_M, M, P or 0, L, align or 1, PADDED=bool(align), BLOCK_R=BLOCK_R, BLOCK_L=BLOCK_L,
           num_warps=4)
    return gid_M, pends_L, P, gid_P
