"""The Triton (weighted) SwiGLU (``triton_swiglu.py``) against the torch code it replaces: forward, the input's and
the weights' gradients, within the rounding of one op (the kernel rounds once, torch after each op). On CPU under the
Triton interpreter in a fresh process (skipped without triton, as in CI); on CUDA directly (``gpu``)."""

from __future__ import annotations

import pytest
import torch

from tests.modules.interpreted import INSIDE, run_interpreted

# (rows, F, dtype, weighted); rows as a tuple: leading dims (the dense MLPs pass (B, S, 2F))
CASES = [(37, 96, torch.float32, True), (64, 768, torch.bfloat16, True), (5, 1500, torch.bfloat16, True),
         (33, 64, torch.float32, False), (9, 2048, torch.bfloat16, False), (0, 32, torch.bfloat16, True),
         ((2, 7), 48, torch.float32, False), ((3, 5), 160, torch.bfloat16, False)]


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(__file__, k="interpreted", passed=len(CASES))


def _check(M, F, dtype, weighted, device):
    from lightning_moe.modules.experts import swiglu
    lead = M if isinstance(M, tuple) else (M,)
    g = torch.Generator().manual_seed(sum(lead) + F)
    h = (torch.randn(*lead, 2 * F, generator=g) * 2).to(dtype).to(device)
    p = torch.rand(*lead, generator=g).to(device) if weighted else None
    go = torch.randn(*lead, F, generator=g).to(dtype).to(device)

    def run(fused):
        h_ = h.clone().requires_grad_()
        p_ = p.clone().requires_grad_() if weighted else None
        out = swiglu(h_, p_, fused=fused)
        out.backward(go)
        return out.detach().float(), h_.grad.float(), (p_.grad if weighted else None)
    ref, got = run(False), run(True)
    for a, b in zip(got, ref):
        if b is None:
            continue
        assert a.shape == b.shape
        if dtype == torch.float32:  # ulps
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
        elif b.numel():  # bf16: the kernel rounds once, torch after each op; a wrong formula is off by O(1)
            assert ((a - b).norm() / b.norm()).item() < 1.5e-2  # ~1 bf16 ulp measured
    with torch.no_grad():  # the no-grad path (evaluation, Recompute's rebuild) runs the kernel too
        torch.testing.assert_close(swiglu(h, p, fused=True).float(), got[0])


@pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")
@pytest.mark.parametrize("M,F,dtype,weighted", CASES)
def test_swiglu_kernel_matches_torch_interpreted(M, F, dtype, weighted):
    _check(M, F, dtype, weighted, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("M,F,dtype,weighted", CASES + [(65536, 768, torch.bfloat16, True),
                                                        (4096, 14336, torch.bfloat16, True)])
def test_swiglu_kernel_matches_torch_on_gpu(M, F, dtype, weighted):
    _check(M, F, dtype, weighted, "cuda")
