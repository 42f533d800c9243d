"""Which rank is gone, and never waiting for it: heartbeats through the rendezvous store.

A collective waits for every rank of its group. When a peer's process dies, gloo notices at once (its sockets
close) but its error names a socket address, not a rank. NCCL, and any backend when a whole host vanishes (no
connection is ever closed), wait for the full collective timeout. The store that every process group already has (a
TCPStore) answers both without touching the collectives:

- each rank's *worker thread* adds 1 to its counter every ``interval`` seconds. It runs while the main thread waits
  in a collective, so a stuck rank still beats; a dead or frozen process does not.
- it watches one neighbour, ``(rank + 1) % world`` (four small store requests per rank and interval in all: beat,
  neighbour, alarm, and whether the store's host has finished). A counter that has not moved for ``lost_after``
  seconds raises the alarm naming that rank.
- a rank that fails with an error of its own (not a failed collective) marks itself failed and raises the alarm with
  the error, so every rank's log names the root cause.
- a *supervisor thread*, which never touches the store, acts on the alarm, or on a store that has not answered for
  ``lost_after`` (its host, rank 0, is gone). Unless the main thread has failed by itself within ``grace``, it
  prints why and ends the process with ``EXIT_LOST_PEER``: a thread blocked in a collective cannot be woken any
  other way (gloo's abort does not wake a waiting collective).
- after a collective failed, :meth:`Liveness.diagnose` names the ranks whose counters stopped (neither done nor
  failed), or the alarm's reason, within a few intervals.

Every store request runs on the worker thread: a frozen store host blocks it (a TCPStore timeout does not bound
``add``), never the main thread or the supervisor. The counter carries the rank's status in its high bits (running,
done, failed), so one request reads both. ``gen`` numbers the strategy's activations (``fit``, then ``validate``...):
a finished phase's statuses and alarm never leak into the next.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable, Optional

EXIT_LOST_PEER = 75  # sysexits' EX_TEMPFAIL: the job may succeed when restarted from its last checkpoint
MAX_LOST_AFTER_S = 60.0
_UNIT = 1 << 40  # the counter's status bits: beats + status * _UNIT
_RUNNING, _DONE, _FAILED = 0, 1, 2


def lost_after_for(timeout_s: float) -> float:
    """Seconds without a heartbeat after which a rank counts as lost: half the collective timeout, at most 60 s, so a
    lost rank is always noticed well before a collective would time out."""
    return min(float(timeout_s) / 2, MAX_LOST_AFTER_S)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]} is" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} are"


class Liveness:
    """Heartbeats of one rank and its watch over a neighbour (see the module docstring).

    Args:
        store: a ``torch.distributed.Store`` (or anything with ``add``, ``set``, ``get``, ``check``) used by the
            worker thread alone.
        rank, world: this rank and the number of ranks.
        gen: the activation number, the same on every rank.
        lost_after: seconds without a heartbeat after which a rank is lost.
        store_host_rank: the rank whose process hosts the store (None: an agent such as torchrun's hosts it). Once
            that rank is done, a store that stops answering is no alarm.
        give_up: called by the supervisor with the reason when this process must end; the default prints it and
            calls ``os._exit(EXIT_LOST_PEER)``.
    """

    def __init__(self, store: Any, rank: int, world: int, gen: int, lost_after: float,
                 store_host_rank: Optional[int] = 0, give_up: Optional[Callable[[str], None]] = None) -> None:
        self.store, self.rank, self.world, self.gen = store, rank, world, gen
        self.lost_after = float(lost_after)
        self.interval = self.lost_after / 12
        self.grace = 2 * self.interval  # the main thread's chance to fail by itself first (gloo does at once)
        self.store_host_rank = store_host_rank
        self._host_done = False  # the store's host rank finished this activation: its store may go away
        self._give_up = give_up or self._exit
        self._prefix = f"moe_fold/liveness/{gen}/"
        self.alarm: Optional[str] = None  # the first alarm of this activation, once read from the store
        self._stop, self._wake = threading.Event(), threading.Event()
        self._status: Optional[tuple[int, str, bool]] = None  # (status, reason, raise the alarm) to write
        self._main_failed = False
        self._last_ok = time.monotonic()
        self._store_failures = 0
        self._worker_gone = threading.Event()
        self._seen: Optional[tuple[int, float]] = None  # the neighbour's (beats, since when)
        self._census: Optional[dict] = None
        self._census_done = threading.Event()
        self._alarm_since: Optional[float] = None
        self._threads = [threading.Thread(target=self._work, name=f"moe_fold-liveness-{rank}", daemon=True),
                         threading.Thread(target=self._supervise, name=f"moe_fold-supervisor-{rank}", daemon=True)]

    # ------------------------------------------------------------------ main thread
    def start(self) -> None:
        for t in self._threads:
            t.start()

    def failed(self, reason: str, root_cause: bool) -> None:
        """The main thread failed: mark this rank failed (not lost), with the alarm when the error is its own."""
        self._main_failed = True
        self._status = (_FAILED, reason[:500], root_cause)
        self._wake.set()

    def diagnose(self, timeout: Optional[float] = None) -> str:
        """After a failed collective: which ranks are lost, or the first failure's reason. Waits a few heartbeat
        intervals (at most ``timeout``, default ``4 * interval + 2`` s) for the counters to show it."""
        self._main_failed = True
        self._census = {}
        self._census_done.clear()
        self._wake.set()
        if self._worker_gone.is_set() or not self._census_done.wait(
                4 * self.interval + 2 if timeout is None else timeout):
            return self._store_lost(time.monotonic() - self._last_ok)
        return self._census["result"]

    def stop(self) -> None:
        """The activation ended: mark this rank done (unless it failed) and end both threads."""
        if self._status is None and not self._main_failed:
            self._status = (_DONE, "", False)
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            if t.is_alive() and t is not threading.current_thread():
                t.join(timeout=2 * self.interval + 1)  # a worker blocked on a dead store is a daemon: left behind

    # ------------------------------------------------------------------ worker thread: every store request
    def _key(self, what: str, rank: Optional[int] = None) -> str:
        return self._prefix + (what if rank is None else f"{what}/{rank}")

    def _work(self) -> None:
        try:
            self._loop()
        finally:
            self._worker_gone.set()

    def _loop(self) -> None:
        while True:
            stopping = self._stop.is_set()
            try:
                self._round(stopping)
                self._last_ok, self._store_failures = time.monotonic(), 0
            except Exception:  # noqa: BLE001 - the store's host is gone or unreachable
                self._store_failures += 1
                if self._census is not None and not self._census_done.is_set():
                    self._finish_census(self._store_lost(0.0))
                if self._store_failures >= 2:  # stop there: every further request would print a C++ warning
                    return
            if stopping:
                return
            self._wake.wait(self.interval)
            self._wake.clear()

    def _round(self, stopping: bool) -> None:
        s = self.store
        if self._status is not None:
            status, reason, alarm = self._status
            self._status = None
            if status == _FAILED:
                s.set(self._key("failed", self.rank), reason)
                if alarm:
                    self._raise_alarm(f"rank {self.rank} failed first: {reason}")
            s.add(self._key("beat", self.rank), status * _UNIT)
        if stopping:
            return
        s.add(self._key("beat", self.rank), 1)
        if self.store_host_rank is not None and self.store_host_rank != self.rank and not self._host_done:
            self._host_done = s.add(self._key("beat", self.store_host_rank), 0) // _UNIT == _DONE
        if self.alarm is None and s.check([self._key("alarm")]):
            self.alarm = s.get(self._key("alarm")).decode()
        if self._census is not None and not self._census_done.is_set():
            self._census_round()
        elif self.alarm is None and self.world > 1:
            self._watch((self.rank + 1) % self.world)

    def _raise_alarm(self, text: str) -> None:
        if self.store.add(self._key("alarm_claims"), 1) == 1:  # the first alarm wins: it is the root cause
            self.store.set(self._key("alarm"), text)
            self.alarm = self.alarm or text

    def _watch(self, peer: int) -> None:
        value = self.store.add(self._key("beat", peer), 0)
        beats, status = value % _UNIT, value // _UNIT
        now = time.monotonic()
        if status != _RUNNING or beats == 0:  # done, failed, or not started yet: nothing to watch
            self._seen = None
        elif self._seen is None or self._seen[0] != beats:
            self._seen = (beats, now)
        elif now - self._seen[1] >= self.lost_after:
            self._raise_alarm(f"rank {peer} is lost: no heartbeat for {now - self._seen[1]:.0f} s (its process or "
                              "its host is gone)")

    def _census_round(self) -> None:
        s, c = self.store, self._census
        values = [s.add(self._key("beat", r), 0) for r in range(self.world)]
        if self.alarm is not None:
            return self._finish_census(self.alarm)
        now = time.monotonic()
        if "values" not in c:
            c.update(values=values, since=now)
            return
        if now - c["since"] < 2.5 * self.interval:
            return
        lost = [r for r in range(self.world) if r != self.rank and values[r] // _UNIT == _RUNNING
                and values[r] == c["values"][r]]
        failed = [r for r in range(self.world) if r != self.rank and values[r] // _UNIT >= _FAILED]
        if lost:
            text = f"{_ranks(lost)} lost: its heartbeat stopped (its process or its host is gone)"
        elif failed:  # with their errors (often a consequence of another rank's: their logs tell)
            text = "no rank is lost; " + "; ".join(
                f"rank {r} failed too: {s.get(self._key('failed', r)).decode()}" for r in failed[:3])
        else:
            text = ("no rank is lost: every other rank still beats, so one of them is stuck outside this collective "
                    "(a hang, a slow filesystem, a deadlock) rather than gone")
        self._finish_census(text)

    def _finish_census(self, text: str) -> None:
        self._census["result"] = text
        self._census_done.set()

    def _store_lost(self, silent_s: float) -> str:
        host = (f"rank {self.store_host_rank}" if self.store_host_rank is not None
                else "the host of the rendezvous store (the launcher's agent)")
        return (f"{host} is lost: the rendezvous store it hosts does not answer"
                + (f" (silent for {silent_s:.1f} s)" if silent_s >= 0.1 else ""))

    # ------------------------------------------------------------------ supervisor thread: no store requests
    def _supervise(self) -> None:
        while not self._stop.wait(self.interval):
            silent = time.monotonic() - self._last_ok
            store_lost = silent > self.lost_after and not self._host_done
            reason = self.alarm or (self._store_lost(silent) if store_lost else None)
            if reason is None or self._main_failed:
                self._alarm_since = None
                continue
            now = time.monotonic()
            self._alarm_since = self._alarm_since or now
            if now - self._alarm_since >= self.grace and not self._stop.is_set() and not self._main_failed:
                self._give_up(reason)
                return

    def _exit(self, reason: str) -> None:
        print(f"[moe_fold rank {self.rank}] {reason}. This rank stops now (exit code {EXIT_LOST_PEER}) instead of "
              "waiting in a collective until the timeout; restart from the last checkpoint.", file=sys.stderr,
              flush=True)
        os._exit(EXIT_LOST_PEER)
