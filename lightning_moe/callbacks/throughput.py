"""MoEThroughput: tokens/s, step time, model TFLOPS per GPU and MFU, measured over windows of optimizer steps."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Optional

import lightning as L
import torch
from lightning.fabric.utilities.throughput import Throughput

from lightning_moe.flops import peak_flops, training_flops_per_token
from lightning_moe.modules.config import ModelConfig

_PROG_BAR = ("perf/tokens_per_sec", "perf/mfu")


def data_parallel_size(trainer: "L.Trainer") -> int:
    """Replicas of the data stream: the strategy's ``distributed_sampler_kwargs["num_replicas"]`` (the attention-DP
    size under ``moe_fold``), else the world size (1 on a single device)."""
    try:  # single-device strategies lack the attribute; some raise before their mesh exists
        kw = trainer.strategy.distributed_sampler_kwargs
    except (AttributeError, AssertionError, RuntimeError):
        kw = None
    if isinstance(kw, Mapping) and kw.get("num_replicas"):
        return int(kw["num_replicas"])
    return int(trainer.world_size)


def _input_ids(batch: Any) -> torch.Tensor:
    if isinstance(batch, Mapping):
        return batch["input_ids"]
    if isinstance(batch, (tuple, list)):
        return batch[0]
    return batch


class MoEThroughput(L.Callback):
    """Logs ``perf/tokens_per_sec`` (global), ``perf/step_time_s``, ``perf/tflops_per_gpu`` and ``perf/mfu``.

    Timing: the wall clock between the ``on_train_batch_start`` of the first micro-batch of consecutive optimizer
    steps, so a step's time covers data loading, every micro-batch's forward/backward and the optimizer step. The
    device is synchronised only at window boundaries, never per step, and all counters are host integers. Windows
    end at the start of the steps after which Lightning writes logs (every ``log_every_n_steps``), so the values
    land in the logger on the step they are logged; the first window opens after ``warmup_steps`` optimizer steps and
    may be shorter. Time spent in validation inside a window is subtracted. A partial window at the end of
    training is not reported.

    Counting: every micro-batch's tokens (``batch["input_ids"].numel()``) count, so gradient accumulation is
    handled; global tokens = this rank's tokens x the data-parallel size (TP/CP/PP peers of one data-parallel rank
    hold the same samples; the batch is assumed to hold full sequences). FLOPs come from
    :func:`lightning_moe.flops.training_flops_per_token` for ``pl_module.config`` at the batch's sequence length;
    TFLOPS per GPU = flops_per_token x global tokens/s / world size, MFU = TFLOPS per GPU / peak.

    The windowed rate math is Lightning's :class:`~lightning.fabric.utilities.throughput.Throughput` (window of two
    updates: the window's start and end). It is given ``world_size=dp`` (its "global" rates multiply by that) and
    each window's per-device FLOPs share, so its ``device/flops_per_sec`` and ``device/mfu`` are ours. Lightning's
    ``ThroughputMonitor`` callback itself does not fit: it synchronises CUDA every batch, takes FLOPs per *batch*
    from the module, and uses a peak table with the sparse H100 number.

    Args:
        log_every_n_steps: window length in optimizer steps; defaults to ``Trainer(log_every_n_steps)``.
        warmup_steps: optimizer steps excluded from measurement at the start of each ``fit``.
        peak_tflops: the per-device peak for MFU; defaults to :func:`lightning_moe.flops.peak_flops` of the CUDA
            device for ``peak_dtype``. With no peak (CPU, unknown GPU) MFU is not logged.
        peak_dtype: the dtype whose peak MFU is taken against (``bf16`` by convention, also under FP8).
        prog_bar: show tokens/s and MFU in the progress bar.

    Attributes:
        history: one dict per reported window (``step``, ``num_steps``, ``tokens``, ``time_s``, ``tokens_per_sec``,
            ``step_time_s``, ``flops_per_token``, ``tflops_per_gpu``, ``mfu``), for benchmarks.
        pipeline_bubble_fraction: under pipeline schedules, the last step's idle fraction of this rank (time spent
            waiting for other stages: 1 - busy / wall, from ``MoEFoldStrategy.pipeline_timing``); None otherwise.
            ``history`` entries also carry ``pipeline_ideal_bubble_fraction``, the schedule's bubble with free
            communication and backward = 2 x forward.
    """

    def __init__(self, log_every_n_steps: Optional[int] = None, warmup_steps: int = 3,
                 peak_tflops: Optional[float] = None, peak_dtype: str = "bf16", prog_bar: bool = True):
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"MoEThroughput: log_every_n_steps must be >= 1, got {log_every_n_steps}")
        if warmup_steps < 0:
            raise ValueError(f"MoEThroughput: warmup_steps must be >= 0, got {warmup_steps}")
        if peak_tflops is not None and not peak_tflops > 0:
            raise ValueError(f"MoEThroughput: peak_tflops must be > 0, got {peak_tflops}")
        self.log_every_n_steps, self.warmup_steps = log_every_n_steps, warmup_steps
        self.peak_tflops, self.peak_dtype, self.prog_bar = peak_tflops, peak_dtype, prog_bar
        self.history: list[dict[str, Any]] = []
        self.pipeline_bubble_fraction: Optional[float] = None
        self.peak_flops: Optional[float] = None  # FLOP/s per device used for MFU
        self._fpt_cache: dict[int, float] = {}
        self._reset_counters(0)

    # ------------------------------------------------------------------ state
    def _reset_counters(self, global_step: int) -> None:
        self._start_step = self._seen_step = global_step  # warmup counts from here (also after a resume)
        self._at_step_start = True
        self._open = False
        self._t_origin: Optional[float] = None
        self._excluded_s = 0.0
        self._val_t0: Optional[float] = None
        self._win_first_step, self._win_elapsed0 = 0, 0.0
        self._win_steps = self._win_tokens = self._win_samples = 0
        self._win_flops = 0.0
        self._cum_steps = self._cum_tokens = self._cum_samples = 0

    def setup(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        cfg = getattr(pl_module, "config", None)
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"MoEThroughput: {type(pl_module).__name__}.config must be a ModelConfig, "
                            f"got {type(cfg).__name__}")
        self._cfg = cfg
        self._fpt_cache = {}
        self._n = self.log_every_n_steps or trainer.log_every_n_steps
        self._dp, self._world = data_parallel_size(trainer), int(trainer.world_size)
        self._device = trainer.strategy.root_device
        if self.peak_tflops is not None:
            self.peak_flops = self.peak_tflops * 1e12
        elif self._device.type == "cuda":
            self.peak_flops = peak_flops(torch.cuda.get_device_name(self._device), self.peak_dtype)
        else:
            self.peak_flops = None
        self._throughput = Throughput(available_flops=self.peak_flops, world_size=self._dp, window_size=2)

    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self._reset_counters(trainer.global_step)

    def flops_per_token(self, seq_length: int) -> float:
        if seq_length not in self._fpt_cache:
            self._fpt_cache[seq_length] = training_flops_per_token(self._cfg, seq_length)
        return self._fpt_cache[seq_length]

    def _now(self) -> float:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # only at window boundaries
        return time.perf_counter()

    # ------------------------------------------------------------------ hooks
    def on_train_batch_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule", batch: Any,
                             batch_idx: int) -> None:
        if not self._n:
            return
        if self._at_step_start:  # the first micro-batch of an optimizer step
            self._at_step_start = False
            step = trainer.global_step  # optimizer steps completed before this one
            # Lightning writes logs at the end of step number step+1 when (step+1) % log_every_n_steps == 0
            boundary = (step + 1) % self._n == 0
            if self._open and self._win_steps > 0 and boundary:
                self._close_window(pl_module, self._now(), step)
            elif not self._open and step - self._start_step >= self.warmup_steps:
                self._open_window(self._now(), step)
        if self._open:
            ids = _input_ids(batch)
            n_tok = ids.numel()  # shape metadata only: no device sync
            self._win_tokens += n_tok
            self._win_samples += ids.shape[0] if ids.ndim > 1 else 1
            self._win_flops += self.flops_per_token(int(ids.shape[-1])) * n_tok

    def on_train_batch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step != self._seen_step:  # this micro-batch ended an optimizer step
            self._seen_step = trainer.global_step
            self._at_step_start = True
            if self._open:
                self._win_steps += 1

    def on_validation_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        if self._open and not trainer.sanity_checking:
            self._val_t0 = self._now()

    def on_validation_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        if self._val_t0 is not None:
            self._excluded_s += self._now() - self._val_t0
            self._val_t0 = None

    # ------------------------------------------------------------------ windows
    def _elapsed(self, t: float) -> float:
        return t - self._t_origin - self._excluded_s

    def _open_window(self, t: float, step: int) -> None:
        if self._t_origin is None:
            self._t_origin = t
            self._throughput.reset()
            self._throughput.update(time=0.0, batches=0, samples=0, lengths=0, flops=0)
        self._open = True
        self._win_first_step, self._win_elapsed0 = step, self._elapsed(t)
        self._win_steps = self._win_tokens = self._win_samples = 0
        self._win_flops = 0.0

    def _pipeline_entry(self, pl_module: "L.LightningModule") -> dict:
        timing_fn = getattr(pl_module.trainer.strategy, "pipeline_timing", None)
        timing = timing_fn() if callable(timing_fn) else {}  # one device sync, once per window
        self.pipeline_bubble_fraction = timing.get("bubble_fraction")
        return {"pipeline_bubble_fraction": self.pipeline_bubble_fraction,
                "pipeline_ideal_bubble_fraction": timing.get("ideal_bubble_fraction")}

    def _close_window(self, pl_module: "L.LightningModule", t: float, step: int) -> None:
        self._cum_steps += self._win_steps
        self._cum_samples += self._win_samples
        self._cum_tokens += self._win_tokens
        # each device's share of the model FLOPs: the dp replicas split the tokens, the world splits the FLOPs
        device_flops = self._win_flops * self._dp / self._world
        elapsed = self._elapsed(t)
        self._throughput.update(time=elapsed, batches=self._cum_steps, samples=self._cum_samples,
                                lengths=self._cum_tokens, flops=device_flops)
        m = self._throughput.compute()
        tokens_per_sec = m["device/items_per_sec"] * self._dp
        tflops = m["device/flops_per_sec"] / 1e12
        mfu = m.get("device/mfu")
        entry = {"step": step, "first_step": self._win_first_step, "num_steps": self._win_steps,
                 "tokens": self._win_tokens * self._dp, "time_s": elapsed - self._win_elapsed0,
                 "tokens_per_sec": tokens_per_sec, "step_time_s": 1.0 / m["device/batches_per_sec"],
                 "flops_per_token": self._win_flops / self._win_tokens, "tflops_per_gpu": tflops, "mfu": mfu,
                 **self._pipeline_entry(pl_module)}
        self.history.append(entry)
        log = dict(on_step=True, on_epoch=False, batch_size=1)
        values = {"perf/tokens_per_sec": tokens_per_sec, "perf/step_time_s": entry["step_time_s"],
                  "perf/tflops_per_gpu": tflops, "perf/mfu": mfu, "perf/pipeline_bubble": self.pipeline_bubble_fraction}
        for name, value in values.items():
            if value is not None:  # host numbers stay on the host: Lightning would put a float on the GPU, then read
                # a progress-bar value back with .item() after every batch (a host sync per micro-batch)
                pl_module.log(name, torch.tensor(float(value)), prog_bar=self.prog_bar and name in _PROG_BAR, **log)
        self._open_window(t, step)
