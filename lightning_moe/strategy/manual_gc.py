"""Python's garbage collector under ``MoEFoldStrategy(manual_gc=N)``: Megatron's ``--manual-gc`` with
``--manual-gc-interval``, torchtitan's ``gc_freq``.

Why: the automatic collector runs a full collection whenever enough objects have outlived two younger ones, and a
full collection walks every Python object of the process: torch's, Lightning's, triton's, the model's (about 0.2 s
for 365,000 objects on a 2-core CPU). It lands in whichever step it happens to, on one rank at a time, and the
others wait for that rank at the next collective. Measured on one H200 (docs/PERFORMANCE.md), Qwen3's bf16 and FP8
steps made no full collection in six steps and their young collections cost about 1 ms per step, so the option did
not change their step time there; it is Megatron's and torchtitan's guard against the case where it does.

How: when training starts, one full collection, then ``gc.freeze()`` (what is alive then, the modules, parameters,
optimizer and imported code, leaves the collector's view for good) and ``gc.disable()``. Every N optimizer steps a
full collection runs, at the same step on every rank, over what was made since the freeze. When training ends (or
fails), the objects are unfrozen and the collector is enabled again if it was. Reference counting still frees all
garbage without cycles at once; only cyclic garbage waits for the next collection (until training ends with N = 0).
Objects the user froze before training stay frozen, and then nothing else is frozen or thawed.
"""

from __future__ import annotations

import gc
from typing import Optional


def check_interval(interval) -> Optional[int]:
    """``manual_gc``'s value: None (the automatic collector) or an int >= 0; ValueError otherwise."""
    if interval is not None and (isinstance(interval, bool) or not isinstance(interval, int) or interval < 0):
        raise ValueError(f"MoEFoldStrategy: manual_gc must be None (Python's automatic garbage collector), 0 (no "
                         f"collections during training) or a number of optimizer steps >= 1, got {interval!r}")
    return interval


class ManualGC:
    """The collector off during training, a full collection every ``interval`` optimizer steps (0: none)."""

    def __init__(self, interval: int):
        self.interval = check_interval(interval)
        self.steps = 0
        self._was_enabled: Optional[bool] = None  # None: not started (or stopped)
        self._freezes = False  # whether start froze the objects (stop thaws them)

    @property
    def active(self) -> bool:
        return self._was_enabled is not None

    def start(self) -> None:
        if self.active:
            return
        self._was_enabled = gc.isenabled()
        # objects frozen before (by the user, before forking workers) stay frozen: then nothing is frozen or thawed here
        self._freezes = gc.get_freeze_count() == 0
        if self._freezes:
            gc.collect()  # the setup's garbage, before what is left is frozen
            gc.freeze()
        gc.disable()
        self.steps = 0

    def step(self) -> None:
        """After an optimizer step."""
        if not self.active:
            return
        self.steps += 1
        if self.interval and self.steps % self.interval == 0:
            gc.collect()

    def stop(self) -> None:
        if not self.active:
            return
        if self._freezes:
            gc.unfreeze()
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None
