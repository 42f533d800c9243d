"""Model FLOPs for TFLOPS/GPU and MFU, following Megatron-LM's ``num_floating_point_operations``
(``megatron/training/training.py``), plus the dense peak throughput of common accelerators.

Every matmul ``(m x n) @ (n x k)`` costs ``2·m·n·k`` FLOPs (one multiply and one add per MAC) and is run three times
in training: forward, backward data-gradient and backward weight-gradient. A weight of shape ``(n, k)`` applied to
one token therefore costs ``3 · 2 · n·k = 6·n·k`` training FLOPs: that is where every ``6`` below comes from.

Per token, with ``h`` hidden, ``L`` layers (``L_moe`` of them MoE, ``L_dense = L - L_moe``), ``f`` the dense FFN
size, ``f_moe`` the expert FFN size, ``f_shared`` the shared-expert FFN size, ``k`` = topk, ``V`` vocab, ``s`` the
sequence length, ``q = heads·head_dim`` and ``kv = kv_heads·head_dim``, ``g = 3`` (SwiGLU: gate, up and down)::

    MLP             6·h·g·(f·L_dense + (f_moe·k + f_shared)·L_moe)
    attn proj (GQA) 6·L·(h·(q + 2·kv) + q·h)            q, k, v and output projections
    core attention  6·L·(2·s·q / 2) = 6·L·s·q           QK^T and (QK^T)V, causal so half of the s x s scores
    logits          6·h·V

Not counted (as in Megatron): the router GEMM (``h·E``), norms, softmax, RoPE, the embedding lookup and the loss.
Megatron uses the padded vocabulary; this model does not pad, so ``V = vocab_size``.
"""

from __future__ import annotations

import re
from typing import Optional

from lightning_moe.modules.config import ModelConfig

SWIGLU_FACTOR = 3  # g: gate, up and down projections of a SwiGLU MLP (Megatron's ffn_expansion_factor with swiglu)
FWD_BWD = 3  # forward + backward dgrad + backward wgrad
FLOPS_PER_MAC = 2


def _attention_flops_per_token_per_layer(cfg: ModelConfig, s: int) -> float:
    """Training FLOPs of one attention layer for one token (projections + causal core attention)."""
    h, H = cfg.hidden_size, cfg.num_attention_heads
    if cfg.attention_type == "mla":
        # Megatron's multi-latent-attention terms (DeepSeek-V2/V3), ``qk_head_dim`` = nope, ``qk_pos_emb`` = rope:
        #   q:    q_lora·(h + H·(nope + rope) + 1)   down h -> q_lora, up q_lora -> H·(nope+rope), "+1" the q norm
        #         (or h·H·(nope + rope) without a q LoRA)
        #   kv:   kv_lora·(h + H·(nope + v) + 1) + h·rope   down h -> kv_lora, up kv_lora -> H·(nope + v), the kv
        #         norm, and the shared rope key h -> rope
        #   out:  H·v·h
        #   core: s·H·(nope + rope)/2 (QK^T) + s·H·v/2 (AV), both causal-halved
        # Megatron counts the two latent norms here (the "+1"s); we keep them for parity, they are < 0.01 %.
        # These are exactly the matmuls of modules/mla.py (tests/test_flops.py checks them against its weights).
        nope, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if None in (nope, rope, v, cfg.kv_lora_rank):
            raise ValueError("training_flops_per_token: attention_type='mla' needs qk_nope_head_dim, "
                             "qk_rope_head_dim, v_head_dim and kv_lora_rank")
        qk = nope + rope
        q_term = h * H * qk if cfg.q_lora_rank is None else cfg.q_lora_rank * (h + H * qk + 1)
        kv_term = cfg.kv_lora_rank * (h + H * (nope + v) + 1) + h * rope
        out_term = H * v * h
        core = s * H * qk / 2 + s * H * v / 2
        return FWD_BWD * FLOPS_PER_MAC * (q_term + kv_term + out_term + core)
    q = H * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    proj = h * (q + 2 * kv) + q * h  # wq, wk, wv, then wo
    # Core attention per token: the token's query row against s keys (QK^T, q·s MACs summed over heads) and its
    # score row against s values (AV, another q·s MACs): 2·s·q MACs; the causal mask leaves half of them: /2.
    core = 2 * s * q / 2
    return FWD_BWD * FLOPS_PER_MAC * (proj + core)


def layer_flops_per_token(cfg: ModelConfig, seq_length: Optional[int] = None) -> dict[str, float]:
    """The terms of the formula, per token: ``attention_proj`` and ``core_attention`` of one layer, ``dense_mlp`` of
    one dense layer, ``experts`` (routed, all k copies) and ``shared_experts`` of one MoE layer, ``logits`` once.
    The layout planner times each on its own kernel's throughput."""
    s = cfg.seq_length if seq_length is None else seq_length
    if s <= 0:
        raise ValueError(f"training_flops_per_token: seq_length must be positive, got {s}")
    h, g, mac = cfg.hidden_size, SWIGLU_FACTOR, FWD_BWD * FLOPS_PER_MAC
    proj = _attention_flops_per_token_per_layer(cfg, 0)  # the core-attention term is the part linear in s
    return {"attention_proj": proj, "core_attention": _attention_flops_per_token_per_layer(cfg, s) - proj,
            "dense_mlp": mac * h * g * cfg.ffn_hidden_size, "experts": mac * h * g * cfg.moe_ffn_hidden_size * cfg.topk,
            "shared_experts": mac * h * g * cfg.shared_expert_ffn_size, "logits": mac * h * cfg.vocab_size}


def training_flops_per_token(cfg: ModelConfig, seq_length: Optional[int] = None) -> float:
    """Forward + backward model FLOPs per token (Megatron's formula; see the module docstring).

    ``seq_length`` defaults to ``cfg.seq_length``; it only enters the causal core-attention term.
    """
    t = layer_flops_per_token(cfg, seq_length)
    L, L_moe = cfg.num_layers, cfg.num_moe_layers
    return float(L * (t["attention_proj"] + t["core_attention"]) + (L - L_moe) * t["dense_mlp"]
                 + L_moe * (t["experts"] + t["shared_experts"]) + t["logits"])


def model_flops_per_step(cfg: ModelConfig, tokens: int, seq_length: Optional[int] = None) -> float:
    """Training FLOPs of one optimizer step over ``tokens`` tokens (all micro-batches, all data-parallel ranks)."""
    return training_flops_per_token(cfg, seq_length) * tokens


# ------------------------------------------------------------------------------------------------ peak throughput
# Dense (no 2:4 sparsity) tensor-core peaks in FLOP/s from NVIDIA's datasheets. MFU is taken against the dense bf16
# number: 989.4 TFLOPS for H100/H200 SXM, not the 1,979 "with sparsity" figure that some tables (Lightning's
# ``_CUDA_FLOPS`` among them) list.
_H100_SXM = {"fp32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12,
             "fp8": 1978.9e12}
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "h100-sxm": _H100_SXM,
    "h200-sxm": dict(_H100_SXM),  # same Hopper SMs and clocks as H100 SXM, more and faster HBM
    "gh200": dict(_H100_SXM),
    "h100-pcie": {"fp32": 51.2e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12,
                  "fp8": 1513e12},
    "a100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
}
H100_SXM_BF16_PEAK = PEAK_FLOPS["h100-sxm"]["bf16"]
_DTYPE_ALIASES = {"bfloat16": "bf16", "bf16-mixed": "bf16", "bf16-true": "bf16", "float16": "fp16", "half": "fp16",
                  "16-mixed": "fp16", "float32": "fp32", "32": "fp32", "32-true": "fp32",
                  "float8": "fp8", "tfloat32": "tf32"}


def device_key(device_name: str) -> Optional[str]:
    """Map ``torch.cuda.get_device_name()`` to a ``PEAK_FLOPS`` key, or None when unknown.

    NVL variants (H100 NVL, H200 NVL) run at lower clocks and power, so they are left unknown rather than guessed.
    """
    name = device_name.lower()
    if re.search(r"\bnvl\b", name):
        return None
    if re.search(r"\bgh200\b", name):
        return "gh200"
    if re.search(r"\bh200\b", name):
        return "h200-sxm"
    if re.search(r"\bh100\b", name):
        return "h100-pcie" if "pcie" in name else "h100-sxm"  # "NVIDIA H100 80GB HBM3" is the SXM part
    if re.search(r"\ba100\b", name):
        return "a100"  # SXM and PCIe have the same tensor-core peak
    return None


def peak_flops(device_name: str, dtype: str = "bf16") -> Optional[float]:
    """Dense peak FLOP/s of one device for ``dtype`` (``bf16``, ``fp16``, ``fp8``, ``tf32``, ``fp32``).

    Returns None for an unknown device or a dtype the device has no tensor-core rate for (e.g. fp8 on A100).
    """
    key = device_key(device_name)
    if key is None:
        return None
    dtype = _DTYPE_ALIASES.get(str(dtype).lower().removeprefix("torch."), str(dtype).lower())
    return PEAK_FLOPS[key].get(dtype)
