"""Activation memory: the bytes autograd keeps per token for one layer, by what keeps them, and what the
``Recompute`` / ``ActivationOffload`` modules take away.

Read off the modules (bf16 activations, fp32 router and norm statistics). Per token of this rank's sequence (S/cp of
each sample), with TP's sequence parallelism sharding what lives between the blocks; the MoE layer sees each token
once per TP group and, under ETP, every row of its ETP group:

    attention   norm input (x, rstd), the norm output (gathered under SP: the q/k/v projections keep it whole),
                q/k before their norm (Qwen3), q, k, v after RoPE and the attention output with its log-sum-exp
                (flash attention keeps them; under CP k and v of the whole sequence)
    MoE         the router's fp32 logits and scores (its input is the norm output, kept in bf16); per routed copy
                the expert input (fc1), fc1's output, the SwiGLU output (fc2's input) and the row's probability
                (the weighted SwiGLU applies it; with ``probs_in_experts=False`` the combine scales fc2's output
                and keeps that instead). The SwiGLU keeps only its input (``experts.swiglu``), not silu(gate).
    dense MLP   its (gathered) input, [gate | up] and the SwiGLU output

``moe_act`` recompute drops the SwiGLU output, ``layernorm`` the two norm outputs (docs/PERFORMANCE.md measured
both) and, with q/k norms, the rotated q and k (those of this rank's tokens: not the gathered k under CP);
checkpointed modules (``moe``, ``mlp``, ``shared_experts``, ``full``) keep their input only and rebuild one layer's
worth in backward (``transient``).
"""

from __future__ import annotations

from lightning_moe.modules.config import ModelConfig
from lightning_moe.planner.settings import Settings

BF16, FP32 = 2, 4
# a module's name in Recompute/ActivationOffload -> the terms below it removes
RECOMPUTED = {"layernorm": ("attn_norm_out", "ffn_norm_out"), "core_attn": ("attn_out",), "moe_act": ("act_out",),
              "mla_up_proj": ("q", "kv"), "shared_experts": ("shared",), "mlp": ("mlp",),
              "moe": ("router", "expert_fc1", "fc1_out", "act_out", "probs", "fc2_out", "shared")}
OFFLOADED = {"attn_norm": ("attn_norm_in",), "core_attn": ("q", "kv", "attn_out"), "attn_proj": ("attn_out",),
             "mlp_norm": ("ffn_norm_in",), "expert_fc1": ("expert_fc1",), "moe_act": ("fc1_out",)}


def _attention(cfg: ModelConfig, tp: int, cp: int) -> dict[str, float]:
    h, H = cfg.hidden_size, cfg.num_attention_heads
    out = {"attn_norm_in": (BF16 * h + FP32) / tp, "attn_norm_out": BF16 * h}
    if cfg.attention_type == "mla":
        nope, rope, v, qk = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, \
            cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        q_lora = cfg.q_lora_rank or 0
        # replicated down-projections run on the gathered sequence: their outputs are whole on every TP rank
        out["mla_latents"] = BF16 * (2 * q_lora + 2 * cfg.kv_lora_rank + rope) + FP32 * 2
        out["q"] = BF16 * H * qk / tp
        out["kv"] = BF16 * H * ((nope + v) + cp * (qk + v)) / tp  # kv up-projection, then k, v (CP: gathered)
        out["attn_out"] = (BF16 * H * v + FP32 * H) / tp
        return out
    d, G = cfg.head_dim, cfg.num_kv_heads
    if cfg.qk_norm:
        out["qk_norm_in"] = (BF16 * d + FP32) * (H + G) / tp
    out["q"] = BF16 * H * d / tp
    out["kv"] = BF16 * 2 * G * d * cp / tp
    out["attn_out"] = (BF16 * H * d + FP32 * H) / tp
    return out


def _ffn(cfg: ModelConfig, moe: bool, tp: int, etp: int) -> dict[str, float]:
    h, sp_input = cfg.hidden_size, (BF16 * cfg.hidden_size if tp > 1 else 0)  # SP: the gathered MLP input
    out = {"ffn_norm_in": (BF16 * h + FP32) / tp, "ffn_norm_out": BF16 * h / tp}
    if not moe:
        out["mlp"] = sp_input + 3 * BF16 * cfg.ffn_hidden_size / tp
        return out
    k, f, E = cfg.topk, cfg.moe_ffn_hidden_size, cfg.num_experts
    out["router"] = 3 * FP32 * E / tp
    out["expert_fc1"] = BF16 * h * k * etp / tp  # ETP: every row of the ETP group, at f / etp
    out["fc1_out"] = BF16 * 2 * f * k / tp
    out["act_out"] = BF16 * f * k / tp
    out["probs"] = FP32 * k * etp / tp  # each row's probability, kept by the weighted SwiGLU (ETP: every row)
    if not cfg.probs_in_experts:  # the combine weights the outputs and keeps them for the probabilities' gradient
        out["fc2_out"] = BF16 * h * k / tp
    if cfg.shared_expert_ffn_size:
        out["shared"] = sp_input + 3 * BF16 * cfg.shared_expert_ffn_size / tp
    return out


def layer_terms(cfg: ModelConfig, layer: int, tp: int = 1, cp: int = 1, etp: int = 1) -> dict[str, float]:
    """Bytes kept per token of this rank's sequence by layer ``layer``, with nothing recomputed or offloaded."""
    return {**_attention(cfg, tp, cp), **_ffn(cfg, cfg.is_moe_layer(layer), tp, etp)}


def layer_bytes(cfg: ModelConfig, layer: int, settings: Settings, tp: int = 1, cp: int = 1,
                etp: int = 1) -> tuple[float, float]:
    """(bytes kept per token until backward, bytes rebuilt per token while this layer's backward runs)."""
    terms = layer_terms(cfg, layer, tp, cp, etp)
    if "full" in settings.recompute:
        return BF16 * cfg.hidden_size / tp, sum(terms.values())
    gone = {t for m in settings.recompute for t in RECOMPUTED.get(m, ())}
    if tp > 1:  # under SP the projections keep the gathered copy, which is no norm's output
        gone.discard("attn_norm_out")
    checkpointed = {t for m in settings.recompute if m in ("moe", "mlp", "shared_experts") for t in RECOMPUTED[m]}
    gone |= {t for m in settings.offload for t in OFFLOADED.get(m, ())}
    k_rotated = 0.0  # the q/k norms' rotated k, which attention keeps (not under CP: there the gathered k)
    if cfg.qk_norm and cfg.attention_type != "mla" and "layernorm" in settings.recompute \
            and "core_attn" not in settings.recompute:  # a recomputed core_attn keeps q and k as its inputs
        k_rotated = terms["kv"] / 2 if cp == 1 and "kv" not in gone else 0.0
        gone.add("q")
    kept = sum(v for t, v in terms.items() if t not in gone) - k_rotated
    return kept, sum(v for t, v in terms.items() if t in checkpointed)


def loss_bytes(cfg: ModelConfig, tp: int = 1) -> float:
    """Per token, on the last stage at the loss: the head's input (gathered under SP), the bf16 logits and their fp32
    copy with the fp32 log-probabilities (``F.cross_entropy``), or under TP the shifted logits and their exp too
    (``_VocabParallelCE``), all alive at once in the forward. The fused loss (``cross_entropy_fusion``, on CUDA)
    keeps the bf16 logits alone, and its backward writes their bf16 gradient while they are alive."""
    if cfg.cross_entropy_fusion:
        return BF16 * cfg.hidden_size + 2 * BF16 * cfg.vocab_size / tp
    fp32_copies = 2 if tp == 1 else 3
    return BF16 * cfg.hidden_size + (BF16 + fp32_copies * FP32) * cfg.vocab_size / tp


def dispatch_bytes(cfg: ModelConfig, tp: int = 1, etp: int = 1) -> float:
    """Per token, while one MoE layer exchanges its rows over EP x ETP: the send and receive buffers."""
    return 2 * BF16 * cfg.hidden_size * cfg.topk * etp / tp
