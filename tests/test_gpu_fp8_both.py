"""Per-expert FP8 quantization into both layouts (``triton_fp8_both``) on the GPU (skipped without CUDA): the bytes of
torch's formula with each expert's scale, row-major and in the wgrad's padded transposed layout, exact amaxes, and
the SwiGLU kernels' bits (with the GPU's FMA contraction) for the fused forward and backward."""

from __future__ import annotations

import pytest
import torch

from tests.modules.test_triton_fp8_both import _check  # torch's formula, both layouts, the scales

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _layout(counts, tail: int, align: int):
    from lightning_moe.modules.expert_padding import fp8_rows_layout
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    M = sum(counts) + tail
    gid_M, poffs, P, gid_P = fp8_rows_layout(offs, M, align)
    return offs, M, gid_M, poffs, P, gid_P


CASES = [([300, 0, 1024, 77], 5, 128), ([1024] * 6, 0, 128), ([40, 0, 300, 17], 3, 16)]


@pytest.mark.parametrize("counts,tail,align", CASES)
@pytest.mark.parametrize("X", [2048, 768])
def test_quant_both_gives_the_formula(counts, tail, align, X):
    from lightning_moe.modules import triton_fp8_both as tb
    offs, M, gid_M, poffs, P, gid_P = _layout(counts, tail, align)
    x = (torch.randn(M, X, device="cuda") * torch.logspace(-3, 2, M, device="cuda").unsqueeze(1)).to(torch.bfloat16)
    x[int(offs[-1]):] = float("nan")
    hist = torch.rand(3, len(counts), device="cuda") * 300 + 0.5  # a delayed history: the scale from its max
    _check(x, tb.quant_both(x, hist, offs, poffs, gid_P, P, align=align), hist, offs, poffs, gid_M)


@pytest.mark.parametrize("counts,tail,align", CASES[:1])
def test_quant_both_saturates_as_torchs_clamp(counts, tail, align):
    """The kernels cast without clamping first (the GPU's cast saturates: ``triton_fp8_quant._sat``): values far
    past the scale's range, the largest bf16 values and infinities give torch's clamp-then-cast bytes; a NaN stays
    NaN."""
    from lightning_moe.modules import triton_fp8_both as tb
    from lightning_moe.modules.fp8 import _saturate, scale_of
    offs, M, gid_M, poffs, P, gid_P = _layout(counts, tail, align)
    x = (torch.randn(M, 768, device="cuda") * 100).to(torch.bfloat16)
    x[0, :6] = torch.tensor([float("inf"), -float("inf"), 3.3e38, -3.3e38, 1e-38, -0.0])
    x[500, 100:102] = torch.tensor([float("inf"), -float("inf")])
    hist = torch.rand(3, len(counts), device="cuda") + 0.5  # most values saturate
    _check(x, tb.quant_both(x, hist, offs, poffs, gid_P, P, align=align), hist, offs, poffs, gid_M)
    x[7, 9] = float("nan")
    q = tb.quant_both(x, hist, offs, poffs, gid_P, P, align=align)[0]
    ref = _saturate(x[:int(offs[-1])], scale_of(hist.amax(0), "e4m3")[gid_M[:int(offs[-1])].long()].unsqueeze(1),
                    448.0, torch.float8_e4m3fn)
    assert torch.equal(q[:int(offs[-1])].view(torch.uint8), ref.view(torch.uint8))
    assert q[7, 9].float().isnan() and (q[0, :4].float().abs() == 448).all()


@pytest.mark.parametrize("counts,tail,align", CASES)
@pytest.mark.parametrize("weighted", [False, True])
def test_swiglu_both_gives_the_swiglu_kernels_bits(counts, tail, align, weighted):
    from lightning_moe.modules import triton_fp8_both as tb
    from lightning_moe.modules import triton_swiglu
    F = 768
    offs, M, gid_M, poffs, P, gid_P = _layout(counts, tail, align)
    g = torch.Generator("cuda").manual_seed(M)
    h = (torch.randn(M, 2 * F, device="cuda", generator=g) * 2).to(torch.bfloat16)
    dy = (torch.randn(M, F, device="cuda", generator=g) * 1e-2).to(torch.bfloat16)
    p = torch.rand(M, device="cuda", generator=g) if weighted else None
    hist = torch.rand(2, len(counts), device="cuda", generator=g) * 300 + 0.5
    _check(triton_swiglu.forward(h, p), tb.swiglu_both(h, p, hist, offs, poffs, gid_P, P, align=align), hist, offs,
           poffs, gid_M)
    *out, gp = tb.swiglu_backward_both(dy, h, p, hist, offs, poffs, gid_P, P, align=align)
    dh, rgp = triton_swiglu.backward(dy, h, p)
    _check(dh, out, hist, offs, poffs, gid_M)
    if weighted:
        end = int(offs[-1])
        torch.testing.assert_close(gp[:end], rgp[:end], rtol=1e-5, atol=1e-6)


hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                            reason="the FP8 grouped kernels need SM 9.0")


def _block_runs(recipe: str, on: bool, monkeypatch, calls: list):
    """Three forward + backward passes of one FP8 grouped GEMM (inputs scaled differently each time, so delayed
    scaling's history matters), with the both-layouts path on or off: [(y, dx, dw)]."""
    from lightning_moe.modules import fp8_grouped_both as both
    from lightning_moe.modules import triton_fp8_both as tb
    from lightning_moe.modules.fp8_grouped import fp8_grouped_mm
    from lightning_moe.modules.fp8_linear import FP8Spec
    monkeypatch.setattr(both, "ENABLED", on)
    real = tb.quant_both
    monkeypatch.setattr(tb, "quant_both", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator("cuda").manual_seed(0)
    L, K, N = 4, 512, 768
    offs = torch.tensor([300, 0, 1024, 77], device="cuda").cumsum(0).to(torch.int32)
    M = int(offs[-1]) + 5
    x = (torch.randn(M, K, device="cuda", generator=g) * torch.logspace(-1, 1, K, device="cuda")).bfloat16()
    w = (torch.randn(L, K, N, device="cuda", generator=g) * 0.05).bfloat16()
    dy = (torch.randn(M, N, device="cuda", generator=g) * 1e-3).bfloat16()
    spec = FP8Spec(recipe, fp8_format="e4m3", fast_accum="all", history=2)
    spec.step = 0  # weights cached, as under FP8Training
    out = []
    for i in range(3):
        xx, ww = (x * (1 + i)).requires_grad_(), w.clone().requires_grad_()
        y = fp8_grouped_mm(xx, ww, offs, spec)
        y.backward(dy * (3 - i))
        out.append((y, xx.grad, ww.grad))
    return out, int(offs[-1])


@hopper
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_both_layouts_path_gives_the_separate_passes_bits(recipe, monkeypatch):
    """The GEMMs' operands from one pass (``fp8_grouped_both``) against the separate passes: y and dx bit for bit
    (the same FP8 operands, scales and GEMM kernels, delayed histories included), dw within the two wgrad kernels'
    accumulation difference (Triton's against CUTLASS's)."""
    calls_on, calls_off = [], []
    on, end = _block_runs(recipe, True, monkeypatch, calls_on)
    off, _ = _block_runs(recipe, False, monkeypatch, calls_off)
    assert len(calls_on) == 6 and not calls_off  # x and dy in each of the three passes
    for (y1, dx1, dw1), (y0, dx0, dw0) in zip(on, off):
        assert torch.equal(y1[:end], y0[:end]) and torch.equal(dx1[:end], dx0[:end])
        rel = ((dw1.float() - dw0.float()).norm() / dw0.float().norm()).item()
        assert rel < 2e-3, rel
    assert not torch.equal(on[0][0], on[2][0])  # the passes differ


@hopper
@pytest.mark.parametrize("recompute", [None, "moe_act", "moe"])
def test_delayed_training_with_the_fused_swiglu_matches_the_separate_passes(recompute, monkeypatch):
    """FP8Training('delayed', fp8_format='e4m3'), bf16 weights: the per-expert GEMMs with the SwiGLU writing a's and
    dh's copies (never a and dh themselves) and the dense linears' one-pass copies train as the separate passes do
    (the same FP8 operands; the experts' wgrad on another kernel): every gradient of the first step within 2 % (a
    wrong copy is off by far more), the losses of four steps within 0.3 %, under recomputation too; the fused
    kernels run from the second step (the histories' first use takes the amax pass)."""
    import copy
    from types import SimpleNamespace

    from lightning_moe import FP8Training
    from lightning_moe.callbacks.recompute import Recompute
    from lightning_moe.modules import fp8_grouped_both as both
    from lightning_moe.modules import fp8_linear_both, fp8_swiglu
    from lightning_moe.modules import triton_fp8_both as tb
    from tests.test_gpu_fp8 import _model
    torch.manual_seed(0)
    tokens = torch.randint(0, 512, (4, 257), device="cuda")
    base, losses, grads, fused = None, {}, {}, []
    real = tb.swiglu_backward_both
    monkeypatch.setattr(tb, "swiglu_backward_both", lambda *a, **k: fused.append(1) or real(*a, **k))
    for on in (True, False):
        for module in (both, fp8_linear_both, fp8_swiglu):
            monkeypatch.setattr(module, "ENABLED", on)
        torch.manual_seed(1)
        lm = _model(FP8Training("delayed", fp8_format="e4m3"))
        lm.model.bfloat16()
        if base is None:
            base = copy.deepcopy(lm.model.state_dict())
        lm.model.load_state_dict(base)
        if recompute:
            Recompute([recompute]).on_fit_start(SimpleNamespace(strategy=SimpleNamespace()), lm)
        opt = torch.optim.AdamW(lm.model.parameters(), lr=1e-3)
        losses[on] = []
        for step in range(4):
            logits, aux = lm.model(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) + aux
            loss.backward()
            if step == 0:
                grads[on] = {n: p.grad.float().clone() for n, p in lm.model.named_parameters() if p.grad is not None}
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses[on].append(loss.item())
    assert fused, "the fused SwiGLU backward never ran"
    for name, g in grads[False].items():
        rel = ((grads[True][name] - g).norm() / g.norm().clamp_min(1e-12)).item()
        assert rel < 2e-2, (name, rel)
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=3e-3, atol=0)
    assert losses[True][-1] < losses[True][0]


@hopper
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_dense_linear_both_layouts_gives_the_separate_passes_bits(recipe, monkeypatch):
    """The dense linear with x and dy quantized once into both layouts (``fp8_linear_both``) against the separate
    passes: y, dx and dw bit for bit over three passes (the same FP8 operands, scales and ``_scaled_mm``; a delayed
    history's first use and later ones), at two token counts."""
    from lightning_moe.modules import fp8_linear_both
    from lightning_moe.modules.fp8_linear import FP8Spec, fp8_linear
    calls = []
    real = fp8_linear_both._quantize
    monkeypatch.setattr(fp8_linear_both, "_quantize", lambda *a: calls.append(1) or real(*a))
    for M in (1024, 2048):
        outs = {}
        for on in (True, False):
            monkeypatch.setattr(fp8_linear_both, "ENABLED", on)
            g = torch.Generator("cuda").manual_seed(M)
            x0 = torch.randn(M, 512, device="cuda", generator=g).bfloat16()
            w0 = (torch.randn(768, 512, device="cuda", generator=g) * 0.05).bfloat16()
            dy0 = (torch.randn(M, 768, device="cuda", generator=g) * 1e-3).bfloat16()
            spec = FP8Spec(recipe, fp8_format="e4m3", history=2)
            spec.step = 0
            res = []
            for i in range(3):
                x, w = (x0 * (i + 1)).requires_grad_(), w0.clone().requires_grad_()
                y = fp8_linear(x, w, spec)
                y.backward(dy0 * (3 - i))
                res.append((y, x.grad, w.grad))
            outs[on] = res
        for (y1, dx1, dw1), (y0, dx0, dw0) in zip(outs[True], outs[False]):
            assert torch.equal(y1, y0) and torch.equal(dx1, dx0) and torch.equal(dw1, dw0)
    assert len(calls) == 12  # x and dy, three passes, two token counts


def test_fp32_operands_take_the_separate_passes():
    """From fp32 operands the transposed copy came out wrong on an H100 (triton 3.6): the kernels refuse them, and
    neither GEMM path routes them there."""
    from lightning_moe.modules import fp8_grouped_both, fp8_linear_both
    from lightning_moe.modules import triton_fp8_both as tb
    from lightning_moe.modules.fp8_linear import FP8Spec
    offs, M, gid_M, poffs, P, gid_P = _layout([64, 64], 0, 128)
    x = torch.randn(M, 256, device="cuda")
    with pytest.raises(ValueError, match="float32 operands are not supported"):
        tb.quant_both(x, torch.ones(1, 2, device="cuda"), offs, poffs, gid_P, P, align=128)
    spec = FP8Spec("delayed", fp8_format="e4m3")
    assert fp8_grouped_both.kernels(spec, x) is None and fp8_linear_both.kernels(spec, x) is None
    if torch.cuda.get_device_capability() == (9, 0):
        assert fp8_grouped_both.kernels(spec, x.bfloat16()) is not None
        assert fp8_linear_both.kernels(spec, x.bfloat16()) is not None


@hopper
@pytest.mark.parametrize("counts", [[256] * 8, [300, 0, 700, 260, 512, 100, 92, 84]])
def test_a_recomputed_block_replays_its_first_pass_scales(counts):
    """The experts' block under the delayed recipe on the one-pass kernels (the SwiGLU's copies from fc1's epilogue
    where it runs), recomputed as ``Recompute(["moe"])`` does (non-reentrant checkpoint with its replay contexts):
    over three steps, the output, every gradient and every amax history equal the block run without recomputation
    bit for bit. The replay scales by the rings its first pass read and pushes nothing; before, it scaled by rings
    its own first pass had advanced, and pushed twice."""
    from torch.utils.checkpoint import checkpoint

    from lightning_moe.callbacks.recompute import _contexts
    from lightning_moe.modules import fp8_swiglu as fs
    from lightning_moe.modules.fp8_grouped import fp8_grouped_mm
    from lightning_moe.modules.fp8_linear import FP8Spec
    E, D, F = len(counts), 256, 128
    M = sum(counts)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    g = torch.Generator("cuda").manual_seed(0)
    x0 = torch.randn(M, D, device="cuda", generator=g).bfloat16()
    p0 = torch.rand(M, device="cuda", generator=g)
    w13_0 = (torch.randn(E, D, 2 * F, device="cuda", generator=g) * 0.05).bfloat16()
    w2_0 = (torch.randn(E, F, D, device="cuda", generator=g) * 0.05).bfloat16()
    dys = [torch.randn(M, D, device="cuda", generator=g).bfloat16() for _ in range(3)]

    def run(recompute: bool):
        x, p = x0.clone().requires_grad_(), p0.clone().requires_grad_()
        w13, w2 = w13_0.clone().requires_grad_(), w2_0.clone().requires_grad_()
        s1, s2 = (FP8Spec("delayed", fp8_format="e4m3", fast_accum="all") for _ in range(2))
        hand = fs.Handoff(both=(s1, s2, w2))
        s1.handoff, s2.handoff = (hand, "fc1"), (hand, "fc2")

        def block(x_MD, p_M):
            fs.prepare(p_M, hand)
            h = fp8_grouped_mm(x_MD, w13, offs, s1)
            return fp8_grouped_mm(fs.fp8_swiglu(h, p_M, hand), w2, offs, s2)

        out = []
        for dy in dys:
            for t in (x, p, w13, w2):
                t.grad = None
            y = checkpoint(block, x, p, use_reentrant=False, context_fn=_contexts) if recompute else block(x, p)
            y.backward(dy)
            out.append([y.detach()] + [t.grad for t in (x, p, w13, w2)])
        rings = {(i, n): h.past.clone() for i, s in enumerate((s1, s2)) for n, h in s.histories.items()
                 if h.past is not None}
        return out, rings

    (plain, rings0), (recomputed, rings1) = run(False), run(True)
    for a, b in zip(plain, recomputed):
        assert all(torch.equal(u[:M], v[:M]) for u, v in zip(a, b))
    assert rings0.keys() == rings1.keys() and len(rings0) >= 4
    assert all(torch.equal(rings0[k], rings1[k]) for k in rings0)
