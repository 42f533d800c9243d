"""The fused rowwise quantization and per-expert column amax (``triton_fp8_quant.rowwise_quant_col_amax``) on CPU under
the Triton interpreter, against the two kernels it fuses (``rowwise_quant``, ``grouped_col_amax``; both tested against
the torch code in ``test_triton_fp8_quant.py``): the same fp8 bytes, scales and amaxes, bit for bit. Uneven and empty
experts, chunks that split experts, rows and features that are not multiples of the blocks, wide rows (two reads of a
row block), tail rows past offs[-1] holding NaN (quantized as ``rowwise_quant`` does, in no amax). Skipped without
triton (CI). Run in a fresh process with ``TRITON_INTERPRET=1``, as ``test_fused_interpret.py`` explains."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.modules.interpreted import INSIDE, run_interpreted  # noqa: E402


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_kernel_under_the_interpreter():
    run_interpreted(__file__, timeout=600, passed=17)


inside = pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bytes (NaNs included, which ``torch.equal`` never finds equal)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    bad = a.contiguous().view(torch.uint8) != b.contiguous().view(torch.uint8)
    assert not bad.any(), f"{int(bad.sum())} bytes differ, first at {bad.nonzero()[:4].tolist()}"


def _same_amax(a: torch.Tensor, b: torch.Tensor) -> None:
    """The same bits, but for a NaN's: the fused kernel's is fp32's canonical one (0x7FFFFFFF), ``grouped_col_amax``'s
    on a GPU too (PTX's max.NaN), while the interpreter's numpy keeps the input's."""
    assert torch.equal(a.isnan(), b.isnan())
    _same_bits(a.nan_to_num(), b.nan_to_num())


def _operand(counts, tail: int, K: int, dtype, seed: int, nan_inside: bool = False):
    """``(x_MK, offs_L, gid_M)``: Gaussian rows at spread magnitudes, an all-zero row, a row with one large value (the
    rest in E4M3's subnormals), a row of E4M3 rounding ties after a scale of 1, the second non-empty expert all zeros
    where there are three, and NaN tail rows (optionally a NaN inside an expert too, which its amax must carry)."""
    from lightning_moe.modules.fp8_grouped import expert_of_rows
    g = torch.Generator().manual_seed(seed)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    end = int(offs[-1]) if len(counts) else 0
    M = end + tail
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, M).unsqueeze(1)
    if M > 3:
        x[1] = 0
        x[2] = torch.randn(K, generator=g) * 1e-3
        x[2, 0] = 100.0
        ties = torch.tensor([64.0 + 4 * (2 * j + 1) for j in range(8)] + [2.0 ** -10 * (2 * j + 1) for j in range(8)])
        x[3] = 448.0
        x[3, 1:] = (ties * torch.tensor([1.0, -1.0]).repeat(8)).repeat(K // 16 + 1)[:K - 1]
    full = [e for e, c in enumerate(counts) if c]
    if len(full) > 2:
        e = full[1]
        x[int(offs[e]) - counts[e]:int(offs[e])] = 0
    # NaNs set after the cast: torch's quiet NaN (its vectorized cast gives 0xFFFF). The interpreter's product of
    # two NaNs keeps one's bits, which of them depending on numpy's loop; the GPU's is canonical
    x = x.to(dtype)
    if nan_inside and len(full) > 1:
        x[int(offs[full[-1]]) - 1, K // 2] = float("nan")
    x[end:] = float("nan")
    return x, offs, expert_of_rows(M, offs, x.device)


def _check(x, offs, gid, config=None) -> None:
    from lightning_moe.modules import triton_fp8_quant as tq
    q, s, amax = tq.rowwise_quant_col_amax(x, offs, gid, config=config)
    rq, rs = tq.rowwise_quant(x)
    _same_bits(q, rq)
    _same_bits(s, rs)
    # wide rows: few wide column blocks for the reference (the interpreter is slow over many programs)
    wide = {"config": (256, 2, 8192, 4)} if x.shape[1] > 1024 else {}
    _same_amax(amax, tq.grouped_col_amax(x, offs, gid, **wide))


COUNTS = [[5, 0, 17, 1, 0, 20], [0, 300, 3, 0, 290, 16, 0], [0, 0, 7], [64, 0, 32], [0, 0, 0], [2, 0, 3]]


@inside
@pytest.mark.parametrize("counts,tail,K,dtype", [
    (COUNTS[0], 9, 72, torch.bfloat16),  # K not a power of two
    (COUNTS[1], 30, 40, torch.bfloat16),  # several chunks per expert, partial row blocks
    (COUNTS[2], 0, 200, torch.float32),  # no tail
    (COUNTS[3], 16, 16, torch.bfloat16),
    (COUNTS[4], 5, 24, torch.bfloat16),  # every expert empty: all rows are tail rows, all amaxes 0
    (COUNTS[5], 2, 9000, torch.bfloat16),  # wide rows in three blocks of 4096, kept in registers
    (COUNTS[5], 1, 16400, torch.bfloat16),  # wider still: the row block's second read (from L2 on a GPU)
])
def test_default_config(counts, tail, K, dtype):
    _check(*_operand(counts, tail, K, dtype, seed=K + tail))


@inside
@pytest.mark.parametrize("config", [
    (8, 1, 128, 4, 1, 1),  # a row at a time, chunks splitting every large expert
    (32, 4, 128, 4, 3, 1),  # pipelined (the interpreter ignores stages)
    (24, 4, 64, 2, 1, 1),  # a chunk that is no multiple of the row block; K = 72 in two blocks, the last partial
    (16, 2, 32, 4, 2, 0),  # three column blocks, the row block read twice
    (256, 8, 16, 8, 1, 0),  # one chunk for all rows, five column blocks read twice
    (16, 2, 16, 4, 1, 1),  # five column blocks kept in registers
])
def test_configs(config):
    """Configs of (CHUNK, BLOCK_M, BLOCK_K, warps, stages, keep) over uneven experts with a NaN in one of them."""
    _check(*_operand(COUNTS[1], 13, 72, torch.bfloat16, seed=7, nan_inside=True), config)


@inside
@pytest.mark.parametrize("config", [None, (4, 2, 8, 1, 1, 0)])
def test_nan_inside_an_expert(config):
    """A NaN reaches its expert's amax (as torch's amax), its row's scale and bytes, and nothing else."""
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules.fp8_grouped import _segment_amax
    x, offs, gid = _operand(COUNTS[0], 9, 24, torch.bfloat16, seed=3, nan_inside=True)
    _check(x, offs, gid, config)
    amax = tq.rowwise_quant_col_amax(x, offs, gid, config=config)[2]
    ref = _segment_amax(torch.where((torch.arange(x.shape[0]) < offs[-1]).unsqueeze(1), x, 0).float().abs(), offs)
    assert amax[-1].isnan().sum() == 1 and amax[:-1].isnan().sum() == 0
    assert amax.view(torch.int32)[amax.isnan()].eq(0x7FFFFFFF).all()  # canonical, whatever the order of the maxes
    torch.testing.assert_close(amax, ref, rtol=0, atol=0, equal_nan=True)


@inside
@pytest.mark.parametrize("M,K,L", [(0, 48, 3), (6, 32, 0)])
def test_empty(M, K, L):
    """No rows, or no experts (every row a tail row): ``rowwise_quant``'s output and zero-sized or zero
    amaxes, without a launch of the fused kernel."""
    from lightning_moe.modules import triton_fp8_quant as tq
    x = torch.randn(M, K).to(torch.bfloat16)
    offs = torch.full((L,), min(M, 2), dtype=torch.int32)
    gid = torch.zeros(M, dtype=torch.int32)
    q, s, amax = tq.rowwise_quant_col_amax(x, offs, gid)
    rq, rs = tq.rowwise_quant(x)
    _same_bits(q, rq)
    _same_bits(s, rs)
    assert amax.shape == (L, K) and not amax.any()
