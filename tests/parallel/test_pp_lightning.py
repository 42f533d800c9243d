"""Pipeline parallelism inside Lightning's loop: logging from the last stage, validation with the forward-only
schedule, checkpoint callbacks, and the bubble reported to the throughput callback (2 gloo ranks, PP=2, 1F1B)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from tests.parallel.harness import run_ranks
from tests.parallel.parity import make_tokens

MODEL = dict(preset="tiny", overrides=dict(seq_length=32, num_layers=4, hidden_size=32, num_attention_heads=4,
                                           num_kv_heads=2, ffn_hidden_size=64, moe_ffn_hidden_size=32, num_experts=8,
                                           topk=2),
             lr=1e-2, warmup_steps=1, max_steps=4, seed=7, log_expert_load=False)
M = 4  # micro-batches of 2 samples; the reference accumulates the same 4 micro-batches


class StepLoss(L.Callback):
    """The mean LM loss of each optimizer step, from training_step outputs."""

    def __init__(self):
        self.steps, self._acc = [], 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._acc += float(outputs["lm_loss"]) / trainer.accumulate_grad_batches
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.steps.append(self._acc)
            self._acc = 0.0


def _run(rank, world, tokens, root):
    from lightning_moe import MoEFoldStrategy, MoELanguageModel, MoEThroughput, TokenDataModule
    from lightning_moe.callbacks.expert_load import ExpertLoadMonitor
    L.seed_everything(0, verbose=False)
    parallel = world > 1
    strategy = (MoEFoldStrategy(pipeline_parallel_size=2, num_microbatches=M, timeout=60, overlap_p2p_comm=True)
                if parallel else "auto")
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(Path(root) / "ckpt"), every_n_train_steps=2,
                                               save_top_k=-1)
    losses, tput = StepLoss(), MoEThroughput(log_every_n_steps=2, warmup_steps=0, prog_bar=False)
    load = ExpertLoadMonitor(every_n_steps=2, log_histogram=False)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=4,
                        accumulate_grad_batches=1 if parallel else M, gradient_clip_val=0.5, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                        callbacks=[losses, load, ckpt, tput] if parallel else [losses, load],
                        enable_checkpointing=parallel,
                        limit_val_batches=2, val_check_interval=2, num_sanity_val_steps=1)
    model = MoELanguageModel(**MODEL)
    trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=32, batch_size=8 // M * (M if parallel
                                                                                                   else 1), seed=3))
    out = {"train_loss_logged": float(trainer.callback_metrics["train_loss"]), "steps": losses.steps,
           "load": {k: float(v) for k, v in load.last_metrics.items()}}
    if parallel:
        out["timing"] = trainer.strategy.pipeline_timing()
    val_dm = TokenDataModule(path=tokens, seq_length=32, batch_size=8, seed=3)
    out["val_loss"] = trainer.validate(model, datamodule=val_dm, verbose=False)[0]["val_loss"]
    if parallel:
        out["history"] = [{k: h[k] for k in ("pipeline_bubble_fraction", "pipeline_ideal_bubble_fraction")}
                          for h in tput.history]
        out["ckpts"] = sorted(p.name for p in (Path(root) / "ckpt").iterdir())
        # a fresh model restored from the last checkpoint validates to the same loss
        fresh = L.Trainer(accelerator="cpu", devices=world, logger=False, enable_progress_bar=False,
                          strategy=MoEFoldStrategy(pipeline_parallel_size=2, num_microbatches=M, timeout=60),
                          limit_val_batches=2, enable_model_summary=False)
        restored = MoELanguageModel(**{**MODEL, "seed": 99})
        last = str(Path(root) / "ckpt" / out["ckpts"][-1])
        out["val_loss_restored"] = fresh.validate(restored, datamodule=val_dm, ckpt_path=last,
                                                  verbose=False)[0]["val_loss"]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp_lightning")
    tokens = make_tokens(str(root / "tokens.bin"))
    ref = run_ranks(_run, 1, tokens, str(root / "ref"), out_dir=str(root / "r1"))[0]
    pp = run_ranks(_run, 2, tokens, str(root / "pp"), out_dir=str(root / "r2"))
    return ref, pp


def test_losses_logged_from_the_last_stage_on_every_rank(runs):
    ref, pp = runs
    for r in pp:  # rank 0 holds the first stage; the loss it logs came from rank 1 through the pp all-reduce
        torch.testing.assert_close(torch.tensor(r["steps"]), torch.tensor(ref["steps"]), rtol=1e-5, atol=0)
        assert r["train_loss_logged"] == pytest.approx(ref["steps"][-1], rel=1e-5)
    assert ref["steps"][-1] < ref["steps"][0]


def test_expert_load_of_every_stage_and_micro_batch_on_every_rank(runs):
    """Rank 0 (first stage) logs the last stage's layers too, and the counts are those of all 4 micro-batches: the
    same numbers as the 1-process run accumulating the same micro-batches."""
    ref, pp = runs
    assert {k.split("/")[1] for k in ref["load"] if k.count("/") == 2} == {f"layer{i}" for i in range(4)}
    for r in pp:
        assert r["load"].keys() == ref["load"].keys()
        for k, v in ref["load"].items():
            assert r["load"][k] == pytest.approx(v, rel=1e-6), k


def test_validation_runs_the_forward_only_schedule(runs):
    ref, pp = runs
    for r in pp:
        assert r["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-5)


def test_checkpoint_callback_saves_each_stage_and_restores(runs):
    _, pp = runs
    for r in pp:
        assert r["ckpts"] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
        assert r["val_loss_restored"] == pytest.approx(r["val_loss"], rel=1e-6)


def test_bubble_reported_to_the_throughput_callback(runs):
    _, pp = runs
    for r in pp:
        t = r["timing"]
        assert t["ideal_bubble_fraction"] == pytest.approx(1 / 5)  # (pp - 1) / (m + pp - 1)
        # the overlapped transfers allow the schedule's bubble; the synchronous 1F1B's allow 1/2
        assert t["overlap_p2p"] is True and t["plan_bubble_fraction"] == pytest.approx(1 / 5)
        assert 0.0 < t["bubble_fraction"] < 1.0 and 0 < t["busy_s"] < t["wall_s"]
        assert r["history"] and all(h["pipeline_bubble_fraction"] is not None for h in r["history"])
        assert all(h["pipeline_ideal_bubble_fraction"] == pytest.approx(0.2) for h in r["history"])
