"""Layout-independent checkpoints (torch.distributed.checkpoint): model weights saved under one layout and loaded
under another equal, on every rank, the matching slices of the one-process model (the same seed gives the same full
weights on every layout, so the one-process model is the ground truth)."""

from __future__ import annotations

import os

import pytest
import torch

from tests.parallel.harness import run_ranks
from tests.parallel.parity import reference_slice

CFG = dict(seq_length=32, num_layers=4, hidden_size=32, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
           moe_ffn_hidden_size=32, num_experts=8, topk=2, first_k_dense=1, shared_expert_ffn_size=32,
           score_function="sigmoid", expert_bias=True, vocab_size=256)
SAVE_SEED, OTHER_SEED = 11, 3


def _ctx(rank, world, layout_kw):
    from lightning_moe.strategy.layout import build_layout
    from lightning_moe.strategy.parallel_context import ParallelContext
    if world == 1 and not layout_kw:
        return ParallelContext.single()
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=rank, world_size=world)
    layout = build_layout(world, **layout_kw)
    return ParallelContext.from_layout(layout, rank, sequence_parallel=layout.tp > 1)


def _model(ctx, cfg, seed):
    from lightning_moe import ModelConfig
    from lightning_moe.modules.transformer import MoETransformer
    model = MoETransformer(ModelConfig.from_preset("tiny", **cfg), ctx)
    model.init_weights(seed)
    with torch.no_grad():  # buffers too: a bias that is not all zeros
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.arange(b.numel(), dtype=b.dtype) * (0.01 if seed == SAVE_SEED else -1))
    return model


def _save(rank, world, layout_kw, path, cfg):
    from lightning_moe.strategy.reshard import save_model
    ctx = _ctx(rank, world, layout_kw)
    save_model(_model(ctx, cfg, SAVE_SEED), ctx, path)


def _load(rank, world, layout_kw, path, cfg):
    from lightning_moe.strategy.reshard import load_model
    ctx = _ctx(rank, world, layout_kw)
    model = _model(ctx, cfg, OTHER_SEED)
    load_model(model, ctx, path)
    from lightning_moe.strategy.parallel_context import ParallelContext
    ref = _model(ParallelContext.single(), cfg, SAVE_SEED).state_dict()
    specs = {n: (getattr(p, "tp_shard_dim", None) if ctx.tp > 1 else None, getattr(p, "tp_parts", 1))
             for n, p in model.named_parameters()}
    worst = 0.0
    for name, t in model.state_dict().items():
        want = reference_slice(name, ref[name], ctx, cfg["num_experts"], specs.get(name, (None, 1)))
        worst = max(worst, (t - want).abs().max().item())
    return {"worst": worst, "names": sorted(model.state_dict())}


CASES = [  # (save world, save layout) -> (load world, load layout)
    ((2, dict(ep=2)), (1, {})),
    ((2, dict(tp=2, ep=2)), (4, dict(ep=4))),
    ((2, dict(pp=2)), (1, {})),
    ((1, {}), (2, dict(tp=2, ep=2))),
    ((4, dict(tp=2, ep=2, etp=2)), (4, dict(pp=2, tp=2))),
]


@pytest.mark.parametrize("save,load", CASES, ids=lambda c: f"w{c[0]}_" + "_".join(f"{k}{v}" for k, v in c[1].items()))
def test_reshard(tmp_path, save, load):
    path = str(tmp_path / "ckpt")
    run_ranks(_save, save[0], save[1], path, CFG, out_dir=str(tmp_path / "s"), start_method="fork")
    assert os.path.isfile(os.path.join(path, ".metadata"))
    results = run_ranks(_load, load[0], load[1], path, CFG, out_dir=str(tmp_path / "l"), start_method="fork")
    for rank, r in enumerate(results):
        assert r["worst"] == 0.0, f"rank {rank}: max abs difference {r['worst']}"  # bit-exact


def test_tied_embeddings_under_pp_reshard_to_one_process(tmp_path):
    cfg = {**CFG, "tie_embeddings": True}
    path = str(tmp_path / "ckpt")
    run_ranks(_save, 2, dict(pp=2), path, cfg, out_dir=str(tmp_path / "s"))
    (r,) = run_ranks(_load, 1, {}, path, cfg, out_dir=str(tmp_path / "l"))
    assert r["worst"] == 0.0 and "embed.weight" in r["names"] and "head.weight" not in r["names"]


def test_config_mismatch_names_the_tensor(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save, 1, {}, path, CFG, out_dir=str(tmp_path / "s"))
    with pytest.raises(AssertionError, match=r"checkpoint tensor 'layers.1.ffn.router.weight' has shape \(8, 32\), this model's is \(16, 32\)"):
        run_ranks(_load, 1, {}, path, {**CFG, "num_experts": 16}, out_dir=str(tmp_path / "l"))
