"""Stage partitioning (pure) and the stage-split model: every layer on exactly one stage, names and initial values
those of the unsplit model."""

import pytest
import torch

from lightning_moe import ModelConfig
from lightning_moe.modules.transformer import MoETransformer
from lightning_moe.strategy.parallel_context import ParallelContext
from lightning_moe.strategy.pipeline.partition import local_stages, partition_layers


def test_even_split_and_interleaved_placement():
    assert partition_layers(8, 2) == [range(0, 4), range(4, 8)]
    assert partition_layers(8, 2, 2) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert local_stages(2, 0, 2) == [0, 2] and local_stages(2, 1, 2) == [1, 3] and local_stages(4, 3) == [3]
    assert partition_layers(5, 1) == [range(5)]


def test_explicit_first_and_last():
    assert [len(r) for r in partition_layers(10, 4, first=1, last=3)] == [1, 3, 3, 3]
    assert [len(r) for r in partition_layers(7, 3, last=1)] == [3, 3, 1]
    assert [len(r) for r in partition_layers(4, 2, first=0)] == [0, 4]  # an embedding-only first stage
    parts = partition_layers(10, 2, 2, first=1, last=1)
    assert [len(r) for r in parts] == [1, 4, 4, 1] and parts[-1] == range(9, 10)


@pytest.mark.parametrize("args,match", [
    ((3, 2), "remaining 3 layers do not divide evenly over 2 stages"),
    ((2, 4), "remaining 2 layers"),
    ((6, 2, None, 7), "remaining -1 layers"),
    ((6, 3, None, 3, 3), "with 3 layers on the first and 3 on the last stage: the remaining 0 layers"),
    ((4, 1, None, 2), "need pipeline_parallel_size > 1"),
])
def test_bad_splits(args, match):
    with pytest.raises(ValueError, match=match):
        partition_layers(*args)


def _ctx(pp, rank, vpp=None, first=None):
    ctx = ParallelContext.single()
    ctx.sizes = {**ctx.sizes, "pp": pp}
    ctx.ranks = {**ctx.ranks, "pp": rank}
    ctx.virtual_pipeline_size, ctx.pipeline_first_layers = vpp, first
    return ctx


@pytest.mark.parametrize("pp,vpp,first,tie", [(2, None, None, False), (2, 2, None, False), (4, None, 1, True)])
def test_stages_hold_the_unsplit_models_weights(pp, vpp, first, tie):
    cfg = ModelConfig.from_preset("tiny", num_layers=8 if first is None else 7, tie_embeddings=tie, num_experts=4,
                                  hidden_size=32, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
                                  moe_ffn_hidden_size=32, vocab_size=64)
    full = MoETransformer(cfg)
    full.init_weights(5)
    ref = full.state_dict()
    seen = {}
    for rank in range(pp):
        stage = MoETransformer(cfg, _ctx(pp, rank, vpp, first))
        stage.init_weights(5)
        assert stage.has_first == (rank == 0) and stage.has_last == (rank == pp - 1)
        if tie and stage.has_last and not stage.has_first:  # the last stage's copy of the tied embedding
            assert stage.embed.weight.pp_tied and stage.embed.weight.pp_tied_copy
        for name, t in stage.state_dict().items():
            torch.testing.assert_close(t, ref[name], rtol=0, atol=0)
            if name != "embed.weight":
                assert name not in seen, f"{name} on two stages"
            seen[name] = rank
        chunk_params = [p for c in range(len(stage.stages)) for p in stage.chunk_parameters(c)]
        assert len({id(p) for p in chunk_params}) == len(list(stage.parameters()))  # every param in one chunk
    assert set(seen) == set(ref)


def test_forward_refuses_a_partial_model():
    cfg = ModelConfig.from_preset("tiny", num_layers=2)
    with pytest.raises(RuntimeError, match="forward_chunk"):
        MoETransformer(cfg, _ctx(2, 0))(torch.zeros(1, 8, dtype=torch.long))


def test_clipping_on_a_rank_without_gradients_still_returns_the_norm():
    """A pipeline stage whose parameters got no gradient must still join the norm's collectives (no early return)."""
    from lightning_moe.strategy.grad_sync import clip_grad_norm_global_
    p = torch.nn.Parameter(torch.ones(3))
    assert clip_grad_norm_global_([p], 1.0, ParallelContext.single()).item() == 0.0
    p.grad = torch.full((3,), 2.0)
    total = clip_grad_norm_global_([p], 1.0, ParallelContext.single())
    assert total.item() == pytest.approx(12 ** 0.5) and p.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
