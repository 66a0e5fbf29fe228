"""Parking for an event loop: queued ASGI requests await a future instead of holding a thread.

The asyncio flavour of :class:`apf_gunicorn.admission.dispatcher.Parking`, with the same face
towards the dispatcher thread (``grant``, ``grant_many``, ``stop_all``, ``waiting``,
``poll_mark``, ``disconnected``, ``epoll``), so one :class:`~.dispatcher.Dispatcher` serves
either. What differs:

* a waiter is a future of the worker's event loop; whoever wakes it from another thread (the
  dispatcher: grants from other workers, the backstop scan, ``stop_all``) hands the wake-up to
  the loop with ``call_soon_threadsafe``; on the loop thread it is set at once;
* a waiting request costs no thread, and nothing here blocks the loop: the table's lock is
  only ever held for a dict operation, and a ledger whose lock another process holds is asked
  again 1 ms later rather than waited for (``LockBusy``);
* the client going away is not seen through an ``epoll`` on its socket (an ASGI app has no
  socket): the front end watches ``receive()`` and calls :meth:`AsyncParking.cancel`.

Usage (``asgi/middleware.py``)::

    w = parking.park(slot, gen)                      # on the loop, after admit QUEUED
    outcome = await parking.wait(w, deadline_ns, clock, ledger.dispatched)
    parking.cancel(w)                                # from the disconnect watcher
"""

from __future__ import annotations

import asyncio
import logging
import select
import threading
import time
from collections.abc import Callable

from apf_gunicorn.admission.dispatcher import CANCELLED, GRANTED, STOPPING, ParkingTable
from apf_gunicorn.ledger.lock import LockBusy

log = logging.getLogger("apf_gunicorn.dispatcher")

RECHECK_S = 0.001  # a ledger whose lock was busy is asked again this soon


class AsyncWaiter:
    """One queued request: ``outcome`` 0 while it waits, else what woke it (GRANTED is a hint
    until the ledger confirms it); ``fut`` is resolved to wake it."""

    __slots__ = ("slot", "gen", "outcome", "fut", "since_ns")

    def __init__(self, slot: int, gen: int, fut: asyncio.Future, now_ns: int):
        self.slot = slot
        self.gen = gen
        self.outcome = 0
        self.fut = fut
        self.since_ns = now_ns


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _resolve_waiter(w: AsyncWaiter) -> None:
    # reads w.fut when it runs on the loop: a waiter that took a new future since the
    # wake-up was scheduled is woken too (it checks again and waits on)
    _resolve(w.fut)


class AsyncParking(ParkingTable):
    """Queued requests of one worker's event loop, by slot; its waking side is thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_slot: dict[int, AsyncWaiter] = {}
        # the dispatcher polls this for the grant socket and its own wake-up pipe
        self.epoll = select.epoll()
        self.stopping = False
        self.false_wakeups = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0

    def park(self, slot: int, gen: int) -> AsyncWaiter:
        """Register a waiter for ``(slot, gen)``; call on the event loop."""
        loop = self._loop
        if loop is None:  # the first queued request binds the loop (it runs after the fork)
            loop = self._loop = asyncio.get_running_loop()
            self._loop_thread = threading.get_ident()
        w = AsyncWaiter(slot, gen, loop.create_future(), time.monotonic_ns())
        with self._lock:
            if self.stopping:
                w.outcome = STOPPING
            else:
                self._by_slot[slot] = w
        return w

    async def wait(self, w: AsyncWaiter, deadline_ns: int, clock: Callable[[], int],
                   dispatched: Callable[[int, int], bool]) -> int:
        """Await until ``w``'s request may run, it is cancelled, the worker stops or
        ``deadline_ns`` (``clock``'s) passes; then unpark it.

        As with threads, GRANTED is a hint: the request runs only if ``dispatched(slot, gen)``
        (the ledger) says so, else it waits on. The hint is taken back under the lock before
        the ledger is read, so a real grant that arrives meanwhile wakes it again.

        Returns:
            GRANTED (run it), CANCELLED, STOPPING, or 0 (the deadline passed).
        Raises:
            asyncio.CancelledError: the request's task was cancelled (it is unparked).
        """
        loop = self._loop
        slot, gen = w.slot, w.gen
        try:
            while True:
                with self._lock:
                    outcome = w.outcome
                    if outcome == GRANTED:
                        w.outcome = 0
                    elif outcome:
                        return outcome
                if w.fut.done():
                    w.fut = loop.create_future()
                busy = False
                try:
                    if dispatched(slot, gen):
                        return GRANTED
                except LockBusy:  # confirming needs the lock, held elsewhere: ask again soon
                    busy = True
                except Exception:  # noqa: BLE001 - wait on: after_wait's cancel asks again
                    log.exception("apf: checking slot %d in the ledger failed", slot)
                if outcome == GRANTED and not busy:
                    self.false_wakeups += 1
                remaining = deadline_ns - clock()
                if remaining <= 0:
                    return 0
                fut = w.fut
                delay = remaining / 1e9
                timer = loop.call_later(min(delay, RECHECK_S) if busy else delay, _resolve, fut)
                try:
                    await fut
                finally:
                    timer.cancel()
        finally:
            self.unpark(w)

    def unpark(self, w: AsyncWaiter) -> None:
        with self._lock:
            if self._by_slot.get(w.slot) is w:
                del self._by_slot[w.slot]

    def _wake(self, w: AsyncWaiter, outcome: int) -> None:
        """Set ``w``'s outcome and wake it (call holding the lock). CANCELLED and STOPPING
        replace an unconfirmed GRANTED (``Admission.after_wait`` handles a dispatched request
        answered either way)."""
        if w.outcome and not (w.outcome == GRANTED and outcome != GRANTED):
            return
        w.outcome = outcome
        if threading.get_ident() == self._loop_thread:
            try:
                _resolve(w.fut)
            except RuntimeError:  # its loop is closed (worker_exit): nobody waits any more
                pass
            return
        try:
            self._loop.call_soon_threadsafe(_resolve_waiter, w)
        except RuntimeError:  # the loop is closed: the worker is exiting, nobody waits
            pass

    def stop(self, w: AsyncWaiter) -> None:
        """Wake ``w`` with STOPPING: the worker is stopping (on the loop)."""
        with self._lock:
            self._wake(w, STOPPING)

    def cancel(self, w: AsyncWaiter) -> None:
        """Wake ``w`` with CANCELLED: its client went away (on the loop)."""
        with self._lock:
            self._wake(w, CANCELLED)

    def drain(self, timeout_s: float) -> None:
        """Nothing to wait for: ``worker_exit`` runs after the event loop has ended (the
        server's shutdown answered queued requests; the worker's reap frees their slots)."""

    def poll_mark(self) -> int:
        return 0  # no client sockets in the dispatcher's epoll

    def disconnected(self, fd: int, mark: int) -> None:
        """Never called with a client's fd (none are registered); drop a stray one."""
        try:
            self.epoll.unregister(fd)
        except (OSError, ValueError):
            pass
