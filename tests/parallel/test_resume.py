"""Exact resume: a run stopped by a checkpoint at step 3 and resumed with ``fit(ckpt_path=...)`` gives bit-identical
losses for steps 4-6 (data position mid-epoch, LR schedule, optimizer, expert bias, global aux-loss window), on one
process and through MoEFoldStrategy's sharded checkpoints with EP2 and with PP2."""

from __future__ import annotations

import glob
import warnings

import lightning as L
import pytest

from tests.parallel.harness import run_ranks
from tests.parallel.parity import make_tokens

MODEL = dict(seq_length=32, num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
             ffn_hidden_size=64, moe_ffn_hidden_size=32, num_experts=8, topk=2, expert_bias=True,
             score_function="sigmoid", load_balancing="global_aux_loss", z_loss_coeff=1e-3)


class Losses(L.Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(outputs["loss"]))


def _fit(world, tokens, root, steps, strategy_kw, ckpt=None, save=False, batch=4):
    from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
    L.seed_everything(0, verbose=False)
    losses = Losses()
    callbacks = [losses]
    if save:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_top_k=-1))
    strategy = MoEFoldStrategy(timeout=60, **strategy_kw) if strategy_kw is not None else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=callbacks, enable_checkpointing=save, default_root_dir=root,
                        accumulate_grad_batches=2, gradient_clip_val=0.5)
    model = MoELanguageModel(preset="tiny", overrides=MODEL, lr=1e-2, warmup_steps=2, max_steps=6, seed=7)
    trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=32, batch_size=batch, seed=3), ckpt_path=ckpt)
    return losses.values


def _resume(rank, world, tokens, root, strategy_kw):
    full = _fit(world, tokens, f"{root}/full", 6, strategy_kw)
    _fit(world, tokens, f"{root}/first", 3, strategy_kw, save=True)
    ckpt = sorted(glob.glob(f"{root}/first/*step=3*"))[-1]
    resumed = _fit(world, tokens, f"{root}/resumed", 6, strategy_kw, ckpt=ckpt)
    return full, resumed


@pytest.mark.parametrize("world,strategy_kw", [(1, None), (2, dict(expert_parallel_size=2)),
                                               (2, dict(pipeline_parallel_size=2, num_microbatches=2))],
                         ids=["one_process", "moe_fold_ep2", "moe_fold_pp2"])
def test_resume_is_exact(tmp_path, world, strategy_kw):
    tokens = make_tokens(str(tmp_path / "tokens.bin"))
    for full, resumed in run_ranks(_resume, world, tokens, str(tmp_path), strategy_kw, out_dir=str(tmp_path / "o")):
        assert len(full) == 12 and len(resumed) == 6  # 2 micro-batches per step
        assert resumed == full[6:], f"resumed {resumed} != uninterrupted {full[6:]}"
        assert full[-1] < full[0]


def _reshard_resume(rank, world, tokens, root):
    # written under EP2 folded over DP2 (4 samples per rank), resumed under TP2 x EP2 (DP1, 8 samples): same global batch
    source, target = dict(expert_parallel_size=2), dict(tensor_parallel_size=2, expert_parallel_size=2)
    _fit(world, tokens, f"{root}/first", 3, source, save=True)
    ckpt = sorted(glob.glob(f"{root}/first/*step=3*"))[-1]
    uninterrupted = _fit(world, tokens, f"{root}/full", 6, target, batch=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _fit(world, tokens, f"{root}/resumed", 6, target, ckpt=ckpt, batch=8)
    return uninterrupted, resumed, any("optimizer moments start afresh" in str(w.message) for w in caught)


def test_resume_onto_another_layout(tmp_path):
    """The weights are resharded (the first resumed step's losses are the target layout's uninterrupted ones, which
    see the same step-3 weights), the step count, LR schedule and data position carry over."""
    tokens = make_tokens(str(tmp_path / "tokens.bin"))
    results = run_ranks(_reshard_resume, 2, tokens, str(tmp_path), out_dir=str(tmp_path / "o"))
    for uninterrupted, resumed, _ in results:
        assert len(resumed) == 6  # steps 4-6, two micro-batches each
        assert resumed[:2] == pytest.approx(uninterrupted[6:8], rel=1e-5)
    assert results[0][2], "rank 0 did not warn that the optimizer moments start afresh"
