"""MoEFoldStrategy on several gloo ranks: collectives, bad layouts, a dying rank, the unchanged user module."""

from __future__ import annotations

import os
import time

import lightning as L
import pytest
import torch

from tests.parallel.harness import run_ranks
from tests.parallel.parity import make_tokens


def _collectives(rank, world):
    from lightning_moe import MoEFoldStrategy
    s = MoEFoldStrategy(expert_parallel_size=2, timeout=60)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=s, logger=False)
    s.setup_environment()
    x = torch.tensor([float(rank + 1)])
    barrier = torch.distributed.barrier
    torch.distributed.barrier = None  # reduce (self.log(sync_dist=True)) must not add a barrier: a host sync on NCCL
    out = {
        "mean": s.reduce(x.clone(), reduce_op="mean").item(),
        "sum": s.reduce(x.clone(), reduce_op="sum").item(),
        "max": s.reduce(x.clone(), reduce_op="max").item(),
        "int_mean": s.reduce(torch.tensor([4 * rank + 1]), reduce_op="mean").tolist(),
    }
    torch.distributed.barrier = barrier
    out.update({
        "broadcast": s.broadcast({"from": rank}, src=1)["from"],
        "gather": s.all_gather(x).flatten().tolist(),
        "sampler": s.distributed_sampler_kwargs,
        "ctx": repr(s.parallel_context),
        "is_distributed": s.is_distributed,
    })
    s.barrier()
    del trainer
    return out


def test_collectives(tmp_path):
    res = run_ranks(_collectives, 2, out_dir=str(tmp_path))
    for rank, r in enumerate(res):
        assert r["mean"] == pytest.approx(1.5) and r["sum"] == pytest.approx(3.0) and r["max"] == 2.0
        assert r["int_mean"] == [3]  # (1 + 5) / 2, in place in the integer tensor
        assert r["broadcast"] == 1
        assert r["gather"] == [1.0, 2.0]
        assert r["sampler"] == {"num_replicas": 2, "rank": rank}
        assert "ep=2" in r["ctx"] and "dp=2" in r["ctx"] and "edp=1" in r["ctx"]
        assert r["is_distributed"]


def _train(rank, world, tokens, root, model_kwargs, ep, die_at=None, timeout=30.0, hang=False):
    from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule

    class Die(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if die_at is not None and rank == 1 and batch_idx == die_at:
                if hang:
                    time.sleep(3600)  # alive but stuck: only the collective timeout can free rank 0
                os._exit(3)  # a hard crash: no exception, no cleanup

    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=MoEFoldStrategy(expert_parallel_size=ep,
                                                                                    timeout=timeout),
                        max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        callbacks=[Die()], default_root_dir=root, limit_val_batches=0)
    model = MoELanguageModel(preset="tiny", overrides=dict(seq_length=16, hidden_size=32, num_layers=1,
                                                           moe_ffn_hidden_size=32, **model_kwargs))
    t0 = time.time()
    try:
        trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=16, batch_size=2))
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(e).__name__}: {e}", "elapsed": time.time() - t0}
    return {"error": None, "steps": trainer.global_step}


def test_bad_num_experts_fails_before_training(tmp_path):
    tokens = make_tokens(str(tmp_path / "t.bin"))
    res = run_ranks(_train, 2, tokens, str(tmp_path / "r"), dict(num_experts=3, topk=1, pre_softmax=True), 2, out_dir=str(tmp_path))
    for r in res:
        assert r["error"] and "num_experts=3" in r["error"] and "ep=2" in r["error"], r


def _run_with_faulty_rank1(tmp_path, hang: bool, timeout: float):
    from tests.parallel.harness import _entry, free_port
    tokens = make_tokens(str(tmp_path / "t.bin"))
    ctx = torch.multiprocessing.get_context("spawn")
    args = (tokens, str(tmp_path / "r"), {}, 2, 2, timeout, hang)
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, 2, port, str(tmp_path), _train, args)) for r in range(2)]
    for p in procs:
        p.start()
    procs[0].join(120)
    survivor_alive = procs[0].is_alive()
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    assert not survivor_alive, "rank 0 hung instead of failing"
    res0 = torch.load(tmp_path / "rank0.pt", weights_only=False)["value"]
    assert res0["error"] is not None, "rank 0 finished training although rank 1 failed"
    return res0, procs


def test_dead_rank_fails_the_others_quickly(tmp_path):
    res0, procs = _run_with_faulty_rank1(tmp_path, hang=False, timeout=20.0)
    assert procs[1].exitcode == 3
    assert res0["elapsed"] < 20, res0


def test_hung_rank_fails_the_others_within_the_timeout(tmp_path):
    res0, _ = _run_with_faulty_rank1(tmp_path, hang=True, timeout=5.0)
    assert 4.0 <= res0["elapsed"] < 40, res0  # the configured 5 s, not forever
    assert "RuntimeError" in res0["error"] or "DistBackendError" in res0["error"], res0


def test_plain_user_module_trains_unchanged(tmp_path):
    """A LightningModule that knows nothing of MoE or parallel contexts trains as plain data parallelism."""
    res = run_ranks(_plain, 2, str(tmp_path), out_dir=str(tmp_path))
    assert res[0]["weight"] == res[1]["weight"]  # replicas stay identical
    assert res[0]["steps"] == 3


class _Plain(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _plain(rank, world, root):
    from lightning_moe import MoEFoldStrategy  # noqa: F401  (registers "moe_fold")
    torch.manual_seed(rank)  # different init per rank: the strategy must broadcast
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="moe_fold", max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=root)
    model = _Plain()
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=4))
    return {"weight": model.layer.weight.detach().flatten().tolist(), "steps": trainer.global_step}
