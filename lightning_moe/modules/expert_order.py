"""Expert order without an argsort: where each routed copy goes in the experts' input, by count and prefix sum.

``expert_order``      the local permute, and the receivers that sort what arrived (all-gather, dedup): keys in
                      [0, E], E meaning "after every expert" (a dropped copy, or another rank's)
``resort_by_expert``  the all-to-all receiver: rows grouped by (source, local expert) regrouped by local expert

Both can round every expert's group up to ``align`` rows, the padding that FP8 grouped GEMMs need (Megatron's
``--moe-router-padding-for-fp8``; ``expert_padding.py`` pads after the fact instead): the holes are zero rows.
The Triton kernels (``triton_expert_order.py``) run on CUDA with ``ModelConfig.permute_fusion``; the torch code here
is the reference and the CPU path, and runs where a shape is past what the kernels keep in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_moe.modules import kernels
from lightning_moe.modules.expert_padding import padded_layout


@dataclass
class ExpertOrder:
    rows_N: torch.Tensor  # int64: each copy's row in the layout (stride layouts: dropped copies at the spare E*stride)
    src_R: torch.Tensor  # int64: each row's source, copy index // div; -1 for rows nobody fills (holes)
    counts_E: torch.Tensor  # int64: copies per expert (the sentinel's excluded)
    sizes_E: torch.Tensor  # int64: each expert's rows in the layout, counts rounded up to align


def layout_rows(N: int, E: int, align: int = 1, stride: int = 0) -> int:
    """The layout's length, a static bound: every expert's group plus the sentinel's copies after them."""
    return E * stride if stride else N + E * (align - 1)


def expert_order(keys_N: torch.Tensor, E: int, div: int = 1, align: int = 1, stride: int = 0,
                 fused: bool = True) -> ExpertOrder:
    """Copies grouped by key, stable (copy order within a key). ``stride``: expert e owns rows [e*stride,
    (e+1)*stride) (padded capacity; its copies must fit). Otherwise the groups are back to back, each rounded up
    to ``align`` rows, and the sentinel's copies follow the last group."""
    N, R = keys_N.numel(), layout_rows(keys_N.numel(), E, align, stride)
    tk = kernels.load("triton_expert_order", keys_N, fused)
    if tk is not None and E + 1 <= tk.MAX_KEYS:
        holes = stride > 0 or align > 1
        return ExpertOrder(*tk.rank_copies(keys_N, E, div, stride, align, R, -1 if holes else None))
    # the reference: a stable argsort and its inverse
    counts_E = torch.zeros(E + 1, device=keys_N.device, dtype=torch.int64).scatter_add_(
        0, keys_N, torch.ones_like(keys_N))[:E]
    order_N = torch.argsort(keys_N, stable=True)
    rank_N = torch.empty_like(order_N).scatter_(0, order_N, torch.arange(N, device=keys_N.device))
    sizes_E = (counts_E + align - 1) // align * align
    if not stride and align == 1:
        return ExpertOrder(rank_N, order_N // div, counts_E, counts_E)
    if stride:
        kept_N = keys_N < E
        e_N = keys_N.clamp(max=E - 1)
        rows_N = torch.where(kept_N, e_N * stride + rank_N - (counts_E.cumsum(0) - counts_E)[e_N], E * stride)
    else:  # rows past the last group (the sentinel's) land past the last padded end, in order
        rows_N = padded_layout(counts_E.cumsum(0), N, align)[0][rank_N]
    src_R = torch.full((R + 1,), -1, device=keys_N.device, dtype=torch.int64).scatter_(
        0, rows_N, torch.arange(N, device=keys_N.device) // div)[:R]  # R: the spare row of dropped copies
    return ExpertOrder(rows_N, src_R, counts_E, sizes_E)


def resort_by_expert(counts_SL: torch.Tensor, M: int, align: int = 1,
                     fused: bool = True) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For M rows that arrive in blocks of ``counts_SL[s, l]`` (source-major): each row's place grouped by local
    expert (stable: source order within an expert), each expert's rows rounded up to ``align``. Returns (dest_M,
    sizes_L, R), R the layout's static length. Only the counts are read: no host sync, no argsort."""
    S, L = counts_SL.shape
    R = M + L * (align - 1)
    tk = kernels.load("triton_expert_order", counts_SL, fused)
    if tk is not None and tk.next_pow2(S) * tk.next_pow2(L) <= tk.MAX_BLOCKS:
        return (*tk.resort_dest(counts_SL, M, align), R)
    flat_X = counts_SL.flatten()
    size_L = (counts_SL.sum(0) + align - 1) // align * align
    out_off_SL = (size_L.cumsum(0) - size_L).unsqueeze(0) + counts_SL.cumsum(0) - counts_SL
    shift_X = out_off_SL.flatten() - (flat_X.cumsum(0) - flat_X)  # each block's output start minus its input start
    block_M = torch.repeat_interleave(torch.arange(S * L, device=counts_SL.device), flat_X, output_size=M)
    return shift_X[block_M] + torch.arange(M, device=counts_SL.device), size_L, R
