"""Tensor-parallel building blocks (Megatron's ``tensor_parallel`` package), written against a ``ParallelContext``.

Regions. Without sequence parallelism (SP), activations outside a TP region are replicated over the TP ranks: a
column-parallel layer enters with ``copy_to_tp`` (identity forward, all-reduce backward) and a row-parallel layer
leaves with ``reduce_from_tp`` (all-reduce forward, identity backward). With SP they are sharded along the sequence
instead: enter with an all-gather, leave with a reduce-scatter (each the other's backward). Activations are
(B, S, D), so the sequence dimension is 1.

Weights are shards of the full tensors, initialised by ``modules/init.py`` so every layout holds the same model.
Parameters replicated over TP (norms, the router) get partial gradients under SP, because each rank saw only its
sequence shard: their gradients must be summed over TP (the test in tests/parallel/test_tp_blocks.py shows it).
Such parameters carry ``grad_sum_over_tp = True``; ``GradSync`` all-reduces them over tp x dp x cp. Sharded weights
carry ``tp_shard_dim`` (and ``tp_parts`` when several logical weights are stacked, e.g. SwiGLU's [gate | up]).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_moe.modules import kernels, wgrad_fusion
from lightning_moe.modules.init import fill_normal_, shard
from lightning_moe.strategy.comm import all_gather, reduce_scatter
from lightning_moe.strategy.parallel_context import ParallelContext


# ------------------------------------------------------------------------------------------------ region collectives
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ReduceFromTP.apply(x, group)


def gather_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """All-gather along ``dim`` (rank order); backward reduce-scatters (sums) the gradient."""
    if group is None:
        return x
    return all_gather(x.movedim(dim, 0), group).movedim(0, dim)


def reduce_scatter_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Sum over ranks, each keeping its chunk of ``dim``; backward all-gathers."""
    if group is None:
        return x
    return reduce_scatter(x.movedim(dim, 0), group).movedim(0, dim)


class _SplitSeq(torch.autograd.Function):
    """Keep this rank's chunk of a TP-replicated tensor; backward all-gathers (the upstream grads are per chunk)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return x.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _GatherSeqSplitGrad.apply(grad, ctx.group, ctx.dim), None, None


class _GatherSeqSplitGrad(torch.autograd.Function):
    """All-gather chunks into a TP-replicated tensor; backward keeps this rank's chunk of the (replicated) grad."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x.movedim(dim, 0).contiguous(), group).movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _SplitSeq.apply(grad, ctx.group, ctx.dim), None, None


def split_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Replicated -> this rank's sequence chunk (Megatron's scatter_to_sequence_parallel_region)."""
    if group is None:
        return x
    if x.shape[dim] % dist.get_world_size(group):
        raise ValueError(f"split_seq: sequence length {x.shape[dim]} is not divisible by the TP size "
                         f"{dist.get_world_size(group)}")
    return _SplitSeq.apply(x, group, dim)


def gather_seq_replicated(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Sequence chunks -> replicated, for consumers that are themselves replicated (grads are not partial sums)."""
    return x if group is None else _GatherSeqSplitGrad.apply(x, group, dim)


def enter_tp_region(x_BSD: torch.Tensor, ctx: ParallelContext, sequence_parallel: Optional[bool] = None
                    ) -> torch.Tensor:
    """The full local sequence for layers that compute on TP shards of their weights: all-gather under SP,
    identity forward / all-reduce backward otherwise. Call once and feed several column-parallel layers."""
    sp = ctx.sequence_parallel if sequence_parallel is None else sequence_parallel
    group = ctx.group("tp")
    return gather_seq(x_BSD, group) if sp else copy_to_tp(x_BSD, group)


def tp_shard(full: torch.Tensor, dim: int, rank: int, size: int, parts: int = 1) -> torch.Tensor:
    """This rank's slice of a full weight: ``parts`` stacked logical weights along ``dim`` are sharded each."""
    if size == 1:
        return full
    return torch.cat([shard(p, dim, rank, size) for p in full.chunk(parts, dim=dim)], dim=dim)


def mark_grad_sum_over_tp(module: nn.Module, ctx: ParallelContext) -> None:
    """Parameters replicated over TP whose gradients are partial (each rank saw a share of the tokens or heads)."""
    if ctx.tp > 1:
        for p in module.parameters():
            p.grad_sum_over_tp = True


# ------------------------------------------------------------------------------------------------ layers
def _check_divisible(what: str, n: int, tp: int) -> None:
    if n % tp:
        raise ValueError(f"tensor parallelism: {what} ({n}) is not divisible by tensor_parallel_size ({tp})")


class ColumnParallelLinear(nn.Module):
    """``y = x W^T`` with W split by output rows: each rank computes its slice of the output features.

    Input: replicated (B, S, D_in), or sequence-sharded (B, S/tp, D_in) under SP. Output: (B, S, D_out/tp).
    """

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, init_std: float = 0.02,
                 sequence_parallel: Optional[bool] = None, input_in_region: bool = False,
                 part_keys: Optional[tuple[str, ...]] = None):
        """``input_in_region``: the input already went through ``enter_tp_region`` (shared by several layers).
        ``part_keys``: the weight stacks len(part_keys) logical weights along the output (e.g. SwiGLU's gate and
        up); each is initialised under its own key and sharded separately, so rank r holds [gate_r | up_r]."""
        super().__init__()
        parts = len(part_keys) if part_keys else 1
        _check_divisible("output features", out_features // parts, ctx.tp)
        self.ctx, self.init_std, self.part_keys, self.input_in_region = ctx, init_std, part_keys, input_in_region
        self.sequence_parallel = ctx.sequence_parallel if sequence_parallel is None else sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features // ctx.tp, in_features))
        self.weight.tp_shard_dim = 0
        self.weight.wgrad_fusable = True  # GradSync may accumulate its gradient in the GEMM (wgrad_fusion.py)
        if parts > 1:
            self.weight.tp_parts = parts

    @torch.no_grad()
    def reset_parameters_sharded(self, seed: int, name: str) -> None:
        r, n = self.ctx.rank("tp"), self.ctx.tp
        if not self.part_keys:
            fill_normal_(self.weight, self.init_std, seed, f"{name}.weight", 0, r, n)
            return
        rows = self.weight.shape[0] // len(self.part_keys)
        for i, key in enumerate(self.part_keys):
            fill_normal_(self.weight[i * rows:(i + 1) * rows], self.init_std, seed, f"{name}.{key}", 0, r, n)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        if not self.input_in_region:
            x_BSD = enter_tp_region(x_BSD, self.ctx, self.sequence_parallel)
        return self._mm(x_BSD, self.weight)

    def _mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The GEMM: the place where low-precision GEMMs are swapped in (``FP8Training``)."""
        return wgrad_fusion.linear(x, w)


class RowParallelLinear(nn.Module):
    """``y = x W^T`` with W split by input columns: each rank holds partial sums, reduced over TP.

    Input: (B, S, D_in/tp), the output of a column-parallel layer. Output: replicated (B, S, D_out), or
    sequence-sharded (B, S/tp, D_out) under SP.
    """

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, init_std: float = 0.02,
                 sequence_parallel: Optional[bool] = None):
        super().__init__()
        _check_divisible("input features", in_features, ctx.tp)
        self.ctx, self.init_std = ctx, init_std
        self.sequence_parallel = ctx.sequence_parallel if sequence_parallel is None else sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features // ctx.tp))
        self.weight.tp_shard_dim = 1
        self.weight.wgrad_fusable = True

    @torch.no_grad()
    def reset_parameters_sharded(self, seed: int, name: str) -> None:
        fill_normal_(self.weight, self.init_std, seed, f"{name}.weight", 1, self.ctx.rank("tp"), self.ctx.tp)

    def forward(self, x_BSF: torch.Tensor) -> torch.Tensor:
        group = self.ctx.group("tp")
        y_BSD = self._mm(x_BSF, self.weight)
        return reduce_scatter_seq(y_BSD, group) if self.sequence_parallel else reduce_from_tp(y_BSD, group)

    def _mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The GEMM: the place where low-precision GEMMs are swapped in (``FP8Training``)."""
        return wgrad_fusion.linear(x, w)


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split over TP: each rank looks up the ids in its range, the rest are summed in
    from the other ranks. Output: replicated (B, S, D), or sequence-sharded under SP (reduce-scatter)."""

    def __init__(self, vocab_size: int, dim: int, ctx: ParallelContext, init_std: float = 0.02,
                 sequence_parallel: Optional[bool] = None):
        super().__init__()
        _check_divisible("vocab size", vocab_size, ctx.tp)
        self.ctx, self.init_std = ctx, init_std
        self.sequence_parallel = ctx.sequence_parallel if sequence_parallel is None else sequence_parallel
        self.vocab_per_rank = vocab_size // ctx.tp
        self.vocab_start = ctx.rank("tp") * self.vocab_per_rank
        self.weight = nn.Parameter(torch.empty(self.vocab_per_rank, dim))
        self.weight.tp_shard_dim = 0

    @torch.no_grad()
    def reset_parameters_sharded(self, seed: int, name: str) -> None:
        fill_normal_(self.weight, self.init_std, seed, f"{name}.weight", 0, self.ctx.rank("tp"), self.ctx.tp)

    def forward(self, ids_BS: torch.Tensor) -> torch.Tensor:
        group = self.ctx.group("tp")
        if group is None:
            return F.embedding(ids_BS, self.weight)
        local_BS = ids_BS - self.vocab_start
        outside_BS = (local_BS < 0) | (local_BS >= self.vocab_per_rank)
        x_BSD = F.embedding(local_BS.masked_fill(outside_BS, 0), self.weight)
        x_BSD = x_BSD.masked_fill(outside_BS.unsqueeze(-1), 0.0)
        return reduce_scatter_seq(x_BSD, group) if self.sequence_parallel else reduce_from_tp(x_BSD, group)


# ------------------------------------------------------------------------------------------------ cross-entropy
class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over vocab-sharded logits without gathering them: three all-reduces of (N,) vectors."""

    @staticmethod
    def forward(ctx, logits_NV, target_N, vocab_start, group, ignore_index):
        logits_NV = logits_NV.float()
        valid_N = target_N != ignore_index
        max_N = logits_NV.max(dim=-1).values
        dist.all_reduce(max_N, op=dist.ReduceOp.MAX, group=group)
        shifted_NV = logits_NV - max_N.unsqueeze(-1)
        local_N = target_N - vocab_start
        inside_N = (local_N >= 0) & (local_N < logits_NV.shape[-1])
        idx_N = local_N.clamp(0, logits_NV.shape[-1] - 1)
        target_logit_N = shifted_NV.gather(1, idx_N.unsqueeze(1)).squeeze(1) * inside_N
        exp_NV = shifted_NV.exp()
        sum_exp_N = exp_NV.sum(dim=-1)
        both = torch.stack([target_logit_N, sum_exp_N])
        dist.all_reduce(both, group=group)
        target_logit_N, sum_exp_N = both[0], both[1]
        loss_N = (sum_exp_N.log() - target_logit_N) * valid_N
        ctx.save_for_backward(exp_NV.div_(sum_exp_N.unsqueeze(-1)), idx_N, inside_N, valid_N)
        return loss_N

    @staticmethod
    def backward(ctx, grad_N):
        softmax_NV, idx_N, inside_N, valid_N = ctx.saved_tensors
        grad_NV = softmax_NV.clone()
        grad_NV.scatter_add_(1, idx_N.unsqueeze(1), -inside_N.to(grad_NV.dtype).unsqueeze(1))
        return grad_NV * (grad_N * valid_N).unsqueeze(-1), None, None, None, None


class _FusedCE(torch.autograd.Function):
    """Cross-entropy of (this rank's vocab shard of) the logits with the Triton kernels (``triton_cross_entropy.py``):
    one pass over the logits forward and one backward, keeping the logits themselves and the log-sum-exp per row.
    Under TP the shards' (N,) partial results are combined with two all-reduces."""

    @staticmethod
    def forward(ctx, logits_NV, target_N, vocab_start, group, ignore_index, tk):
        max_N, sum_N, tgt_N = tk.partials(logits_NV, target_N, vocab_start, ignore_index)
        if group is not None:
            global_max_N = max_N.clone()
            dist.all_reduce(global_max_N, op=dist.ReduceOp.MAX, group=group)
            both = torch.stack([tgt_N, sum_N * torch.exp(max_N - global_max_N)])
            dist.all_reduce(both, group=group)  # the target's logit comes from the one shard that holds it
            tgt_N, sum_N, max_N = both[0], both[1], global_max_N
        lse_N = sum_N.log() + max_N
        valid_N = target_N != ignore_index
        ctx.save_for_backward(logits_NV, target_N, lse_N, valid_N)
        ctx.vocab_start, ctx.tk = vocab_start, tk
        return (lse_N - tgt_N) * valid_N

    @staticmethod
    def backward(ctx, grad_N):
        logits_NV, target_N, lse_N, valid_N = ctx.saved_tensors
        scale_N = (grad_N * valid_N).float()
        return ctx.tk.grad(logits_NV, target_N, lse_N, scale_N, ctx.vocab_start), None, None, None, None, None


def vocab_parallel_cross_entropy(logits_NV: torch.Tensor, target_N: torch.Tensor, ctx: ParallelContext,
                                 reduction: str = "mean", ignore_index: int = -100,
                                 fused: bool = False) -> torch.Tensor:
    """``F.cross_entropy`` of the full-vocabulary logits, given this rank's vocab shard (fp32 math). Targets equal
    to ``ignore_index`` count for nothing, as in ``F.cross_entropy``; targets outside the vocabulary are not
    checked under TP or with ``fused`` (that would need a host sync). ``fused``: the Triton kernels where they run
    (CUDA; ``ModelConfig.cross_entropy_fusion``), which never make a float32 copy of the logits."""
    group = ctx.group("tp")
    tk = kernels.load("triton_cross_entropy", logits_NV, fused)
    if group is None and tk is None:
        return F.cross_entropy(logits_NV.float(), target_N, reduction=reduction, ignore_index=ignore_index)
    vocab_start = ctx.rank("tp") * logits_NV.shape[-1] if group is not None else 0
    if tk is not None:
        loss_N = _FusedCE.apply(logits_NV, target_N, vocab_start, group, ignore_index, tk)
    else:
        loss_N = _VocabParallelCE.apply(logits_NV, target_N, vocab_start, group, ignore_index)
    if reduction == "mean":  # over the targets that count (NaN when none does, as F.cross_entropy)
        return loss_N.sum() / (target_N != ignore_index).sum()
    if reduction == "sum":
        return loss_N.sum()
    if reduction == "none":
        return loss_N
    raise ValueError(f"vocab_parallel_cross_entropy: unknown reduction {reduction!r}")
