"""Borrowing between priority levels: Kubernetes' fair allocation and the periodic adjustment.

Two pure pieces and one thin driver:

* :func:`compute_concurrency_allocation` is ``conc_alloc.go``: split an integer ``required_sum``
  among items ``(target, lower, upper)`` so that every item gets ``clamp(fair_prop * target,
  lower, upper)`` and the allocations add up to ``required_sum``.
* :func:`adjust` is ``updateBorrowingLocked``: given each level's demand statistics since the
  last run, update its smoothed demand and compute its new current concurrency limit (the
  exempt level's claim first, then the two constrained branches or the fair allocation).
* :func:`run_borrowing` reads the demand stats from the ledger, calls :func:`adjust` and writes
  the limits back with ``ledger.set_limits``; the master calls it every 10 s.

    >>> allocs, fp = compute_concurrency_allocation(25, [(1, 1, 25), (24, 12, 20), (8, 8, 18)])
    >>> [round(a) for a in allocs]
    [1, 16, 8]

State that outlives one run (smoothed demand, high watermark, current limit) is kept per level
name in a :class:`BorrowingStates` mapping owned by the caller; metrics read it at scrape time.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from apf_gunicorn.flowcontrol.gomath import go_round

log = logging.getLogger(__name__)

MIN_TARGET = 0.001  # conc_alloc.go MinTarget: keeps zero targets from dividing by zero
EPSILON = 1e-7  # conc_alloc.go epsilon for the "pinned by bounds" tests
SMOOTHING_COEFFICIENT = 0.977  # seatDemandSmoothingCoefficient (half-life ~5 min at 10 s)
ADJUSTMENT_PERIOD_NS = 10_000_000_000  # borrowingAdjustmentPeriod


class AllocationError(ValueError):
    """The allocation problem has no solution (bad bounds or sums out of range)."""


class AllocItem(NamedTuple):
    target: float
    lower: float
    upper: float


def compute_concurrency_allocation(
    required_sum: int, items: Sequence[tuple[float, float, float]]
) -> tuple[list[float], float]:
    """Return ``(allocs, fair_prop)`` for items ``(target, lower, upper)``; raises
    :class:`AllocationError` with Kubernetes' reasons when no allocation exists."""
    if required_sum < 0:
        raise AllocationError("negative sums are not supported")
    req = float(required_sum)
    low_sum = high_sum = target_sum = 0.0
    rel: list[tuple[float, float, float]] = []  # (target', relLow, relHigh)
    for idx, item in enumerate(items):
        target, lower, upper = (float(v) for v in item)
        if lower < 0:
            raise AllocationError(
                f"lower bound {idx} is {lower} but negative lower bounds are not allowed"
            )
        if target < lower:
            raise AllocationError(
                f"target {idx} is {target}, which is below its lower bound of {lower}"
            )
        if upper < lower:
            raise AllocationError(
                f"upper bound {idx} is {upper} but should not be less than the lower bound {lower}"
            )
        target = max(target, MIN_TARGET)
        low_sum += lower
        high_sum += upper
        target_sum += target
        rel.append((target, lower / target, upper / target))
    lb_min = min((r[1] for r in rel), default=math.inf)
    lb_max = max((r[1] for r in rel), default=-math.inf)
    ub_min = min((r[2] for r in rel), default=math.inf)
    ub_max = max((r[2] for r in rel), default=-math.inf)
    if lb_max > 1:
        raise AllocationError(
            f"lbRange.max-1={lb_max - 1}, which is impossible because lbRange.max can not be "
            "greater than 1"
        )
    if low_sum - req > EPSILON:
        raise AllocationError(
            f"lower bounds sum to {low_sum}, which is higher than the required sum of {required_sum}"
        )
    if req - high_sum > EPSILON:
        raise AllocationError(
            f"upper bounds sum to {high_sum}, which is lower than the required sum of {required_sum}"
        )
    if required_sum == 0:
        return [0.0] * len(rel), 0.0
    if low_sum - req > -EPSILON:  # no wiggle room, pinned from below
        return [float(it[1]) for it in items], lb_min
    if req - high_sum > -EPSILON:  # no wiggle room, pinned from above
        return [float(it[2]) for it in items], ub_max
    fair_prop = req / target_sum
    if lb_max <= fair_prop <= ub_min:  # no bound binds
        return [r[0] * fair_prop for r in rel], fair_prop

    # Some bounds bind: sweep fair_prop upward over the sorted relative bounds, tracking the
    # target sum of the items that respond to it (between their two bounds).
    bounds = sorted(
        [(r[1], i, True) for i, r in enumerate(rel)] + [(r[2], i, False) for i, r in enumerate(rel)],
        key=lambda b: b[0],
    )
    sum_so_far = low_sum
    fair_prop = lb_min
    sens_sum = d_sens_sum = 0.0
    sens_n = d_sens_n = 0
    next_idx = 0
    while sum_so_far < req:
        while True:
            sens_sum += d_sens_sum
            sens_n += d_sens_n
            if next_idx >= len(bounds):
                raise AllocationError(
                    "impossible: ran out of bounds to consider in bound-constrained problem"
                )
            next_bound, item_idx, is_lower = bounds[next_idx]
            if is_lower:
                d_sens_n, d_sens_sum = 1, rel[item_idx][0]
            else:
                d_sens_n, d_sens_sum = -1, -rel[item_idx][0]
            next_idx += 1
            if next_bound > fair_prop:
                break
        if sens_n == 0:  # nothing responds in (fair_prop, next_bound]
            fair_prop = next_bound
            continue
        next_prop = fair_prop + (req - sum_so_far) / sens_sum
        if next_prop <= next_bound:
            fair_prop = next_prop
            break
        sum_so_far += (next_bound - fair_prop) * sens_sum
        fair_prop = next_bound
    allocs = [
        max(float(it[1]), min(float(it[2]), fair_prop * r[0])) for it, r in zip(items, rel, strict=True)
    ]
    return allocs, fair_prop


@dataclass
class BorrowingState:
    """What Kubernetes keeps per level between adjustments (``seatDemandStats`` + currentCL)."""

    current_limit: int = 0
    smoothed: float = 0.0
    avg: float = 0.0
    stddev: float = 0.0
    high_watermark: int = 0
    target: float = 0.0  # the allocation target last used (the target_seats metric)
    concurrency_denominator: int = 1

    def update(self, stats: Any) -> None:
        """Fold one integrator result (``duration_s, average, deviation, high_watermark``)."""
        self.high_watermark = go_round(float(stats.high_watermark))
        if stats.duration_s <= 0:
            return
        dev = stats.deviation
        if dev is None or math.isnan(dev):
            dev = 0.0
        self.avg = float(stats.average)
        self.stddev = float(dev)
        envelope = self.avg + self.stddev
        self.smoothed = max(
            envelope,
            SMOOTHING_COEFFICIENT * self.smoothed + (1 - SMOOTHING_COEFFICIENT) * envelope,
        )


class BorrowingStates(dict[str, BorrowingState]):
    """Level name -> :class:`BorrowingState`, plus the last ``fair_frac`` (seat_fair_frac)."""

    fair_frac: float = 0.0

    def state(self, name: str, initial_limit: int = 0) -> BorrowingState:
        st = self.get(name)
        if st is None:
            st = self[name] = BorrowingState(current_limit=initial_limit)
        return st


@dataclass(frozen=True)
class DemandObservation:
    """An integrator result as the ledger's ``take_demand_stats`` returns it."""

    duration_s: float
    average: float
    deviation: float
    high_watermark: float


@dataclass
class LevelInput:
    """One level for :func:`adjust`; ``state`` is updated in place."""

    name: str
    exempt: bool
    nominal: int
    lower: int  # minCL = nominal - lendable
    upper: int  # maxCL = nominal + borrowing
    stats: Any  # DemandObservation-like
    state: BorrowingState = field(default_factory=BorrowingState)


class LevelOutput(NamedTuple):
    name: str
    current_limit: int
    concurrency_denominator: int
    target: float


@dataclass
class Adjustment:
    levels: list[LevelOutput]
    fair_frac: float


def adjust(levels: Sequence[LevelInput], nominal_sum: int, server_limit: int) -> Adjustment:
    """Kubernetes ``updateBorrowingLocked`` on plain values. Levels keep their order in the
    output; states are updated in place. ``nominal_sum`` is the sum of nominal limits of all
    levels (exempt included), ``server_limit`` the server concurrency limit."""
    remaining = nominal_sum
    min_sum = min_current_sum = 0
    items: list[AllocItem] = []
    non_exempt: list[tuple[LevelInput, int]] = []
    min_currents: dict[int, int] = {}
    for i, lv in enumerate(levels):
        lv.state.update(lv.stats)
        hw = lv.state.high_watermark
        if lv.exempt:
            mc = max(lv.lower, hw)  # exempt may take far more than its nominal share
            remaining -= mc
        else:
            mc = max(lv.lower, min(lv.nominal, hw))
            target = max(float(mc), lv.state.smoothed)
            items.append(AllocItem(target, float(mc), float(lv.upper)))
            non_exempt.append((lv, mc))
            min_sum += lv.lower
            min_current_sum += mc
        min_currents[i] = mc
    if not items and nominal_sum > 0:
        log.error("impossible: no non-exempt priority levels to allocate %d seats to", nominal_sum)
        return Adjustment(
            [_output(lv, lv.state.current_limit, server_limit, lv.state.target) for lv in levels],
            0.0,
        )

    fair_frac = 0.0
    new_limits: list[int]
    if remaining <= min_sum:  # the exempt level has eaten everything lendable
        new_limits = [lv.lower for lv, _ in non_exempt]
    elif remaining <= min_current_sum:  # squeeze between minCL and minCurrentCL
        share_frac = (remaining - min_sum) / (min_current_sum - min_sum)
        new_limits = [lv.lower + go_round((mc - lv.lower) * share_frac) for lv, mc in non_exempt]
    else:
        # Upstream uses nominalCLSum here, not `remaining` (exempt demand is not subtracted).
        try:
            allocs, fair_frac = compute_concurrency_allocation(nominal_sum, items)
        except AllocationError as exc:
            log.error("unable to derive new concurrency limits: %s (items %s)", exc, items)
            allocs = [float(lv.state.current_limit) for lv, _ in non_exempt]
            fair_frac = 0.0
        new_limits = [go_round(a) for a in allocs]

    by_name = {lv.name: (lim, it.target) for (lv, _), lim, it in zip(non_exempt, new_limits, items, strict=True)}
    out: list[LevelOutput] = []
    for i, lv in enumerate(levels):
        if lv.exempt:
            limit = min_currents[i]
            # upstream quirk: the exempt level's target_seats is the first item's target
            target = items[0].target if items else 0.0
        else:
            limit, target = by_name[lv.name]
        out.append(_output(lv, limit, server_limit, target))
    return Adjustment(out, fair_frac)


def _output(lv: LevelInput, limit: int, server_limit: int, target: float) -> LevelOutput:
    denominator = limit if limit > 0 else max(1, go_round(server_limit / 10))
    lv.state.current_limit = limit
    lv.state.concurrency_denominator = denominator
    lv.state.target = target
    return LevelOutput(lv.name, limit, denominator, target)


def run_borrowing(
    ledger: Any,
    level_limits: Mapping[str, Any],
    states: BorrowingStates,
    now: int,
    *,
    server_limit: int | None = None,
    levels: Iterable[tuple[str, int, bool]] | None = None,
) -> list:
    """One borrowing round against a ledger; returns the grants ``ledger.set_limits`` made.

    ``level_limits`` maps level name -> ``LevelLimits`` (``nominal``, ``lower``, ``upper``).
    ``levels`` is ``(name, ledger index, is_exempt)`` per level; when omitted it is read from
    ``ledger.snapshot(now)`` (exempt = ``desired_queues < 0``). Levels the ledger has but the
    limits do not (removed levels draining) keep their limit. ``server_limit`` defaults to the
    sum of the nominal limits; pass the real server limit when known (it only affects the
    concurrency denominator of a level whose limit is 0).
    """
    if levels is None:
        snap = ledger.snapshot(now)
        levels = [(lv.name, lv.index, lv.desired_queues < 0) for lv in snap.levels]
    present = [(name, idx, ex) for name, idx, ex in levels if name in level_limits]
    nominal_sum = sum(int(level_limits[name].nominal) for name, _, _ in present)
    if server_limit is None:
        server_limit = nominal_sum
    inputs = []
    for name, idx, exempt in present:
        lim = level_limits[name]
        stats = ledger.take_demand_stats(idx, now)
        # a new level starts from nominal - lendable/2, as upstream (only used as fallback)
        lendable = int(getattr(lim, "lendable", int(lim.nominal) - int(lim.lower)))
        state = states.state(name, int(lim.nominal) - lendable // 2)
        inputs.append(
            LevelInput(name, exempt, int(lim.nominal), int(lim.lower), int(lim.upper), stats, state)
        )
    result = adjust(inputs, nominal_sum, server_limit)
    states.fair_frac = result.fair_frac
    index = {name: idx for name, idx, _ in present}
    for name in list(states):
        if name not in level_limits:
            del states[name]
    return ledger.set_limits({index[o.name]: o.current_limit for o in result.levels}, now)
