"""Triton cross-entropy over (a vocabulary shard of) the logits, in their own dtype: Megatron's
``--cross-entropy-loss-fusion`` (``tensor_parallel.vocab_parallel_cross_entropy`` falls back to torch elsewhere).

forward    one pass per row over the logits: the running max and sum of exponentials (online softmax) and the
           target's logit when this shard holds it. The caller combines the shards' (N,) vectors (TP all-reduces)
           into the log-sum-exp and the loss.
backward   one pass per row: grad = (exp(logit - lse) - [v == target]) * grad_loss, written in the logits' dtype

torch's path upcasts the logits to float32 and keeps the log-probabilities: two float32 copies of the logits in
forward and two more passes in backward (5 GB each at 8,192 tokens of Qwen3's 151,936-word vocabulary). This keeps
only the logits themselves and one float32 per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lightning_moe.modules.triton_launch import launch


@triton.jit
def _fwd_kernel(x_ptr, stride, t_ptr, max_ptr, sum_ptr, tgt_ptr, V, vocab_start, ignore_index,
                BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride
    m_vec = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    s_vec = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        new_m = tl.maximum(m_vec, x)
        # lanes that have seen only padding stay at -inf with a zero sum (exp(-inf - -inf) would be NaN)
        safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)
        s_vec = s_vec * tl.exp(m_vec - safe_m) + tl.exp(x - safe_m)
        m_vec = new_m
    m = tl.max(m_vec, axis=0)
    # a shard whose logits are all -inf sums to 0 (its max stays -inf, and the TP combine scales it away)
    s = tl.sum(s_vec * tl.exp(m_vec - tl.where(m == float("-inf"), 0.0, m)), axis=0)
    t = tl.load(t_ptr + row)
    local = t - vocab_start
    inside = (local >= 0) & (local < V) & (t != ignore_index)
    tgt = tl.load(x_row + tl.where(inside, local, 0)).to(tl.float32)
    tl.store(max_ptr + row, m)
    tl.store(sum_ptr + row, s)
    tl.store(tgt_ptr + row, tl.where(inside, tgt, 0.0))


@triton.jit
def _bwd_kernel(x_ptr, stride, g_ptr, t_ptr, lse_ptr, scale_ptr, V, vocab_start, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, g_row = x_ptr + row * stride, g_ptr + row * V
    lse = tl.load(lse_ptr + row)
    scale = tl.load(scale_ptr + row)  # the loss's gradient for this row; 0 where the target is ignored
    local = tl.load(t_ptr + row) - vocab_start  # outside [0, V) when another shard holds the target
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        mask = offs < V
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(offs == local, 1.0, 0.0)) * scale
        tl.store(g_row + offs, g.to(g_ptr.dtype.element_ty), mask=mask)


def _block(V: int) -> int:
    return min(4096, triton.next_power_of_2(max(V, 16)))


def partials(logits_NV: torch.Tensor, target_N: torch.Tensor, vocab_start: int,
             ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of this shard: (max logit, sum of exp(logit - max), the target's logit or 0 where another shard holds
    it or it is ignored), float32."""
    N, V = logits_NV.shape
    if logits_NV.stride(1) != 1:
        logits_NV = logits_NV.contiguous()
    max_N, sum_N, tgt_N = (torch.empty(N, device=logits_NV.device, dtype=torch.float32) for _ in range(3))
    if N:
        launch(_fwd_kernel, (N,), logits_NV, logits_NV.stride(0), target_N.contiguous(), max_N, sum_N, tgt_N, V,
               vocab_start, ignore_index, BLOCK_V=_block(V), num_warps=8)
    return max_N, sum_N, tgt_N


def grad(logits_NV: torch.Tensor, target_N: torch.Tensor, lse_N: torch.Tensor, scale_N: torch.Tensor,
         vocab_start: int) -> torch.Tensor:
    """d loss / d logits of this shard, in the logits' dtype: (softmax - one-hot of the target) * scale per row."""
    N, V = logits_NV.shape
    if logits_NV.stride(1) != 1:
        logits_NV = logits_NV.contiguous()
    g = torch.empty(N, V, device=logits_NV.device, dtype=logits_NV.dtype)
    if N:
        launch(_bwd_kernel, (N,), logits_NV, logits_NV.stride(0), g, target_N.contiguous(), lse_N.contiguous(),
               scale_N.contiguous(), V, vocab_start, BLOCK_V=_block(V), num_warps=8)
    return g
