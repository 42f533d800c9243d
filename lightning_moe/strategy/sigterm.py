"""SIGTERM agreement between ranks without a GPU round trip per step.

Lightning's training loop broadcasts a one-element CUDA tensor from rank 0 and reads it back with ``.item()`` before
every batch of a multi-process run (``_broadcast_sigterm_tensor``), so that all ranks stop together when one is told
to. That is a host-device synchronisation per step: the CPU waits for the GPU queue to drain, and the GPU then idles
while the CPU launches the next step. Here the ranks agree with a CPU all-reduce on a gloo group instead: still a
collective, so every rank decides at the same step (a store flag could be seen at different steps and leave ranks in
mismatched collectives), but the GPU queue is never waited on. Any rank's SIGTERM stops all of them; they raise
Lightning's ``SIGTERMException`` after a barrier, as Lightning does.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def install(trainer, timeout=None) -> bool:
    """Replace the epoch loop's per-step CUDA broadcast (collective: every rank calls this at setup). False where
    there is nothing to replace: one process, or a Lightning without the hook."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    if loop is None or not hasattr(loop, "_broadcast_sigterm_tensor") or not dist.is_initialized():
        return False
    if dist.get_world_size() == 1:
        return False
    group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    def agree() -> None:
        flag = torch.tensor([1 if getattr(trainer, "received_sigterm", False) else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)  # CPU tensor on gloo: no CUDA stream involved
        if flag.item():
            with contextlib.suppress(Exception):
                dist.barrier(group=group)  # as Lightning: every rank gets here before any exits
            raise SIGTERMException()

    loop._broadcast_sigterm_tensor = agree
    return True
