"""fc1's FP8 GEMM with the SwiGLU's per-expert FP8 copies made in its epilogue (``gluon_fp8_fc1_swiglu``), on an H100
or H200 (skipped elsewhere): the warp-specialized GEMM's h and ``triton_fp8_both.swiglu_both``'s copies, scales and
amaxes bit for bit, and a delayed FP8 training bit-identical with the epilogue on and off."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the Gluon FP8 kernels need SM 9.0")]

CASES = [([300, 0, 1024, 77], 5, 256, 512), ([1024] * 6, 0, 768, 2048), ([129, 1, 0, 640, 255], 0, 192, 272)]


@pytest.mark.parametrize("counts,tail,F,K", CASES)
@pytest.mark.parametrize("weighted", [False, True])
def test_fc1_swiglu_gives_the_gemm_and_the_swiglu_pass_bits(counts, tail, F, K, weighted):
    from lightning_moe.modules import gluon_fp8_fc1_swiglu as fk
    from lightning_moe.modules import gluon_fp8_grouped_ws as ws
    from lightning_moe.modules import triton_fp8_both as tb
    from lightning_moe.modules.expert_padding import fp8_rows_layout
    g = torch.Generator("cuda").manual_seed(len(counts) + F)
    L = len(counts)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    M = sum(counts) + tail
    x = (torch.randn(M, K, device="cuda", generator=g) * 8).to(torch.float8_e4m3fn)
    w = (torch.randn(L, 2 * F, K, device="cuda", generator=g) * 8).to(torch.float8_e4m3fn)
    sx = torch.rand(M, device="cuda", generator=g) * 1e-2 + 1e-3
    sw = torch.rand(L, 2 * F, device="cuda", generator=g) * 1e-2 + 1e-3
    p = torch.rand(M, device="cuda", generator=g) if weighted else None
    hist = torch.rand(3, L, device="cuda", generator=g) * 4 + 0.1
    _, poffs, P, gid_P = fp8_rows_layout(offs, M, 128)
    h, q, qt, inv_M, inv_L, amax = fk.fc1_swiglu(x, w, sx, sw, offs, p, hist, P)
    end, pend = int(offs[-1]), int(poffs[-1])
    ref_h = ws.grouped_mm(x, w, sx, sw, offs, config=ws.NARROW_CONFIG)
    assert torch.equal(h[:end], ref_h[:end])
    rq, rqt, rinv_M, rinv_L, ramax = tb.swiglu_both(ref_h, p, hist, offs, poffs, gid_P, P, align=128)
    assert torch.equal(q[:end].view(torch.uint8), rq[:end].view(torch.uint8))
    assert torch.equal(qt[:, :pend].view(torch.uint8), rqt[:, :pend].view(torch.uint8))
    assert torch.equal(inv_M[:end], rinv_M[:end]) and torch.equal(inv_L, rinv_L)
    assert torch.equal(amax, ramax)
    assert amax.min() >= 0 and (amax[torch.tensor(counts, device="cuda") == 0] == 0).all()


def _train(fc1: bool, monkeypatch, real, real_pass, calls: list):
    """Four delayed FP8 steps of the tiny MoE (bf16 weights): the losses and the second step's gradients (the
    epilogue runs from the second step on: the first use of fc2's input history takes an amax pass)."""
    from lightning_moe import FP8Training
    from lightning_moe.modules import fp8_grouped_both as both
    from lightning_moe.modules import gluon_fp8_fc1_swiglu as fk
    from lightning_moe.modules import triton_fp8_both as tb
    from tests.test_gpu_fp8 import _model
    monkeypatch.setattr(both, "FC1_SWIGLU", fc1)
    monkeypatch.setattr(fk, "fc1_swiglu", lambda *a, **k: calls.append("fc1") or real(*a, **k))
    monkeypatch.setattr(tb, "swiglu_both", lambda *a, **k: calls.append("pass") or real_pass(*a, **k))
    torch.manual_seed(1)
    lm = _model(FP8Training("delayed", fp8_format="e4m3", fast_accum="all"))
    lm.model.bfloat16()
    torch.manual_seed(0)
    tokens = torch.randint(0, 512, (4, 257), device="cuda")
    opt = torch.optim.AdamW(lm.model.parameters(), lr=1e-3)
    losses, grads = [], None
    for step in range(4):
        logits, aux = lm.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) + aux
        loss.backward()
        if step == 1:
            grads = {n: p.grad.clone() for n, p in lm.model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads


def test_delayed_training_bit_identical_with_the_swiglu_in_fc1s_epilogue(monkeypatch):
    """The epilogue gives the separate SwiGLU pass's bits, so training is bit-identical: four losses and every
    gradient of the second step (the router's probabilities weigh the SwiGLU). It runs in steps 2-4 of the MoE
    layer, and the SwiGLU takes its copies (no separate pass then)."""
    from lightning_moe.modules import gluon_fp8_fc1_swiglu as fk
    from lightning_moe.modules import triton_fp8_both as tb
    real, real_pass = fk.fc1_swiglu, tb.swiglu_both
    on_calls, off_calls = [], []
    off = _train(False, monkeypatch, real, real_pass, off_calls)
    on = _train(True, monkeypatch, real, real_pass, on_calls)
    # the copies are taken: the separate pass runs only at the history's first use
    assert on_calls == ["pass", "fc1", "fc1", "fc1"] and off_calls == ["pass"] * 4
    assert on[0] == off[0]
    for name, g in off[1].items():
        assert torch.equal(on[1][name], g), name
