"""The per-worker dispatcher thread and the table of parked request threads.

A request the ledger queued parks its thread on a :class:`Waiter` (a ``threading.Event`` plus
an outcome) and waits in :meth:`Parking.wait`. These wake it:

* a grant: from this process directly (:meth:`Parking.grant`), or from another worker as a
  datagram the dispatcher reads (:mod:`.channel`), or found by the dispatcher's 100 ms backstop
  scan of the ledger (a lost datagram costs at most 100 ms). A grant is only a hint: the
  request runs only if the ledger says it was dispatched with its generation
  (``Ledger.dispatched``), otherwise it waits on (a stale or forged grant runs nothing). The
  ledger is also asked once at park time, so a grant that came before the thread parked is
  never needed;
* the client going away: the dispatcher watches every parked socket in one ``epoll`` for
  ``EPOLLRDHUP``/``EPOLLHUP`` (outcome ``CANCELLED``). An event names an fd number, which a
  closed socket's successor may reuse before the event is handled: an event counts only for a
  registration older than the ``epoll_wait`` that returned it (:meth:`Parking.poll_mark`);
* the worker stopping (``worker.alive`` false, or :meth:`Parking.stop_all` from
  ``worker_exit``): outcome ``STOPPING``, answered 503;
* another request of its worker taking its thread (:meth:`Parking.evict`, outcome ``EVICTED``;
  ``gthread/threadshare.py``: the ledger has already removed it);
* or its own wait limit running out.

The dispatcher also releases lingering seats (Kubernetes' additional latency) when their time
is up, finishes the requests a finalizer handed over (:meth:`Dispatcher.finish_later`: a
finalizer may run on a thread that holds the ledger lock, so it never takes it), and delivers
whatever those calls dispatch.

Usage (worker, in ``post_worker_init``)::

    parking = Parking()
    disp = Dispatcher(parking, inbox, ledger, owner=index, deliver=deliver, alive=lambda: worker.alive)
    disp.start()
    ...
    w = parking.park(slot, gen, fd)           # from the request thread after admit QUEUED
    outcome = parking.wait(w, deadline_ns, clock, ledger.dispatched)
    disp.add_linger(until_ns, slot, gen)      # from the request thread after ledger.finish
    disp.finish_later(slot, gen)              # from a finalizer
"""

from __future__ import annotations

import heapq
import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable

from apf_gunicorn.ledger.lock import LockBusy
from apf_gunicorn.ledger.records import LedgerPort

log = logging.getLogger("apf_gunicorn.dispatcher")

GRANTED = 1
CANCELLED = 2
STOPPING = 3
EVICTED = 4

TICK_S = 0.1
_SOCK_EVENTS = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR


class Waiter:
    """One parked request: ``outcome`` 0 while it waits, else what woke it (GRANTED is a hint
    until the ledger confirms it, see :meth:`Parking.wait`)."""

    __slots__ = ("slot", "gen", "event", "outcome", "fd", "since_ns", "reg")

    def __init__(self, slot: int, gen: int, fd: int, now_ns: int):
        self.slot = slot
        self.gen = gen
        self.event = threading.Event()
        self.outcome = 0
        self.fd = fd
        self.since_ns = now_ns
        self.reg = 0  # when its fd was registered (Parking's registration count)


class ParkingTable:
    """What both parkings share (this module's :class:`Parking` for threads,
    ``asyncparking.AsyncParking`` for an event loop): the table of waiters by slot under a
    lock, and the dispatcher's side of it. A subclass sets ``_lock``, ``_by_slot``,
    ``stopping`` and ``epoll`` (what the dispatcher polls), wakes a waiter in
    ``_wake(w, outcome)`` (called holding the lock) and answers ``poll_mark`` and
    ``disconnected`` (client sockets it watches, if any)."""

    _lock: threading.Lock
    _by_slot: dict
    stopping: bool

    def _wake(self, w, outcome: int) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._by_slot)

    def grant(self, slot: int, gen: int) -> None:
        """Wake the request parked on ``(slot, gen)``, if any; from any thread (a grant for
        nobody is dropped: a request that parks later asks the ledger first)."""
        with self._lock:
            w = self._by_slot.get(slot)
            if w is not None and w.gen == gen:
                self._wake(w, GRANTED)

    def grant_many(self, pairs) -> None:
        for slot, gen in pairs:
            self.grant(slot, gen)

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

    def drain(self, timeout_s: float) -> None:
        """After :meth:`stop_all` (``worker_exit``): give the woken requests up to
        ``timeout_s`` to answer 503 and unpark."""
        deadline = time.monotonic() + timeout_s
        while len(self._by_slot) and time.monotonic() < deadline:
            time.sleep(0.01)  # parked threads answer 503 and unpark


class Parking(ParkingTable):
    """Parked requests of one worker, by slot; thread-safe."""

    def __init__(self, epoll: select.epoll | None = None):
        self._lock = threading.Lock()
        self._by_slot: dict[int, Waiter] = {}
        self._by_fd: dict[int, Waiter] = {}
        self.epoll = epoll if epoll is not None else select.epoll()
        self.stopping = False
        self._registrations = 0
        # wake-ups the ledger did not confirm (stale or forged grants), for tests and dumps
        self.false_wakeups = 0

    def park(self, slot: int, gen: int, fd: int = -1) -> Waiter:
        """Register a waiter (and its client socket ``fd`` for hang-ups, if >= 0)."""
        w = Waiter(slot, gen, fd, time.monotonic_ns())
        with self._lock:
            if self.stopping:
                w.outcome = STOPPING
                w.event.set()
                return w
            self._by_slot[slot] = w
            if fd >= 0:
                try:
                    self.epoll.register(fd, _SOCK_EVENTS)
                    self._registrations += 1
                    w.reg = self._registrations
                    self._by_fd[fd] = w
                except (OSError, ValueError):
                    w.fd = -1
        return w

    def wait(self, w: Waiter, deadline_ns: int, clock: Callable[[], int],
             dispatched: Callable[[int, int], bool]) -> int:
        """Block until ``w``'s request may run, its client leaves, the worker stops or
        ``deadline_ns`` (``clock``'s) passes; then unpark it.

        A GRANTED wake-up is a hint: the request runs only if ``dispatched(slot, gen)`` (the
        ledger) says so, else it waits on and the wake-up is counted in ``false_wakeups``. The
        hint is taken back under the lock *before* the ledger is read, so a real grant that
        arrives meanwhile sets the event again and is never lost.

        Returns:
            GRANTED (run it), CANCELLED, STOPPING, EVICTED, or 0 (the deadline passed).
        """
        slot, gen = w.slot, w.gen
        try:
            while True:
                with self._lock:
                    outcome = w.outcome
                    if outcome == GRANTED:
                        w.outcome = 0
                        w.event.clear()
                    elif outcome:
                        return outcome
                try:
                    if dispatched(slot, gen):
                        return GRANTED
                except Exception:  # noqa: BLE001 - wait on: the caller's cancel at the deadline
                    # asks the ledger again and runs the request if it was dispatched
                    log.exception("apf: checking slot %d in the ledger failed", slot)
                if outcome == GRANTED:
                    self.false_wakeups += 1
                remaining = deadline_ns - clock()
                if remaining <= 0:
                    return 0
                w.event.wait(remaining / 1e9)
        finally:
            self.unpark(w)

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
        # CANCELLED, STOPPING and EVICTED replace an unconfirmed GRANTED (the waiter handles a
        # dispatched request answered either way: Middleware._wait)
        if not w.outcome or (w.outcome == GRANTED and outcome != GRANTED):
            w.outcome = outcome
            w.event.set()

    def evict(self, w: Waiter) -> None:
        """Wake ``w``'s thread with EVICTED: another request of this worker took its thread,
        and the ledger no longer holds it (``gthread/threadshare.py``)."""
        with self._lock:
            self._wake(w, EVICTED)

    def poll_mark(self) -> int:
        """Take before ``epoll.poll``: :meth:`disconnected` ignores registrations made later."""
        return self._registrations

    def disconnected(self, fd: int, mark: int) -> None:
        """An ``epoll`` event (hang-up) for ``fd`` from a poll that began at ``mark``."""
        with self._lock:
            w = self._by_fd.get(fd)
            if w is None:
                try:
                    self.epoll.unregister(fd)
                except (OSError, ValueError):
                    pass
            elif w.reg <= mark:
                self._wake(w, CANCELLED)
                self._drop_fd(w)
            # else: registered after the poll began, so the event was its predecessor's (a closed
            # socket whose number was reused); epoll is level-triggered: if this socket did hang
            # up, the next poll says so again

def finish_request(finish: Callable[[int, int, int], tuple[list, int]],
                   deliver: Callable[[list], None], add_linger: Callable[[int, int, int], None],
                   slot: int, gen: int, now: int) -> None:
    """End a request's main phase in the ledger and hand on what that frees.

    Args:
        finish: ``Ledger.finish``; deliver: wakes the requests it dispatched; add_linger:
            schedules the release of its lingering seats (``Dispatcher.add_linger``).
        slot, gen: the request; now: monotonic ns.
    Never raises but ``LockBusy`` (only on an event loop's thread, with nothing done): a failed
    finish is logged (the seats stay taken until the worker's reap).
    """
    try:
        granted, linger_until = finish(slot, gen, now)
    except LockBusy:
        raise  # nothing done: an event loop's caller hands it to the dispatcher thread
    except Exception:
        log.exception("apf: finish failed for slot %d", slot)
        return
    if granted:
        deliver(granted)
    if linger_until:
        add_linger(linger_until, slot, gen)


def granted_slots(ledger: LedgerPort, owner: int) -> dict[int, int]:
    """{slot: gen} of this owner's slots the ledger has dispatched (the backstop scan)."""
    return {slot: gen for slot, gen, st in ledger.owned_slots(owner) if st != "waiting"}


class Dispatcher(threading.Thread):
    """One per worker process; a daemon thread."""

    def __init__(self, parking: ParkingTable, inbox, ledger: LedgerPort, *, owner: int,
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
        # requests whose finalizer gave their seats back: (slot, gen); appended from any
        # thread without a lock (deque.append is atomic), finished here
        self._finishes: deque[tuple[int, int]] = deque()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._running = True
        self.scans = self.rescued = 0

    def add_linger(self, until_ns: int, slot: int, gen: int) -> None:
        with self._linger_lock:
            first = not self._lingers or until_ns < self._lingers[0][0]
            heapq.heappush(self._lingers, (until_ns, slot, gen))
        if first:
            self._poke()

    def finish_later(self, slot: int, gen: int) -> None:
        """Finish ``(slot, gen)`` on this thread soon. Takes no lock, so a finalizer may call it
        whatever its thread holds (the ledger lock is not reentrant)."""
        self._finishes.append((slot, gen))
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
        """Finish what finalizers handed over and release every lingering seat now (worker
        exit)."""
        self._due_finishes()
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
            mark = self.parking.poll_mark()
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
                        self.parking.disconnected(fd, mark)
                if self._finishes:
                    self._due_finishes()
                self._due_lingers()
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + TICK_S
                    self._tick()
            except Exception:
                # This thread is the only one that wakes parked requests and returns lingering
                # seats: log and go on, never die. (The backstop scan redoes a lost grant.)
                log.exception("apf: dispatcher step failed")
                next_tick = time.monotonic() + TICK_S

    def _due_finishes(self) -> None:
        finishes = self._finishes
        while True:
            try:  # (worker_exit drains it from another thread as well)
                slot, gen = finishes.popleft()
            except IndexError:
                return
            finish_request(self.ledger.finish, self.deliver, self.add_linger, slot, gen,
                           self.clock())

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
