"""The experts' SwiGLU fused with the FP8 quantization (``triton_fp8_swiglu``, ``fp8_swiglu``) on the GPU (skipped
without CUDA; the block and training tests need SM 9.0): the kernels give the unfused kernels' bits (with the GPU's
FMA contraction), the FP8 block with the handoff gives the unfused block's outputs and gradients bit for bit (the
row weights' gradient within fp32 rounding: another summation order) while quantizing two operands fewer times, and
FP8 training with it stays exact under Recompute and the deferred wgrad."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch

from lightning_moe.modules import fp8_grouped_kernels as gk

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
hopper = pytest.mark.skipif(not torch.cuda.is_available() or not gk.available(torch.device("cuda")),
                            reason="torch._scaled_grouped_mm needs SM 9.0")


def _same(a, b):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _rows(counts, tail, F, weighted, seed):
    from lightning_moe.modules.fp8_grouped import expert_of_rows
    g = torch.Generator("cuda").manual_seed(seed)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    M = sum(counts) + tail
    h = (torch.randn(M, 2 * F, device="cuda", generator=g) * 2).to(torch.bfloat16)
    dy = torch.randn(M, F, device="cuda", generator=g).to(torch.bfloat16) * 1e-2
    p = torch.rand(M, device="cuda", generator=g) if weighted else None
    return h, dy, p, offs, expert_of_rows(M, offs, h.device, int32=True)


@pytest.mark.parametrize("F,counts,tail", [(256, [40, 0, 300, 17], 5), (768, [512, 700, 3, 0], 0),
                                           (14336, [70, 0, 130], 9)])
@pytest.mark.parametrize("weighted", [False, True])
def test_fused_kernels_give_the_unfused_bits(F, counts, tail, weighted):
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules import triton_fp8_swiglu as tsw
    from lightning_moe.modules import triton_swiglu
    h, dy, p, offs, gid = _rows(counts, tail, F, weighted, seed=F)
    a, q, s, amax = tsw.swiglu_quant(h, p, offs, gid)
    ra = triton_swiglu.forward(h, p)
    for got, want in zip((a, q, s, amax), (ra, *tq.rowwise_quant_col_amax(ra, offs, gid, inverse=True))):
        _same(got, want)
    dh, gp, q, s, amax = tsw.swiglu_backward_quant(dy, h, p, offs, gid)
    rdh, rgp = triton_swiglu.backward(dy, h, p)
    for got, want in zip((dh, q, s, amax), (rdh, *tq.rowwise_quant_col_amax(rdh, offs, gid, inverse=True))):
        _same(got, want)
    if weighted:
        torch.testing.assert_close(gp, rgp, rtol=1e-5, atol=1e-6)


def _block(fused, fast, counts, tail, monkeypatch):
    """The FP8 expert block (fc1, weighted SwiGLU, fc2) forward and backward: (outputs and gradients, how many rowwise
    passes ran)."""
    from lightning_moe.modules.experts import swiglu
    from lightning_moe.modules.fp8_grouped import fp8_grouped_mm
    from lightning_moe.modules.fp8_linear import FP8Spec
    from lightning_moe.modules.fp8_swiglu import Handoff, fp8_swiglu
    L_, D, F = len(counts), 512, 768
    g = torch.Generator("cuda").manual_seed(0)
    M = sum(counts) + tail
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    x = torch.randn(M, D, device="cuda", generator=g).bfloat16().requires_grad_()
    w13 = (torch.randn(L_, D, 2 * F, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    w2 = (torch.randn(L_, F, D, device="cuda", generator=g) * 0.05).bfloat16().requires_grad_()
    p = torch.rand(M, device="cuda", generator=g).requires_grad_()
    dy = torch.randn(M, D, device="cuda", generator=g).bfloat16()
    s1, s2 = FP8Spec("rowwise", fast_accum=fast), FP8Spec("rowwise", fast_accum=fast)
    passes = []
    real = gk._rows_and_amax
    monkeypatch.setattr(gk, "_rows_and_amax", lambda *a, **k: passes.append(1) or real(*a, **k))
    hand = Handoff()
    if fused:
        s1.handoff, s2.handoff = (hand, "fc1"), (hand, "fc2")
    h = fp8_grouped_mm(x, w13, offs, s1)
    a = fp8_swiglu(h, p, hand) if fused else swiglu(h, p)
    y = fp8_grouped_mm(a, w2, offs, s2)
    y.backward(dy)
    assert hand.rows is None and hand.forward is None and hand.backward is None  # every handoff taken
    return (y, x.grad, w13.grad, w2.grad, p.grad), len(passes)


@hopper
@pytest.mark.parametrize("fast", ["fprop", "all"])
@pytest.mark.parametrize("counts,tail", [([300, 0, 517, 64], 0), ([128, 256, 1, 700], 11)])
def test_block_with_the_handoff_gives_the_unfused_bits(fast, counts, tail, monkeypatch):
    ref, ref_passes = _block(False, fast, counts, tail, monkeypatch)
    got, passes = _block(True, fast, counts, tail, monkeypatch)
    assert (ref_passes, passes) == (4, 2)  # a's and dh's rowwise passes are the fused SwiGLU's
    end = sum(counts)
    for r, o in zip(ref[:4], got[:4]):
        _same(r[:end] if r.shape[0] > end else r, o[:end] if o.shape[0] > end else o)
    # the row weights' gradient sums the same fp32 terms in another order: within fp32 rounding of the sum
    dp, rdp = got[4][:end], ref[4][:end]
    assert ((dp - rdp).norm() / rdp.norm()).item() < 1e-5
    assert (dp - rdp).abs().max().item() < 1e-4 * rdp.abs().max().item()


OVR = dict(seq_length=256, hidden_size=512, num_layers=3, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=1024,
           moe_ffn_hidden_size=512, num_experts=8, topk=2, vocab_size=512, first_k_dense=1,
           shared_expert_ffn_size=512)


def _fit(tmp_path, callbacks, **strategy_kw):
    from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
    from lightning_moe.data import write_tokens
    tokens = write_tokens(str(tmp_path / "t.bin"), np.random.default_rng(0).integers(0, 512, 80000), "uint16")
    L.seed_everything(0, verbose=False)
    losses, fused = [], []

    class Rec(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["lm_loss"].detach().clone())
            fused.append(sum("_act" in m.__dict__ for n, m in pl_module.named_modules() if n.endswith("experts.act")))

    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=MoEFoldStrategy(**strategy_kw), precision="bf16-true",
                        max_steps=3,
                        accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False, limit_val_batches=2,
                        val_check_interval=4, num_sanity_val_steps=0,  # evaluation runs under inference_mode
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Rec(), *callbacks])
    model = MoELanguageModel(preset="tiny", overrides=OVR, seed=3, lr=3e-3, warmup_steps=1)
    trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=256, batch_size=2))
    assert "val_loss" in trainer.callback_metrics
    return torch.stack(losses).cpu(), {k: v.detach().float().cpu() for k, v in model.state_dict().items()}, fused


@hopper
def test_fp8_training_with_the_fused_swiglu(tmp_path, monkeypatch):
    """With the fused SwiGLU, Recompute (moe_act: its rebuild is the plain kernel's bits; moe: the whole layer again)
    and the deferred wgrad give its losses and weights bit for bit. Without it (``LMOE_FP8_FUSED_SWIGLU=0``) the
    router's gradient through the row weights is summed in another order: close, not equal."""
    from lightning_moe import FP8Training, Recompute
    from lightning_moe.modules import fp8_swiglu

    def fp8(**kw):
        return FP8Training("rowwise", fast_accum="all", **kw)

    ref_losses, ref_state, ref_fused = _fit(tmp_path, [fp8()])
    assert set(ref_fused) == {2}  # both MoE layers (the first is dense)
    for name, callbacks in (("recompute_act", [fp8(), Recompute(["moe_act"])]),
                            ("recompute_moe", [fp8(), Recompute(["moe"])]),
                            ("deferred", [fp8(defer_expert_wgrad=True)])):
        losses, state, fused = _fit(tmp_path, callbacks)
        assert set(fused) == {2}, name
        assert torch.equal(losses, ref_losses), name
        assert all(torch.equal(state[k], v) for k, v in ref_state.items()), name
    monkeypatch.setattr(fp8_swiglu, "ENABLED", False)
    losses, state, fused = _fit(tmp_path, [fp8()])
    assert set(fused) == {0}
    torch.testing.assert_close(losses, ref_losses, rtol=2e-3, atol=0)


@hopper
def test_delayed_fp8_training_defers_the_fp8_expert_wgrad(tmp_path):
    """The delayed recipe with E4M3 gradients (the one-pass kernels): ``defer_expert_wgrad`` gives the losses and
    weights of no deferral bit for bit."""
    from lightning_moe import FP8Training

    def fp8(**kw):
        return FP8Training("delayed", fp8_format="e4m3", fast_accum="all", **kw)

    ref_losses, ref_state, _ = _fit(tmp_path, [fp8()])
    for defer in (True, 2):
        losses, state, _ = _fit(tmp_path, [fp8(defer_expert_wgrad=defer)])
        assert torch.equal(losses, ref_losses), defer
        assert all(torch.equal(state[k], v) for k, v in ref_state.items()), defer


@hopper
def test_fp8_training_defers_the_bf16_expert_wgrad(tmp_path):
    """``fp8_wgrad=False`` with the experts' bf16 wgrad deferred, by ``FP8Training(defer_expert_wgrad=True)`` or by
    ``MoEFoldStrategy(defer_expert_wgrad=True)``: the first step's main grads are the per-micro-batch ones up to
    float32 summation order (the segments kernel sums the step's rows in one accumulator; the clipping coefficient
    follows), and the losses follow closely. (Adam turns last-bit differences of near-zero gradients into whole
    updates, so the weights are not compared.)"""
    from lightning_moe import FP8Training

    def fp8(**kw):
        return FP8Training("rowwise", fast_accum="all", fp8_wgrad=False, **kw)

    class Grads(L.Callback):  # the first step's main grads, after its optimizer step (nothing overwrites them yet)
        def __init__(self):
            self.grads = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:
                self.grads = {n: p.main_grad.double().clone() for n, p in pl_module.named_parameters()
                              if getattr(p, "main_grad", None) is not None}

    ref = Grads()
    ref_losses, _, _ = _fit(tmp_path, [fp8(), ref])
    experts = [n for n in ref.grads if ".experts.w" in n]
    assert len(experts) == 4 and all(ref.grads[n].norm() > 0 for n in experts)
    for name, callbacks, kw in (("callback", [fp8(defer_expert_wgrad=True)], {}),
                                ("strategy", [fp8()], dict(defer_expert_wgrad=True))):
        got = Grads()
        losses, _, _ = _fit(tmp_path, [*callbacks, got], **kw)
        assert torch.equal(losses[:2], ref_losses[:2]), name  # the first step's forward: no update yet
        torch.testing.assert_close(losses, ref_losses, rtol=1e-3, atol=0)
        for n, g in ref.grads.items():
            rel = ((got.grads[n] - g).norm() / g.norm().clamp_min(1e-30)).item()
            assert rel < 1e-5, (name, n, rel)


@pytest.mark.parametrize("D", [2048, 4096, 8200])
def test_permute_gather_quant_gives_the_two_kernels_bits(D):
    """``triton_fp8_gather.gather_quant``: the permute's gather and ``rowwise_quant`` of its output, bit for bit, at
    Qwen3's and Mixtral's widths and a wide one (read twice), with holes (padded layouts) and a zero row."""
    from lightning_moe.modules import triton_fp8_gather as tg
    from lightning_moe.modules import triton_fp8_quant as tq
    from lightning_moe.modules import triton_permute as tp
    g = torch.Generator("cuda").manual_seed(D)
    x = (torch.randn(700, D, device="cuda", generator=g) * 3).to(torch.bfloat16)
    x[5] = 0
    src = torch.randint(0, 700, (5000,), device="cuda", generator=g)
    src[::97] = -1
    out, q, s = tg.gather_quant(x, src)
    ref = tp.gather(x, src)
    rq, rs = tq.rowwise_quant(ref, inverse=True)
    _same(out, ref)
    _same(q, rq)
    _same(s, rs)


@hopper
def test_fp8_training_with_the_permutes_quantizing(tmp_path, monkeypatch):
    """The MoE layers' permutes quantize x (the dispatch's gather) and dy (the combine's gather in backward) for the
    experts' FP8 GEMMs, which take both at every micro-batch (validation and the recompute of ``Recompute(["moe"])``
    included). Losses and weights are those of the GEMMs' own quantization passes bit for bit, with the FP8 wgrad (its
    column amaxes then come from a pass of their own) and with ``fp8_wgrad=False``."""
    from lightning_moe import FP8Training, Recompute
    from lightning_moe.modules import fp8_swiglu
    taken = {"input": 0, "grad_out": 0}
    take = fp8_swiglu.Handoff.take

    def counting(self, which, t):
        got = take(self, which, t)
        if got is not None and which in taken:
            taken[which] += 1
        return got

    monkeypatch.setattr(fp8_swiglu.Handoff, "take", counting)
    for fp8_wgrad in (True, False):
        def fp8():
            return FP8Training("rowwise", fast_accum="all", fp8_wgrad=fp8_wgrad)
        monkeypatch.setattr(fp8_swiglu, "PERMUTE", False)
        ref_losses, ref_state, _ = _fit(tmp_path, [fp8()])
        assert taken == {"input": 0, "grad_out": 0}
        monkeypatch.setattr(fp8_swiglu, "PERMUTE", True)
        for name, callbacks in (("fused", [fp8()]), ("recompute_moe", [fp8(), Recompute(["moe"])])):
            losses, state, _ = _fit(tmp_path, callbacks)
            # 3 steps x 2 micro-batches x 2 MoE layers; forwards: also 2 validation batches, and the recomputes
            assert taken["grad_out"] == 12 and taken["input"] >= 16 + (12 if name == "recompute_moe" else 0), \
                (fp8_wgrad, name, taken)
            assert torch.equal(losses, ref_losses), (fp8_wgrad, name)
            assert all(torch.equal(state[k], v) for k, v in ref_state.items()), (fp8_wgrad, name)
            taken.update(input=0, grad_out=0)


@hopper
def test_fp8_training_quantizes_the_attention_input_once(tmp_path, monkeypatch):
    """``FP8Training``'s dense linears share their input's quantization (``fp8_linear.SharedInput``): q, k and v read
    one normed x, quantized once instead of three times per layer and micro-batch. Losses and weights are those of
    ``LMOE_FP8_SHARED_INPUT=0`` bit for bit."""
    from lightning_moe import FP8Training
    from lightning_moe.callbacks import fp8_training
    from tests.modules.test_fp8_linear import count_quantizations
    calls = count_quantizations(monkeypatch)
    monkeypatch.setattr(fp8_training, "SHARED_INPUT", False)
    ref_losses, ref_state, _ = _fit(tmp_path, [FP8Training("rowwise", fast_accum="all", fp8_wgrad=False)])
    unshared = calls.count("x")
    calls.clear()
    monkeypatch.setattr(fp8_training, "SHARED_INPUT", True)
    losses, state, _ = _fit(tmp_path, [FP8Training("rowwise", fast_accum="all", fp8_wgrad=False)])
    # k and v take q's: 2 fewer in each of 3 layers at each of the 6 training forwards (and the validation's)
    assert unshared - calls.count("x") >= 2 * 3 * 6, (calls.count("x"), unshared)
    assert torch.equal(losses, ref_losses)
    assert all(torch.equal(state[k], v) for k, v in ref_state.items())
