"""The host side of optimizer CPU offload (``MoEFoldStrategy(optimizer_cpu_offload=...)``, Megatron's
``--optimizer-cpu-offload``): the host slots' fp32 main weights, their gradients and a staging copy of their new
weights in the model's dtype live in page-locked host memory; side streams move the gradients out after the
gradient sync and the new weights back after the CPU step, so that neither copy waits in the compute stream. Their
optimizer state stays in ordinary host memory (it never crosses the bus)."""

from __future__ import annotations

import mmap
import os
import weakref
from typing import Optional

import torch


PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def host_buffer(n: int, dtype: torch.dtype, pin: bool, keep: list) -> torch.Tensor:
    """``n`` elements of host memory, page-locked in place with ``cudaHostRegister`` when ``pin`` (torch's pinned
    allocator rounds every allocation up to a power of two: 16 GiB for a 10 GiB buffer). Registered regions are
    whole pages of their own, so two buffers never share a page (which cannot be registered twice). ``keep`` gets
    ``(allocation, registered address)``: hand it to ``unregister`` before the allocation may be freed."""
    if not (pin and n):
        return torch.empty(n, dtype=dtype)
    nbytes = n * dtype.itemsize
    size = -(-nbytes // PAGE) * PAGE
    # an anonymous mapping: page-aligned pages of its own (torch's tensor shares it and keeps it alive)
    raw = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)
    err = torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), size, 0)
    if int(err) != 0:
        raise RuntimeError(f"optimizer_cpu_offload: cudaHostRegister of {size / 2**30:.2f} GiB failed with CUDA error "
                           f"{int(err)} (pinned host memory)")
    keep.append((raw, raw.data_ptr()))
    return raw[:nbytes].view(dtype)


def unregister(keep: list) -> None:
    """Unpin (the memory stays valid as ordinary host memory for whatever still views it)."""
    while keep:
        _, ptr = keep.pop()
        torch.cuda.cudart().cudaHostUnregister(ptr)


def _views(sizes: list[int], dtype: torch.dtype, pin: bool, keep: list) -> list[torch.Tensor]:
    return list(host_buffer(sum(sizes), dtype, pin, keep).split(sizes)) if sizes else []


class HostCopies:
    """Buffers and copies of the host slots (``sharded_optimizer.Slot`` with ``host=True``) on ``device``."""

    def __init__(self, slots: list, device: torch.device):
        self.slots, self.device = slots, device
        self.cuda = device.type == "cuda"
        pin, self._pinned = self.cuda, []
        # unpinned when this object goes (the registered allocations are kept alive until then)
        weakref.finalize(self, unregister, self._pinned)
        for dtype in {s.grad.dtype for s in slots}:  # main weights in the stepped dtype, gradients alike
            mine = [s for s in slots if s.grad.dtype == dtype]
            sizes = [s.hi - s.lo for s in mine]
            for s, t, g in zip(mine, _views(sizes, dtype, pin, self._pinned), _views(sizes, dtype, pin, self._pinned)):
                s.is_view, s.tensor, s.host_grad = False, t, g
                t.copy_(s.weight())
        for dtype in {s.param.dtype for s in slots if s.param.dtype != s.tensor.dtype}:  # staging in the model's dtype
            mine = [s for s in slots if s.param.dtype == dtype and s.tensor.dtype != dtype]
            for s, t in zip(mine, _views([s.hi - s.lo for s in mine], dtype, pin, self._pinned)):
                s.staging = t
        self.stream: Optional[torch.cuda.Stream] = torch.cuda.Stream(device) if self.cuda and slots else None
        self._out = torch.cuda.Stream(device) if self.cuda and slots else None
        self._grads_done = None
        self.weights_done: Optional[torch.cuda.Event] = None  # the last copy of new weights to the device

    def release(self) -> None:
        """Unpin the host buffers (they stay valid as ordinary memory) and drop the streams."""
        unregister(self._pinned)
        self.stream = self._out = self._grads_done = self.weights_done = None

    def grads_out(self) -> None:
        """Start copying the (synced, clipped) gradients to the host, after the compute stream's work on them."""
        if not self.slots:
            return
        if not self.cuda:
            torch._foreach_copy_([s.host_grad for s in self.slots], [s.grad for s in self.slots])
            return
        self._out.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._out):
            torch._foreach_copy_([s.host_grad for s in self.slots], [s.grad for s in self.slots], non_blocking=True)
        self._grads_done = self._out.record_event()

    def wait_grads(self) -> None:
        """Host wait, unavoidable: the CPU steps these gradients (the GPU meanwhile steps the device slots). Also
        waits for the last step's copies out of the host weights (long done)."""
        for event in (self._grads_done, self.weights_done):
            if event is not None:
                event.synchronize()
        for s in self.slots:
            s.tensor.grad = s.host_grad

    def weights_in(self) -> None:
        """Copy the stepped weights back into the model's weights (staged in the model's dtype) on the side stream."""
        staged = [s for s in self.slots if s.staging is not None]
        if staged:
            torch._foreach_copy_([s.staging for s in staged], [s.tensor for s in staged])
        src = [s.staging if s.staging is not None else s.tensor for s in self.slots]
        if not self.cuda:
            torch._foreach_copy_([s.weight() for s in self.slots], src)
            return
        # after this step's device writes and every earlier read of these weights on the compute stream
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            torch._foreach_copy_([s.weight() for s in self.slots], src, non_blocking=True)
        self.weights_done = self.stream.record_event()
