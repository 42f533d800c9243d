"""The rowwise recipe's two weight copies in two passes (``triton_fp8_weights.py``) on CPU under the Triton
interpreter, against the torch code they replace in ``fp8_grouped_kernels``: the same fp8 bytes and scales, exactly,
over tile configs that do and do not divide the weight. Skipped without triton (CI); the GPU cases are
``tests/test_gpu_fp8_quant.py``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.modules.interpreted import INSIDE, run_interpreted  # noqa: E402


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_kernels_under_the_interpreter():
    run_interpreted(__file__, timeout=600, passed=4)


inside = pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")


def _weight(dtype, seed=0):
    """Columns and rows at spread magnitudes (the two layouts' scales differ), an all-zero expert, a zero row and
    column, one large value among small ones (subnormals after scaling)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(3, 200, 72, generator=g) * torch.logspace(-2, 2, 72) * torch.logspace(-1, 1, 200).unsqueeze(1)
    w[1] = 0
    w[0, 5], w[2, :, 7] = 0, 0
    w[2, 9] = torch.randn(72, generator=g) * 1e-4
    w[2, 9, 3] = 50.0
    return w.to(dtype)


@inside
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [None, (32, 16, 2)])  # None: the default
def test_both_copies_exact(dtype, config):
    from lightning_moe.modules import triton_fp8_weights as tw
    from lightning_moe.modules.fp8 import abs_amax, saturate, scale_of
    w = _weight(dtype)
    (qf, sf), (qd, sd) = tw.quantize_both(w, "e4m3", *([config] if config else []))
    ref_sf, ref_sd = scale_of(abs_amax(w, 1), "e4m3"), scale_of(abs_amax(w, 2), "e4m3")
    ref_qf = saturate(w, ref_sf, 448.0, torch.float8_e4m3fn).transpose(1, 2).contiguous()
    ref_qd = saturate(w, ref_sd, 448.0, torch.float8_e4m3fn)
    assert torch.equal(sf, ref_sf) and torch.equal(sd, ref_sd)
    for got, ref in ((qf, ref_qf), (qd, ref_qd)):
        assert got.shape == ref.shape and got.is_contiguous()
        bad = got.view(torch.uint8) != ref.view(torch.uint8)
        assert not bad.any(), f"{int(bad.sum())} bytes differ, first at {bad.nonzero()[:4].tolist()}"
