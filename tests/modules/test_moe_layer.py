"""Single-rank MoELayer against a per-token loop reference built from the router's own output."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from lightning_moe.modules.config import ModelConfig
from lightning_moe.modules.dispatcher import TokenDispatcher, build_dispatcher
from lightning_moe.modules.dispatchers import AllGatherDispatcher, AllToAllDispatcher
from lightning_moe.modules.experts import SwiGLU
from lightning_moe.modules.init import init_weights
from lightning_moe.modules.moe_layer import MoELayer
from lightning_moe.strategy.parallel_context import ParallelContext


class CustomDispatcher(AllToAllDispatcher):
    """A user dispatcher reached through a class path."""
    built = 0

    def __init__(self, cfg, ctx):
        super().__init__(cfg, ctx)
        CustomDispatcher.built += 1


# ------------------------------------------------------------------------------------------ helpers / reference
def cfg_(**kw) -> ModelConfig:
    base = dict(hidden_size=16, num_attention_heads=1, num_experts=4, topk=2, moe_ffn_hidden_size=24,
                init_std=0.3, aux_loss_coeff=1e-2, z_loss_coeff=1e-3)
    base.update(kw)
    return ModelConfig(**base)


def make_layer(cfg: ModelConfig, seed: int = 0, dtype=torch.float32) -> MoELayer:
    layer = MoELayer(cfg, ParallelContext.single(), out_std=0.3)
    init_weights(layer, seed)
    return layer.to(dtype).train()


def expert_fn(layer: MoELayer, e: int, x_D: torch.Tensor) -> torch.Tensor:
    Fh = layer.experts.ffn
    w13, w2 = layer.experts.w13[e], layer.experts.w2[e]
    return (F.silu(x_D @ w13[:, :Fh]) * (x_D @ w13[:, Fh:])) @ w2


def reference(layer: MoELayer, x_BSD: torch.Tensor) -> tuple[torch.Tensor, object]:
    """For each token t: sum_k prob_tk * expert_{e_tk}(x_t) over kept assignments (+ shared MLP)."""
    B, S, D = x_BSD.shape
    x_TD = x_BSD.reshape(B * S, D)
    route = layer.router(x_TD, num_sequences=B)
    rows = []
    for t in range(x_TD.shape[0]):
        y = x_TD.new_zeros(D)
        for k in range(layer.router.cfg.topk):
            if route.keep_TK is not None and not bool(route.keep_TK[t, k]):
                continue
            e = int(route.experts_TK[t, k])
            y = y + route.probs_TK[t, k].to(x_TD.dtype) * expert_fn(layer, e, x_TD[t])
        if layer.shared_experts is not None:
            y = y + layer.shared_experts(x_TD[t])
        rows.append(y)
    return torch.stack(rows).view(B, S, D), route


def run(layer: MoELayer, x: torch.Tensor, g: torch.Tensor):
    """Forward + backward of <y, g>; returns y and the gradients of input and every parameter."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y, aux = layer(x)
    (y * g).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), x.grad.detach(), grads, aux


def ref_run(layer: MoELayer, x: torch.Tensor, g: torch.Tensor):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y, route = reference(layer, x)
    (y * g).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), x.grad.detach(), grads, route


# ------------------------------------------------------------------------------------------ output vs reference
CASES = {
    "dropless": dict(),
    "capacity_probs": dict(capacity_factor=0.5, drop_policy="probs"),
    "capacity_position": dict(capacity_factor=0.5, drop_policy="position"),
    "capacity_probs_padded": dict(capacity_factor=0.5, drop_policy="probs", pad_to_capacity=True),
    "capacity_position_padded": dict(capacity_factor=0.75, drop_policy="position", pad_to_capacity=True),
    "sigmoid_groups": dict(num_experts=8, topk=4, score_function="sigmoid", num_groups=4, group_topk=2,
                           topk_scaling_factor=2.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_per_token_reference(case):
    torch.manual_seed(0)
    layer = make_layer(cfg_(**CASES[case]))
    x = torch.randn(2, 8, 16)
    g = torch.randn(2, 8, 16)
    y, gx, grads, aux = run(layer, x, g)
    y_r, gx_r, grads_r, route = ref_run(layer, x, g)

    if "capacity" in case:  # the capacity cases must actually drop something, else they test nothing new
        assert route.num_dropped.item() > 0
    else:
        assert route.keep_TK is None
    assert torch.isfinite(aux) and aux.item() > 0
    torch.testing.assert_close(y, y_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx, gx_r, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(grads_r) == {"router.weight", "experts.w13", "experts.w2"}
    for name in grads:
        torch.testing.assert_close(grads[name], grads_r[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("policy,cf", [("probs", 0.5), ("position", 0.5), ("probs", 1.0), ("position", 1.3)])
def test_pad_to_capacity_is_the_same_computation(policy, cf, dtype):
    torch.manual_seed(1)
    x = torch.randn(3, 8, 16, dtype=dtype)
    g = torch.randn(3, 8, 16, dtype=dtype)
    plain = make_layer(cfg_(capacity_factor=cf, drop_policy=policy), dtype=dtype)
    padded = make_layer(cfg_(capacity_factor=cf, drop_policy=policy, pad_to_capacity=True), dtype=dtype)
    assert torch.equal(plain.router.weight, padded.router.weight)
    y0, gx0, grads0, aux0 = run(plain, x, g)
    y1, gx1, grads1, aux1 = run(padded, x, g)
    assert plain.last_stats["num_dropped"].item() == padded.last_stats["num_dropped"].item()
    # the same numbers up to summation order (the padded buffer groups rows differently): float32 differs in the
    # last bit or two, float64 to 1e-12
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (1e-12, 1e-13)
    torch.testing.assert_close(y1, y0, rtol=rtol, atol=atol)
    torch.testing.assert_close(gx1, gx0, rtol=rtol, atol=atol)
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=rtol, atol=10 * atol, msg=name)
    assert torch.equal(aux0, aux1)


def test_allgather_dispatcher_matches_alltoall_on_one_rank():
    torch.manual_seed(2)
    x, g = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    for extra in (dict(), dict(capacity_factor=0.5)):
        a2a = make_layer(cfg_(dispatcher="alltoall", **extra))
        ag = make_layer(cfg_(dispatcher="allgather", **extra))
        assert isinstance(ag.dispatcher, AllGatherDispatcher)
        y0, gx0, grads0, _ = run(a2a, x, g)
        y1, gx1, grads1, _ = run(ag, x, g)
        torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gx1, gx0, rtol=1e-5, atol=1e-6)
        for name in grads0:
            torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-5, atol=1e-5, msg=name)


# ------------------------------------------------------------------------------------------ gradcheck
def _separated_layer_and_input(seed=3, T=5):
    """hidden 8, 4 experts, top-2, and the tokens whose 2nd and 3rd logits are furthest apart."""
    cfg = cfg_(hidden_size=8, num_experts=4, topk=2, moe_ffn_hidden_size=6, init_std=0.5)
    layer = make_layer(cfg, seed=seed, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    cand = torch.randn(64, 8, dtype=torch.float64, generator=gen)
    top = (cand @ layer.router.weight.T).sort(dim=-1, descending=True).values
    gaps = top[:, 1] - top[:, 2]
    keep = gaps.argsort(descending=True)[:T].sort().values  # the T tokens with the clearest top-2
    return layer, cand[keep].view(1, T, 8), gaps[keep].min().item()


def test_gradcheck_expert_path_float64_fixed_routing():
    """Strict float64 gradcheck of dispatch -> grouped experts -> combine w.r.t. the input AND the gates.

    The router itself computes in float32 by design (TopKRouter casts x and its weight with ``.float()``), so the
    routing decision is taken once and held fixed; the router's own float64 gradients are checked on its pure
    functions in tests/modules/test_router.py.
    """
    torch.manual_seed(3)
    for extra in (dict(), dict(capacity_factor=0.6), dict(capacity_factor=0.6, pad_to_capacity=True)):
        cfg = cfg_(hidden_size=8, num_experts=4, topk=2, moe_ffn_hidden_size=6, init_std=0.5, **extra)
        layer = make_layer(cfg, dtype=torch.float64)
        x = torch.randn(6, 8, dtype=torch.float64)
        route = layer.router(x, num_sequences=1)
        if "capacity_factor" in extra:
            assert route.num_dropped.item() > 0
        probs = route.probs_TK.detach().double().requires_grad_()

        for in_experts in (False, True):  # the combine weights the outputs, or the experts weight their rows
            def fn(x_TD, probs_TK):
                route.probs_TK = probs_TK
                x_MD, tpe_L, st = layer.dispatcher.dispatch(x_TD, route)
                if not in_experts:
                    return layer.dispatcher.combine(layer.experts(x_MD, tpe_L, has_tail=st.has_tail), st)
                assert st.probs_M is not None
                y_MD = layer.experts(x_MD, tpe_L, has_tail=st.has_tail, probs_M=st.probs_M)
                st.probs_applied = True
                return layer.dispatcher.combine(y_MD, st)

            out = fn(x, probs)
            assert out.dtype == torch.float64
            assert torch.autograd.gradcheck(fn, (x.clone().requires_grad_(), probs), eps=1e-6, atol=1e-8, rtol=1e-6)
            g, = torch.autograd.grad(fn(x, probs).sum(), probs)
            assert g.abs().sum() > 0  # the gates are used on both paths


def test_gradcheck_whole_layer_double():
    """The whole layer (router included) after ``.double()``, w.r.t. its input.

    A strict float64 gradcheck (eps=1e-6) fails here: TopKRouter rounds x and its weight to float32 (by design,
    ``F.linear(x.float(), weight.float())``), so a 1e-6 finite difference of the gates drowns in float32 rounding
    (measured Jacobian error ~7e-3 at eps=1e-5, ~1e-4 at eps=1e-3). This test therefore checks the
    whole layer with a step (1e-2) large against the float32 rounding of x (~6e-8 / step) but two orders of
    magnitude below the logit gap, so routing cannot flip under the perturbation. Measured: central-difference
    error ~3e-5 against Jacobian entries up to ~2.4; a missing gate-gradient term would be O(0.1).
    """
    layer, x, gap = _separated_layer_and_input()
    assert layer.router.weight.dtype == torch.float64
    step = 1e-2
    max_logit_change = step * layer.router.weight.abs().max().item()  # gradcheck moves one element at a time
    assert gap > 20 * max_logit_change, (gap, max_logit_change)

    def fn(x_):
        return layer(x_)[0]

    xr = x.clone().requires_grad_()
    assert torch.autograd.gradcheck(fn, (xr,), eps=step, atol=1e-4, rtol=1e-3)
    # the routing decision really did not change under the perturbation
    with torch.no_grad():
        base = layer.router(x.reshape(-1, 8), 1).experts_TK
        for sign in (1, -1):
            moved = layer.router((x + sign * step).reshape(-1, 8), 1).experts_TK
            assert torch.equal(base, moved)


# ------------------------------------------------------------------------------------------ shared experts
def test_shared_experts_are_added():
    torch.manual_seed(4)
    with_shared = make_layer(cfg_(shared_expert_ffn_size=20))
    without = make_layer(cfg_())
    assert isinstance(with_shared.shared_experts, SwiGLU) and without.shared_experts is None
    assert with_shared.shared_experts.w2.weight.shape[1] == 20
    # same names, same seed: identical router and routed experts
    assert torch.equal(with_shared.experts.w13, without.experts.w13)
    assert torch.equal(with_shared.router.weight, without.router.weight)
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        y_s, _ = with_shared(x)
        y_r, _ = without(x)
        shared = with_shared.shared_experts(x)
        y_ref, _ = reference(with_shared, x)
    assert shared.abs().max() > 1e-3  # the shared MLP contributes something
    torch.testing.assert_close(y_s, y_r + shared, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y_s, y_ref, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ dispatcher selection
def test_build_dispatcher_builtins_and_class_path():
    ctx = ParallelContext.single()
    assert type(build_dispatcher(cfg_(dispatcher="alltoall"), ctx)) is AllToAllDispatcher
    assert type(build_dispatcher(cfg_(dispatcher="allgather"), ctx)) is AllGatherDispatcher
    d = build_dispatcher(cfg_(dispatcher="lightning_moe.modules.dispatchers.AllToAllDispatcher"), ctx)
    assert type(d) is AllToAllDispatcher and d.num_local_experts == 4 and d.local_expert_offset == 0
    d = build_dispatcher(cfg_(dispatcher="lightning_moe.modules.dispatchers.AllGatherDispatcher"), ctx)
    assert type(d) is AllGatherDispatcher
    # a user subclass, also through the MoE layer
    before = CustomDispatcher.built
    layer = make_layer(cfg_(dispatcher=f"{__name__}.CustomDispatcher"))
    assert type(layer.dispatcher).__name__ == "CustomDispatcher" and CustomDispatcher.built == before + 1
    y, _ = layer(torch.randn(1, 4, 16))
    assert y.shape == (1, 4, 16) and torch.isfinite(y).all()


def test_build_dispatcher_errors(monkeypatch):
    ctx = ParallelContext.single()
    with pytest.raises(ValueError, match=r"ModelConfig\.dispatcher.*'nope'"):
        ModelConfig(dispatcher="nope")
    with pytest.raises(ValueError, match=r"dispatcher.*not a TokenDispatcher subclass"):
        build_dispatcher(cfg_(dispatcher="lightning_moe.modules.experts.SwiGLU"), ctx)
    with pytest.raises(ValueError, match=r"dispatcher.*not a TokenDispatcher subclass"):
        build_dispatcher(cfg_(dispatcher="lightning_moe.modules.dispatcher.build_dispatcher"), ctx)  # a function
    with pytest.raises(ValueError, match=r"dispatcher.*cannot import"):
        build_dispatcher(cfg_(dispatcher="no_such_pkg_xyz.module.Cls"), ctx)
    with pytest.raises(ValueError, match=r"dispatcher.*cannot import"):
        build_dispatcher(cfg_(dispatcher="lightning_moe.modules.dispatchers.NoSuchDispatcher"), ctx)
    assert issubclass(AllGatherDispatcher, TokenDispatcher)
    # deepep without DeepEP installed: an ImportError that names the package
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # makes `import deep_ep` raise ImportError
    with pytest.raises(ImportError, match="deep_ep"):
        build_dispatcher(cfg_(dispatcher="deepep"), ctx)


# ------------------------------------------------------------------------------------------ no host sync
def test_dropless_single_rank_path_makes_no_host_sync(monkeypatch):
    torch.manual_seed(5)
    layer = make_layer(cfg_(shared_expert_ffn_size=8))
    x = torch.randn(2, 8, 16, requires_grad=True)
    g = torch.randn(2, 8, 16)

    calls = []

    def forbid(name):
        def _raise(self, *a, **k):
            calls.append(name)
            raise AssertionError(f"host sync: Tensor.{name} called in the MoE layer")
        return _raise

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, forbid(name))
    with pytest.raises(AssertionError, match="host sync"):  # the patch is live
        torch.ones(()).item()
    calls.clear()
    y, aux = layer(x)
    ((y * g).sum() + aux).backward()
    monkeypatch.undo()
    assert calls == []
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert layer.experts.w13.grad is not None and layer.router.weight.grad is not None


@pytest.mark.parametrize("sizes,match", [({"ep": 3}, "num_experts=8 is not divisible by expert_parallel_size ep=3"),
                                         ({"etp": 3}, "moe_ffn_hidden_size=32 is not divisible by "
                                                      "expert_tensor_parallel_size etp=3")])
def test_dispatcher_rejects_shards_that_do_not_divide(sizes, match):
    from lightning_moe import ModelConfig, ParallelContext
    from lightning_moe.modules.dispatcher import build_dispatcher
    ctx = ParallelContext.single()
    ctx.sizes.update(sizes)
    with pytest.raises(ValueError, match=match):
        build_dispatcher(ModelConfig(num_experts=8, moe_ffn_hidden_size=32), ctx)
