"""Parking table and dispatcher thread: grants (direct, early, by datagram), disconnects seen
through epoll, worker stop, lingering-seat release timing."""

import os
import socket
import threading
import time

from apf_gunicorn.server.channel import GrantInbox, GrantSender
from apf_gunicorn.server.dispatcher import (
    CANCELLED,
    GRANTED,
    STOPPING,
    Dispatcher,
    Parking,
)


def test_grant_wakes_matching_generation_only():
    p = Parking()
    w = p.park(3, 7)
    p.grant(3, 6)  # stale generation
    assert not w.event.is_set()
    p.grant(3, 7)
    assert w.event.is_set() and w.outcome == GRANTED
    p.unpark(w)
    assert len(p) == 0


def test_grant_before_park_is_kept():
    p = Parking()
    p.grant(5, 1)
    w = p.park(5, 1)
    assert w.outcome == GRANTED
    w2 = p.park(5, 2)  # consumed: a new generation waits
    assert not w2.outcome


def test_stop_all_answers_parked_and_later_requests():
    p = Parking()
    w = p.park(1, 1)
    assert p.stop_all() == 1
    assert w.outcome == STOPPING
    assert p.park(2, 1).outcome == STOPPING


class _Releases:
    def __init__(self):
        self.calls = []
        self.pending_grants = []  # the part of LedgerPort the dispatcher's tick reads

    def release(self, slot, gen, now):
        self.calls.append((slot, gen, now))
        return [(9, 1, 0)]


def _dispatcher(ledger, alive=lambda: True):
    token = f"d{os.getpid()}-{id(ledger)}"
    inbox = GrantInbox(token, 0)
    parking = Parking()
    delivered = []
    d = Dispatcher(parking, inbox, ledger, owner=0, deliver=delivered.extend, alive=alive)
    d.start()
    return d, parking, token, delivered


def test_datagram_grant_and_disconnect_and_linger():
    led = _Releases()
    d, parking, token, delivered = _dispatcher(led)
    try:
        # a grant from another process wakes the parked thread
        w = parking.park(4, 2)
        sender = GrantSender(token)
        sender.send(0, [[4, 2]])
        assert w.event.wait(30) and w.outcome == GRANTED
        parking.unpark(w)
        sender.close()

        # the client closing its socket cancels the wait (epoll RDHUP): nothing else would
        # (a parked thread has no timeout of its own here)
        a, b = socket.socketpair()
        w = parking.park(5, 1, a.fileno())
        b.close()
        assert w.event.wait(30) and w.outcome == CANCELLED
        parking.unpark(w)
        a.close()

        # lingering seats are released when their time comes, not before: the release's clock
        # reading (the dispatcher's monotonic_ns) is at or after the linger's end
        until = time.monotonic_ns() + 150_000_000
        d.add_linger(until, 6, 3)
        deadline = time.monotonic() + 30
        while not led.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [(s, g) for s, g, _ in led.calls] == [(6, 3)]
        assert led.calls[0][2] >= until
        assert delivered == [(9, 1, 0)]
    finally:
        d.stop()
        d.join(2)


def test_worker_stop_wakes_parked_within_a_tick():
    alive = threading.Event()
    alive.set()
    d, parking, _, _ = _dispatcher(_Releases(), alive=alive.is_set)
    try:
        w = parking.park(1, 1)
        alive.clear()
        assert w.event.wait(30) and w.outcome == STOPPING
    finally:
        d.stop()
        d.join(2)
