"""Repair: rebuild every derived part of a ledger from its slot table, and check invariants.

The slot table is the ledger's source of truth: each slot's state, level, queue, seats, work
and arrival order. Everything else that a half-finished operation can leave inconsistent is
derived from it: per-queue FIFO links and sums, executing counts and seats, per-level totals,
the active-queue count and rate inputs, the min-segment trees and the free list. What is *not*
derivable (each level's R, queues' ``nextDispatchR``, robin index, counters) is kept as found,
except that the words an interrupted event had written are first put back from the undo log
(:func:`rollback`), so the counters and the slot states are those of whole events.

The ledger calls :func:`repair_locked` itself, under the lock, when the lock reports that its
previous holder died (``EOWNERDEAD``) or when the dirty mark shows an operation did not
complete; the dead holder's slots are dropped first. :func:`verify` lists every violated
invariant (tests and ``apf-gunicorn dump`` use it)::

    problems = verify(led)     # [] when consistent
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from apf_gunicorn.ledger import layout as L
from apf_gunicorn.ledger.layout import (
    EXECUTING,
    FREE,
    LINGERING,
    NIL,
    WAITING,
)
from apf_gunicorn.ledger.seatseconds import U64


class RepairView(NamedTuple):
    """What repair and :func:`verify` use of a ledger (``Ledger.repair_view()``): its buffer
    views and layout, and the steps that need the lock held, which are the ledger's own (the
    same code every operation runs, so a repair cannot drift from it)."""

    w: memoryview  # the buffer as int64 words
    u: memoryview  # the same words as uint64 (R, SeatSeconds, hashes)
    lay: L.Layout
    queue: Callable[[int, int], int]  # (level address, queue index) -> queue record address
    count_lost_wait_locked: Callable[[int, int, int], None]  # a dead worker's wait: cancelled
    log_locked: Callable[..., None]  # the undo log: note words before an event writes them
    commit_locked: Callable[[], None]  # the event is whole
    demand_locked: Callable[[int, int], None]  # seat-demand integrator Set() from the totals
    repair_level_locked: Callable[[int], None]  # the fairness's invariants (fairness.py)
    dispatch_all_locked: Callable[[int, int, list], None]  # dispatch what fits in a level
    leaf_value_locked: Callable[[int, int], int]  # what a queue's min-tree leaf should hold
    verify_maxmin_locked: Callable[[int], list]  # a maxmin level's flow-table invariants

_LEVEL_AGGREGATES = (L.L_WAITING, L.L_EXECUTING, L.L_SEATS_IN_USE, L.L_SEATS_WAITING,
                     L.L_ACTIVE_QUEUES, L.L_QSEATS)
_QUEUE_AGGREGATES = (L.Q_WAITING, L.Q_INIT_SUM, L.Q_MAX_SUM, L.Q_WORK_SUM, L.Q_EXECUTING,
                     L.Q_SEATS)


def _owners_of_pid(v: RepairView, pid: int) -> set[int]:
    if pid <= 0:
        return set()
    w = v.w
    lay = v.lay
    return {i for i in range(lay.cap.workers)
            if w[lay.worker(i) + L.W_STATE] != L.WORKER_FREE and w[lay.worker(i) + L.W_PID] == pid}


def _expected(v: RepairView) -> tuple[dict, dict, list[int], dict]:
    """Recompute aggregates from the slot table.

    Returns (level aggregates {level: {field: value}}, queue aggregates {(level, q): {...}},
    free slots, waiting slots {(level, q): [slot, ...] in arrival order})."""
    w, u = v.w, v.u
    lay = v.lay
    levels: dict[int, dict[int, int]] = {}
    queues: dict[tuple[int, int], dict[int, int]] = {}
    for i in range(lay.cap.levels):
        lb = lay.level(i)
        if w[lb + L.L_USED]:
            levels[i] = dict.fromkeys(_LEVEL_AGGREGATES, 0)
            for q in range(w[lb + L.L_NQ]):
                queues[(i, q)] = dict.fromkeys(_QUEUE_AGGREGATES, 0)
    free = []
    waiting: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for s in range(lay.cap.slots):
        sa = lay.slot(s)
        state = w[sa + L.S_STATE]
        if state == FREE:
            free.append(s)
            continue
        level, q = w[sa + L.S_LEVEL], w[sa + L.S_QUEUE]
        agg = levels[level]
        qagg = queues.get((level, q))
        if state == WAITING:
            ms = w[sa + L.S_MAX_SEATS]
            agg[L.L_WAITING] += 1
            agg[L.L_SEATS_WAITING] += ms
            if qagg is None:
                continue
            qagg[L.Q_WAITING] += 1
            qagg[L.Q_INIT_SUM] += w[sa + L.S_INITIAL]
            qagg[L.Q_MAX_SUM] += ms
            qagg[L.Q_WORK_SUM] = (qagg[L.Q_WORK_SUM] + u[sa + L.S_TOTAL_WORK]) & U64
            waiting.setdefault((level, q), []).append((w[sa + L.S_SEQ], s))
        else:
            held = w[sa + L.S_HELD]
            agg[L.L_SEATS_IN_USE] += held
            if state == EXECUTING:
                agg[L.L_EXECUTING] += 1
            if qagg is not None:
                qagg[L.Q_SEATS] += held
                if state == EXECUTING:
                    qagg[L.Q_EXECUTING] += 1
    for (level, _q), qagg in queues.items():
        agg = levels[level]
        agg[L.L_QSEATS] += qagg[L.Q_SEATS] + qagg[L.Q_MAX_SUM]
        if qagg[L.Q_WAITING] or qagg[L.Q_EXECUTING]:
            agg[L.L_ACTIVE_QUEUES] += 1
    order = {key: [s for _, s in sorted(v)] for key, v in waiting.items()}
    return levels, queues, free, order


def rollback(led) -> int:
    """Put back the words the interrupted event wrote (its undo log, newest first) and clear
    the log. Call with the lock held. Returns how many words were logged."""
    return _rollback(led.repair_view())


def _rollback(v: RepairView) -> int:
    w = v.w
    n = w[L.H_UNDO_N]
    words = v.lay.size // L.WORD
    if 0 < n <= L.UNDO_PAIRS:
        base = v.lay.undo_base
        for i in range(n - 1, -1, -1):
            addr = w[base + 2 * i]
            if v.lay.level_base <= addr < words:
                w[addr] = w[base + 2 * i + 1]
    w[L.H_UNDO_N] = 0
    return max(0, n)


def _sanitize(v: RepairView, drop_owners: set[int], now: int | None) -> None:
    """Free slots that cannot be placed (dead owner, unknown level or queue, bad state). A dead
    owner's waiting requests are counted as cancelled, as a reap counts them."""
    w = v.w
    lay = v.lay
    for s in range(lay.cap.slots):
        sa = lay.slot(s)
        state = w[sa + L.S_STATE]
        if state == FREE:
            continue
        level = w[sa + L.S_LEVEL]
        ok = state in (WAITING, EXECUTING, LINGERING) and 0 <= level < lay.cap.levels
        if ok:
            lb = lay.level(level)
            ok = bool(w[lb + L.L_USED]) and w[sa + L.S_OWNER] not in drop_owners
            if state == WAITING and w[lb + L.L_USED] and w[sa + L.S_OWNER] in drop_owners:
                # one event: the count, then the slot freed below (not ok: a dropped owner)
                t = w[lb + L.L_LAST_NS] if now is None else now
                v.count_lost_wait_locked(lb, sa, t)
                v.log_locked(sa + L.S_STATE)
            q = w[sa + L.S_QUEUE]
            if ok and not (q == NIL or 0 <= q < w[lb + L.L_NQ]):
                if state == WAITING:
                    ok = False
                else:
                    w[sa + L.S_QUEUE] = NIL
            if ok and state == WAITING and q == NIL:
                ok = False
        if not ok:
            w[sa + L.S_STATE] = FREE
            v.commit_locked()


def rebuild(led, now: int | None, drop_owners: set[int] | frozenset = frozenset()) -> list:
    """Drop the slots of ``drop_owners``, rebuild everything derived from the slot table, and
    dispatch what the freed seats allow. Call with the lock held. Returns the grants."""
    return _rebuild(led.repair_view(), now, drop_owners)


def _rebuild(v: RepairView, now: int | None, drop_owners: set[int] | frozenset) -> list:
    w, u = v.w, v.u
    lay = v.lay
    _sanitize(v, set(drop_owners), now)
    levels, queues, free, order = _expected(v)
    for s in range(lay.cap.slots):
        sa = lay.slot(s)
        w[sa + L.S_PREV] = NIL
        w[sa + L.S_NEXT] = NIL
    for i in range(len(free) - 1, -1, -1):
        s = free[i]
        sa = lay.slot(s)
        w[sa + L.S_QUEUE] = NIL
        w[sa + L.S_NEXT] = free[i + 1] if i + 1 < len(free) else NIL
    w[L.H_FREE_HEAD] = free[0] if free else NIL
    w[L.H_FREE_COUNT] = len(free)
    for (level, q), qagg in queues.items():
        qa = v.queue(lay.level(level), q)
        for field, value in qagg.items():
            if field == L.Q_WORK_SUM:
                u[qa + field] = value
            else:
                w[qa + field] = value
        chain = order.get((level, q), [])
        w[qa + L.Q_HEAD] = chain[0] if chain else NIL
        w[qa + L.Q_TAIL] = chain[-1] if chain else NIL
        for k, s in enumerate(chain):
            sa = lay.slot(s)
            w[sa + L.S_PREV] = chain[k - 1] if k else NIL
            w[sa + L.S_NEXT] = chain[k + 1] if k + 1 < len(chain) else NIL
    granted: list = []
    for level, agg in levels.items():
        lb = lay.level(level)
        for field, value in agg.items():
            w[lb + field] = value
        v.repair_level_locked(lb)
        t = w[lb + L.L_LAST_NS] if now is None else max(now, w[lb + L.L_LAST_NS])
        v.demand_locked(lb, t)
        v.dispatch_all_locked(lb, t, granted)
    for owner in drop_owners:
        if 0 <= owner < lay.cap.workers:
            wa = lay.worker(owner)
            if w[wa + L.W_STATE] != L.WORKER_FREE:
                w[wa + L.W_STATE] = L.WORKER_GONE
            w[wa + L.W_ROOM] = 0
            w[wa + L.W_CONNS] = 0
    return granted


def repair_locked(led, now: int | None, dead_pid: int = 0) -> list:
    """What the ledger runs on ``EOWNERDEAD`` or a dirty mark: drop the dead holder's slots
    (found by pid in the worker table), rebuild, count the repair. Returns the grants."""
    rollback(led)
    v = led.repair_view()
    granted = rebuild(led, now, _owners_of_pid(v, dead_pid))
    v.w[L.H_REPAIRS] += 1
    v.w[L.H_DIRTY] = 0
    return granted


def verify(led) -> list[str]:
    """Every violated invariant, as text. Call without concurrent mutators."""
    v = led.repair_view()
    w, u = v.w, v.u
    lay = v.lay
    problems: list[str] = []
    levels, queues, free, order = _expected(v)
    for level, agg in levels.items():
        lb = lay.level(level)
        for field, value in agg.items():
            if w[lb + field] != value:
                problems.append(f"level {level} field {field}: {w[lb + field]} != {value}")
    for (level, q), qagg in queues.items():
        qa = v.queue(lay.level(level), q)
        for field, value in qagg.items():
            got = u[qa + field] if field == L.Q_WORK_SUM else w[qa + field]
            if got != value:
                problems.append(f"level {level} queue {q} field {field}: {got} != {value}")
        chain = []
        s = w[qa + L.Q_HEAD]
        prev = NIL
        while s != NIL and len(chain) <= lay.cap.slots:
            sa = lay.slot(s)
            if w[sa + L.S_PREV] != prev:
                problems.append(f"slot {s}: prev link {w[sa + L.S_PREV]} != {prev}")
            chain.append(s)
            prev = s
            s = w[sa + L.S_NEXT]
        if w[qa + L.Q_TAIL] != prev:
            problems.append(f"level {level} queue {q}: tail {w[qa + L.Q_TAIL]} != {prev}")
        if chain != order.get((level, q), []):
            problems.append(f"level {level} queue {q}: FIFO {chain} != arrival order "
                            f"{order.get((level, q), [])}")
        if chain and not w[lay.level(level) + L.L_FAIRNESS]:
            head_r = u[lay.slot(chain[0]) + L.S_ARRIVAL_R]
            if u[qa + L.Q_NDR] < head_r:
                problems.append(f"level {level} queue {q}: nextDispatchR below head arrival R")
    if w[L.H_FREE_COUNT] != len(free):
        problems.append(f"free count {w[L.H_FREE_COUNT]} != {len(free)}")
    if w[L.H_UNDO_N]:
        problems.append(f"the undo log holds {w[L.H_UNDO_N]} words of an unfinished event")
    seen = set()
    s = w[L.H_FREE_HEAD]
    while s != NIL and len(seen) <= lay.cap.slots:
        if s in seen:
            problems.append("free list has a cycle")
            break
        seen.add(s)
        s = w[lay.slot(s) + L.S_NEXT]
    if seen != set(free):
        problems.append("free list does not hold exactly the FREE slots")
    for level in levels:
        if w[lay.level(level) + L.L_FAIRNESS]:  # maxmin: no tree, its flow table instead
            problems.extend(v.verify_maxmin_locked(lay.level(level)))
        else:
            problems.extend(_verify_tree(v, lay.level(level)))
    return problems


def _verify_tree(v: RepairView, lb: int) -> list[str]:
    w, u = v.w, v.u
    p = w[lb + L.L_TP]
    if p == 0:
        return [] if w[lb + L.L_NQ] == 0 else [f"level at {lb}: queues but no tree"]
    tb = w[lb + L.L_TBASE]
    out = []
    nq = w[lb + L.L_NQ]
    if nq > p:
        return [f"level at {lb}: {nq} queues but a tree of {p} leaves"]
    for q in range(p):
        want = v.leaf_value_locked(lb, q) if q < nq else U64
        if u[tb + p + q] != want:
            out.append(f"level at {lb}: tree leaf {q} = {u[tb + p + q]}, want {want}")
    for i in range(1, p):
        if u[tb + i] != min(u[tb + 2 * i], u[tb + 2 * i + 1]):
            out.append(f"level at {lb}: tree node {i} is not the min of its children")
    return out

