"""Emulated NVFP4 GEMMs (forward, dgrad, wgrad) against float64, dense and grouped; the experts' padded token layout
and the random Hadamard transform leave the exact wgrad unchanged (checked with quantization switched off)."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.modules import nvfp4_linear as nl
from lightning_moe.modules.nvfp4_linear import NVFP4Spec, make_hadamard, nvfp4_grouped_mm, nvfp4_linear

OFFS = [10, 30, 55, 70]  # 4 experts of 10, 20, 25 and 15 tokens: no 16-token chunk fits an expert exactly


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def _grouped_ref(x, w, dy):
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    starts = [0] + OFFS[:-1]
    yd = torch.cat([xd[s:e] @ wd[i] for i, (s, e) in enumerate(zip(starts, OFFS))])
    yd.backward(dy.double())
    return yd.detach(), xd.grad, wd.grad


@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("stochastic", [False, True])
def test_emulated_gemms_against_float64(hadamard, stochastic):
    g = torch.Generator().manual_seed(0)
    spec = NVFP4Spec(make_hadamard(0) if hadamard else None, stochastic)
    x, w = torch.randn(100, 64, generator=g).requires_grad_(), (torch.randn(32, 64, generator=g) * 0.1).requires_grad_()
    y = nvfp4_linear(x, w, spec)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (xd @ wd.t()).backward(dy.double())
    errs = [_rel(y, xd.detach() @ wd.detach().t()), _rel(x.grad, xd.grad), _rel(w.grad, wd.grad)]
    assert all(0.03 < e < 0.25 for e in errs), errs  # E2M1 keeps about two significant bits
    x, w = torch.randn(70, 64, generator=g).requires_grad_(), (torch.randn(4, 64, 48, generator=g) * 0.1).requires_grad_()
    y = nvfp4_grouped_mm(x, w, torch.tensor(OFFS, dtype=torch.int32), spec)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    ref = _grouped_ref(x, w, dy)
    errs = [_rel(y, ref[0]), _rel(x.grad, ref[1]), _rel(w.grad, ref[2])]
    assert all(0.03 < e < 0.25 for e in errs), errs


def test_padded_layout_and_hadamard_keep_the_exact_wgrad(monkeypatch):
    """Quantization off: the experts' wgrad through the padded layout (16-token chunks within each expert) and the
    random Hadamard transform is the exact per-expert x^T dy; a transform across two experts' tokens would not be."""
    monkeypatch.setattr(nl, "fake_quantize", lambda x, **kw: x.float())
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(70, 64, generator=g), torch.randn(70, 48, generator=g)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    exact = torch.stack([x[s:e].double().t() @ dy[s:e].double() for s, e in zip([0] + OFFS[:-1], OFFS)])
    for spec in (NVFP4Spec(None), NVFP4Spec(make_hadamard(3))):
        torch.testing.assert_close(nl._expert_wgrad(x, dy, offs, spec).double(), exact, rtol=1e-5, atol=1e-5)
