"""NVFP4 quantizers against their reference formulas: E2M1 rounding (ties to even, saturation, stochastic and
unbiased), E4M3 block scales and the fp32 tensor scale, 1 x 16 and 16 x 16 blocks, the random Hadamard transform and
its inverse, and the emulated GEMM against float64."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.modules.nvfp4 import (apply_along_rows, dequantize, fake_quantize, hadamard, quantize,
                                         random_hadamard, round_e2m1)


def test_round_to_nearest_even_and_saturate():
    v = torch.tensor([0.0, 0.2, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 6.0, 7.0, 100.0, -0.75, -2.6, -9.0])
    want = [0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, 6.0, -1.0, -3.0, -6.0]
    assert round_e2m1(v).tolist() == want  # ties go to the even code (0, 1, 2, 4), beyond 6 saturates


def test_stochastic_rounding_is_unbiased_between_neighbours():
    g = torch.Generator().manual_seed(0)
    v = torch.full((40000,), 2.4)
    r = round_e2m1(v, stochastic=True, generator=g)
    assert set(r.unique().tolist()) == {2.0, 3.0}
    assert r.mean().item() == pytest.approx(2.4, abs=0.01)
    assert round_e2m1(torch.full((100,), 4.0), stochastic=True, generator=g).eq(4.0).all()  # on the grid: exact


@pytest.mark.parametrize("square,blocks", [(False, (64, 8)), (True, (4, 8))])
def test_block_and_tensor_scales(square, blocks):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=g) * torch.logspace(-2, 2, 64).unsqueeze(1)
    q, block, ts = quantize(x, square=square)
    assert block.shape == blocks
    assert ts.item() == pytest.approx(448 * 6 / x.abs().max().item(), rel=1e-6)
    assert torch.equal(block, block.to(torch.float8_e4m3fn).float())  # stored in E4M3
    rb, cb = 64 // blocks[0], 128 // blocks[1]
    amax = (x * ts).abs().reshape(blocks[0], rb, blocks[1], cb).amax(dim=(1, 3))
    assert torch.equal(block, (amax / 6).to(torch.float8_e4m3fn).float())
    assert set(q.abs().unique().tolist()) <= {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0}
    # each element within half the largest grid step (between 4 and 6) of its block's scale
    err = (dequantize(q, block, ts) - x).abs()
    bound = block.repeat_interleave(rb, 0).repeat_interleave(cb, 1) / ts
    assert (err <= bound * 1.0001 + 1e-12).all()


def test_blocks_must_divide():
    with pytest.raises(ValueError, match=r"60 x 128 operand does not split into 16 x 16 blocks"):
        quantize(torch.randn(60, 128), square=True)


def test_emulated_gemm_against_float64():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(256, 512, generator=g), torch.randn(128, 512, generator=g)
    ref = a.double() @ b.double().t()
    y = fake_quantize(a) @ fake_quantize(b, square=True).t()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert 0.02 < err < 0.15, err  # E2M1 keeps ~2 significant bits


def test_hadamard_transform_is_orthogonal_and_exact_in_products():
    h = hadamard(16)
    torch.testing.assert_close(h @ h.t(), torch.eye(16))
    signs = torch.randint(0, 2, (16,), generator=torch.Generator().manual_seed(3)) * 2 - 1
    t = random_hadamard(signs)
    torch.testing.assert_close(t @ t.t(), torch.eye(16))
    g = torch.Generator().manual_seed(4)
    dy, x = torch.randn(64, 32, generator=g, dtype=torch.float64), torch.randn(64, 48, generator=g, dtype=torch.float64)
    # the wgrad product dy^T x is unchanged when both go through the same transform along their rows (tokens)
    torch.testing.assert_close(apply_along_rows(dy, t).double().t() @ apply_along_rows(x, t).double(), dy.t() @ x,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_along_rows(apply_along_rows(x, t), t.t()).double(), x, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="power of two"):
        hadamard(12)
