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

from lightning_moe.modules import kernels


def _tk(t: torch.Tensor, fused: bool):
    """The Triton kernels (``triton_permute.py``) when they run for ``t``; None: the torch code below, which is the
    reference and the CPU path."""
    return kernels.load("triton_permute", t, fused)


def _gather(tk, x_TD: torch.Tensor, src_N: torch.Tensor, quant, slot: str) -> torch.Tensor:
    """``tk.gather``; with ``quant`` (an ``fp8_swiglu.Handoff``), fused with the rows' rowwise FP8 quantization
    (``triton_fp8_gather``), which it puts into ``quant``'s ``slot`` for the experts' GEMM that reads these rows."""
    tq = kernels.load("triton_fp8_gather", x_TD) if quant is not None else None
    if tq is None:
        return tk.gather(x_TD, src_N)
    out_ND, q_ND, inv_N1 = tq.gather_quant(x_TD, src_N)
    quant.put(slot, out_ND, (q_ND, inv_N1, None))
    return out_ND


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, src_N, rows_TK, keep_TK, zero_row: bool, fused: bool, quant=None):
        ctx.save_for_backward(rows_TK, keep_TK)
        ctx.n_rows, ctx.fused = src_N.numel(), fused
        tk = _tk(x_TD, fused)
        if tk is not None:  # holes (src -1) are written as zeros
            return _gather(tk, x_TD, src_N, quant, "input")
        if zero_row:  # src_N == -1 reads a zero row (padded slots nobody fills)
            src_N = torch.where(src_N < 0, x_TD.shape[0], src_N)
            x_TD = torch.cat([x_TD, x_TD.new_zeros(1, x_TD.shape[1])])
        return x_TD.index_select(0, src_N)

    @staticmethod
    def backward(ctx, g_ND):
        rows_TK, keep_TK = ctx.saved_tensors
        T, K = rows_TK.shape
        tk = _tk(g_ND, ctx.fused)
        if tk is not None:  # sum of each token's copies in one pass (dropped copies are never read)
            return tk.combine_fwd(g_ND, rows_TK, None, keep_TK, g_ND.dtype), None, None, None, None, None, None
        g_TKD = g_ND.index_select(0, rows_TK.reshape(-1).clamp(max=ctx.n_rows - 1)).view(T, K, -1)
        if keep_TK is not None:
            g_TKD = torch.where(keep_TK.unsqueeze(-1), g_TKD, 0)
        return g_TKD.sum(1), None, None, None, None, None, None


def gather_tokens(x_TD: torch.Tensor, src_N: torch.Tensor, rows_TK: torch.Tensor,
                  keep_TK: Optional[torch.Tensor] = None, zero_row: bool = False, fused: bool = True,
                  quant=None) -> torch.Tensor:
    """``x_TD[src_N]``; the gradient of token t is the sum of the gradients of its (kept) copies. ``zero_row``:
    ``src_N`` holds -1 for rows that stay zero (the holes of padded layouts). ``quant``: an ``fp8_swiglu.Handoff``
    that gets the rows' rowwise FP8 copy as ``input`` where the Triton kernels run (the experts' fc1 takes it)."""
    return _GatherTokens.apply(x_TD, src_N, rows_TK, keep_TK, zero_row, fused, quant)


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND, probs_TK, rows_TK, keep_TK, permutation: bool, fused: bool):
        ctx.save_for_backward(y_ND, probs_TK, rows_TK, keep_TK)
        ctx.permutation, ctx.fused = permutation, fused
        tk = _tk(y_ND, fused)
        if tk is not None:
            return tk.combine_fwd(y_ND, rows_TK, probs_TK, keep_TK, y_ND.dtype)
        y_TKD = _gather_copies(y_ND, rows_TK, keep_TK)
        return torch.bmm(probs_TK.unsqueeze(1).to(y_ND.dtype), y_TKD).squeeze(1)

    @staticmethod
    def backward(ctx, g_TD):
        y_ND, probs_TK, rows_TK, keep_TK = ctx.saved_tensors
        T, K = rows_TK.shape
        N, D = y_ND.shape
        tk = _tk(y_ND, ctx.fused)
        if tk is not None:
            grad_y, grad_probs = tk.combine_bwd(g_TD, y_ND, rows_TK, probs_TK, keep_TK, ctx.permutation)
            return grad_y, grad_probs.to(probs_TK.dtype), None, None, None, None
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
        return grad_y, grad_probs, None, None, None, None


def _gather_copies(y_ND, rows_TK, keep_TK):
    T, K = rows_TK.shape
    y_TKD = y_ND.index_select(0, rows_TK.reshape(-1).clamp(max=y_ND.shape[0] - 1)).view(T, K, -1)
    if keep_TK is not None:  # dropped copies point at undefined rows: zero them (a 0 prob would not hide NaN)
        y_TKD = torch.where(keep_TK.unsqueeze(-1), y_TKD, 0)
    return y_TKD


def combine_rows(y_ND: torch.Tensor, probs_TK: Optional[torch.Tensor], rows_TK: torch.Tensor,
                 keep_TK: Optional[torch.Tensor] = None, permutation: bool = True, fused: bool = True,
                 src_N: Optional[torch.Tensor] = None, quant=None) -> torch.Tensor:
    """``out[t] = sum_k probs[t, k] * y[rows[t, k]]`` (dropped copies contribute 0).

    ``permutation``: ``rows_TK`` covers every row of ``y_ND`` exactly once (false for padded capacity layouts).
    ``probs_TK`` None: the plain sum of the copies (the experts weighted their rows already, ``row_probs``); then
    ``src_N``, the token of each row (-1: none), as ``gather_tokens`` took it, makes the backward that gather, and
    nothing of ``y_ND`` is kept for it. Rows whose copy the sum skips (dropped, or another rank's) still get their
    token's gradient: the experts never let them reach an output (``GroupedExperts``' tail mask). ``quant`` (with
    ``src_N``): an ``fp8_swiglu.Handoff`` that gets that gather's rowwise FP8 copy as ``grad_out`` (fc2's backward).
    """
    if probs_TK is None:
        return _SumCopies.apply(y_ND, rows_TK, keep_TK, src_N, fused, quant)
    return _CombineRows.apply(y_ND, probs_TK, rows_TK, keep_TK, permutation, fused)


class _SumCopies(torch.autograd.Function):
    """The adjoint of ``gather_tokens``: forward is its backward, backward its forward."""

    @staticmethod
    def forward(ctx, y_ND, rows_TK, keep_TK, src_N, fused: bool, quant=None):
        ctx.save_for_backward(src_N)
        ctx.fused, ctx.quant = fused, quant
        return _GatherTokens.backward(_Ctx((rows_TK, keep_TK), y_ND.shape[0], fused), y_ND)[0]

    @staticmethod
    def backward(ctx, g_TD):
        (src_N,) = ctx.saved_tensors
        tk = _tk(g_TD, ctx.fused)
        none = (None,) * 5
        if tk is not None:  # holes (src -1) are written as zeros
            return (_gather(tk, g_TD.contiguous(), src_N, ctx.quant, "grad_out"), *none)
        src_N = torch.where(src_N < 0, g_TD.shape[0], src_N)
        return (torch.cat([g_TD, g_TD.new_zeros(1, g_TD.shape[1])]).index_select(0, src_N), *none)


class _Ctx:
    """Stands in for an autograd context, to call a Function's backward as a plain function."""

    def __init__(self, saved: tuple, n_rows: int, fused: bool):
        self.saved_tensors, self.n_rows, self.fused = saved, n_rows, fused


def row_probs(probs_TK: torch.Tensor, rows_TK: torch.Tensor, keep_TK: Optional[torch.Tensor],
              num_rows: int) -> torch.Tensor:
    """The router probability of each of ``num_rows`` expert rows (``rows_TK[t, k]`` holds copy (t, k)), float32 or
    wider; 0 for rows that hold no kept copy. Differentiable in ``probs_TK``. The experts weight their rows with it before
    the second GEMM, as Megatron does, so that the combine needs no expert output for the probabilities' gradient
    (one activation of the experts' output size less per layer)."""
    rows_N = rows_TK.reshape(-1)
    if keep_TK is not None:  # dropped copies: to the spare row, cut off below
        rows_N = torch.where(keep_TK.reshape(-1), rows_N, num_rows)
    dtype = torch.promote_types(probs_TK.dtype, torch.float32)  # the router's float32 (float64 in float64 tests)
    out = probs_TK.new_zeros(num_rows + 1, dtype=dtype)
    return out.index_copy(0, rows_N.clamp(max=num_rows), probs_TK.reshape(-1).to(dtype))[:num_rows]


def _scatter(x_MD: torch.Tensor, dest_M: torch.Tensor, R: int) -> torch.Tensor:
    out = x_MD.new_empty(R, x_MD.shape[1]) if R == x_MD.shape[0] else x_MD.new_zeros(R, x_MD.shape[1])
    return out.index_copy_(0, dest_M, x_MD)


class _MoveRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MD, dest_M, R: int):
        ctx.save_for_backward(dest_M)
        return _scatter(x_MD, dest_M, R)

    @staticmethod
    def backward(ctx, g_RD):
        (dest_M,) = ctx.saved_tensors
        return g_RD.index_select(0, dest_M), None, None


def move_rows(x_MD: torch.Tensor, dest_M: torch.Tensor, R: int) -> torch.Tensor:
    """Row m to row ``dest_M[m]`` of R rows (distinct places; rows nobody lands on are zero). Backward gathers."""
    return _MoveRows.apply(x_MD, dest_M, R)


def take_rows(y_RD: torch.Tensor, dest_M: torch.Tensor) -> torch.Tensor:
    """``y_RD[dest_M]``, the inverse of ``move_rows``; rows not taken get a zero gradient."""
    return _TakeRows.apply(y_RD, dest_M)


class _TakeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_RD, dest_M):
        ctx.save_for_backward(dest_M)
        ctx.R = y_RD.shape[0]
        return y_RD.index_select(0, dest_M)

    @staticmethod
    def backward(ctx, g_MD):
        (dest_M,) = ctx.saved_tensors
        return _scatter(g_MD, dest_M, ctx.R), None
