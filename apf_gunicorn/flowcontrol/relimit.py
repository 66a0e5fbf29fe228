"""Levels follow the server limit: apply a new server concurrency limit to a running ledger.

When the server limit changes (the adaptive controller, :mod:`.adaptive`), every priority
level's nominal seats are recomputed from its shares (:func:`.limits.compute_limits`, as a HUP
with the new limit would), and each level's current limit is re-derived by the borrowing
allocation (:func:`.borrowing.run_borrowing`) from the demand it last measured, so borrowing
keeps working between its 10 s rounds. Only the limits change: queues, waiting and executing
requests are not touched (a lower limit lets executing requests finish and dispatches less;
a higher one dispatches at once). The exempt level is never limited by the ledger::

    level_limits, granted = follow_server_limit(ledger, cfg.priority_levels.values(),
                                                levels, states, 12, now)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from apf_gunicorn.flowcontrol.borrowing import BorrowingStates, DemandObservation, run_borrowing
from apf_gunicorn.flowcontrol.limits import LevelLimits, compute_limits
from apf_gunicorn.flowcontrol.objects import PriorityLevel


class _LastDemand:
    """A ledger view for :func:`run_borrowing` that answers each level's demand with what the
    last borrowing round measured (an empty interval: nothing new folded in), so a
    re-allocation does not consume the demand statistics the next round needs."""

    def __init__(self, ledger: Any, states: BorrowingStates, names: dict[int, str]) -> None:
        self._ledger = ledger
        self._states = states
        self._names = names

    def take_demand_stats(self, level: int, now: int) -> DemandObservation:
        state = self._states.get(self._names[level])
        watermark = float(state.high_watermark) if state is not None else 0.0
        return DemandObservation(0.0, 0.0, 0.0, watermark)

    def set_limits(self, limits: dict[int, int], now: int) -> list:
        return self._ledger.set_limits(limits, now)


def follow_server_limit(ledger: Any, priority_levels: Iterable[PriorityLevel],
                        levels: Iterable[tuple[str, int, bool]], states: BorrowingStates,
                        server_limit: int, now: int) -> tuple[dict[str, LevelLimits], list]:
    """Re-derive every level's limits for ``server_limit`` and apply them to ``ledger``.

    Args:
        ledger: the ledger (``set_limits``).
        priority_levels: the configuration's levels (shares, lendable and borrowing percents).
        levels: ``(name, ledger index, is_exempt)`` per level, as :func:`run_borrowing` takes.
        states: the borrowing states (updated: each level's current limit).
        server_limit: the new server concurrency limit, in seats.
        now: the caller's monotonic ns.
    Returns:
        ``(level limits, grants)``: the new :class:`LevelLimits` per level name (the caller's
        next borrowing rounds use them) and the requests the ledger dispatched, as
        ``(slot, gen, owner)``.
    """
    level_limits = compute_limits(priority_levels, server_limit)
    levels = list(levels)
    view = _LastDemand(ledger, states, {idx: name for name, idx, _ in levels})
    granted = run_borrowing(view, level_limits, states, now, server_limit=server_limit,
                            levels=levels)
    return level_limits, granted
