"""Which pass of a recomputed region is running. Activation recomputation (``lightning_moe.Recompute``) runs a
region's forward twice: once normally, once again in backward to rebuild what was not kept. Stateful layers (the
router's token counters and global aux-loss window) must count only the first pass, and the replay must reproduce the
first pass's values: they ask here, and keep what the replay needs in the region invocation's ``store`` (FP8's
delayed scales: ``fp8.Recomputed``). Set by the recomputation's contexts (``torch.utils.checkpoint``'s
``context_fn``); thread-local, since the autograd engine may replay on its own thread."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Optional

_state = threading.local()


def replaying() -> bool:
    """Inside the backward-time replay of a recomputed region."""
    return getattr(_state, "phase", None) == "replay"


def recorded() -> bool:
    """Inside the first forward of a region that will be replayed: values the replay needs must be kept."""
    return getattr(_state, "phase", None) == "first"


def store() -> Optional[dict]:
    """The recomputed region's own store, shared by its first pass and its replay (None elsewhere, and in a rebuild
    that keeps nothing from a first pass): what one invocation of a region keeps for its replay, freed with the
    region. Keyed by its user; unlike a queue across regions, it cannot pair a replay with another invocation's first
    pass (the replay may stop early: ``torch.utils.checkpoint``'s early stop)."""
    return getattr(_state, "store", None)


def entries(owner: object) -> list:
    """What ``owner`` keeps for the replay in the current region invocation's store, in order (its first pass
    appends, its replay pops from the front); a new empty list where there is no store (nothing is kept)."""
    kept = store()
    return [] if kept is None else kept.setdefault(id(owner), [])


@contextmanager
def _phase(name: str, kept: Optional[dict]):
    old = getattr(_state, "phase", None), getattr(_state, "store", None)
    _state.phase, _state.store = name, kept
    try:
        yield
    finally:
        _state.phase, _state.store = old


def first_pass(kept: Optional[dict] = None):
    return _phase("first", kept)


def replay(kept: Optional[dict] = None):
    return _phase("replay", kept)
