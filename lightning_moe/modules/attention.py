"""Causal self-attention with grouped-query heads, RoPE and optional per-head q/k RMSNorm (Qwen3).

Tensor parallelism splits the heads: q, k, v are column-parallel (each rank holds H/tp query and G/tp kv heads,
contiguous, so a rank's query heads find their kv heads locally), the output projection is row-parallel. Like
Megatron, the number of kv heads must be divisible by TP (no kv-head replication). Context parallelism hands each
rank its zig-zag chunks of the sequence (``positions_S`` are their global positions, for RoPE) and exchanges K/V
inside ``context_parallel_attention``.

Shapes: B batch, S local sequence, D hidden, H local query heads, G local kv heads, Dh head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_moe.modules import kernels
from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.context_parallel import context_parallel_attention
from lightning_moe.modules.document_mask import Mask
from lightning_moe.modules.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, enter_tp_region,
                                                   mark_grad_sum_over_tp)
from lightning_moe.strategy.parallel_context import ParallelContext


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles_SH = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles_SDh = torch.cat([angles_SH, angles_SH], dim=-1)  # HF "rotate half" layout, as Mixtral/Qwen3 checkpoints
    return angles_SDh.cos(), angles_SDh.sin()


def apply_rope(x_BHSDh: torch.Tensor, cos_SDh: torch.Tensor, sin_SDh: torch.Tensor,
               per_row: bool = False) -> torch.Tensor:
    """Rotate by the tables of shared positions (S, Dh) or of each row's own (B, S, Dh: packed documents).
    ``per_row``: the tables are already shaped to broadcast against ``x``."""
    if cos_SDh.dim() == 3 and not per_row:
        cos_SDh, sin_SDh = cos_SDh.unsqueeze(1), sin_SDh.unsqueeze(1)
    x1, x2 = x_BHSDh.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x_BHSDh.float() * cos_SDh + rotated.float() * sin_SDh).to(x_BHSDh.dtype)


def apply_rope_bshd(x_BSHDh: torch.Tensor, cos_SDh: torch.Tensor, sin_SDh: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` for heads in the third dimension (B, S, H, Dh): the same operations, broadcast over heads."""
    return apply_rope(x_BSHDh, cos_SDh.unsqueeze(-2), sin_SDh.unsqueeze(-2), per_row=True)


class RotaryCache:
    """cos/sin tables grown on demand and indexed by global position. Not a buffer: never checkpointed or cast."""

    def __init__(self, dim: int, theta: float, min_len: int):
        self.dim, self.theta, self.min_len = dim, theta, min_len
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, positions_S: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``seq_len``: the full (global) sequence length; under CP the positions of a rank's chunks reach it.
        Sizes come from it, not from the positions' values: no host sync."""
        need, dev = max(seq_len, self.min_len), positions_S.device
        if self._table is None or self._table[0].shape[0] < need or self._table[0].device != dev:
            # built outside inference mode: a table first made by trainer.validate() must still serve training
            with torch.inference_mode(False), torch.no_grad():
                self._table = rope_cos_sin(need, self.dim, self.theta, dev)
        cos, sin = self._table
        return cos[positions_S], sin[positions_S]


def check_attention_tp(cfg: ModelConfig, tp: int) -> None:
    """Heads (and GQA kv heads) must split evenly over TP; also part of the model's layout check."""
    if cfg.num_attention_heads % tp:
        raise ValueError(f"num_attention_heads={cfg.num_attention_heads} is not divisible by tensor_parallel_size "
                         f"(tp={tp})")
    if cfg.attention_type == "gqa" and cfg.num_kv_heads % tp:
        raise ValueError(f"num_kv_heads={cfg.num_kv_heads} is not divisible by tensor_parallel_size (tp={tp}) "
                         "(kv heads are split over TP, not replicated, as in Megatron)")


class CoreAttention(nn.Module):
    """Causal attention of rotated q, k and v (under CP with the K/V exchange; under packed documents' mask, dense or
    a FlexAttention BlockMask: ``document_mask.py``) as a module: the place that ``Recompute(["core_attn"])``
    recomputes and ``ActivationOffload(["core_attn"])`` offloads. No parameters."""

    def __init__(self, ctx: ParallelContext):
        super().__init__()
        self.ctx = ctx

    def forward(self, q_BHSE: torch.Tensor, k_BGSE: torch.Tensor, v_BGSF: torch.Tensor,
                scale: float | None = None, mask: Mask | None = None) -> torch.Tensor:
        ctx = self.ctx
        return context_parallel_attention(q_BHSE, k_BGSE, v_BGSF, ctx.group("cp"), ctx.rank("cp"), ctx.cp,
                                          scale=scale, mask=mask)


class _NormRope(torch.autograd.Function):
    """The Triton RoPE (after the per-head RMSNorm when ``w_Dh`` is given; ``triton_rope.py``), keeping the tables
    and, with the norm, its input and rstd per row: what the norm and RoPE keep in torch, less the norm's output."""

    @staticmethod
    def forward(ctx, x, w_Dh, cos, sin, eps, tk):
        out, rstd = tk.forward(x, w_Dh, cos, sin, eps)
        # RoPE alone needs only the tables: the input stays unkept, as torch's rotation keeps it
        ctx.save_for_backward(x if w_Dh is not None else None, w_Dh, cos, sin, rstd)
        ctx.tk, ctx.shape = tk, x.shape
        return out

    @staticmethod
    def backward(ctx, g):
        x, w_Dh, cos, sin, rstd = ctx.saved_tensors
        dx, dw = ctx.tk.backward(g, x, w_Dh, cos, sin, rstd, ctx.shape)
        return dx, (dw if ctx.needs_input_grad[1] else None), None, None, None, None


def rotate(x_BSHDh: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, norm: nn.RMSNorm | None = None,
           fused: bool = True) -> torch.Tensor:
    """``apply_rope_bshd(norm(x))`` (without ``norm``: RoPE alone); ``fused``: one Triton pass each way where the
    kernel runs (CUDA), else the torch ops, the reference."""
    tk = kernels.load("triton_rope", x_BSHDh, fused)
    if tk is None:
        return apply_rope_bshd(x_BSHDh if norm is None else norm(x_BSHDh), cos, sin)
    w = None if norm is None else norm.weight
    eps = 0.0 if norm is None else (norm.eps if norm.eps is not None else torch.finfo(x_BSHDh.dtype).eps)
    if torch.is_grad_enabled() and (x_BSHDh.requires_grad or (w is not None and w.requires_grad)):
        return _NormRope.apply(x_BSHDh, w, cos, sin, eps, tk)
    return tk.forward(x_BSHDh, w, cos, sin, eps)[0]


class NormRotate(nn.Module):
    """q and k normalised per head (Qwen3's q/k norms), then rotated: what attention keeps of them. A module so that
    ``Recompute(["layernorm"])`` can rebuild its outputs in backward from its inputs, which the norms keep anyway, as
    it rebuilds the pre-norms' outputs. No parameters: the norms stay the attention's (their names are the
    checkpoints')."""

    def __init__(self, fused: bool = True):
        super().__init__()
        self.fused = fused

    def forward(self, q_BSHDh: torch.Tensor, k_BSGDh: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                q_norm: nn.RMSNorm, k_norm: nn.RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        return rotate(q_BSHDh, cos, sin, q_norm, self.fused), rotate(k_BSGDh, cos, sin, k_norm, self.fused)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, out_std: float):
        super().__init__()
        check_attention_tp(cfg, ctx.tp)
        self.cfg, self.ctx = cfg, ctx
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads // ctx.tp, cfg.num_kv_heads // ctx.tp, \
            cfg.head_dim
        D, Dh, std = cfg.hidden_size, cfg.head_dim, cfg.init_std
        self.wq = ColumnParallelLinear(D, cfg.num_attention_heads * Dh, ctx, std, input_in_region=True)
        self.wk = ColumnParallelLinear(D, cfg.num_kv_heads * Dh, ctx, std, input_in_region=True)
        self.wv = ColumnParallelLinear(D, cfg.num_kv_heads * Dh, ctx, std, input_in_region=True)
        self.wo = RowParallelLinear(cfg.num_attention_heads * Dh, D, ctx, out_std)
        self.q_norm = nn.RMSNorm(Dh, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(Dh, eps=cfg.norm_eps) if cfg.qk_norm else None
        for norm in (self.q_norm, self.k_norm):  # shared by all heads, each rank sees only its own heads
            if norm is not None:
                mark_grad_sum_over_tp(norm, ctx)
        self.norm_rotate = NormRotate(cfg.rope_fusion) if cfg.qk_norm else None
        self.rope = RotaryCache(Dh, cfg.rope_theta, cfg.seq_length)
        self.core_attn = CoreAttention(ctx)

    def forward(self, x_BSD: torch.Tensor, positions_S: torch.Tensor, mask: Mask | None = None) -> torch.Tensor:
        x_BSD = enter_tp_region(x_BSD, self.ctx)  # one all-gather (SP) for q, k and v
        B, S, _ = x_BSD.shape
        # q, k and v stay in (B, S, heads, Dh) memory and reach the kernel as transposed views: the kernels lay their
        # output out like q, so the output projection's input below is a view of the output that attention keeps,
        # not a second copy (64 MiB per layer and micro-batch at the Qwen3 shape, and a copy kernel each way)
        q_BSHDh = self.wq(x_BSD).view(B, S, self.n_heads, self.head_dim)
        k_BSGDh = self.wk(x_BSD).view(B, S, self.n_kv, self.head_dim)
        v_BSGDh = self.wv(x_BSD).view(B, S, self.n_kv, self.head_dim)
        cos, sin = self.rope(positions_S, S * self.ctx.cp)
        if self.norm_rotate is not None:
            q_BSHDh, k_BSGDh = self.norm_rotate(q_BSHDh, k_BSGDh, cos, sin, self.q_norm, self.k_norm)
        else:
            fused = self.cfg.rope_fusion
            q_BSHDh, k_BSGDh = rotate(q_BSHDh, cos, sin, fused=fused), rotate(k_BSGDh, cos, sin, fused=fused)
        o_BHSDh = self.core_attn(q_BSHDh.transpose(1, 2), k_BSGDh.transpose(1, 2), v_BSGDh.transpose(1, 2),
                                 mask=mask)
        return self.wo(o_BHSDh.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))


def build_attention(cfg: ModelConfig, ctx: ParallelContext, out_std: float) -> nn.Module:
    if cfg.attention_type == "mla":
        from lightning_moe.modules.mla import MLAttention
        return MLAttention(cfg, ctx, out_std)
    return Attention(cfg, ctx, out_std)
