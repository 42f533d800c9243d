"""The experts' FP8 weight gradient with fast accumulation, written (not added), warp-specialized in Gluon:

    out[l] = sa[l][:, None] * sb[l][None, :] * (aT_l @ bT_l^T)      over expert l's tokens (``offs``: their ends)

with ``triton_fp8_wgrad.wgrad_into(..., per_expert=True, fast=True)``'s arguments and bits for ``first=True``.

Why: the wgrad reduces over only the expert's tokens (2,048 at Mixtral's block, 1,024 at Qwen3's), so a tile's MMAs
are short against its pipeline fill and epilogue, and the triton kernels ran at 860-1,100 TFLOP/s against the
forward's 1,370. Here one program per SM loops over tiles (persistent) and a one-warp loader partition streams every
tile's 128-token blocks through the shared-memory stages without waiting for epilogues; the MMA warps write each tile
through shared memory by asynchronous TMA stores (in pieces of 128-byte rows, two buffers). With two consumers (one
warpgroup each, alternate tiles, main loops taking turns) one's epilogue also runs under the other's MMAs.

The MMAs run in the same order with the same accumulator as the triton kernel (one fp32 accumulator per tile, the
tensor cores' own accumulation) and the epilogue multiplies by the same scales in the same order: the same bits.
Each expert's tokens start on a 128-token boundary (``triton_fp8_wgrad``'s layout); an expert without tokens gets
zeros. Output rows are tiled 128 at a time per expert, so K must be a multiple of 128 (``fits``).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from lightning_moe.modules.triton_launch import launch

T = 128  # tokens per block (the wgrad layout's alignment)
# (BLOCK_K, BLOCK_N, warps, stages[, consumers]): one consumer of two warpgroups on 128 x 256 tiles (64 accumulator rows
# per warpgroup), or two consumers of one warpgroup each on 128 x 128 tiles taking turns (one's epilogue under the
# other's MMAs). Measured on an H100 (docs/PERFORMANCE.md): the two consumers win where the experts have at most
# NARROW_TOKENS tokens each (Qwen3's block, the models' micro-batches) and wherever the output is fp32 (a main grad:
# twice the epilogue's bytes), the one consumer writing bf16 at Mixtral's block (2,048)
CONFIG, NARROW_CONFIG, NARROW_TOKENS = (128, 256, 8, 4), (128, 128, 4, 5, 2), 1024
MAXNREG = 168  # 12 warps (8 + the loader's warpgroup) x 32 x 168 fits the register file; the MMA warps get 240
WORKER_REGS = 232  # two consumers of 4 warps (``config``'s fifth entry): the second's registers (the first gets 248)
LOADER_REGS = gl.constexpr(32)  # the loader warp's registers (it holds the experts' ends: ``_ends``)
_T = gl.constexpr(T)


def config_for(tokens: int, experts: int, out_bytes: int = 2) -> tuple:
    """The default config for ``tokens`` padded tokens over ``experts`` into ``out_bytes``-byte values (host numbers:
    no sync)."""
    return NARROW_CONFIG if out_bytes > 2 or tokens <= (NARROW_TOKENS + T) * experts else CONFIG


@functools.lru_cache(maxsize=None)
def shared_layout(block: tuple, dtype) -> gl.NVMMASharedLayout:
    """The NVMMA shared-memory layout of a TMA block, built once per block and dtype (an immutable value: building it
    at every launch cost host time on the models' many small GEMMs)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    """The persistent kernels' program count: the GPU's SMs."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def fits(K: int, N: int, out: torch.Tensor) -> bool:
    """Whether the kernel takes this output: K rows tile by 128 per expert, and TMA stores its rows."""
    return K % CONFIG[0] == 0 and (N * out.element_size()) % 16 == 0 and out.data_ptr() % 16 == 0


@gluon.jit
def _ends(offs_ptr, L, BLOCK_L: gl.constexpr, WARPS: gl.constexpr):
    """Once per program: the experts' token ends, every warp holding all of them (the layout repeats over the warps;
    BLOCK_L >= 32), so that a tile's bounds (``_tile``) reduce within a warp instead of loading: two loads' latency
    per tile, on the MMA warps' path and the loader's, against a main loop of about 3 us at 1,024 tokens."""
    ls = gl.arange(0, BLOCK_L, layout=gl.BlockedLayout([BLOCK_L // 32], [32], [WARPS], [0]))
    return gl.load(offs_ptr + ls, mask=ls < L, other=0)


@gluon.jit
def _tile(t, ends, K, N, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_K: gl.constexpr,
          BLOCK_L: gl.constexpr, WARPS: gl.constexpr):
    """Tile ``t``: (expert, K tile, N tile, first token, 128-token blocks); GROUP_K K tiles in a row share each N
    tile while it is in L2 (``triton_grouped_wgrad.grouped_tile``'s order). ``ends``: ``_ends``'s."""
    tiles_k, tiles_n = gl.cdiv(K, BLOCK_K), gl.cdiv(N, BLOCK_N)
    per_e = tiles_k * tiles_n
    e = t // per_e
    r = t % per_e
    width = GROUP_K * tiles_n
    first_k = (r // width) * GROUP_K
    size = gl.minimum(tiles_k - first_k, GROUP_K)
    pk = first_k + (r % width) % size
    pn = (r % width) // size
    ls = gl.arange(0, BLOCK_L, layout=gl.BlockedLayout([BLOCK_L // 32], [32], [WARPS], [0]))
    start = gl.sum(gl.where(ls == e - 1, ends, 0), 0)
    nk = (gl.sum(gl.where(ls == e, ends, 0), 0) - start) // _T
    return e, pk, pn, start, nk


@gluon.jit
def _load(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, K, N, L, tiles, BLOCK_K: gl.constexpr,
          BLOCK_N: gl.constexpr, GROUP_K: gl.constexpr, STAGES: gl.constexpr, BLOCK_L: gl.constexpr):
    """One warp: every block of this program's tiles into the stages, as soon as a stage is free."""
    it = 0
    ends = _ends(offs_ptr, L, BLOCK_L, 1)
    for t in range(gl.program_id(0), tiles, gl.num_programs(0)):
        e, pk, pn, start, nk = _tile(t, ends, K, N, BLOCK_K, BLOCK_N, GROUP_K, BLOCK_L, 1)
        for kb in range(nk):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
            mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [pk * BLOCK_K, start + kb * _T], ready.index(s), a_bufs.index(s))
            tma.async_copy_global_to_shared(b_desc, [pn * BLOCK_N, start + kb * _T], ready.index(s), b_bufs.index(s))
            it += 1


@gluon.jit
def _split_n(x, PIECES: gl.constexpr):
    """``x`` (M, N) as PIECES column pieces of N / PIECES, left to right (register renaming: in the MMA layout the
    high column bits are a thread's registers)."""
    xs = (x, )
    for _ in gl.static_range(PIECES.bit_length() - 1):
        nxt = ()
        for j in gl.static_range(len(xs)):
            y = xs[j]
            nxt += y.reshape(y.shape[0], 2, y.shape[1] // 2).permute(0, 2, 1).split()
        xs = nxt
    return xs


@gluon.jit
def _store_tile(res, c_smem, c_desc, row, col, C: gl.constexpr):
    """``res`` to ``c_desc`` at (row, col) by TMA, in pieces of the descriptor's width through consumer C's two
    shared-memory buffers (a piece is written while the one before is stored; TMA clips the columns at the end)."""
    PIECES: gl.constexpr = res.shape[1] // c_desc.block_type.shape[1]
    pieces = _split_n(res, PIECES)
    for i in gl.static_range(PIECES):
        buf = c_smem.index(2 * C + i % 2)
        tma.store_wait(1)  # the store that last read this buffer is done
        buf.store(pieces[i])
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [row, col + i * c_desc.block_type.shape[1]], buf)


@gluon.jit
def _mainloop(a_bufs, b_bufs, ready, empty, order, it, nk, n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, CONSUMERS: gl.constexpr, C: gl.constexpr, mma: gl.constexpr):
    """Consumer C's ``n``-th tile: its ``nk`` blocks from ring position ``it``, one MMA in flight, each stage released
    once its MMA is done; with two consumers, after the other's main loop of the tile before is past its last wait,
    and telling the other once past its own. Returns the fp32 accumulator."""
    if CONSUMERS == 2:
        if C == 0:
            mbarrier.wait(order.index(0), (n - 1) & 1, pred=n > 0)
        else:
            mbarrier.wait(order.index(1), n & 1)
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
    for kb in range(nk):
        s = (it + kb) % STAGES
        mbarrier.wait(ready.index(s), ((it + kb) // STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        mbarrier.arrive(empty.index((it + kb + STAGES - 1) % STAGES), pred=kb > 0)  # the previous block's
    if CONSUMERS == 2:
        mbarrier.arrive(order.index(1 - C))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    mbarrier.arrive(empty.index((it + nk + STAGES - 1) % STAGES), pred=nk > 0)
    return acc


@gluon.jit
def _consume(a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, sa_ptr, sb_ptr, offs_ptr, K, N, L, tiles,
             BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_K: gl.constexpr, STAGES: gl.constexpr,
             CONSUMERS: gl.constexpr, C: gl.constexpr, WARPS: gl.constexpr, BLOCK_L: gl.constexpr):
    """MMA warps (consumer C of CONSUMERS, taking every CONSUMERS-th of the program's tiles): each tile's MMAs with
    one in flight (a stage is released once its MMA is done), then the scaled tile out through shared memory by TMA,
    the stores left in flight into the next tile. Two consumers alternate tiles: one's epilogue runs while the
    other's MMAs do. Their main loops take turns (``order``: each waits until the other has waited for its tile's
    last block), so that no consumer waits on a stage's barrier more than one phase ahead of the loads: a parity
    wait cannot tell phases two apart."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                  instr_shape=[16, BLOCK_N, 32])
    it = 0  # the program's blocks before this tile (the stage ring's position)
    j = 0
    n = 0  # this consumer's tiles so far
    ends = _ends(offs_ptr, L, BLOCK_L, WARPS)
    for t in range(gl.program_id(0), tiles, gl.num_programs(0)):
        e, pk, pn, start, nk = _tile(t, ends, K, N, BLOCK_K, BLOCK_N, GROUP_K, BLOCK_L, WARPS)
        if j % CONSUMERS == C:
            rk = pk * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, mma))
            rn = pn * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
            # the scales before the main loop: their loads' latency under the MMAs
            sa = gl.load(sa_ptr + e.to(gl.int64) * K + rk, mask=rk < K, other=0.0)
            sb = gl.load(sb_ptr + e.to(gl.int64) * N + rn, mask=rn < N, other=0.0)
            acc = _mainloop(a_bufs, b_bufs, ready, empty, order, it, nk, n, BLOCK_K, BLOCK_N, STAGES, CONSUMERS, C, mma)
            n += 1
            res = acc * gl.expand_dims(sa, 1) * gl.expand_dims(sb, 0)
            res = gl.where(nk > 0, res, 0.0)  # an expert without tokens: zeros (its scales may be anything)
            _store_tile(res.to(c_desc.dtype), c_smem, c_desc, e * K + pk * BLOCK_K, pn * BLOCK_N, C)
        it += nk
        j += 1
    tma.store_wait(0)


@gluon.jit
def _worker(a_desc, b_desc, a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, sa_ptr, sb_ptr, offs_ptr, K, N,
            L, tiles, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_K: gl.constexpr, STAGES: gl.constexpr,
            WARPS: gl.constexpr, ROLE: gl.constexpr, BLOCK_L: gl.constexpr):
    """The worker partitions (one signature for all): the loader (ROLE 0) or the second consumer (ROLE 1)."""
    if ROLE == 0:
        _load(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offs_ptr, K, N, L, tiles, BLOCK_K, BLOCK_N, GROUP_K,
              STAGES, BLOCK_L)
    else:
        _consume(a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, sa_ptr, sb_ptr, offs_ptr, K, N, L, tiles,
                 BLOCK_K, BLOCK_N, GROUP_K, STAGES, 2, 1, WARPS, BLOCK_L)


@gluon.jit
def _buffers(a_desc, b_desc, c_desc, STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """The warp-specialized kernels' shared memory: the operands' stages with their ready and empty barriers, each
    consumer's two output buffers, and the consumers' turn barriers."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [2 * CONSUMERS] + c_desc.block_type.shape, c_desc.layout)
    ready, empty, order = barriers(STAGES)
    return a_bufs, b_bufs, c_smem, ready, empty, order


@gluon.jit
def barriers(STAGES: gl.constexpr):
    """The stages' ready and empty barriers and the consumers' turn barriers, initialized."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(order.index(i), count=1)
    return ready, empty, order


@gluon.jit
def _kernel(a_desc, sa_ptr, b_desc, sb_ptr, c_desc, offs_ptr, K, N, L, BLOCK_K: gl.constexpr,
            BLOCK_N: gl.constexpr, GROUP_K: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
            WORKER_REGS: gl.constexpr, BLOCK_L: gl.constexpr, num_warps: gl.constexpr):
    tiles = L * gl.cdiv(K, BLOCK_K) * gl.cdiv(N, BLOCK_N)
    a_bufs, b_bufs, c_smem, ready, empty, order = _buffers(a_desc, b_desc, c_desc, STAGES, CONSUMERS)
    if CONSUMERS == 1:
        gl.warp_specialize([
            (_consume, (a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, sa_ptr, sb_ptr, offs_ptr, K, N, L, tiles,
                        BLOCK_K, BLOCK_N, GROUP_K, STAGES, CONSUMERS, 0, num_warps, BLOCK_L)),
            (_worker, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, sa_ptr, sb_ptr, offs_ptr,
                       K, N, L, tiles, BLOCK_K, BLOCK_N, GROUP_K, STAGES, num_warps, 0, BLOCK_L)),
        ], [1], [LOADER_REGS])
    else:
        gl.warp_specialize([
            (_consume, (a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, sa_ptr, sb_ptr, offs_ptr, K, N, L, tiles,
                        BLOCK_K, BLOCK_N, GROUP_K, STAGES, CONSUMERS, 0, num_warps, BLOCK_L)),
            (_worker, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, sa_ptr, sb_ptr, offs_ptr,
                       K, N, L, tiles, BLOCK_K, BLOCK_N, GROUP_K, STAGES, num_warps, 1, BLOCK_L)),
            (_worker, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, order, c_smem, c_desc, sa_ptr, sb_ptr, offs_ptr,
                       K, N, L, tiles, BLOCK_K, BLOCK_N, GROUP_K, STAGES, num_warps, 0, BLOCK_L)),
        ], [num_warps, 1], [WORKER_REGS, LOADER_REGS])


def descriptors(aT, bT, out_LKN, bk: int, bn: int):
    """The TMA descriptors: aT (K, P) and bT (N, P) in (rows, 128-token) blocks, out as (L * K, N) in
    (BLOCK_K, 128 bytes) pieces."""
    f8 = gl.float8e4nv
    da = TensorDescriptor.from_tensor(aT, [bk, T], shared_layout((bk, T), f8))
    db = TensorDescriptor.from_tensor(bT, [bn, T], shared_layout((bn, T), f8))
    dt = {torch.bfloat16: gl.bfloat16, torch.float32: gl.float32, torch.float16: gl.float16}[out_LKN.dtype]
    split = min(bn, 128 // out_LKN.element_size())
    L, K, N = out_LKN.shape
    dc = TensorDescriptor.from_tensor(out_LKN.view(L * K, N), [bk, split], shared_layout((bk, split), dt))
    return da, db, dc


@torch.no_grad()
def wgrad(out_LKN: torch.Tensor, aT: torch.Tensor, sa: torch.Tensor, bT: torch.Tensor, sb: torch.Tensor,
          offs_L: torch.Tensor, config=None, programs=None) -> None:
    """``out[l] = a_l^T b_l`` dequantized by ``sa`` (L, K) and ``sb`` (L, N), fast accumulation: the arguments of
    ``triton_fp8_wgrad.wgrad_into`` (checked there) with ``per_expert=True, fast=True, first=True``."""
    L, K, N = out_LKN.shape
    bk, bn, warps, stages, *rest = config or config_for(aT.shape[1], L, out_LKN.element_size())
    consumers = rest[0] if rest else 1
    da, db, dc = descriptors(aT.contiguous(), bT.contiguous(), out_LKN, bk, bn)
    tiles = L * triton.cdiv(K, bk) * triton.cdiv(N, bn)
    if programs is None:
        programs = sm_count(torch.cuda._get_device_index(out_LKN.device, optional=True))
    launch(_kernel, (min(programs, tiles),), da, sa.float().contiguous(), db, sb.float().contiguous(), dc,
           offs_L.to(torch.int32).contiguous(), K, N, L, BLOCK_K=bk, BLOCK_N=bn, GROUP_K=8, STAGES=stages,
           CONSUMERS=consumers, WORKER_REGS=WORKER_REGS, BLOCK_L=max(32, triton.next_power_of_2(L)), num_warps=warps,
           maxnreg=MAXNREG)
