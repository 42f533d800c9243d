"""GPU (skipped without CUDA): gradient-accumulation fusion on cuBLAS (``torch.mm`` / ``torch.addmm`` with an fp32
output written in place into ``main_grad``)."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.modules.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from lightning_moe.strategy.grad_sync import GradSync
from lightning_moe.strategy.parallel_context import ParallelContext

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run(fuse: bool, micro: int = 4):
    ctx = ParallelContext.single()
    torch.manual_seed(0)
    col, row = ColumnParallelLinear(1024, 4096, ctx), RowParallelLinear(4096, 1024, ctx)
    with torch.no_grad():
        for m in (col, row):
            m.weight.normal_(0, 0.02)
    col, row = col.cuda().to(torch.bfloat16), row.cuda().to(torch.bfloat16)
    sync = GradSync(list(col.parameters()) + list(row.parameters()), ctx, main_grads=True, fuse_wgrad=fuse)
    g = torch.Generator("cuda").manual_seed(1)
    data = [(torch.randn(2, 2048, 1024, device="cuda", generator=g).to(torch.bfloat16),
             torch.randn(2, 2048, 1024, device="cuda", generator=g).to(torch.bfloat16)) for _ in range(micro)]
    dxs = []
    for i, (x, dy) in enumerate(data):
        x = x.clone().requires_grad_()
        if i == micro - 1:
            sync.arm()
        row(col(x)).backward(dy)
        dxs.append(x.grad)
    sync.finish()
    ref = []  # float64 of the same bf16 weights and inputs
    w1, w2 = col.weight.double(), row.weight.double()
    m1, m2 = torch.zeros_like(w1), torch.zeros_like(w2)
    for x, dy in data:
        x, dy = x.double().reshape(-1, 1024), dy.double().reshape(-1, 1024)
        m2 += dy.t() @ (x @ w1.t())
        m1 += (dy @ w2).t() @ x
    ref = [m1, m2]
    return [col.weight.main_grad, row.weight.main_grad], ref, dxs, [col.weight.grad, row.weight.grad]


def test_fused_main_grads_on_cublas_are_closer_to_float64_and_input_grads_unchanged():
    fused, ref, dx_f, grads = _run(True)
    plain, _, dx_p, _ = _run(False)
    assert grads == [None, None]
    for a, b in zip(dx_f, dx_p):
        assert torch.equal(a, b)
    for f, p, r in zip(fused, plain, ref):
        # mean errors against float64: h and dh are the same bf16 tensors in both runs; only the wgrad rounding differs
        err_f, err_p = (f.double() - r).abs().mean().item(), (p.double() - r).abs().mean().item()
        scale = r.abs().mean().item()
        print(f"main grad mean error: fused {err_f / scale:.2e}, unfused {err_p / scale:.2e} (relative to the mean)")
        assert err_f < err_p and err_f / scale < 1e-2


@pytest.mark.parametrize("deferral", [(True, None), (True, 2)])  # 2: the second window adds two segments
def test_experts_deferred_bf16_wgrad_matches_the_per_micro_batch_one(deferral):
    """``GradSync.expert_deferral`` (``MoEFoldStrategy(defer_expert_wgrad)``): the experts' bf16 wgrad of 4 micro-
    batches held and run over the step (or windows of 2) on the segments kernel: the per-micro-batch main grads up to
    float32 summation order (both within 1e-5 of float64), the input gradients bit for bit, nothing left held."""
    from lightning_moe.modules import wgrad_fusion
    L, K, N = 16, 512, 768
    g = torch.Generator("cuda").manual_seed(0)
    w = (torch.randn(L, K, N, device="cuda", generator=g) * 0.02).bfloat16()
    data = []
    for i in range(4):
        counts = torch.randint(0, 300, (L,), device="cuda", generator=g)
        counts[i] = 0  # an empty expert in each micro-batch
        M = int(counts.sum()) + 5  # rows past the last expert's
        data.append((torch.randn(M, K, device="cuda", generator=g).bfloat16(),
                     torch.randn(M, N, device="cuda", generator=g).bfloat16(), counts.cumsum(0).to(torch.int32)))
    out = {}
    for name, dfr in (("now", (False, None)), ("deferred", deferral)):
        p = torch.nn.Parameter(w.clone())
        p.wgrad_fusable = True
        sync = GradSync([p], ParallelContext.single(), main_grads=True, fuse_wgrad=True)
        sync.expert_deferral = dfr
        dxs = []
        for i, (x, dy, offs) in enumerate(data):
            if i == 3:
                sync.arm()
            xg = x.clone().requires_grad_()
            wgrad_fusion.grouped_linear(xg, p, offs).backward(dy)
            dxs.append(xg.grad)
        sync.finish()
        assert sync.held(p) == []
        out[name] = (p.main_grad.clone(), dxs)
    ref = torch.zeros(L, K, N, dtype=torch.float64, device="cuda")
    for x, dy, offs in data:
        ends = [0] + offs.tolist()
        for e in range(L):
            ref[e] += x[ends[e]:ends[e + 1]].double().t() @ dy[ends[e]:ends[e + 1]].double()
    rel = lambda a: ((a.double() - ref).norm() / ref.norm()).item()  # noqa: E731
    assert rel(out["now"][0]) < 1e-5 and rel(out["deferred"][0]) < 1e-5
    # rows past the last expert's are not written by grouped_mm: compare the routed ones
    assert all(torch.equal(a[:offs[-1]], b[:offs[-1]]) for a, b, (_, _, offs) in zip(out["now"][1],
                                                                                    out["deferred"][1], data))
