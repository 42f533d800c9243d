"""An experiment, not used by the library: the experts' FP8 grouped GEMM with the precise accumulation, in Gluon.

``triton_fp8_grouped_mm`` promotes the tensor cores' partial sums into an fp32 accumulator after every 128 of K
(``max_num_imprecise_acc=128``, CUTLASS's points). In its shipped config (128 x 128 tiles on one warpgroup) triton
emits the promotion's adds between the MMAs of a step, and ptxas then serializes every MMA (its warning C7514: a wait
after each ``wgmma``; see docs/PERFORMANCE.md). Gluon exposes the asynchronous MMA and its waits, so here block k's
MMA runs while block k - 1's partial sum is added: each block's MMA starts from zero (``use_acc=False``), one wait
keeps the newer MMA in flight, and two blocks per iteration keep any MMA from being in flight across the loop's back
edge (a loop-carried accumulator in flight is copied, and ptxas serializes every MMA again). The same MMAs, promoted
at the same points in the same order: the bits of the Triton kernel (``bench_gluon_precise.py`` checks them).

Same arguments, layout and tile schedule as ``triton_fp8_grouped_mm.grouped_mm``; ``fast`` keeps one accumulator.
"""
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _load(a_desc, b_desc, bars, a_bufs, b_bufs, row0, col0, kb, nk_pad, STAGES: gl.constexpr):
    """Block ``kb`` of K (its A and B tiles) into stage ``kb % STAGES``, if the loop will read it."""
    s = kb % STAGES
    pred = kb < nk_pad
    mbarrier.expect(bars.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [row0, kb * a_desc.block_type.shape[1]], bars.index(s), a_bufs.index(s),
                                    pred)
    tma.async_copy_global_to_shared(b_desc, [col0, kb * b_desc.block_type.shape[1]], bars.index(s), b_bufs.index(s),
                                    pred)


@gluon.jit
def _kernel(a_desc, sa_ptr, b_desc, sb_ptr, out_ptr, offs_ptr, N, K, L, TILES,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_L: gl.constexpr,
            GROUP_M: gl.constexpr, STAGES: gl.constexpr, FAST: gl.constexpr, U: gl.constexpr, num_warps: gl.constexpr):
    # the grouped tile order: GROUP_M row tiles share each column tile
    pid = gl.program_id(0)
    tiles_n = gl.cdiv(N, BLOCK_N)
    width = GROUP_M * tiles_n
    first = (pid // width) * GROUP_M
    size = gl.minimum(TILES - first, GROUP_M)
    t = first + (pid % width) % size
    pn = (pid % width) // size
    sched: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    ls = gl.arange(0, BLOCK_L, layout=sched)
    live = ls < L
    ends = gl.load(offs_ptr + ls, mask=live, other=0)
    starts = gl.load(offs_ptr + ls - 1, mask=live & (ls > 0), other=0)
    tiles = gl.where(live, gl.cdiv(ends - starts, BLOCK_M), 0)
    cum = gl.associative_scan(tiles, 0, _add)
    e = gl.sum((cum <= t).to(gl.int32), 0)
    if e >= L:
        return
    mine = ls == e
    start = gl.sum(gl.where(mine, starts, 0), 0)
    end = gl.sum(gl.where(mine, ends, 0), 0)
    row0 = start + (t - gl.sum(gl.where(mine, cum - tiles, 0), 0)) * BLOCK_M
    col0 = e * N + pn * BLOCK_N

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    nk = gl.cdiv(K, BLOCK_K)
    nk_pad = gl.cdiv(nk, U) * U  # the blocks the loop reads (those past K are TMA's zeros)
    for i in gl.static_range(STAGES - 1):
        _load(a_desc, b_desc, bars, a_bufs, b_bufs, row0, col0, i, nk_pad, STAGES)

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
    if FAST:
        for ki in range(nk):
            s = ki % STAGES
            mbarrier.wait(bars.index(s), (ki // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            _load(a_desc, b_desc, bars, a_bufs, b_bufs, row0, col0, ki + STAGES - 1, nk_pad, STAGES)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    else:
        # U blocks of K per iteration, so that no MMA is in flight across the loop's back edge (a loop-carried
        # accumulator in flight would be copied, and ptxas serializes every MMA then). Blocks past K are zeros (TMA
        # fills them), adding +0 to the accumulator.
        zero = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
        for k0 in range(0, nk, U):
            s = k0 % STAGES
            mbarrier.wait(bars.index(s), (k0 // STAGES) & 1)
            prev = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), zero, use_acc=False,
                                 is_async=True)
            # block k0 - 1's stage is free (waited for at the end of the last iteration): block k0 + STAGES - 1
            _load(a_desc, b_desc, bars, a_bufs, b_bufs, row0, col0, k0 + STAGES - 1, nk_pad, STAGES)
            for j in gl.static_range(1, U):
                ki = k0 + j
                s = ki % STAGES
                mbarrier.wait(bars.index(s), (ki // STAGES) & 1)
                cur = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), zero, use_acc=False,
                                    is_async=True)
                p = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))
                acc = acc + p
                # block ki - 1's stage is free: refill it STAGES - 1 blocks ahead
                _load(a_desc, b_desc, bars, a_bufs, b_bufs, row0, col0, ki + STAGES - 1, nk_pad, STAGES)
                prev = cur
            acc = acc + warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    rm = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
    rn = pn * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    rows, cols = rm < end, rn < N
    sa = gl.load(sa_ptr + rm, mask=rows, other=0.0)
    sb = gl.load(sb_ptr + e.to(gl.int64) * N + rn, mask=cols, other=0.0)
    out = acc * gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0)
    ptrs = out_ptr + gl.expand_dims(rm.to(gl.int64), 1) * N + gl.expand_dims(rn, 0)
    gl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(rows, 1) & gl.expand_dims(cols, 0))


def grouped_mm(a_MK: torch.Tensor, b_LNK: torch.Tensor, sa_M: torch.Tensor, sb_LN: torch.Tensor,
               offs_L: torch.Tensor, fast: bool = False, config: tuple = (128, 128, 8, 4), unroll: int = 2):
    """``triton_fp8_grouped_mm.grouped_mm``'s product. ``config``: (BLOCK_M, BLOCK_N, warps, stages); ``unroll``: the
    blocks of K per iteration of the precise loop (2: the fewest that keep the MMAs unserialized)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    M, K = a_MK.shape
    L, N, _ = b_LNK.shape
    bm, bn, warps, stages = config
    out = torch.empty(M, N, device=a_MK.device, dtype=torch.bfloat16)
    la = gl.NVMMASharedLayout.get_default_for([bm, 128], gl.float8e4nv)
    lb = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv)
    da = TensorDescriptor.from_tensor(a_MK.contiguous(), [bm, 128], la)
    db = TensorDescriptor.from_tensor(b_LNK.contiguous().view(L * N, K), [bn, 128], lb)
    tiles = triton.cdiv(M, bm) + L
    _kernel[(tiles * triton.cdiv(N, bn),)](da, sa_M.float().contiguous(), db, sb_LN.float().contiguous(), out,
                                           offs_L.to(torch.int32).contiguous(), N, K, L, tiles, BLOCK_M=bm,
                                           BLOCK_N=bn, BLOCK_K=128, BLOCK_L=max(16, triton.next_power_of_2(L)),
                                           GROUP_M=8, STAGES=stages, FAST=fast, U=unroll, num_warps=warps)
    return out
