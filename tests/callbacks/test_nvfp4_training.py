"""NVFP4Training (emulated) on one process: it trains the tiny MoE to within 5 % of the fp32 loss over 40 steps while
changing the numbers; the last layers stay out; refusals, each before training with one clear error."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_moe import MoELanguageModel, NVFP4Training
from tests.callbacks.test_fp8_training import MODEL, _fit


def test_trains_close_to_fp32(tokens, tmp_path):
    ref = _fit(tokens, str(tmp_path), [])
    losses = _fit(tokens, str(tmp_path), [NVFP4Training(bf16_last_layers=0)])
    end = sum(ref[-5:]) / 5
    assert losses != ref
    assert abs(sum(losses[-5:]) / 5 - end) <= 0.05 * end, (losses[-5:], ref[-5:])


def _start(cb, lm):
    cb.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu"))), lm)


def _lm(**kw):
    lm = MoELanguageModel(preset="tiny", overrides={**MODEL, **kw})
    lm.configure_model()
    return lm


def test_last_layers_and_head_stay_out():
    lm = _lm()
    cb = NVFP4Training(bf16_last_layers=1)
    _start(cb, lm)
    swapped = {n for n, m in lm.named_modules() if "_mm" in vars(m)}
    assert "model.layers.0.attn.wq" in swapped and "model.layers.0.ffn.w13" in swapped
    assert not [n for n in swapped if n.startswith("model.layers.1.") or n == "model.head"]
    cb.teardown(None, lm, "fit")
    assert not any("_mm" in vars(m) for m in lm.modules())


def test_refusals():
    with pytest.raises(ValueError, match="kernels='fp4'"):
        NVFP4Training(kernels="fp4")
    with pytest.raises(ValueError, match="bf16_last_layers=-1"):
        NVFP4Training(bf16_last_layers=-1)
    with pytest.raises(ValueError, match="kernels='real'.*cpu has no FP4 tensor cores"):
        _start(NVFP4Training(kernels="real"), _lm())
    with pytest.raises(ValueError, match=r"attn.wq: 120 x 120 is not a multiple of NVFP4's 16 x 16"):
        _start(NVFP4Training(bf16_last_layers=0), _lm(hidden_size=120, num_attention_heads=4))
