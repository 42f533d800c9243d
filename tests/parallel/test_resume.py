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
    kw = dict(strategy_kw or {})
    precision = kw.pop("precision", "32-true")  # a Trainer argument, carried in the case's dict
    fp8 = kw.pop("fp8", None)  # FP8Training's arguments, carried alike
    if fp8 is not None:
        from lightning_moe import FP8Training
        callbacks.append(FP8Training(**fp8))
    strategy = MoEFoldStrategy(timeout=60, **kw) if strategy_kw is not None else "auto"
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                        precision=precision,
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
                                               (2, dict(pipeline_parallel_size=2, num_microbatches=2)),
                                               # bf16 weights and moments: the fp32 main weights and the bf16
                                               # moments are saved from their slices (half of them offloaded)
                                               (2, dict(expert_parallel_size=2, distributed_optimizer=True,
                                                        optimizer_cpu_offload=0.5, exp_avg_sq_dtype="bf16",
                                                        precision="bf16-true")),
                                               # the weights between steps hold their FP8 values, the checkpoint
                                               # the full ones: the GEMMs quantize either to the same bytes
                                               (2, dict(distributed_optimizer=True, precision="bf16-true",
                                                        fp8=dict(recipe="tensorwise", fp8_param_gather=True)))],
                         ids=["one_process", "moe_fold_ep2", "moe_fold_pp2", "moe_fold_ep2_dist_offload_bf16",
                              "moe_fold_dp2_fp8_param_gather"])
def test_resume_is_exact(tmp_path, world, strategy_kw):
    tokens = make_tokens(str(tmp_path / "tokens.bin"))
    for full, resumed in run_ranks(_resume, world, tokens, str(tmp_path), strategy_kw, out_dir=str(tmp_path / "o")):
        assert len(full) == 12 and len(resumed) == 6  # 2 micro-batches per step
        assert resumed == full[6:], f"resumed {resumed} != uninterrupted {full[6:]}"
        assert full[-1] < full[0]


def _reshard_resume(rank, world, tokens, root, source, source_batch, target, target_batch):
    _fit(world, tokens, f"{root}/first", 3, source, save=True, batch=source_batch)
    ckpt = sorted(glob.glob(f"{root}/first/*step=3*"))[-1]
    uninterrupted = _fit(world, tokens, f"{root}/full", 6, target, batch=target_batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = _fit(world, tokens, f"{root}/resumed", 6, target, ckpt=ckpt, batch=target_batch)
    return uninterrupted, resumed, any("starts afresh" in str(w.message) for w in caught)


EP2, TP2_EP2 = dict(expert_parallel_size=2), dict(tensor_parallel_size=2, expert_parallel_size=2)
PP2 = dict(pipeline_parallel_size=2, num_microbatches=2)
DIST = dict(distributed_optimizer=True)


# The same global batch: 4 samples per DP rank under EP2 folded over DP2, 8 under TP2 x EP2 and PP2 (DP1). PP2's
# first 3 steps differ from EP2's by float32 rounding that Adam (eps 1e-8) turns into ~lr moves of weights with
# near-zero gradients (see test_pp_parity.py): 2e-4 in the resumed losses. Restarted moments differ by 2e-2.
# The distributed optimizer writes its slices of the moments and step counts as blocks of the logical tensors: the
# checkpoint loads without it, onto another layout, and back (offloaded slices too).
@pytest.mark.parametrize("source,source_batch,target,target_batch,rel", [
    (EP2, 4, TP2_EP2, 8, 1e-5), (PP2, 8, EP2, 4, 1e-3),
    ({**EP2, **DIST}, 4, TP2_EP2, 8, 1e-5), (TP2_EP2, 8, {**EP2, **DIST, "optimizer_cpu_offload": 0.5}, 4, 1e-5),
    ({**EP2, **DIST, "optimizer_cpu_offload": 0.5}, 4, {**PP2, **DIST}, 8, 1e-3)],
    ids=["ep2_to_tp2_ep2", "pp2_to_ep2", "ep2_dist_to_tp2_ep2", "tp2_ep2_to_ep2_dist_offload",
         "ep2_dist_offload_to_pp2_dist"])
def test_resume_onto_another_layout(tmp_path, source, source_batch, target, target_batch, rel):
    """Weights, Adam's moments and step counts are resharded, and the step count, LR schedule and data position carry
    over: every resumed loss is the target layout's uninterrupted one (the two layouts differ only in float32
    rounding). Moments that restarted would move every weight by ~lr at step 4 and show at steps 5-6."""
    tokens = make_tokens(str(tmp_path / "tokens.bin"))
    results = run_ranks(_reshard_resume, 2, tokens, str(tmp_path), source, source_batch, target, target_batch,
                        out_dir=str(tmp_path / "o"))
    for uninterrupted, resumed, warned in results:
        assert len(resumed) == 6  # steps 4-6, two micro-batches each
        assert resumed == pytest.approx(uninterrupted[6:], rel=rel), (resumed, uninterrupted[6:])
        assert not warned
