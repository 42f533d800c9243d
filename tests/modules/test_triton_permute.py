"""The Triton permute kernels against the torch reference path (CUDA only)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _case(T, K, D, dtype, keep_frac, pad):
    g = torch.Generator(device="cuda").manual_seed(T * K + D)
    N = T * K
    rows = torch.randperm(N, device="cuda", generator=g).view(T, K)
    keep = (torch.rand(T, K, device="cuda", generator=g) < keep_frac) if keep_frac < 1 else None
    if pad and keep is not None:
        rows = torch.where(keep, rows, N)  # dropped copies point at the spare row, as in padded capacity
    y = torch.randn(N, D, device="cuda", dtype=dtype, generator=g)
    if keep is not None and not pad:  # poison the rows dropped copies point at: they must never be read
        y[rows[~keep]] = float("nan")
    probs = torch.rand(T, K, device="cuda", generator=g)
    return y, probs, rows, keep


@pytest.mark.parametrize("T,K,D", [(1000, 8, 2048), (513, 2, 4096), (64, 6, 7168), (37, 1, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("keep_frac,pad", [(1.0, False), (0.7, False), (0.7, True)])
def test_combine_and_gather_match_torch(T, K, D, dtype, keep_frac, pad):
    from lightning_moe.modules import permute
    y, probs, rows, keep = _case(T, K, D, dtype, keep_frac, pad)
    perm = not pad

    def run(fused):
        y_ = y.clone().requires_grad_()
        p_ = probs.clone().requires_grad_()
        out = permute.combine_rows(y_, p_, rows, keep, permutation=perm, fused=fused)
        go = torch.randn_like(out, generator=torch.Generator(device="cuda").manual_seed(1))
        out.backward(go)
        x = torch.randn(T, D, device="cuda", dtype=dtype, requires_grad=True)
        src = torch.empty(T * K, dtype=torch.long, device="cuda").scatter_(
            0, rows.clamp(max=T * K - 1).flatten(), torch.arange(T * K, device="cuda") // K) if perm else \
            torch.arange(T * K, device="cuda") // K
        xs = permute.gather_tokens(x, src, rows, keep, fused=fused)
        gx = torch.autograd.grad(xs, x, torch.ones_like(xs))[0] if perm else None
        return out.float(), y_.grad.float(), p_.grad.float(), gx

    fast = run(True)
    ref = run(False)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for a, b in zip(fast, ref):
        if a is None:
            continue
        assert torch.isfinite(a).all()
        assert ((a - b).norm() / b.norm().clamp(min=1e-6)).item() < tol
