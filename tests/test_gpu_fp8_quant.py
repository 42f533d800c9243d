"""The rowwise FP8 quantization kernels (``triton_fp8_quant.py``) on the GPU (skipped without CUDA or triton): the
same fp8 bytes and scales as the torch code at Qwen3's and Mixtral's expert shapes, and ``_ScaledGroupedMM``'s
forward, dgrad and wgrad bit-identical with the kernels on and off (``fp8_grouped_kernels.FUSED_QUANT``); the dense
linear's likewise, and with its wgrad operands quantized straight into the transposed layout or from transposed
copies."""

from __future__ import annotations

import pytest
import torch

from lightning_moe.modules import fp8_grouped_kernels as k

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
tq = pytest.importorskip("lightning_moe.modules.triton_fp8_quant")
hopper = pytest.mark.skipif(not torch.cuda.is_available() or not k.available(torch.device("cuda")),
                            reason="torch._scaled_grouped_mm needs SM 9.0")


def _same_bytes(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    bad = a.view(torch.uint8) != b.view(torch.uint8)
    assert not bad.any(), f"{int(bad.sum())} fp8 bytes differ, first at {bad.nonzero()[:4].tolist()}"


def _uneven_offs(M_valid: int, L: int, g) -> torch.Tensor:
    """Cumulative ends of L experts of very uneven sizes (some empty) summing to M_valid."""
    w = torch.rand(L, generator=g, device="cuda") ** 3
    w[torch.randperm(L, generator=g, device="cuda")[:L // 10]] = 0
    counts = (w / w.sum() * M_valid).floor().long()
    counts[int(w.argmax())] += M_valid - counts.sum()
    return counts.cumsum(0).to(torch.int32)


def _x(M, K, g, dtype=torch.bfloat16):
    x = torch.randn(M, K, generator=g, device="cuda") * torch.logspace(-2, 2, M, device="cuda").unsqueeze(1)
    x[::97] = 0
    return x.to(dtype)


@pytest.mark.parametrize("M,K", [(131072, 2048), (131072, 1536), (131072, 768), (16384, 28672), (1000, 100)])
def test_rowwise_quant_exact(M, K):
    from lightning_moe.modules.fp8 import abs_amax
    from lightning_moe.modules.fp8_grouped import _cast
    g = torch.Generator(device="cuda").manual_seed(K)
    x = _x(M, K, g)
    q, s = tq.rowwise_quant(x)
    rq, rs = _cast(x, abs_amax(x, 1), "e4m3")
    _same_bytes(q, rq)
    assert torch.equal(s, rs)


@pytest.mark.parametrize("M,X,L", [(131072, 2048, 128), (131072, 1536, 128), (16384, 4096, 8), (3000, 200, 7)])
def test_grouped_colwise_quant_t_exact(M, X, L):
    from lightning_moe.modules.expert_padding import padded_layout
    from lightning_moe.modules.fp8 import scale_of
    from lightning_moe.modules.fp8_grouped import _segment_amax, expert_of_rows
    g = torch.Generator(device="cuda").manual_seed(M + X)
    offs = _uneven_offs(M - 100, L, g)  # 100 tail rows
    x = _x(M, X, g)
    x[offs[-1]:] = float("nan")
    x_ref = torch.where((torch.arange(M, device="cuda") < offs[-1]).unsqueeze(1), x, 0)
    gid_M = expert_of_rows(M, offs, x.device)
    dest_M, poffs, _, P = padded_layout(offs, M, k.ALIGN)
    gid_P = expert_of_rows(P, poffs, x.device)
    amax = tq.grouped_col_amax(x, offs, gid_M)
    ramax = _segment_amax(x_ref.abs(), offs)
    assert torch.equal(amax, ramax)
    q = tq.quant_t_padded(x, scale_of(amax, "e4m3"), offs, poffs, gid_P, P)
    rq, rs = k._by_expert_t(x_ref, ramax, dest_M, gid_P, P, "e4m3")
    _same_bytes(q, rq)


@hopper
@pytest.mark.parametrize("M,K,N,L", [(131072, 2048, 1536, 128), (8192, 512, 256, 16)])
def test_scaled_grouped_mm_fused_on_off_identical(M, K, N, L, monkeypatch):
    from lightning_moe.modules.fp8_linear import FP8Spec
    g = torch.Generator(device="cuda").manual_seed(0)
    offs = _uneven_offs(M - 64, L, g)
    x = _x(M, K, g)
    w = (torch.randn(L, K, N, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    dy = torch.randn(M, N, generator=g, device="cuda").to(torch.bfloat16)
    outs = {}
    monkeypatch.setattr(k, "TRITON_WGRAD", False)  # CUTLASS's wgrad both times: this compares the quantizers
    for on in (False, True):
        monkeypatch.setattr(k, "FUSED_QUANT", on)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = k.scaled_grouped_mm(xg, wg, offs, FP8Spec("rowwise"))
        y.backward(dy)
        v = int(offs[-1])
        outs[on] = (y[:v], xg.grad[:v], wg.grad)
    for a, b, name in zip(outs[True], outs[False], ("y", "dx", "dw")):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("M,D,dtype", [(37, 100, torch.bfloat16), (5, 64, torch.float32), (0, 48, torch.bfloat16),
                                       (131072, 2048, torch.bfloat16)])
def test_fp8_dispatch_pack_and_unpack_exact(M, D, dtype, monkeypatch):
    """The FP8 dispatch's packing and unpacking through the kernels: the torch path's bytes and values, bit for bit."""
    from tests.modules.test_triton_fp8_quant import _check_pack_and_unpack
    _check_pack_and_unpack(M, D, dtype, monkeypatch, exact_cast=True, device="cuda")


@hopper
@pytest.mark.parametrize("L,K,N", [(8, 4096, 28672), (8, 14336, 4096), (128, 2048, 1536), (128, 768, 2048)])
def test_weight_copies_exact(L, K, N):
    """``triton_fp8_weights.quantize_both``: the forward and dgrad copies of the experts' weights with torch's bytes
    and scales, at Mixtral's and Qwen3's expert weights."""
    from lightning_moe.modules import triton_fp8_weights as tw
    from lightning_moe.modules.fp8 import abs_amax, saturate, scale_of
    g = torch.Generator(device="cuda").manual_seed(K + N)
    w = (torch.randn(L, K, N, generator=g, device="cuda") * torch.logspace(-2, 1, N, device="cuda")).bfloat16()
    w[0, :, 3] = 0
    (qf, sf), (qd, sd) = tw.quantize_both(w)
    ref_sf, ref_sd = scale_of(abs_amax(w, 1), "e4m3"), scale_of(abs_amax(w, 2), "e4m3")
    assert torch.equal(sf, ref_sf) and torch.equal(sd, ref_sd)
    _same_bytes(qf, k.saturate_t(w, ref_sf, 448.0, torch.float8_e4m3fn))
    _same_bytes(qd, saturate(w, ref_sd, 448.0, torch.float8_e4m3fn))


@pytest.mark.parametrize("M,K,L", [(131072, 2048, 128), (131072, 768, 128), (16384, 14336, 8), (16384, 28672, 8),
                                   (3000, 200, 7)])
def test_rowwise_quant_col_amax_exact(M, K, L):
    """``rowwise_quant_col_amax``: the two kernels' bytes, scales and amaxes from one read, with its default configs
    (rows kept in registers, and the widest read twice), at uneven experts with a NaN tail."""
    from lightning_moe.modules.fp8_grouped import expert_of_rows
    g = torch.Generator(device="cuda").manual_seed(M + K)
    offs = _uneven_offs(M - 50, L, g)
    x = _x(M, K, g)
    x[offs[-1]:] = float("nan")
    gid = expert_of_rows(M, offs, x.device)
    q, s, amax = tq.rowwise_quant_col_amax(x, offs, gid)
    rq, rs = tq.rowwise_quant(x)
    _same_bytes(q[:int(offs[-1])], rq[:int(offs[-1])])  # tail rows: NaN, whose E4M3 byte the two kernels may differ in
    assert torch.equal(s, rs) or torch.equal(s.nan_to_num(), rs.nan_to_num())
    assert torch.equal(amax, tq.grouped_col_amax(x, offs, gid))
    qi, si, ai = tq.rowwise_quant_col_amax(x, offs, gid, inverse=True)  # the GEMMs' dequantization scales
    _same_bytes(qi[:int(offs[-1])], q[:int(offs[-1])])
    assert torch.equal(si.nan_to_num(), s.reciprocal().nan_to_num()) and torch.equal(ai, amax)


@pytest.mark.parametrize("M,L,align", [(131072, 128, 128), (16384, 8, 128), (3000, 7, 16), (70000, 300, 16)])
def test_rows_layout_is_torchs(M, L, align):
    """``fp8_rows_layout`` in one Triton launch: torch's rows' experts, padded ends and padded positions' experts."""
    from lightning_moe.modules import triton_expert_rows as tk
    from lightning_moe.modules.expert_padding import padded_ends
    from lightning_moe.modules.fp8_grouped import expert_of_rows
    g = torch.Generator(device="cuda").manual_seed(M + L)
    offs = _uneven_offs(M - 50, L, g)
    gid, pends, P, gid_P = tk.rows_layout(offs, M, align)
    want_pends, want_P = padded_ends(offs, M, align)
    assert P == want_P and torch.equal(pends, want_pends)
    assert torch.equal(gid, expert_of_rows(M, offs, offs.device, int32=True))
    assert torch.equal(gid_P, expert_of_rows(P, want_pends, offs.device, int32=True))


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_dense_fp8_linear_one_pass_quant_identical(recipe, monkeypatch):
    """The dense FP8 linear (``fp8_linear``) with its rowwise operands quantized by one Triton kernel each and with
    torch's amax, scale and cast (``FUSED_QUANT`` off): the same output, dgrad and wgrad, bit for bit (tensorwise
    never takes the kernel: the check that both runs take the same path there)."""
    from lightning_moe.modules.fp8_linear import FP8Spec, fp8_linear
    g = torch.Generator(device="cuda").manual_seed(5)
    x = _x(4096, 2048, g)
    w = (torch.randn(1536, 2048, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    dy = _x(4096, 1536, g)
    outs = []
    for fused in (True, False):
        monkeypatch.setattr(k, "FUSED_QUANT", fused)
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(xi, wi, FP8Spec(recipe))
        outs.append((y, *torch.autograd.grad(y, (xi, wi), dy)))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("M,K", [(16384, 4096), (131072, 2048), (4000, 200)])
def test_colwise_quant_t_exact(M, K):
    """``colwise_quant_t``: ``rowwise_quant`` of the transposed copy, bit for bit (rows of the copy up to 131072 wide:
    ``rowwise_quant``'s two reads), with all-zero rows and a zero column."""
    g = torch.Generator(device="cuda").manual_seed(M + K)
    x = _x(M, K, g)
    x[:, 7] = 0
    q, s = tq.colwise_quant_t(x)
    rq, rs = tq.rowwise_quant(x.t().contiguous())
    _same_bytes(q, rq)
    assert s.shape == rs.shape and s.dtype == rs.dtype and torch.equal(s, rs)
    # column amaxes reduced over other ranks: larger for some columns, smaller (saturating) for others
    from lightning_moe.modules.fp8 import Tiling, quantize
    amax_K1 = x.t().abs().amax(1, keepdim=True).float() * torch.linspace(0.5, 2.0, K, device="cuda").unsqueeze(1)
    q, s, inv = tq.colwise_quant_t(x, "e4m3", amax_K1, inverse=True)
    rq, rs = quantize(x.t().contiguous(), "e4m3", Tiling(1, None), amax_K1)
    _same_bytes(q, rq)
    assert s.shape == rs.shape and torch.equal(s, rs) and torch.equal(inv, rs.reciprocal())


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="the one-pass kernels need E4M3 (SM 8.9)")
@pytest.mark.parametrize("M,K,N", [(8192, 4096, 1024), (4000, 2048, 1536)])
def test_dense_fp8_linear_wgrad_quant_t_identical(M, K, N, monkeypatch):
    """The dense FP8 linear's wgrad operands quantized straight into the transposed layout (``colwise_quant_t``) and
    by ``rowwise_quant`` from transposed copies, as before: the same output, dgrad and wgrad, bit for bit."""
    from lightning_moe.modules.fp8_linear import FP8Spec, fp8_linear
    g = torch.Generator(device="cuda").manual_seed(M + N)
    x = _x(M, K, g)
    w = (torch.randn(N, K, generator=g, device="cuda") * 0.02).to(torch.bfloat16)
    dy = _x(M, N, g)
    used, colwise = [], tq.colwise_quant_t
    outs = []
    for new in (True, False):
        monkeypatch.setattr(tq, "colwise_quant_t", (lambda x_MK, fmt, amax=None, inverse=False: used.append(fmt)
                                                    or colwise(x_MK, fmt, amax, inverse)) if new
                            else (lambda x_MK, fmt, amax=None, inverse=False: _copy_quant(x_MK, fmt, inverse)))
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(xi, wi, FP8Spec("rowwise"))
        outs.append((y, *torch.autograd.grad(y, (xi, wi), dy)))
    assert len(used) == 2  # both operands took the kernel
    for a, b, name in zip(*outs, ("y", "dx", "dw")):
        assert torch.equal(a, b), name


def _copy_quant(x_MK, fmt, inverse):
    """``rowwise_quant`` of the transposed copy, with its scales' reciprocals where asked (``colwise_quant_t``'s)."""
    q, s = tq.rowwise_quant(x_MK.t().contiguous(), fmt)
    return (q, s, s.reciprocal()) if inverse else (q, s)


@pytest.mark.parametrize("M,K,L", [(65536, 2048, 128), (8192, 4096, 8), (3000, 200, 7)])
def test_quant_t_padded_block_expert_exact(M, K, L):
    """``quant_t_padded(align=128)`` (each block one expert's: ends and scales read once) against the per-position
    gathers, at the Triton wgrad's 128-row layout: the same bytes."""
    from lightning_moe.modules.expert_padding import fp8_rows_layout
    from lightning_moe.modules.fp8 import scale_of
    g = torch.Generator(device="cuda").manual_seed(M + K + 1)
    offs = _uneven_offs(M - 50, L, g)
    x = _x(M, K, g)
    gid_M, poffs, P, gid_P = fp8_rows_layout(offs, M, 128)
    scale = scale_of(tq.grouped_col_amax(x, offs, gid_M), "e4m3")
    want = tq.quant_t_padded(x, scale, offs, poffs, gid_P, P)
    _same_bytes(tq.quant_t_padded(x, scale, offs, poffs, gid_P, P, align=128), want)
