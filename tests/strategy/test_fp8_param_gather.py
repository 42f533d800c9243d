"""The FP8 parameter all-gather's pieces (``strategy/fp8_param_gather.py``) on one process: block amaxes,
quantization and dequantization of arbitrary flat slices against ``fp8.py`` on the whole tensor, the exact round trip
through bf16, and the refusals. The gather itself: ``tests/parallel/test_fp8_param_gather.py``."""

from __future__ import annotations

import random

import lightning as L
import pytest
import torch

from lightning_moe import FP8Training, MoEFoldStrategy, MoELanguageModel, TokenDataModule
from lightning_moe.modules.fp8 import Tiling, dequantize, quantize, scale_of
from lightning_moe.strategy.fp8_param_gather import (RECIPES, dequantize_into, local_amax, quantize_into,
                                                     weight_blocks)


@pytest.mark.parametrize("seed", range(6))
def test_slices_match_the_whole_tensor(seed):
    """Any cut of a weight into ranks' slices gives the whole tensor's block amaxes, FP8 bytes and dequantized
    values; quantizing the dequantized bf16 weight with those amaxes gives the bytes back."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for recipe in RECIPES:
        for grouped in (False, True):
            shape = (rng.randint(1, 3), 128 * rng.randint(1, 2), 128 * rng.randint(1, 3)) if grouped else \
                (128 * rng.randint(1, 3), 128 * rng.randint(1, 2))
            b = weight_blocks(shape, recipe, grouped)
            w = (torch.randn(shape) * torch.rand(shape) ** 4 * 3).to(torch.bfloat16)
            w.view(-1)[rng.randrange(w.numel())] = 0.0
            flat, n = w.reshape(-1), w.numel()
            cuts = sorted({0, n, *(rng.randint(0, n) for _ in range(rng.randint(1, 6)))})
            amax = torch.zeros(b.grid)
            for lo, hi in zip(cuts, cuts[1:]):
                local_amax(flat[lo:hi], b, lo, hi, amax)
            x = w.reshape(b.R, b.C)
            t = Tiling(b.h, b.w)
            want = x.abs().float().reshape(b.grid[0], b.h, b.grid[1], b.w).amax((1, 3))
            assert torch.equal(amax, want), (recipe, grouped, shape, cuts)
            q = torch.empty(n, dtype=torch.float8_e4m3fn)
            d = torch.empty(n, dtype=torch.bfloat16)
            s = scale_of(amax, "e4m3")
            for lo, hi in zip(cuts, cuts[1:]):
                quantize_into(q[lo:hi], flat[lo:hi], b, lo, hi, s)
                dequantize_into(d[lo:hi], q[lo:hi], b, lo, hi, s)
            q_ref, s_ref = quantize(x, "e4m3", t, amax=amax)
            assert torch.equal(q.view(torch.uint8), q_ref.reshape(-1).view(torch.uint8))
            assert torch.equal(d, dequantize(q_ref, s_ref, t).to(torch.bfloat16).reshape(-1))
            q_back, s_back = quantize(d.reshape(b.R, b.C), "e4m3", t)  # even with amaxes taken from d itself
            assert torch.equal(q_back.reshape(-1).view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(s_back, s_ref)


def test_blocks_follow_the_gemms():
    assert weight_blocks((256, 128), "tensorwise", False).grid == (1, 1)
    assert weight_blocks((4, 128, 256), "tensorwise", True).grid == (4, 1)  # one scale per expert
    assert weight_blocks((4, 128, 256), "blockwise", True).grid == (4, 2)
    with pytest.raises(ValueError, match="recipe 'rowwise' has no single FP8 copy"):
        weight_blocks((256, 128), "rowwise", False)


MODEL = dict(seq_length=32, num_layers=2, hidden_size=128, num_attention_heads=4, num_kv_heads=4, ffn_hidden_size=256,
             moe_ffn_hidden_size=128, num_experts=4, topk=2, vocab_size=256)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    from tests.parallel.parity import make_tokens
    return make_tokens(str(tmp_path_factory.mktemp("tokens") / "t.bin"))


def _fit(tokens, root, strategy, precision):
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        strategy=strategy, precision=precision, default_root_dir=root,
                        callbacks=[FP8Training("tensorwise", fp8_param_gather=True)])
    lm = MoELanguageModel(preset="tiny", overrides=MODEL, lr=1e-3, warmup_steps=1, seed=3)
    trainer.fit(lm, datamodule=TokenDataModule(path=tokens, seq_length=32, batch_size=2, seed=3))


def test_refusals(tokens, tmp_path):
    for recipe, why in (("rowwise", "scales differ between the forward and dgrad layouts"),
                        ("delayed", "follow an amax history")):
        with pytest.raises(ValueError, match=rf"FP8Training\(recipe='{recipe}', fp8_param_gather=True\): .*{why}"):
            FP8Training(recipe, fp8_param_gather=True)
    with pytest.raises(ValueError, match=r"needs MoEFoldStrategy\(distributed_optimizer=True\)"):
        _fit(tokens, tmp_path, MoEFoldStrategy(), "bf16-true")
    with pytest.raises(ValueError, match="needs bf16 weights with fp32 main params"):
        _fit(tokens, tmp_path, MoEFoldStrategy(distributed_optimizer=True), "32-true")
    with pytest.warns(UserWarning, match="no FP8 weight is all-gathered in this layout"):
        _fit(tokens, tmp_path, MoEFoldStrategy(distributed_optimizer=True), "bf16-true")  # one rank: nothing to do


def test_published_amaxes_lapse_when_the_weight_is_written():
    """A preset is dropped once the weight, or the flat buffer that holds it, is written in place: the GEMMs then
    take the amaxes from the weights (a callback's new weights must not be quantized with old scales)."""
    from lightning_moe.strategy.fp8_param_gather import WeightAmaxes
    flat = torch.randn(64)
    p = torch.nn.Parameter(flat[:32].view(4, 8), requires_grad=False)
    amaxes, a = WeightAmaxes(), torch.ones(1, 1)
    amaxes.set(p, a, flat)
    assert amaxes.get(p) is a and amaxes.get(p.detach()) is a
    with torch.no_grad():
        p.mul_(2)
    assert amaxes.get(p) is None
    amaxes.set(p, a, flat)
    flat[40:].zero_()  # the bucket's buffer
    assert amaxes.get(p) is None
