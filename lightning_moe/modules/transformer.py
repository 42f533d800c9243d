"""Decoder-only MoE transformer: embedding, pre-norm blocks (attention + MoE or dense SwiGLU), final norm, head.

Parallel pieces swapped in: a vocab-parallel embedding and head (the loss never gathers the logits), TP attention
and MLPs, and context parallelism, which keeps this rank's zig-zag chunks of every sequence (tokens and labels).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe.modules.attention import build_attention, check_attention_tp
from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.context_parallel import zigzag_positions, zigzag_shard
from lightning_moe.modules.experts import SwiGLU
from lightning_moe.modules.init import init_weights
from lightning_moe.modules.moe_layer import MoELayer
from lightning_moe.modules.tensor_parallel import (ColumnParallelLinear, VocabParallelEmbedding, enter_tp_region,
                                                   mark_grad_sum_over_tp, vocab_parallel_cross_entropy)
from lightning_moe.strategy.parallel_context import ParallelContext


def _norm(cfg: ModelConfig, ctx: ParallelContext) -> nn.RMSNorm:
    norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
    if ctx.sequence_parallel:  # each TP rank normalises its own sequence shard
        mark_grad_sum_over_tp(norm, ctx)
    return norm


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, layer_idx: int):
        super().__init__()
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)  # Megatron's scaled init for output projections
        self.layer_idx, self.is_moe = layer_idx, cfg.is_moe_layer(layer_idx)
        self.attn_norm = _norm(cfg, ctx)
        self.attn = build_attention(cfg, ctx, out_std)
        self.ffn_norm = _norm(cfg, ctx)
        self.ffn = MoELayer(cfg, ctx, out_std) if self.is_moe else SwiGLU(cfg.hidden_size, cfg.ffn_hidden_size,
                                                                          cfg.init_std, out_std, ctx)

    def forward(self, x_BSD: torch.Tensor, positions_S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), positions_S)
        if self.is_moe:
            y_BSD, aux = self.ffn(self.ffn_norm(x_BSD))
        else:
            y_BSD, aux = self.ffn(self.ffn_norm(x_BSD)), x_BSD.new_zeros((), dtype=torch.float32)
        return x_BSD + y_BSD, aux


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: Optional[ParallelContext] = None):
        super().__init__()
        ctx = ctx or ParallelContext.single()
        check_model_layout(cfg, ctx)
        self.cfg, self.ctx = cfg, ctx
        self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx, cfg.init_std)
        self.layers = nn.ModuleList(Block(cfg, ctx, i) for i in range(cfg.num_layers))
        self.norm = _norm(cfg, ctx)
        self.head = None if cfg.tie_embeddings else ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, ctx,
                                                                         cfg.init_std)

    @torch.no_grad()
    def reset_parameters_sharded(self, seed: int, name: str) -> None:
        for m in self.modules():
            if isinstance(m, nn.RMSNorm):
                m.reset_parameters()

    def init_weights(self, seed: int) -> None:
        init_weights(self, seed)

    def forward(self, tokens_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and the summed auxiliary loss of all MoE layers. On one process the logits are (B, S, V); under
        CP they cover this rank's zig-zag positions and under TP this rank's vocabulary shard."""
        S, cp, cp_rank = tokens_BS.shape[1], self.ctx.cp, self.ctx.rank("cp")
        positions_S = zigzag_positions(S, cp, cp_rank, tokens_BS.device)
        x_BSD = self.embed(zigzag_shard(tokens_BS, cp, cp_rank))
        aux = x_BSD.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            x_BSD, layer_aux = layer(x_BSD, positions_S)
            aux = aux + layer_aux
        h_BSD = self.norm(x_BSD)
        if self.head is not None:
            return self.head(h_BSD), aux
        return F.linear(enter_tp_region(h_BSD, self.ctx), self.embed.weight), aux

    def loss(self, tokens_BS: torch.Tensor, labels_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean next-token cross-entropy over this rank's tokens (fp32, vocab-parallel) and the auxiliary loss."""
        logits_BSV, aux = self(tokens_BS)
        labels_BS = zigzag_shard(labels_BS, self.ctx.cp, self.ctx.rank("cp"))
        return vocab_parallel_cross_entropy(logits_BSV.flatten(0, 1), labels_BS.flatten(), self.ctx), aux

    def moe_layers(self) -> list[MoELayer]:
        return [blk.ffn for blk in self.layers if blk.is_moe]


def check_model_layout(cfg: ModelConfig, ctx_or_layout) -> None:
    """Raise ValueError when the model cannot be split over the layout (heads, kv heads, FFN sizes, vocab, experts,
    sequence length). Takes a ParallelContext or a strategy Layout, so it can run before any process group."""
    tp, cp, ep, etp = (getattr(ctx_or_layout, n) for n in ("tp", "cp", "ep", "etp"))

    def need(what: str, n: int, by: int, name: str) -> None:
        if n % by:
            long, short = name.split()
            raise ValueError(f"{what}={n} is not divisible by {long} ({short}={by})")

    check_attention_tp(cfg, tp)
    need("vocab_size", cfg.vocab_size, tp, "tensor_parallel_size tp")
    if cfg.num_layers > cfg.num_moe_layers:
        need("ffn_hidden_size", cfg.ffn_hidden_size, tp, "tensor_parallel_size tp")
    if cfg.shared_expert_ffn_size:
        need("shared_expert_ffn_size", cfg.shared_expert_ffn_size, tp, "tensor_parallel_size tp")
    if cfg.num_moe_layers:
        need("num_experts", cfg.num_experts, ep, "expert_parallel_size ep")
        need("moe_ffn_hidden_size", cfg.moe_ffn_hidden_size, etp, "expert_tensor_parallel_size etp")
    if cp > 1 and cfg.seq_length % (2 * cp):
        raise ValueError(f"seq_length={cfg.seq_length} is not divisible by 2 x context_parallel_size = {2 * cp} "
                         "(zig-zag sharding gives every CP rank two equal chunks)")
    if tp > 1 and (cfg.seq_length // cp) % tp:
        raise ValueError(f"seq_length / context_parallel_size = {cfg.seq_length // cp} is not divisible by "
                         f"tensor_parallel_size={tp} (sequence parallelism and the MoE token split shard it)")
