"""``MoEFoldStrategy(skip_nonfinite_steps=N)``: a step whose global gradient norm is NaN or infinite, or whose router
logits held a NaN or an infinity, is skipped (the weights, the optimizer state and the expert biases stay as they
were, with or without clipping), training goes on, and N such steps in a row stop the run with an error. Without the
guard the NaN reaches the weights, and non-finite router logits stop the run naming the layer; either way the expert
bias never takes such a step."""

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


def _fit(tmp_path, poison, steps=5, clip=None, cb=None, **strategy):
    from tests.parallel.parity import make_tokens
    cb = cb or _Poison(poison)
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
    cb = _Poison([1])
    with pytest.raises(RuntimeError, match=r"the router logits of model.layers.0.ffn.router \(rank 0\) held a NaN or "
                                           r"an infinity at step 2"):
        _fit(tmp_path, poison=[1], cb=cb)  # without the guard the NaN reaches the weights; the next step stops
    assert len(cb.weights) == 2 and not all(torch.isfinite(w).all() for w in cb.weights[-1].values())
    with pytest.raises(ValueError, match="skip_nonfinite_steps must be a positive integer or None, got 0"):
        MoEFoldStrategy(skip_nonfinite_steps=0)
    with pytest.raises(ValueError, match="does not work with distributed_optimizer=True yet"):
        MoEFoldStrategy(skip_nonfinite_steps=2, distributed_optimizer=True)


# ---------------------------------------------------------------------------------------------- router logits
ROUTED = dict(MODEL, num_layers=2, score_function="sigmoid", expert_bias=True, bias_update_rate=0.01,
              z_loss_coeff=0.0)


def test_nonfinite_logits_never_move_the_expert_bias():
    """The router counts micro-batches with a NaN or an infinity in its logits (on the device); the bias update then
    keeps the bias, and resets the flag with the counts; the next finite step moves it again."""
    from lightning_moe import ModelConfig
    from lightning_moe.modules.router import TopKRouter, updated_expert_bias
    router = TopKRouter(ModelConfig(hidden_size=8, num_experts=4, topk=2, score_function="sigmoid",
                                    expert_bias=True, bias_update_rate=0.5)).train()
    x = torch.randn(6, 8)
    router(x, 1)
    router.update_expert_bias()
    before = router.expert_bias.clone()
    assert before.abs().sum() > 0 and router.nonfinite_logits.item() == 0
    for poison in (float("nan"), float("inf")):
        bad = x.clone()
        bad[2, 3] = poison
        router(x, 1), router(bad, 1)
        assert router.nonfinite_logits.item() == 1 and router.local_tokens_per_expert.sum().item() == 24
        router.update_expert_bias()
        assert torch.equal(router.expert_bias, before)
        assert router.nonfinite_logits.item() == 0 and router.local_tokens_per_expert.sum().item() == 0
    with torch.no_grad():
        router(bad, 1)  # not training: not counted
    router(x, 1)
    expected = updated_expert_bias(before, router.local_tokens_per_expert, 0.5)
    router.update_expert_bias()
    assert torch.equal(router.expert_bias, expected) and not torch.equal(expected, before)


class PoisonLogits(L.Callback):
    """At the given steps, layer ``layer``'s router logit (token 0, expert 0) becomes +inf in training: sigmoid
    scoring turns it into a finite gate with a zero gradient, so the loss and the gradient norm stay finite and only
    the router's own check sees it. ``patch(module, name, value)`` sets an attribute (``monkeypatch.setattr``).
    Records every step's weights and expert biases."""

    def __init__(self, steps, patch, layer=1):
        self.steps, self.patch, self.layer, self.weights, self.biases = set(steps), patch, layer, [], []

    def on_fit_start(self, trainer, pl_module):
        from lightning_moe.modules import router
        target, original, steps = pl_module.model.layers[self.layer].ffn.router.weight, router.router_logits, self.steps

        def poisoned(x, w, *args):  # router.router_logits, but for the target router's logits
            out = original(x, w, *args)
            if w is target and pl_module.training and trainer.global_step in steps:
                bump = torch.zeros_like(out)
                bump[0, 0] = float("inf")
                out = out + bump
            return out
        self.patch(router, "router_logits", poisoned)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.weights.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})
        self.biases.append([layer.ffn.router.expert_bias.clone() for layer in pl_module.model.layers])


def _fit_routed(tmp_path, cb, steps=4, **strategy):
    from tests.parallel.parity import make_tokens
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MoEFoldStrategy(**strategy), max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[cb],
                        default_root_dir=str(tmp_path))
    cb.lm = MoELanguageModel(preset="tiny", overrides=ROUTED, lr=1e-2, warmup_steps=1, seed=1)
    trainer.fit(cb.lm, datamodule=TokenDataModule(path=make_tokens(str(tmp_path / "t.bin")), seq_length=16,
                                                  batch_size=2, seed=1))
    return trainer


def test_nonfinite_router_logits_skip_the_step_with_the_guard(tmp_path, monkeypatch):
    """An infinite logit in layer 1 at step 2, with a finite loss and gradient norm: the guard still skips the step
    (the weights and every expert bias unchanged, though layer 0's routing was finite and its bias update ran),
    names the layer, and training goes on; two in a row stop it."""
    cb = PoisonLogits([2], monkeypatch.setattr)
    with pytest.warns(UserWarning, match=r"step 2 skipped, the router logits of model.layers.1.ffn.router \(rank 0\) "
                                         r"held a NaN or an infinity; its gradient norm is \d+\.\d+ \(1 in a row, 1 "
                                         r"in all\)"):
        trainer = _fit_routed(tmp_path, cb, skip_nonfinite_steps=2)
    assert trainer.global_step == 4 and trainer.strategy.skipped_steps == 1
    assert all(torch.equal(cb.weights[2][n], cb.weights[1][n]) for n in cb.weights[2])
    assert all(torch.equal(a, b) for a, b in zip(cb.biases[2], cb.biases[1]))
    for step in (1, 3):  # the others step, and move both biases
        assert not any(torch.equal(cb.weights[step][n], cb.weights[step - 1][n]) for n in cb.weights[step])
        assert all(not torch.equal(a, b) for a, b in zip(cb.biases[step], cb.biases[step - 1]))
    with pytest.raises(RuntimeError, match=r"2 optimizer steps in a row had a non-finite gradient norm or router "
                                           r"logits"):
        _fit_routed(tmp_path, PoisonLogits([1, 2], monkeypatch.setattr), skip_nonfinite_steps=2)


def test_nonfinite_router_logits_stop_the_run_without_the_guard(tmp_path, monkeypatch):
    """Without the guard the run stops at that step with one error naming the layer, before the step's update: the
    weights and the expert biases are those of the step before. Unpoisoned, the same run trains through."""
    cb = PoisonLogits([2], monkeypatch.setattr)
    with pytest.raises(RuntimeError, match=r"the router logits of model.layers.1.ffn.router \(rank 0\) held a NaN or "
                                           r"an infinity at step 2, stopping before its optimizer step; the expert "
                                           r"bias kept its value"):
        _fit_routed(tmp_path, cb)
    assert len(cb.weights) == 2
    assert all(torch.equal(p, cb.weights[1][n]) for n, p in cb.lm.named_parameters())
    assert all(torch.equal(layer.ffn.router.expert_bias, b) for layer, b in zip(cb.lm.model.layers, cb.biases[1]))
    trainer = _fit_routed(tmp_path / "ok", cb := PoisonLogits([], monkeypatch.setattr))
    assert trainer.global_step == 4 and all(torch.isfinite(w).all() for w in cb.weights[-1].values())
