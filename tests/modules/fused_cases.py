"""Fused kernels against their torch references, one function per kernel family, for any device: the GPU tests
(``tests/test_gpu_fused.py``) run them on CUDA over a grid of shapes, ``test_fused_interpret.py`` on CPU tensors
under the Triton interpreter.

Random inputs have no ties, so the top-k sets are compared exactly; router values within 1e-6 (the kernel's exp
and sums round differently from torch's), gradients within 1e-6 absolute.
"""

from __future__ import annotations

import torch

from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.dispatcher import TokenDispatcher
from lightning_moe.modules.expert_order import expert_order, resort_by_expert
from lightning_moe.modules.router import RouterOutput, TopKRouter, apply_capacity, expert_capacity
from lightning_moe.strategy.parallel_context import ParallelContext


def _close(a, b, atol=1e-6, rtol=1e-5, what=""):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def check_router(device: str, T: int, E: int, B: int = 2, seed: int = 0, **kw) -> None:
    """TopKRouter with router_fusion on and off: selections, gates, counts, losses and the logits' gradient."""
    g = torch.Generator().manual_seed(seed)
    x_TD = (torch.randn(T, E, generator=g) * 1.5).to(device)
    bias_E = (torch.randn(E, generator=g) * 0.05).to(device)
    w_TK = torch.randn(T, kw.get("topk", 2), generator=g).to(device)
    runs = {}
    for fused in (True, False):
        cfg = ModelConfig(hidden_size=E, num_experts=E, router_fusion=fused, **kw)
        r = TopKRouter(cfg).to(device).train()
        with torch.no_grad():  # identity weight: the logits are x, so x.grad is the logits' gradient
            r.weight.copy_(torch.eye(E, device=device))
            if r.expert_bias is not None:
                r.expert_bias.copy_(bias_E)
        x = x_TD.clone().requires_grad_()
        out = r(x, num_sequences=B)
        loss = (out.probs_TK * w_TK).sum() + 10 * out.aux_loss + 10 * out.z_loss
        loss.backward()
        runs[fused] = out, x.grad
    (f, gf), (ref, gref) = runs[True], runs[False]
    assert torch.equal(f.experts_TK, ref.experts_TK), "selected experts differ"
    _close(f.probs_TK, ref.probs_TK, what="probs")
    assert torch.equal(f.tokens_per_expert_E, ref.tokens_per_expert_E), "tokens per expert differ"
    assert torch.equal(f.num_dropped, ref.num_dropped)
    assert (f.keep_TK is None) == (ref.keep_TK is None)
    if f.keep_TK is not None:
        assert torch.equal(f.keep_TK, ref.keep_TK)
    _close(f.aux_loss, ref.aux_loss, what="aux loss")
    _close(f.z_loss, ref.z_loss, what="z loss")
    _close(gf, gref, what="logits grad")


def check_expert_order(device: str, N: int, E: int, div: int = 1, align: int = 1, stride: int = 0,
                       drop: float = 0.0, seed: int = 0) -> None:
    """The count/prefix-sum/scatter kernels equal the argsort reference exactly."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, E, (N,), generator=g)
    if drop:
        keys = torch.where(torch.rand(N, generator=g) < drop, E, keys)
    if stride:  # padded capacity: at most `stride` copies per expert survive
        rank = torch.empty(N, dtype=torch.int64)
        for e in range(E + 1):  # test input only
            idx = (keys == e).nonzero().flatten()
            rank[idx] = torch.arange(len(idx))
        keys = torch.where(rank < stride, keys, E)
    keys = keys.to(device)
    a = expert_order(keys, E, div=div, align=align, stride=stride, fused=True)
    b = expert_order(keys, E, div=div, align=align, stride=stride, fused=False)
    for name in ("rows_N", "src_R", "counts_E", "sizes_E"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    if align > 1:  # every group starts on a multiple of align
        starts = b.sizes_E.cumsum(0) - b.sizes_E
        assert bool((starts % align == 0).all())


def check_resort(device: str, S: int, L: int, align: int = 1, empty: float = 0.3, seed: int = 0) -> None:
    """The receiver's re-sort kernel equals the torch reference and the stable argsort it replaced."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 9, (S, L), generator=g) * (torch.rand(S, L, generator=g) >= empty)
    M = int(counts.sum())
    counts = counts.to(device)
    dest_f, sizes_f, R = resort_by_expert(counts, M, align, fused=True)
    dest_r, sizes_r, _ = resort_by_expert(counts, M, align, fused=False)
    assert torch.equal(dest_f, dest_r) and torch.equal(sizes_f, sizes_r)
    if align == 1:  # the argsort formulation it replaced
        expert_M = torch.repeat_interleave(torch.arange(L, device=device).repeat(S), counts.flatten())
        order = torch.argsort(expert_M, stable=True)
        assert torch.equal(dest_r[order], torch.arange(M, device=device))
    assert R >= int(sizes_r.sum())


def check_dispatch(device: str, T: int, D: int, E: int, topk: int, dtype=torch.float32, seed: int = 0,
                   **kw) -> None:
    """Single-rank dispatch -> a row-wise 'expert' -> combine, permute_fusion on and off: outputs and gradients.
    With ``probs_in_experts`` (the default) the 'expert' weights its rows by ``st.probs_M`` and the combine sums.

    Both paths round differently (the kernels accumulate in fp32 in another order; the probs gradient is a dot over
    D), so each is measured against a float64 run of the reference on the same rounded inputs: the fused error must
    stay within twice the reference's plus a few units of the format, and within the format's bound."""
    g = torch.Generator().manual_seed(seed)
    x_TD = torch.randn(T, D, generator=g).to(dtype)
    logits = torch.randn(T, E, generator=g)
    scale_M = torch.randn(T * topk + E * 64, 1, generator=g).to(dtype)  # a per-row weight as the expert
    gy = torch.randn(T, D, generator=g).to(dtype)
    runs = {}
    for name, fused, dt in (("fused", True, dtype), ("ref", False, dtype), ("exact", False, torch.float64)):
        cfg = ModelConfig(hidden_size=D, num_experts=E, topk=topk, permute_fusion=fused, **kw)
        probs_TK, experts_TK = torch.softmax(logits.to(device), -1).topk(topk, -1)
        keep_TK = None
        if cfg.capacity_factor is not None:
            keep_TK = apply_capacity(probs_TK, experts_TK, E, expert_capacity(T, E, topk, cfg.capacity_factor),
                                     cfg.drop_policy)
        route = RouterOutput(probs_TK.to(torch.float64 if dt == torch.float64 else torch.float32)
                             .clone().requires_grad_(), experts_TK, keep_TK, torch.zeros(()), torch.zeros(()),
                             torch.zeros(E), torch.zeros(()))
        d = TokenDispatcher(cfg, ParallelContext.single())
        x = x_TD.to(device, dt, copy=True).requires_grad_()
        x_MD, sizes_L, st = d.dispatch(x, route)
        y_MD = x_MD * scale_M[: x_MD.shape[0]].to(device, dt)
        if st.probs_M is not None:  # probs_in_experts: the experts weight their rows, the combine sums
            y_MD = y_MD * st.probs_M.unsqueeze(1).to(dt)
            st.probs_applied = True
        y = d.combine(y_MD, st)
        y.backward(gy.to(device, dt))
        runs[name] = y.detach().double(), x.grad.double(), route.probs_TK.grad.double(), x_MD.detach(), sizes_L
    f, r, ex = runs["fused"], runs["ref"], runs["exact"]
    assert torch.equal(f[4], r[4]), "group sizes differ"
    n = int(r[4].sum())  # rows past the groups are undefined (dropped copies, padding bound)
    assert torch.equal(f[3][:n], r[3][:n]), "permuted rows differ"
    eps = torch.finfo(dtype).eps
    for i, what in enumerate(("combined output", "x grad", "probs grad")):
        scale = float(ex[i].abs().max()) or 1.0
        err_f, err_r = float((f[i] - ex[i]).abs().max()), float((r[i] - ex[i]).abs().max())
        assert err_f <= 2 * err_r + 4 * eps * scale, f"{what}: fused error {err_f:.3g}, reference {err_r:.3g}"
        assert err_f <= 64 * eps * scale, f"{what}: fused error {err_f:.3g} over the bound, max |value| {scale:.3g}"
