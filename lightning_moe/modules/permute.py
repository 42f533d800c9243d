"""Token permute / unpermute with backward passes that know they are permutations.

Plain indexing (``x[idx]``) backpropagates through ``index_put_(accumulate=True)``, which on CUDA sorts the
indices and reduces segments: slow, and wasted here because each expert row has exactly one source. These
functions backpropagate with gathers only.

Shapes: T tokens, K top-k, D hidden, N permuted rows. ``rows_TK[t, k]`` is the row holding token t's k-th copy;
``keep_TK`` (optional) marks copies that were not dropped; a dropped copy's row is never read back.
"""

from __future__ import annotations

from typing import Optional

import torch

try:  # fused kernels on CUDA; the torch code below is the reference and the CPU path
    from lightning_moe.modules import triton_permute as _tk
except ImportError:  # no triton (CPU-only installs)
    _tk = None


def _use_triton(t: torch.Tensor) -> bool:
    return _tk is not None and t.is_cuda


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, src_N, rows_TK, keep_TK, zero_row: bool):
        ctx.save_for_backward(rows_TK, keep_TK)
        ctx.n_rows = src_N.numel()
        if zero_row:  # src_N == T reads a zero row (padded capacity slots nobody fills)
            x_TD = torch.cat([x_TD, x_TD.new_zeros(1, x_TD.shape[1])])
        return x_TD.index_select(0, src_N)

    @staticmethod
    def backward(ctx, g_ND):
        rows_TK, keep_TK = ctx.saved_tensors
        T, K = rows_TK.shape
        if _use_triton(g_ND):  # sum of each token's copies in one pass (dropped copies are never read)
            return _tk.combine_fwd(g_ND, rows_TK, None, keep_TK, g_ND.dtype), None, None, None, None
        g_TKD = g_ND.index_select(0, rows_TK.reshape(-1).clamp(max=ctx.n_rows - 1)).view(T, K, -1)
        if keep_TK is not None:
            g_TKD = torch.where(keep_TK.unsqueeze(-1), g_TKD, 0)
        return g_TKD.sum(1), None, None, None, None


def gather_tokens(x_TD: torch.Tensor, src_N: torch.Tensor, rows_TK: torch.Tensor,
                  keep_TK: Optional[torch.Tensor] = None, zero_row: bool = False) -> torch.Tensor:
    """``x_TD[src_N]``; the gradient of token t is the sum of the gradients of its (kept) copies."""
    return _GatherTokens.apply(x_TD, src_N, rows_TK, keep_TK, zero_row)


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND, probs_TK, rows_TK, keep_TK, permutation: bool):
        ctx.save_for_backward(y_ND, probs_TK, rows_TK, keep_TK)
        ctx.permutation = permutation
        if _use_triton(y_ND):
            return _tk.combine_fwd(y_ND, rows_TK, probs_TK, keep_TK, y_ND.dtype)
        y_TKD = _gather_copies(y_ND, rows_TK, keep_TK)
        return torch.bmm(probs_TK.unsqueeze(1).to(y_ND.dtype), y_TKD).squeeze(1)

    @staticmethod
    def backward(ctx, g_TD):
        y_ND, probs_TK, rows_TK, keep_TK = ctx.saved_tensors
        T, K = rows_TK.shape
        N, D = y_ND.shape
        if _use_triton(y_ND):
            grad_y, grad_probs = _tk.combine_bwd(g_TD, y_ND, rows_TK, probs_TK, keep_TK, ctx.permutation)
            return grad_y, grad_probs.to(probs_TK.dtype), None, None, None
        y_TKD = _gather_copies(y_ND, rows_TK, keep_TK)  # recomputed: cheaper than keeping T*K*D alive
        g_TD1 = g_TD.unsqueeze(-1)
        grad_probs = torch.bmm(y_TKD, g_TD1).squeeze(-1).to(probs_TK.dtype) if ctx.needs_input_grad[1] else None
        grad_y = None
        if ctx.needs_input_grad[0]:
            g_TKD = probs_TK.unsqueeze(-1).to(g_TD.dtype) * g_TD.unsqueeze(1)
            if keep_TK is not None:
                g_TKD = torch.where(keep_TK.unsqueeze(-1), g_TKD, 0)
            if ctx.permutation:  # every row is written exactly once
                grad_y = y_ND.new_empty(N, D).index_copy_(0, rows_TK.reshape(-1), g_TKD.view(T * K, D))
            else:  # padded: empty slots get 0; dropped copies write 0 into the spare row N
                grad_y = y_ND.new_zeros(N + 1, D).index_copy_(0, rows_TK.reshape(-1), g_TKD.view(T * K, D))[:N]
        return grad_y, grad_probs, None, None, None


def _gather_copies(y_ND, rows_TK, keep_TK):
    T, K = rows_TK.shape
    y_TKD = y_ND.index_select(0, rows_TK.reshape(-1).clamp(max=y_ND.shape[0] - 1)).view(T, K, -1)
    if keep_TK is not None:  # dropped copies point at undefined rows: zero them (a 0 prob would not hide NaN)
        y_TKD = torch.where(keep_TK.unsqueeze(-1), y_TKD, 0)
    return y_TKD


def combine_rows(y_ND: torch.Tensor, probs_TK: torch.Tensor, rows_TK: torch.Tensor,
                 keep_TK: Optional[torch.Tensor] = None, permutation: bool = True) -> torch.Tensor:
    """``out[t] = sum_k probs[t, k] * y[rows[t, k]]`` (dropped copies contribute 0).

    ``permutation``: ``rows_TK`` covers every row of ``y_ND`` exactly once (false for padded capacity layouts).
    """
    return _CombineRows.apply(y_ND, probs_TK, rows_TK, keep_TK, permutation)


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD, order_M, inverse_M):
        ctx.save_for_backward(inverse_M)
        return x_MD.index_select(0, order_M)

    @staticmethod
    def backward(ctx, g_MD):
        (inverse_M,) = ctx.saved_tensors
        return g_MD.index_select(0, inverse_M), None, None


def permute_rows(x_MD: torch.Tensor, order_M: torch.Tensor, inverse_M: torch.Tensor) -> torch.Tensor:
    """``x_MD[order_M]`` for a permutation whose inverse is given; backward is the inverse gather."""
    return _PermuteRows.apply(x_MD, order_M, inverse_M)
