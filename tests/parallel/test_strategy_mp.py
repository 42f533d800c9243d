"""MoEFoldStrategy on several gloo ranks: collectives, bad layouts, a rank killed, frozen or hung inside a dispatcher
all-to-all or a pipeline exchange (the others stop in bounded time, naming it), the unchanged user module."""

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


def _train(rank, world, tokens, root, model_kwargs, strategy_kwargs, timeout=30.0, fault=None):
    """Train 4 steps. ``fault = (site, how, victim)``: from step 1 on, rank ``victim`` ``"exit"``s, ``"hang"``s,
    is SIGKILLed (``"kill"``) or SIGSTOPped (``"stop"``) at ``site``: the start of a batch, or inside the dispatcher's
    all-to-all or a pipeline exchange (sends and receives), half a second after entering it (the other ranks are
    inside theirs)."""
    import signal

    from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
    from lightning_moe.strategy import comm
    from lightning_moe.strategy.pipeline import p2p

    site, how, victim = fault or (None, None, None)
    inside = []  # the fault site this rank is in, if its failure comes from there

    def strike():
        if rank == victim and trainer.global_step >= 1:
            if how == "hang":
                time.sleep(3600)  # alive but stuck: only the collective timeout can free the others
            if how == "exit":
                os._exit(3)  # a hard crash: no exception, no cleanup
            time.sleep(0.5)
            if how == "stop":  # a frozen process, like a vanished host: its sockets stay open
                with open(os.path.join(root, "stopped_at"), "w") as f:
                    f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)

    def wrap(module, name):
        real = getattr(module, name)

        def call(*args, **kwargs):
            strike()
            inside.append(site)
            out = real(*args, **kwargs)
            inside.pop()
            return out
        setattr(module, name, call)

    if site == "all_to_all":
        wrap(comm, "all_to_all")
    elif site == "p2p" and strategy_kwargs.get("overlap_p2p_comm", True):  # the overlapped executor (the default)
        wrap(p2p.OverlappedComm, "post")  # posting a batch of sends and receives
        wrap(p2p.OverlappedComm, "wait")  # and waiting for one
    elif site == "p2p":
        wrap(p2p.StageComm, "exchange")

    class Strike(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if site == "batch_start":
                strike()

    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=MoEFoldStrategy(timeout=timeout,
                                                                                    **strategy_kwargs),
                        max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Strike()], default_root_dir=root,
                        limit_val_batches=0)
    model = MoELanguageModel(preset="tiny", overrides={**dict(seq_length=16, hidden_size=32, num_layers=1,
                                                              moe_ffn_hidden_size=32), **model_kwargs})
    t0 = time.time()
    try:
        trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=16, batch_size=2))
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(e).__name__}: {e}", "elapsed": time.time() - t0, "failed_at": time.time(),
                "inside": inside[-1:]}
    return {"error": None, "steps": trainer.global_step}


def test_bad_num_experts_fails_before_training(tmp_path):
    tokens = make_tokens(str(tmp_path / "t.bin"))
    res = run_ranks(_train, 2, tokens, str(tmp_path / "r"), dict(num_experts=3, topk=1, pre_softmax=True),
                    dict(expert_parallel_size=2), out_dir=str(tmp_path))
    for r in res:
        assert r["error"] and "num_experts=3" in r["error"] and "ep=2" in r["error"], r


def _logged_entry(rank, world, port, out_dir, fn, args):
    """The harness's entry with this rank's stderr in ``rank<r>.err`` (a process ended by the supervisor leaves no
    result, only its message)."""
    from tests.parallel.harness import _entry
    fd = os.open(os.path.join(out_dir, f"rank{rank}.err"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    _entry(rank, world, port, out_dir, fn, args)


def _run_with_fault(tmp_path, fault, timeout, strategy_kwargs=None, model_kwargs=None, world=2):
    """Start ``world`` ranks with ``fault``; wait (at most 120 s) for every rank but the victim. Returns
    ``{rank: (result or None, exit code, stderr)}`` for the survivors, and the processes."""
    from tests.parallel.harness import free_port
    tokens = make_tokens(str(tmp_path / "t.bin"))
    root = tmp_path / "r"
    root.mkdir()
    ctx = torch.multiprocessing.get_context("spawn")
    args = (tokens, str(root), model_kwargs or {}, strategy_kwargs or dict(expert_parallel_size=2), timeout, fault)
    port = free_port()
    procs = [ctx.Process(target=_logged_entry, args=(r, world, port, str(tmp_path), _train, args))
             for r in range(world)]
    for p in procs:
        p.start()
    survivors = [r for r in range(world) if r != fault[2]]
    deadline = time.time() + 120
    for r in survivors:
        procs[r].join(max(0.0, deadline - time.time()))
    ended_at = time.time()
    alive = [r for r in survivors if procs[r].is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    assert not alive, f"ranks {alive} hung instead of failing"
    out = {}
    for r in survivors:
        f = tmp_path / f"rank{r}.pt"
        result = torch.load(f, weights_only=False) if f.exists() else None  # our own test output
        assert result is None or result["ok"], f"rank {r} raised outside trainer.fit: {result['error']}"
        result = result and result["value"]
        assert result is None or result["error"] is not None, f"rank {r} finished training although a rank failed"
        out[r] = (result, procs[r].exitcode, (tmp_path / f"rank{r}.err").read_text())
    out["ended_at"] = ended_at
    return out, procs


def test_dead_rank_in_an_all_to_all_is_named_at_once(tmp_path):
    """SIGKILL of rank 1 while rank 0 waits in the dispatcher's all-to-all (EP=2): rank 0 fails at once, its error
    naming rank 1, a few heartbeat intervals later (0.5 s each here), not after the collective timeout."""
    out, procs = _run_with_fault(tmp_path, ("all_to_all", "kill", 1), timeout=12.0)
    res0, code0, err0 = out[0]
    assert procs[1].exitcode == -9 and code0 == 0 and res0["inside"] == ["all_to_all"], (res0, procs[1].exitcode)
    assert res0["error"].startswith("RuntimeError: [moe_fold rank 0] rank 1 is lost: its heartbeat stopped (its "
                                    "process or its host is gone). The collective's error: "), res0
    assert res0["elapsed"] < 6, res0  # well before the 12 s timeout (and lost_after, 6 s)
    assert "[moe_fold rank 0] rank 1 is lost" in err0


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "synchronous"])
def test_dead_store_host_in_a_pipeline_exchange_is_named(tmp_path, overlap):
    """SIGKILL of rank 0 (pipeline stage 0, and the host of the rendezvous store) inside a send while rank 1 waits
    for its activations: rank 1 fails at once, naming rank 0 (with the overlapped executor, the default, and the
    synchronous exchanges)."""
    out, procs = _run_with_fault(tmp_path, ("p2p", "kill", 0), timeout=12.0,
                                 strategy_kwargs=dict(pipeline_parallel_size=2, num_microbatches=2,
                                                      overlap_p2p_comm=overlap),
                                 model_kwargs=dict(num_layers=2))
    res1, code1, _ = out[1]
    assert procs[0].exitcode == -9 and res1["inside"] == ["p2p"], (res1, procs[0].exitcode)
    assert res1["error"].startswith("RuntimeError: [moe_fold rank 1] rank 0 is lost: the rendezvous store it hosts "
                                    "does not answer. The collective's error: "), res1
    assert res1["elapsed"] < 6, res1


@pytest.mark.slow
def test_frozen_rank_in_an_all_to_all_ends_the_others_before_the_timeout(tmp_path):
    """SIGSTOP of rank 1 inside the all-to-all, like a host that vanished: no socket closes, so gloo would wait for
    its 16 s timeout. The heartbeat watch ends rank 0 after lost_after = 8 s plus the grace, naming rank 1."""
    out, _ = _run_with_fault(tmp_path, ("all_to_all", "stop", 1), timeout=16.0)
    res0, code0, err0 = out[0]
    stopped_at = float((tmp_path / "r" / "stopped_at").read_text())
    assert res0 is None and code0 == 75, (res0, code0, err0[-2000:])
    assert "[moe_fold rank 0] rank 1 is lost: no heartbeat for 8 s (its process or its host is gone). This rank " \
           "stops now (exit code 75)" in err0, err0[-2000:]
    assert 8 <= out["ended_at"] - stopped_at < 16, out["ended_at"] - stopped_at


def test_hung_rank_fails_the_others_within_the_timeout(tmp_path):
    out, _ = _run_with_fault(tmp_path, ("batch_start", "hang", 1), timeout=5.0)
    res0 = out[0][0]
    assert 4.0 <= res0["elapsed"] < 40, res0  # the configured 5 s, not forever
    assert "RuntimeError" in res0["error"] or "DistBackendError" in res0["error"], res0
    assert "no rank is lost: every other rank still beats" in res0["error"], res0


def _router_inf_on_rank1(rank, world, tokens, root):
    import warnings

    from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
    from tests.strategy.test_nonfinite_guard import ROUTED, PoisonLogits
    cb = PoisonLogits([1, 3, 4] if rank == 1 else [], lambda obj, name, value: setattr(obj, name, value), layer=0)
    trainer = L.Trainer(accelerator="cpu", devices=world, max_steps=6, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=[cb],
                        strategy=MoEFoldStrategy(expert_parallel_size=2, skip_nonfinite_steps=2, timeout=30),
                        default_root_dir=root)
    lm = MoELanguageModel(preset="tiny", overrides=ROUTED, lr=1e-2, warmup_steps=1, seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(lm, datamodule=TokenDataModule(path=tokens, seq_length=16, batch_size=2, seed=1))
            error = None
        except RuntimeError as e:
            error = str(e)
    return {"error": error, "skipped": trainer.strategy.skipped_steps,
            "warnings": [str(w.message) for w in caught if "skipped" in str(w.message)],
            "router": [w["model.layers.0.ffn.router.weight"].tolist() for w in cb.weights],
            "biases": [[b.tolist() for b in step] for step in cb.biases]}


def test_router_inf_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """An infinite router logit on rank 1 only (EP=2, with a finite loss and gradient norm everywhere): both ranks
    skip the step together (the flags join the guard's one all-reduce), rank 0's warning names the layer on rank 1,
    the replicated router weight and expert biases stay equal across ranks and unchanged by the skipped steps, and
    two in a row stop both ranks at the same step."""
    res = run_ranks(_router_inf_on_rank1, 2, make_tokens(str(tmp_path / "t.bin")), str(tmp_path / "r"),
                    out_dir=str(tmp_path))
    for r in res:
        assert r["error"].startswith("MoEFoldStrategy(skip_nonfinite_steps=2): 2 optimizer steps in a row had a "
                                     "non-finite gradient norm or router logits"), r["error"]
        assert r["skipped"] == 3 and len(r["router"]) == 4  # steps 1, 3 and 4 skipped; 4 raised
    assert res[0]["warnings"][0].startswith("MoEFoldStrategy: step 1 skipped, the router logits of "
                                            "model.layers.0.ffn.router (rank 1) held a NaN or an infinity; its "
                                            "gradient norm is "), res[0]["warnings"]
    assert "nan" not in res[0]["warnings"][0] and len(res[0]["warnings"]) == 3
    assert res[0]["router"] == res[1]["router"] and res[0]["biases"] == res[1]["biases"]
    steps = res[0]["router"], res[0]["biases"]
    for seq in steps:
        assert seq[1] == seq[0] and seq[3] == seq[2] and seq[2] != seq[1]  # skipped at 1 and 3, stepped at 2


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
