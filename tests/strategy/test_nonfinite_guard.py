"""``MoEFoldStrategy(skip_nonfinite_steps=N)``: a step whose global gradient norm is NaN or infinite is skipped (the
weights and the optimizer state stay as they were, with or without clipping), training goes on, and N such steps in
a row stop the run with an error. Without the guard the NaN reaches the weights (the test can fail)."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule

MODEL = dict(seq_length=16, num_layers=1, hidden_size=32, num_attention_heads=2, num_kv_heads=2, ffn_hidden_size=64,
             moe_ffn_hidden_size=32, num_experts=4, topk=2)


class _Poison(L.Callback):
    """NaN into one gradient at the given steps; records the weights after every step."""

    def __init__(self, steps):
        self.steps, self.weights = set(steps), []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step in self.steps:
            next(p for p in pl_module.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.weights.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})


def _fit(tmp_path, poison, steps=5, clip=None, **strategy):
    from tests.parallel.parity import make_tokens
    cb = _Poison(poison)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MoEFoldStrategy(**strategy), max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, gradient_clip_val=clip, callbacks=[cb],
                        default_root_dir=str(tmp_path))
    lm = MoELanguageModel(preset="tiny", overrides=MODEL, lr=1e-2, warmup_steps=1, seed=1)
    trainer.fit(lm, datamodule=TokenDataModule(path=make_tokens(str(tmp_path / "t.bin")), seq_length=16,
                                               batch_size=2, seed=1))
    return trainer, cb


@pytest.mark.parametrize("clip", [None, 1.0], ids=["no_clip", "clip"])
def test_nonfinite_steps_are_skipped(tmp_path, clip):
    trainer, cb = _fit(tmp_path, poison=[1, 3], clip=clip, skip_nonfinite_steps=2)
    assert trainer.global_step == 5 and trainer.strategy.skipped_steps == 2
    for step in (1, 3):  # the weights after a skipped step are those before it
        assert all(torch.equal(cb.weights[step][n], cb.weights[step - 1][n]) for n in cb.weights[step])
    assert not all(torch.equal(cb.weights[2][n], cb.weights[1][n]) for n in cb.weights[2])  # the others step
    assert all(torch.isfinite(w).all() for w in cb.weights[-1].values())


def test_too_many_in_a_row_stop_the_run(tmp_path):
    with pytest.raises(RuntimeError, match=r"skip_nonfinite_steps=2\): 2 optimizer steps in a row had a non-finite "
                                           r"gradient norm"):
        _fit(tmp_path, poison=[2, 3], skip_nonfinite_steps=2)
    _, cb = _fit(tmp_path, poison=[1])  # without the guard the NaN reaches the weights
    assert not all(torch.isfinite(w).all() for w in cb.weights[-1].values())
    with pytest.raises(ValueError, match="skip_nonfinite_steps must be a positive integer or None, got 0"):
        MoEFoldStrategy(skip_nonfinite_steps=0)
    with pytest.raises(ValueError, match="does not work with distributed_optimizer=True yet"):
        MoEFoldStrategy(skip_nonfinite_steps=2, distributed_optimizer=True)
