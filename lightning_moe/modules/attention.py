"""Causal self-attention with grouped-query heads, RoPE and optional per-head q/k RMSNorm (Qwen3).

Shapes: B batch, S sequence, D hidden, H query heads, G kv heads, Dh head dim.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.init import fill_normal_


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles_SH = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles_SDh = torch.cat([angles_SH, angles_SH], dim=-1)  # HF "rotate half" layout, as Mixtral/Qwen3 checkpoints
    return angles_SDh.cos(), angles_SDh.sin()


def apply_rope(x_BHSDh: torch.Tensor, cos_SDh: torch.Tensor, sin_SDh: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BHSDh.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x_BHSDh.float() * cos_SDh + rotated.float() * sin_SDh).to(x_BHSDh.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, out_std: float):
        super().__init__()
        if cfg.attention_type == "mla":
            warnings.warn("attention_type='mla' (multi-head latent attention) is not implemented yet; this model "
                          f"uses standard attention with {cfg.num_attention_heads} heads of dim {cfg.head_dim} "
                          "in its place. MLA lands with the tensor/context-parallel issue.", stacklevel=2)
        self.cfg, self.out_std = cfg, out_std
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
        D, Dh = cfg.hidden_size, cfg.head_dim
        self.wq = nn.Linear(D, self.n_heads * Dh, bias=False)
        self.wk = nn.Linear(D, self.n_kv * Dh, bias=False)
        self.wv = nn.Linear(D, self.n_kv * Dh, bias=False)
        self.wo = nn.Linear(self.n_heads * Dh, D, bias=False)
        self.q_norm = nn.RMSNorm(Dh, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(Dh, eps=cfg.norm_eps) if cfg.qk_norm else None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def reset_parameters_sharded(self, seed: int, name: str) -> None:
        for proj in ("wq", "wk", "wv"):
            fill_normal_(getattr(self, proj).weight, self.cfg.init_std, seed, f"{name}.{proj}")
        fill_normal_(self.wo.weight, self.out_std, seed, f"{name}.wo")

    def rope(self, seq_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        # cached and grown on demand: not a buffer, so it is never checkpointed or cast by precision plugins
        if self._rope is None or self._rope[0].shape[0] < seq_len or self._rope[0].device != torch.device(device):
            # built outside inference mode: a cache first made by trainer.validate() must still serve training
            with torch.inference_mode(False), torch.no_grad():
                self._rope = rope_cos_sin(max(seq_len, self.cfg.seq_length), self.head_dim, self.cfg.rope_theta,
                                          device)
        cos, sin = self._rope
        return cos[:seq_len], sin[:seq_len]

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q_BHSDh = self.wq(x_BSD).view(B, S, self.n_heads, self.head_dim).transpose(1, 2)
        k_BGSDh = self.wk(x_BSD).view(B, S, self.n_kv, self.head_dim).transpose(1, 2)
        v_BGSDh = self.wv(x_BSD).view(B, S, self.n_kv, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q_BHSDh, k_BGSDh = self.q_norm(q_BHSDh), self.k_norm(k_BGSDh)
        cos, sin = self.rope(S, x_BSD.device)
        q_BHSDh, k_BGSDh = apply_rope(q_BHSDh, cos, sin), apply_rope(k_BGSDh, cos, sin)
        o_BHSDh = F.scaled_dot_product_attention(q_BHSDh, k_BGSDh, v_BGSDh, is_causal=True,
                                                 enable_gqa=self.n_kv != self.n_heads)
        return self.wo(o_BHSDh.transpose(1, 2).reshape(B, S, self.n_heads * self.head_dim))
