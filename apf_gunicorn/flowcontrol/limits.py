"""Static per-level limits: how a server concurrency limit splits into nominal, lendable and
borrowing seats, as Kubernetes computes them at every configuration digest.

    limits = compute_limits(cfg.priority_levels.values(), 600)
    limits["workload-low"]   # LevelLimits(nominal=245, lendable=221, borrowing=600, lower=24,
                             #             upper=845, max_seats=37)

Rules (Kubernetes ``finishQueueSetReconfigsLocked``):

* ``shareSum`` is the sum of nominalConcurrencyShares over *all* levels, exempt included;
* ``nominal = ceil(server_limit * shares / shareSum)`` in floating point;
* ``lendable = round(nominal * lendablePercent / 100)`` and, when borrowingLimitPercent is set,
  ``borrowing = round(nominal * borrowingLimitPercent / 100)``, else the server limit (always the
  server limit for Exempt levels); rounding is Go's, half away from zero;
* ``lower = nominal - lendable``, ``upper = nominal + borrowing``;
* ``max_seats = max(1, min(ceil(0.15 * nominal), nominal // handSize))`` for queuing levels,
  ``None`` for the others (the work estimator then uses its own cap);
* our extension: a level annotated ``apf-gunicorn.io/max-seats: "N"`` (``PriorityLevel.
  max_seats``) has ``max_seats = N`` whatever its type (exempt levels cannot carry it), so a
  small server can still admit wide requests.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from apf_gunicorn.flowcontrol.gomath import go_round
from apf_gunicorn.flowcontrol.objects import PriorityLevel

#: The PriorityLevelConfiguration annotation that sets the level's widest request in seats
#: (instead of Kubernetes' 15% of the nominal limit), for servers with few seats.
MAX_SEATS_ANNOTATION = "apf-gunicorn.io/max-seats"


@dataclass(frozen=True, slots=True)
class LevelLimits:
    nominal: int
    lendable: int
    borrowing: int
    lower: int  # Kubernetes minCL: the seats the level never lends
    upper: int  # Kubernetes maxCL: the most it may hold by borrowing
    max_seats: int | None  # widest request in seats: queuing or annotated levels only


def compute_limits(levels: Iterable[PriorityLevel], server_limit: int) -> dict[str, LevelLimits]:
    """The limits of every level (keyed by name, in the given order) for ``server_limit`` seats."""
    levels = list(levels)
    share_sum = sum(pl.nominal_concurrency_shares for pl in levels)
    out: dict[str, LevelLimits] = {}
    for pl in levels:
        if share_sum > 0:
            nominal = math.ceil(
                float(server_limit) * float(pl.nominal_concurrency_shares) / float(share_sum)
            )
        else:
            nominal = 0
        lendable = go_round(float(nominal) * float(pl.lendable_percent) / 100)
        if pl.is_exempt or pl.borrowing_limit_percent is None:
            borrowing = server_limit
        else:
            borrowing = go_round(float(nominal) * float(pl.borrowing_limit_percent) / 100)
        max_seats = None
        if pl.max_seats is not None and not pl.is_exempt:
            max_seats = pl.max_seats
        elif pl.queuing is not None:
            max_seats = max(1, min(math.ceil(0.15 * nominal), nominal // pl.queuing.hand_size))
        out[pl.name] = LevelLimits(
            nominal=nominal,
            lendable=lendable,
            borrowing=borrowing,
            lower=nominal - lendable,
            upper=nominal + borrowing,
            max_seats=max_seats,
        )
    return out


def nominal_sum(limits: Mapping[str, LevelLimits]) -> int:
    """Kubernetes' nominalCLSum (also its ``maxExecutingRequests``)."""
    return sum(lim.nominal for lim in limits.values())


def max_waiting_requests(levels: Iterable[PriorityLevel]) -> int:
    """Sum of queues x queueLengthLimit over queuing levels (the waiting-ratio denominator)."""
    return sum(
        pl.queuing.queues * pl.queuing.queue_length_limit for pl in levels if pl.queuing is not None
    )


def max_seats_origin(level: PriorityLevel) -> str:
    """Where a level's widest request comes from, for messages that report a clamp.

    Args:
        level: the priority level.

    Returns:
        A phrase such as ``"its apf-gunicorn.io/max-seats annotation"`` or ``"Kubernetes'
        rule: 15% of its nominal seats, at most nominal / handSize; raise it with the
        apf-gunicorn.io/max-seats annotation"``.
    """
    # getattr: callers may hold a stand-in with fewer fields (a level built by hand)
    if getattr(level, "is_exempt", False):
        return "the server's concurrency limit (an exempt level)"
    if getattr(level, "max_seats", None) is not None:
        return f"its {MAX_SEATS_ANNOTATION} annotation"
    if getattr(level, "queuing", True) is None:
        rule = "its nominal concurrency limit (a Reject level)"
    else:
        rule = "Kubernetes' rule: 15% of its nominal seats, at most nominal / handSize"
    return f"{rule}; set it with the {MAX_SEATS_ANNOTATION} annotation"
