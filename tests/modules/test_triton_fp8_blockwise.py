"""The blockwise recipe's quantizers for DeepGEMM (``triton_fp8_blockwise.py``) on CPU under the Triton interpreter,
against the torch references in ``fp8_deepgemm``: the same bytes, scales and bf16 wgrad operands. Skipped without
triton (CI); the GPU case is ``tests/test_gpu_fp8_deepgemm.py``."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.modules.interpreted import INSIDE, run_interpreted  # noqa: E402


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_kernels_under_the_interpreter():
    run_interpreted(__file__, timeout=600, passed=4)


inside = pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")


def _x(M, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * torch.logspace(-3, 2, K)).to(dtype)
    x[5] = 0.0  # an all-zero row: its tiles get the tiny-amax scale
    x[7, :16] = torch.tensor([2.0 ** -12 * (2 * j + 1) for j in range(8)] + [0.0] * 8)  # E4M3 subnormals after scaling
    return x


@inside
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tiles_match_the_reference(dtype):
    from lightning_moe.modules import fp8_deepgemm as dgm
    from lightning_moe.modules import triton_fp8_blockwise as tk
    offs = torch.tensor([40, 40, 200, 230])
    x = _x(236, 256, dtype)
    rows = dgm.rows_of(offs, 236)
    end = int(rows.poffs_L[-1])  # past it (no expert's rows) the kernel writes nothing
    q, sf, w = tk.tiles(x, rows.src_P, rows.poffs_L[-1:], "e4m3", True)
    q_ref, sf_ref, w_ref = dgm.tiles_reference(x, rows.src_P, "e4m3", True, torch.bfloat16)
    bad = q[:end].view(torch.uint8) != q_ref[:end].view(torch.uint8)
    assert not bad.any(), f"{int(bad.sum())} bytes differ"
    assert torch.equal(sf[:, :end], sf_ref[:, :end])
    assert torch.equal(w[:end].view(torch.int16), w_ref[:end].view(torch.int16)), "the wgrad operand's rounding"
    q2, sf2, w2 = tk.tiles(x, rows.src_P, rows.poffs_L[-1:], "e4m3", False)
    assert w2 is None and torch.equal(q2[:end].view(torch.uint8), q[:end].view(torch.uint8))
    assert torch.equal(sf2[:, :end], sf[:, :end])


@inside
@pytest.mark.parametrize("preset", [False, True])
def test_weight_blocks_match_the_reference(preset):
    from lightning_moe.modules import fp8_deepgemm as dgm
    from lightning_moe.modules import triton_fp8_blockwise as tk
    w = _x(2 * 256, 384, torch.bfloat16, seed=1).reshape(2, 256, 384)
    amax = w.float().abs().reshape(2, 2, 128, 3, 128).amax((2, 4)).reshape(4, 3) / 3 if preset else None
    got = tk.weight_blocks(w, "e4m3", amax)
    ref = dgm.weight_blocks_reference(w, "e4m3", amax)
    for a, b in zip(got[:2], ref[:2]):
        bad = a.view(torch.uint8) != b.view(torch.uint8)
        assert not bad.any(), f"{int(bad.sum())} bytes differ"
    assert torch.equal(got[2], ref[2])
