"""The experts' FP8 wgrad with the precise accumulation, in Gluon (triton's lower-level language):
``triton_fp8_wgrad.wgrad_segments_into(..., fast=False)``'s arguments and bits,

    out[l] (+)= sum over segments s of (sum over s's 128-token blocks of l: aT_blk bT_blk^T) * sa[s, l][:, None]
                                                                                          * sb[s, l][None, :]

each 128-token block's product promoted into an fp32 accumulator, as CUTLASS's non-fast-accumulation kernels do. In
triton the promotion's add reads the block's MMA registers inside the software pipeline, and ptxas then injects a
wait for every MMA (its info C7517; docs/PERFORMANCE.md): the precise wgrad ran at 0.78-0.87x the fast one's rate.
As in ``gluon_fp8_grouped_mm``, each block's MMA here starts from zero and runs while the previous block's partial sum
is added, two blocks per loop iteration so that no MMA is in flight across the loop's back edge. The running sum over
segments lives in shared memory (the registers hold the accumulator and two partial sums), read and written once per
segment; ``out`` is read (adding) and written once. The same MMAs, promoted and dequantized at the same points in the
same order: the same bits.

A segment with no tokens of expert l still takes one step, at token P (TMA's zeros), and adds nothing; an odd number
of steps takes one more such step, which adds zeros to the accumulator after its last segment.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from lightning_moe.modules.triton_fp8_wgrad import T, _rows_16, check_segments

CONFIG = (128, 128, 8, 4)  # (BLOCK_K, BLOCK_N, warps, stages): two warpgroups of 64 rows each
UNROLL = 4  # steps per loop iteration: the MMAs drain once per iteration
_T = gl.constexpr(T)


@gluon.jit
def _tile(pid, K, N, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_K: gl.constexpr):
    """``triton_grouped_wgrad.grouped_tile``: GROUP_K tiles along K share each N tile while it is in L2."""
    tiles_k = gl.cdiv(K, BLOCK_K)
    width = GROUP_K * gl.cdiv(N, BLOCK_N)
    first_k = (pid // width) * GROUP_K
    size = gl.minimum(tiles_k - first_k, GROUP_K)
    return first_k + (pid % width) % size, (pid % width) // size


@gluon.jit
def _pick(v, si, s):
    """``v[s]`` of a per-segment vector that every thread holds whole (the reduction stays in the thread)."""
    return gl.sum(gl.where(si == s, v, 0), 0)


@gluon.jit
def _advance(s, kk, start, nk, nsteps, si, firsts, nks, nsteps_s):
    """The cursor's next step: the next block of the segment, or the next segment's first (past the last segment:
    zero steps, never reached again)."""
    kk += 1
    if kk == nsteps:
        s += 1
        start, nk, nsteps = _pick(firsts, si, s), _pick(nks, si, s), _pick(nsteps_s, si, s)
        kk = 0
    return s, kk, start, nk, nsteps


@gluon.jit
def _load(a_desc, b_desc, bars, a_bufs, b_bufs, k0, n0, t0, j, steps_pad, STAGES: gl.constexpr):
    """Step ``j``'s tiles (token ``t0``) into stage ``j % STAGES``, if the loop will read them."""
    st = j % STAGES
    pred = j < steps_pad
    mbarrier.expect(bars.index(st), a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [k0, t0], bars.index(st), a_bufs.index(st), pred)
    tma.async_copy_global_to_shared(b_desc, [n0, t0], bars.index(st), b_bufs.index(st), pred)


@gluon.jit
def _mma(bars, a_bufs, b_bufs, zero, j, STAGES: gl.constexpr):
    """Step ``j``'s product from zero, asynchronous, once its tiles have landed."""
    st = j % STAGES
    mbarrier.wait(bars.index(st), (j // STAGES) & 1)
    return warpgroup_mma(a_bufs.index(st), b_bufs.index(st).permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _fold(total, acc, sa_s, sb_s, s, nk, mma: gl.constexpr):
    """A segment's end: its product dequantized (its scales from shared memory) and added into the running sum;
    nothing for an empty segment."""
    if nk > 0:
        sa = sa_s.index(s).load(gl.SliceLayout(1, mma))
        sb = sb_s.index(s).load(gl.SliceLayout(0, mma))
        run = total.load(mma)
        total.store(run + acc * gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0))


@gluon.jit
def _out_tile(out_ptr, e, K, N, k0, n0, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, rows: gl.constexpr):
    """Expert ``e``'s output tile at (k0, n0): pointers and mask in the ``rows`` layout."""
    rk = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, rows))
    rn = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, rows))
    ptrs = out_ptr + e.to(gl.int64) * K * N + gl.expand_dims(rk.to(gl.int64), 1) * N + gl.expand_dims(rn, 0)
    return ptrs, gl.expand_dims(rk < K, 1) & gl.expand_dims(rn < N, 0)


@gluon.jit
def _kernel(a_desc, sa_ptr, b_desc, sb_ptr, out_ptr, starts_ptr, ends_ptr, K, N, L, S, P, ACC: gl.constexpr,
            BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_S: gl.constexpr, GROUP_K: gl.constexpr,
            STAGES: gl.constexpr, UNROLL: gl.constexpr, num_warps: gl.constexpr):
    e = gl.program_id(1)
    pk, pn = _tile(gl.program_id(0), K, N, BLOCK_K, BLOCK_N, GROUP_K)
    k0, n0 = pk * BLOCK_K, pn * BLOCK_N
    # every segment's tokens of expert e, in registers that each thread holds whole: the cursors below move between
    # segments without waiting for memory. A segment without tokens takes one step at token P (TMA's zeros)
    segs: gl.constexpr = gl.BlockedLayout([BLOCK_S], [32], [num_warps], [0])
    si = gl.arange(0, BLOCK_S, layout=segs)
    live = si < S
    st = gl.load(starts_ptr + si * L + e, mask=live, other=0)
    nks = (gl.load(ends_ptr + si * L + e, mask=live, other=0) - st) // _T
    firsts = gl.where(nks > 0, st, P)
    nsteps_s = gl.where(live, gl.maximum(nks, 1), 0)
    steps = gl.sum(nsteps_s, 0)
    steps_pad = gl.cdiv(steps, UNROLL) * UNROLL  # UNROLL per iteration; the extra ones read past P (zeros)
    # every segment's scales of this tile in shared memory: a fold reads them without waiting for global memory
    per_seg: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # one segment's row, indexed by segment
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    rk = k0 + gl.arange(0, BLOCK_K, layout=vec)
    rn = n0 + gl.arange(0, BLOCK_N, layout=vec)
    sa_s = gl.allocate_shared_memory(gl.float32, [BLOCK_S, BLOCK_K], per_seg)
    sb_s = gl.allocate_shared_memory(gl.float32, [BLOCK_S, BLOCK_N], per_seg)
    for i in gl.static_range(BLOCK_S):
        row = (gl.minimum(i, S - 1) * L + e).to(gl.int64)  # past S: never read
        sa_s.index(i).store(gl.load(sa_ptr + row * K + rk, mask=rk < K, other=0.0))
        sb_s.index(i).store(gl.load(sb_ptr + row * N + rn, mask=rn < N, other=0.0))
    # the running sum in shared memory, from out (adding) or zero, read and written in 16-byte rows
    TN: gl.constexpr = BLOCK_N // 4 if BLOCK_N // 4 < 32 else 32
    rows: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TN, TN], [num_warps, 1], [1, 0])
    if ACC:  # read in another layout than the store's: the compiler then cannot keep the store's pointers live
        # across the loop as the same values (100-odd registers, and spills)
        rows2: gl.constexpr = gl.BlockedLayout([2, 4], [32 // TN, TN], [num_warps, 1], [1, 0])
        o_ptrs, o_mask = _out_tile(out_ptr, e, K, N, k0, n0, BLOCK_K, BLOCK_N, rows2)
        first = gl.load(o_ptrs, mask=o_mask, other=0.0).to(gl.float32)
    else:
        first = gl.zeros((BLOCK_K, BLOCK_N), dtype=gl.float32, layout=rows)
    # 32-byte vectors swizzled by row: the MMA layout's fragments (eight rows of a warp's access each in their own
    # vector) and the 16-byte rows both read and write without bank conflicts (unswizzled, eight rows 512 bytes apart
    # share their banks)
    total = gl.allocate_shared_memory(gl.float32, [BLOCK_K, BLOCK_N], gl.SwizzledSharedLayout(8, 1, 8, [1, 0]),
                                      first)

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    # two cursors over (segment, block): the loads' runs STAGES - 1 steps ahead of the MMAs'
    ls, lk = 0, 0
    lstart, lnk, lsteps = _pick(firsts, si, 0), _pick(nks, si, 0), _pick(nsteps_s, si, 0)
    for j in range(STAGES - 1):
        _load(a_desc, b_desc, bars, a_bufs, b_bufs, k0, n0, gl.where(j < steps, lstart + lk * _T, P), j, steps_pad,
              STAGES)
        ls, lk, lstart, lnk, lsteps = _advance(ls, lk, lstart, lnk, lsteps, si, firsts, nks, nsteps_s)
    ms, mk = 0, 0
    mnk, msteps = _pick(nks, si, 0), _pick(nsteps_s, si, 0)
    mstart = 0  # unused by the MMAs' cursor
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    acc = gl.zeros((BLOCK_K, BLOCK_N), dtype=gl.float32, layout=mma)
    zero = gl.zeros((BLOCK_K, BLOCK_N), dtype=gl.float32, layout=mma)
    gl.thread_barrier()  # the scales and the running sum's first value are in shared memory for every thread
    for j in range(0, steps_pad, UNROLL):
        prev = _mma(bars, a_bufs, b_bufs, zero, j, STAGES)
        # step j - 1's stage is free (its MMA was waited for at the end of the last iteration)
        jl = j + STAGES - 1
        _load(a_desc, b_desc, bars, a_bufs, b_bufs, k0, n0, gl.where(jl < steps, lstart + lk * _T, P), jl,
              steps_pad, STAGES)
        ls, lk, lstart, lnk, lsteps = _advance(ls, lk, lstart, lnk, lsteps, si, firsts, nks, nsteps_s)
        for u in gl.static_range(1, UNROLL + 1):
            if u < UNROLL:
                nxt = _mma(bars, a_bufs, b_bufs, zero, j + u, STAGES)
                done = warpgroup_mma_wait(num_outstanding=1, deps=(prev,))  # while step j + u multiplies
            else:  # the iteration's last: no MMA in flight across the loop's back edge
                done = warpgroup_mma_wait(num_outstanding=0, deps=(prev,))
            acc = acc + done
            if (mk == msteps - 1) & (j + u - 1 < steps):  # step j + u - 1 ends its segment (an extra step: none)
                _fold(total, acc, sa_s, sb_s, ms, mnk, mma)
                acc = gl.zeros((BLOCK_K, BLOCK_N), dtype=gl.float32, layout=mma)
            ms, mk, mstart, mnk, msteps = _advance(ms, mk, mstart, mnk, msteps, si, firsts, nks, nsteps_s)
            if u < UNROLL:  # step j + u - 1's stage is free
                jl = j + u - 1 + STAGES
                _load(a_desc, b_desc, bars, a_bufs, b_bufs, k0, n0, gl.where(jl < steps, lstart + lk * _T, P), jl,
                      steps_pad, STAGES)
                ls, lk, lstart, lnk, lsteps = _advance(ls, lk, lstart, lnk, lsteps, si, firsts, nks, nsteps_s)
                prev = nxt
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    gl.thread_barrier()  # every segment's fold is in shared memory
    o_ptrs, o_mask = _out_tile(out_ptr, e, K, N, k0, n0, BLOCK_K, BLOCK_N, rows)  # not held across the loop
    gl.store(o_ptrs, total.load(rows).to(out_ptr.dtype.element_ty), mask=o_mask)


MAX_SEGMENTS = 32  # their scales stay in shared memory beside the pipeline (1 KiB each at 128 x 128 tiles)
_SHARED = 232448  # Hopper's shared memory per block


def _stages(bk: int, bn: int, stages: int, block_s: int) -> int:
    """``stages``, fewer where the pipeline, the running sum and the scales would not fit in shared memory."""
    fixed = 4 * bk * bn + 4 * block_s * (bk + bn) + 1024  # the running sum, the scales, barriers and slack
    while stages > 2 and fixed + stages * T * (bk + bn) > _SHARED:
        stages -= 1
    return stages


@torch.no_grad()
def wgrad_segments_into(out_LKN: torch.Tensor, a: tuple, b: tuple, starts_SL: torch.Tensor, ends_SL: torch.Tensor,
                        first: bool, config: Optional[tuple] = None, unroll: int = UNROLL) -> None:
    """``triton_fp8_wgrad.wgrad_segments_into(..., fast=False)``'s result and bits (its arguments, at most
    ``MAX_SEGMENTS`` segments; ``config``: (BLOCK_K, BLOCK_N, warps, stages), fewer stages where they would not fit)."""
    (aT, sa), (bT, sb) = a, b
    L, K, N, S, P = check_segments(out_LKN, aT, sa, bT, sb, starts_SL, ends_SL)
    if S > MAX_SEGMENTS:
        raise ValueError(f"gluon_fp8_wgrad: {S} segments; at most {MAX_SEGMENTS} (their scales stay in shared "
                         f"memory): use triton_fp8_wgrad.wgrad_segments_into")
    if P == 0 or L == 0 or S == 0:
        if first:
            out_LKN.zero_()
        return
    bk, bn, warps, stages = config or CONFIG
    block_s = max(2, triton.next_power_of_2(S))
    la = gl.NVMMASharedLayout.get_default_for([bk, T], gl.float8e4nv)
    lb = gl.NVMMASharedLayout.get_default_for([bn, T], gl.float8e4nv)
    da = TensorDescriptor.from_tensor(_rows_16(aT), [bk, T], la)
    db = TensorDescriptor.from_tensor(_rows_16(bT), [bn, T], lb)
    grid = (triton.cdiv(K, bk) * triton.cdiv(N, bn), L)
    _kernel[grid](da, sa.float().contiguous(), db, sb.float().contiguous(), out_LKN,
                  starts_SL.to(torch.int32).contiguous(), ends_SL.to(torch.int32).contiguous(), K, N, L, S, P,
                  ACC=not first, BLOCK_K=bk, BLOCK_N=bn, BLOCK_S=block_s, GROUP_K=8,
                  STAGES=_stages(bk, bn, stages, block_s), UNROLL=unroll, num_warps=warps)
