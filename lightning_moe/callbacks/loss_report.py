"""LossReport: says at the end of training whether train_loss fell (the demo's visible check)."""

from __future__ import annotations

from typing import Optional

import lightning as L
from lightning.pytorch.utilities import rank_zero_info


class LossReport(L.Callback):
    """Averages ``train_loss`` over the first and last ``window`` optimizer steps and prints both at the end."""

    def __init__(self, window: int = 10, metric: str = "train_loss"):
        self.window, self.metric = window, metric
        self.history: list[float] = []
        self._step: Optional[int] = None  # the global step of the last value taken

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._step:  # mid-step (gradient accumulation): no new value yet
            return
        value = trainer.callback_metrics.get(self.metric)
        # a host read once per step: the demo runs on CPU, and this callback is for demos and tests
        if value is not None:
            self._step = trainer.global_step
            self.history.append(float(value))

    def on_train_end(self, trainer, pl_module) -> None:
        if len(self.history) < 2:
            return
        w = max(1, min(self.window, len(self.history) // 2))
        first, last = sum(self.history[:w]) / w, sum(self.history[-w:]) / w
        verdict = "fell" if last < first else "did NOT fall"
        rank_zero_info(f"{self.metric} {verdict}: {first:.4f} (mean of first {w} steps) -> {last:.4f} "
                       f"(mean of last {w} steps) over {len(self.history)} steps")

    def state_dict(self) -> dict:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict) -> None:
        self.history = list(state_dict.get("history", []))
