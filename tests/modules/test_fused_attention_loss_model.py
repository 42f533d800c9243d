"""A tiny Qwen3-style model (q/k norms) with the fused RoPE and the fused loss on, under the Triton interpreter: the
loss and every gradient against the same model with both off (the torch reference), and ``Recompute(["layernorm"])``
(which rebuilds the fused RoPE's outputs in backward) bit-identical to no recompute. Skipped without triton (CI);
the GPU runs are ``tests/test_gpu_activations.py`` and ``tests/test_gpu.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.modules.interpreted import INSIDE, run_interpreted

MODEL = dict(seq_length=16, num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
             moe_ffn_hidden_size=32, num_experts=4, topk=2, first_k_dense=1, vocab_size=96, qk_norm=True)


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_model_under_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(__file__, k="interpreted", passed=1)


def _grads(fused: bool, recompute: bool = False):
    from lightning_moe import MoELanguageModel, Recompute
    lm = MoELanguageModel(preset="tiny", overrides=dict(MODEL, rope_fusion=fused, cross_entropy_fusion=fused), seed=3)
    lm.configure_model()
    cb = Recompute(["layernorm"]) if recompute else None
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
def test_fused_rope_and_loss_in_a_model_interpreted():
    ref_loss, ref = _grads(False)
    loss, got = _grads(True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert got.keys() == ref.keys() and any("q_norm" in n for n in got)
    for n, g in got.items():
        assert ((g - ref[n]).norm() / ref[n].norm().clamp_min(1e-12)).item() < 1e-4, n
    again_loss, again = _grads(True, recompute=True)  # the fused RoPE rebuilt in backward: the same bits
    assert torch.equal(again_loss, loss) and all(torch.equal(again[n], g) for n, g in got.items())
