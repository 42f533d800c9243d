"""The experts' FP8 forward/dgrad kernel (``triton_fp8_grouped_mm.py``) on CPU under the Triton interpreter, whose dot
has no FP8: the same kernel on fp32 operands (it is generic in the operand type), against a float64 reference. Experts
whose rows straddle tiles, an empty expert, a tail of rows past the last expert, dims that are not multiples of the
tiles, both accumulations. Skipped without triton (CI); the FP8 cases run on a GPU (``tests/test_gpu_fp8_quant.py``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.modules.interpreted import INSIDE, run_interpreted  # noqa: E402


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_kernel_under_the_interpreter():
    run_interpreted(__file__, timeout=600, passed=6)


inside = pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")


def _case(counts, K=144, N=40, tail=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    M = int(offs[-1]) + tail
    L = len(counts)
    return (torch.randn(M, K, generator=g), torch.randn(L, N, K, generator=g), torch.rand(M, generator=g) + 0.5,
            torch.rand(L, N, generator=g) + 0.5, offs)


def _reference(a, b, sa, sb, offs):
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = (a[start:end].double() @ b[e].double().t()) * sa[start:end, None].double() \
            * sb[e].double()
        start = end
    return out


@inside
@pytest.mark.parametrize("counts", [[37, 0, 16, 75], [16, 16, 16, 16], [0, 0, 50, 0]])
def test_matches_the_reference(counts):
    from lightning_moe.modules import triton_fp8_grouped_mm as tg
    a, b, sa, sb, offs = _case(counts)
    out = tg.grouped_mm(a, b, sa, sb, offs, config=(16, 32, 4, 1), out_dtype=torch.float32)
    end = int(offs[-1])
    torch.testing.assert_close(out[:end].double(), _reference(a, b, sa, sb, offs)[:end], rtol=1e-5, atol=1e-4)


@inside
@pytest.mark.parametrize("fast", [False, True])
def test_larger_tiles_and_both_accumulations(fast):
    """Tiles larger than some experts, N past the last tile, scales given as (M, 1) and (L, 1, N)."""
    from lightning_moe.modules import triton_fp8_grouped_mm as tg
    a, b, sa, sb, offs = _case([70, 3, 0, 100], K=272, N=72, tail=0, seed=1)
    out = tg.grouped_mm(a, b, sa.unsqueeze(1), sb.unsqueeze(1), offs, fast=fast, config=(32, 64, 4, 2),
                        out_dtype=torch.float32)
    torch.testing.assert_close(out.double(), _reference(a, b, sa, sb, offs), rtol=1e-5, atol=1e-4)


def test_bad_shapes_are_refused():
    from lightning_moe.modules import triton_fp8_grouped_mm as tg
    a, b, sa, sb, offs = _case([4, 4], K=32, tail=0)
    with pytest.raises(ValueError, match="FP8 grouped GEMM"):
        tg.grouped_mm(a, b[:, :, :16], sa, sb, offs)
