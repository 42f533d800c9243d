"""GroupedExperts / SwiGLU / grouped_mm against per-expert Python-loop references (never the vectorised code)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from lightning_moe.modules.experts import GroupedExperts, SwiGLU, grouped_mm
from lightning_moe.modules.init import init_weights


# ------------------------------------------------------------------------------------------ references
def ref_grouped_mm(x_MK, w_LKN, counts):
    """Row block l of x times w[l], one expert at a time; rows past sum(counts) are absent."""
    outs, start = [], 0
    for l, c in enumerate(counts):
        outs.append(x_MK[start:start + c] @ w_LKN[l])
        start += c
    return torch.cat(outs)


def ref_experts(x_MD, w13, w2, counts):
    """SwiGLU per expert: silu(x @ gate) * (x @ up) @ down, gate/up = the two halves of w13 (columns)."""
    Fh = w13.shape[-1] // 2
    outs, start = [], 0
    for l, c in enumerate(counts):
        xs = x_MD[start:start + c]
        gate, up = w13[l][:, :Fh], w13[l][:, Fh:]
        outs.append((F.silu(xs @ gate) * (xs @ up)) @ w2[l])
        start += c
    return torch.cat(outs)


def make_experts(L, D, Ffull, dtype=torch.float32, seed=0, std=0.3, **kw):
    m = GroupedExperts(L, D, Ffull, init_std=std, out_std=std, **kw)
    m.reset_parameters_sharded(seed, "experts")
    return m.to(dtype)


COUNT_CASES = [
    [5, 0, 9, 2],  # an empty expert in the middle
    [0, 7, 1, 0],  # empty first and last experts
    [3, 11, 0, 6],
]


# ------------------------------------------------------------------------------------------ forward / backward
@pytest.mark.parametrize("counts", COUNT_CASES)
def test_grouped_experts_forward_and_grads_match_loop(counts):
    torch.manual_seed(1)
    L, D, Ffull = 4, 16, 24
    m = make_experts(L, D, Ffull)
    M = sum(counts)
    x = torch.randn(M, D, requires_grad=True)
    g = torch.randn(M, D)  # a non-trivial upstream gradient (not ones: that hides transposition bugs)

    y = m(x, torch.tensor(counts))
    (y * g).sum().backward()

    x_r = x.detach().clone().requires_grad_()
    w13_r = m.w13.detach().clone().requires_grad_()
    w2_r = m.w2.detach().clone().requires_grad_()
    y_r = ref_experts(x_r, w13_r, w2_r, counts)
    (y_r * g).sum().backward()

    assert y.shape == (M, D)
    torch.testing.assert_close(y, y_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x_r.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.w13.grad, w13_r.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.w2.grad, w2_r.grad, rtol=1e-5, atol=1e-5)
    # an expert with no tokens gets an exactly-zero weight gradient
    for l, c in enumerate(counts):
        if c == 0:
            assert torch.count_nonzero(m.w13.grad[l]) == 0 and torch.count_nonzero(m.w2.grad[l]) == 0
        else:
            assert torch.count_nonzero(m.w13.grad[l]) > 0


def test_has_tail_rows_are_exactly_zero_even_when_poisoned():
    torch.manual_seed(2)
    L, D, Ffull = 4, 16, 24
    counts = [4, 0, 6, 3]
    M, tail = sum(counts), 5
    m = make_experts(L, D, Ffull)
    x_valid = torch.randn(M, D)
    poison = torch.randn(tail, D) * 1e30
    poison[0] = float("nan")
    poison[2, 3] = float("inf")
    x = torch.cat([x_valid, poison]).requires_grad_()
    g = torch.randn(M + tail, D)

    y = m(x, torch.tensor(counts), has_tail=True)
    (y * g).sum().backward()

    assert torch.equal(y[M:], torch.zeros(tail, D))
    assert torch.equal(x.grad[M:], torch.zeros(tail, D))
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    assert torch.isfinite(m.w13.grad).all() and torch.isfinite(m.w2.grad).all()

    # the valid rows, their gradient and the weight gradients are those of the tail-free reference
    x_r = x_valid.clone().requires_grad_()
    w13_r = m.w13.detach().clone().requires_grad_()
    w2_r = m.w2.detach().clone().requires_grad_()
    y_r = ref_experts(x_r, w13_r, w2_r, counts)
    (y_r * g[:M]).sum().backward()
    torch.testing.assert_close(y[:M], y_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad[:M], x_r.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.w13.grad, w13_r.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.w2.grad, w2_r.grad, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ fallback path
@pytest.mark.parametrize("dtype,K", [(torch.float64, 8), (torch.float32, 6)])  # float64; fp32 with 24-byte rows
def test_grouped_mm_fallback_matches_loop(dtype, K):
    torch.manual_seed(3)
    counts = [3, 0, 5, 2, 0]
    M, N = sum(counts), 6  # N * 4 bytes = 24: not 16-byte aligned in float32 either
    x = torch.randn(M + 2, K, dtype=dtype)  # two tail rows (undefined output, must not break the valid rows)
    w = torch.randn(len(counts), K, N, dtype=dtype)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    y = grouped_mm(x, w, offs)
    assert y.dtype == dtype and y.shape == (M + 2, N)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(y[:M], ref_grouped_mm(x, w, counts), rtol=tol, atol=tol)


def test_grouped_experts_float64_matches_loop_and_gradcheck():
    torch.manual_seed(4)
    L, D, Ffull = 3, 4, 6
    counts = torch.tensor([2, 0, 3])
    m = make_experts(L, D, Ffull, dtype=torch.float64, std=0.5)
    x = torch.randn(int(counts.sum()), D, dtype=torch.float64)
    torch.testing.assert_close(m(x, counts), ref_experts(x, m.w13, m.w2, counts.tolist()), rtol=1e-12, atol=1e-12)

    w13 = m.w13.detach().clone().requires_grad_()
    w2 = m.w2.detach().clone().requires_grad_()

    def fn(x_, w13_, w2_):
        return functional_call(m, {"w13": w13_, "w2": w2_}, (x_, counts))

    assert torch.autograd.gradcheck(fn, (x.clone().requires_grad_(), w13, w2), eps=1e-6, atol=1e-7, rtol=1e-5)

    # with a tail: tail rows contribute nothing, in value or gradient
    x_tail = torch.cat([x, torch.randn(2, D, dtype=torch.float64)]).requires_grad_()

    def fn_tail(x_, w13_, w2_):
        return functional_call(m, {"w13": w13_, "w2": w2_}, (x_, counts), {"has_tail": True})

    assert torch.autograd.gradcheck(fn_tail, (x_tail, w13, w2), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_grouped_experts_backward_with_expanded_grad():
    torch.manual_seed(5)
    m = make_experts(4, 16, 24)
    x = torch.randn(12, 16, requires_grad=True)
    m(x, torch.tensor([3, 0, 5, 4])).sum().backward()
    x_r = x.detach().clone().requires_grad_()
    ref_experts(x_r, m.w13.detach(), m.w2.detach(), [3, 0, 5, 4]).sum().backward()
    torch.testing.assert_close(x.grad, x_r.grad, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ dense SwiGLU
def _init(m, seed, name):
    init_weights(torch.nn.ModuleDict({name: m}), seed)  # as the model does: every submodule under its own name


def test_swiglu_matches_formula():
    torch.manual_seed(6)
    D, Fh = 12, 20
    m = SwiGLU(D, Fh, init_std=0.3, out_std=0.3)
    _init(m, 7, "mlp")
    x = torch.randn(2, 5, D)
    gate_w, up_w = m.w13.weight[:Fh], m.w13.weight[Fh:]  # nn.Linear stores (out, in)
    expected = (F.silu(x @ gate_w.T) * (x @ up_w.T)) @ m.w2.weight.T
    torch.testing.assert_close(m(x), expected, rtol=1e-5, atol=1e-6)
    # the gate half really goes through silu: swapping the halves changes the result
    swapped = (F.silu(x @ up_w.T) * (x @ gate_w.T)) @ m.w2.weight.T
    assert not torch.allclose(m(x), swapped, atol=1e-4)


def test_swiglu_init_is_seeded_and_named():
    a, b, c = SwiGLU(8, 16), SwiGLU(8, 16), SwiGLU(8, 16)
    _init(a, 3, "x")
    _init(b, 3, "x")
    _init(c, 3, "y")
    assert torch.equal(a.w13.weight, b.w13.weight) and torch.equal(a.w2.weight, b.w2.weight)
    assert not torch.equal(a.w13.weight, c.w13.weight)
    assert abs(a.w13.weight.std().item() - 0.02) < 0.005


# ------------------------------------------------------------------------------------------ layout invariance
@pytest.mark.parametrize("offset,etp_rank", [(2, 1), (0, 0), (2, 0)])
def test_init_is_layout_invariant(offset, etp_rank):
    D, Ffull, seed, name = 8, 12, 11, "layers.0.ffn.experts"
    full = GroupedExperts(4, D, Ffull)
    full.reset_parameters_sharded(seed, name)
    part = GroupedExperts(num_local_experts=2, hidden=D, ffn_full=Ffull, expert_offset=offset, etp_rank=etp_rank,
                          etp_size=2)
    part.reset_parameters_sharded(seed, name)

    Fs = Ffull // 2
    cols = slice(etp_rank * Fs, (etp_rank + 1) * Fs)
    experts = slice(offset, offset + 2)
    gate_full, up_full = full.w13[experts, :, :Ffull], full.w13[experts, :, Ffull:]
    expected_w13 = torch.cat([gate_full[..., cols], up_full[..., cols]], dim=-1)  # [gate_shard | up_shard]
    expected_w2 = full.w2[experts, cols, :]
    assert part.w13.shape == (2, D, 2 * Fs) and part.w2.shape == (2, Fs, D)
    assert torch.equal(part.w13, expected_w13)
    assert torch.equal(part.w2, expected_w2)
    # and the full model's experts differ from each other (the expert index is part of the seed)
    assert not torch.equal(full.w13[0], full.w13[1])
