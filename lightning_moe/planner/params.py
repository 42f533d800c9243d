"""Parameter counts of ``MoETransformer`` without building it: per layer, split by how the layout shards them.

``replicated`` parameters are whole on every TP rank (norms, the router, MLA's down-projections and latent norms),
``tp`` ones are split over TP (attention projections, dense and shared-expert MLPs, embedding, head) and ``expert``
ones over EP x ETP. Dense gradients are reduced over DP x CP, expert gradients over EDP. tests/planner checks these
counts against the module built on the meta device.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from lightning_moe.flops import SWIGLU_FACTOR
from lightning_moe.modules.config import ModelConfig


class Params(NamedTuple):
    replicated: int = 0
    tp: int = 0
    expert: int = 0

    def __add__(self, other: "Params") -> "Params":  # type: ignore[override]
        return Params(*(a + b for a, b in zip(self, other)))

    def per_rank(self, tp: int, ep: int, etp: int) -> tuple[float, float]:
        """(dense, expert) parameters held by one rank."""
        return self.replicated + self.tp / tp, self.expert / (ep * etp)


def attention_params(cfg: ModelConfig) -> Params:
    h, H = cfg.hidden_size, cfg.num_attention_heads
    if cfg.attention_type == "mla":
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q = (Params(cfg.q_lora_rank * (h + 1), cfg.q_lora_rank * H * qk) if cfg.q_lora_rank
             else Params(0, h * H * qk))
        kv = Params(h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank,
                    cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        return q + kv + Params(0, H * cfg.v_head_dim * h)
    q, kv = H * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return Params(2 * cfg.head_dim if cfg.qk_norm else 0, h * (q + 2 * kv) + q * h)


def layer_params(cfg: ModelConfig, i: int) -> Params:
    """Layer ``i``: its two norms, attention and FFN (dense SwiGLU, or router + experts + shared experts)."""
    h, g = cfg.hidden_size, SWIGLU_FACTOR
    p = Params(2 * h) + attention_params(cfg)
    if not cfg.is_moe_layer(i):
        return p + Params(0, g * h * cfg.ffn_hidden_size)
    return p + Params(h * cfg.num_experts, g * h * cfg.shared_expert_ffn_size,
                      cfg.num_experts * g * h * cfg.moe_ffn_hidden_size)


def embedding_params(cfg: ModelConfig) -> Params:
    return Params(0, cfg.vocab_size * cfg.hidden_size)


def head_params(cfg: ModelConfig, pp: int = 1) -> Params:
    """Final norm and head on the last stage (with tied embeddings and PP > 1, its own copy of the embedding)."""
    tied_here = cfg.tie_embeddings and pp == 1
    return Params(cfg.hidden_size, 0 if tied_here else cfg.vocab_size * cfg.hidden_size)


def stage_params(cfg: ModelConfig, layers: Sequence[int], first: bool, last: bool, pp: int = 1) -> Params:
    """The parameters of one pipeline rank holding ``layers`` (and the embedding / head when first / last)."""
    p = sum((layer_params(cfg, i) for i in layers), Params())
    if first:
        p = p + embedding_params(cfg)
    if last:
        p = p + head_params(cfg, pp)
    return p


def model_params(cfg: ModelConfig) -> Params:
    return stage_params(cfg, range(cfg.num_layers), True, True)
