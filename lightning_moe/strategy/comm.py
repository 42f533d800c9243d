"""Differentiable collectives along dim 0. Each is a no-op on a group of size 1 (``group is None``).

Variable-size gather/scatter are written with ``all_to_all_single`` so they run the same on gloo and NCCL.
Split sizes are host ints: callers get them from one device->host copy per layer (see the dispatchers).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist


# torch 2.13 renamed all_gather_into_tensor (the old name warns); torch 2.11 has only the old one
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group) -> torch.Tensor:
    """Rows ``in_splits[j]`` go to rank j; rows ``out_splits[j]`` arrive from rank j, in rank order."""
    if group is None:
        return x
    return _AllToAll.apply(x, list(out_splits), list(in_splits), group)


def all_gather_v(x: torch.Tensor, sizes: Sequence[int], group) -> torch.Tensor:
    """Concatenate every rank's rows (rank j holds ``sizes[j]``); backward sums each rank's grads back to it."""
    P = _size(group)
    if P == 1:
        return x
    me = dist.get_rank(group)
    x_rep = x.unsqueeze(0).expand(P, *x.shape).reshape(P * x.shape[0], *x.shape[1:])
    return all_to_all(x_rep, sizes, [sizes[me]] * P, group)


def reduce_scatter_v(x: torch.Tensor, sizes: Sequence[int], group) -> torch.Tensor:
    """Sum over ranks of rank-j's block of rows (``sizes[j]`` each), delivered to rank j. Dual of all_gather_v."""
    P = _size(group)
    if P == 1:
        return x
    me = dist.get_rank(group)
    parts = all_to_all(x, [sizes[me]] * P, sizes, group)
    return parts.view(P, sizes[me], *x.shape[1:]).sum(0)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((_size(group) * x.shape[0],) + tuple(x.shape[1:]))
        _all_gather_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _ReduceScatter.apply(grad, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty((x.shape[0] // _size(group),) + tuple(x.shape[1:]))
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllGather.apply(grad, ctx.group), None


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Equal-size gather along dim 0; backward is a reduce-scatter (sum)."""
    return x if group is None else _AllGather.apply(x, group)


def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ranks, each rank keeping its equal share of dim 0; backward is an all-gather."""
    return x if group is None else _ReduceScatter.apply(x, group)


def all_gather_nograd(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    if group is None:
        return x
    out = x.new_empty((_size(group) * x.shape[0],) + tuple(x.shape[1:]))
    _all_gather_tensor(out, x.contiguous(), group=group)
    return out


def reduce_scatter_flat(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup):
    """Async sum of the flat ``x`` over the group into this rank's equal slice ``out`` (may be that slice of ``x``:
    in place on NCCL and gloo). Returns the work handle."""
    return _reduce_scatter_tensor(out, x, group=group, async_op=True)


def all_gather_flat(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup):
    """Async gather of every rank's equal slice ``x`` into the flat ``out`` (``x`` may be this rank's slice of
    ``out``). Returns the work handle."""
    return _all_gather_tensor(out, x, group=group, async_op=True)
