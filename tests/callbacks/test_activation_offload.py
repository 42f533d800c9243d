"""ActivationOffload on CPU: what it refuses, each before training with one clear error (it needs CUDA; its GPU tests
are in tests/test_gpu_activations.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_moe import ActivationOffload, MoELanguageModel


def _trainer(device="cpu", graphs=False):
    return SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device(device), cuda_graphs=graphs))


@pytest.mark.parametrize("kw,match", [
    (dict(modules=["experts"]), r"unknown module 'experts'; valid: attn_norm, core_attn, attn_proj, mlp_norm, "
                                r"expert_fc1, moe_act"),
    (dict(layers=2.5), r"layers=2.5"),
])
def test_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        ActivationOffload(**kw)


def test_refused_without_cuda_and_with_cuda_graphs():
    lm = MoELanguageModel(preset="tiny", overrides=dict(num_layers=2, hidden_size=32))
    lm.configure_model()
    with pytest.raises(ValueError, match="ActivationOffload needs CUDA devices .* this run is on cpu"):
        ActivationOffload().on_fit_start(_trainer(), lm)
    with pytest.raises(ValueError, match="cannot be combined with MoEFoldStrategy\\(cuda_graphs=True\\)"):
        ActivationOffload().on_fit_start(_trainer("cuda", graphs=True), lm)
    with pytest.raises(ValueError, match="layer 5 is out of range"):
        ActivationOffload(layers=[5]).on_fit_start(_trainer("cuda"), lm)
