"""``ModelConfig.probs_in_experts``: the router probabilities weight each expert row after the SwiGLU (Megatron's
weighted SwiGLU) instead of the combine's weighted sum. Same layer outputs and gradients as the weighted combine (up
to float rounding), on every dispatcher layout of one rank, and the layer no longer keeps the experts' output."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.modules.experts import SwiGLUActivation, swiglu
from lightning_moe.modules.permute import combine_rows, gather_tokens, row_probs
from tests.modules.test_moe_layer import cfg_, make_layer

LAYOUTS = {
    "dropless": dict(),
    "capacity": dict(capacity_factor=1.0),
    "padded": dict(capacity_factor=1.0, pad_to_capacity=True),
    "aligned16": dict(expert_rows_align=16),
    "allgather_capacity": dict(dispatcher="allgather", capacity_factor=1.0),
    "dedup": dict(dispatcher="alltoall_dedup"),
    "shared_sigmoid_bias": dict(shared_expert_ffn_size=16, score_function="sigmoid", expert_bias=True),
}


def _run(over: dict, probs_in_experts: bool, x_BSD: torch.Tensor):
    layer = make_layer(cfg_(probs_in_experts=probs_in_experts, **over))
    x = x_BSD.clone().requires_grad_()
    y, aux = layer(x)
    (y.square().mean() + aux).backward()
    return y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_weighting_in_the_experts_equals_weighting_in_the_combine(name):
    x = torch.randn(2, 12, 16, generator=torch.Generator().manual_seed(1))
    y0, gx0, g0 = _run(LAYOUTS[name], False, x)
    y1, gx1, g1 = _run(LAYOUTS[name], True, x)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)
    assert g0.keys() == g1.keys() and any("router" in n for n in g1)  # the probabilities' gradient reaches it
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6, msg=n)


def _saved_bytes(layer, x) -> int:
    total = 0

    def pack(t):
        nonlocal total
        if not (t.requires_grad and t.is_leaf):  # activations, not parameters
            total += t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return total


def test_the_layer_keeps_no_expert_output():
    over = dict(hidden_size=64, moe_ffn_hidden_size=32, num_experts=4, topk=2)
    x = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(0), requires_grad=True)
    kept = {p: _saved_bytes(make_layer(cfg_(probs_in_experts=p, **over)), x) for p in (False, True)}
    rows, D = 2 * 32 * 2, 64
    # the combine kept the experts' (rows x D) float32 output; the weighted SwiGLU keeps one float32 per row, and
    # the probabilities' scatter its int64 row index
    assert kept[False] - kept[True] == rows * D * 4 - rows * 4 - rows * 8


def test_weighted_swiglu_gradients_in_float64():
    h = torch.randn(7, 10, dtype=torch.float64, requires_grad=True)
    p = torch.rand(7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda h, p: swiglu(h, p, fused=False), (h, p))
    act = SwiGLUActivation()
    with torch.no_grad():  # the eval path computes the same
        torch.testing.assert_close(act(h, p), swiglu(h.detach(), p.detach()))


def test_row_probs_and_the_plain_sum_of_copies():
    T, K, D = 5, 2, 3
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g)
    rows = torch.randperm(T * K, generator=g).view(T, K)
    src = torch.empty(T * K, dtype=torch.long)
    src[rows.reshape(-1)] = torch.arange(T).repeat_interleave(K)
    keep = torch.rand(T, K, generator=g) > 0.3
    probs = torch.rand(T, K, generator=g, requires_grad=True)
    p_N = row_probs(probs, rows, keep, T * K)
    assert torch.equal(p_N[rows[keep]], probs[keep].detach()) and (p_N[rows[~keep]] == 0).all()
    p_N.sum().backward()
    assert torch.equal(probs.grad, keep.float())  # dropped copies get no gradient
    y = torch.randn(T * K, D, generator=g, requires_grad=True)
    out = combine_rows(y, None, rows, keep, src_N=src, fused=False)
    ref = combine_rows(y, torch.ones(T, K), rows, keep, fused=False)
    torch.testing.assert_close(out, ref)
    gy, = torch.autograd.grad(out, y, torch.ones_like(out))
    # every row gets its token's gradient, kept or not (the experts mask rows past their counts)
    assert torch.equal(gy, torch.ones_like(gy))
    assert gather_tokens(x, src, rows).shape == (T * K, D)
