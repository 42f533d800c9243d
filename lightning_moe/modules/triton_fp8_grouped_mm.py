"""The experts' FP8 forward and dgrad GEMMs with rowwise scales, rows grouped by expert, on Hopper's FP8 tensor cores:

    out[m] = sa[m] * sb[e][None, :] * (a[m] @ b[e]^T)     for the rows m of expert e (``offs``: their cumulative ends)

a (M, K) and b (L, N, K) are E4M3 with K contiguous (K-major, as the MMA reads both), sa (M,) and sb (L, N) the
dequantization scales, out (M, N) bf16. The precise accumulation adds the tensor cores' partial sums into an fp32
accumulator after every 128 of K, as CUTLASS's non-fast-accumulation kernels promote; ``fast`` keeps the tensor
cores' own accumulator. Both give CUTLASS's bits (``torch._scaled_grouped_mm``: the same MMAs over K in the same
order, promoted at the same points, the same epilogue), so the kernel choice leaves the numbers alone. Against it on
one H100 (docs/PERFORMANCE.md), the precise accumulation runs 2.7-3.9x as fast at Qwen3's fine-grained experts
(where CUTLASS's runs at 0.4 of bf16) and about as fast at Mixtral's; the fast one 1.07x on average over the presets'
expert GEMMs, most at uneven routing.

Each expert's rows are cut into BLOCK_M tiles, the last one partial. Every program computes the tiles' schedule from
the offsets on the device (the experts' tile counts and their prefix sum, in registers), and the grid is the static
bound cdiv(M, BLOCK_M) + L tiles: nothing waits on the host. A tile reads its rows by TMA; rows past its expert's
end (the next expert's, or zeros past M) enter the product but are never stored. Rows past ``offs[-1]`` are left
undefined, as ``torch._scaled_grouped_mm`` leaves them.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from lightning_moe.modules.triton_grouped_wgrad import grouped_tile
from lightning_moe.modules.triton_launch import launch

BLOCK_K = 128  # the promotion interval of the precise accumulation, and the TMA block along K


@triton.jit
def _fp8_grouped_mm_kernel(a_desc, sa_ptr, b_desc, sb_ptr, out_ptr, offs_ptr, N, K, L, TILES, FAST: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_L: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr):
    t, pn = grouped_tile(tl.program_id(0), TILES * BLOCK_M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # the schedule: expert e owns tiles [cum[e] - tiles[e], cum[e])
    ls = tl.arange(0, BLOCK_L)
    live = ls < L
    ends = tl.load(offs_ptr + ls, mask=live, other=0)
    starts = tl.load(offs_ptr + ls - 1, mask=live & (ls > 0), other=0)
    tiles = tl.where(live, tl.cdiv(ends - starts, BLOCK_M), 0)
    cum = tl.cumsum(tiles, 0)
    e = tl.sum((cum <= t).to(tl.int32), 0)  # experts wholly before tile t (L or more: t is past the schedule)
    if e >= L:
        return
    mine = ls == e
    start, end = tl.sum(tl.where(mine, starts, 0), 0), tl.sum(tl.where(mine, ends, 0), 0)
    row0 = start + (t - tl.sum(tl.where(mine, cum - tiles, 0), 0)) * BLOCK_M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        a = a_desc.load([row0, k0])
        b = b_desc.load([e * N + pn * BLOCK_N, k0])
        if FAST:
            acc = tl.dot(a, tl.trans(b), acc)
        else:  # the tensor cores' partial sums added into the fp32 accumulator after each block of K
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
    rm = row0 + tl.arange(0, BLOCK_M)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    rows, cols = rm < end, rn < N
    sa = tl.load(sa_ptr + rm, mask=rows, other=0.0)
    sb = tl.load(sb_ptr + e.to(tl.int64) * N + rn, mask=cols, other=0.0)
    out = acc * sa[:, None] * sb[None, :]
    tl.store(out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], out.to(out_ptr.dtype.element_ty),
             mask=rows[:, None] & cols[None, :])


# (BLOCK_M, BLOCK_N, warps, stages): the best of a sweep on one H100 over the Mixtral, Qwen3, OLMoE and DeepSeek-V3
# (EP8) expert GEMMs (``benchmarks/bench_fp8_grouped_mm.py``, docs/PERFORMANCE.md). The precise promotion holds the
# partial product and the accumulator, which one warpgroup on 128 x 128 tiles keeps in registers (as the FP8 wgrad,
# triton_fp8_wgrad.CONFIGS); fast accumulation takes 128 x 256 tiles on two warpgroups, except over a short K.
CONFIGS = {"precise": (128, 128, 4, 3), "fast": (128, 256, 8, 4), "fast_short_k": (128, 128, 4, 3)}
SHORT_K = 1024


def config_for(fast: bool, K: int) -> tuple:
    return CONFIGS["precise" if not fast else "fast_short_k" if K <= SHORT_K else "fast"]


def check_operands(a_MK, b_LNK, sa_M, sb_LN, offs_L) -> tuple:
    """(M, K, N, L) of a grouped GEMM's operands; ValueError where they do not fit together."""
    M, K = a_MK.shape
    L, N, Kb = b_LNK.shape
    if Kb != K or sa_M.numel() != M or sb_LN.numel() != L * N or offs_L.numel() != L or K % 16:
        raise ValueError(f"FP8 grouped GEMM: a {tuple(a_MK.shape)}, b {tuple(b_LNK.shape)}, scales "
                         f"{tuple(sa_M.shape)} and {tuple(sb_LN.shape)}, {offs_L.numel()} offsets: want (M, K), "
                         "(L, N, K), M and L x N scales, L offsets, K a multiple of 16")
    return M, K, N, L


@torch.no_grad()
def grouped_mm(a_MK: torch.Tensor, b_LNK: torch.Tensor, sa_M: torch.Tensor, sb_LN: torch.Tensor,
               offs_L: torch.Tensor, fast: bool = False, config: Optional[tuple] = None,
               out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``out[rows of l] = sa[rows] * sb[l] * (a[rows] @ b[l]^T)``: ``a`` (M, K), ``b`` (L, N, K), both K-contiguous;
    ``sa`` (M,) or (M, 1) and ``sb`` (L, N) or (L, 1, N) dequantize (the reciprocals of the quantization scales);
    ``offs``: the experts' cumulative row ends, on the device. ``config``: (BLOCK_M, BLOCK_N, warps, stages), by
    default ``config_for``'s."""
    M, K, N, L = check_operands(a_MK, b_LNK, sa_M, sb_LN, offs_L)
    out = torch.empty(M, N, device=a_MK.device, dtype=out_dtype)
    if M == 0 or N == 0 or L == 0:
        return out
    bm, bn, warps, stages = config or config_for(fast, K)
    da = TensorDescriptor.from_tensor(a_MK.contiguous(), [bm, BLOCK_K])
    db = TensorDescriptor.from_tensor(b_LNK.contiguous().view(L * N, K), [bn, BLOCK_K])
    tiles = triton.cdiv(M, bm) + L  # a static bound of the experts' tiles
    launch(_fp8_grouped_mm_kernel, (tiles * triton.cdiv(N, bn),), da, sa_M.float().contiguous(), db,
           sb_LN.float().contiguous(), out, offs_L.to(torch.int32).contiguous(), N, K, L, tiles, FAST=fast, BLOCK_M=bm,
           BLOCK_N=bn, BLOCK_K=BLOCK_K, BLOCK_L=max(16, triton.next_power_of_2(L)), GROUP_M=8, STAGES=stages,
           num_warps=warps)
    return out
