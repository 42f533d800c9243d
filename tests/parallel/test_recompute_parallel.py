"""Recompute on folded layouts (gloo): with TP2·EP2 (sequence parallel), CP2 and PP2, each rank's losses, gradients and
final weights and buffers are the same with and without recomputation, bit for bit. The replays run the dispatcher's
all-to-all, the CP K/V exchange and the TP collectives again, in backward, on every rank in the same order."""

from __future__ import annotations

import pytest

from tests.parallel.harness import run_ranks
from tests.parallel.parity import make_tokens

MODEL = dict(seq_length=32, num_layers=4, hidden_size=32, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
             moe_ffn_hidden_size=32, num_experts=8, topk=2, first_k_dense=1, shared_expert_ffn_size=32,
             score_function="sigmoid", expert_bias=True, bias_update_rate=1e-2, z_loss_coeff=1e-3)
# the Qwen3 q/k norms: "layernorm" without "core_attn" also rebuilds their rotated outputs (attention's q and k)
SETTINGS = [["core_attn", "layernorm", "moe_act", "shared_experts", "mlp"], ["layernorm", "moe_act"], ["moe"],
            ["full"]]


def _worker(rank, world, tokens, root, strategy_kw, model):
    import lightning as L
    import torch

    from lightning_moe import MoEFoldStrategy, MoELanguageModel, Recompute, TokenDataModule
    from tests.callbacks.test_recompute import _Record

    def fit(modules):
        L.seed_everything(0, verbose=False)
        rec = _Record()
        callbacks = [rec] + ([Recompute(modules)] if modules else [])
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=MoEFoldStrategy(timeout=60, **strategy_kw),
                            max_steps=2, accumulate_grad_batches=2, gradient_clip_val=0.5, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=0, callbacks=callbacks, default_root_dir=root)
        lm = MoELanguageModel(preset="tiny", overrides=model, lr=1e-2, warmup_steps=1, seed=3)
        trainer.fit(lm, datamodule=TokenDataModule(path=tokens, seq_length=32, batch_size=4, seed=3))
        return rec.losses, rec.grads, {n: t.detach().clone() for n, t in lm.state_dict().items()}

    ref = fit(None)
    out = {}
    for modules in SETTINGS:
        losses, grads, state = fit(modules)
        out["+".join(modules)] = (losses == ref[0], all(torch.equal(grads[k], v) for k, v in ref[1].items()),
                                  all(torch.equal(state[k], v) for k, v in ref[2].items()))
    return out


@pytest.mark.parametrize("world,strategy_kw,model", [
    (4, dict(tensor_parallel_size=2, expert_parallel_size=2), dict(MODEL, load_balancing="global_aux_loss",
                                                                   qk_norm=True)),
    (2, dict(context_parallel_size=2), dict(MODEL, load_balancing="global_aux_loss", qk_norm=True)),
    # interleaved 1F1B over 4 micro-batches: the router's replays of the global aux-loss window come back in order
    (2, dict(pipeline_parallel_size=2, virtual_pipeline_size=2, num_microbatches=4),
     dict(MODEL, load_balancing="global_aux_loss")),
], ids=["tp2_ep2", "cp2", "pp2_vpp2"])
def test_recompute_parallel_is_bit_identical(tmp_path, world, strategy_kw, model):
    tokens = make_tokens(str(tmp_path / "t.bin"))
    for rank, res in enumerate(run_ranks(_worker, world, tokens, str(tmp_path), strategy_kw, model,
                                         out_dir=str(tmp_path / "o"))):
        for name, (losses, grads, state) in res.items():
            assert losses and grads and state, f"rank {rank}, {name}: losses {losses} grads {grads} state {state}"
