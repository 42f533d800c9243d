"""Which pass of a recomputed region is running. Activation recomputation (``lightning_moe.Recompute``) runs a
region's forward twice: once normally, once again in backward to rebuild what was not kept. Stateful layers (the
router's token counters and global aux-loss window) must count only the first pass, and the replay must reproduce the
first pass's values: they ask here, and keep what the replay needs in the region invocation's ``store`` (FP8's
delayed scales: ``fp8.Recomputed``). Set by the recomputation's contexts (``torch.utils.checkpoint``'s
``context_fn``); thread-local, since the autograd engine may replay on its own thread."""

from __future__ import annotations

import threading
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
    """What ``owner`` keeps for the replay in the current region invocation's store, in order: its first pass
    appends, its replay pops from the front of a copy of its own (a second backward through a retained graph replays
    again, from the start); a new empty list where there is no store (nothing is kept)."""
    kept = store()
    if kept is None:
        return []
    if replaying():
        pending = _state.pending
        if id(owner) not in pending:
            pending[id(owner)] = list(kept.get(id(owner), ()))
        return pending[id(owner)]
    return kept.setdefault(id(owner), [])


class _Phase:
    """A phase of one region invocation, entered each time it runs (a context manager object that can be entered
    again: torch.utils.checkpoint enters the same one for each recomputation)."""

    def __init__(self, name: str, kept: Optional[dict]):
        self.name, self.kept, self._outer = name, kept, []

    def __enter__(self):
        self._outer.append((getattr(_state, "phase", None), getattr(_state, "store", None),
                            getattr(_state, "pending", None)))
        _state.phase, _state.store = self.name, self.kept
        _state.pending = {} if self.name == "replay" else None  # this replay's copies of the entries (``entries``)
        return self

    def __exit__(self, *exc) -> bool:
        _state.phase, _state.store, _state.pending = self._outer.pop()
        return False


def first_pass(kept: Optional[dict] = None) -> _Phase:
    return _Phase("first", kept)


def replay(kept: Optional[dict] = None) -> _Phase:
    return _Phase("replay", kept)
