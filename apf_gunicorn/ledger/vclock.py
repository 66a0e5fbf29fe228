"""The virtual clock R and the seat-demand integrator."""

from __future__ import annotations

import math

from apf_gunicorn.ledger.layout import (
    L_ACTIVE_QUEUES,
    L_C,
    L_I_CUR,
    L_I_LAST,
    L_I_MAX,
    L_I_MIN,
    L_I_T,
    L_I_X,
    L_I_XX,
    L_LAST_NS,
    L_QSEATS,
    L_R,
    L_SEATS_IN_USE,
    L_SEATS_WAITING,
)
from apf_gunicorn.ledger.records import (
    DemandStats,
)
from apf_gunicorn.ledger.seatseconds import (
    HIGH_R,
    U64,
    seats_ns_times,
)
from apf_gunicorn.ledger.seatseconds import seats_times_duration as _std


def _seconds(ns: int) -> float:
    """Go's ``Duration.Seconds()``: whole seconds plus the nanosecond rest, each as a float.
    Below one second that is ``ns / 1e9`` exactly (0.0 + x == x), which the fast paths use."""
    sec, nsec = divmod(ns, 1_000_000_000)
    return float(sec) + float(nsec) / 1e9


class VirtualClock:
    """R sync and the seat-demand integrator of a level (lock held)."""

    def _sync(self, lb: int, now: int) -> None:
        """``syncTimeLocked``: advance R by round(ratio * dt) with the rate of the last span."""
        w = self._w
        last = w[lb + L_LAST_NS]
        if now <= last:
            return
        w[lb + L_LAST_NS] = now
        active = w[lb + L_ACTIVE_QUEUES]
        if active == 0:
            return
        c = w[lb + L_C]
        seats = w[lb + L_QSEATS]
        if active == 1:
            incr = seats_ns_times(seats if seats < c else c, now - last)
        else:
            incr = _std((seats if seats < c else c) / active, now - last)
        u = self._u
        prev = u[lb + L_R]
        r = (prev + incr) & U64
        u[lb + L_R] = r
        if r >= HIGH_R and r >= prev:
            self._advance_epoch(lb)

    def _demand(self, lb: int, now: int) -> None:
        """``seatDemandIntegrator.Set(totSeatsInUse + totSeatsWaiting)``."""
        w = self._w
        self._demand_x(lb, now, float(w[lb + L_SEATS_IN_USE] + w[lb + L_SEATS_WAITING]))

    def _demand_x(self, lb: int, now: int, x: float) -> None:
        f, w = self._f, self._w
        last = w[lb + L_I_LAST]
        if now > last:
            sec, nsec = divmod(now - last, 1_000_000_000)
            dt = float(sec) + float(nsec) / 1e9  # Go's Duration.Seconds()
            cur = f[lb + L_I_CUR]
            f[lb + L_I_T] += dt
            f[lb + L_I_X] += cur * dt
            f[lb + L_I_XX] += cur * cur * dt
            w[lb + L_I_LAST] = now
        f[lb + L_I_CUR] = x
        if x < f[lb + L_I_MIN]:
            f[lb + L_I_MIN] = x
        if x > f[lb + L_I_MAX]:
            f[lb + L_I_MAX] = x

    def _demand_results(self, level: int, now: int, reset: bool) -> DemandStats:
        lb = self._lb(level)
        f = self._f
        self._demand_x(lb, now, f[lb + L_I_CUR])
        stats = _results(f[lb + L_I_T], f[lb + L_I_X], f[lb + L_I_XX], f[lb + L_I_MIN],
                         f[lb + L_I_MAX])
        if reset:
            f[lb + L_I_T] = 0.0
            f[lb + L_I_X] = 0.0
            f[lb + L_I_XX] = 0.0
            f[lb + L_I_MIN] = f[lb + L_I_CUR]
            f[lb + L_I_MAX] = f[lb + L_I_CUR]
        return stats


def _results(t: float, x: float, xx: float, mn: float, mx: float) -> DemandStats:
    """``Moments.ToResults`` plus min and max."""
    nan = float("nan")
    if t <= 0:
        return DemandStats(t, nan, nan, mn, mx)
    avg = x / t
    var = xx / t - avg * avg
    return DemandStats(t, avg, math.sqrt(var) if var >= 0 else nan, mn, mx)
