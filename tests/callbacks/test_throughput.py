"""MoEThroughput on a tiny CPU run: windows, token counts, tokens/s against independent timestamps, TFLOPS/MFU."""

from __future__ import annotations

import time

import lightning as L
import pytest

from lightning_moe import MoELanguageModel, TokenDataModule
from lightning_moe.callbacks.throughput import MoEThroughput
from lightning_moe.flops import training_flops_per_token

SEQ, BATCH = 32, 4
TINY = dict(seq_length=SEQ, hidden_size=32, num_layers=2, num_attention_heads=4, num_kv_heads=2, ffn_hidden_size=64,
            moe_ffn_hidden_size=32)




class StepClock(L.Callback):
    """Independent timestamps: perf_counter at the first micro-batch start of each optimizer step."""

    def __init__(self):
        self.t: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.t.setdefault(trainer.global_step, time.perf_counter())


def fit(token_file, monitor, max_steps, log_every_n_steps, **trainer_kw):
    model = MoELanguageModel(preset="tiny", overrides=TINY, warmup_steps=2)
    dm = TokenDataModule(path=token_file, seq_length=SEQ, batch_size=BATCH)
    clock = StepClock()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, log_every_n_steps=log_every_n_steps,
                        callbacks=[monitor, clock], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, **trainer_kw)
    trainer.fit(model, dm)
    return trainer, model, clock


def test_windows_rates_tflops_and_mfu(token_file):
    monitor = MoEThroughput(peak_tflops=1.0, warmup_steps=2)
    assert monitor.pipeline_bubble_fraction is None
    trainer, model, clock = fit(token_file, monitor, max_steps=12, log_every_n_steps=4, limit_val_batches=0)
    h = monitor.history
    # warmup skips steps 0-1; windows end where Lightning writes logs (at the start of steps 3, 7, 11, 0-based),
    # so the first window is the single step 2, then full windows of 4 steps; the tail after step 11 is not reported
    assert [(e["first_step"], e["step"], e["num_steps"]) for e in h] == [(2, 3, 1), (3, 7, 4), (7, 11, 4)]
    fpt = training_flops_per_token(model.config, SEQ)
    for e in h:
        assert e["tokens"] == e["num_steps"] * BATCH * SEQ
        assert e["tokens_per_sec"] > 0 and e["step_time_s"] > 0
        # tokens/s from the callback vs tokens / (independent step-start timestamps): same window, loose factor
        independent = e["tokens"] / (clock.t[e["step"]] - clock.t[e["first_step"]])
        assert 0.5 < e["tokens_per_sec"] / independent < 2.0
        assert e["tokens_per_sec"] * e["step_time_s"] == pytest.approx(BATCH * SEQ, rel=1e-9)
        assert e["time_s"] == pytest.approx(e["num_steps"] * e["step_time_s"], rel=1e-9)
        assert e["flops_per_token"] == fpt
        assert e["tflops_per_gpu"] == pytest.approx(fpt * e["tokens_per_sec"] / 1e12, rel=1e-12)
        assert e["mfu"] == e["tflops_per_gpu"] / 1.0
    m = trainer.callback_metrics
    for key in ("perf/tokens_per_sec", "perf/step_time_s", "perf/tflops_per_gpu", "perf/mfu"):
        assert key in m
    assert float(m["perf/tokens_per_sec"]) == pytest.approx(h[-1]["tokens_per_sec"], rel=1e-6)
    assert float(m["perf/mfu"]) == pytest.approx(h[-1]["mfu"], rel=1e-6)
    assert "perf/tokens_per_sec" in trainer.progress_bar_metrics and "perf/mfu" in trainer.progress_bar_metrics


def test_gradient_accumulation_counts_every_micro_batch(token_file):
    monitor = MoEThroughput(warmup_steps=1)  # no peak on CPU: MFU is not logged
    trainer, model, clock = fit(token_file, monitor, max_steps=8, log_every_n_steps=2, accumulate_grad_batches=3,
                                limit_val_batches=0)
    h = monitor.history
    assert [(e["first_step"], e["step"], e["num_steps"]) for e in h] == [(1, 3, 2), (3, 5, 2), (5, 7, 2)]
    for e in h:
        assert e["tokens"] == e["num_steps"] * 3 * BATCH * SEQ  # three micro-batches per optimizer step
        assert e["tokens_per_sec"] * e["step_time_s"] == pytest.approx(3 * BATCH * SEQ, rel=1e-9)
        independent = e["tokens"] / (clock.t[e["step"]] - clock.t[e["first_step"]])
        assert 0.5 < e["tokens_per_sec"] / independent < 2.0
        assert e["mfu"] is None
    assert "perf/tokens_per_sec" in trainer.callback_metrics and "perf/mfu" not in trainer.callback_metrics


def test_validation_time_is_excluded(token_file):
    monitor = MoEThroughput(peak_tflops=1.0, warmup_steps=1)
    # validation after every 2nd step, slowed down so that it would dominate the windows if it were counted
    class SlowVal(L.Callback):
        def on_validation_batch_end(self, *args, **kwargs):
            time.sleep(0.05)

    model = MoELanguageModel(preset="tiny", overrides=TINY, warmup_steps=2)
    dm = TokenDataModule(path=token_file, seq_length=SEQ, batch_size=BATCH, val_batches=2)
    clock = StepClock()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=8, log_every_n_steps=4, val_check_interval=2,
                        num_sanity_val_steps=0, callbacks=[monitor, clock, SlowVal()], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, dm)
    e = monitor.history[-1]
    assert (e["first_step"], e["step"]) == (3, 7)
    with_val = clock.t[e["step"]] - clock.t[e["first_step"]]  # includes two validations of >= 0.1 s each
    assert e["time_s"] < with_val - 0.15
