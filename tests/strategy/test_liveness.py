"""``strategy/liveness.py`` with in-process ranks on a fake store (the multi-process cases are in
``tests/parallel/test_strategy_mp.py``): a rank that stops beating is named, and the others give up within
``lost_after`` plus a few intervals; a rank failing with its own error passes it to the others; a store that does not
answer names its host; finished or merely stuck ranks are never called lost."""

from __future__ import annotations

import threading
import time

from lightning_moe.strategy.liveness import Liveness, lost_after_for

LOST_AFTER = 0.6  # interval 0.05 s, grace 0.1 s


class Store:
    """A dict behind a lock, shared by the in-process ranks."""

    def __init__(self):
        self.data, self.lock, self.dead = {}, threading.Lock(), False

    def client(self):
        return Client(self)


class Client:
    """One rank's connection: ``freeze()`` blocks it forever (a frozen process or host), ``store.dead`` makes every
    request fail (the host's process is gone)."""

    def __init__(self, store):
        self.s, self.frozen = store, threading.Event()

    def _gate(self):
        if self.frozen.is_set():
            threading.Event().wait()  # never returns: the daemon thread stays blocked
        if self.s.dead:
            raise RuntimeError("Broken pipe")

    def add(self, key, n):
        self._gate()
        with self.s.lock:
            self.s.data[key] = int(self.s.data.get(key, 0)) + n
            return self.s.data[key]

    def set(self, key, value):
        self._gate()
        with self.s.lock:
            self.s.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        self._gate()
        with self.s.lock:
            return self.s.data[key]

    def check(self, keys):
        self._gate()
        with self.s.lock:
            return all(k in self.s.data for k in keys)


def _ranks(world, store=None):
    store = store or Store()
    gave_up = {}
    clients = [store.client() for _ in range(world)]
    ranks = [Liveness(clients[r], r, world, gen=1, lost_after=LOST_AFTER,
                      give_up=lambda why, r=r: gave_up.setdefault(r, (why, time.monotonic())))
             for r in range(world)]
    for lv in ranks:
        lv.start()
    return store, clients, ranks, gave_up


def _stop(ranks):
    for lv in ranks:
        lv._stop.set()
        lv._wake.set()


def _wait(cond, limit=5.0):
    end = time.monotonic() + limit
    while not cond() and time.monotonic() < end:
        time.sleep(0.02)
    return cond()


def test_lost_after_is_half_the_timeout_up_to_a_minute():
    assert lost_after_for(12) == 6 and lost_after_for(1800) == 60 and lost_after_for(100) == 50


def test_a_frozen_rank_is_named_and_the_others_give_up():
    _, clients, ranks, gave_up = _ranks(3)
    time.sleep(0.2)
    clients[1].frozen.set()
    t0 = time.monotonic()
    assert _wait(lambda: 0 in gave_up and 2 in gave_up)
    for r in (0, 2):  # rank 0 watches rank 1 and raises the alarm; rank 2 reads it
        why, t = gave_up[r]
        assert why.startswith("rank 1 is lost: no heartbeat for 1 s (its process or its host is gone)"), why
        assert LOST_AFTER <= t - t0 < LOST_AFTER + 1.0, t - t0  # lost_after, then the grace, in 50 ms steps
    _stop(ranks)


def test_a_killed_rank_is_named_after_a_failed_collective():
    """A dead process fails the collective at once (gloo); diagnose() names it from its stopped counter within a few
    intervals, long before lost_after, and the failing main thread is never ended by the supervisor."""
    _, clients, ranks, gave_up = _ranks(3)
    time.sleep(0.2)
    clients[2].frozen.set()
    t0 = time.monotonic()
    ranks[0].failed("RuntimeError: Connection closed by peer [127.0.0.1]:4242", root_cause=False)
    why = ranks[0].diagnose()
    assert why == "rank 2 is lost: its heartbeat stopped (its process or its host is gone)", why
    assert time.monotonic() - t0 < LOST_AFTER
    time.sleep(LOST_AFTER + 0.3)
    assert 0 not in gave_up  # its main thread failed by itself
    _stop(ranks)


def test_a_rank_failing_with_its_own_error_names_it_everywhere():
    _, _, ranks, gave_up = _ranks(3)
    time.sleep(0.1)
    ranks[1].failed("ValueError: router logits of model.layers.0.ffn.router are NaN", root_cause=True)
    assert _wait(lambda: 0 in gave_up and 2 in gave_up)
    for r in (0, 2):
        assert gave_up[r][0] == "rank 1 failed first: ValueError: router logits of model.layers.0.ffn.router are NaN"
    assert 1 not in gave_up
    _stop(ranks)
    _, clients, ranks, gave_up = _ranks(2)  # the other ranks' collectives fail before the grace: they diagnose
    ranks[1].failed("ValueError: bad", root_cause=True)
    ranks[0].failed("RuntimeError: Connection reset by peer", root_cause=False)
    assert ranks[0].diagnose() == "rank 1 failed first: ValueError: bad"
    _stop(ranks)


def test_a_store_that_stops_answering_names_its_host():
    store, clients, ranks, gave_up = _ranks(2)
    time.sleep(0.1)
    store.dead = True  # rank 0's process, which hosts the store, is gone: requests fail at once
    ranks[1].failed("RuntimeError: Connection closed by peer", root_cause=False)
    assert ranks[1].diagnose() == "rank 0 is lost: the rendezvous store it hosts does not answer"
    _stop(ranks)
    store, clients, ranks, gave_up = _ranks(2)  # frozen host: requests never return; the supervisor still acts
    time.sleep(0.1)
    clients[1].frozen.set()
    t0 = time.monotonic()
    assert _wait(lambda: 1 in gave_up)
    assert gave_up[1][0].startswith("rank 0 is lost: the rendezvous store it hosts does not answer (silent for")
    assert LOST_AFTER <= gave_up[1][1] - t0 < LOST_AFTER + 1.0
    _stop(ranks)


def test_finished_and_stuck_ranks_are_not_lost():
    store, clients, ranks, gave_up = _ranks(3)
    time.sleep(0.1)
    ranks[1].stop()  # done: its counter stops, marked done
    ranks[0].stop()  # the store's host is done, then its store goes away
    time.sleep(0.2)
    store.dead = True
    time.sleep(LOST_AFTER + 0.4)
    assert gave_up == {}
    _stop(ranks)
    _, _, ranks, gave_up = _ranks(3)  # a collective timed out, but every rank still beats: one is stuck, none lost
    time.sleep(0.1)
    ranks[2].failed("RuntimeError: Timed out waiting 5000ms for recv operation to complete", root_cause=False)
    assert ranks[2].diagnose().startswith("no rank is lost: every other rank still beats")
    assert gave_up == {}
    ranks[0].failed("RuntimeError: Connection closed by peer", root_cause=False)  # the others' collectives fail next
    assert ranks[0].diagnose() == ("no rank is lost; rank 2 failed too: RuntimeError: Timed out waiting 5000ms for "
                                   "recv operation to complete")
    _stop(ranks)
