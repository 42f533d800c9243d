"""FP8 quantizers against their reference formulas (scale per block, saturation, round to nearest, block shapes),
FP8 GEMMs against float64, and torch's _scaled_mm against the emulation on the same quantized inputs."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.modules.fp8 import FORMATS, AmaxHistory, Tiling, dequantize, fp8_mm, quantize, tiling


def _x(R, K, seed=0, spread=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, K, generator=g)
    if spread:  # rows and columns of very different magnitude: what per-block scales are for
        x = x * torch.logspace(-3, 3, R).unsqueeze(1) * torch.logspace(0, 1, K).unsqueeze(0)
    return x


@pytest.mark.parametrize("recipe,role,blocks", [
    ("tensorwise", "input", (1, 1)), ("rowwise", "input", (256, 1)), ("rowwise", "weight", (256, 1)),
    ("blockwise", "input", (256, 3)), ("blockwise", "weight", (2, 3)),
])
def test_scale_per_block_is_format_max_over_block_amax(recipe, role, blocks):
    x = _x(256, 384)
    t = tiling(recipe, role)
    q, scale = quantize(x, "e4m3", t)
    assert scale.shape == blocks and q.dtype == torch.float8_e4m3fn
    rb, cb = 256 // blocks[0], 384 // blocks[1]
    for i in range(blocks[0]):
        for j in range(blocks[1]):
            amax = x[i * rb:(i + 1) * rb, j * cb:(j + 1) * cb].abs().max()
            assert scale[i, j].item() == pytest.approx(448.0 / amax.item(), rel=1e-6)
    # every block's largest value lands on the format's largest one
    assert dequantize(q, scale, t).abs().max().item() == pytest.approx(x.abs().max().item(), rel=1e-6)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_round_to_nearest_and_saturate(fmt):
    dtype, fmax = FORMATS[fmt]
    x = _x(64, 128, spread=False)
    t = Tiling(None, None)
    q, scale = quantize(x, fmt, t)
    assert torch.equal(q.float(), (x * scale).to(dtype).float())  # the cast rounds to nearest
    rel = ((dequantize(q, scale, t) - x).abs() / x.abs()).masked_select(x.abs() * scale > 2 ** -6 * fmax / 448)
    assert rel.max().item() <= {"e4m3": 2 ** -4, "e5m2": 2 ** -3}[fmt] * 1.0001  # half an ulp of the mantissa
    # an amax smaller than the data (delayed scaling after a spike) saturates instead of overflowing to NaN
    q, scale = quantize(x, fmt, t, amax=x.abs().max() / 4)
    assert torch.isfinite(q.float()).all() and q.float().abs().max().item() == fmax


def test_indivisible_blocks_name_the_multiple():
    with pytest.raises(ValueError, match=r"100 x 384 operand does not split into 128 x 128 .* multiples of 128"):
        quantize(torch.randn(100, 384), "e4m3", tiling("blockwise", "weight"))
    with pytest.raises(ValueError, match="unknown FP8 recipe 'fp4'"):
        tiling("fp4", "input")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fp8_gemm_error_within_the_format_bound(recipe):
    a, b = _x(256, 512, 1, spread=False), _x(384, 512, 2, spread=False)
    ref = a.double() @ b.double().t()
    y = fp8_mm(a, b, tiling(recipe, "input"), tiling(recipe, "weight"), "e4m3", "e4m3", torch.float32)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    # each operand is within 2^-4 elementwise (half an ulp), errors of a random sum add in quadrature: ~2^-4 / sqrt(3)
    assert 1e-3 < err < 0.04, err


def test_blockwise_beats_tensorwise_on_spread_data():
    a, b = _x(256, 512, 3), _x(384, 512, 4)
    ref = a.double() @ b.double().t()
    errs = {r: ((fp8_mm(a, b, tiling(r, "input"), tiling(r, "weight"), "e4m3", "e4m3", torch.float32).double()
                 - ref).norm() / ref.norm()).item() for r in ("tensorwise", "rowwise", "blockwise")}
    assert errs["blockwise"] <= errs["rowwise"] < errs["tensorwise"], errs


@pytest.mark.parametrize("recipe,fmts", [("tensorwise", ("e4m3", "e4m3")), ("tensorwise", ("e5m2", "e4m3")),
                                         ("rowwise", ("e4m3", "e4m3"))])
def test_scaled_mm_matches_the_emulation(recipe, fmts):
    a, b = _x(64, 128, 5, spread=False), _x(96, 128, 6, spread=False)
    ta, tb = tiling(recipe, "input"), tiling(recipe, "weight")
    kernel = fp8_mm(a, b, ta, tb, *fmts, torch.float32)
    emulated = fp8_mm(a, b, ta, tb, *fmts, torch.float32, emulate=True)
    torch.testing.assert_close(kernel, emulated, rtol=1e-5, atol=1e-5)


def test_amax_history_scales_from_the_max_of_past_steps():
    h = AmaxHistory(length=3)
    assert h.amax(torch.tensor([2.0])).item() == 2.0  # first call: its own
    assert h.amax(torch.tensor([1.0])).item() == 2.0  # then the max of the history, before recording
    assert h.amax(torch.tensor([5.0])).item() == 2.0
    assert h.amax(torch.tensor([1.0])).item() == 5.0
    h.amax(torch.tensor([1.0]))
    h.amax(torch.tensor([1.0]))
    assert h.amax(torch.tensor([1.0])).item() == 1.0  # 5 fell out of the 3-step window
    with pytest.raises(ValueError, match="history length"):
        AmaxHistory(0)
