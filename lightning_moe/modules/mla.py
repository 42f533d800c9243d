"""Multi-head latent attention (DeepSeek-V2/V3), tensor-parallel.

Queries (optionally through a low-rank ``q_lora_rank`` bottleneck) and keys/values through a shared latent of
``kv_lora_rank`` plus one RoPE key of ``qk_rope_head_dim`` shared by all heads:

    q      = W_qb · norm(W_qa · x)                 (H, nope + rope) per token   [or W_q · x without q LoRA]
    c, k_r = W_kva · x                            latent (kv_lora) and the shared rope key (rope)
    k, v   = W_kvb · norm(c)                      (H, nope) keys and (H, v) values per token
    o      = W_o · attn([q_nope, rope(q_r)], [k_nope, rope(k_r)], v)

Under TP the up-projections (W_qb, W_kvb) are column-parallel over heads and W_o row-parallel. The down-projections
and latent norms are small and replicated, as in Megatron; they see the full (gathered) sequence, but each rank
back-propagates only through its own heads, so their gradients are summed over TP (``grad_sum_over_tp``).

RoPE uses the rotate-half layout; DeepSeek checkpoints store the interleaved layout, which is a fixed permutation
of the rope rows of W_qb and W_kva (for checkpoint import). YaRN scaling is not applied (pre-training length).

Shapes: B batch, S local sequence, D hidden, H local heads, N nope dim, R rope dim, V value dim, Q q_lora, C kv_lora.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_moe.modules import kernels
from lightning_moe.modules.attention import CoreAttention, RotaryCache, apply_rope_bshd, check_attention_tp
from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.document_mask import Mask
from lightning_moe.modules.init import fill_normal_
from lightning_moe.modules.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, enter_tp_region,
                                                   mark_grad_sum_over_tp)
from lightning_moe.strategy.parallel_context import ParallelContext


def check_mla_config(cfg: ModelConfig) -> None:
    missing = [n for n in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
               if not getattr(cfg, n)]
    if missing:
        raise ValueError(f"ModelConfig: attention_type='mla' needs {', '.join(missing)} to be set")
    if cfg.qk_rope_head_dim % 2:
        raise ValueError(f"ModelConfig.qk_rope_head_dim: must be even for RoPE, got {cfg.qk_rope_head_dim}")


class _RopeQ(torch.autograd.Function):
    """``[q_nope | rope(q_rope)]`` in one Triton pass each way (``triton_mla_rope.py``)."""

    @staticmethod
    def forward(ctx, q_BSHK, nope, cos, sin, tk):
        ctx.save_for_backward(cos, sin)
        ctx.nope, ctx.tk = nope, tk
        return tk.rope_q(q_BSHK, nope, cos, sin)

    @staticmethod
    def backward(ctx, g_BSHK):
        cos, sin = ctx.saved_tensors
        return ctx.tk.rope_q(g_BSHK, ctx.nope, cos, sin, inverse=True), None, None, None, None


class _RopeK(torch.autograd.Function):
    """``[k_nope | rope(k_rope)]`` with the shared rope key broadcast to every head, in one Triton pass."""

    @staticmethod
    def forward(ctx, k_nope_BSHN, k_rope_BSR, cos, sin, tk):
        ctx.save_for_backward(cos, sin)
        ctx.nope, ctx.tk = k_nope_BSHN.shape[-1], tk
        return tk.rope_k(k_nope_BSHN, k_rope_BSR, cos, sin)

    @staticmethod
    def backward(ctx, g_BSHK):
        cos, sin = ctx.saved_tensors
        return (g_BSHK[..., :ctx.nope], ctx.tk.rope_k_backward(g_BSHK, ctx.nope, cos, sin), None, None, None)


def rope_heads(q_BSHK: torch.Tensor, k_nope_BSHN: torch.Tensor, k_rope_BSR: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """q with its rope part rotated, and k = [k_nope | rope(k_rope)] for every head. ``fused``: the Triton kernels
    where they run (CUDA; ``ModelConfig.rope_fusion``), else torch's split, rotation and cat, the reference."""
    N, (B, S, H, R) = k_nope_BSHN.shape[-1], (*k_nope_BSHN.shape[:3], k_rope_BSR.shape[-1])
    tk = kernels.load("triton_mla_rope", q_BSHK, fused)
    if tk is not None:
        return _RopeQ.apply(q_BSHK, N, cos, sin, tk), _RopeK.apply(k_nope_BSHN, k_rope_BSR, cos, sin, tk)
    q_nope_BSHN, q_rope_BSHR = q_BSHK.split([N, R], dim=-1)
    q_BSHK = torch.cat([q_nope_BSHN, apply_rope_bshd(q_rope_BSHR, cos, sin)], dim=-1)
    k_rope_BS1R = apply_rope_bshd(k_rope_BSR.unsqueeze(2), cos, sin)
    return q_BSHK, torch.cat([k_nope_BSHN, k_rope_BS1R.expand(B, S, H, R)], dim=-1)


class MLAUpProjection(nn.Module):
    """The up-projections and RoPE, from the latents to the heads' q, k and v: the place that
    ``Recompute(["mla_up_proj"])`` recomputes from the (small) latents instead of keeping q, k and v. No parameters
    of its own: it applies its attention module's, given as the first argument."""

    def forward(self, attn: "MLAttention", q_in_BSX: torch.Tensor, c_BSC: torch.Tensor, k_rope_BSR: torch.Tensor,
                positions_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, S, _ = c_BSC.shape
        H, N, R, V = attn.n_heads, attn.nope, attn.rope_dim, attn.v_dim
        # built in (B, S, H, *) memory and handed over as transposed views: the attention kernel lays its output out
        # like q, so the output projection's input is a view of the output attention keeps, not a copy
        q_BSX = attn.wq_b(q_in_BSX) if attn.cfg.q_lora_rank else attn.wq(q_in_BSX)
        q_BSHK = q_BSX.view(B, S, H, N + R)
        kv_BSHX = attn.wkv_b(attn.kv_a_norm(c_BSC)).view(B, S, H, N + V)
        k_nope_BSHN, v_BSHV = kv_BSHX.split([N, V], dim=-1)
        cos, sin = attn.rope(positions_S, S * attn.ctx.cp)
        q_BSHK, k_BSHK = rope_heads(q_BSHK, k_nope_BSHN, k_rope_BSR, cos, sin, attn.cfg.rope_fusion)
        return q_BSHK.transpose(1, 2), k_BSHK.transpose(1, 2), v_BSHV.transpose(1, 2)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, out_std: float):
        super().__init__()
        check_mla_config(cfg)
        check_attention_tp(cfg, ctx.tp)
        self.cfg, self.ctx = cfg, ctx
        D, H_full, std = cfg.hidden_size, cfg.num_attention_heads, cfg.init_std
        self.n_heads = H_full // ctx.tp
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora = cfg.kv_lora_rank
        qk = self.nope + self.rope_dim
        if cfg.q_lora_rank:
            self.wq_a = nn.Linear(D, cfg.q_lora_rank, bias=False)
            self.q_a_norm = nn.RMSNorm(cfg.q_lora_rank, eps=cfg.norm_eps)
            self.wq_b = ColumnParallelLinear(cfg.q_lora_rank, H_full * qk, ctx, std, input_in_region=True)
            replicated = [self.wq_a, self.q_a_norm]
        else:
            self.wq = ColumnParallelLinear(D, H_full * qk, ctx, std, input_in_region=True)
            replicated = []
        self.wkv_a = nn.Linear(D, self.kv_lora + self.rope_dim, bias=False)
        self.kv_a_norm = nn.RMSNorm(self.kv_lora, eps=cfg.norm_eps)
        self.wkv_b = ColumnParallelLinear(self.kv_lora, H_full * (self.nope + self.v_dim), ctx, std,
                                          input_in_region=True)
        self.wo = RowParallelLinear(H_full * self.v_dim, D, ctx, out_std)
        for m in replicated + [self.wkv_a, self.kv_a_norm]:
            mark_grad_sum_over_tp(m, ctx)
        self.scale = 1.0 / math.sqrt(qk)
        self.rope = RotaryCache(self.rope_dim, cfg.rope_theta, cfg.seq_length)
        self.up_proj, self.core_attn = MLAUpProjection(), CoreAttention(ctx)

    @torch.no_grad()
    def reset_parameters_sharded(self, seed: int, name: str) -> None:
        # the replicated down-projections are plain nn.Linear: the same full weight on every rank
        if self.cfg.q_lora_rank:
            fill_normal_(self.wq_a.weight, self.cfg.init_std, seed, f"{name}.wq_a.weight")
        fill_normal_(self.wkv_a.weight, self.cfg.init_std, seed, f"{name}.wkv_a.weight")

    def forward(self, x_BSD: torch.Tensor, positions_S: torch.Tensor, mask: Mask | None = None) -> torch.Tensor:
        x_BSD = enter_tp_region(x_BSD, self.ctx)
        B, S, _ = x_BSD.shape
        q_in_BSX = self.q_a_norm(self.wq_a(x_BSD)) if self.cfg.q_lora_rank else x_BSD
        c_BSC, k_rope_BSR = self.wkv_a(x_BSD).split([self.kv_lora, self.rope_dim], dim=-1)
        q_BHSK, k_BHSK, v_BHSV = self.up_proj(self, q_in_BSX, c_BSC, k_rope_BSR, positions_S)
        o_BHSV = self.core_attn(q_BHSK, k_BHSK, v_BHSV, scale=self.scale, mask=mask)
        return self.wo(o_BHSV.transpose(1, 2).reshape(B, S, self.n_heads * self.v_dim))
