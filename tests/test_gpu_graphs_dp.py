"""Two GPUs (skipped with fewer): ``MoEFoldStrategy(cuda_graphs=True)`` under data parallelism with the distributed
optimizer, against the same run without graphs.

The graphs replay each block; the gradients' reduce-scatter runs in the hooks around the replays, the parameters'
all-gather after each step is waited for before the first replay (the blocks' forward pre-hooks do not run in a
replay), and FP8Training's cached weights are rewritten after that wait. Each rank's losses and final weights must be
the eager run's.
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel.harness import run_ranks
from tests.test_gpu import OVR

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 GPUs")]


def _fit(rank, world, tokens, graphs, fp8, defer):
    import lightning as L

    from lightning_moe import FP8Training, MoEFoldStrategy, MoELanguageModel, TokenDataModule
    losses, sizes, graphed = [], [], []

    class Rec(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["lm_loss"].detach().float().cpu())
            graphed.append("forward" in vars(pl_module.model.layers[1]))

        def on_train_end(self, trainer, pl_module):  # before the graphs are released
            sizes.extend(c.size for c in trainer.strategy._grad_sync._copies.values())

    callbacks = [FP8Training("rowwise", fp8_wgrad=not defer, defer_expert_wgrad=defer)] if fp8 else []
    strategy = MoEFoldStrategy(cuda_graphs=graphs, distributed_optimizer=True,
                               defer_expert_wgrad=defer and not fp8)
    trainer = L.Trainer(accelerator="gpu", devices=world, strategy=strategy, precision="bf16-true", max_steps=5,
                        accumulate_grad_batches=3, gradient_clip_val=1.0, logger=False, limit_val_batches=0,
                        num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks + [Rec()])
    ovr = {**OVR, "num_layers": 3, "first_k_dense": 1, "shared_expert_ffn_size": 256}
    model = MoELanguageModel(preset="tiny", overrides=ovr, seed=3, lr=3e-3, warmup_steps=1)
    trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=256, batch_size=2))
    state = {k: v.detach().float().cpu() for k, v in model.model.state_dict().items()}
    return {"losses": torch.stack(losses), "state": state, "steps": trainer.global_step, "copies": sizes,
            "graphed": graphed}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    import numpy as np

    from lightning_moe.data import write_tokens
    path = tmp_path_factory.mktemp("graphs_dp") / "t.bin"
    return write_tokens(str(path), np.random.default_rng(0).integers(0, 512, 120000), "uint16")


@pytest.mark.parametrize("fp8,defer", [(False, False), (False, True), (True, True)], ids=["bf16", "bf16_defer",
                                                                                        "fp8_defer"])
def test_cuda_graphs_with_the_distributed_optimizer_match_eager(tokens, tmp_path, fp8, defer):
    eager = run_ranks(_fit, 2, tokens, False, fp8, defer, out_dir=str(tmp_path / "eager"))
    graphs = run_ranks(_fit, 2, tokens, True, fp8, defer, out_dir=str(tmp_path / "graphs"))
    for rank, (e, g) in enumerate(zip(eager, graphs)):
        assert e["steps"] == g["steps"] == 5 and len(g["losses"]) == 15
        assert all(g["graphed"]) and not any(e["graphed"])
        assert set(g["copies"]) == ({3} if defer else set()) and not e["copies"]  # a graph copy per micro-batch
        diff = (g["losses"] - e["losses"]).abs().max().item()
        worst = max(((g["state"][k] - v).norm() / v.norm().clamp_min(1e-12)).item() for k, v in e["state"].items())
        print(f"rank {rank} fp8={fp8} defer={defer}: max |loss diff| {diff:.3g}, worst param rel-norm diff {worst:.3g}")
        torch.testing.assert_close(g["losses"], e["losses"], rtol=2e-3, atol=0)
        assert worst < 2e-2, worst
    # the ranks saw different data, and the distributed optimizer gathered the same weights on both
    assert not torch.equal(graphs[0]["losses"], graphs[1]["losses"])
    for k, v in graphs[0]["state"].items():
        assert torch.equal(v, graphs[1]["state"][k]), k
