"""Pure index math of the distributed optimizer (no torch.distributed): where each parameter sits in its bucket's
flat buffer, which contiguous slice of every bucket a rank owns, how a flat slice of a parameter maps to rectangular
blocks of the tensor (for checkpoints with global shapes), and which part of the owned state goes to the host.

A bucket's flat buffer holds its parameters one after another, each starting at a multiple of ``ALIGN`` elements
(grouped GEMMs need 16-byte-aligned weights), padded at the end to a multiple of ``ALIGN * group size`` so that it
splits into equal, aligned slices: rank ``r`` of the group owns ``[r * n / size, (r + 1) * n / size)``. This is
Megatron's distributed-optimizer layout (``ParamAndGradBuffer``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

ALIGN = 64  # elements: 128 bytes in bf16, 256 in fp32


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bucket_layout(numels: Sequence[int], group_size: int, align: int = ALIGN) -> tuple[list[int], int]:
    """``(start offset of each parameter, padded buffer length)`` of one bucket."""
    offsets, n = [], 0
    for k in numels:
        n = round_up(n, align)
        offsets.append(n)
        n += k
    return offsets, round_up(max(n, 1), align * group_size)


def owned_slice(total: int, group_size: int, rank: int) -> tuple[int, int]:
    """The slice ``[lo, hi)`` of a bucket buffer of length ``total`` that group rank ``rank`` owns."""
    if total % group_size:
        raise ValueError(f"bucket length {total} is not divisible by the group size {group_size}")
    n = total // group_size
    return rank * n, (rank + 1) * n


@dataclass(frozen=True)
class Range:
    """Elements ``[lo, hi)`` of parameter ``index`` (flattened), at ``[buf_lo, buf_lo + hi - lo)`` of the bucket."""
    index: int
    lo: int
    hi: int
    buf_lo: int

    @property
    def numel(self) -> int:
        return self.hi - self.lo


def owned_ranges(offsets: Sequence[int], numels: Sequence[int], lo: int, hi: int) -> list[Range]:
    """The parts of the bucket's parameters that fall into the owned buffer slice ``[lo, hi)``."""
    out = []
    for i, (start, n) in enumerate(zip(offsets, numels)):
        a, b = max(lo, start), min(hi, start + n)
        if a < b:
            out.append(Range(i, a - start, b - start, a))
    return out


def split_for_host(sizes: Sequence[int], fraction: float) -> list[tuple[int, int]]:
    """How many leading elements of each range (taken in order) go to the host so that ``fraction`` of all the
    elements do: ``[(device part, host part)]`` per range; at most one range is split."""
    total = sum(sizes)
    left = int(round(fraction * total))
    out = []
    for n in sizes:
        host = min(n, left)
        left -= host
        out.append((n - host, host))
    return out


def flat_boxes(shape: Sequence[int], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Split the flat (C-order) range ``[lo, hi)`` of a tensor of ``shape`` into rectangular blocks, each one
    contiguous in the flat order: ``[(offsets, sizes, flat start)]``. At most ``2 * ndim - 1`` blocks."""
    shape = tuple(int(s) for s in shape)
    if lo >= hi:
        return []
    if not shape:
        return [((), (), lo)]
    inner = math.prod(shape[1:])
    first, lo_in = divmod(lo, inner)
    last, hi_in = divmod(hi, inner)

    def row(i: int, a: int, b: int):  # elements [a, b) of index i of dim 0 (shape has >= 2 dims here)
        return [((i, *o), (1, *s), i * inner + f) for o, s, f in flat_boxes(shape[1:], a, b)]

    if first == last:  # within one index of dim 0
        return row(first, lo_in, hi_in)
    out = []
    if lo_in:
        out += row(first, lo_in, inner)
        first += 1
    if last > first:
        out.append(((first, *(0,) * (len(shape) - 1)), (last - first, *shape[1:]), first * inner))
    if hi_in:
        out += row(last, 0, hi_in)
    return out


def unravel(flat: int, shape: Sequence[int]) -> tuple[int, ...]:
    out = []
    for s in reversed(tuple(shape)):
        flat, r = divmod(flat, s)
        out.append(r)
    return tuple(reversed(out))


def intersect(a_off, a_size, b_off, b_size):
    """The intersection of two boxes as ``(offsets, sizes)``, or None when empty."""
    off = tuple(max(x, y) for x, y in zip(a_off, b_off))
    end = tuple(min(x + s, y + t) for x, s, y, t in zip(a_off, a_size, b_off, b_size))
    if any(e <= o for o, e in zip(off, end)):
        return None
    return off, tuple(e - o for o, e in zip(off, end))
