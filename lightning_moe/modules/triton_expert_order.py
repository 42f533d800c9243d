"""Triton kernels that put routed copies into expert order by counting, not sorting (``expert_order.py`` is the
interface and the torch reference).

histogram   per block of BLOCK_N keys: how many go to each expert (the sentinel E included)
rank        per block: the expert starts (prefix sum of the group sizes, each rounded up to ALIGN, or e * STRIDE)
            plus the copies of earlier blocks, plus the rank within the block (a cumsum over a one-hot tile):
            each copy's row, and each row's source (n // DIV). Stable: token order within an expert, as the
            stable argsort it replaces.
resort      the EP receiver: rows arrive grouped by (source, local expert); each row's place grouped by local
            expert, from the S x L counts alone (every program recomputes the offsets in registers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lightning_moe.modules.triton_launch import launch


@triton.jit
def _histogram_kernel(keys_ptr, hist_ptr, N, E1, BLOCK_N: tl.constexpr, SUB: tl.constexpr, E_PAD: tl.constexpr):
    b = tl.program_id(0)
    cols = tl.arange(0, E_PAD)
    acc = tl.zeros((E_PAD,), tl.int32)
    for s in range(0, BLOCK_N, SUB):
        n = b * BLOCK_N + s + tl.arange(0, SUB)
        key = tl.load(keys_ptr + n, mask=n < N, other=-1).to(tl.int32)
        acc += tl.sum((key[:, None] == cols[None, :]).to(tl.int32), axis=0)
    tl.store(hist_ptr + b * E1 + cols, acc, mask=cols < E1)


@triton.jit
def _rank_kernel(keys_ptr, hist_ptr, rows_ptr, src_ptr, counts_ptr, sizes_ptr, N, E, NB, DIV, STRIDE,
                 HAS_STRIDE: tl.constexpr, ALIGN: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr,
                 CH: tl.constexpr, E_PAD: tl.constexpr):
    b = tl.program_id(0)
    E1 = E + 1
    cols = tl.arange(0, E_PAD)
    cmask = cols < E1
    # copies per key over all blocks, and in the blocks before this one
    total = tl.zeros((E_PAD,), tl.int32)
    before = tl.zeros((E_PAD,), tl.int32)
    for b0 in range(0, NB, CH):
        bs = b0 + tl.arange(0, CH)
        h = tl.load(hist_ptr + bs[:, None] * E1 + cols[None, :], mask=(bs[:, None] < NB) & cmask[None, :], other=0)
        total += tl.sum(h, axis=0)
        before += tl.sum(tl.where(bs[:, None] < b, h, 0), axis=0)
    real = cols < E
    size = (total + ALIGN - 1) // ALIGN * ALIGN
    size = tl.where(real, size, 0)
    if HAS_STRIDE:  # padded capacity: expert e owns [e * STRIDE, (e + 1) * STRIDE)
        start = cols * STRIDE
    else:  # groups back to back; the sentinel's copies (size 0 here) start after the last group
        start = tl.cumsum(size, axis=0) - size
    if b == 0:
        tl.store(counts_ptr + cols, total.to(tl.int64), mask=real)
        if ALIGN > 1:
            tl.store(sizes_ptr + cols, size.to(tl.int64), mask=real)
    base = start + before
    for s in range(0, BLOCK_N, SUB):
        n = b * BLOCK_N + s + tl.arange(0, SUB)
        nmask = n < N
        key = tl.load(keys_ptr + n, mask=nmask, other=-1).to(tl.int32)
        hot = (key[:, None] == cols[None, :]).to(tl.int32)
        rank = tl.cumsum(hot, axis=0) - 1  # rank among this sub-block's copies of the same key
        row = tl.sum(hot * (base[None, :] + rank), axis=1)
        if HAS_STRIDE:
            dropped = key == E
            row = tl.where(dropped, E * STRIDE, row)  # one spare slot for every dropped copy, never read
            tl.store(src_ptr + row, (n // DIV).to(tl.int64), mask=nmask & ~dropped)
        else:
            tl.store(src_ptr + row, (n // DIV).to(tl.int64), mask=nmask)
        tl.store(rows_ptr + n, row.to(tl.int64), mask=nmask)
        base += tl.sum(hot, axis=0)


@triton.jit
def _resort_kernel(counts_ptr, dest_ptr, sizes_ptr, M, S, L, ALIGN: tl.constexpr, BLOCK_M: tl.constexpr,
                   S_PAD: tl.constexpr, L_PAD: tl.constexpr):
    pid = tl.program_id(0)
    s_ = tl.arange(0, S_PAD)
    l_ = tl.arange(0, L_PAD)
    c = tl.load(counts_ptr + s_[:, None] * L + l_[None, :], mask=(s_[:, None] < S) & (l_[None, :] < L),
                other=0).to(tl.int32)
    # where each (source, expert) block starts in the input (row-major) and in the output (expert-major)
    row_tot = tl.sum(c, axis=1)
    in_off = (tl.cumsum(row_tot, axis=0) - row_tot)[:, None] + tl.cumsum(c, axis=1) - c
    tot = tl.sum(c, axis=0)
    size = (tot + ALIGN - 1) // ALIGN * ALIGN
    out_off = (tl.cumsum(size, axis=0) - size)[None, :] + tl.cumsum(c, axis=0) - c
    if pid == 0:
        tl.store(sizes_ptr + l_, size.to(tl.int64), mask=l_ < L)
    in_1 = tl.reshape(in_off, (S_PAD * L_PAD,))
    shift_1 = tl.reshape(out_off - in_off, (S_PAD * L_PAD,))
    m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    # a row's block is the last one starting at or before it (empty blocks start where the next one does)
    le = (in_1[None, :] <= m[:, None]).to(tl.int32)
    last = tl.sum(le, axis=1) - 1
    j = tl.arange(0, S_PAD * L_PAD)
    shift = tl.sum(tl.where(j[None, :] == last[:, None], shift_1[None, :], 0), axis=1)
    tl.store(dest_ptr + m, (m + shift).to(tl.int64), mask=m < M)


# ---------------------------------------------------------------------------------------------------- launchers
BLOCK_N = 512  # keys a program ranks: ~256 programs at 131K copies; each re-reads the earlier blocks' counts
MAX_KEYS = 1024  # experts (+ the sentinel) in one register row; more and the reference runs
MAX_BLOCKS = 16384  # (sources x local experts) padded, for the receiver's re-sort


def _sub(E_PAD: int) -> int:
    return max(16, min(BLOCK_N, 4096 // E_PAD))


def rank_copies(keys_N: torch.Tensor, E: int, div: int, stride: int, align: int, R: int, fill: int):
    """(rows_N, src_R, counts_E, sizes_E): see ``expert_order.expert_order``."""
    N = keys_N.numel()
    dev = keys_N.device
    E_PAD = triton.next_power_of_2(E + 1)
    nb = max(1, triton.cdiv(N, BLOCK_N))
    sub = _sub(E_PAD)
    hist = torch.empty(nb, E + 1, device=dev, dtype=torch.int32)
    keys_N = keys_N.contiguous()
    launch(_histogram_kernel, (nb,), keys_N, hist, N, E + 1, BLOCK_N=BLOCK_N, SUB=sub, E_PAD=E_PAD, num_warps=4)
    rows = torch.empty(N, device=dev, dtype=torch.int64)
    # every row is written only when the layout has no holes
    src = torch.empty(R, device=dev, dtype=torch.int64) if fill is None else \
        torch.full((R,), fill, device=dev, dtype=torch.int64)
    counts = torch.empty(E, device=dev, dtype=torch.int64)
    sizes = torch.empty(E, device=dev, dtype=torch.int64) if align > 1 else counts
    launch(_rank_kernel, (nb,), keys_N, hist, rows, src, counts, sizes, N, E, nb, div, stride, HAS_STRIDE=stride > 0,
           ALIGN=align, BLOCK_N=BLOCK_N, SUB=sub, CH=16, E_PAD=E_PAD, num_warps=4)
    return rows, src, counts, sizes


def resort_dest(counts_SL: torch.Tensor, M: int, align: int):
    """(dest_M, sizes_L): see ``expert_order.resort_by_expert``."""
    S, L = counts_SL.shape
    dev = counts_SL.device
    dest = torch.empty(M, device=dev, dtype=torch.int64)
    sizes = torch.empty(L, device=dev, dtype=torch.int64)
    S_PAD, L_PAD = triton.next_power_of_2(S), triton.next_power_of_2(L)
    block_m = max(1, min(64, 4096 // (S_PAD * L_PAD)))
    launch(_resort_kernel, (max(1, triton.cdiv(M, block_m)),), counts_SL.contiguous(), dest, sizes, M, S, L,
           ALIGN=align, BLOCK_M=block_m, S_PAD=S_PAD, L_PAD=L_PAD, num_warps=4)
    return dest, sizes


next_pow2 = triton.next_power_of_2
