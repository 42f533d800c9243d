"""FP8Training's weight cache on the GPU (skipped without Hopper): the micro-batches of a step reuse the quantized
expert weights and give the same numbers as quantizing each time; a new step re-quantizes the changed weights."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.modules import fp8_grouped_kernels as k
from lightning_moe.modules.fp8_linear import FP8Spec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or not k.available(
    torch.device("cuda")), reason="torch._scaled_grouped_mm needs SM 9.0")]


def _step(x, w, offs, dy, spec):
    xg, wg = x.clone().requires_grad_(), w.requires_grad_()
    y = k.scaled_grouped_mm(xg, wg, offs, spec)
    y.backward(dy)
    grads = (y.detach(), xg.grad, wg.grad.clone())
    wg.grad = None
    return grads


@pytest.mark.parametrize("fused", [True, False])
def test_cached_weights_give_the_uncached_numbers_and_follow_the_step(fused, monkeypatch):
    monkeypatch.setattr(k, "FUSED_QUANT", fused)
    g = torch.Generator(device="cuda").manual_seed(0)
    L, K, N, M = 16, 512, 256, 8192
    offs = torch.linspace(0, M, L + 1, device="cuda")[1:].round().to(torch.int32)
    w = (torch.randn(L, K, N, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    micro = [(torch.randn(M, K, generator=g, device="cuda").to(torch.bfloat16),
              torch.randn(M, N, generator=g, device="cuda").to(torch.bfloat16)) for _ in range(2)]
    cached, plain = FP8Spec("rowwise", step=0), FP8Spec("rowwise")
    for x, dy in micro:
        for a, b in zip(_step(x, w, offs, dy, cached), _step(x, w, offs, dy, plain)):
            assert torch.equal(a, b)
    # the rowwise Triton quantizers make both copies in one call (triton_fp8_weights); torch's, one per GEMM
    key = "w_both" if k._weight_kernels(cached, w) is not None else "w"
    assert set(cached.weights) == ({key} if key == "w_both" else {"w", "w_t"}) and not plain.weights
    held = cached.weights[key][2][0]
    _step(*micro[0][:1], w, offs, micro[0][1], cached)
    assert cached.weights[key][2][0] is held  # reused within the step
    with torch.no_grad():
        w.mul_(1.5)  # the optimizer step
    cached.step = 1
    for a, b in zip(_step(micro[1][0], w, offs, micro[1][1], cached), _step(micro[1][0], w, offs, micro[1][1], plain)):
        assert torch.equal(a, b)
    assert cached.weights[key][2][0] is not held
