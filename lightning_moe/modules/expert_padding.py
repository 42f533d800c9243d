"""Expert row groups padded to an alignment on the device (Megatron's ``--moe-router-padding-for-fp8``).

Low-precision grouped kernels need each expert's rows to start on an aligned boundary (16 rows: CUTLASS's FP8 wgrad
GEMM reduces over tokens with 16-byte TMA loads; the NVFP4 recipe quantizes 16-token chunks; 128 rows: the Triton FP8
wgrad's TMA blocks of tokens and DeepGEMM's expert blocks). The padded layout is
computed from the group offsets on the device, and its length is a static bound, so nothing waits on the host. The
padding rows are zeros: they add nothing to any product, change no amax, and are dropped before the loss.
"""

from __future__ import annotations

import torch


def padded_length(M: int, L: int, align: int) -> int:
    """The padded layout's static length for M rows in L groups: every group's padding fits, whatever the counts."""
    return -(-M // align) * align + align * L


def padded_layout(offs_L: torch.Tensor, M: int, align: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """For M rows grouped by the cumulative ends ``offs_L``: each row's place in the padded layout, the padded
    cumulative ends, each row's group, and the padded length P (a static bound: ceil(M / align) * align + align * L).
    Rows past ``offs_L[-1]`` (dropped or foreign rows, undefined values) land past the last padded end, where no
    group reads them."""
    L = offs_L.numel()
    offs_L = offs_L.to(torch.int64)
    counts_L = torch.diff(offs_L, prepend=offs_L.new_zeros(1))
    padded_L = (counts_L + align - 1) // align * align
    pends_L = torch.cumsum(padded_L, 0)
    rows_M = torch.arange(M, device=offs_L.device)
    gid_M = torch.bucketize(rows_M, offs_L, right=True).clamp_(max=L - 1)
    dest_M = (pends_L - padded_L)[gid_M] + rows_M - (offs_L - counts_L)[gid_M]
    dest_M = torch.where(rows_M < offs_L[-1], dest_M, pends_L[-1] + rows_M - offs_L[-1])
    return dest_M, pends_L, gid_M, padded_length(M, L, align)


def padded_ends(offs_L: torch.Tensor, M: int, align: int) -> tuple[torch.Tensor, int]:
    """``padded_layout``'s padded cumulative ends (int32) and P alone, for kernels that place each row themselves from
    the ends (``triton_fp8_quant.quant_t_padded``): a few launches where the rows' places take about twenty."""
    offs_L = offs_L.to(torch.int32)
    counts_L = torch.diff(offs_L, prepend=offs_L.new_zeros(1))
    pends_L = torch.cumsum((counts_L + align - 1) // align * align, 0, dtype=torch.int32)
    return pends_L, padded_length(M, offs_L.numel(), align)


def scatter_rows(x_MK: torch.Tensor, dest_M: torch.Tensor, P: int) -> torch.Tensor:
    """``x``'s rows at ``dest`` in P zero rows (FP8 rows move as bytes: index ops need no FP8 kernels)."""
    raw = x_MK.view(torch.uint8) if x_MK.element_size() == 1 else x_MK
    out = raw.new_zeros(P, x_MK.shape[1]).index_copy_(0, dest_M, raw)
    return out.view(x_MK.dtype)


def fp8_rows_layout(offs_L: torch.Tensor, M: int, align: int = 0, fused: bool = True):
    """What the FP8 expert GEMMs' kernels read, int32: ``(gid_M, pends_L, P, gid_P)``, each of M rows' group
    (``fp8_grouped.expert_of_rows``), and with ``align`` the padded ends and length (``padded_ends``) and each padded
    position's group (None without). One Triton launch where it runs (``triton_expert_rows``; ``fused``), else torch's
    ops."""
    from lightning_moe.modules.fp8_grouped import expert_of_rows  # it builds on this module
    from lightning_moe.modules.kernels import load
    tk = load("triton_expert_rows", offs_L, fused)
    if tk is not None:
        return tk.rows_layout(offs_L, M, align)
    gid_M = expert_of_rows(M, offs_L, offs_L.device, int32=True)
    if not align:
        return gid_M, None, None, None
    pends_L, P = padded_ends(offs_L, M, align)
    return gid_M, pends_L, P, expert_of_rows(P, pends_L, offs_L.device, int32=True)
