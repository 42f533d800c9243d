"""The experts' deferred wgrad (``defer_expert_wgrad``) inside CUDA graphs (``MoEFoldStrategy(cuda_graphs=True)``).

Eagerly, ``GradSync.defer_wgrad`` holds each micro-batch's wgrad operands, the tensors themselves, until its window's
pass. A captured backward's operands are the graph's static buffers, which the next replay overwrites. So the capture
copies them into one slot per micro-batch of the window, at a slot index kept on the device, since a replay cannot
take another address from the host: ``index_copy_`` at ``index``, then ``index += 1``. The host counts the replays
through the weight's gradient hook. After the replay that fills the window, or the step's last, it queues the
window's pass over the filled slots, eagerly, then sets the index back to 0.

The slots are allocated in the capture's warm-up, outside the graph, so the capture does not record their zeroing.
Cost: one copy of the operands per micro-batch (2 bytes per routed row and feature of both expert GEMMs, written, then
read by the pass), and the window's slots in memory.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


def _widest(flat: torch.Tensor) -> torch.dtype:
    """The widest integer type whose elements tile a contiguous (1, n) tensor (the same bytes, fewer elements)."""
    nbytes, start = flat.numel() * flat.element_size(), flat.storage_offset() * flat.element_size()
    for wide, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if size > flat.element_size() and nbytes % size == 0 and start % size == 0:
            return wide
    return flat.dtype


class HeldSlots:
    """One expert weight's slots: ``size`` micro-batches of its wgrad operands (``held``: tensors of fixed shapes)."""

    def __init__(self, param: torch.nn.Parameter, held: tuple, size: int):
        self.param, self.size = param, size
        self.bufs = tuple(torch.empty((size, *t.shape), dtype=t.dtype, device=t.device) for t in held)
        self.index = torch.zeros(1, dtype=torch.int64, device=held[0].device)
        self.filled = 0  # replays whose operands sit in the slots (the host's count of ``index``)
        self.run: Optional[Callable] = None  # the pass, ``run(main, first, helds)``, once captured

    def capture(self, held: tuple, run: Callable) -> None:
        """Inside the capture: the replay's operands into the slot at ``index``, which then advances."""
        shapes = [(t.shape, t.dtype) for t in held]
        if shapes != [(b.shape[1:], b.dtype) for b in self.bufs]:
            raise RuntimeError(f"deferred wgrad in a CUDA graph: operands {shapes} differ from the warm-up's "
                               f"{[(b.shape[1:], b.dtype) for b in self.bufs]}")
        for buf, t in zip(self.bufs, held):
            if not t.numel():
                continue
            flat = t.contiguous().view(1, -1)
            wide = _widest(flat)  # index_copy_ goes element by element: the same bytes as fewer, wider elements
            buf.view(buf.shape[0], -1).view(wide).index_copy_(0, self.index, flat.view(wide))
        self.index.add_(1)
        self.run = run

    def replayed(self) -> bool:
        """A replay's gradient hook: one more slot filled; whether the window is now full."""
        self.filled += 1
        return self.filled >= self.size

    def take(self) -> list:
        """The filled slots' operands, in micro-batch order (views: read by the pass queued next)."""
        return [tuple(b[i] for b in self.bufs) for i in range(self.filled)]

    def reset(self) -> None:
        """After the pass is queued, or a step abandoned: the next replay writes the first slot."""
        self.filled = 0
        self.index.zero_()
