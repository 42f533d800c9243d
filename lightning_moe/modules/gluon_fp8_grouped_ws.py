"""The experts' FP8 forward and dgrad GEMM with fast accumulation, warp-specialized and persistent in Gluon:

    out[m] = sa[m] * sb[e][None, :] * (a[m] @ b[e]^T)     for the rows m of expert e (``offs``: their cumulative ends)

with ``triton_fp8_grouped_mm.grouped_mm(..., fast=True)``'s arguments, tiles, schedule and bits (the same MMAs over K
in the same order into one accumulator, the same epilogue). One program per SM loops over the tiles; a one-warp
loader partition streams their K blocks through the shared-memory stages across tile boundaries, and the MMA warps
(one consumer of two warpgroups on 128 x 256 tiles, or two of one warpgroup on 128 x 128 tiles taking turns) store
each whole tile by TMA from shared memory, asynchronously. A tile cut by its expert's end (the last of an expert
whose rows are not a multiple of 128) is stored with masked pointer stores instead, which never write past the
expert's rows; with ``shift`` (the default at fine-grained experts, ``config_for``) it moves up to end at the
expert's end wherever the expert has a whole tile of rows, and is loaded and stored whole, recomputing some rows of
the tile before it with the same bits. Rows past ``offs[-1]`` are left undefined.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from lightning_moe.modules.gluon_fp8_wgrad import (MAXNREG, WORKER_REGS, _buffers, _mainloop, _store_tile,
                                                   shared_layout, sm_count)
from lightning_moe.modules.triton_fp8_grouped_mm import check_operands
from lightning_moe.modules.triton_launch import launch

BLOCK_K = 128
# (BLOCK_M, BLOCK_N, warps, stages[, consumers[, shift]]): one consumer of 128 x 256 tiles at coarse experts; at up to
# NARROW_ROWS rows per expert two consumers of 128 x 128 tiles, cut tiles shifted (benchmarks/bench_gluon_grouped_ws.py:
# at Qwen3's shapes 1.06-1.19x triton's kernel, balanced and uneven, against 1.03-1.08x for one consumer;
# docs/PERFORMANCE.md, fourth session of 2026-11-27)
CONFIG, NARROW_CONFIG, NARROW_ROWS = (128, 256, 8, 4), (128, 128, 4, 4, 2, 1), 1024
_BK = gl.constexpr(BLOCK_K)


@gluon.jit
def _experts(offs_ptr, L, BLOCK_M: gl.constexpr, BLOCK_L: gl.constexpr, WARPS: gl.constexpr):
    """Once per program: the experts' row ends, the schedule's row tiles up to each expert's last (expert e owns the
    row tiles [cum[e] - tiles[e], cum[e])) and the live row tiles' count. Every warp holds all of them (the layout
    repeats over the warps; BLOCK_L >= 32), so a tile's lookup (``_place``) reduces within a warp. Why: looking each
    tile up from memory put a load's latency (about a microsecond) twice per tile on the MMA warps' path, and once on
    the loader's, against a main loop of 2.4 us at K = 768 (Qwen3's fc2)."""
    ls = gl.arange(0, BLOCK_L, layout=gl.BlockedLayout([BLOCK_L // 32], [32], [WARPS], [0]))
    live = ls < L
    ends = gl.load(offs_ptr + ls, mask=live, other=0)
    starts = gl.load(offs_ptr + ls - 1, mask=live & (ls > 0), other=0)
    tiles = gl.where(live, gl.cdiv(ends - starts, BLOCK_M), 0)
    cum = gl.associative_scan(tiles, 0, _add)
    return ends, cum, gl.sum(tiles, 0)


@gluon.jit
def _order(i, N, TILES, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """Entry ``i`` of the schedule of TILES x cdiv(N, BLOCK_N) tiles in ``triton_fp8_grouped_mm``'s order: (row
    tile, N tile); GROUP_M row tiles share each N tile. A row tile at or past ``_experts``'s count is not live."""
    width = GROUP_M * gl.cdiv(N, BLOCK_N)
    first = (i // width) * GROUP_M
    size = gl.minimum(TILES - first, GROUP_M)
    return first + (i % width) % size, (i % width) // size


@gluon.jit
def _place(t, ends, cum, BLOCK_M: gl.constexpr, BLOCK_L: gl.constexpr, WARPS: gl.constexpr, SHIFT: gl.constexpr):
    """Live row tile ``t``'s (expert, first row, the expert's end) from ``_experts``'s vectors. SHIFT: an expert's
    last tile, cut by its end, moves up to end at it where the expert has BLOCK_M rows or more, so that it is whole
    (TMA loads and stores); it recomputes rows of the tile before it, with the same bits."""
    ls = gl.arange(0, BLOCK_L, layout=gl.BlockedLayout([BLOCK_L // 32], [32], [WARPS], [0]))
    e = gl.sum((cum <= t).to(gl.int32), 0)  # experts wholly before tile t
    end = gl.sum(gl.where(ls == e, ends, 0), 0)
    start = gl.sum(gl.where(ls == e - 1, ends, 0), 0)
    first = gl.sum(gl.where(ls == e, cum, 0), 0) - gl.cdiv(end - start, BLOCK_M)
    row0 = start + (t - first) * BLOCK_M
    if SHIFT:
        row0 = gl.where(end - start >= BLOCK_M, gl.minimum(row0, end - BLOCK_M), row0)
    return e, row0, end


@gluon.jit
def _tile(i, offs_ptr, N, L, TILES, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_L: gl.constexpr,
          GROUP_M: gl.constexpr, WARPS: gl.constexpr, SHIFT: gl.constexpr):
    """Schedule entry ``i``'s (live, expert, first row, the expert's end, N tile): ``_experts``, ``_order`` and
    ``_place`` at once, for a kernel of one tile per program."""
    ends, cum, live_tiles = _experts(offs_ptr, L, BLOCK_M, BLOCK_L, WARPS)
    t, pn = _order(i, N, TILES, BLOCK_N, GROUP_M)
    e, row0, end = _place(t, ends, cum, BLOCK_M, BLOCK_L, WARPS, SHIFT)
    return t < live_tiles, e, row0, end, pn


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _load(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, N, K, L, TILES, BLOCK_M: gl.constexpr,
          BLOCK_N: gl.constexpr, BLOCK_L: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
          SHIFT: gl.constexpr):
    """One warp: the K blocks of this program's live tiles into the stages, as soon as a stage is free."""
    nk = gl.cdiv(K, _BK)
    it = 0
    ends, cum, live_tiles = _experts(offs_ptr, L, BLOCK_M, BLOCK_L, 1)
    for i in range(gl.program_id(0), TILES * gl.cdiv(N, BLOCK_N), gl.num_programs(0)):
        t, pn = _order(i, N, TILES, BLOCK_N, GROUP_M)
        if t < live_tiles:
            e, row0, end = _place(t, ends, cum, BLOCK_M, BLOCK_L, 1, SHIFT)
            for kb in range(nk):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
                mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [row0, kb * _BK], ready.index(s), a_bufs.index(s))
                tma.async_copy_global_to_shared(b_desc, [e * N + pn * BLOCK_N, kb * _BK], ready.index(s),
                                                b_bufs.index(s))
                it += 1


@gluon.jit
def _consume(a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, sa_ptr, sb_ptr, out_ptr, offs_ptr, N, K, L, TILES,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_L: gl.constexpr, GROUP_M: gl.constexpr,
             STAGES: gl.constexpr, CONSUMERS: gl.constexpr, C: gl.constexpr, WARPS: gl.constexpr,
             SHIFT: gl.constexpr):
    """MMA warps, consumer C of CONSUMERS (every CONSUMERS-th live tile; main loops taking turns, as
    ``gluon_fp8_wgrad._consume``), then the scaled tile out: whole tiles by TMA, a tile cut by its expert's end by
    masked stores."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    nk = gl.cdiv(K, _BK)
    it = 0
    j = 0  # live tiles so far
    n = 0  # this consumer's
    ends, cum, live_tiles = _experts(offs_ptr, L, BLOCK_M, BLOCK_L, WARPS)
    for i in range(gl.program_id(0), TILES * gl.cdiv(N, BLOCK_N), gl.num_programs(0)):
        t, pn = _order(i, N, TILES, BLOCK_N, GROUP_M)
        if t < live_tiles:
            if j % CONSUMERS == C:
                e, row0, end = _place(t, ends, cum, BLOCK_M, BLOCK_L, WARPS, SHIFT)
                rm = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma))
                rn = pn * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
                rows, cols = rm < end, rn < N
                # the scales before the main loop: their loads' latency under the MMAs, not after them
                sa = gl.load(sa_ptr + rm, mask=rows, other=0.0)
                sb = gl.load(sb_ptr + e.to(gl.int64) * N + rn, mask=cols, other=0.0)
                acc = _mainloop(a_bufs, b_bufs, ready, empty, order, it, nk, n, BLOCK_M, BLOCK_N, STAGES, CONSUMERS, C,
                                mma)
                n += 1
                res = (acc * gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0)).to(c_desc.dtype)
                if row0 + BLOCK_M <= end:  # a whole tile of the expert's rows: TMA, which clips the columns at N
                    _store_tile(res, c_smem, c_desc, row0, pn * BLOCK_N, C)
                else:  # the expert's last, cut tile: the rows past its end belong to the next expert
                    ptrs = out_ptr + gl.expand_dims(rm.to(gl.int64), 1) * N + gl.expand_dims(rn, 0)
                    gl.store(ptrs, res, mask=gl.expand_dims(rows, 1) & gl.expand_dims(cols, 0))
            it += nk
            j += 1
    tma.store_wait(0)


@gluon.jit
def _worker(a_desc, b_desc, a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, sa_ptr, sb_ptr, out_ptr, offs_ptr,
            N, K, L, TILES, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_L: gl.constexpr,
            GROUP_M: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr, ROLE: gl.constexpr,
            SHIFT: gl.constexpr):
    """The worker partitions (one signature for all): the loader (ROLE 0) or the second consumer (ROLE 1)."""
    if ROLE == 0:
        _load(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, N, K, L, TILES, BLOCK_M, BLOCK_N, BLOCK_L,
              GROUP_M, STAGES, SHIFT)
    else:
        _consume(a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, sa_ptr, sb_ptr, out_ptr, offs_ptr, N, K, L,
                 TILES, BLOCK_M, BLOCK_N, BLOCK_L, GROUP_M, STAGES, 2, 1, WARPS, SHIFT)


@gluon.jit
def _kernel(a_desc, sa_ptr, b_desc, sb_ptr, c_desc, out_ptr, offs_ptr, N, K, L, TILES, BLOCK_M: gl.constexpr,
            BLOCK_N: gl.constexpr, BLOCK_L: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
            CONSUMERS: gl.constexpr, WORKER_REGS: gl.constexpr, SHIFT: gl.constexpr, num_warps: gl.constexpr):
    a_bufs, b_bufs, c_smem, ready, empty, order = _buffers(a_desc, b_desc, c_desc, STAGES, CONSUMERS)
    if CONSUMERS == 1:
        gl.warp_specialize([
            (_consume, (a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, sa_ptr, sb_ptr, out_ptr, offs_ptr, N, K,
                        L, TILES, BLOCK_M, BLOCK_N, BLOCK_L, GROUP_M, STAGES, CONSUMERS, 0, num_warps, SHIFT)),
            (_worker, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, sa_ptr, sb_ptr, out_ptr,
                       offs_ptr, N, K, L, TILES, BLOCK_M, BLOCK_N, BLOCK_L, GROUP_M, STAGES, num_warps, 0, SHIFT)),
        ], [1], [32])
    else:
        gl.warp_specialize([
            (_consume, (a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, sa_ptr, sb_ptr, out_ptr, offs_ptr, N, K,
                        L, TILES, BLOCK_M, BLOCK_N, BLOCK_L, GROUP_M, STAGES, CONSUMERS, 0, num_warps, SHIFT)),
            (_worker, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, sa_ptr, sb_ptr, out_ptr,
                       offs_ptr, N, K, L, TILES, BLOCK_M, BLOCK_N, BLOCK_L, GROUP_M, STAGES, num_warps, 1, SHIFT)),
            (_worker, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, sa_ptr, sb_ptr, out_ptr,
                       offs_ptr, N, K, L, TILES, BLOCK_M, BLOCK_N, BLOCK_L, GROUP_M, STAGES, num_warps, 0, SHIFT)),
        ], [num_warps, 1], [WORKER_REGS, 32])


def narrow(M: int, L: int) -> bool:
    """Whether M rows over L experts are fine-grained: NARROW_ROWS per expert or fewer (host numbers: no sync)."""
    return M <= NARROW_ROWS * L


def config_for(M: int, L: int) -> tuple:
    """The default config for M rows over L experts."""
    return NARROW_CONFIG if narrow(M, L) else CONFIG


def fits(N: int) -> bool:
    """Whether TMA stores the output's rows (16-byte aligned bf16 rows)."""
    return N % 8 == 0


@torch.no_grad()
def grouped_mm(a_MK: torch.Tensor, b_LNK: torch.Tensor, sa_M: torch.Tensor, sb_LN: torch.Tensor,
               offs_L: torch.Tensor, config=None, programs=None) -> torch.Tensor:
    """``triton_fp8_grouped_mm.grouped_mm(..., fast=True)``'s product and bits (its arguments); ``config``:
    (BLOCK_M, BLOCK_N, warps, stages[, consumers[, shift]]), ``config_for``'s by default."""
    M, K, N, L = check_operands(a_MK, b_LNK, sa_M, sb_LN, offs_L)
    out = torch.empty(M, N, device=a_MK.device, dtype=torch.bfloat16)
    if M == 0 or N == 0 or L == 0:
        return out
    bm, bn, warps, stages, *rest = config or config_for(M, L)
    f8 = gl.float8e4nv
    da = TensorDescriptor.from_tensor(a_MK.contiguous(), [bm, BLOCK_K], shared_layout((bm, BLOCK_K), f8))
    db = TensorDescriptor.from_tensor(b_LNK.contiguous().view(L * N, K), [bn, BLOCK_K],
                                      shared_layout((bn, BLOCK_K), f8))
    dc = TensorDescriptor.from_tensor(out, [bm, 64], shared_layout((bm, 64), gl.bfloat16))
    tiles = triton.cdiv(M, bm) + L  # a static bound of the experts' row tiles
    if programs is None:
        programs = sm_count(torch.cuda._get_device_index(a_MK.device, optional=True))
    launch(_kernel, (min(programs, tiles * triton.cdiv(N, bn)),), da, sa_M.float().contiguous(), db,
           sb_LN.float().contiguous(), dc, out, offs_L.to(torch.int32).contiguous(), N, K, L, tiles, BLOCK_M=bm,
           BLOCK_N=bn, BLOCK_L=max(32, triton.next_power_of_2(L)), GROUP_M=8, STAGES=stages,
           CONSUMERS=rest[0] if rest else 1, WORKER_REGS=WORKER_REGS, SHIFT=rest[1] if len(rest) > 1 else 0,
           num_warps=warps, maxnreg=MAXNREG)
    return out
