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
