"""Tensor-parallel building blocks on 2 gloo ranks against the same modules on one process (same full weights).

A small network covers every block: vocab-parallel embedding -> RMSNorm -> column-parallel -> ReLU -> row-parallel
(+ residual) -> column-parallel head -> vocab-parallel cross-entropy. Compared: the loss, the input-independent
gradient of every weight shard against the matching slice of the reference gradient, and (under sequence
parallelism) the RMSNorm gradient summed over TP.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.parallel.harness import run_ranks

B, S, D, FF, V = 2, 8, 16, 32, 24


def _net(ctx):
    from lightning_moe.modules.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                                       VocabParallelEmbedding)
    mods = torch.nn.ModuleDict(dict(emb=VocabParallelEmbedding(V, D, ctx), norm=torch.nn.RMSNorm(D),
                                    up=ColumnParallelLinear(D, FF, ctx), down=RowParallelLinear(FF, D, ctx),
                                    head=ColumnParallelLinear(D, V, ctx)))
    for name, m in mods.items():
        if hasattr(m, "reset_parameters_sharded"):
            m.reset_parameters_sharded(11, name)
    with torch.no_grad():
        mods["norm"].weight.copy_(torch.linspace(0.5, 1.5, D))
    return mods


def _loss(mods, ids_BS, target_BS, ctx):
    from lightning_moe.modules.tensor_parallel import vocab_parallel_cross_entropy
    x_BSD = mods["emb"](ids_BS)
    x_BSD = x_BSD + mods["down"](torch.relu(mods["up"](mods["norm"](x_BSD))))
    logits_BSV = mods["head"](x_BSD)  # vocab shard, full sequence (the head gathers the sequence under SP)
    return vocab_parallel_cross_entropy(logits_BSV.flatten(0, 1), target_BS.flatten(), ctx)


def _data():
    g = torch.Generator().manual_seed(0)
    ids, target = torch.randint(0, V, (B, S), generator=g), torch.randint(0, V, (B, S), generator=g)
    target[0, :3] = -100  # ignored, as F.cross_entropy does (masked labels)
    return ids, target


def _reference():
    from lightning_moe.strategy.parallel_context import ParallelContext
    mods = _net(ParallelContext.single())
    ids, target = _data()
    loss = _loss(mods, ids, target, ParallelContext.single())
    loss.backward()
    ref_ce = F.cross_entropy(mods["head"](mods["emb"](ids)).flatten(0, 1), target.flatten())  # sanity of the path
    return {"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in mods.named_parameters()},
            "ce_ok": bool(torch.isfinite(ref_ce))}


def _worker(rank, world, sp, ref):
    import torch.distributed as dist

    from lightning_moe.strategy.layout import build_layout
    from lightning_moe.strategy.parallel_context import ParallelContext
    dist.init_process_group("gloo")
    ctx = ParallelContext.from_layout(build_layout(world, tp=world), rank, sequence_parallel=sp)
    mods = _net(ctx)
    ids, target = _data()
    loss = _loss(mods, ids, target, ctx)
    loss.backward()
    out = {"loss": (loss.detach() - ref["loss"]).abs().item()}
    for n, p in mods.named_parameters():
        g = p.grad
        if getattr(p, "tp_shard_dim", None) is not None:
            want = ref["grads"][n].chunk(world, dim=p.tp_shard_dim)[rank]
        else:  # replicated over TP: under SP each rank holds a partial gradient, summed over TP
            want = ref["grads"][n]
            if sp:
                g = g.clone()
                dist.all_reduce(g, group=ctx.group("tp"))
        out[n] = ((g - want).abs().max() / want.abs().max()).item()
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
def test_tp_blocks_match_one_process(tmp_path, sp):
    ref = _reference()
    assert ref["ce_ok"]
    for rank, res in enumerate(run_ranks(_worker, 2, sp, ref, out_dir=str(tmp_path))):
        print(f"tp2 sp={sp} rank{rank}: " + ", ".join(f"{k}={v:.1e}" for k, v in res.items()))
        assert res.pop("loss") <= 1e-6
        for name, rel in res.items():
            assert rel <= 1e-5, f"rank {rank}: gradient of {name} differs from the reference by {rel:.2e} (rel)"


def test_vocab_parallel_ce_single_process_is_cross_entropy():
    from lightning_moe.modules.tensor_parallel import vocab_parallel_cross_entropy
    from lightning_moe.strategy.parallel_context import ParallelContext
    logits, target = torch.randn(6, 10), torch.randint(0, 10, (6,))
    assert torch.equal(vocab_parallel_cross_entropy(logits, target, ParallelContext.single()),
                       F.cross_entropy(logits, target))


@pytest.mark.parametrize("cls,args,match", [
    ("ColumnParallelLinear", (16, 30), "output features"),
    ("RowParallelLinear", (30, 16), "input features"),
    ("VocabParallelEmbedding", (25, 16), "vocab size"),
])
def test_indivisible_sizes_raise(cls, args, match):
    import lightning_moe.modules.tensor_parallel as tpm
    from lightning_moe.strategy.parallel_context import ParallelContext
    ctx = ParallelContext.single()
    ctx.sizes = dict(ctx.sizes, tp=4)
    with pytest.raises(ValueError, match=match):
        getattr(tpm, cls)(*args, ctx)
