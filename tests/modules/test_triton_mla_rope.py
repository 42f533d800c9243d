"""The Triton MLA RoPE (``triton_mla_rope.py``) against torch's split, rotation and cat (``mla.rope_heads(...,
fused=False)``): q and k, the gradients of q, of the nope keys (a view inside the up-projection's output) and of the
shared rope key (a view inside the down-projection's output), shared positions and each row's own, within one rounding
of the output's dtype. On CPU under the Triton interpreter in a fresh process (skipped without triton, as in CI); on
CUDA directly (``gpu``)."""

from __future__ import annotations

import pytest
import torch

from tests.modules.interpreted import INSIDE, run_interpreted

# (B, S, heads, nope, rope, value dim, dtype, per-row positions)
CASES = [(2, 5, 3, 8, 4, 6, torch.float32, False), (1, 7, 4, 16, 8, 16, torch.float32, True),
         (2, 9, 2, 128, 64, 128, torch.bfloat16, False), (3, 4, 1, 12, 6, 8, torch.bfloat16, True),
         (1, 0, 2, 8, 4, 8, torch.bfloat16, False)]


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(__file__, k="interpreted", passed=len(CASES))


def _check(B, S, H, N, R, V, dtype, per_row, device):
    from lightning_moe.modules.attention import RotaryCache
    from lightning_moe.modules.mla import rope_heads
    g = torch.Generator().manual_seed(B * 100 + S * 10 + H + N + R)
    C = 5  # latent width before the rope key in the down-projection's output
    down = (torch.randn(B, S, C + R, generator=g) * 2).to(dtype).to(device).requires_grad_()
    up = (torch.randn(B, S, H * (N + V), generator=g) * 2).to(dtype).to(device).requires_grad_()
    q = (torch.randn(B, S, H * (N + R), generator=g) * 2).to(dtype).to(device).requires_grad_()
    positions = (torch.randint(0, 64, (B, S), generator=g) if per_row else torch.arange(S) + 3).to(device)
    cos, sin = RotaryCache(R, 10000.0, 8)(positions, S + 64)
    go_q = torch.randn(B, S, H, N + R, generator=g).to(dtype).to(device)
    go_k = torch.randn(B, S, H, N + R, generator=g).to(dtype).to(device)
    go_v = torch.randn(B, S, H, V, generator=g).to(dtype).to(device)
    got = {}
    for fused in (False, True):
        k_rope = down.split([C, R], dim=-1)[1]  # a strided view, as in the model
        k_nope, v = up.view(B, S, H, N + V).split([N, V], dim=-1)
        q_out, k_out = rope_heads(q.view(B, S, H, N + R), k_nope, k_rope, cos, sin, fused)
        assert q_out.shape == k_out.shape == (B, S, H, N + R)
        grads = torch.autograd.grad([q_out, k_out, v], [q, up, down], [go_q, go_k, go_v], allow_unused=True)
        got[fused] = (q_out.detach(), k_out.detach(), *grads)
    ulp = {torch.float32: 1e-6, torch.bfloat16: 2.0 ** -7}[dtype]
    for name, ref, fus in zip(("q", "k", "dq", "d_up", "d_down"), got[False], got[True]):
        scale = ref.float().abs().amax().clamp_min(1.0) if ref.numel() else 1.0
        err = (fus.float() - ref.float()).abs().amax().item() if ref.numel() else 0.0
        # the rope key's gradient sums H heads in float32 before rounding, torch rounds each head's first
        tol = ulp * scale * (H + 1 if name == "d_down" else 1)
        assert err <= tol, (name, err, tol)
    if S:  # the nope parts are copies, bit for bit
        assert torch.equal(got[True][0][..., :N], got[False][0][..., :N])
        assert torch.equal(got[True][1][..., :N], got[False][1][..., :N])


@pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")
@pytest.mark.parametrize("B,S,H,N,R,V,dtype,per_row", CASES)
def test_mla_rope_matches_torch_interpreted(B, S, H, N, R, V, dtype, per_row):
    _check(B, S, H, N, R, V, dtype, per_row, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("B,S,H,N,R,V,dtype,per_row", CASES + [(1, 4096, 128, 128, 64, 128, torch.bfloat16, False)])
def test_mla_rope_matches_torch_cuda(B, S, H, N, R, V, dtype, per_row):
    _check(B, S, H, N, R, V, dtype, per_row, torch.device("cuda"))
