"""The FP8 parameter all-gather's kernels (``triton_block_quant.py``) on CPU under the Triton interpreter: slices cut
anywhere in tensorwise and blockwise weights, quantized and dequantized through ``fp8_param_gather`` (which takes the
kernels there), against ``fp8.quantize`` / ``fp8.dequantize`` on the whole tensor: the same bytes and bf16 values.
Skipped without triton (CI); the GPU case is ``tests/test_gpu_fp8_param_gather.py``."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from tests.modules.interpreted import INSIDE, run_interpreted  # noqa: E402


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_kernels_under_the_interpreter():
    run_interpreted(__file__, timeout=600, passed=5)


inside = pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")


@inside
@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
@pytest.mark.parametrize("grouped", [False, True])
def test_slices_match_the_whole_tensor(recipe, grouped, monkeypatch):
    from lightning_moe.modules import triton_block_quant as tk
    from lightning_moe.modules.fp8 import Tiling, dequantize, quantize, scale_of
    from lightning_moe.strategy import fp8_param_gather as g
    calls = []
    for name in ("rows_amax", "rows_quantize", "rows_dequantize", "quantize_slice", "dequantize_slice"):
        real = getattr(tk, name)
        monkeypatch.setattr(tk, name, lambda *a, real=real, name=name: (calls.append(name), real(*a))[1])
    rng = random.Random(1)
    torch.manual_seed(1)
    shape = (2, 256, 384) if grouped else (384, 256)
    b = g.weight_blocks(shape, recipe, grouped)
    w = (torch.randn(shape) * torch.logspace(-4, 2, shape[-1])).to(torch.bfloat16)
    flat = w.reshape(-1)
    flat[:16] = torch.tensor([2.0 ** -10 * (2 * j + 1) for j in range(8)] + [0.0] * 8)  # tiny and zero values
    n = flat.numel()
    cuts = sorted({0, n, *(rng.randrange(n) for _ in range(5))})
    x, t = w.reshape(b.R, b.C), Tiling(b.h, b.w)
    amax = x.abs().float().reshape(b.grid[0], b.h, b.grid[1], b.w).amax((1, 3))
    mine = torch.zeros(b.grid)
    for lo, hi in zip(cuts, cuts[1:]):
        g.local_amax(flat[lo:hi], b, lo, hi, mine)
    assert torch.equal(mine, amax)
    s = scale_of(amax, "e4m3")
    q = torch.empty(n, dtype=torch.float8_e4m3fn)
    d = torch.empty(n, dtype=torch.bfloat16)
    for lo, hi in zip(cuts, cuts[1:]):
        g.quantize_into(q[lo:hi], flat[lo:hi], b, lo, hi, s)
        g.dequantize_into(d[lo:hi], q[lo:hi], b, lo, hi, s)
    q_ref, s_ref = quantize(x, "e4m3", t, amax=amax)
    bad = q.view(torch.uint8) != q_ref.reshape(-1).view(torch.uint8)
    assert not bad.any(), f"{int(bad.sum())} bytes differ"
    assert torch.equal(d, dequantize(q_ref, s_ref, t).to(torch.bfloat16).reshape(-1))
    assert {"rows_amax", "rows_quantize", "rows_dequantize", "quantize_slice", "dequantize_slice"} <= set(calls)


@inside
def test_nan_reaches_the_amax():
    """A NaN weight makes its block's amax NaN, as torch's amax does (the whole block then quantizes to NaN)."""
    from lightning_moe.modules import triton_block_quant as tk
    x = torch.randn(64, 256, dtype=torch.bfloat16)
    x[40, 200] = float("nan")
    amax = torch.zeros(2, 2)
    tk.rows_amax(x.reshape(-1), amax, 0, 256, 32, 128)
    want = x.float().abs().reshape(2, 32, 2, 128).amax((1, 3))
    assert want[1, 1].isnan() and amax[1, 1].isnan()
    others = [0, 0, 1], [0, 1, 0]
    assert torch.equal(amax[others], want[others])
