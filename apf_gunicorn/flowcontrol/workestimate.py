"""Work estimates: how many seats a request occupies, and for how long after it returns.

Kubernetes' ``WorkEstimate``: ``initial_seats`` while the request executes; afterwards the
request may keep ``final_seats`` for ``additional_latency_ns`` (the ledger reserves
``max(initial, final)`` seats for both phases). The default estimator gives every request one
seat and no tail, as Kubernetes does for anything that is not a list or a mutation.

Usage::

    from apf_gunicorn.flowcontrol.workestimate import WorkEstimate, default_estimator
    est = default_estimator(attrs, classification)      # ONE_SEAT, a shared constant
    est = WorkEstimate(2, 1, 5_000_000)                  # 2 seats, then 1 seat for 5 ms

A custom estimator is any callable ``(RequestAttributes, Classification) -> WorkEstimate``;
the middleware takes one (``APFMiddleware(..., estimator=...)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


class WorkEstimate(NamedTuple):
    initial_seats: int = 1
    final_seats: int = 0
    additional_latency_ns: int = 0

    @property
    def max_seats(self) -> int:
        return max(self.initial_seats, self.final_seats)


ONE_SEAT = WorkEstimate(1, 0, 0)

Estimator = Callable[[Any, Any], WorkEstimate]


def default_estimator(attrs: Any, classification: Any) -> WorkEstimate:
    """One seat, no tail (allocation-free: returns a shared constant)."""
    return ONE_SEAT


def clamp(est: WorkEstimate, max_seats: int) -> WorkEstimate:
    """Clamp the seats to ``[1, max_seats]`` (initial) and ``[0, max_seats]`` (final),
    keeping the tail's area (seats x latency) when the final seats are cut, as Kubernetes'
    mutating estimator does."""
    initial = min(max(1, est.initial_seats), max(1, max_seats))
    final = max(0, est.final_seats)
    latency = max(0, est.additional_latency_ns)
    if final > max_seats >= 1:
        latency = latency * final // max_seats
        final = max_seats
    if final == 0:
        latency = 0
    return WorkEstimate(initial, final, latency)
