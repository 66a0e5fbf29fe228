"""The server limit read from the app's connection pools (with no limit set, and ``auto``'s first
signal).

A request that holds an APF seat and then waits for a pooled connection waits inside the app,
first come first served, where the fair queues cannot help: the seats of the level that floods
should stop where its requests begin to queue on the pool. This rule finds that point from the
pools' own signals, once a tick (the master's, ``master/poollimit.py``):

* **start** (the first tick that sees a bounded pool): the level's seats are the pool's
  server-wide capacity, so the server limit is that capacity divided by the share of the level
  that floods (the smallest limit whose ``ceil(limit x share)`` is the capacity, as
  ``flowcontrol/limits.py`` rounds a level's seats);
* **follow the capacity**: when workers come or go, the largest pool's capacity changes and
  the seats move by as much;
* **step down** when requests waited for a pool over the tick (its mean number waiting, the
  rate of its cumulative wait time, is at least ``down_at``): those requests held seats the
  pool could not serve, so the level gives back as many seats, down to the connections the
  requests can have: the pool's capacity less those held by something other than a request
  (another tenant's job, a thread of the app's own): the connections in use and waited for
  beyond the requests in flight (``executing``, the seats held server-wide), counted from
  :data:`HELD_NOISE` of them two ticks running (the workers' samples are of different
  instants). With nothing else holding any, that is the pool's size: requests spread unevenly
  over the workers' pools wait a little there, which is no reason to leave connections idle;
* **step up** when no pool was waited for, some connections stood idle and the limit was
  binding (requests queued in APF or were turned away) in this tick and the one before (a
  pool's reading lags by up to a window): back to the most seats the level held before a
  pool made it step down, at once, as far as the idle connections go (a tenant gave its
  connections back); above those, one seat a tick (part of each request does not hold a
  connection, so the knee can be above the pool's size);
* **the others give back**: when two ticks running show fewer connections held outside
  requests, the seats rise to the connections left;
* **what a move down already gave back** is not given again: a move shows in the pools'
  readings from their next window, up to a tick later, so the tick after a move down counts
  only the waiting beyond the seats that move gave back (a move up, bounded by the idle
  connections and by the seats once served, needs no such care);
* **hold** otherwise (a saturated pool nobody waits for is at its knee; a limit that does not
  bind gains nothing from more seats).

With the master's one-second tick and the workers' one-second windows, the seats follow a
change of the capacity the requests can use (another tenant taking half the connections, or
giving them back) within three ticks (``tests/test_poollimit.py`` drives it against a model
of a pool whose readings lag the ticks).

The server limit never exceeds ``ceiling`` (the default limit). Time comes from the caller
(``now`` in monotonic ns), so the rule is tested without a clock::

    rule = PoolLimit(ceiling=20)
    d = rule.update(now, pools, share=0.8, binding=True, executing=12)  # None: no pool
    if d.changed: apply(d.limit)                          # d.reason says why
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

#: a pool's connections held outside requests count from this many (a tick's count is off by
#: a connection or so: the workers' samples are of different instants)
HELD_NOISE = 2


class PoolSignal(Protocol):
    """One pool summed over the workers (``signals.table.PoolTotals`` has these)."""

    name: str
    kind: str
    capacity: int  # <= 0: unbounded or not published now
    in_use: int
    waiting: int
    wait_ns: int  # cumulative time waited for a connection
    workers: int  # workers that have it


@dataclass(frozen=True)
class PoolLimitSettings:
    """The rule's thresholds, in requests waiting on average over a tick."""

    down_at: float = 0.5  # step down from this mean number waiting
    up_below: float = 0.05  # step up only below this

    def __post_init__(self) -> None:
        if not 0 <= self.up_below <= self.down_at:
            raise ValueError("PoolLimitSettings needs 0 <= up_below <= down_at, got "
                             f"up_below={self.up_below}, down_at={self.down_at}")


@dataclass(frozen=True)
class PoolDecision:
    """A tick's outcome: the server ``limit``, the flooding level's ``seats`` it stands for,
    whether the limit ``changed`` and the ``reason`` (for the log); on the first (the start
    from the pools), ``found`` says what was found (:func:`describe_pools`)."""

    limit: int
    seats: int
    changed: bool
    reason: str
    found: str = ""


def describe_pools(pools: Iterable[PoolSignal]) -> str:
    """``2 SQLAlchemy pools, 8 connections server-wide`` (per kind, bounded pools only)."""
    kinds = {"sqlalchemy": "SQLAlchemy", "psycopg_pool": "psycopg_pool", "django": "Django",
             "resource": "apf_gunicorn.resource"}
    per_kind: dict[str, int] = {}
    total = 0
    for p in pools:
        if p.capacity > 0:
            label = kinds.get(p.kind, p.kind or "other")
            per_kind[label] = per_kind.get(label, 0) + max(p.workers, 1)
            total += p.capacity
    parts = [f"{n} {label} pool{'s' if n != 1 else ''}" for label, n in per_kind.items()]
    return f"{', '.join(parts)}, {total} connections server-wide"


class PoolLimit:
    """The pool rule (module docstring). ``ceiling``: the highest server limit it sets."""

    def __init__(self, ceiling: int, settings: PoolLimitSettings | None = None) -> None:
        if ceiling < 1:
            raise ValueError(f"PoolLimit ceiling must be >= 1, got {ceiling}")
        self.ceiling = ceiling
        self.settings = settings or PoolLimitSettings()
        self.seats: int | None = None  # the flooding level's seats; None until a pool is seen
        self.limit: int | None = None
        self._waited: dict[str, int] = {}
        self._since: int | None = None
        self._capacity = 0  # the largest bounded pool's, server-wide
        self._binding = False  # the last tick's
        self._gave = 0  # seats the last tick's move down gave back
        self._executing = 0  # the last tick's
        self._outside: dict[str, int] = {}  # connections held outside requests, last tick
        self._held: dict[str, int] = {}  # ... as two ticks running agree
        self._served = 0  # the most seats the level held before a pool made it step down

    def _held_outside(self, pools: list[PoolSignal], in_flight: int) -> dict[str, int]:
        """Per pool, the connections held by something other than a request (another
        tenant's job, a thread of the app's own): each request holds a seat, so those in use
        and waited for beyond the requests in flight. The workers' samples are of different
        instants, and requests move between workers in between, so a tick's count is off by
        a connection or two either way: the estimate rises only when two ticks running show
        at least two, and more than it, and falls when two ticks running show fewer. (Once it
        is not zero, a tick whose requests wait counts what that tick shows, if more.)"""
        now = {p.name: max(0, p.in_use + p.waiting - in_flight) for p in pools}
        before, self._outside = self._outside, now
        for p in pools:
            lo, hi = sorted((now[p.name], before.get(p.name, 0)))
            held = self._held.get(p.name, 0)
            if lo >= max(held + 1, HELD_NOISE):
                held = lo
            elif hi < held:
                held = hi
            self._held[p.name] = min(held, p.capacity - 1)
        return {p.name: self._held[p.name] for p in pools}

    def _limit_for(self, seats: int, share: float) -> int:
        # the smallest server limit that gives the level ``seats``: a level's nominal seats
        # are ceil(limit x share) (flowcontrol/limits.py)
        limit = max(1, math.floor((seats - 1) / share) - 1)
        while math.ceil(limit * share - 1e-9) < seats:
            limit += 1
        return min(self.ceiling, limit)

    def keep(self, limit: int, share: float) -> None:
        """The caller applied ``limit`` instead of the last decision's (``auto``: the CPU
        refused a rise, or its bounds clamped it): the rule goes on from there, so its next
        move is from the seats the level has.

        Raises:
            ValueError: ``limit`` below 1 or ``share`` out of range.
        """
        if limit < 1 or not 0 < share <= 1:
            raise ValueError(f"keep needs limit >= 1 and share in (0, 1], got {limit}, {share}")
        self.limit = limit
        self.seats = max(1, math.ceil(limit * share - 1e-9))

    def update(self, now: int, pools: Iterable[PoolSignal], share: float,
               binding: bool, executing: int) -> PoolDecision | None:
        """One tick.

        Args:
            now: monotonic ns.
            pools: every pool server-wide (unbounded ones and ones no live worker has now are
                left out).
            share: the fraction of the server limit the flooding level holds (0 < share <= 1).
            binding: whether the limit was binding over the tick.
            executing: the seats requests hold server-wide now, in every level.
        Returns:
            The decision, or None while no bounded pool is known (the limit is not the rule's).
        Raises:
            ValueError: ``share`` out of range.
        """
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        bounded = [p for p in pools if p.capacity > 0]
        previous, since = self._waited, self._since
        self._waited = {p.name: p.wait_ns for p in bounded}
        self._since = now
        # a pool's reading is up to a window old: a flood that has just begun shows the pool
        # idle, so a step up needs the limit binding in two ticks running
        binding_before, self._binding = self._binding, binding
        # a move shows in the pools' readings from their next window, up to a tick later:
        # the tick after a move down may still count the waiting that move ended
        gave, self._gave = self._gave, 0
        # the pools' samples were taken since the last tick: as many requests as then or now
        in_flight, self._executing = max(self._executing, executing), executing
        if not bounded:
            return None
        largest = max(bounded, key=lambda p: p.capacity)
        capacity, self._capacity = self._capacity, largest.capacity
        if self.seats is None:
            self.seats = self._served = largest.capacity
            self.limit = self._limit_for(self.seats, share)
            found = describe_pools(bounded)
            return PoolDecision(self.limit, self.seats, True,
                                f"limit from pools: {found}; {self.seats} seats for the "
                                f"busiest level (share {share:.2f})", found)
        if capacity != largest.capacity:  # workers came or went: the knee moves with them
            self.seats = max(1, self.seats + largest.capacity - capacity)
            self._served = max(1, self._served + largest.capacity - capacity)
            limit, self.limit = self.limit, self._limit_for(self.seats, share)
            return PoolDecision(self.limit, self.seats, limit != self.limit,
                                f"pool {largest.name}: capacity {capacity} -> "
                                f"{largest.capacity} server-wide: {self.seats} seats")
        elapsed_s = (now - since) / 1e9 if since is not None and now > since else 0.0
        worst, worst_waiting = None, 0.0
        for p in bounded:
            if elapsed_s > 0 and p.name in previous:
                mean = max(0, p.wait_ns - previous[p.name]) / 1e9 / elapsed_s
            else:
                mean = float(p.waiting)  # first sight of this pool: its sample
            if worst is None or mean > worst_waiting:
                worst, worst_waiting = p, mean
        assert worst is not None and self.limit is not None
        held = self._held_outside(bounded, in_flight)
        seats, reason = self.seats, ""
        idle = min(p.capacity - p.in_use for p in bounded)
        if worst_waiting >= self.settings.down_at:
            beyond = worst_waiting - gave
            # with nothing else holding connections the level keeps the pool's size: requests
            # spread unevenly over the workers' pools wait a little there
            others = held[worst.name]
            if others:  # someone holds some: while requests wait, a tick's count of them
                others = min(worst.capacity - 1, max(others, self._outside[worst.name]))
                held[worst.name] = self._held[worst.name] = others
            floor = min(seats, worst.capacity - others)
            if beyond >= self.settings.down_at and seats > floor:
                # the requests that waited held seats the pool could not serve: give them back
                self._served = max(self._served, seats)
                seats = max(floor, seats - max(1, round(beyond)))
                self._gave = self.seats - seats
            reason = (f"pool {worst.name}: {worst_waiting:.1f} waiting"
                      + (f" ({gave} seats given back a tick ago)" if gave else "")
                      + f", {worst.in_use} of {worst.capacity} in use"
                      + (f", {others} held outside requests" if others else ""))
        elif (worst_waiting < self.settings.up_below and binding and binding_before
              and idle > 0
              and self._limit_for(seats, share) < self.ceiling):
            # connections stood idle while the limit bound: back to the seats the pool
            # served before it made the level step down, at once (a tenant gave its
            # connections back), and above them one at a time (the knee above the pool's
            # size: part of each request holds no connection)
            seats = min(max(seats + 1, min(seats + idle, self._served)),
                        math.ceil(self.ceiling * share - 1e-9))
            busiest = max(bounded, key=lambda p: p.in_use / p.capacity)
            reason = (f"pool {busiest.name}: none waiting, {busiest.in_use} of "
                      f"{busiest.capacity} in use, limit binding")
        # connections the others gave back: at least as many seats as the requests can have
        room, tightest = min((p.capacity - held[p.name], p.name) for p in bounded)
        if seats < room:
            seats = min(room, math.ceil(self.ceiling * share - 1e-9))
            reason = f"pool {tightest}: fewer held outside requests ({held[tightest]})"
        self.seats = seats
        limit = self._limit_for(seats, share)
        changed = limit != self.limit
        self.limit = limit
        return PoolDecision(limit, seats, changed,
                            f"{reason}: {seats} seats" if reason else f"{seats} seats")
