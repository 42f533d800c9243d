"""FP8Training on one process (CPU: torch._scaled_mm for dense tensorwise/rowwise GEMMs, emulation otherwise): every
recipe trains the tiny MoE to within 3 % of the fp32 loss over 40 steps while changing the numbers (FP8 is on);
exclusions, the head, teardown, FP8 token dispatch switched on and off, and the refusals, each before training with
one clear error."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lightning_moe import FP8Training, MoELanguageModel, TokenDataModule
from lightning_moe.modules.experts import GroupedMM
from lightning_moe.modules.tensor_parallel import ColumnParallelLinear, RowParallelLinear

MODEL = dict(seq_length=32, num_layers=2, hidden_size=128, num_attention_heads=4, num_kv_heads=4, ffn_hidden_size=256,
             moe_ffn_hidden_size=128, num_experts=8, topk=2, first_k_dense=1, shared_expert_ffn_size=128,
             vocab_size=256)


class _Losses(L.Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(outputs["loss"]))


def _fit(tokens, root, callbacks, steps=40):
    L.seed_everything(0, verbose=False)
    rec = _Losses()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        gradient_clip_val=1.0, callbacks=[rec, *callbacks], default_root_dir=root)
    lm = MoELanguageModel(preset="tiny", overrides=MODEL, lr=3e-3, warmup_steps=5, seed=3)
    trainer.fit(lm, datamodule=TokenDataModule(path=tokens, seq_length=32, batch_size=4, seed=3))
    return rec.values


def test_every_recipe_trains_close_to_fp32(tokens, tmp_path):
    ref = _fit(tokens, str(tmp_path), [])
    end = sum(ref[-5:]) / 5
    for recipe, kw in (("tensorwise", {}), ("delayed", {}), ("rowwise", {}), ("blockwise", {}),
                       ("rowwise", dict(fp8_wgrad=False))):
        losses = _fit(tokens, str(tmp_path), [FP8Training(recipe, **kw)])
        assert losses != ref, recipe  # quantization changed the numbers
        assert abs(sum(losses[-5:]) / 5 - end) <= 0.03 * end, (recipe, kw, losses[-5:], ref[-5:])


def _lm():
    lm = MoELanguageModel(preset="tiny", overrides=MODEL)
    lm.configure_model()
    return lm


def _start(cb, lm):
    cb.on_fit_start(SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu"))), lm)


def test_swaps_exclusions_head_and_teardown():
    lm = _lm()
    cb = FP8Training("rowwise", exclude=["model.layers.0.*"], include_head=True)
    _start(cb, lm)
    swapped = {name for name, m in lm.named_modules() if "_mm" in vars(m)}
    assert "model.head" in swapped and "model.layers.1.ffn.experts.fc1" in swapped
    assert "model.layers.1.attn.wq" in swapped and "model.layers.1.ffn.shared_experts.w2" in swapped
    assert not any(n.startswith("model.layers.0.") for n in swapped)
    gemms = [m for m in lm.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear, GroupedMM))]
    assert len(swapped) == len(gemms) - sum(1 for n, m in lm.named_modules()
                                           if n.startswith("model.layers.0.") and m in gemms)
    cb.teardown(None, lm, "fit")
    assert not any("_mm" in vars(m) for m in lm.modules())
    cb = FP8Training()  # the head stays out by default
    _start(cb, _lm())


def test_fp8_dispatch_flag_and_teardown():
    lm = _lm()
    dispatchers = [m.dispatcher for m in lm.model.moe_layers()]
    cb = FP8Training("rowwise", fp8_dispatch=True)
    _start(cb, lm)
    assert dispatchers and all(d.fp8_dispatch for d in dispatchers)
    cb.teardown(None, lm, "fit")
    assert not any(d.fp8_dispatch for d in dispatchers)


def test_refusals():
    with pytest.raises(ValueError, match="unknown recipe; valid: tensorwise, delayed, rowwise, blockwise"):
        FP8Training("mxfp8")
    with pytest.raises(ValueError, match=r"fp8_format='e5m2'\): valid: 'hybrid', 'e4m3'"):
        FP8Training(fp8_format="e5m2")
    with pytest.raises(ValueError, match=r"fast_accum='dgrad'\): valid: 'fprop', 'all', 'none'"):
        FP8Training(fast_accum="dgrad")
    with pytest.raises(ValueError, match="the rowwise recipe is E4M3 throughout"):
        FP8Training("rowwise", fp8_format="hybrid")
    with pytest.raises(ValueError, match=r"FP8Training\(recipe='blockwise', fp8_wgrad=False\): the blockwise recipe's "
                                         "wgrad on DeepGEMM already runs on bf16 tensor cores"):
        FP8Training("blockwise", fp8_wgrad=False)
    lm = MoELanguageModel(preset="tiny", overrides=dict(MODEL, num_kv_heads=2))  # wk: 128 x 64
    lm.configure_model()
    with pytest.raises(ValueError, match=r"model.layers.0.attn.wk: 128 x 64 is not a multiple of the blockwise"):
        _start(FP8Training("blockwise"), lm)
    _start(FP8Training("blockwise", exclude=["*.wk", "*.wv"]), lm)  # excluded, it runs
    lm = MoELanguageModel(preset="tiny", overrides=dict(MODEL, dispatcher="allgather"))
    lm.configure_model()
    with pytest.raises(ValueError, match=r"FP8Training\(fp8_dispatch=True\) needs the 'alltoall' dispatcher, but "
                                         r"model.layers.1.ffn uses dispatcher='allgather'"):
        _start(FP8Training("rowwise", fp8_dispatch=True), lm)
    assert not any("_mm" in vars(m) for m in lm.modules())  # refused before any GEMM was swapped


@pytest.mark.parametrize("fast_accum, expected", [("fprop", [True, False, False]), ("all", [True, True, True]),
                                                  ("none", [False, False, False])])
def test_fast_accumulation_reaches_each_gemm(monkeypatch, fast_accum, expected):
    """The dense FP8 linear's three GEMMs (forward, dgrad, wgrad) ask ``torch._scaled_mm`` for fast accumulation as
    ``fast_accum`` says; the callback hands the option to every spec it makes."""
    seen, real = [], torch._scaled_mm

    def spy(*args, use_fast_accum=False, **kwargs):
        seen.append(use_fast_accum)
        return real(*args, use_fast_accum=use_fast_accum, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    lm = _lm()
    cb = FP8Training("rowwise", fast_accum=fast_accum)
    _start(cb, lm)
    wq = lm.model.layers[1].attn.wq
    assert vars(wq)["_mm"].keywords["spec"].fast_accum == fast_accum
    assert vars(wq)["_mm"].keywords["spec"].fp8_wgrad  # on by default
    x = torch.randn(2, 8, 128, requires_grad=True)
    wq(x).sum().backward()
    assert seen == expected
    cb.teardown(None, lm, "fit")


def test_dense_linears_share_their_input_quantization_within_a_forward(tokens, tmp_path, monkeypatch):
    """FP8Training gives its dense linears one ``SharedInput``: q, k and v quantize their one input once per forward
    (the same losses as each quantizing it), and the entry is dropped when the forward is over (before backward, after
    the batch) and at teardown. ``LMOE_FP8_SHARED_INPUT=0`` (``SHARED_INPUT``) turns it off."""
    from lightning_moe.callbacks import fp8_training
    from tests.modules.test_fp8_linear import count_quantizations
    held = []

    class Watch(L.Callback):  # after FP8Training: what it left
        def on_before_backward(self, trainer, pl_module, loss):
            held.append(cb._inputs.held)

    calls = count_quantizations(monkeypatch)
    monkeypatch.setattr(fp8_training, "SHARED_INPUT", False)
    ref = _fit(tokens, str(tmp_path), [FP8Training("rowwise")], steps=3)
    unshared = calls.count("x")
    calls.clear()
    monkeypatch.setattr(fp8_training, "SHARED_INPUT", True)
    cb = FP8Training("rowwise")
    losses = _fit(tokens, str(tmp_path), [cb, Watch()], steps=3)
    assert losses == ref
    assert unshared - calls.count("x") == 2 * 2 * 3  # k and v take q's: 2 layers, 3 forwards
    assert len(held) == 3 and not any(held) and cb._inputs.held is None


def test_reduced_amaxes_are_reduced_once_and_not_shared(monkeypatch):
    """Where the input's amax is all-reduced over ranks (tensorwise with data parallelism) the quantization depends on
    more than the tensor: each linear quantizes it, and its amax is reduced once per linear, as without sharing."""
    from lightning_moe.modules import fp8_linear as fl
    reduced = []
    monkeypatch.setattr(fl.dist, "all_reduce", lambda t, op=None, group=None: reduced.append(group))
    x, w = torch.randn(64, 128), torch.randn(32, 128)
    group = object()  # stands in for the data-parallel group
    for shared in (None, fl.SharedInput()):
        reduced.clear()
        for _ in range(2):
            fl.fp8_linear(x, w, fl.FP8Spec("tensorwise", data_group=group, inputs=shared))
        assert reduced == [group, group]  # x's amax, once per linear (w is not split)
        assert shared is None or shared.held is None
