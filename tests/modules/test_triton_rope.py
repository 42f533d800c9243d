"""The Triton RoPE, alone and after the per-head RMSNorm (``triton_rope.py``), against the torch ops it replaces
(``attention.rotate(..., fused=False)``): output, the input's and the norm weight's gradients, shared positions and
each row's own (packed documents), within the rounding of one op (the kernel rounds at the norm's output and at the
end, torch after each op). On CPU under the Triton interpreter in a fresh process (skipped without triton, as in
CI); on CUDA directly (``gpu``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.modules.interpreted import INSIDE, run_interpreted

# (B, S, heads, Dh, dtype, norm, per-row positions)
CASES = [(2, 5, 3, 8, torch.float32, True, False), (1, 7, 4, 16, torch.float32, False, False),
         (2, 9, 2, 32, torch.bfloat16, True, False), (3, 4, 1, 8, torch.bfloat16, False, True),
         (2, 6, 4, 12, torch.float32, True, True), (1, 0, 2, 8, torch.bfloat16, True, False),
         (2, 33, 4, 128, torch.bfloat16, True, False)]


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(__file__, k="interpreted", passed=len(CASES) + 2)


def _check(B, S, H, Dh, dtype, norm, per_row, device, strided=False):
    from lightning_moe.modules.attention import RotaryCache, rotate
    g = torch.Generator().manual_seed(B * 100 + S * 10 + H + Dh)
    x = (torch.randn(B, S, H, Dh + 2 * strided, generator=g) * 3).to(dtype).to(device)[..., :Dh]
    go = torch.randn(B, S, H, Dh, generator=g).to(dtype).to(device)
    positions = (torch.randint(0, 64, (B, S), generator=g) if per_row else torch.arange(S) + 3).to(device)
    cos, sin = RotaryCache(Dh, 10000.0, 8)(positions, S + 64)  # the table covers every position
    rms = None
    if norm:
        rms = nn.RMSNorm(Dh, eps=1e-6).to(device)
        with torch.no_grad():
            rms.weight.copy_(torch.rand(Dh, generator=g) + 0.5)
        rms.to(dtype)

    def run(fused):
        x_ = x.detach().requires_grad_()  # a view when strided: the kernels copy it
        if rms is not None:
            rms.weight.grad = None
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
            out = rotate(x_, cos, sin, rms, fused)
        if fused and not norm:  # RoPE alone keeps the tables only, as torch's rotation does
            mine = x_.untyped_storage().data_ptr()
            assert not [t for t in kept if t.untyped_storage().data_ptr() == mine and x_.numel()]
        out.backward(go)
        return out.detach().float(), x_.grad.float(), (rms.weight.grad.float() if rms is not None else None)

    ref, got = run(False), run(True)
    for a, b in zip(got, ref):
        if b is None:
            continue
        assert a.shape == b.shape and a.dtype == b.dtype
        if not b.any():  # no rows: the weight's gradient is zero
            assert torch.equal(a, b)
            continue
        if dtype == torch.float32:  # ulps
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        else:  # bf16: a wrong formula is off by O(1); rounding once against after each op, about one ulp
            assert ((a - b).norm() / b.norm()).item() < 1.5e-2
    with torch.no_grad():  # the no-grad path (evaluation, Recompute's rebuild) runs the kernel too
        torch.testing.assert_close(rotate(x, cos, sin, rms, True).float(), got[0])


@pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")
@pytest.mark.parametrize("B,S,H,Dh,dtype,norm,per_row", CASES)
def test_rope_kernel_matches_torch_interpreted(B, S, H, Dh, dtype, norm, per_row):
    _check(B, S, H, Dh, dtype, norm, per_row, "cpu")


@pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")
@pytest.mark.parametrize("norm", [True, False])
def test_rope_kernel_reads_a_strided_input_interpreted(norm):
    _check(2, 5, 3, 8, torch.float32, norm, False, "cpu", strided=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B,S,H,Dh,dtype,norm,per_row", CASES + [(2, 4096, 32, 128, torch.bfloat16, True, False),
                                                                  (2, 4096, 4, 128, torch.bfloat16, True, True),
                                                                  (1, 4096, 32, 128, torch.bfloat16, False, False)])
def test_rope_kernel_matches_torch_on_gpu(B, S, H, Dh, dtype, norm, per_row):
    _check(B, S, H, Dh, dtype, norm, per_row, "cuda")
