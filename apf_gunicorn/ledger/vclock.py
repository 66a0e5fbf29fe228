"""The virtual clock R and the seat-demand integrator: one copy of each, for every path.

Kubernetes syncs a level's virtual time before every change (``syncTimeLocked``) and sets its
seat-demand integrator after every change (``seatDemandIntegrator.Set``). Both are computed
here and nowhere else: :func:`r_after` and :func:`integrate` work on plain values, so that the
fast paths (``fastpath.py``, which hold the level record in locals) and the general path
(:class:`VirtualClock`, which reads and writes the words) run the same arithmetic, and the C
fast path (``_fastpath.c``) mirrors these two functions. ::

    r = r_after(r, last, now, active, qseats, c)        # now > last, active > 0
    if r >= HIGH_R and r >= old_r: ...                  # the epoch advance is due
    it, ix, ixx, imn, imx, cur, ilast = integrate(it, ix, ixx, imn, imx, cur, ilast, now, x)
"""

from __future__ import annotations

import math
import struct

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
from apf_gunicorn.ledger.records import DemandStats
from apf_gunicorn.ledger.seatseconds import EXACT_BOUND, HIGH_R, U64, seats_ns_times
from apf_gunicorn.ledger.seatseconds import seats_times_duration as _std

# the integrator's words, L_I_T .. L_I_LAST: t, x, xx, min, max (float64), current, last (int64)
_INTEGRATOR = struct.Struct("<6dq")
if (L_I_X, L_I_XX, L_I_MIN, L_I_MAX, L_I_CUR, L_I_LAST) != tuple(range(L_I_T + 1, L_I_T + 7)):
    raise ImportError("the seat-demand integrator's words are not contiguous in layout.py")


def seconds(ns: int) -> float:
    """Go's ``Duration.Seconds()``: whole seconds plus the nanosecond rest, each as a float.
    Below one second that is ``ns / 1e9`` exactly (0.0 + x == x), which :func:`integrate` uses."""
    sec, nsec = divmod(ns, 1_000_000_000)
    return float(sec) + float(nsec) / 1e9


def r_after(r: int, last: int, now: int, active: int, qseats: int, c: int) -> int:
    """``syncTimeLocked`` on values: R advanced over ``(last, now]`` at the rate of that span.

    Args:
        r: R at ``last`` (uint64 SeatSeconds).
        last: the level's last sync, ns; must be below ``now``.
        now: ns.
        active: queues with something waiting or executing; must be above 0 (with none, R
            does not move).
        qseats: seats requested by the queues (executing plus waiting), the rate's numerator.
        c: the level's concurrency limit, which caps ``qseats``.
    Returns:
        The new R, wrapped to uint64. When it is at least ``HIGH_R`` and not below ``r``, the
        caller must advance the epoch (the fast paths hand that case to the general path).
    """
    seats = qseats if qseats < c else c
    dt = now - last
    if active == 1:  # seats_ns_times inline: (x + 5) // 10 when exact
        x = seats * dt
        return (r + ((x + 5) // 10 if 0 <= x < EXACT_BOUND else seats_ns_times(seats, dt))) & U64
    return (r + _std(seats / active, dt)) & U64


def integrate(it: float, ix: float, ixx: float, imn: float, imx: float, cur: float, ilast: int,
              now: int, x: float) -> tuple[float, float, float, float, float, float, int]:
    """``seatDemandIntegrator.Set(x)`` at ``now`` on values (Kubernetes' ``Integrator``).

    Args:
        it, ix, ixx: the integrals of 1, value and value² over time (seconds).
        imn, imx: the minimum and maximum value since the last reset.
        cur: the value since ``ilast``.
        ilast: when the value last changed, ns.
        now: ns; a ``now`` at or before ``ilast`` integrates nothing.
        x: the new value.
    Returns:
        ``(it, ix, ixx, imn, imx, x, ilast)`` after the change, in layout order.
    """
    if now > ilast:
        dt = now - ilast
        dt = dt / 1e9 if dt < 1_000_000_000 else seconds(dt)
        it += dt
        ix += cur * dt
        ixx += cur * cur * dt
        ilast = now
    if x < imn:
        imn = x
    if x > imx:
        imx = x
    return it, ix, ixx, imn, imx, x, ilast


def results(t: float, x: float, xx: float, mn: float, mx: float) -> DemandStats:
    """``Moments.ToResults`` plus min and max."""
    nan = float("nan")
    if t <= 0:
        return DemandStats(t, nan, nan, mn, mx)
    avg = x / t
    var = xx / t - avg * avg
    return DemandStats(t, avg, math.sqrt(var) if var >= 0 else nan, mn, mx)


class VirtualClock:
    """A level's R and seat-demand integrator in the buffer (mixin of ``Ledger``, lock held)."""

    def _sync_locked(self, lb: int, now: int) -> None:
        """``syncTimeLocked``: advance R to ``now``, then the epoch if R reached ``highR``.
        A ``now`` at or before the last sync counts as no time passing."""
        w = self._w
        last = w[lb + L_LAST_NS]
        if now <= last:
            return
        w[lb + L_LAST_NS] = now
        active = w[lb + L_ACTIVE_QUEUES]
        if active == 0:
            return
        u = self._u
        prev = u[lb + L_R]
        r = r_after(prev, last, now, active, w[lb + L_QSEATS], w[lb + L_C])
        u[lb + L_R] = r
        if r >= HIGH_R and r >= prev:
            self._advance_epoch_locked(lb)

    def _demand_locked(self, lb: int, now: int) -> None:
        """``seatDemandIntegrator.Set(totSeatsInUse + totSeatsWaiting)``: :func:`integrate` on
        the level's words (as :meth:`_set_demand_locked`, one call fewer on the general path)."""
        w, mv = self._w, self._mv
        at = (lb + L_I_T) * 8
        it, ix, ixx, imn, imx, cur, ilast = _INTEGRATOR.unpack_from(mv, at)
        _INTEGRATOR.pack_into(mv, at, *integrate(
            it, ix, ixx, imn, imx, cur, ilast, now,
            float(w[lb + L_SEATS_IN_USE] + w[lb + L_SEATS_WAITING])))

    def _set_demand_locked(self, lb: int, now: int, x: float) -> None:
        """``seatDemandIntegrator.Set(x)``: :func:`integrate` on the level's words."""
        mv = self._mv
        at = (lb + L_I_T) * 8
        it, ix, ixx, imn, imx, cur, ilast = _INTEGRATOR.unpack_from(mv, at)
        _INTEGRATOR.pack_into(mv, at, *integrate(it, ix, ixx, imn, imx, cur, ilast, now, x))

    def _demand_results_locked(self, level: int, now: int, reset: bool) -> DemandStats:
        """The integrator's results up to ``now``; ``reset`` restarts it (``Reset()``): the
        integrals at 0, min and max at the current value."""
        lb = self._lb(level)
        f = self._f
        self._set_demand_locked(lb, now, f[lb + L_I_CUR])
        stats = results(f[lb + L_I_T], f[lb + L_I_X], f[lb + L_I_XX], f[lb + L_I_MIN],
                        f[lb + L_I_MAX])
        if reset:
            f[lb + L_I_T] = 0.0
            f[lb + L_I_X] = 0.0
            f[lb + L_I_XX] = 0.0
            f[lb + L_I_MIN] = f[lb + L_I_CUR]
            f[lb + L_I_MAX] = f[lb + L_I_CUR]
        return stats
