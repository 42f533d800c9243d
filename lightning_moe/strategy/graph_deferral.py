"""The experts' deferred wgrad (``defer_expert_wgrad``) inside CUDA graphs (``MoEFoldStrategy(cuda_graphs=True)``).

Eagerly, ``GradSync.defer_wgrad`` holds each micro-batch's wgrad operands, the tensors themselves, until its window's
pass. A captured backward's operands are the graph's static buffers, which the next replay of that graph overwrites.
So the strategy captures the blocks once per micro-batch of the window, in one memory pool
(``cuda_graphs.capture_blocks``): copy k's operands are tensors of its own, which live as long as the graphs, and the
window's k-th replay leaves its micro-batch's operands there. Nothing is copied. The host counts the replays through
the weight's gradient hook, and the next forward replays the copy after them (``GradSync.graph_copy``). After the
replay that fills the window, or the step's last, it queues the window's pass over the copies' operands, eagerly,
and the count goes back to 0.

Why this is safe in one pool: within a window the copies replay in order, 0 to the last filled, and the window's pass
is queued (same stream) before copy 0 replays again; a step's first forward starts at copy 0 (``GradSync.new_step``).
A copy's kept tensors may lie in memory that earlier copies used as scratch during their captures, but those copies
do not replay again before the pass has read them.

Cost: the window's copies of the graphs: the capture's time, and in memory each copy's operands (what the eager
deferral holds) and its static tensors (per block about three of its activations' size: output, input gradient and
output gradient).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


class HeldCopies:
    """One expert weight's deferred wgrad under graphs: the operands ``held[k]`` that graph copy k's backward leaves
    (fixed tensors, captured once), ``size`` copies (the window)."""

    def __init__(self, param: torch.nn.Parameter, size: int):
        self.param, self.size = param, size
        self.held: list[Optional[tuple]] = [None] * size
        self.filled = 0  # replays since the last pass: copies 0 .. filled - 1 hold this window's operands
        self.run: Optional[Callable] = None  # the pass, ``run(main, first, helds)``, once captured

    def capture(self, k: int, held: tuple, run: Callable) -> None:
        """Inside copy k's capture: its backward's operands, which each of its replays rewrites."""
        if not 0 <= k < self.size:
            raise RuntimeError(f"deferred wgrad in a CUDA graph: copy {k} captured for a window of {self.size}")
        ptrs = [t.data_ptr() for t in held if t.numel()]
        for j, other in enumerate(self.held):  # each copy's own tensors (not a buffer every copy would share)
            if j != k and other is not None and set(ptrs) & {t.data_ptr() for t in other if t.numel()}:
                raise RuntimeError(f"deferred wgrad in a CUDA graph: copies {j} and {k} hold the same operand memory")
        self.held[k], self.run = held, run

    def replayed(self) -> bool:
        """A replay's gradient hook: one more copy filled; whether the window is now full."""
        self.filled += 1
        return self.filled >= self.size

    def take(self) -> list:
        """The filled copies' operands, in micro-batch order (read by the pass queued next, before any later replay
        of those copies rewrites them)."""
        missing = [k for k in range(self.filled) if self.held[k] is None]
        if missing:
            raise RuntimeError(f"deferred wgrad in a CUDA graph: copies {missing} were replayed but never captured")
        return list(self.held[:self.filled])

    def reset(self) -> None:
        """After the pass is queued, or a step abandoned: the next forward replays copy 0."""
        self.filled = 0
