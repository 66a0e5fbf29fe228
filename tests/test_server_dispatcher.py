"""Parking table and dispatcher thread: grants (direct, early, by datagram), disconnects seen
through epoll, worker stop, lingering-seat release timing."""

import os
import select
import socket
import threading
import time

from apf_gunicorn.admission.channel import GrantInbox, GrantSender
from apf_gunicorn.admission.dispatcher import (
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


def test_a_grant_before_park_is_not_kept_the_ledger_is_asked_instead():
    """A grant for a request that has not parked yet is dropped (a table of them let any sender
    fill memory with made-up slots); the thread asks the ledger when it parks."""
    p = Parking()
    p.grant(5, 1)
    w = p.park(5, 1)
    assert w.outcome == 0
    dispatched = {(5, 1)}
    assert p.wait(w, time.monotonic_ns() + 10**9, time.monotonic_ns,
                  lambda s, g: (s, g) in dispatched) == GRANTED
    assert len(p) == 0 and p.false_wakeups == 0


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
        sender = GrantSender(token, {0: d.inbox.name}.get)
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


class _RacingEpoll:
    """The parking epoll, with ``race`` run inside the poll that first reports ``fd``: after the
    kernel reported the event, before the dispatcher handles it (the window of the race)."""

    def __init__(self):
        self.ep = select.epoll()
        self.fd = -1
        self.race = None
        self.polls = 0

    def register(self, fd, mask):
        self.ep.register(fd, mask)

    def unregister(self, fd):
        self.ep.unregister(fd)

    def poll(self, timeout=-1):
        events = self.ep.poll(timeout)
        self.polls += 1
        if self.race is not None and any(fd == self.fd for fd, _ in events):
            race, self.race = self.race, None
            race()
        return events


def test_hang_up_of_a_closed_socket_does_not_cancel_the_request_that_reuses_its_fd():
    """The loop acted on fd numbers: a parked socket hung up, its request ended and closed it,
    and a new parked request got the same fd number before the event was handled: the new
    request was cancelled (answered 429, its client still there)."""
    ep = _RacingEpoll()
    parking = Parking(epoll=ep)
    token = f"r{os.getpid()}-{id(ep)}"
    inbox = GrantInbox(token, 0)
    d = Dispatcher(parking, inbox, _Releases(), owner=0, deliver=lambda g: None,
                   alive=lambda: True)
    a, a_peer = socket.socketpair()
    b, b_peer = socket.socketpair()
    fd = a.fileno()
    wa = parking.park(1, 1, fd)
    reused = {}

    def race():
        parking.unpark(wa)  # request A ended (say it was granted) and its socket closes
        a.close()
        os.dup2(b.fileno(), fd)  # request B's socket gets the same number
        reused["sock"] = socket.socket(fileno=fd)
        reused["w"] = parking.park(2, 1, fd)

    ep.fd, ep.race = fd, race
    d.start()
    try:
        a_peer.close()  # A's client hangs up
        deadline = time.monotonic() + 10
        while "w" not in reused and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "w" in reused, "the hang-up was never polled"
        seen = ep.polls
        while ep.polls < seen + 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # three more passes of the loop
        assert ep.polls >= seen + 3
        assert reused["w"].outcome == 0, "B was cancelled by A's hang-up"
        b_peer.close()  # B's own hang-up still cancels B
        assert reused["w"].event.wait(5) and reused["w"].outcome == CANCELLED
    finally:
        d.stop()
        d.join(2)
        inbox.close()
        for s in (reused.get("sock"), b):
            if s is not None:
                s.close()


def test_a_wake_up_the_ledger_does_not_confirm_waits_on():
    """A forged or stale grant naming a parked request's (slot, gen) woke it and it ran without
    seats (and its real dispatch later leaked them)."""
    p = Parking()
    dispatched = set()
    w = p.park(3, 7)
    out = []
    t = threading.Thread(target=lambda: out.append(
        p.wait(w, time.monotonic_ns() + 30 * 10**9, time.monotonic_ns,
               lambda s, g: (s, g) in dispatched)))
    t.start()
    try:
        p.grant(3, 7)  # forged: the ledger still has it waiting
        deadline = time.monotonic() + 10
        while p.false_wakeups < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.false_wakeups == 1 and not out, out
        dispatched.add((3, 7))  # the real dispatch, then its grant
        p.grant(3, 7)
        t.join(10)
        assert out == [GRANTED]
    finally:
        p.stop_all()
        t.join(10)
