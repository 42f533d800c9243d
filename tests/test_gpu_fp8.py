"""FP8 on the GPU (skipped without CUDA; the kernel tests need SM 9.0): the experts' grouped GEMM and the dense linear
on their kernels against the emulation (same quantized operands: they differ by accumulation order and the bf16
output), an FP8 training step with no host-device sync, and FP8/NVFP4 trainings whose loss falls."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_moe.modules import fp8_grouped_kernels as kernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
hopper = pytest.mark.skipif(not torch.cuda.is_available() or not kernels.available(torch.device("cuda")),
                            reason="torch._scaled_grouped_mm needs SM 9.0")

OVR = dict(seq_length=256, hidden_size=256, num_layers=2, num_attention_heads=4, num_kv_heads=2,
           ffn_hidden_size=512, moe_ffn_hidden_size=256, num_experts=8, topk=2, vocab_size=512,
           shared_expert_ffn_size=256, first_k_dense=1)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _grouped(spec, x, w, dy, offs):
    from lightning_moe.modules.fp8_grouped import fp8_grouped_mm
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8_grouped_mm(x, w, offs, spec)
    y.backward(dy)
    return y, x.grad, w.grad


@hopper
@pytest.mark.parametrize("recipe,fmt,fast", [("rowwise", None, "fprop"), ("tensorwise", "e4m3", "fprop"),
                                             ("delayed", "e4m3", "fprop"), ("tensorwise", "hybrid", "fprop"),
                                             ("rowwise", None, "all"), ("rowwise", None, "none")])
def test_scaled_grouped_kernel_matches_emulation(recipe, fmt, fast):
    from lightning_moe.modules.fp8_linear import FP8Spec
    g = torch.Generator(device="cuda").manual_seed(0)
    L, K, N = 8, 512, 768
    counts = torch.tensor([300, 0, 17, 513, 128, 77, 1, 1000], device="cuda")  # uneven, one empty, unaligned
    offs = counts.cumsum(0).to(torch.int32)
    M = int(counts.sum())
    x = (torch.randn(M, K, device="cuda", generator=g) * torch.logspace(-1, 1, K, device="cuda")).bfloat16()
    w = (torch.randn(L, K, N, device="cuda", generator=g) * 0.05).bfloat16()
    dy = (torch.randn(M, N, device="cuda", generator=g) * 1e-3).bfloat16()
    emu, ker = FP8Spec(recipe, emulate=True, fp8_format=fmt), FP8Spec(recipe, fp8_format=fmt, fast_accum=fast)
    for _ in range(2):
        ref, got = _grouped(emu, x, w, dy, offs), _grouped(ker, x, w, dy, offs)
        errs = [_rel(a, b) for a, b in zip(got, ref)]
        assert all(e < 1e-2 for e in errs), errs  # bf16 outputs: ~2^-9 per element


@hopper
@pytest.mark.parametrize("fast", ["fprop", "all"])
def test_rowwise_triton_wgrad_matches_cutlass(monkeypatch, fast):
    """The rowwise wgrad on ``triton_fp8_wgrad`` (the default where the Triton quantizers run) against CUTLASS's
    (``torch._scaled_grouped_mm``), same operands and scales: each expert's gradient (uneven, unaligned and empty
    experts), precise and fast accumulation; and into the main grads under GradSync's fusion over two micro-batches,
    where the fp32 sum differs from the unfused bf16 gradients by their rounding only."""
    from lightning_moe.modules.fp8_grouped import fp8_grouped_mm
    from lightning_moe.modules.fp8_linear import FP8Spec
    from lightning_moe.strategy.grad_sync import GradSync
    from lightning_moe.strategy.parallel_context import ParallelContext
    g = torch.Generator(device="cuda").manual_seed(2)
    L, K, N = 8, 512, 768
    counts = torch.tensor([300, 0, 17, 513, 128, 77, 1, 1000], device="cuda")
    offs = counts.cumsum(0).to(torch.int32)
    ends = [0] + offs.tolist()
    M = int(counts.sum())
    x = (torch.randn(M, K, device="cuda", generator=g) * torch.logspace(-1, 1, K, device="cuda")).bfloat16()
    w = (torch.randn(L, K, N, device="cuda", generator=g) * 0.05).bfloat16()
    dy = (torch.randn(M, N, device="cuda", generator=g) * 1e-3).bfloat16()

    def main_grad():
        p = torch.nn.Parameter(w.clone())
        p.wgrad_fusable = True
        sync = GradSync([p], ParallelContext.single(), main_grads=True, fuse_wgrad=True)
        for i, scale in enumerate((1.0, 2.0)):
            if i == 1:
                sync.arm()
            fp8_grouped_mm(x.clone().requires_grad_(), p, offs, spec).backward(dy * scale)
        sync.finish()
        return p.main_grad.clone()

    spec = FP8Spec("rowwise", fast_accum=fast)
    fused, real = [], GradSync.accumulate_wgrad
    monkeypatch.setattr(GradSync, "accumulate_wgrad", lambda self, p, write: (fused.append(1), real(self, p, write)))
    got = {}
    for on in (False, True):
        monkeypatch.setattr(kernels, "TRITON_WGRAD", on)
        got[on] = (_grouped(spec, x, w, dy, offs), main_grad(), len(fused))
    (y1, dx1, dw1), mg1, calls1 = got[True]
    (y0, dx0, dw0), mg0, calls0 = got[False]
    assert calls0 == 0 and calls1 == 2  # CUTLASS's gradient goes through the hook; the Triton one into main
    assert torch.equal(y1, y0) and torch.equal(dx1, dx0)
    frozen = w.clone()  # no weight gradient wanted: none made, the same dgrad
    xf = x.clone().requires_grad_()
    fp8_grouped_mm(xf, frozen, offs, spec).backward(dy)
    assert frozen.grad is None and torch.equal(xf.grad, dx1)
    for e in range(L):
        if ends[e + 1] > ends[e]:
            assert _rel(dw1[e], dw0[e]) < 5e-3, (e, _rel(dw1[e], dw0[e]))
            assert _rel(mg1[e], mg0[e]) < 5e-3, (e, _rel(mg1[e], mg0[e]))
        else:
            assert not dw1[e].any() and not mg1[e].any()
    assert _rel(mg1, mg0) > 0  # the fused sum is fp32, the unfused one adds bf16 gradients


@hopper
@pytest.mark.parametrize("recipe,fast", [("tensorwise", "fprop"), ("rowwise", "fprop"), ("rowwise", "all")])
def test_scaled_mm_linear_matches_emulation(recipe, fast):
    from lightning_moe.modules.fp8_linear import FP8Spec, fp8_linear
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(2048, 1024, device="cuda", generator=g).bfloat16()
    w = (torch.randn(1536, 1024, device="cuda", generator=g) * 0.05).bfloat16()
    dy = (torch.randn(2048, 1536, device="cuda", generator=g) * 1e-3).bfloat16()
    out = []
    for emulate in (True, False):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(xx, ww, FP8Spec(recipe, emulate=emulate, fast_accum=fast))
        y.backward(dy)
        out.append((y, xx.grad, ww.grad))
    errs = [_rel(a, b) for a, b in zip(out[1], out[0])]
    assert all(e < 1e-2 for e in errs), errs


@hopper
def test_scaled_mm_linear_unquantized_wgrad():
    """``FP8Spec(fp8_wgrad=False)`` on the dense linear's kernels: forward and dgrad bit for bit as with the FP8 wgrad;
    the weight gradient from the unquantized bf16 operands, fp32-accumulated (bf16 result: ~2^-9 of float64's), where
    the FP8 one carries its quantization."""
    from lightning_moe.modules.fp8_linear import FP8Spec, fp8_linear
    g = torch.Generator(device="cuda").manual_seed(2)
    x = (torch.randn(2048, 1024, device="cuda", generator=g) * torch.logspace(-1, 1, 1024, device="cuda")).bfloat16()
    w = (torch.randn(1536, 1024, device="cuda", generator=g) * 0.05).bfloat16()
    dy = (torch.randn(2048, 1536, device="cuda", generator=g) * 1e-3).bfloat16()
    out = []
    for fp8_wgrad in (True, False):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fp8_linear(xx, ww, FP8Spec("rowwise", fp8_wgrad=fp8_wgrad))
        y.backward(dy)
        out.append((y, xx.grad, ww.grad))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    ref = dy.double().t() @ x.double()
    rel = [((o[2].double() - ref).norm() / ref.norm()).item() for o in out]
    assert rel[1] < 4e-3 and rel[0] > 2 * rel[1], rel


@hopper
@pytest.mark.parametrize("fast", [False, True])
def test_persistent_fp8_wgrad_gives_the_one_tile_bits(fast):
    """``triton_fp8_wgrad.wgrad_into(persistent=True)`` on E4M3 operands: the one-tile kernel's bits, written and added
    into fp32 main grads, with an empty expert and uneven ones (multiples of 128 tokens, as the padded layout gives),
    at one and two programs per SM and at a few programs (many tiles each), both default configs (128 x 128 tiles, and
    64 x 128 at two programs per SM, which this shape's 512 tokens per expert take by default), its output by pointers
    or by TMA."""
    from lightning_moe.modules import triton_fp8_wgrad as tw
    g = torch.Generator(device="cuda").manual_seed(3)
    L, K, N = 6, 320, 704  # partial 128-wide tiles in both dims: the pointer masks, TMA's clipping
    counts = torch.tensor([384, 0, 128, 1024, 256, 640], device="cuda")
    offs = counts.cumsum(0).to(torch.int32)
    P = int(counts.sum())
    aT = (torch.randn(K, P, device="cuda", generator=g) * 4).to(torch.float8_e4m3fn)
    bT = (torch.randn(N, P, device="cuda", generator=g) * 4).to(torch.float8_e4m3fn)
    sa = torch.rand(L, K, device="cuda", generator=g) + 0.5
    sb = torch.rand(L, N, device="cuda", generator=g) * 1e-3
    start = torch.randn(L, K, N, device="cuda", generator=g)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for first in (True, False):
        ref = start.clone()
        tw.wgrad_into(ref, (aT, sa), (bT, sb), offs, first, per_expert=True, fast=fast, persistent=False)
        for config, programs, tma_out in ((None, None, False), (tw.PERSISTENT_CONFIG, sms, False),
                                          (tw.PERSISTENT_CONFIG, 2 * sms, False), (tw.PERSISTENT_CONFIG, 5, False),
                                          (tw.PERSISTENT_NARROW_CONFIG, 2 * sms, False),
                                          (tw.PERSISTENT_NARROW_CONFIG, 5, False), (None, sms, True), (None, 5, True)):
            got = start.clone()
            tw.wgrad_into(got, (aT, sa), (bT, sb), offs, first, per_expert=True, fast=fast, persistent=True,
                          config=config, programs=programs, tma_out=tma_out)
            assert torch.equal(got, ref), (first, config, programs, tma_out)



@hopper
@pytest.mark.parametrize("fast", [False, True])
def test_fp8_wgrad_over_segments_gives_one_kernel_per_segments_bits(fast):
    """``wgrad_segments_into`` (the deferred wgrad: three micro-batches' E4M3 operands side by side, each with its own
    scales and expert sizes, an empty expert in one and a segment with one expert) against one ``wgrad_into`` per
    micro-batch with the default kernels (the first writing or adding, the others adding): the same bits, in every
    config the benchmark sweeps."""
    from lightning_moe.modules import triton_fp8_wgrad as tw
    g = torch.Generator(device="cuda").manual_seed(4)
    L, K, N = 6, 320, 704
    counts = [[384, 0, 128, 1024, 256, 640], [128, 256, 128, 0, 384, 128], [0, 0, 0, 0, 0, 512]]
    segs = []
    for c in counts:
        offs = torch.tensor(c, device="cuda").cumsum(0).to(torch.int32)
        P = sum(c)
        segs.append(((torch.randn(K, P, device="cuda", generator=g) * 4).to(torch.float8_e4m3fn),
                     torch.rand(L, K, device="cuda", generator=g) + 0.5,
                     (torch.randn(N, P, device="cuda", generator=g) * 4).to(torch.float8_e4m3fn),
                     torch.rand(L, N, device="cuda", generator=g) * 1e-3, offs))
    base, starts, ends = 0, [], []
    for aT, _, _, _, offs in segs:
        starts.append(torch.nn.functional.pad(offs[:-1], (1, 0)) + base)
        ends.append(offs + base)
        base += aT.shape[1]
    a = (torch.cat([s[0] for s in segs], 1), torch.stack([s[1] for s in segs]))
    b = (torch.cat([s[2] for s in segs], 1), torch.stack([s[3] for s in segs]))
    start = torch.randn(L, K, N, device="cuda", generator=g)
    for first in (True, False):
        ref = start.clone()
        for i, (aT, sa, bT, sb, offs) in enumerate(segs):
            tw.wgrad_into(ref, (aT, sa), (bT, sb), offs, first and i == 0, per_expert=True, fast=fast)
        for config in (None, (128, 128, 8, 3), (64, 128, 4, 3), (64, 128, 4, 4), (128, 64, 4, 4)):
            got = start.clone()
            tw.wgrad_segments_into(got, a, b, torch.stack(starts), torch.stack(ends), first, fast=fast, config=config)
            assert torch.equal(got, ref), (first, config)


@hopper
@pytest.mark.parametrize("recipe,fast,window", [("rowwise", "fprop", None), ("rowwise", "all", None),
                                                ("rowwise", "fprop", 2), ("delayed", "all", None),
                                                ("delayed", "fprop", 2), ("tensorwise", "all", 2)])
def test_deferred_expert_wgrad_gives_the_same_main_grads_and_dgrad(recipe, fast, window):
    """``FP8Spec(defer_wgrad=True)`` (``FP8Training(defer_expert_wgrad=True)``): three micro-batches of uneven
    experts through GradSync's fusion, the wgrad held until the armed backward (``window=2``: the first two run at
    the second backward, the third alone at the armed one), against the wgrad of every micro-batch into the main
    grads: the same main grads and input gradients, bit for bit, over four steps, the held operands in arenas kept
    from step to step (the tensorwise and delayed recipes: E4M3, the one-pass kernels of ``fp8_grouped_both``,
    whose input copy from forward is copied there)."""
    from lightning_moe.modules import fp8_grouped_both as both
    from lightning_moe.modules.fp8_grouped import fp8_grouped_mm
    from lightning_moe.modules.fp8_linear import FP8Spec
    from lightning_moe.strategy.grad_sync import GradSync
    from lightning_moe.strategy.parallel_context import ParallelContext
    g = torch.Generator(device="cuda").manual_seed(5)
    L, K, N = 8, 512, 768
    w = (torch.randn(L, K, N, device="cuda", generator=g) * 0.05).bfloat16()
    batches = []
    for c in ([300, 0, 17, 513, 128, 77, 1, 1000], [10, 200, 0, 0, 640, 5, 300, 129], [0, 0, 0, 0, 0, 0, 0, 64]):
        offs = torch.tensor(c, device="cuda").cumsum(0).to(torch.int32)
        M = sum(c)
        batches.append(((torch.randn(M, K, device="cuda", generator=g) * torch.logspace(-1, 1, K, device="cuda")
                         ).bfloat16(), (torch.randn(M, N, device="cuda", generator=g) * 1e-3).bfloat16(), offs))

    longer = [(torch.cat([x, x]), torch.cat([dy, dy]), offs * 2) for x, dy, offs in batches]  # 2x the tokens

    def run(defer: bool):
        p = torch.nn.Parameter(w.clone())
        p.wgrad_fusable = True
        sync = GradSync([p], ParallelContext.single(), main_grads=True, fuse_wgrad=True)
        spec = FP8Spec(recipe, fast_accum=fast, fp8_format="e4m3", defer_wgrad=defer,
                       defer_window=window if defer else None)
        out, arenas = [], []
        # step 0 concatenates the held operands into arenas, step 1 quantizes into them (no concatenation), step 2's
        # longer micro-batches do not fit (concatenated into larger arenas), step 3 fits those
        for step, micro in enumerate((batches, batches, longer, batches)):
            dxs = []
            for i, (x, dy, offs) in enumerate(micro):
                if i == len(micro) - 1:
                    sync.arm()
                x = x.clone().requires_grad_()
                fp8_grouped_mm(x, p, offs, spec).backward(dy * (step + 1))
                dxs.append(x.grad)
            sync.finish()
            out.append((p.main_grad.clone(), dxs))
            arenas.append(spec.wgrad_arena)
            sync.discard()
        return out, arenas

    (deferred, arenas), (plain, none) = run(True), run(False)
    for (mg_d, dx_d), (mg, dx) in zip(deferred, plain):
        assert torch.equal(mg_d, mg) and mg.abs().sum() > 0
        assert all(torch.equal(a, b) for a, b in zip(dx_d, dx))
    assert none == [None] * 4
    if recipe != "rowwise":
        assert both.kernels(FP8Spec(recipe, fp8_format="e4m3"), batches[0][0]) is not None  # the one-pass path
    assert arenas[1] is arenas[0] and arenas[3] is arenas[2]  # reused where they fit
    assert arenas[2][0].shape[1] > arenas[0][0].shape[1]

def _model(callback, **overrides):
    from lightning_moe.modules.lm import MoELanguageModel
    lm = MoELanguageModel(preset="tiny", overrides={**OVR, **overrides})
    lm.configure_model()
    lm.model.cuda()
    callback.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda"))), lm)
    return lm


def _train_step(model, opt, tokens) -> torch.Tensor:
    """One bf16-autocast step of next-token loss on ``tokens``; the loss (on the device)."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits, aux = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) + aux
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


@hopper
@pytest.mark.parametrize("recipe,fmt", [("rowwise", "e4m3"), ("tensorwise", "hybrid"), ("delayed", "e4m3")])
def test_fp8_step_has_no_host_sync(recipe, fmt):
    from lightning_moe import FP8Training
    lm = _model(FP8Training(recipe, fp8_format=fmt))
    model = lm.model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    tokens = torch.randint(0, 512, (4, 257), device="cuda")
    for _ in range(3):  # warm up, and compile the fused quantization kernels
        _train_step(model, opt, tokens)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = _train_step(model, opt, tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item()
