"""``MoEFoldStrategy(manual_gc=N)`` (``strategy/manual_gc.py``): Python's automatic garbage collector off while
training runs, a full collection every N optimizer steps (counted through ``gc.callbacks``), the collector and the
frozen objects given back when training ends or fails, and bad values refused."""

from __future__ import annotations

import gc

import lightning as L
import pytest

from lightning_moe import MoEFoldStrategy, MoELanguageModel, TokenDataModule
from lightning_moe.strategy.manual_gc import ManualGC
from tests.parallel.parity import make_tokens

MODEL = dict(seq_length=32, num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
             moe_ffn_hidden_size=32, num_experts=4, topk=2)


class _FullCollections:
    """Counts full (generation 2) collections while installed."""

    def __init__(self):
        self.count = 0

    def __call__(self, phase, info):
        if phase == "start" and info["generation"] == 2:
            self.count += 1

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def test_collects_every_interval_steps_and_gives_the_collector_back():
    assert gc.isenabled()
    m = ManualGC(2)
    with _FullCollections() as full:
        m.start()
        assert not gc.isenabled() and gc.get_freeze_count() > 0 and full.count == 1  # the one before the freeze
        for step in range(1, 6):
            m.step()
            assert full.count == 1 + step // 2
        m.stop()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    m.stop()  # twice: nothing more


def test_interval_zero_never_collects_and_a_disabled_collector_stays_off():
    gc.disable()
    try:
        m = ManualGC(0)
        with _FullCollections() as full:
            m.start()
            for _ in range(5):
                m.step()
            m.stop()
        assert full.count == 1 and not gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.enable()


def _frozen(obj) -> bool:
    """Whether the collector tracks ``obj`` in its permanent generation (``gc.freeze``): no generation lists it."""
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())


def test_objects_frozen_before_stay_frozen():
    # checked on one object: the frozen count alone can drop while the test runs (frozen objects still die by
    # reference count, e.g. released by another thread), which once failed this test on a loaded CI host
    sentinel = [[]]
    gc.freeze()
    try:
        assert _frozen(sentinel)
        m = ManualGC(1)
        m.start()
        assert not gc.isenabled() and _frozen(sentinel)
        m.step()
        m.stop()
        assert gc.isenabled() and _frozen(sentinel)
    finally:
        gc.unfreeze()
        gc.enable()
    assert not _frozen(sentinel)  # the check itself can tell


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
def test_bad_values_are_refused(bad):
    with pytest.raises(ValueError, match="manual_gc must be None"):
        MoEFoldStrategy(manual_gc=bad)


class _Watch(L.Callback):
    def __init__(self, full: _FullCollections, fail_at: int = -1):
        self.full, self.fail_at = full, fail_at
        self.enabled, self.full_before_step = [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.enabled.append(gc.isenabled())
        self.full_before_step.append(self.full.count)
        if batch_idx == self.fail_at:
            raise RuntimeError("boom")


def _fit(tmp_path, interval, fail_at=-1):
    model = MoELanguageModel(preset="tiny", overrides=MODEL, log_expert_load=False)
    with _FullCollections() as full:
        watch = _Watch(full, fail_at)
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy=MoEFoldStrategy(manual_gc=interval), max_steps=5,
                            accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                            limit_val_batches=0, callbacks=[watch])
        trainer.fit(model, datamodule=TokenDataModule(path=make_tokens(str(tmp_path / "t.bin")), seq_length=32,
                                                      batch_size=4))
    return watch, full


def test_trainer_runs_with_the_collector_off_and_collects_every_n_steps(tmp_path):
    watch, full = _fit(tmp_path, 2)
    assert watch.enabled == [False] * 10  # 5 optimizer steps of 2 micro-batches
    start = watch.full_before_step[0]  # the collection before the freeze (and any before training)
    # micro-batch i starts after i // 2 optimizer steps: one more full collection after steps 2 and 4
    assert [c - start for c in watch.full_before_step] == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_a_failed_run_gives_the_collector_back(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        _fit(tmp_path, 2, fail_at=3)
    assert gc.isenabled() and gc.get_freeze_count() == 0
