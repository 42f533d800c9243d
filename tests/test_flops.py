"""Megatron's training-FLOPs formula, checked by hand arithmetic and against parameter counts of the real model."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_moe.flops import model_flops_per_step, peak_flops, training_flops_per_token
from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.transformer import MoETransformer


def independent_flops_per_token(cfg: ModelConfig, s: int) -> float:
    """6 x (matmul weights one token passes through) + causal core attention, counted from a meta-device model.

    Each weight element is one MAC per token: 2 FLOPs forward, 4 backward. Experts count k of E; the router, norms
    and the embedding lookup are left out, as in Megatron. Core attention: QK^T and AV are s x q MACs each per
    token, half of them under the causal mask: 6 * 2 * s * q / 2 per layer.
    """
    with torch.device("meta"):
        model = MoETransformer(cfg)
    active = 0.0
    for blk in model.layers:
        active += sum(p.numel() for n, p in blk.attn.named_parameters() if n.startswith("w"))
        if blk.is_moe:
            active += (blk.ffn.experts.w13.numel() + blk.ffn.experts.w2.numel()) * cfg.topk / cfg.num_experts
            if blk.ffn.shared_experts is not None:
                active += sum(p.numel() for p in blk.ffn.shared_experts.parameters())
        else:
            active += sum(p.numel() for p in blk.ffn.parameters())
    active += model.head.weight.numel() if model.head is not None else model.embed.weight.numel()
    q = cfg.num_attention_heads * cfg.head_dim
    return 6 * active + cfg.num_layers * 6 * 2 * s * q / 2


def test_small_moe_config_by_hand():
    # h=16, L=3 (layer 0 dense, layers 1-2 MoE), heads 4 x head_dim 4 -> q=16, kv heads 2 -> kv=8, s=10, V=100,
    # f=40, f_moe=8, k=2, f_shared=12, g=3
    cfg = ModelConfig(vocab_size=100, hidden_size=16, num_layers=3, num_attention_heads=4, num_kv_heads=2,
                      ffn_hidden_size=40, seq_length=10, num_experts=4, moe_ffn_hidden_size=8, topk=2,
                      first_k_dense=1, shared_expert_ffn_size=12)
    assert (cfg.num_moe_layers, cfg.head_dim) == (2, 4)
    mlp = 6 * 16 * 3 * (40 * 1 + (8 * 2 + 12) * 2)  # 288 * 96 = 27648
    proj = 16 * (16 + 2 * 8) + 16 * 16  # 512 + 256 = 768
    core = 2 * 10 * 16 / 2  # 160
    attention = 6 * 3 * (proj + core)  # 18 * 928 = 16704
    logits = 6 * 16 * 100  # 9600
    assert mlp == 27648 and attention == 16704 and logits == 9600
    assert training_flops_per_token(cfg) == 53952 == mlp + attention + logits
    # the sequence length only moves core attention: s=20 adds 6 * 3 * 160 = 2880
    assert training_flops_per_token(cfg, seq_length=20) == 53952 + 2880
    assert model_flops_per_step(cfg, tokens=1000) == 53952 * 1000
    assert training_flops_per_token(cfg) == pytest.approx(independent_flops_per_token(cfg, 10), rel=1e-12)


def test_dense_only_config():
    # every layer dense (first_k_dense = num_layers): h=8, L=2, MHA 2 heads x 4 -> q=kv=8, f=24, s=6, V=50
    cfg = ModelConfig(vocab_size=50, hidden_size=8, num_layers=2, num_attention_heads=2, ffn_hidden_size=24,
                      seq_length=6, num_experts=4, moe_ffn_hidden_size=16, first_k_dense=2)
    assert cfg.num_moe_layers == 0
    mlp = 6 * 8 * 3 * 24 * 2  # 6912
    attention = 6 * 2 * (8 * (8 + 2 * 8) + 8 * 8 + 6 * 8)  # 12 * (192 + 64 + 48) = 3648
    logits = 6 * 8 * 50  # 2400
    assert training_flops_per_token(cfg) == mlp + attention + logits == 12960
    # the textbook form: 6 x matmul params (2 x (4*64 + 3*8*24) + 8*50 = 2064) + 6*L*s*q (576)
    assert 6 * 2064 + 6 * 2 * 6 * 8 == 12960
    assert training_flops_per_token(cfg) == independent_flops_per_token(cfg, 6)


def test_moe_with_shared_experts_and_tied_embeddings_match_param_count():
    cfg = ModelConfig(vocab_size=300, hidden_size=48, num_layers=4, num_attention_heads=6, num_kv_heads=3,
                      head_dim=16, ffn_hidden_size=96, seq_length=64, num_experts=8, moe_ffn_hidden_size=32,
                      topk=3, moe_layer_freq=[0, 1, 1, 0], shared_expert_ffn_size=64, tie_embeddings=True)
    assert cfg.num_moe_layers == 2
    assert training_flops_per_token(cfg) == pytest.approx(independent_flops_per_token(cfg, 64), rel=1e-12)
    # dropping the shared expert removes exactly 6 * h * 3 * f_shared * L_moe
    no_shared = cfg.replace(shared_expert_ffn_size=0)
    assert training_flops_per_token(cfg) - training_flops_per_token(no_shared) == 6 * 48 * 3 * 64 * 2


def test_mixtral_8x7b_per_token():
    cfg = ModelConfig.from_preset("mixtral-8x7b")
    ours = training_flops_per_token(cfg)
    # exact: against the parameters of the real model built on the meta device
    assert ours == pytest.approx(independent_flops_per_token(cfg, 4096), rel=1e-12)
    # by hand: per layer attention 2*4096*4096 + 2*4096*1024 = 41.9M, two active experts 2*3*4096*14336 = 352.3M
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 2 * 3 * 4096 * 14336
    matmul_params = 32 * per_layer + 32000 * 4096  # + LM head: 12.75e9
    core = 6 * 32 * 4096 * 4096  # 6 * L * s * q = 3.2e9
    assert ours == 6 * matmul_params + core
    # the published ~12.9B active parameters (embedding, router and norms included) give ~6 * 12.9e9 = 7.7e10 for
    # the matmuls; with core attention both land near 8e10 and within a few percent of each other
    published = 6 * 12.9e9 + core
    assert ours == pytest.approx(published, rel=0.03)
    assert 7.8e10 < ours < 8.1e10


def test_deepseek_v3_mla_terms():
    cfg = ModelConfig.from_preset("deepseek-v3")
    h, H, s, L = 7168, 128, 4096, 61
    # Megatron's MLA self-attention term per layer (q_lora 1536, kv_lora 512, nope 128, rope 64, v 128)
    q_term = 1536 * (h + H * (128 + 64) + 1)
    kv_term = 512 * (h + H * (128 + 128) + 1) + h * 64
    o_term = H * 128 * h
    core = s * H * (128 + 64) / 2 + s * H * 128 / 2
    attention = 6 * L * (q_term + kv_term + o_term + core)
    # 3 dense layers (f=18432), 58 MoE layers with top-8 of f_moe=2048 and one shared expert of 2048
    mlp = 6 * h * 3 * (18432 * 3 + (2048 * 8 + 2048) * 58)
    logits = 6 * h * 129280
    assert training_flops_per_token(cfg) == pytest.approx(mlp + attention + logits, rel=1e-12)
    # sanity: ~37B activated parameters (0.93B of them the embedding) -> 6 * 36.1e9 + core attention
    assert training_flops_per_token(cfg) == pytest.approx(6 * (37e9 - 129280 * h) + 6 * L * core, rel=0.03)


def test_seq_length_validation():
    with pytest.raises(ValueError, match="seq_length"):
        training_flops_per_token(ModelConfig(), seq_length=0)


@pytest.mark.parametrize("name, dtype, expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4e12),  # SXM
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989.4e12),
    ("NVIDIA H100 80GB HBM3", "fp8", 1978.9e12),
    ("NVIDIA H200", "bf16", 989.4e12),
    ("NVIDIA GH200 480GB", "bf16", 989.4e12),
    ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA A100 80GB PCIe", "fp16", 312e12),
    ("NVIDIA A100-SXM4-40GB", "fp8", None),  # no fp8 tensor cores
    ("NVIDIA H100 NVL", "bf16", None),  # lower clocks: not guessed
    ("NVIDIA H20", "bf16", None),  # not an H200
    ("NVIDIA GeForce RTX 4090", "bf16", None),
    ("cpu", "bf16", None),
])
def test_peak_flops(name, dtype, expected):
    assert peak_flops(name, dtype) == expected


def test_peak_is_dense_not_sparse():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert not math.isclose(peak_flops("NVIDIA H100 80GB HBM3"), 1979e12, rel_tol=0.01)


def test_mla_formula_counts_the_implemented_model():
    """The MLA terms equal the matmul weights of modules/mla.py (plus Megatron's two latent-norm '+1's) and its
    causal core attention (QK^T over nope + rope, AV over v)."""
    cfg = ModelConfig.from_preset("deepseek-v3", num_layers=4, vocab_size=1024)
    with torch.device("meta"):
        model = MoETransformer(cfg)
    s, H = cfg.seq_length, cfg.num_attention_heads
    attn = model.layers[0].attn
    assert type(attn).__name__ == "MLAttention"
    weights = sum(p.numel() for n, p in attn.named_parameters() if n.startswith("w"))
    norms = cfg.q_lora_rank + cfg.kv_lora_rank
    core = s * H * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) / 2 + s * H * cfg.v_head_dim / 2
    expected_attention = 6 * cfg.num_layers * (weights + norms + core)
    mlp_and_logits = training_flops_per_token(cfg.replace(attention_type="gqa", num_attention_heads=1,
                                                          num_kv_heads=1, head_dim=1, seq_length=s))
    gqa_attention = 6 * cfg.num_layers * (cfg.hidden_size * 3 + cfg.hidden_size + s * 1)  # the 1-head stand-in
    assert training_flops_per_token(cfg) == pytest.approx(mlp_and_logits - gqa_attention + expected_attention,
                                                          rel=1e-12)
