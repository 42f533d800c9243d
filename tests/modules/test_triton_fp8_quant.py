"""The rowwise FP8 quantization kernels (``triton_fp8_quant.py``) on CPU under the Triton interpreter, against the
torch code they replace in ``fp8_grouped_kernels``: the same fp8 bytes and scales, exactly. Skipped without triton
(CI); the GPU cases are ``tests/test_gpu_fp8_quant.py``. Run in a fresh process with ``TRITON_INTERPRET=1``, as
``test_fused_interpret.py`` explains."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.modules.interpreted import INSIDE, run_interpreted  # noqa: E402


@pytest.mark.skipif(INSIDE, reason="the outer test only")
def test_kernels_under_the_interpreter():
    run_interpreted(__file__, timeout=600, passed=34)


inside = pytest.mark.skipif(not INSIDE, reason="runs in the interpreter's process")


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    bad = a.view(torch.uint8) != b.view(torch.uint8)
    assert not bad.any(), f"{int(bad.sum())} fp8 bytes differ, first at {bad.nonzero()[:4].tolist()}"


def _operand(M: int, K: int, dtype, seed: int) -> torch.Tensor:
    """Gaussian rows at spread magnitudes, an all-zero row, one row with a single large value (the rest lands in
    E4M3's subnormals), and exact ties of E4M3's rounding (normal and subnormal) after a scale of 1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-3, 3, M).unsqueeze(1)
    if M > 2:
        x[1] = 0
        x[2] = torch.randn(K, generator=g) * 1e-3
        x[2, 0] = 100.0
    if M > 3:
        ties = torch.tensor([64.0 + 4 * (2 * j + 1) for j in range(8)] + [2.0 ** -10 * (2 * j + 1) for j in range(8)])
        x[3] = 448.0  # scale 1: the ties stay ties
        x[3, 1:] = (ties * torch.tensor([1.0, -1.0]).repeat(8)).repeat(K // 16 + 1)[:K - 1]
    return x.to(dtype)


@inside
@pytest.mark.parametrize("M,K,dtype", [(37, 100, torch.bfloat16), (9, 8192, torch.bfloat16),
                                       (5, 9000, torch.bfloat16), (33, 64, torch.float32), (0, 48, torch.bfloat16)])
def test_rowwise_quant(M, K, dtype):
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules.fp8 import abs_amax
    from lightning_moe.modules.fp8_grouped import _cast
    x = _operand(M, K, dtype, M + K)
    q, s = tq.rowwise_quant(x)
    rq, rs = _cast(x, abs_amax(x, 1), "e4m3")
    _same_bytes(q, rq)
    assert s.shape == rs.shape and torch.equal(s, rs)


COUNTS = [[5, 0, 17, 1, 0, 20], [0, 300, 3, 0, 290, 16, 0], [0, 0, 7], [64, 0, 32], [0, 0, 0]]


@inside
@pytest.mark.parametrize("counts,tail,X,dtype", [(COUNTS[0], 9, 72, torch.bfloat16), (COUNTS[1], 30, 40,
                         torch.bfloat16), (COUNTS[2], 0, 200, torch.float32), (COUNTS[3], 16, 16, torch.bfloat16),
                         (COUNTS[4], 5, 24, torch.bfloat16)])
def test_grouped_colwise_quant_t(counts, tail, X, dtype):
    """Per (expert, feature) scales over uneven and empty experts, written transposed into the 16-row padded
    wgrad layout; tail rows hold NaN, which must reach neither an amax nor the layout."""
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules.expert_padding import padded_layout
    from lightning_moe.modules.fp8 import scale_of
    from lightning_moe.modules.fp8_grouped import _segment_amax, expert_of_rows
    from lightning_moe.modules.fp8_grouped_kernels import ALIGN, _by_expert_t
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    M = int(offs[-1]) + tail
    x = _operand(M, X, dtype, M * X)
    x[int(offs[-1]):] = float("nan")
    x_ref = torch.where((torch.arange(M) < offs[-1]).unsqueeze(1), x, 0)  # the reference reads tail rows
    gid_M = expert_of_rows(M, offs, x.device)
    dest_M, poffs, _, P = padded_layout(offs, M, ALIGN)
    gid_P = expert_of_rows(P, poffs, x.device)
    amax = tq.grouped_col_amax(x, offs, gid_M)
    ramax = _segment_amax(x_ref.abs(), offs)
    assert torch.equal(amax, ramax)
    q = tq.quant_t_padded(x, scale_of(amax, "e4m3"), offs, poffs, gid_P, P)
    rq, rs = _by_expert_t(x_ref, ramax, dest_M, gid_P, P, "e4m3")
    _same_bytes(q, rq)
    assert torch.equal(scale_of(amax, "e4m3"), rs)


@inside
@pytest.mark.parametrize("config", [(8, 4, 16, 4), (32, 16, 64, 4), (256, 32, 128, 4), (256, 64, 128, 4)])
def test_grouped_col_amax_configs(config):
    """Chunks that split experts, row blocks that do not divide them, partial column blocks: the same amaxes."""
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules.fp8_grouped import _segment_amax, expert_of_rows
    offs = torch.tensor(COUNTS[1]).cumsum(0).to(torch.int32)
    M = int(offs[-1]) + 7
    x = _operand(M, 72, torch.bfloat16, 5)
    x[int(offs[-1]):] = float("nan")  # the tail: in no amax
    ref = _segment_amax(torch.where((torch.arange(M) < offs[-1]).unsqueeze(1), x, 0).abs(), offs)
    assert torch.equal(tq.grouped_col_amax(x, offs, expert_of_rows(M, offs, x.device), config), ref)


@inside
def test_wiring_helpers():
    """``fp8_grouped_kernels``' fused helpers against their torch paths (the autograd function needs Hopper)."""
    from lightning_moe.modules import fp8_grouped_kernels as k
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules.expert_padding import padded_layout
    from lightning_moe.modules.fp8_grouped import expert_of_rows, tokens_amax
    from lightning_moe.modules.fp8_linear import FP8Spec
    spec = FP8Spec("rowwise")
    assert k._quant_kernels(spec, torch.zeros(1)) is tq
    assert k._quant_kernels(FP8Spec("tensorwise"), torch.zeros(1)) is None
    assert k._quant_kernels(FP8Spec("rowwise", fp8_format="hybrid"), torch.zeros(1)) is None
    offs = torch.tensor([3, 3, 40, 41]).to(torch.int32)
    M = 45
    x = _operand(M, 32, torch.bfloat16, 1)
    gid_M = expert_of_rows(M, offs, x.device)
    for role in ("input", "grad"):  # (q, dequantization scales, amax)
        ref = k._rows_and_amax(None, x, offs, gid_M, spec, role, "x", False, "e4m3", False)
        for amax in (False, True):
            got = k._rows_and_amax(tq, x, offs, gid_M.to(torch.int32), spec, role, "x", False, "e4m3", amax)
            _same_bytes(got[0], ref[0])
            assert torch.equal(got[1], ref[1]) and ref[2] is None and (got[2] is not None) == amax
    dest_M, poffs, _, P = padded_layout(offs, M, k.ALIGN)
    gid_P = expert_of_rows(P, poffs, x.device)
    x[41:] = 0  # the torch layout carries tail rows past the last expert; the fused one writes zeros there
    q, s = k._by_expert_t_fused(tq, x, offs, gid_M, poffs, gid_P, P, spec, "x_t", "e4m3")
    rq, rs = k._by_expert_t(x, tokens_amax(x, offs, k.tiling("rowwise", "input"), spec, "x_t", False), dest_M,
                            gid_P, P, "e4m3")
    _same_bytes(q, rq)
    assert torch.equal(s, rs)


@inside
@pytest.mark.parametrize("M,K,dtype", [(100, 48, torch.bfloat16), (256, 96, torch.bfloat16), (37, 200, torch.float32)])
def test_colwise_quant_t(M, K, dtype):
    """``colwise_quant_t``: ``rowwise_quant`` of the transposed copy, bit for bit (rows and columns not multiples of
    the kernels' blocks, an all-zero column, the ties of ``_operand``'s rows)."""
    from lightning_moe.modules import triton_fp8_quant as tq
    x = _operand(M, K, dtype, M + K)
    x[:, 5] = 0
    q, s = tq.colwise_quant_t(x)
    rq, rs = tq.rowwise_quant(x.t().contiguous())
    _same_bytes(q, rq)
    assert s.shape == rs.shape and s.dtype == rs.dtype and torch.equal(s, rs)
    # column amaxes from elsewhere (reduced over data ranks): larger for some columns, smaller (saturating) for others
    from lightning_moe.modules.fp8 import Tiling, quantize
    amax_K1 = x.t().abs().amax(1, keepdim=True).float() * torch.linspace(0.5, 2.0, K).unsqueeze(1)
    q, s = tq.colwise_quant_t(x, "e4m3", amax_K1)
    rq, rs = quantize(x.t().contiguous(), "e4m3", Tiling(1, None), amax_K1)
    _same_bytes(q, rq)
    assert s.shape == rs.shape and torch.equal(s, rs)


@inside
@pytest.mark.parametrize("recipe,fp8_format,calls", [("rowwise", None, 2), ("rowwise", "hybrid", 1),
                                                     ("tensorwise", None, 0)])
def test_dense_linear_wgrad_quant_t(recipe, fp8_format, calls, monkeypatch):
    """The dense FP8 linear's wgrad operands quantized straight into the transposed layout (``colwise_quant_t``)
    against ``rowwise_quant`` of the transposed copies, as before: the same output, dgrad and wgrad, bit for bit. Each
    operand on its own: hybrid's E5M2 gradient takes torch's quantization, tensorwise no kernel."""
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules.fp8_linear import FP8Spec, fp8_linear
    x = _operand(100, 48, torch.bfloat16, 3)
    w = (torch.randn(32, 48, generator=torch.Generator().manual_seed(4)) * 0.02).bfloat16()
    dy = _operand(100, 32, torch.bfloat16, 5)
    used, colwise = [], tq.colwise_quant_t
    outs = []
    for new in (True, False):
        monkeypatch.setattr(tq, "colwise_quant_t", (lambda x_MK, fmt, amax=None, inverse=False: used.append(fmt)
                                                    or colwise(x_MK, fmt, amax, inverse)) if new
                            else (lambda x_MK, fmt, amax=None, inverse=False: _copy_quant(x_MK, fmt, inverse)))
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(xi, wi, FP8Spec(recipe, fp8_format=fp8_format))
        outs.append((y, *torch.autograd.grad(y, (xi, wi), dy)))
    assert len(used) == calls
    for a, b, name in zip(*outs, ("y", "dx", "dw")):
        assert torch.equal(a, b), name


def _check_pack_and_unpack(M, D, dtype, monkeypatch, exact_cast: bool, device: str = "cpu") -> None:
    from lightning_moe.modules import fp8_dispatch
    x = _operand(M, D, dtype, M * D + 3).to(device)
    fused = fp8_dispatch.pack(x)
    monkeypatch.setattr(fp8_dispatch, "_kernels", lambda t: None)
    ref = fp8_dispatch.pack(x)
    assert fused.shape == ref.shape == (M, fp8_dispatch.row_bytes(D)) and torch.equal(fused, ref)
    assert fused.shape[1] % 16 == 0
    if M > 4:  # every E4M3 byte, NaN included, in one row
        ref[4, :D] = torch.arange(D, dtype=torch.int32, device=device).remainder(256).to(torch.uint8)
    want = {t: fp8_dispatch.unpack(ref, t, D) for t in (torch.float32, dtype)}
    monkeypatch.undo()
    for t, w in want.items():
        got = fp8_dispatch.unpack(ref, t, D)
        assert got.dtype == w.dtype == t and got.shape == w.shape and torch.equal(got.isnan(), w.isnan())
        got, w = got.nan_to_num(), w.nan_to_num()
        if t == torch.float32 or exact_cast:  # decoded from the bits and divided as torch divides: exact
            assert torch.equal(got, w), (got - w).abs().max()
        else:  # the interpreter casts float32 to bf16 by truncation, not to nearest: within one ulp
            torch.testing.assert_close(got.float(), w.float(), rtol=2.0 ** -7, atol=0.0)


PACK_CASES = [(37, 100, torch.bfloat16), (9, 2048, torch.bfloat16), (5, 64, torch.float32), (0, 48, torch.bfloat16),
              (6, 4100, torch.bfloat16)]


@inside
@pytest.mark.parametrize("M,D,dtype", PACK_CASES)
def test_fp8_dispatch_pack_and_unpack(M, D, dtype, monkeypatch):
    """``fp8_dispatch.pack`` / ``unpack`` through the kernels (rowwise_quant, dequant_packed) against their torch
    code: the same packed bytes, and the same dequantized values (E4M3 decoded from its bits, NaN kept)."""
    _check_pack_and_unpack(M, D, dtype, monkeypatch, exact_cast=False)



@inside
def test_quant_t_padded_into_a_column_slice():
    """``quant_t_padded(out=...)``: the same bytes written into columns of a wider buffer (the deferred wgrad's arena),
    the columns around them untouched; a view of the wrong shape, dtype or column stride is refused."""
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules.expert_padding import padded_layout
    from lightning_moe.modules.fp8_grouped import expert_of_rows
    x = _operand(100, 48, torch.bfloat16, 8)
    offs = torch.tensor([30, 30, 75, 100], dtype=torch.int32)
    _, poffs, _, P = padded_layout(offs, 100, 16)
    gid_P = expert_of_rows(P, poffs, x.device)
    scale = torch.rand(4, 48) * 10 + 1
    want = tq.quant_t_padded(x, scale, offs, poffs, gid_P, P)
    wide = torch.full((48, P + 48), 7, dtype=torch.uint8).view(torch.float8_e4m3fn)
    got = tq.quant_t_padded(x, scale, offs, poffs, gid_P, P, out=wide[:, 16:16 + P])
    assert got.data_ptr() == wide[:, 16:].data_ptr()
    _same_bytes(wide[:, 16:16 + P], want)
    assert (wide[:, :16].view(torch.uint8) == 7).all() and (wide[:, 16 + P:].view(torch.uint8) == 7).all()
    for bad in (wide[:, :P - 1], wide[:, :P].view(torch.uint8), torch.empty(P, 48, dtype=wide.dtype).t()):
        with pytest.raises(ValueError, match="unit column stride"):
            tq.quant_t_padded(x, scale, offs, poffs, gid_P, P, out=bad)


@inside
@pytest.mark.parametrize("M,K", [(40, 96), (5, 8200)])  # one pass; two (rows wider than 8192)
def test_inverse_scales(M, K):
    """``inverse=True``: the GEMMs' dequantization scales, ``scale.reciprocal()``'s bits, and the same bytes."""
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules.fp8_grouped import expert_of_rows
    x = _operand(M, K, torch.bfloat16, 3)
    q, s = tq.rowwise_quant(x)
    qi, si = tq.rowwise_quant(x, inverse=True)
    _same_bytes(qi, q)
    assert torch.equal(si, s.reciprocal())
    if K < 1024:  # the fused kernel too (its wide rows are slow under the interpreter)
        offs = torch.tensor([7, 7, M - 3], dtype=torch.int32)
        qf, sf, _ = tq.rowwise_quant_col_amax(x, offs, expert_of_rows(M, offs, x.device, int32=True), inverse=True)
        _same_bytes(qf, q)
        assert torch.equal(sf, s.reciprocal())


def _copy_quant(x_MK, fmt, inverse):
    """``rowwise_quant`` of the transposed copy, with its scales' reciprocals where asked (``colwise_quant_t``'s)."""
    from lightning_moe.modules import triton_fp8_quant as tq
    q, s = tq.rowwise_quant(x_MK.t().contiguous(), fmt)
    return (q, s, s.reciprocal()) if inverse else (q, s)


@inside
@pytest.mark.parametrize("M,K,given", [(300, 72, False), (5, 130, True), (0, 16, False)])
def test_colwise_quant_t_inverse(M, K, given):
    """``colwise_quant_t(inverse=True)``: the bytes and scales of the copy's ``rowwise_quant``, and the scales'
    reciprocals (with given amaxes: ``fp8.quantize``'s); no rows: the scales of zero amaxes."""
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules.fp8 import Tiling, quantize
    x = _operand(M, K, torch.bfloat16, 7)
    amax = (x.float().abs().amax(0) * 1.5).reshape(K, 1) if given and M else None
    q, s, inv = tq.colwise_quant_t(x, "e4m3", amax, inverse=True)
    rq, rs = quantize(x.t().contiguous(), "e4m3", Tiling(1, None), amax) if M else \
        (torch.empty(K, 0, dtype=torch.float8_e4m3fn), torch.full((K, 1), 448.0 / 1e-12))
    _same_bytes(q, rq)
    assert torch.equal(s, rs.reshape(K, 1)) and torch.equal(inv, s.reciprocal())


@inside
@pytest.mark.parametrize("counts,tail", [([130, 0, 7, 256], 9), ([1, 0, 0], 0)])
def test_quant_t_padded_block_expert(counts, tail):
    """``quant_t_padded(align=128)`` at the Triton wgrad's 128-row layout: each block's ends and scales read once, the
    bytes of the per-position gathers (empty experts, tail rows, a scale that is NaN)."""
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules.expert_padding import fp8_rows_layout
    from lightning_moe.modules.fp8 import scale_of
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    M = int(offs[-1]) + tail
    x = _operand(M, 72, torch.bfloat16, 11)
    gid_M, poffs, P, gid_P = fp8_rows_layout(offs, M, 128, fused=False)
    scale = scale_of(tq.grouped_col_amax(x, offs, gid_M), "e4m3")
    scale[0, 3] = float("nan")
    want = tq.quant_t_padded(x, scale, offs, poffs, gid_P, P)
    _same_bytes(tq.quant_t_padded(x, scale, offs, poffs, gid_P, P, align=128), want)

