"""A tiny Qwen3-style model (q/k norms), and one with MLA, with the fused RoPE and the fused loss on, under the Triton
interpreter: the loss and every gradient against the same model with both off (the torch reference), and
``Recompute(["layernorm"])`` / ``["mla_up_proj"]`` (which rebuild the fused RoPE's outputs in backward)
bit-identical to no recompute. Skipped without triton (CI);
the GPU runs are ``tests/test_gpu_activations.py`` and ``tests/test_gpu.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.modules.interpreted import INSIDE, run_interpreted

MODEL = dict(seq_length=16, num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
             moe_ffn_hidden_size=32, num_experts=4, topk=2, first_k_dense=1, vocab_size=96, qk_norm=True)
MLA = dict(MODEL, qk_norm=False, attention_type="mla", kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8,
           qk_rope_head_dim=4, v_head_dim=8)
ATTENTION = {"gqa": (MODEL, "layernorm"), "mla": (MLA, "mla_up_proj")}


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_model_under_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(__file__, k="interpreted", passed=len(ATTENTION))


def _grads(attn: str, fused: bool, recompute: bool = False):
    from lightning_moe import MoELanguageModel, Recompute
    model, module = ATTENTION[attn]
    lm = MoELanguageModel(preset="tiny", overrides=dict(model, rope_fusion=fused, cross_entropy_fusion=fused), seed=3)
    lm.configure_model()
    cb = Recompute([module]) if recompute else None
    if cb is not None:
        cb.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(cuda_graphs=False)), lm)
    tokens = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    labels = tokens[:, 1:].clone()
    labels[0, :3] = -100  # ignored targets
    lm_loss, aux = lm.model.loss(tokens[:, :-1], labels)
    (lm_loss + aux).backward()
    if cb is not None:
        cb.teardown(None, lm, "fit")
    return lm_loss.detach(), {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}


@pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")
@pytest.mark.parametrize("attn", list(ATTENTION))
def test_fused_rope_and_loss_in_a_model_interpreted(attn):
    ref_loss, ref = _grads(attn, False)
    loss, got = _grads(attn, True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert got.keys() == ref.keys() and any(("q_norm" if attn == "gqa" else "wkv_a") in n for n in got)
    for n, g in got.items():
        assert ((g - ref[n]).norm() / ref[n].norm().clamp_min(1e-12)).item() < 1e-4, n
    again_loss, again = _grads(attn, True, recompute=True)  # the fused RoPE rebuilt in backward: the same bits
    assert torch.equal(again_loss, loss) and all(torch.equal(again[n], g) for n, g in got.items())
