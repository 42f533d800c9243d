"""Extreme routing on one process: every token to the same two experts (their expert bias dwarfs every sigmoid score).
Dropless keeps every copy on those experts and trains; capacity keeps exactly each expert's capacity and drops the
rest, and the model's load metrics report that fraction. (EP2 parity of both: tests/parallel/test_ep_parity.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_moe import MoELanguageModel

OVR = dict(seq_length=32, num_layers=1, hidden_size=32, num_attention_heads=2, num_kv_heads=2, ffn_hidden_size=64,
           moe_ffn_hidden_size=32, num_experts=8, topk=2, score_function="sigmoid", expert_bias=True,
           bias_update_rate=0.0, vocab_size=64)


@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity"])
def test_all_tokens_to_two_experts(capacity_factor):
    lm = MoELanguageModel(preset="tiny", overrides=dict(OVR, capacity_factor=capacity_factor), seed=2)
    lm.configure_model()
    moe = lm.model.moe_layers()[0]
    moe.router.expert_bias[:2] = 100.0
    tokens = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    loss, aux = lm.model.loss(tokens[:, :-1], tokens[:, 1:])
    (loss + aux).backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in lm.parameters() if p.grad is not None)
    T, k, E = 64, 2, 8
    counts = moe.last_stats["tokens_per_expert"]
    if capacity_factor is None:  # dropless: every copy on experts 0 and 1
        assert counts.tolist() == [T, T] + [0] * (E - 2) and int(moe.last_stats["num_dropped"]) == 0
        return
    cap = math.ceil(T * k / E * capacity_factor)
    assert counts.tolist() == [cap, cap] + [0] * (E - 2)
    assert int(moe.last_stats["num_dropped"]) == T * k - 2 * cap
    metrics = lm.expert_load_metrics()
    assert float(metrics["load/layer0/dropped"]) == pytest.approx((T * k - 2 * cap) / (T * k))
    assert float(metrics["load/layer0/expert0"]) == pytest.approx(cap / (T * k))
