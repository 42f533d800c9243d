"""The fused Triton router and permutes against the torch references on CUDA, over a grid of shapes and options
(values and gradients; ``tests/modules/fused_cases.py`` says how they are compared). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.modules.fused_cases import check_dispatch, check_expert_order, check_resort, check_router

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROUTERS = {
    "softmax": dict(topk=2),
    "softmax_z": dict(topk=8, z_loss_coeff=1e-3),
    "pre_softmax": dict(topk=6, pre_softmax=True),
    "pre_softmax_top1": dict(topk=1, pre_softmax=True, load_balancing="global_aux_loss"),
    "softmax_groups": dict(topk=8, num_groups=8, group_topk=4, load_balancing="seq_aux_loss"),
    "softmax_scaled": dict(topk=4, topk_scaling_factor=2.5, z_loss_coeff=1e-3),
    "sigmoid": dict(topk=8, score_function="sigmoid"),
    "sigmoid_top1": dict(topk=1, score_function="sigmoid", load_balancing="none"),
    "deepseek_v3": dict(topk=8, score_function="sigmoid", expert_bias=True, num_groups=8, group_topk=4,
                        topk_scaling_factor=2.5, load_balancing="seq_aux_loss", z_loss_coeff=1e-3),
    "sigmoid_bias_global": dict(topk=4, score_function="sigmoid", expert_bias=True,
                                load_balancing="global_aux_loss"),
    "capacity_probs": dict(topk=2, capacity_factor=1.0, drop_policy="probs"),
    "capacity_position": dict(topk=8, capacity_factor=0.7, drop_policy="position", z_loss_coeff=1e-3),
}


@pytest.mark.parametrize("name", list(ROUTERS))
@pytest.mark.parametrize("T,E", [(4096, 128), (1000, 64), (2048, 8), (512, 256), (768, 160)])
def test_router_matches_reference(name, T, E):
    kw = ROUTERS[name]
    if kw["topk"] > E or (kw.get("num_groups") and (E % kw["num_groups"] or kw["topk"] // kw["group_topk"] >
                                                    E // kw["num_groups"])):
        pytest.skip("shape does not fit these options")
    check_router("cuda", T, E, B=4 if T % 4 == 0 else 1, **kw)


@pytest.mark.parametrize("N,E", [(131072, 128), (131072, 64), (32768, 8), (5000, 256), (777, 3)])
@pytest.mark.parametrize("div,align,drop", [(8, 1, 0.0), (2, 1, 0.3), (1, 16, 0.0), (4, 32, 0.2)])
def test_expert_order_matches_argsort(N, E, div, align, drop):
    check_expert_order("cuda", N, E, div, align, drop=drop)


@pytest.mark.parametrize("N,E,stride", [(16384, 64, 300), (4000, 8, 600)])
def test_expert_order_padded_capacity(N, E, stride):
    check_expert_order("cuda", N, E, 2, stride=stride, drop=0.1)


@pytest.mark.parametrize("S,L,align", [(8, 16, 1), (8, 16, 16), (64, 4, 1), (2, 128, 16), (1, 1, 1)])
def test_resort_matches_reference(S, L, align):
    check_resort("cuda", S, L, align)


@pytest.mark.parametrize("T,D,E,k", [(2048, 2048, 128, 8), (1000, 4096, 8, 2), (512, 7168, 64, 6)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kw", [dict(), dict(expert_rows_align=16), dict(capacity_factor=1.0),
                                dict(capacity_factor=1.0, pad_to_capacity=True, expert_rows_align=16),
                                dict(probs_in_experts=False), dict(capacity_factor=1.0, probs_in_experts=False)],
                         ids=["dropless", "fp8_aligned", "dropping", "padded_capacity", "weighted_combine",
                              "weighted_combine_dropping"])
def test_dispatch_matches_reference(T, D, E, k, dtype, kw):
    check_dispatch("cuda", T, D, E, k, dtype, **kw)


def test_router_forward_has_no_host_sync():
    from lightning_moe.modules.config import ModelConfig
    from lightning_moe.modules.router import TopKRouter
    cfg = ModelConfig(hidden_size=256, num_experts=64, topk=8, score_function="sigmoid", expert_bias=True,
                      num_groups=8, group_topk=4, load_balancing="seq_aux_loss", z_loss_coeff=1e-3)
    r = TopKRouter(cfg).cuda().train()
    x = torch.randn(1024, 256, device="cuda", requires_grad=True)
    for _ in range(2):
        out = r(x, num_sequences=4)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = r(x, num_sequences=4)
        (out.probs_TK.sum() + out.aux_loss + out.z_loss).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("T,D,E", [(16384, 2048, 128), (4096, 7168, 256)])
def test_bf16_router_gemm_matches_its_float32_emulation(T, D, E):
    """``router_dtype="bf16"`` on CUDA (one ``mm(..., out_dtype=float32)``) against float32 products of the same bf16
    values (the CPU path): forward and both gradients, within float32 accumulation-order error."""
    from lightning_moe.modules.router import router_logits
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (torch.randn(E, D, device="cuda", generator=g) * 0.02).requires_grad_()
    gl = torch.randn(T, E, device="cuda", generator=g) * 1e-3
    out = router_logits(x, w, "bf16")
    out.backward(gl)
    xr, wr = x.detach().float(), w.detach().bfloat16().float()
    g16 = gl.bfloat16().float()
    torch.testing.assert_close(out, xr @ wr.t(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w.grad, g16.t() @ xr, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad.float(), (g16 @ wr).bfloat16().float(), rtol=1e-2, atol=1e-5)
