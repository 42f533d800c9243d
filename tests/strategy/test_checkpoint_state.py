"""Splitting a Lightning checkpoint into DCP tensors and a tensor-free shard, and filling it back (one process)."""

from __future__ import annotations

import pytest
import torch

from lightning_moe import ModelConfig
from lightning_moe.modules.transformer import MoETransformer
from lightning_moe.strategy.checkpoint_state import fill_checkpoint, split_checkpoint
from lightning_moe.strategy.parallel_context import ParallelContext
from lightning_moe.strategy.reshard import load_pieces, save_pieces


def _setup(seed):
    ctx = ParallelContext.single()
    torch.manual_seed(seed)
    model = MoETransformer(ModelConfig.from_preset("tiny", num_layers=1, seq_length=16), ctx)
    model.init_weights(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (2, 16))
    lm, aux = model.loss(ids, ids)
    (lm + aux).backward()
    opt.step()
    return ctx, model, opt


def _checkpoint(model, opt):
    return {"state_dict": {k: v.clone() for k, v in model.state_dict().items()}, "global_step": 1,
            "optimizer_states": [opt.state_dict()]}


def test_round_trip_is_exact_and_the_shard_holds_no_tensors(tmp_path):
    ctx, model, opt = _setup(0)
    ckpt = _checkpoint(model, opt)
    pieces, rest = split_checkpoint(ckpt, model, ctx, [opt])
    assert rest["state_dict"] == {} and rest["global_step"] == 1
    assert all(v is None for st in rest["optimizer_states"][0]["state"].values() for v in st.values())
    save_pieces(pieces, str(tmp_path / "dcp"))
    ctx2, model2, opt2 = _setup(1)  # other weights and moments, to be overwritten
    filled, restored = fill_checkpoint(rest, str(tmp_path / "dcp"), model2, ctx2, [opt2], None, True, load_pieces)
    assert restored
    for k, v in ckpt["state_dict"].items():
        assert torch.equal(filled["state_dict"][k], v), k
    saved, got = ckpt["optimizer_states"][0], filled["optimizer_states"][0]
    assert got["param_groups"] == saved["param_groups"]
    for idx, st in saved["state"].items():
        for k, v in st.items():
            assert torch.equal(got["state"][idx][k], v), (idx, k)
    opt2.load_state_dict(got)  # torch accepts it


def test_state_not_shaped_like_its_parameter_stays_in_the_shard(tmp_path):
    ctx, model, opt = _setup(0)
    ckpt = _checkpoint(model, opt)
    ckpt["optimizer_states"][0]["state"][0]["factored"] = torch.ones(3)  # e.g. Adafactor's row statistics
    pieces, rest = split_checkpoint(ckpt, model, ctx, [opt])
    assert torch.equal(rest["optimizer_states"][0]["state"][0]["factored"], torch.ones(3))
    save_pieces(pieces, str(tmp_path / "dcp"))
    same, ok = fill_checkpoint(rest, str(tmp_path / "dcp"), model, ctx, [opt], None, True, load_pieces)
    assert ok and same["optimizer_states"][0] is rest["optimizer_states"][0]
    other, ok = fill_checkpoint(rest, str(tmp_path / "dcp"), model, ctx, [opt], None, False, load_pieces)
    assert not ok and other["optimizer_states"] is None  # another layout: the optimizer restarts (with a warning)


def test_a_different_model_is_named(tmp_path):
    ctx, model, opt = _setup(0)
    pieces, rest = split_checkpoint(_checkpoint(model, opt), model, ctx, [opt])
    save_pieces(pieces, str(tmp_path / "dcp"))
    other = MoETransformer(ModelConfig.from_preset("tiny", num_layers=2, seq_length=16), ctx)
    with pytest.raises(ValueError, match="only in the model.*layers.1"):
        fill_checkpoint(rest, str(tmp_path / "dcp"), other, ctx, [], None, True, load_pieces)
