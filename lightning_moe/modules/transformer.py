"""Decoder-only MoE transformer: embedding, pre-norm blocks (attention + MoE or dense SwiGLU), final norm, head."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from lightning_moe.modules.attention import Attention
from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.experts import SwiGLU
from lightning_moe.modules.init import fill_normal_, init_weights
from lightning_moe.modules.moe_layer import MoELayer
from lightning_moe.strategy.parallel_context import ParallelContext


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, layer_idx: int):
        super().__init__()
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)  # Megatron's scaled init for output projections
        self.layer_idx, self.is_moe = layer_idx, cfg.is_moe_layer(layer_idx)
        self.attn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = Attention(cfg, out_std)
        self.ffn_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.ffn = MoELayer(cfg, ctx, out_std) if self.is_moe else SwiGLU(cfg.hidden_size, cfg.ffn_hidden_size,
                                                                          cfg.init_std, out_std)

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_BSD = x_BSD + self.attn(self.attn_norm(x_BSD))
        if self.is_moe:
            y_BSD, aux = self.ffn(self.ffn_norm(x_BSD))
        else:
            y_BSD, aux = self.ffn(self.ffn_norm(x_BSD)), x_BSD.new_zeros((), dtype=torch.float32)
        return x_BSD + y_BSD, aux


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: Optional[ParallelContext] = None):
        super().__init__()
        ctx = ctx or ParallelContext.single()
        self.cfg, self.ctx = cfg, ctx
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, ctx, i) for i in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @torch.no_grad()
    def reset_parameters_sharded(self, seed: int, name: str) -> None:
        fill_normal_(self.embed.weight, self.cfg.init_std, seed, "embed")
        if self.head is not None:
            fill_normal_(self.head.weight, self.cfg.init_std, seed, "head")
        for m in self.modules():
            if isinstance(m, nn.RMSNorm):
                m.reset_parameters()

    def init_weights(self, seed: int) -> None:
        init_weights(self, seed)

    def forward(self, tokens_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns logits (B, S, V) and the summed auxiliary loss of all MoE layers."""
        x_BSD = self.embed(tokens_BS)
        aux = x_BSD.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            x_BSD, layer_aux = layer(x_BSD)
            aux = aux + layer_aux
        h_BSD = self.norm(x_BSD)
        logits_BSV = self.head(h_BSD) if self.head is not None else h_BSD @ self.embed.weight.t()
        return logits_BSV, aux

    def moe_layers(self) -> list[MoELayer]:
        return [blk.ffn for blk in self.layers if blk.is_moe]
