"""The per-worker dispatcher thread and the table of parked request threads.

A request the ledger queued parks its thread on a :class:`Waiter` (a ``threading.Event`` plus
an outcome). Exactly one thing wakes it:

* a grant: from this process directly (:meth:`Parking.grant`), or from another worker as a
  datagram the dispatcher reads (:mod:`.channel`), or found by the dispatcher's 100 ms backstop
  scan of the ledger (a lost datagram costs at most 100 ms);
* the client going away: the dispatcher watches every parked socket in one ``epoll`` for
  ``EPOLLRDHUP``/``EPOLLHUP`` (outcome ``CANCELLED``);
* the worker stopping (``worker.alive`` false, or :meth:`Parking.stop_all` from
  ``worker_exit``): outcome ``STOPPING``, answered 503;
* or its own wait limit running out (the request thread's ``Event.wait`` timeout).

The dispatcher also releases lingering seats (Kubernetes' additional latency) when their time
is up, and delivers whatever those releases dispatch.

Usage (worker, in ``post_worker_init``)::

    parking = Parking()
    disp = Dispatcher(parking, inbox, ledger, owner=index, deliver=deliver, alive=lambda: worker.alive)
    disp.start()
    ...
    disp.add_linger(until_ns, slot, gen)      # from the request thread after ledger.finish
"""

from __future__ import annotations

import heapq
import logging
import os
import select
import threading
import time
from collections.abc import Callable

from apf_gunicorn.ledger.records import LedgerPort

log = logging.getLogger("apf_gunicorn.dispatcher")

GRANTED = 1
CANCELLED = 2
STOPPING = 3

TICK_S = 0.1
_EARLY_TTL_NS = 2_000_000_000
_SOCK_EVENTS = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR


class Waiter:
    __slots__ = ("slot", "gen", "event", "outcome", "fd", "since_ns")

    def __init__(self, slot: int, gen: int, fd: int, now_ns: int):
        self.slot = slot
        self.gen = gen
        self.event = threading.Event()
        self.outcome = 0
        self.fd = fd
        self.since_ns = now_ns


class Parking:
    """Parked requests of one worker, by slot; thread-safe."""

    def __init__(self, epoll: select.epoll | None = None):
        self._lock = threading.Lock()
        self._by_slot: dict[int, Waiter] = {}
        self._by_fd: dict[int, Waiter] = {}
        # Grants that arrived before their thread parked (admit returned QUEUED, another
        # process dispatched it at once): slot -> (gen, arrival ns).
        self._early: dict[int, tuple[int, int]] = {}
        self.epoll = epoll if epoll is not None else select.epoll()
        self.stopping = False

    def __len__(self) -> int:
        return len(self._by_slot)

    def park(self, slot: int, gen: int, fd: int = -1) -> Waiter:
        """Register a waiter; if its grant already came, it is returned already set."""
        w = Waiter(slot, gen, fd, time.monotonic_ns())
        with self._lock:
            early = self._early.pop(slot, None)
            if early is not None and early[0] == gen:
                w.outcome = GRANTED
                w.event.set()
                return w
            if self.stopping:
                w.outcome = STOPPING
                w.event.set()
                return w
            self._by_slot[slot] = w
            if fd >= 0:
                try:
                    self.epoll.register(fd, _SOCK_EVENTS)
                    self._by_fd[fd] = w
                except (OSError, ValueError):
                    w.fd = -1
        return w

    def unpark(self, w: Waiter) -> None:
        with self._lock:
            if self._by_slot.get(w.slot) is w:
                del self._by_slot[w.slot]
            self._drop_fd(w)

    def _drop_fd(self, w: Waiter) -> None:
        if w.fd >= 0 and self._by_fd.get(w.fd) is w:
            del self._by_fd[w.fd]
            try:
                self.epoll.unregister(w.fd)
            except (OSError, ValueError):
                pass

    def _wake(self, w: Waiter, outcome: int) -> None:
        if not w.outcome:
            w.outcome = outcome
            w.event.set()

    def grant(self, slot: int, gen: int) -> None:
        with self._lock:
            w = self._by_slot.get(slot)
            if w is not None and w.gen == gen:
                self._wake(w, GRANTED)
            elif w is None:
                self._early[slot] = (gen, time.monotonic_ns())

    def grant_many(self, pairs) -> None:
        for slot, gen in pairs:
            self.grant(slot, gen)

    def disconnected(self, fd: int) -> None:
        with self._lock:
            w = self._by_fd.get(fd)
            if w is not None:
                self._wake(w, CANCELLED)
                self._drop_fd(w)
            else:
                try:
                    self.epoll.unregister(fd)
                except (OSError, ValueError):
                    pass

    def stop_all(self) -> int:
        """Answer every parked request (and every later one) with STOPPING; returns how many."""
        with self._lock:
            self.stopping = True
            n = 0
            for w in self._by_slot.values():
                if not w.outcome:
                    n += 1
                self._wake(w, STOPPING)
            return n

    def waiting(self, older_than_ns: int) -> dict[int, int]:
        """{slot: gen} of waiters parked before ``older_than_ns`` and not yet woken."""
        with self._lock:
            return {w.slot: w.gen for w in self._by_slot.values()
                    if not w.outcome and w.since_ns < older_than_ns}

    def prune_early(self, now_ns: int) -> None:
        with self._lock:
            if self._early:
                for slot in [s for s, (_, t) in self._early.items() if now_ns - t > _EARLY_TTL_NS]:
                    del self._early[slot]


def granted_slots(ledger: LedgerPort, owner: int) -> dict[int, int]:
    """{slot: gen} of this owner's slots the ledger has dispatched (the backstop scan)."""
    return {slot: gen for slot, gen, st in ledger.owned_slots(owner) if st != "waiting"}


class Dispatcher(threading.Thread):
    """One per worker process; a daemon thread."""

    def __init__(self, parking: Parking, inbox, ledger: LedgerPort, *, owner: int,
                 deliver: Callable[[list], None], alive: Callable[[], bool],
                 clock: Callable[[], int] = time.monotonic_ns):
        super().__init__(name="apf-dispatcher", daemon=True)
        self.parking = parking
        self.inbox = inbox
        self.ledger = ledger
        self.owner = owner
        self.deliver = deliver
        self.alive = alive
        self.clock = clock
        self._lingers: list[tuple[int, int, int]] = []
        self._linger_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._running = True
        self.scans = self.rescued = 0

    def add_linger(self, until_ns: int, slot: int, gen: int) -> None:
        with self._linger_lock:
            first = not self._lingers or until_ns < self._lingers[0][0]
            heapq.heappush(self._lingers, (until_ns, slot, gen))
        if first:
            self._poke()

    def _poke(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except OSError:
            pass

    def stop(self) -> None:
        self._running = False
        self._poke()

    def release_all_lingers(self) -> None:
        """Release every lingering seat now (worker exit)."""
        with self._linger_lock:
            items, self._lingers = self._lingers, []
        for _, slot, gen in items:
            self._release(slot, gen)

    def _release(self, slot: int, gen: int) -> None:
        try:
            granted = self.ledger.release(slot, gen, self.clock())
            if granted:
                self.deliver(granted)
        except Exception:
            log.exception("apf: releasing lingering seats of slot %d failed", slot)

    def run(self) -> None:
        ep = self.parking.epoll
        inbox_fd = self.inbox.fileno()
        ep.register(inbox_fd, select.EPOLLIN)
        ep.register(self._wake_r, select.EPOLLIN)
        next_tick = time.monotonic() + TICK_S
        while self._running:
            now = time.monotonic()
            timeout = next_tick - now
            with self._linger_lock:
                if self._lingers:
                    timeout = min(timeout, (self._lingers[0][0] - self.clock()) / 1e9)
            try:
                events = ep.poll(max(0.0, timeout))
            except InterruptedError:
                continue
            except (OSError, ValueError):
                if not self._running:
                    return
                raise
            try:
                for fd, _ev in events:
                    if fd == inbox_fd:
                        self.parking.grant_many(self.inbox.receive())
                    elif fd == self._wake_r:
                        try:
                            os.read(self._wake_r, 4096)
                        except OSError:
                            pass
                    else:
                        self.parking.disconnected(fd)
                self._due_lingers()
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + TICK_S
                    self._tick()
            except Exception:
                # This thread is the only one that wakes parked requests and returns lingering
                # seats: log and go on, never die. (The backstop scan redoes a lost grant.)
                log.exception("apf: dispatcher step failed")
                next_tick = time.monotonic() + TICK_S

    def _due_lingers(self) -> None:
        now = self.clock()
        while True:
            with self._linger_lock:
                if not self._lingers or self._lingers[0][0] > now:
                    return
                _, slot, gen = heapq.heappop(self._lingers)
            self._release(slot, gen)

    def _tick(self) -> None:
        now = self.clock()
        if not self.alive():
            self.parking.stop_all()
        # Grants a lock repair found inside a call that could not return them.
        pending = self.ledger.pending_grants
        if pending:
            self.ledger.pending_grants = []
            self.deliver(pending)
        self.parking.prune_early(now)
        stuck = self.parking.waiting(now - int(TICK_S * 1e9))
        if not stuck:
            return
        self.scans += 1
        try:
            granted = granted_slots(self.ledger, self.owner)
        except Exception:
            log.exception("apf: backstop scan failed")
            return
        for slot, gen in stuck.items():
            g = granted.get(slot, -1)
            if g == gen or (slot in granted and g is None):
                self.rescued += 1
                self.parking.grant(slot, gen)
