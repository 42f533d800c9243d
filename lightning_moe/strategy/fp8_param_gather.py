"""FP8 parameter all-gather (Megatron's ``--fp8-param-gather``): the distributed optimizer's weight all-gather sends
the weights of the FP8 GEMMs as E4M3 bytes, one per element instead of bf16's two.

After the step each rank holds the new bf16 weights of its slice of every bucket. For the buckets with FP8 weights:

1. ``reduce_amaxes``: each rank takes the amax of its slice of each FP8 weight per scale block of the recipe
   (``Blocks``: one block per weight or per expert for tensorwise, 128 x 128 tiles for blockwise). They are
   max-reduced over each bucket group, then over TP / ETP where those split a tensorwise weight, as the GEMMs reduce
   them: one all-reduce per group for all buckets, before any gather;
2. ``start``: each rank quantizes its slice of a bucket with those scales into one byte chunk (the bf16 bytes of the
   bucket's other parameters, then the FP8 bytes); the chunks, padded to the largest, are all-gathered;
3. ``finish`` (before the bucket's first use): every chunk is unpacked, bf16 bytes copied and FP8 ones dequantized
   (``q / scale``) into the bf16 weights, and the amaxes are published (``WeightAmaxes``) to the FP8 GEMMs, which
   quantize with them instead of taking them again. They get the gathered bytes back exactly: an E4M3 value divided
   by its scale and rounded to bf16 (8 significant bits) stays within 2^-8 of it, far inside half an E4M3 step (at
   least 1/30 of the value). The dequantized weight's own amax is the published one too (the amax was a bf16 value,
   and its element comes back as itself), so a GEMM that takes it anew gets the same scale.

A step's numbers are thus those of FP8 training without it, bit for bit. Between steps the model's weights hold their
FP8 values; the fp32 main params keep the full ones (checkpoints store those), and
``ShardedOptimizer.restore_weights`` writes them back into the model when training ends.

Shapes: a weight is seen as an (R, C) row-major matrix: a dense weight as (N, K), the experts' (L, K, N) as
(L * K, N).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from lightning_moe.modules.fp8 import BLOCK, FORMATS, abs_amax, scale_of
from lightning_moe.modules.kernels import load
from lightning_moe.strategy.comm import all_gather_flat
from lightning_moe.strategy.flat_shards import owned_ranges, owned_slice, round_up

RECIPES = ("tensorwise", "blockwise")  # transpose-invariant weight scales: one FP8 copy serves fprop and dgrad
FMT = "e4m3"  # every recipe's weights


@dataclass(frozen=True)
class Blocks:
    """An (R, C) weight with scale blocks of h x w elements."""
    R: int
    C: int
    h: int
    w: int

    @property
    def grid(self) -> tuple[int, int]:
        return self.R // self.h, self.C // self.w


def weight_blocks(shape: tuple, recipe: str, grouped: bool) -> Blocks:
    """The scale blocks the recipe gives a weight: as the GEMMs quantize it (``fp8_linear``, ``fp8_grouped``)."""
    if recipe not in RECIPES:
        raise ValueError(f"FP8 parameter all-gather: recipe {recipe!r} has no single FP8 copy of a weight; valid: "
                         f"{', '.join(RECIPES)}")
    if grouped:
        L, K, N = shape
        R, C, hw = L * K, N, (K, N)  # one scale per expert
    else:
        R, C = shape
        hw = (R, C)
    return Blocks(R, C, *(hw if recipe == "tensorwise" else (BLOCK, BLOCK)))


def _pieces(b: Blocks, lo: int, hi: int) -> list[tuple[int, int, int, int]]:
    """Elements ``[lo, hi)`` of the flattened weight as rectangles (r0, r1, c0, c1), in order: a partial first row,
    whole rows that stay within one block row or cover whole block rows, a partial last row."""
    out = []
    r, c = divmod(lo, b.C)
    if c:
        end = min(b.C, c + hi - lo)
        out.append((r, r + 1, c, end))
        lo += end - c
        r += 1
    if lo >= hi:
        return out
    r_end = r + (hi - lo) // b.C  # whole rows [r, r_end)
    while r < r_end:
        if r % b.h or r_end - r < b.h:
            nxt = min(r_end, (r // b.h + 1) * b.h)
        else:
            nxt = r + (r_end - r) // b.h * b.h
        out.append((r, nxt, 0, b.C))
        r = nxt
    if hi > r_end * b.C:
        out.append((r_end, r_end + 1, 0, hi - r_end * b.C))
    return out


def _piece_view(x: torch.Tensor, b: Blocks, p: tuple) -> torch.Tensor:
    """The piece's elements (a flat slice of ``x``) shaped for broadcasting with ``_piece_scales``."""
    r0, r1, c0, c1 = p
    return x.view(r1 - r0, b.C // b.w, b.w) if c1 - c0 == b.C else x


def _piece_scales(s_G: torch.Tensor, b: Blocks, p: tuple) -> torch.Tensor:
    """The grid values ``s_G`` at each element of the piece, broadcastable with ``_piece_view``."""
    r0, r1, c0, c1 = p
    if c1 - c0 == b.C:
        rows = torch.arange(r0, r1, device=s_G.device) // b.h
        return s_G[rows].unsqueeze(2)
    return s_G[r0 // b.h, torch.arange(c0, c1, device=s_G.device) // b.w]


def _kernels(t: torch.Tensor):
    """``triton_block_quant`` where it runs for ``t``: Triton stores E4M3 from SM 8.9 on (emulated FP8 runs below)."""
    tk = load("triton_block_quant", t)
    if tk is not None and t.is_cuda and torch.cuda.get_device_capability(t.device) < (8, 9):
        return None
    return tk


def _rows_on_kernel(tk, b: Blocks, p: tuple) -> bool:
    """Whether piece ``p`` is whole rows that the Triton kernels take in single-block tiles."""
    return tk is not None and p[3] - p[2] == b.C and tk.tiles_fit(p[1] - p[0], p[0], b.C, b.h, b.w)


def local_amax(x: torch.Tensor, b: Blocks, lo: int, hi: int, amax_G: torch.Tensor) -> None:
    """Max ``|x|`` (elements ``[lo, hi)`` of the flattened weight) into the grid ``amax_G`` per scale block."""
    tk = _kernels(x)
    at = 0
    for p in _pieces(b, lo, hi):
        r0, r1, c0, c1 = p
        n, nr, gw = (r1 - r0) * (c1 - c0), r1 - r0, b.C // b.w
        piece = x[at:at + n]
        at += n
        if _rows_on_kernel(tk, b, p):
            tk.rows_amax(piece, amax_G, r0, b.C, b.h, b.w)
        elif c1 - c0 == b.C and r0 % b.h == 0 and nr % b.h == 0:  # whole block rows
            g0, nb = r0 // b.h, nr // b.h
            a = abs_amax(piece.view(nb, b.h, gw, b.w), (1, 3)).view(nb, gw)
            amax_G[g0:g0 + nb] = torch.maximum(amax_G[g0:g0 + nb], a)
        elif c1 - c0 == b.C:  # whole rows within one block row
            amax_G[r0 // b.h] = torch.maximum(amax_G[r0 // b.h], abs_amax(piece.view(nr, gw, b.w), (0, 2)).view(gw))
        else:  # part of one row
            cols = torch.arange(c0, c1, device=x.device) // b.w
            amax_G[r0 // b.h].scatter_reduce_(0, cols, piece.abs().float(), "amax", include_self=True)


def quantize_into(q: torch.Tensor, x: torch.Tensor, b: Blocks, lo: int, hi: int, s_G: torch.Tensor) -> None:
    """``q`` (E4M3, flat) = ``x`` (elements ``[lo, hi)`` of the weight) quantized with the block scales ``s_G``:
    saturated, rounded to nearest, as ``fp8.quantize``. One pass on the Triton kernels."""
    tk = _kernels(x)
    dtype, fmax = FORMATS[FMT]
    at = 0
    for p in _pieces(b, lo, hi):
        n = (p[1] - p[0]) * (p[3] - p[2])
        if _rows_on_kernel(tk, b, p):
            tk.rows_quantize(q[at:at + n], x[at:at + n], s_G, p[0], b.C, b.h, b.w)
        elif tk is not None:
            tk.quantize_slice(q[at:at + n], x[at:at + n], s_G, p[0] * b.C + p[2], b.C, b.h, b.w)
        else:
            v = (_piece_view(x[at:at + n], b, p).float() * _piece_scales(s_G, b, p)).clamp(-fmax, fmax)
            q[at:at + n].copy_(v.to(dtype).reshape(-1))
        at += n


def dequantize_into(out: torch.Tensor, q: torch.Tensor, b: Blocks, lo: int, hi: int, s_G: torch.Tensor,
                    table: Optional[torch.Tensor] = None) -> None:
    """``out`` (the weight's dtype, flat) = ``q / scale``, rounded to ``out``'s dtype, as ``fp8.dequantize``.
    ``table``: the blocks' ``triton_block_quant.dequant_table`` for ``out``'s dtype, if made already."""
    tk = _kernels(q)
    if tk is not None and table is None:
        table = tk.dequant_table(s_G, out.dtype)
    at = 0
    for p in _pieces(b, lo, hi):
        n = (p[1] - p[0]) * (p[3] - p[2])
        if _rows_on_kernel(tk, b, p):
            tk.rows_dequantize(out[at:at + n], q[at:at + n], table, p[0], b.C, b.h, b.w)
        elif tk is not None:
            tk.dequantize_slice(out[at:at + n], q[at:at + n], table, p[0] * b.C + p[2], b.C, b.h, b.w)
        else:
            v = _piece_view(q[at:at + n], b, p).float() / _piece_scales(s_G, b, p)
            out[at:at + n].copy_(v.reshape(-1))
        at += n


@dataclass
class FP8Weight:
    """A weight of an FP8 GEMM whose all-gather runs in FP8."""
    param: torch.nn.Parameter
    blocks: Blocks
    group: Optional[dist.ProcessGroup] = None  # TP / ETP ranks that split a tensorwise weight: its amax spans them


class WeightAmaxes:
    """Each FP8-gathered weight's block amaxes for its current (dequantized) values, by storage: the FP8 GEMMs
    quantize with these (``FP8Spec.weight_amax``) instead of taking them again (a pass over the weight, and an
    all-reduce over TP for tensorwise ones). The optimizer empties it before it rewrites the weights; an entry is also
    dropped once the weight or its bucket was written in place since (their version counters), e.g. by a callback.
    Either way the GEMMs then take the amaxes from the weights, which give the same values for the gathered ones."""

    def __init__(self):
        self._by_ptr: dict[int, tuple] = {}

    def get(self, w: torch.Tensor) -> Optional[torch.Tensor]:
        hit = self._by_ptr.get(w.data_ptr()) if self._by_ptr else None
        if hit is None:
            return None
        amax_G, version, flat, flat_version = hit
        if w._version != version or flat._version != flat_version:
            del self._by_ptr[w.data_ptr()]
            return None
        return amax_G

    def set(self, w: torch.Tensor, amax_G: torch.Tensor, flat: torch.Tensor) -> None:
        """``w``'s amaxes, valid while neither ``w`` nor the flat buffer that holds it is written."""
        self._by_ptr[w.data_ptr()] = (amax_G, w._version, flat, flat._version)

    def clear(self) -> None:
        self._by_ptr.clear()


@dataclass
class _Seg:
    index: int  # the parameter's position in the bucket
    lo: int  # elements of the flattened parameter
    hi: int
    buf_lo: int  # its place in the bucket's flat weights
    at: int  # byte offset in its rank's chunk
    fp8: bool


@dataclass
class BucketPlan:
    """How one bucket's weights travel: each group rank's chunk of bf16 and FP8 segments."""
    params: list
    fp8: dict  # bucket position -> FP8Weight
    segs: list  # per group rank: its segments
    chunk: int  # bytes per rank, padded
    group: Optional[dist.ProcessGroup]
    amax: dict = field(default_factory=dict)  # bucket position -> this step's reduced amax grid
    out: Optional[torch.Tensor] = None  # the gathered chunks until unpacked

    @property
    def fp8_elements(self) -> int:
        return sum(s.hi - s.lo for segs in self.segs for s in segs if s.fp8)


def plan_bucket(params: list, offsets: list, total: int, world: int, fp8: dict, elem: int,
                group: Optional[dist.ProcessGroup]) -> BucketPlan:
    """``fp8``: bucket position -> FP8Weight. ``elem``: bytes per element of the bucket's weights."""
    numels = [p.numel() for p in params]
    segs, sizes = [], []
    for r in range(world):
        ranges = owned_ranges(offsets, numels, *owned_slice(total, world, r))
        raw = [g for g in ranges if g.index not in fp8]
        low = [g for g in ranges if g.index in fp8]
        mine, at = [], 0
        for g in raw:  # 16-bit values first: their offsets stay even
            mine.append(_Seg(g.index, g.lo, g.hi, g.buf_lo, at, False))
            at += g.numel * elem
        for g in low:
            mine.append(_Seg(g.index, g.lo, g.hi, g.buf_lo, at, True))
            at += g.numel
        segs.append(mine)
        sizes.append(at)
    return BucketPlan(params, fp8, segs, round_up(max(max(sizes), 1), 16), group)


def reduce_amaxes(plans: list, weights: list, ranks: list) -> None:
    """This step's amax grids of the FP8 weights of every bucket in ``plans`` (their flat ``weights``, this rank's
    position ``ranks`` in each group): local, then max-reduced in one all-reduce per bucket group and one per TP / ETP
    group, before any bucket's all-gather starts (an all-reduce queued behind a bucket's gather on the same
    communicator would hold the next bucket's quantization until that gather ends). No host sync."""
    grids = []
    for plan, w, me in zip(plans, weights, ranks):
        mine = {i: torch.zeros(plan.fp8[i].blocks.grid, dtype=torch.float32, device=w.device) for i in sorted(plan.fp8)}
        for s in plan.segs[me]:
            if s.fp8:
                local_amax(w[s.buf_lo:s.buf_lo + s.hi - s.lo], plan.fp8[s.index].blocks, s.lo, s.hi, mine[s.index])
        grids.append(mine)
    # the same groups in the same order on every rank (bucket order); then TP / ETP, where it splits a tensorwise
    # weight: its amax spans the whole weight, as the GEMMs reduce it
    by_group: dict = {}
    for k, plan in enumerate(plans):
        by_group.setdefault(plan.group, []).extend((k, i) for i in grids[k])
    by_extra: dict = {}
    for k, plan in enumerate(plans):
        for i in grids[k]:
            if plan.fp8[i].group is not None:
                by_extra.setdefault(plan.fp8[i].group, []).append((k, i))
    for groups in (by_group, by_extra):
        for group, members in groups.items():
            flat = torch.cat([grids[k][i].reshape(-1) for k, i in members])
            if group is not None:
                dist.all_reduce(flat, dist.ReduceOp.MAX, group=group)
            at = 0
            for k, i in members:
                n = grids[k][i].numel()
                grids[k][i] = flat[at:at + n].view(grids[k][i].shape)
                at += n
    for plan, mine in zip(plans, grids):
        plan.amax = mine


def start(plan: BucketPlan, weights: torch.Tensor, me: int, world: int):
    """Pack this rank's chunk (with the amaxes of ``reduce_amaxes``) and launch the all-gather; returns its work
    handle."""
    out = torch.zeros(world * plan.chunk, dtype=torch.uint8, device=weights.device)
    mine = out[me * plan.chunk:(me + 1) * plan.chunk]
    elem = weights.element_size()
    for s in plan.segs[me]:
        n = s.hi - s.lo
        src = weights[s.buf_lo:s.buf_lo + n]
        if s.fp8:
            fp8 = plan.fp8[s.index]
            quantize_into(mine[s.at:s.at + n].view(FORMATS[FMT][0]), src, fp8.blocks, s.lo, s.hi,
                          scale_of(plan.amax[s.index], FMT))
        else:
            mine[s.at:s.at + n * elem].copy_(src.view(torch.uint8))
    plan.out = out
    return all_gather_flat(out, mine, plan.group)


def finish(plan: BucketPlan, weights: torch.Tensor, amaxes: WeightAmaxes) -> None:
    """After the all-gather: every rank's chunk into the flat weights; the amaxes published for the GEMMs."""
    out, plan.out = plan.out, None
    if out.is_cuda:  # made on the offload side stream where the bucket has host slots: freed after this stream's use
        stream = torch.cuda.current_stream(out.device)
        for t in (out, *plan.amax.values()):
            t.record_stream(stream)
    elem, dtype = weights.element_size(), weights.dtype
    scales = {i: scale_of(a, FMT) for i, a in plan.amax.items()}
    tk = _kernels(weights)
    tables = {i: tk.dequant_table(s, dtype) for i, s in scales.items()} if tk is not None else {}
    for r, segs in enumerate(plan.segs):
        chunk = out[r * plan.chunk:(r + 1) * plan.chunk]
        for s in segs:
            n = s.hi - s.lo
            dst = weights[s.buf_lo:s.buf_lo + n]
            if s.fp8:
                dequantize_into(dst, chunk[s.at:s.at + n].view(FORMATS[FMT][0]), plan.fp8[s.index].blocks, s.lo,
                                s.hi, scales[s.index], tables.get(s.index))
            else:
                dst.copy_(chunk[s.at:s.at + n * elem].view(dtype))
    for i, a in plan.amax.items():
        amaxes.set(plan.params[i], a, weights)
