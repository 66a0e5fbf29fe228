"""Sharing a worker's non-exempt threads fairly between flows.

A parked request (waiting in a fair queue) holds its thread. When a request finds every
non-exempt thread of its worker held (the thread reserve, gthread/worker.py), turning *it* away
would let a flood that parked on every thread shut every other flow out before fair queuing
sees them. Instead the **newest waiting request of the flow that holds the most parked
threads** gives up its thread: it is taken out of the ledger (``Ledger.cancel`` with reason
``thread-share``), its thread wakes and answers ``429``, and the arrival keeps the thread it is
on. The arrival is turned away itself (``thread-reserve``, as before) when its own flow holds
as many parked threads as any other, or no flow holds several (two or more). So a flow holding
one parked thread or none is never turned away for threads while another holds several, a
flow's only parked request is never taken, and a flow that parked on every thread while alone
gives them up as other flows arrive, down to one.

A flow is ``(priority level index, flow hash)``, as the ledger keys its queues. Only requests
that park are tracked (:meth:`ThreadShare.park` / :meth:`ThreadShare.leave`): a request that
runs at once costs nothing here.

Races. A victim is claimed under this object's lock, and its ``cancel`` runs under it too, so
the victim's thread, which calls :meth:`ThreadShare.leave` whatever woke it (a grant, its wait
limit, its client leaving, the worker stopping), learns the verdict only once it is final:

* ``cancel`` removed it: it answers ``429`` (``thread-share``) and neither cancels nor runs;
* ``cancel`` found it dispatched (granted concurrently): it runs as if nothing happened, and
  the arrival tries the flow's next victim (or another flow's), or is turned away.

Usage (gthread/wsgi.py)::

    share = ThreadShare()
    entry = share.park((level, flow_hash), slot, gen, waiter)    # the request parks
    ...
    if share.leave(entry): answer 429                            # its wait ended
    victim = share.evict((level, flow_hash), cancel)             # an arrival found no thread
    share.has_victim_for((level, flow_hash))                     # would it? (the poller asks)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger("apf_gunicorn.threadshare")

Flow = tuple[int, int]  # (priority level index, flow hash)
# A flow's only parked request is never taken: parked counts say nothing of the threads a flow
# runs, and a flood running on every other thread (none parked) would otherwise take a light
# user's one parked request for each of its newcomers.
MIN_VICTIM_PARKED = 2


def choose_victim(parked: Mapping[Flow, int], arrival: Flow) -> Flow | None:
    """The flow that gives a parked thread to an arrival that found none.

    Args:
        parked: parked threads per flow in this worker (flows with none may be absent);
            iteration order breaks ties: the first flow of those holding the most wins.
        arrival: the arriving request's flow.
    Returns:
        The flow holding the most parked threads when that is several (two or more) and more
        than ``arrival``'s own flow holds; None when the arrival itself is to be turned away
        (its flow holds the most, or ties it, or no flow holds several).
    """
    best, most = None, max(parked.get(arrival, 0), MIN_VICTIM_PARKED - 1)
    for flow, n in parked.items():
        if n > most:
            best, most = flow, n
    return best



def reserve_full(held: int, nonexempt_threads: int) -> bool:
    """The thread reserve's rule (``APF_EXEMPT_THREADS``): whether a worker whose non-exempt
    requests hold ``held`` threads has none left for another one. ``nonexempt_threads`` is its
    threads less the reserve; the reserve's threads are for exempt requests. The one copy the
    middleware (on a thread and for the poller) and the worker ask."""
    return held >= nonexempt_threads


class Parked:
    """One parked request: its ledger slot, its waiter (``dispatcher.Waiter``), and the
    verdict once an arrival claimed it."""

    __slots__ = ("flow", "slot", "gen", "waiter", "claimed", "evicted")

    def __init__(self, flow: Flow, slot: int, gen: int, waiter: Any):
        self.flow = flow
        self.slot = slot
        self.gen = gen
        self.waiter = waiter
        self.claimed = False  # an arrival took it out of the table
        self.evicted = False  # ... and the ledger removed it: it answers 429


class ThreadShare:
    """The parked requests of one worker, by flow, newest last; thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        # flow -> its parked requests, oldest first; a flow is deleted when it has none, so
        # the dict's order is the order in which flows began holding parked threads
        self._flows: dict[Flow, list[Parked]] = {}

    def counts(self) -> dict[Flow, int]:
        """Parked requests per flow (a copy, for dumps and tests)."""
        with self._lock:
            return {flow: len(v) for flow, v in self._flows.items()}

    def park(self, flow: Flow, slot: int, gen: int, waiter: Any) -> Parked:
        """Track a request that parks; pair with :meth:`leave` whatever its wait ends with.

        Args:
            flow: its ``(level index, flow hash)``.
            slot, gen: its ledger slot, as ``admit`` returned it.
            waiter: what ``Parking.park`` returned (woken when it is evicted).
        Returns:
            Its entry, for :meth:`leave`.
        """
        entry = Parked(flow, slot, gen, waiter)
        with self._lock:
            entries = self._flows.get(flow)
            if entries is None:
                self._flows[flow] = [entry]
            else:
                entries.append(entry)
        return entry

    def leave(self, entry: Parked) -> bool:
        """Stop tracking a request whose wait ended (whatever ended it).

        Returns:
            True when an arrival evicted it: the ledger no longer holds it (removed and
            counted as ``thread-share``) and its thread is no longer counted in the worker's
            thread reserve; the caller answers 429. False otherwise (go on as the wait's
            outcome says).
        """
        with self._lock:
            if entry.claimed:
                return entry.evicted
            entries = self._flows.get(entry.flow)
            if entries is not None:
                try:
                    entries.remove(entry)
                except ValueError:
                    pass
                if not entries:
                    del self._flows[entry.flow]
            return False

    def has_victim_for(self, arrival: Flow) -> bool:
        """Whether an arrival that found no thread would take another flow's parked thread
        now (:func:`choose_victim`): the poller's question before it answers 429 itself."""
        with self._lock:
            return choose_victim({f: len(v) for f, v in self._flows.items()}, arrival) is not None

    def evict(self, arrival: Flow, cancel: Callable[[int, int], bool]) -> Parked | None:
        """Take a parked thread for an arrival that found none (:func:`choose_victim`).

        Args:
            arrival: the arriving request's flow.
            cancel: removes a waiting request from the ledger (``Ledger.cancel`` with reason
                ``thread-share``); False when it was dispatched meanwhile. Called under this
                object's lock, so a victim's :meth:`leave` waits for the verdict.
        Returns:
            The evicted request (the caller wakes its waiter and hands its thread to the
            arrival), or None: turn the arrival away.
        """
        with self._lock:
            flows = self._flows
            while flows:
                victim = choose_victim({f: len(v) for f, v in flows.items()}, arrival)
                if victim is None:
                    return None
                entries = flows[victim]
                entry = entries.pop()
                if not entries:
                    del flows[victim]
                entry.claimed = True
                try:
                    entry.evicted = cancel(entry.slot, entry.gen)
                except Exception:
                    # Not known to be removed: it goes on as its wait ends (its own cancel
                    # asks the ledger again).
                    log.exception("apf: cancelling slot %d for another flow failed", entry.slot)
                if entry.evicted:
                    return entry
                # dispatched meanwhile: it runs; it is no longer parked, so look again
            return None
