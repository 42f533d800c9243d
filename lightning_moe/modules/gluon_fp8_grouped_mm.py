"""The experts' FP8 forward and dgrad GEMM with the precise accumulation, in Gluon (triton's lower-level language):

    out[m] = sa[m] * sb[e][None, :] * (a[m] @ b[e]^T)     for the rows m of expert e (``offs``: their cumulative ends)

with ``triton_fp8_grouped_mm``'s arguments, layout, tile schedule and bits. Both promote the tensor cores' partial
sums into an fp32 accumulator after every 128 of K, as CUTLASS does. In triton the promotion's adds sit between the
asynchronous MMAs of a block, and ptxas then serializes every MMA (its info C7514; a wait after each ``wgmma`` in the
SASS: docs/PERFORMANCE.md). Here each 128-deep block's MMA starts from zero (``use_acc=False``) and runs while the
previous block's partial sum is added (one wait keeps the newer MMA in flight); two blocks per loop iteration keep any
MMA from being in flight across the loop's back edge, where the loop-carried copy of its accumulator would make
ptxas serialize them again. The same MMAs, promoted at the same points in the same order: the same bits.

On one H100 it ran up to 31 % faster than the triton kernel at Mixtral's expert GEMMs (K >= 4,096), 9 % slower at
some uneven routings, and slower at Qwen3's short K (one program per SM against triton's two); Mixtral's model gained
1-2 %. So ``fp8_grouped_kernels`` takes it from ``MIN_K`` on, and only with ``LMOE_FP8_GLUON_GEMM=1``: Gluon is
triton's experimental API. Blocks past K are TMA's zeros (an odd number of blocks adds a zero block: +0 to the
accumulator).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from lightning_moe.modules.gluon_fp8_grouped_ws import _tile
from lightning_moe.modules.gluon_fp8_wgrad import shared_layout
from lightning_moe.modules.triton_fp8_grouped_mm import check_operands
from lightning_moe.modules.triton_launch import launch

BLOCK_K = 128  # the promotion interval, and the TMA block along K
CONFIG = (128, 128, 8, 4)  # (BLOCK_M, BLOCK_N, warps, stages): two warpgroups of 64 rows each, 208 registers
MIN_K = 4096  # the shortest K it is taken for (docs/PERFORMANCE.md)
_BK = gl.constexpr(BLOCK_K)


@gluon.jit
def _load(a_desc, b_desc, bars, a_bufs, b_bufs, row0, col0, kb, nk_pad, STAGES: gl.constexpr):
    """Block ``kb`` of K (its A and B tiles) into stage ``kb % STAGES``, if the loop will read it."""
    s = kb % STAGES
    pred = kb < nk_pad
    mbarrier.expect(bars.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [row0, kb * _BK], bars.index(s), a_bufs.index(s), pred)
    tma.async_copy_global_to_shared(b_desc, [col0, kb * _BK], bars.index(s), b_bufs.index(s), pred)


@gluon.jit
def _mma(bars, a_bufs, b_bufs, zero, kb, STAGES: gl.constexpr):
    """Block ``kb``'s product from zero, asynchronous, once its tiles have landed."""
    s = kb % STAGES
    mbarrier.wait(bars.index(s), (kb // STAGES) & 1)
    return warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _kernel(a_desc, sa_ptr, b_desc, sb_ptr, out_ptr, offs_ptr, N, K, L, TILES, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, BLOCK_L: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
            num_warps: gl.constexpr):
    # triton_fp8_grouped_mm's schedule (from the offsets, on the device)
    live, e, row0, end, pn = _tile(gl.program_id(0), offs_ptr, N, L, TILES, BLOCK_M, BLOCK_N, BLOCK_L, GROUP_M,
                                   num_warps, False)  # cut tiles stay in place (masked stores below)
    if not live:
        return
    col0 = e * N + pn * BLOCK_N

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    nk_pad = gl.cdiv(gl.cdiv(K, _BK), 2) * 2  # the blocks the loop reads, two per iteration
    for i in gl.static_range(STAGES - 1):
        _load(a_desc, b_desc, bars, a_bufs, b_bufs, row0, col0, i, nk_pad, STAGES)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
    zero = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
    for k0 in range(0, nk_pad, 2):
        p0 = _mma(bars, a_bufs, b_bufs, zero, k0, STAGES)
        # block k0 - 1's stage is free (its MMA was waited for at the end of the last iteration)
        _load(a_desc, b_desc, bars, a_bufs, b_bufs, row0, col0, k0 + STAGES - 1, nk_pad, STAGES)
        p1 = _mma(bars, a_bufs, b_bufs, zero, k0 + 1, STAGES)
        acc = acc + warpgroup_mma_wait(num_outstanding=1, deps=(p0,))  # while block k0 + 1 multiplies
        _load(a_desc, b_desc, bars, a_bufs, b_bufs, row0, col0, k0 + STAGES, nk_pad, STAGES)
        acc = acc + warpgroup_mma_wait(num_outstanding=0, deps=(p1,))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    rm = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
    rn = pn * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    sa = gl.load(sa_ptr + rm, mask=rm < end, other=0.0)
    sb = gl.load(sb_ptr + e.to(gl.int64) * N + rn, mask=rn < N, other=0.0)
    out = (acc * gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0)).to(out_ptr.dtype.element_ty)
    # stored in 16-byte rows: from the MMA's fragments (two adjacent columns per thread) it ran up to 20 % slower
    TN: gl.constexpr = BLOCK_N // 8 if BLOCK_N // 8 < 32 else 32
    store: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TN, TN], [num_warps, 1], [1, 0])
    out = gl.convert_layout(out, store)
    rm = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, store))
    rn = pn * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store))
    ptrs = out_ptr + gl.expand_dims(rm.to(gl.int64), 1) * N + gl.expand_dims(rn, 0)
    gl.store(ptrs, out, mask=gl.expand_dims(rm < end, 1) & gl.expand_dims(rn < N, 0))


@torch.no_grad()
def grouped_mm(a_MK: torch.Tensor, b_LNK: torch.Tensor, sa_M: torch.Tensor, sb_LN: torch.Tensor,
               offs_L: torch.Tensor, config: Optional[tuple] = None) -> torch.Tensor:
    """``triton_fp8_grouped_mm.grouped_mm(..., fast=False)``'s product and bits: ``a`` (M, K) and ``b`` (L, N, K)
    E4M3, K-contiguous; ``sa`` (M,) and ``sb`` (L, N) dequantization scales; ``offs`` the experts' cumulative row
    ends, on the device. Rows past ``offs[-1]`` are left undefined. ``config``: (BLOCK_M, BLOCK_N, warps, stages)."""
    M, K, N, L = check_operands(a_MK, b_LNK, sa_M, sb_LN, offs_L)
    out = torch.empty(M, N, device=a_MK.device, dtype=torch.bfloat16)
    if M == 0 or N == 0 or L == 0:
        return out
    bm, bn, warps, stages = config or CONFIG
    la, lb = shared_layout((bm, BLOCK_K), gl.float8e4nv), shared_layout((bn, BLOCK_K), gl.float8e4nv)
    da = TensorDescriptor.from_tensor(a_MK.contiguous(), [bm, BLOCK_K], la)
    db = TensorDescriptor.from_tensor(b_LNK.contiguous().view(L * N, K), [bn, BLOCK_K], lb)
    tiles = triton.cdiv(M, bm) + L  # a static bound of the experts' row tiles
    launch(_kernel, (tiles * triton.cdiv(N, bn),), da, sa_M.float().contiguous(), db, sb_LN.float().contiguous(), out,
           offs_L.to(torch.int32).contiguous(), N, K, L, tiles, BLOCK_M=bm, BLOCK_N=bn,
           BLOCK_L=max(32, triton.next_power_of_2(L)), GROUP_M=8, STAGES=stages, num_warps=warps)
    return out
