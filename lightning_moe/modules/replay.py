"""Which pass of a recomputed region is running. Activation recomputation (``lightning_moe.Recompute``) runs a
region's forward twice: once normally, once again in backward to rebuild what was not kept. Stateful layers (the
router's token counters and global aux-loss window) must count only the first pass, and the replay must reproduce the
first pass's values: they ask here. Set by the recomputation's contexts (``torch.utils.checkpoint``'s ``context_fn``);
thread-local, since the autograd engine may replay on its own thread."""

from __future__ import annotations

import threading
from contextlib import contextmanager

_state = threading.local()


def replaying() -> bool:
    """Inside the backward-time replay of a recomputed region."""
    return getattr(_state, "phase", None) == "replay"


def recorded() -> bool:
    """Inside the first forward of a region that will be replayed: values the replay needs must be kept."""
    return getattr(_state, "phase", None) == "first"


@contextmanager
def _phase(name: str):
    old = getattr(_state, "phase", None)
    _state.phase = name
    try:
        yield
    finally:
        _state.phase = old


def first_pass():
    return _phase("first")


def replay():
    return _phase("replay")
