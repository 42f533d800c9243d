"""The experts' FP8 weight gradient on Hopper's FP8 tensor cores, with the experts' token offsets on the device:

    out[l] (+)= sum over l's tokens t of aT[:, t] bT[:, t]^T, dequantized:
      blockwise   each 128-token block's product times its scales, sa[t][:, None] * sb[t][None, :] (the recipe's
                  128 x 1 tiles, ``triton_fp8_blockwise.tiles(..., wgrad_fp8=True)``), promoted to fp32 per block
                  as DeepGEMM's 1D1D kernels do
      rowwise     the sum times the expert's scales, sa[l][:, None] * sb[l][None, :] (per expert and feature,
                  ``fp8_grouped_kernels``), accumulated in fp32 every 128 tokens (as CUTLASS's non-fast-accumulation
                  FP8 kernels promote) or, with ``fast``, in the tensor cores' own accumulator

aT (K, P) and bT (N, P) are E4M3 with the tokens contiguous (K-major for the MMA, which reduces over them), read by
TMA in 128-token blocks; each expert's tokens start on a 128-token boundary (its padding zero), so no block mixes two
experts. The offsets are read on the device: no host sync, where DeepGEMM's k-grouped FP8 kernel takes them as a host
list on SM 9.0 and ``torch._scaled_grouped_mm`` writes a new bf16 gradient. ``out`` is written (``first``) or added
to (a main grad over micro-batches, ``wgrad_fusion``), in its own dtype.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from lightning_moe.modules.kernels import interpreting, load
from lightning_moe.modules.triton_grouped_wgrad import grouped_tile
from lightning_moe.modules.triton_launch import launch

T = 128  # tokens per block: the blockwise recipe's scale tiles, and the rowwise promotion interval
# which kernel the per-expert wgrad takes by default: "auto" the persistent one when adding into a main grad (where it
# measured 1.06-1.52x the one-tile kernel on an H100 at Mixtral's and Qwen3's expert shapes: docs/PERFORMANCE.md) and
# the one-tile one when writing (where the persistent one measured 0.87-0.99x); "1" / "0" always / never, for
# comparisons
PERSISTENT = os.environ.get("LMOE_FP8_WGRAD_PERSISTENT", "auto")
# the per-expert wgrad with fast accumulation, written, on the warp-specialized Gluon kernel (``gluon_fp8_wgrad``: the
# same bits) where it fits; "0": the triton kernels, for comparisons
GLUON = os.environ.get("LMOE_FP8_GLUON_WGRAD", "1") != "0"


@triton.jit
def _fp8_wgrad_kernel(a_desc, sa_ptr, b_desc, sb_ptr, out_ptr, offs_ptr, K, N, ACC: tl.constexpr,
                      PER_BLOCK: tl.constexpr, FAST: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                      TB: tl.constexpr, GROUP_K: tl.constexpr, STAGES: tl.constexpr):
    e = tl.program_id(1)
    pk, pn = grouped_tile(tl.program_id(0), K, N, BLOCK_K, BLOCK_N, GROUP_K)
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(offs_ptr + e)
    rk = pk * BLOCK_K + tl.arange(0, BLOCK_K)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    o_ptrs = out_ptr + e.to(tl.int64) * K * N + rk[:, None].to(tl.int64) * N + rn[None, :]
    o_mask = (rk[:, None] < K) & (rn[None, :] < N)
    if ACC:
        if end == start:  # nothing to add
            return
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for t0 in tl.range(start, end, TB, num_stages=STAGES):
        a = a_desc.load([pk * BLOCK_K, t0])
        b = b_desc.load([pn * BLOCK_N, t0])
        if PER_BLOCK:
            sa = tl.load(sa_ptr + (t0 // TB) * K + rk, mask=rk < K, other=0.0)
            sb = tl.load(sb_ptr + (t0 // TB) * N + rn, mask=rn < N, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb[None, :]
        elif FAST:
            acc = tl.dot(a, tl.trans(b), acc)
        else:  # the tensor cores' partial sums added into the fp32 accumulator after each block of TB tokens
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=TB)
    if not PER_BLOCK:
        sa = tl.load(sa_ptr + e.to(tl.int64) * K + rk, mask=rk < K, other=0.0)
        sb = tl.load(sb_ptr + e.to(tl.int64) * N + rn, mask=rn < N, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if ACC:
        acc += tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _block_mma(a_desc, b_desc, k0, n0, t0, acc, FAST: tl.constexpr, TB: tl.constexpr):
    """One 128-token block's MMA of the per-expert kernels: ``acc`` plus the block's product, accumulated fast or
    promoted into fp32 after the block (as the one-tile kernel, and CUTLASS's non-fast-accumulation kernels)."""
    a = a_desc.load([k0, t0])
    b = b_desc.load([n0, t0])
    if FAST:
        return tl.dot(a, tl.trans(b), acc)
    return tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=TB)


@triton.jit
def _tile_of(t, offs_ptr, K, N, L, P, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, TB: tl.constexpr,
             GROUP_K: tl.constexpr):
    """Tile ``t`` of all experts' tiles: (expert, K tile, N tile, first token, 128-token blocks, steps). An expert
    without tokens still takes one step, at token P, past the end (TMA fills it with zeros), for its epilogue. Past
    the last tile (after a program's last epilogue) the values are unused: the expert index is clamped for the reads."""
    per_e = tl.cdiv(K, BLOCK_K) * tl.cdiv(N, BLOCK_N)
    e = tl.minimum(t // per_e, L - 1)
    pk, pn = grouped_tile(t % per_e, K, N, BLOCK_K, BLOCK_N, GROUP_K)
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    nk = (tl.load(offs_ptr + e) - start) // TB
    return e, pk, pn, tl.where(nk > 0, start, P), nk, tl.maximum(nk, 1)


@triton.jit
def _fp8_wgrad_persistent_kernel(a_desc, sa_ptr, b_desc, sb_ptr, out_ptr, o_desc, offs_ptr, K, N, L, P,
                                 ACC: tl.constexpr, FAST: tl.constexpr, TMA_OUT: tl.constexpr, BLOCK_K: tl.constexpr,
                                 BLOCK_N: tl.constexpr, TB: tl.constexpr, GROUP_K: tl.constexpr,
                                 STAGES: tl.constexpr):
    """The per-expert (rowwise) wgrad as one flat loop over this program's (tile, 128-token block) steps, tiles
    strided by the number of programs: the loads of a tile's first blocks are issued by the software pipeline while
    the previous tile's epilogue (scales, the fp32 read-add-write) runs, which the one-tile-per-program kernel leaves
    to other resident programs. Same MMAs in the same order per tile: the same bits. That the loads stay pipelined is
    checked on the CPU from the compiled IR (``tests/modules/test_triton_pipelining.py``). ``TMA_OUT``: the output
    tile read and written by TMA through ``o_desc`` ((L, K, N), blocks of (1, BLOCK_K, BLOCK_N)) instead of pointers,
    so the store is asynchronous and the accumulator's layout goes to shared memory once, not through two layout
    conversions."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    tiles = L * tl.cdiv(K, BLOCK_K) * tl.cdiv(N, BLOCK_N)
    steps = 0
    for t in range(pid, tiles, programs):  # scalar pre-pass: this program's steps
        steps += _tile_of(t, offs_ptr, K, N, L, P, BLOCK_K, BLOCK_N, TB, GROUP_K)[5]
    t = pid
    e, pk, pn, start, nk, nsteps = _tile_of(t, offs_ptr, K, N, L, P, BLOCK_K, BLOCK_N, TB, GROUP_K)
    kk = 0
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for _ in tl.range(0, steps, num_stages=STAGES):
        # the next tile, in scalar code of its own ahead of the loads (as triton's loop flattening lays it out): the
        # pipeline can compute the coming steps' coordinates without waiting for this tile's epilogue
        if kk == nsteps:
            t += programs
            e, pk, pn, start, nk, nsteps = _tile_of(t, offs_ptr, K, N, L, P, BLOCK_K, BLOCK_N, TB, GROUP_K)
            kk = 0
        t0 = start + kk * TB
        # the epilogue's condition apart from the step count: the next iteration's branch reads the count, which
        # must not sink into the MMA's pipeline stage with the condition (a value carried back more than one stage
        # keeps triton from pipelining the loop)
        last = kk == nsteps - 1
        kk += 1
        acc = _block_mma(a_desc, b_desc, pk * BLOCK_K, pn * BLOCK_N, t0, acc, FAST, TB)
        # the tile's last block: its epilogue, then the accumulator's reset inside the branch (a reset by a select in
        # every step makes each step wait for its MMA, where the branch lets one MMA stay in flight across steps)
        if last:
            rk = pk * BLOCK_K + tl.arange(0, BLOCK_K)
            rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
            sa = tl.load(sa_ptr + e.to(tl.int64) * K + rk, mask=rk < K, other=0.0)
            sb = tl.load(sb_ptr + e.to(tl.int64) * N + rn, mask=rn < N, other=0.0)
            res = acc * sa[:, None] * sb[None, :]
            # an empty expert: zeros written, or its values stored back as they were (its scales may be anything)
            if TMA_OUT:  # TMA clips the tile at the expert's last row and column
                if ACC:
                    old = o_desc.load([e, pk * BLOCK_K, pn * BLOCK_N]).reshape(BLOCK_K, BLOCK_N).to(tl.float32)
                    res = tl.where(nk > 0, res + old, old)
                else:
                    res = tl.where(nk > 0, res, 0.0)
                o_desc.store([e, pk * BLOCK_K, pn * BLOCK_N],
                             res.to(out_ptr.dtype.element_ty).reshape(1, BLOCK_K, BLOCK_N))
            else:
                o_ptrs = out_ptr + e.to(tl.int64) * K * N + rk[:, None].to(tl.int64) * N + rn[None, :]
                o_mask = (rk[:, None] < K) & (rn[None, :] < N)
                if ACC:
                    old = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
                    res = tl.where(nk > 0, res + old, old)
                else:
                    res = tl.where(nk > 0, res, 0.0)
                tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=o_mask)
            acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)



@triton.jit
def _segment_of(s, e, starts_ptr, ends_ptr, L, P, TB: tl.constexpr):
    """Expert ``e``'s tokens in segment ``s``: (first token, 128-token blocks, steps). An empty one still takes one
    step, at token P, past the end (TMA fills it with zeros), for its epilogue, which then adds nothing."""
    start = tl.load(starts_ptr + s * L + e)
    nk = (tl.load(ends_ptr + s * L + e) - start) // TB
    return tl.where(nk > 0, start, P), nk, tl.maximum(nk, 1)


@triton.jit
def _fp8_wgrad_segments_kernel(a_desc, sa_ptr, b_desc, sb_ptr, out_ptr, starts_ptr, ends_ptr, K, N, L, S, P,
                               ACC: tl.constexpr, FAST: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                               TB: tl.constexpr, GROUP_K: tl.constexpr, STAGES: tl.constexpr):
    """The per-expert (rowwise) wgrad over S segments of tokens (the micro-batches of an optimizer step), each with
    its own per-expert scales: one tile, one flat loop over its expert's blocks of every segment (the pipeline runs
    on across segments), and at each segment's last block its product dequantized and added into an fp32 sum in
    registers that starts from ``out`` (adding) or zero. The sums run in the order of S one-tile kernels, the first
    writing (or adding) and the others adding: the same bits, with ``out`` read and written once."""
    e = tl.program_id(1)
    pk, pn = grouped_tile(tl.program_id(0), K, N, BLOCK_K, BLOCK_N, GROUP_K)
    rk = pk * BLOCK_K + tl.arange(0, BLOCK_K)
    rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    o_ptrs = out_ptr + e.to(tl.int64) * K * N + rk[:, None].to(tl.int64) * N + rn[None, :]
    o_mask = (rk[:, None] < K) & (rn[None, :] < N)
    if ACC:
        total = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    else:
        total = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    steps = 0
    for s in range(S):  # scalar pre-pass: the steps over all segments
        steps += _segment_of(s, e, starts_ptr, ends_ptr, L, P, TB)[2]
    s = 0
    start, nk, nsteps = _segment_of(s, e, starts_ptr, ends_ptr, L, P, TB)
    kk = 0
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for _ in tl.range(0, steps, num_stages=STAGES):
        if kk == nsteps:  # the next segment (as the persistent kernel's next tile)
            s += 1
            start, nk, nsteps = _segment_of(s, e, starts_ptr, ends_ptr, L, P, TB)
            kk = 0
        t0 = start + kk * TB
        last = kk == nsteps - 1
        kk += 1
        acc = _block_mma(a_desc, b_desc, pk * BLOCK_K, pn * BLOCK_N, t0, acc, FAST, TB)
        if last:  # the segment's product with its scales (an empty segment's may be anything: nothing added)
            sa = tl.load(sa_ptr + (s * L + e).to(tl.int64) * K + rk, mask=rk < K, other=0.0)
            sb = tl.load(sb_ptr + (s * L + e).to(tl.int64) * N + rn, mask=rn < N, other=0.0)
            total = tl.where(nk > 0, total + acc * sa[:, None] * sb[None, :], total)
            acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    tl.store(o_ptrs, total.to(out_ptr.dtype.element_ty), mask=o_mask)

# (BLOCK_K, BLOCK_N, warps, stages) per accumulation: the fastest of a sweep on one H100 at the Mixtral and Qwen3
# expert shapes (``benchmarks/bench_fp8_wgrad.py``, docs/PERFORMANCE.md). Larger tiles spill once the per-block
# promotion holds the block's product and the accumulator; the rowwise promotion runs best on one warpgroup.
CONFIGS = {"blockwise": (128, 128, 8, 4), "precise": (128, 128, 4, 3), "fast": (128, 128, 8, 3)}
# the persistent kernel, both accumulations: two warpgroups and four stages (its one program per SM has the room)
PERSISTENT_CONFIG = (128, 128, 8, 4)
# ... and where the experts have few tokens each (at most PERSISTENT_NARROW_TOKENS on average), so that a tile's
# epilogue weighs more against its MMAs: 64 x 128 tiles on one warpgroup, two programs per SM (104 KiB of shared memory
# each), one's MMAs running while the other's epilogue reads, adds and writes. Adding on an H100, against the 128 x 128
# kernel: 1.18-1.43x at 512 and 1,024 tokens per Qwen3 or Mixtral expert, 1.02-1.14x at Qwen3's block (1,024);
# 0.80-1.05x at Mixtral's (2,048), so not there
PERSISTENT_NARROW_CONFIG, PERSISTENT_NARROW_TOKENS = (64, 128, 4, 3), 1024
# with the output by TMA, adding takes two more 64 KiB tiles of shared memory (the old tile's load, the store): three
# stages keep it within Hopper's 227 KiB (sm_90 compile: 229,416 bytes; four stages would need 262,184)
TMA_OUT_CONFIG = (128, 128, 8, 3)


def use_persistent(per_expert: bool, first: bool) -> bool:
    """The default kernel choice (``PERSISTENT``; per-128-token-block scales have only the one-tile kernel)."""
    if not per_expert:
        return False
    if PERSISTENT not in ("auto", "0", "1"):
        raise ValueError(f"LMOE_FP8_WGRAD_PERSISTENT={PERSISTENT!r}: want auto, 1 or 0")
    return PERSISTENT == "1" or (PERSISTENT == "auto" and not first)


def persistent_config(tokens: int, experts: int) -> tuple:
    """The persistent kernel's default (config, programs per SM) for ``tokens`` padded tokens over ``experts``."""
    if experts and tokens <= PERSISTENT_NARROW_TOKENS * experts:
        return PERSISTENT_NARROW_CONFIG, 2
    return PERSISTENT_CONFIG, 1


def config_for(per_expert: bool, fast: bool) -> tuple:
    return CONFIGS["blockwise" if not per_expert else "fast" if fast else "precise"]


@torch.no_grad()
def wgrad_into(out_LKN: torch.Tensor, a: tuple, b: tuple, offs_L: torch.Tensor, first: bool,
               per_expert: bool = False, fast: bool = False, config: Optional[tuple] = None,
               persistent: Optional[bool] = None, programs: Optional[int] = None, tma_out: bool = False) -> None:
    """``out[l] = a_l^T b_l`` (``first``) or ``+=``, dequantized. ``a = (aT (K, P) E4M3, sa)``, ``b`` likewise with
    N; ``offs``: the experts' cumulative token ends, multiples of 128. The scales dequantize (the reciprocals of the
    quantization scales): (P / 128, K) per 128-token block (blockwise), or with ``per_expert`` (L, K) (rowwise;
    ``fast``: no fp32 promotion within the expert's sum). ``config``: (BLOCK_K, BLOCK_N, warps, stages), by default
    ``config_for``'s (``persistent_config``'s for the persistent kernel). ``persistent`` (per expert only):
    ``programs`` programs (default: ``persistent_config``'s number per SM, or one per SM with a config given) each
    loop over strided tiles, overlapping a tile's epilogue with the next tile's loads; the same bits. ``None``:
    ``use_persistent`` (``tma_out`` implies it). ``tma_out`` (persistent only; on an H100 0.89-1.02x the pointers'
    rate when adding, 0.82-0.99x writing, so not the default): the output tiles read and written by TMA, where
    ``out``'s rows are 16-byte aligned."""
    if (GLUON and per_expert and fast and first and config is None and persistent is None and not tma_out
            and out_LKN.is_cuda and not interpreting()):
        gw = load("gluon_fp8_wgrad", out_LKN)
        if gw is not None and out_LKN.dim() == 3 and gw.fits(*out_LKN.shape[1:], out_LKN):
            check_args(out_LKN, aT=a[0], sa=a[1], bT=b[0], sb=b[1], per_expert=True)
            if a[0].shape[1] and out_LKN.shape[0]:
                gw.wgrad(out_LKN, a[0], a[1], b[0], b[1], offs_L)
            else:
                out_LKN.zero_()
            return
    if persistent is None:
        persistent = tma_out or use_persistent(per_expert, first)
    if persistent and not per_expert:
        raise ValueError("FP8 wgrad: the persistent kernel takes per-expert (rowwise) scales only")
    if tma_out and not persistent:
        raise ValueError("FP8 wgrad: tma_out is an option of the persistent kernel (persistent=True)")
    (aT, sa), (bT, sb) = a, b
    L, K, N, P = check_args(out_LKN, aT, sa, bT, sb, per_expert)
    per_block = not per_expert
    if tma_out and ((N * out_LKN.element_size()) % 16 or out_LKN.data_ptr() % 16):
        raise ValueError(f"FP8 wgrad: tma_out needs out's rows 16-byte aligned (N = {N} of {out_LKN.dtype}, data "
                         f"at {out_LKN.data_ptr() % 16} mod 16); use tma_out=False")
    if P == 0 or L == 0:  # no tokens here (a rank that got none): nothing to add, zeros to write
        if first:
            out_LKN.zero_()
        return
    per_sm = 1
    if config is None and persistent and not tma_out:
        config, per_sm = persistent_config(P, L)
    bk, bn, warps, stages = config or (TMA_OUT_CONFIG if tma_out else config_for(per_expert, fast))
    da = TensorDescriptor.from_tensor(aT.contiguous(), [bk, T])
    db = TensorDescriptor.from_tensor(bT.contiguous(), [bn, T])
    if persistent:
        if programs is None:
            programs = per_sm * torch.cuda.get_device_properties(out_LKN.device).multi_processor_count \
                if out_LKN.is_cuda else 4
        do = TensorDescriptor.from_tensor(out_LKN, [1, bk, bn]) if tma_out else out_LKN
        launch(_fp8_wgrad_persistent_kernel, (programs,), da, sa.float().contiguous(), db, sb.float().contiguous(),
               out_LKN, do, offs_L.to(torch.int32), K, N, L, P, ACC=not first, FAST=fast, TMA_OUT=tma_out, BLOCK_K=bk,
               BLOCK_N=bn, TB=T, GROUP_K=8, STAGES=stages, num_warps=warps)
        return
    grid = (triton.cdiv(K, bk) * triton.cdiv(N, bn), L)
    launch(_fp8_wgrad_kernel, grid, da, sa.float().contiguous(), db, sb.float().contiguous(), out_LKN,
           offs_L.to(torch.int32), K, N, ACC=not first, PER_BLOCK=per_block, FAST=fast, BLOCK_K=bk, BLOCK_N=bn, TB=T,
           GROUP_K=8, STAGES=stages, num_warps=warps)


def check_args(out_LKN, aT, sa, bT, sb, per_expert: bool) -> tuple:
    """(L, K, N, P) of ``wgrad_into``'s arguments; ValueError where they do not fit together."""
    if out_LKN.dim() != 3:
        raise ValueError(f"FP8 wgrad: out {tuple(out_LKN.shape)}: want (L, K, N), one (K, N) gradient per expert")
    L, K, N = out_LKN.shape
    P = aT.shape[1]
    want_sa, want_sb = ((L, K), (L, N)) if per_expert else ((P // T, K), (P // T, N))
    if (not out_LKN.is_contiguous() or aT.shape != (K, P) or bT.shape != (N, P) or P % T
            or sa.shape != want_sa or sb.shape != want_sb):
        raise ValueError(f"FP8 wgrad: out {tuple(out_LKN.shape)} (contiguous), aT {tuple(aT.shape)}, bT "
                         f"{tuple(bT.shape)}, scales {tuple(sa.shape)}, {tuple(sb.shape)}: want (L, K, N), (K, P), "
                         f"(N, P) with P a multiple of {T}, and scales per 128-token block ((P / {T}, K), "
                         f"(P / {T}, N)) or per expert ((L, K), (L, N))")
    return L, K, N, P


# the segments kernel: two fp32 tiles live across its loop (the running sum and the segment's accumulator). Measured on
# an H100 at bench_model's micro-batches (benchmarks/bench_fp8_wgrad_deferred.py): 64 x 128 tiles on one warpgroup,
# 3 stages, fastest or level with the precise accumulation at Mixtral's and Qwen3's experts, and with the fast one at
# Qwen3's (1,024 tokens per expert over the step); 128 x 128 on two warpgroups with the fast one at Mixtral's (4,096),
# where the narrow tiles ran 0.76-0.93x. Neither spills (sm_90 compile, written)
SEGMENTS_CONFIG, SEGMENTS_NARROW_CONFIG, SEGMENTS_WIDE_TOKENS = (128, 128, 8, 4), (64, 128, 4, 3), 2048


def segments_config(tokens: int, experts: int, fast: bool) -> tuple:
    """The segments kernel's default config for ``tokens`` tokens (all segments') over ``experts``."""
    wide = fast and experts and tokens > SEGMENTS_WIDE_TOKENS * experts
    return SEGMENTS_CONFIG if wide else SEGMENTS_NARROW_CONFIG


@torch.no_grad()
def wgrad_segments_into(out_LKN: torch.Tensor, a: tuple, b: tuple, starts_SL: torch.Tensor, ends_SL: torch.Tensor,
                        first: bool, fast: bool = False, config: Optional[tuple] = None) -> None:
    """``out[l] = sum over segments s of a_{s,l}^T b_{s,l}`` (``first``) or ``+=``, each segment's product
    dequantized with its own per-expert scales: the micro-batches of an optimizer step in one pass over ``out``
    (``fp8_grouped_kernels``' deferred wgrad), with the bits of one ``wgrad_into(..., per_expert=True)`` per segment
    in order. ``a = (aT (K, P), sa (S, L, K))``, ``b`` likewise with N: every segment's tokens side by side;
    ``starts``/``ends`` (S, L): each segment's expert's tokens, [start, end) in P, on 128-token boundaries.
    ``config``: (BLOCK_K, BLOCK_N, warps, stages), by default ``segments_config``'s."""
    (aT, sa), (bT, sb) = a, b
    L, K, N, S, P = check_segments(out_LKN, aT, sa, bT, sb, starts_SL, ends_SL)
    if P == 0 or L == 0 or S == 0:
        if first:
            out_LKN.zero_()
        return
    bk, bn, warps, stages = config or segments_config(P, L, fast)
    # column slices of wider buffers (the held operands' arenas) as they are: TMA takes any 16-byte row stride
    da = TensorDescriptor.from_tensor(_rows_16(aT), [bk, T])
    db = TensorDescriptor.from_tensor(_rows_16(bT), [bn, T])
    grid = (triton.cdiv(K, bk) * triton.cdiv(N, bn), L)
    launch(_fp8_wgrad_segments_kernel, grid, da, sa.float().contiguous(), db, sb.float().contiguous(), out_LKN,
           starts_SL.to(torch.int32).contiguous(), ends_SL.to(torch.int32).contiguous(), K, N, L, S, P, ACC=not first,
           FAST=fast, BLOCK_K=bk, BLOCK_N=bn, TB=T, GROUP_K=8, STAGES=stages, num_warps=warps)


def check_segments(out_LKN, aT, sa, bT, sb, starts_SL, ends_SL) -> tuple:
    """(L, K, N, S, P) of the wgrad over segments' arguments; ValueError where they do not fit together."""
    if out_LKN.dim() != 3:
        raise ValueError(f"FP8 wgrad: out {tuple(out_LKN.shape)}: want (L, K, N), one (K, N) gradient per expert")
    L, K, N = out_LKN.shape
    S, P = starts_SL.shape[0], aT.shape[1]
    if (not out_LKN.is_contiguous() or aT.shape != (K, P) or bT.shape != (N, P) or P % T
            or sa.shape != (S, L, K) or sb.shape != (S, L, N) or starts_SL.shape != (S, L)
            or ends_SL.shape != (S, L)):
        raise ValueError(f"FP8 wgrad over segments: out {tuple(out_LKN.shape)} (contiguous), aT {tuple(aT.shape)}, "
                         f"bT {tuple(bT.shape)}, scales {tuple(sa.shape)}, {tuple(sb.shape)}, starts "
                         f"{tuple(starts_SL.shape)}, ends {tuple(ends_SL.shape)}: want (L, K, N), (K, P), (N, P) with "
                         f"P a multiple of {T}, scales (S, L, K) and (S, L, N), starts and ends (S, L)")
    return L, K, N, S, P


def _rows_16(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where TMA reads it (unit column stride, rows on 16-byte multiples), else a contiguous copy."""
    ok = t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
    return t if ok else t.contiguous()
