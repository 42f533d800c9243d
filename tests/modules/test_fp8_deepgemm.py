"""The blockwise recipe on DeepGEMM (``fp8_deepgemm.py``) with CPU stand-ins for its kernels against the emulation.
The experts' ``m_grouped_fp8_gemm_nt_contiguous`` (its layouts checked: K-major operands, 1 x 128 scales MN-major
and TMA-aligned, 128 x 128 scales contiguous or transposed, experts on 128-row boundaries, -1 rows skipped) against
``fp8_grouped._FP8GroupedMM``, and the dense ``fp8_gemm_nt`` against ``fp8_linear``'s emulation: the same quantized
operands, so forward and dgrad agree to the bf16 output rounding and wgrad to float32 summation order (and an ulp in
its operands). The real kernels are ``tests/test_gpu_fp8_deepgemm.py``; the Triton quantizers against the references
here are ``tests/modules/test_triton_fp8_blockwise.py``."""

from __future__ import annotations

import types

import pytest
import torch

from lightning_moe.modules import fp8_deepgemm as dgm
from lightning_moe.modules import fp8_grouped
from lightning_moe.modules.fp8 import FORMATS, Tiling, scale_of
from lightning_moe.modules.fp8_linear import FP8Spec
from lightning_moe.modules.kernels import interpreting

L, K, N = 4, 256, 384
OFFS = [13, 13, 150, 170]  # uneven, one empty expert, one of more than 128 rows; 4 tail rows past the last expert
M = 174


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * torch.logspace(-1, 1, K)
    w = torch.randn(L, K, N, generator=g) * torch.logspace(-3, -1, N)
    dy = torch.randn(M, N, generator=g) * torch.logspace(-2, 0, N)
    x[170:], dy[170:] = float("nan"), float("nan")  # tail rows (dropped or foreign copies) hold anything
    return x, w, dy


def _m_grouped_on_cpu(a, b, d, layout, disable_ue8m0_cast):
    """DeepGEMM's SM 9.0 contract: each 128-row block takes its expert g from its first row (-1: the block is
    skipped), and ``d[p] = A[p] B[g]^T`` for all its rows, dequantized by A's per-(row, 128 columns) and B's per-
    (128 x 128) fp32 scales."""
    (aq, sfa), (bq, sfb) = a, b
    assert aq.dtype == bq.dtype == torch.float8_e4m3fn and d.dtype == torch.bfloat16 and disable_ue8m0_cast
    assert layout.dtype == torch.int32 and layout.shape == (aq.shape[0],)
    P, R = aq.shape
    G, NN, R2 = bq.shape
    assert R2 == R and aq.stride(1) == 1 and bq.stride(2) == 1, "K-major A and B"
    assert sfa.shape == (P, R // 128) and sfa.stride(0) == 1 and (R == 128 or sfa.stride(1) == P), \
        "1 x 128 scales MN-major (P is 4-aligned: no copy)"
    assert sfb.shape == (G, NN // 128, R // 128) and (sfb.is_contiguous() or sfb.transpose(1, 2).is_contiguous())
    lay = layout.tolist()
    a_f = (aq.float().reshape(P, R // 128, 128) * sfa.reshape(P, R // 128, 1)).reshape(P, R)
    for p in range(0, P, 128):
        g = lay[p]
        assert all(v in (g, -1) for v in lay[p:p + 128]), "an expert's rows share no block with another's"
        assert g >= 0 or all(v == -1 for v in lay[p:p + 128]), "a block whose first row is -1 is skipped whole"
        if g >= 0:
            b_f = bq[g].float().reshape(NN // 128, 128, R // 128, 128) * sfb[g][:, None, :, None]
            d[p:p + 128] = (a_f[p:p + 128] @ b_f.reshape(NN, R).t()).to(d.dtype)


FAKE = types.SimpleNamespace(m_grouped_fp8_gemm_nt_contiguous=_m_grouped_on_cpu,
                             get_mk_alignment_for_contiguous_layout=lambda: 128)


def _run(x, w, dy, spec, dg=None):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    offs = torch.tensor(OFFS, dtype=torch.int32)
    y = dgm.grouped_mm(x, w, offs, spec, dg) if dg is not None else fp8_grouped._FP8GroupedMM.apply(x, w, offs, spec)
    y.backward(dy)
    return y.detach()[:170], x.grad[:170], w.grad


def test_rows_of_lays_experts_on_128_row_boundaries():
    offs = torch.tensor(OFFS)
    rows = dgm.rows_of(offs, M)
    P = rows.src_P.numel()
    assert P == 256 + 128 * L
    starts = [0] + OFFS[:-1]
    pstarts = [0] + rows.poffs_L.tolist()[:-1]
    assert all(s % 128 == 0 for s in pstarts) and rows.poffs_L.tolist() == [128, 128, 384, 512]
    for g, (s, e) in enumerate(zip(starts, OFFS)):
        dest = rows.dest_M[s:e]
        assert dest.tolist() == list(range(pstarts[g], pstarts[g] + e - s))
        assert (rows.layout_P[dest] == g).all() and rows.src_P[dest].tolist() == list(range(s, e))
    assert (rows.layout_P >= 0).sum() == 170 and (rows.src_P >= 0).sum() == 170  # tail rows and padding: -1
    assert ((rows.layout_P >= 0) == (rows.src_P >= 0)).all()


def test_tiles_are_the_emulations_quantization():
    """1 x 128 tiles along K: the emulation's bytes; 128-token tiles of each expert for wgrad: its dequantized
    values (to an ulp)."""
    x, _, _ = _data()
    offs = torch.tensor(OFFS)
    rows = dgm.rows_of(offs, M)
    q, sf, w = dgm.tiles_reference(x, rows.src_P, "e4m3", True, torch.float32)
    amax = x[:170].abs().reshape(170, K // 128, 128).amax(2, keepdim=True)
    q_ref, scale = fp8_grouped._cast(x[:170].reshape(170, K // 128, 128), amax, "e4m3")
    dest = rows.dest_M[:170]
    assert torch.equal(q[dest].view(torch.uint8), q_ref.reshape(170, K).view(torch.uint8))
    assert torch.equal(sf.t()[dest], scale.reciprocal().reshape(170, K // 128))
    gid = fp8_grouped.expert_of_rows(M, offs, x.device)
    x0 = torch.where((torch.arange(M) < 170).unsqueeze(1), x, 0)
    w_ref = fp8_grouped._tokens_per_expert(x0, offs, gid, Tiling(1, 128), "e4m3", FP8Spec("blockwise"), "x_t", False)
    # the emulation divides by the scale, the GEMM path multiplies by its reciprocal: an ulp apart at most
    torch.testing.assert_close(w[dest], w_ref[:170], rtol=2 ** -22, atol=0)
    pad = rows.src_P < 0
    assert not q[pad].float().any() and not w[pad].any()


def test_weight_blocks_are_the_emulations_quantization():
    _, w, _ = _data()
    q, qt, sf = dgm.weight_blocks_reference(w, "e4m3")
    blocks = w.reshape(L, K // 128, 128, N // 128, 128)
    amax = blocks.abs().amax((2, 4), keepdim=True)
    q_ref, scale = fp8_grouped._cast(blocks, amax, "e4m3")
    assert torch.equal(q.view(torch.uint8), q_ref.reshape(L, K, N).view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), q.transpose(1, 2).view(torch.uint8))
    assert torch.equal(sf, scale.reciprocal().reshape(L, K // 128, N // 128))
    # the FP8 parameter all-gather's amaxes are used as given (here half the true ones: values saturate)
    q2, _, sf2 = dgm.weight_blocks_reference(w, "e4m3", (amax / 2).reshape(L * K // 128, N // 128))
    assert q2.float().abs().max() == FORMATS["e4m3"][1]
    assert torch.equal(sf2, (scale_of(amax / 2, "e4m3")).reciprocal().reshape(L, K // 128, N // 128))


def test_matches_the_emulation():
    """Forward, dgrad and wgrad through DeepGEMM's layouts equal the emulation of the blockwise recipe."""
    x, w, dy = _data()
    spec = FP8Spec("blockwise")
    mine = _run(x, w, dy, spec, FAKE)
    emulated = _run(x, w, dy, FP8Spec("blockwise", emulate=True))
    for a, b in zip(mine[:2], emulated[:2]):  # DeepGEMM writes bf16: one rounding apart at most
        torch.testing.assert_close(a, b.bfloat16().float(), rtol=2 ** -7, atol=1e-6)
    # wgrad: the same operands up to an ulp (reciprocal against division), float32 sums in another order; under the
    # Triton interpreter the kernels write the operands in bf16, as on the GPU
    rel = ((mine[2] - emulated[2]).norm() / emulated[2].norm()).item()
    assert rel < (4e-3 if interpreting() else 1e-6), rel


def test_transposed_weight_scales_would_be_caught():
    """The comparison can fail: with the forward's weight-scale grid not transposed (a plausible slip), y differs."""
    x, w, dy = _data()
    real = _m_grouped_on_cpu

    def slip(a, b, d, layout, disable_ue8m0_cast):
        (bq, sfb) = b
        sq = sfb.transpose(1, 2).contiguous().reshape(sfb.shape) if sfb.shape[1] != sfb.shape[2] else sfb
        return real(a, (bq, sq), d, layout, disable_ue8m0_cast)

    mine = _run(x, w, dy, FP8Spec("blockwise"), types.SimpleNamespace(
        m_grouped_fp8_gemm_nt_contiguous=slip, get_mk_alignment_for_contiguous_layout=lambda: 128))
    emulated = _run(x, w, dy, FP8Spec("blockwise", emulate=True))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(mine[0], emulated[0].bfloat16().float(), rtol=2 ** -7, atol=1e-6)


def test_weights_quantized_once_per_step():
    x, w, dy = _data()
    spec = FP8Spec("blockwise")
    spec.step = 0
    calls = []
    real = dgm._weights
    try:
        dgm._weights = lambda *a: calls.append(1) or real(*a)
        w = w.requires_grad_()
        for step in (0, 0, 1):  # two micro-batches of step 0, then step 1
            spec.step = step
            dgm.grouped_mm(x, w, torch.tensor(OFFS, dtype=torch.int32), spec, FAKE).backward(dy)
        assert len(calls) == 2
    finally:
        dgm._weights = real


def test_fp8_grouped_mm_takes_deepgemm_where_it_runs(monkeypatch):
    monkeypatch.setattr(dgm, "available", lambda device: True)
    monkeypatch.setattr(dgm, "deep_gemm", lambda: FAKE)
    x, w, dy = _data()
    calls = []
    monkeypatch.setattr(FAKE, "m_grouped_fp8_gemm_nt_contiguous",
                        lambda *a, **kw: calls.append(1) or _m_grouped_on_cpu(*a, **kw))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    fp8_grouped.fp8_grouped_mm(xr, wr, torch.tensor(OFFS, dtype=torch.int32), FP8Spec("blockwise")).backward(dy)
    assert calls == [1, 1]  # forward and dgrad
    for recipe, emulate in (("rowwise", True), ("blockwise", True)):  # other recipes, and emulate=True: not here
        calls.clear()
        fp8_grouped.fp8_grouped_mm(x, w, torch.tensor(OFFS, dtype=torch.int32), FP8Spec(recipe, emulate=emulate))
        assert calls == []


def test_unavailable_without_deepgemm_or_hopper():
    assert not dgm.available(torch.device("cpu"))
    assert not dgm.eligible("blockwise", 256, 384, torch.device("cpu"))
    assert not dgm.runs(FP8Spec("tensorwise"), torch.zeros(1, 256), torch.zeros(1, 256, 384))


def _dense_on_cpu(a, b, d, c=None, recipe=None, disable_ue8m0_cast=False):
    """DeepGEMM's dense SM 9.0 contract: ``d = A B^T (+ c)``, A (M, K) with per-(row, 128 columns) scales, B (N, K)
    with per-128 x 128 scales (bf16 out) or, with recipe (1, 1, 128), per-(row, 128 columns) ones (fp32 out, ``c``
    accumulated)."""
    (aq, sfa), (bq, sfb) = a, b
    assert aq.dtype == bq.dtype == torch.float8_e4m3fn and disable_ue8m0_cast
    (M, R), (NN, R2) = aq.shape, bq.shape
    assert R2 == R and aq.stride(1) == 1 and bq.stride(1) == 1 and sfa.shape == (M, R // 128)
    a_f = (aq.float().reshape(M, R // 128, 128) * sfa.reshape(M, R // 128, 1)).reshape(M, R)
    if recipe == (1, 1, 128):
        assert d.dtype == torch.float32 and c is d and sfb.shape == (NN, R // 128)
        b_f = (bq.float().reshape(NN, R // 128, 128) * sfb.reshape(NN, R // 128, 1)).reshape(NN, R)
        d += a_f @ b_f.t()
        return
    assert recipe is None and c is None and d.dtype == torch.bfloat16 and sfb.shape == (NN // 128, R // 128)
    b_f = (bq.float().reshape(NN // 128, 128, R // 128, 128) * sfb[:, None, :, None]).reshape(NN, R)
    d.copy_(a_f @ b_f.t())


@pytest.mark.parametrize("tokens", [100, 128])
def test_dense_linear_matches_the_emulation(monkeypatch, tokens):
    """A blockwise dense linear equals the emulation. In bf16 it runs as one expert of the grouped path (forward and
    dgrad on the m-grouped kernel, the tokens in place when they are a multiple of 128, wgrad on the dequantized
    operands); fp32 outputs keep the emulation for forward and dgrad (the kernels write bf16) and take the dense
    kernel's 1 x 128 by 1 x 128 wgrad along the tokens."""
    from lightning_moe.modules.fp8_linear import fp8_linear
    calls = []
    fake = types.SimpleNamespace(
        fp8_gemm_nt=lambda *a, **kw: calls.append(kw.get("recipe")) or _dense_on_cpu(*a, **kw),
        m_grouped_fp8_gemm_nt_contiguous=lambda *a, **kw: calls.append("grouped") or _m_grouped_on_cpu(*a, **kw),
        get_mk_alignment_for_contiguous_layout=lambda: 128)
    monkeypatch.setattr(dgm, "available", lambda device: True)
    monkeypatch.setattr(dgm, "deep_gemm", lambda: fake)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, tokens, 256, generator=g) * torch.logspace(-1, 1, 256)  # 200 tokens: padded to 256
    w = torch.randn(384, 256, generator=g) * 0.05
    dy = torch.randn(2, tokens, 384, generator=g)
    for dtype, kernels in ((torch.bfloat16, ["grouped", "grouped"]), (torch.float32, [(1, 1, 128)])):
        out = []
        for emulate in (True, False):
            calls.clear()
            xx, ww = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
            y = fp8_linear(xx, ww, FP8Spec("blockwise", emulate=emulate))
            y.backward(dy.to(dtype))
            out.append((y.detach().float(), xx.grad.float(), ww.grad.float()))
        assert calls == kernels  # forward, dgrad, wgrad
        for a, b in zip(out[1][:2], out[0][:2]):  # bf16 outputs
            torch.testing.assert_close(a, b.bfloat16().float(), rtol=2 ** -7, atol=1e-6)
        # wgrad in fp32, dequantized by the reciprocal scales (the emulation divides): an ulp per operand apart
        rel = ((out[1][2] - out[0][2]).norm() / out[0][2].norm()).item()
        assert rel < (1e-6 if dtype == torch.float32 else 4e-3), rel


def test_m_equals_zero():
    _, w, _ = _data()
    x = torch.zeros(0, K, requires_grad=True)
    y = dgm.grouped_mm(x, w.clone().requires_grad_(), torch.zeros(L, dtype=torch.int32), FP8Spec("blockwise"), FAKE)
    y.backward(torch.zeros(0, N))
    assert y.shape == (0, N) and x.grad.shape == (0, K)


def test_deepgemm_with_another_alignment_is_refused():
    x, w, _ = _data()
    other = types.SimpleNamespace(**{**vars(FAKE), "get_mk_alignment_for_contiguous_layout": lambda: 256})
    with pytest.raises(RuntimeError, match="alignment is 256 rows"):
        dgm.grouped_mm(x, w, torch.tensor(OFFS, dtype=torch.int32), FP8Spec("blockwise"), other)


def test_why_deepgemm_is_unavailable(monkeypatch):
    import sys
    monkeypatch.setattr(dgm, "_IMPORTED", {})
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import fails
    assert dgm.deep_gemm() is None and "import deep_gemm failed" in dgm._IMPORTED["why"]
    monkeypatch.setattr(dgm, "_IMPORTED", {})
    monkeypatch.setitem(sys.modules, "deep_gemm", types.SimpleNamespace(
        get_theoretical_mk_alignment_for_contiguous_layout=lambda: 256, m_grouped_fp8_gemm_nt_contiguous=None))
    assert dgm.deep_gemm() is None and "256 rows" in dgm._IMPORTED["why"]
    monkeypatch.setattr(dgm, "_IMPORTED", {})  # its __init__ skipped the kernels (CUDA before 12.1)
    monkeypatch.setitem(sys.modules, "deep_gemm", types.SimpleNamespace(__file__="/x/deep_gemm/__init__.py"))
    assert dgm.deep_gemm() is None and "/x/deep_gemm/__init__.py) has no FP8 grouped GEMMs" in dgm._IMPORTED["why"]
    monkeypatch.setattr(dgm, "_IMPORTED", {})
    monkeypatch.setitem(sys.modules, "deep_gemm", FAKE_WITH_ALIGN := types.SimpleNamespace(
        get_theoretical_mk_alignment_for_contiguous_layout=lambda: 128, m_grouped_fp8_gemm_nt_contiguous=None))
    assert dgm.deep_gemm() is FAKE_WITH_ALIGN
    assert dgm.unavailable(torch.device("cpu")) == "not an SM 9.0 GPU"
    monkeypatch.setattr(dgm, "ENABLED", False)
    assert dgm.unavailable(torch.device("cpu")) == "LMOE_DEEPGEMM=0"


def test_no_wgrad_operand_without_grad():
    """Under no_grad (validation) or for frozen experts the wgrad operand is not made; the outputs are the same."""
    x, w, _ = _data()
    offs = torch.tensor(OFFS, dtype=torch.int32)
    made = []
    real = dgm._tiles
    try:
        dgm._tiles = lambda *a: made.append(a[3]) or real(*a)
        y = dgm.grouped_mm(x, w.clone().requires_grad_(), offs, FP8Spec("blockwise"), FAKE)
        with torch.no_grad():
            y_eval = dgm.grouped_mm(x, w.clone().requires_grad_(), offs, FP8Spec("blockwise"), FAKE)
        y_frozen = dgm.grouped_mm(x.clone().requires_grad_(), w, offs, FP8Spec("blockwise"), FAKE)
    finally:
        dgm._tiles = real
    assert made == [True, False, False]
    assert torch.equal(y[:170], y_eval[:170]) and torch.equal(y_eval[:170], y_frozen[:170].detach())


def _aligned_data(seed=0):
    """``_data``'s 170 rows laid out as ``ModelConfig.expert_rows_align=128`` lays them (zero rows up to each expert's
    128-row boundary), then 5 tail rows: 517 rows, not a multiple of 128."""
    x, w, dy = _data(seed)
    sizes = [-(-c // 128) * 128 for c in torch.diff(torch.tensor([0] + OFFS)).tolist()]
    starts = torch.tensor([0] + sizes[:-1]).cumsum(0).tolist()
    dest = torch.cat([torch.arange(s, s + e - b) for s, b, e in zip(starts, [0] + OFFS[:-1], OFFS)])
    Ma = sum(sizes) + 5
    xa, dya = torch.zeros(Ma, K), torch.zeros(Ma, N)
    xa[dest], dya[dest] = x[:170], dy[:170]
    xa[sum(sizes):], dya[sum(sizes):] = float("nan"), float("nan")
    return xa, w, dya, torch.tensor(sizes).cumsum(0).to(torch.int32), dest


def test_aligned_rows_are_used_in_place():
    """With ``rows_align=128`` the experts' input is DeepGEMM's layout as it is: no scatter, no gather, and the same
    forward, dgrad and wgrad as the scattered path (the same tiles: the zero rows sit where rows_of pads)."""
    x, w, dy = _data()
    xa, _, dya, offs_a, dest = _aligned_data()
    rows = dgm.rows_aligned(offs_a, xa.shape[0])
    assert rows.dest_M is None and rows.layout_P.numel() == 640  # 517 rounded up to 128
    assert rows.layout_P.tolist() == [0] * 128 + [2] * 256 + [3] * 128 + [-1] * 128
    scattered = _run(x, w, dy, FP8Spec("blockwise"), FAKE)
    xa, wa = xa.requires_grad_(), w.clone().requires_grad_()
    ya = dgm.grouped_mm(xa, wa, offs_a, FP8Spec("blockwise", rows_align=128), FAKE)
    ya.backward(dya)
    assert ya.shape == (xa.shape[0], N) and xa.grad.shape == xa.shape
    assert torch.equal(ya.detach()[dest], scattered[0]) and torch.equal(xa.grad[dest], scattered[1])
    assert torch.equal(wa.grad, scattered[2])
    holes = torch.ones(512, dtype=torch.bool)
    holes[dest] = False
    assert not ya.detach()[:512][holes].any()  # zero rows in, zero rows out


def test_aligned_rows_are_checked_on_the_device():
    x, w, _ = _data()
    with pytest.raises(RuntimeError, match="rows_align=128 was promised"):
        dgm.grouped_mm(x, w, torch.tensor(OFFS, dtype=torch.int32), FP8Spec("blockwise", rows_align=128), FAKE)


def test_the_experts_pass_their_row_alignment_to_fp8():
    """``ModelConfig.expert_rows_align`` reaches the experts' GEMM modules and FP8Training's specs for them."""
    from lightning_moe import FP8Training
    from lightning_moe.modules.config import ModelConfig
    from lightning_moe.modules.moe_layer import MoELayer
    from lightning_moe.strategy.parallel_context import ParallelContext
    for align in (1, 128):
        cfg = ModelConfig(hidden_size=128, num_experts=4, moe_ffn_hidden_size=128, topk=2, num_layers=1,
                          seq_length=16, expert_rows_align=align)
        layer = MoELayer(cfg, ParallelContext.single(), out_std=0.02)
        for m in (layer.experts.fc1, layer.experts.fc2):
            assert m.rows_align == align
            g = types.SimpleNamespace(grouped=True, module=m, name="experts.fc1")
            assert FP8Training("blockwise")._spec(g, None).rows_align == align


def _fused_against_unfused(w0, x, dy, gemm, micro: int = 3, valid=None):
    """``gemm(x_i, w)`` over ``micro`` micro-batches (x scaled by i + 1) under GradSync with and without its
    gradient-accumulation fusion: asserts equal input gradients (their first ``valid`` rows) and returns the main
    grads' relative difference."""
    from lightning_moe.strategy.grad_sync import GradSync
    from lightning_moe.strategy.parallel_context import ParallelContext
    out = {}
    for fuse in (False, True):
        w = torch.nn.Parameter(w0.bfloat16())
        w.wgrad_fusable = True
        sync = GradSync([w], ParallelContext.single(), main_grads=True, fuse_wgrad=fuse)
        assert [id(p) for p in sync.fused_params] == ([id(w)] if fuse else [])
        dxs = []
        for i in range(micro):
            xx = (x * (i + 1)).bfloat16().requires_grad_()
            if i == micro - 1:
                sync.arm()
            gemm(xx, w).backward(dy.bfloat16())
            dxs.append(xx.grad[:valid].float())
        sync.finish()
        out[fuse] = (w.main_grad.clone(), dxs)
    assert all(torch.equal(a, b) for a, b in zip(out[True][1], out[False][1]))
    return ((out[True][0] - out[False][0]).norm() / out[False][0].norm()).item()


def test_expert_wgrad_goes_into_the_main_grad():
    """Under GradSync's gradient-accumulation fusion the wgrad of the dequantized operands is summed in fp32 straight
    into ``main_grad`` (no bf16 gradient for the hook to add): the unfused path's sum, less its per-micro-batch bf16
    rounding; the dgrad is untouched."""
    x, w0, dy = _data()
    offs = torch.tensor(OFFS, dtype=torch.int32)
    rel = _fused_against_unfused(w0, x, dy, lambda xx, w: dgm.grouped_mm(xx, w, offs, FP8Spec("blockwise"), FAKE),
                                 valid=170)
    assert 0 < rel < 4e-3, rel  # the unfused path rounds each micro-batch's gradient to bf16


@pytest.mark.parametrize("tokens", [100, 128])
def test_dense_wgrad_goes_into_the_main_grad(monkeypatch, tokens):
    """A dense blockwise linear on the grouped path sums its wgrad in fp32 into ``main_grad`` under GradSync's fusion
    (the tokens' zero padding adds nothing); the input gradient is untouched."""
    from lightning_moe.modules.fp8_linear import fp8_linear
    monkeypatch.setattr(dgm, "available", lambda device: True)
    monkeypatch.setattr(dgm, "deep_gemm", lambda: FAKE)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, tokens, 256, generator=g)
    w0 = torch.randn(384, 256, generator=g) * 0.05
    dy = torch.randn(2, tokens, 384, generator=g)
    rel = _fused_against_unfused(w0, x, dy, lambda xx, w: fp8_linear(xx, w, FP8Spec("blockwise")), micro=2)
    assert 0 < rel < 4e-3, rel
