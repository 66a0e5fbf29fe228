"""Each server's load state, summarised for the load balancer in front (docs/load-balancers.md).

Two exports read the same lock-free summary of the ledger (:meth:`Ledger.load`):

* the HAProxy agent-check weight (:func:`weight_percent`, served by ``master/agent.py``);
* ORCA load reports on responses (:class:`OrcaReport`, ``APF_LOAD_REPORT=orca``): the
  ``endpoint-load-metrics`` header in Envoy's TEXT encoding, plus ``x-envoy-ratelimited`` on
  429s so Envoy does not retry a rejected request on the same host.

Usage::

    load = summarize(ledger.load())
    weight_percent(load)                       # 100 idle ... 1 saturated
    orca = OrcaReport(ledger.load, {0: "work"})
    headers = orca.extend(route_headers, time.monotonic_ns())   # cached for 100 ms

The weight formula (docs/load-balancers.md): the server's *demand* is the seats its
non-exempt levels use plus the seats their queued requests ask for, over the sum of their
current concurrency limits; a level that has requests queued counts at least with its own
demand (it is full, and rejects next). Then

    weight = 100 * 10 ** -demand     (in percent, rounded, at least 1)

100% idle, 56% a quarter busy, 32% half busy, 10% full, 3% with a queue of half the limit, 1%
from twice the limit. It keeps falling past saturation, so of two saturated servers the one
with more room in its queues still gets more traffic. Exempt levels take no seats of the limit
and are left out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from math import isfinite
from typing import NamedTuple

log = logging.getLogger("apf_gunicorn.loadreport")

ORCA_HEADER = "endpoint-load-metrics"
RATELIMITED = ("x-envoy-ratelimited", "true")
REFRESH_NS = 100_000_000  # a worker recomputes its ORCA header at most every 100 ms
RATE_WINDOW_NS = 1_000_000_000  # rps_fractional: dispatches over the last window of >= 1 s
WEIGHT_FLOOR = 1  # percent: a saturated server keeps a trickle (0 would be HAProxy's drain)
WEIGHT_DEMAND_CAP = 4.0  # demand beyond this changes nothing (the weight is 1% from 2.0)


class ServerLoad(NamedTuple):
    """The server-wide sums the exports are computed from."""

    limit: int  # sum of the non-exempt levels' current concurrency limits
    seats_in_use: int  # non-exempt levels
    seats_waiting: int  # non-exempt levels
    queuing_levels: int  # non-exempt levels with requests waiting
    queuing_demand: float  # max over those of (seats in use + seats waiting) / their limit
    dispatched: int  # all levels, cumulative
    rejected: int  # all levels, cumulative
    levels: tuple  # ((index, seats in use, limit), ...) of the non-exempt levels


def summarize(levels: Iterable) -> ServerLoad:
    """Sum :class:`~apf_gunicorn.ledger.ledger.LevelLoad` rows into a :class:`ServerLoad`.

    Args:
        levels: what ``Ledger.load()`` returned.

    Returns:
        The server-wide sums.
    """
    limit = in_use = waiting = queuing = dispatched = rejected = 0
    queuing_demand = 0.0
    per_level = []
    for lv in levels:
        dispatched += lv.dispatched
        rejected += lv.rejected
        if lv.exempt:
            continue
        limit += lv.concurrency_limit
        in_use += lv.seats_in_use
        waiting += lv.seats_waiting
        if lv.requests_waiting:
            queuing += 1
            demand = (lv.seats_in_use + lv.seats_waiting) / max(1, lv.concurrency_limit)
            queuing_demand = max(queuing_demand, demand)
        per_level.append((lv.index, lv.seats_in_use, lv.concurrency_limit))
    return ServerLoad(limit, in_use, waiting, queuing, queuing_demand, dispatched, rejected,
                      tuple(per_level))


def demand(load: ServerLoad) -> float:
    """(seats in use + seats waiting) / limit, at least the busiest queuing level's own."""
    busy = load.seats_in_use + load.seats_waiting
    if load.limit <= 0:
        server = 0.0 if busy <= 0 else float(WEIGHT_DEMAND_CAP)
    else:
        server = busy / load.limit
    return max(server, load.queuing_demand)


def weight_percent(load: ServerLoad) -> int:
    """The agent-check weight: ``100 * 10 ** -demand``, in percent.

    Args:
        load: the server's :class:`ServerLoad`.

    Returns:
        An integer from :data:`WEIGHT_FLOOR` (demand of twice the limit or more) to 100
        (idle).
    """
    d = min(demand(load), WEIGHT_DEMAND_CAP)
    return max(WEIGHT_FLOOR, min(100, int(100 * 10 ** -d + 0.5)))


def utilization(load: ServerLoad) -> float:
    """ORCA ``application_utilization``: seats in use / limit (non-exempt levels)."""
    return load.seats_in_use / load.limit if load.limit > 0 else 0.0


class RateMeter:
    """A rate of a cumulative counter over windows of at least ``window_ns``.

    ``observe(count, now)`` returns the rate of the last completed window (0.0 before the
    first); a counter that went backwards (a level index reused) starts a new window."""

    def __init__(self, window_ns: int = RATE_WINDOW_NS) -> None:
        self.window_ns = window_ns
        self._t0: int | None = None
        self._c0 = 0
        self.rate = 0.0

    def observe(self, count: int, now: int) -> float:
        """Args: count: the counter's value; now: integer ns. Returns: events per second."""
        if self._t0 is None or count < self._c0:
            self._t0, self._c0 = now, count
            return self.rate
        dt = now - self._t0
        if dt >= self.window_ns:
            self.rate = (count - self._c0) * 1e9 / dt
            self._t0, self._c0 = now, count
        return self.rate


def _num(x: float) -> str:
    """A short decimal that any float parser reads back (no exponent, no NaN)."""
    if not isfinite(x):
        return "0"
    text = f"{x:.3f}".rstrip("0").rstrip(".")
    return text if text and text != "-0" else "0"


def orca_text(load: ServerLoad, rps: float, names: dict[int, str]) -> str:
    """See :func:`orca_text_with`; ``names`` as level index -> name."""
    return orca_text_with(load, rps, level_prefixes(names))


def level_prefixes(names: dict[int, str]) -> dict[int, str]:
    """Level index -> ``", named_metrics.<name>_utilization="`` (built once per worker)."""
    return {i: f", named_metrics.{name}_utilization=" for i, name in names.items() if name}


def orca_text_with(load: ServerLoad, rps: float, prefixes: dict[int, str]) -> str:
    """The ``endpoint-load-metrics`` value in ORCA's TEXT encoding.

    Args:
        load: the server's :class:`ServerLoad`.
        rps: the recent dispatch rate (``rps_fractional``).
        prefixes: :func:`level_prefixes` of the level names, for
            ``named_metrics.<level>_utilization``.

    Returns:
        ``"TEXT application_utilization=0.5, rps_fractional=12.3, named_metrics.work_..."``.
    """
    parts = [f"TEXT application_utilization={_num(utilization(load))}, "
             f"rps_fractional={_num(rps)}"]
    for index, in_use, limit in load.levels:
        prefix = prefixes.get(index)
        if prefix is not None:
            parts.append(prefix)
            parts.append(_num(in_use / limit if limit > 0 else 0.0))
    return "".join(parts)


class OrcaReport:
    """Per worker: the ORCA header, recomputed from the ledger at most every ``refresh_ns``.

    Args:
        read: ``Ledger.load`` of the worker's ledger (lock-free).
        names: level index -> name (the worker's configuration generation).
        refresh_ns: how long a computed value is reused.
    """

    def __init__(self, read: Callable[[], list], names: dict[int, str],
                 refresh_ns: int = REFRESH_NS) -> None:
        self._read = read
        self._prefixes = level_prefixes(names)
        self._refresh_ns = refresh_ns
        self._next = 0
        self._meter = RateMeter()
        self._failed = False
        self.value = "TEXT application_utilization=0, rps_fractional=0"
        self._tail = [(ORCA_HEADER, self.value)]
        self._reject_tail = [(ORCA_HEADER, self.value), RATELIMITED]

    def extend(self, headers: list, now: int) -> list:
        """``headers`` plus the ORCA header (a new list; ``headers`` is not changed).

        Args:
            headers: the response's APF headers.
            now: integer ns from the middleware's clock.
        """
        if now >= self._next:
            self.refresh(now)
        return headers + self._tail

    def reject_headers(self, now: int) -> list:
        """The ORCA header and ``x-envoy-ratelimited``, for a 429."""
        if now >= self._next:
            self.refresh(now)
        return self._reject_tail

    def refresh(self, now: int) -> None:
        """Recompute the value; on a read failure keep the previous one (logged once)."""
        self._next = now + self._refresh_ns
        try:
            load = summarize(self._read())
        except Exception:
            if not self._failed:
                self._failed = True
                log.exception("apf: reading the ledger for the ORCA load report failed")
            return
        rps = self._meter.observe(load.dispatched, now)
        self.value = orca_text_with(load, rps, self._prefixes)
        self._tail = [(ORCA_HEADER, self.value)]
        self._reject_tail = [(ORCA_HEADER, self.value), RATELIMITED]
