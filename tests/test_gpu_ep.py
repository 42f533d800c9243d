"""Two GPUs (skipped with fewer): whole EP2 Trainer steps with no host-device sync on the sync-free DeepEP dispatch.

``torch.cuda.set_sync_debug_mode`` flags every synchronising CUDA call once the steps are warm. The dropless
``alltoall`` dispatcher copies its split sizes to the host once per layer, which the same watch must see (so the
watch works); ``deepep`` with ``sync_free_dispatch`` must show none anywhere in the step.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.parallel.harness import run_ranks
from tests.test_gpu import OVR

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 GPUs")]


def _steps(rank, world, tokens, model_overrides):
    import traceback
    import warnings

    import lightning as L

    from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 3:  # warm: the first steps allocate and build the optimizer state
                torch.cuda.set_sync_debug_mode("warn")

        def on_train_end(self, trainer, pl_module):
            torch.cuda.set_sync_debug_mode(0)

    trainer = L.Trainer(accelerator="gpu", devices=world, strategy=MoEFoldStrategy(expert_parallel_size=world),
                        precision="bf16-true", max_steps=6, gradient_clip_val=1.0, logger=False,
                        limit_val_batches=0, callbacks=[Watch()], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    model = MoELanguageModel(preset="tiny", overrides={**OVR, **model_overrides}, log_expert_load=False)
    syncs = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):  # where it came from: the innermost frames
            if any("set_sync_debug_mode" in f.line for f in traceback.extract_stack() if f.line):
                return  # the watch switching itself on
            frames = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno}" for f in traceback.extract_stack()[:-1]]
            syncs.append(" <- ".join(reversed(frames[-6:])))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        trainer.fit(model, datamodule=TokenDataModule(path=tokens, seq_length=256, batch_size=2))
    torch.cuda.set_sync_debug_mode(0)
    return {"syncs": sorted(set(syncs)), "steps": trainer.global_step}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    import numpy as np

    from lightning_moe.data import write_tokens
    path = tmp_path_factory.mktemp("ep") / "t.bin"
    return write_tokens(str(path), np.random.default_rng(0).integers(0, 512, 80000), "uint16")


def test_alltoall_dispatch_syncs_once_per_layer(tokens, tmp_path):
    out = run_ranks(_steps, 2, tokens, dict(dispatcher="alltoall", load_balancing="global_aux_loss"),
                    out_dir=str(tmp_path))
    for r in out:
        print("SYNCS alltoall", r["syncs"])
        assert r["steps"] == 6
        assert any("dispatchers.py" in s for s in r["syncs"]), r["syncs"]  # the watch sees the split-size copy


@pytest.mark.skipif(importlib.util.find_spec("deep_ep") is None, reason="needs DeepEP (benchmarks/build_deepep.sh)")
def test_deepep_sync_free_step_has_no_host_sync(tokens, tmp_path):
    out = run_ranks(_steps, 2, tokens, dict(dispatcher="deepep", sync_free_dispatch=True,
                                             load_balancing="global_aux_loss"), out_dir=str(tmp_path))
    for r in out:
        print("SYNCS deepep sync-free", r["syncs"])
        assert r["steps"] == 6
        assert r["syncs"] == [], r["syncs"]
