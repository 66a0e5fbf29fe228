"""Exact Kubernetes queueset behaviours, checked one by one on the ledger (k8s-queueset.md)."""

from __future__ import annotations

import math

import pytest

from apf_gunicorn.flowcontrol.shufflesharding import deal
from apf_gunicorn.ledger import (
    EXECUTE,
    QUEUED,
    REJECTED,
    Capacity,
    Ledger,
    LevelSpec,
    verify,
)
from apf_gunicorn.ledger import layout as L
from apf_gunicorn.ledger.seatseconds import HIGH_R, R_DECREMENT, SS_SCALE

MS = 1_000_000
S = 1_000_000_000
CAP = Capacity(levels=4, queues=128, slots=64, workers=4, flow_schemas=4, detail_bytes=16)


def make(queues: int, c: int, hand: int = 1, qll: int = 100, g: int = 3 * MS, cap=CAP):
    led = Ledger.create(bytearray(Ledger.size(cap)), cap, service_estimate_ns=g)
    levels, _ = led.configure([LevelSpec("l", queues, hand, qll, c)], [], 0)
    return led, levels["l"]


def put_waiting(led: Ledger, level: int, q: int, initial: int, ndr_seat_seconds: int) -> int:
    """Hand-build a waiting request at the tail of queue q (as the Go test builds queues)."""
    w, u = led._w, led._u
    lb = led._lb(level)
    s, sa, _gen = led._alloc_locked(level, 0, 0, 0, initial, 0, 0, 0, b"")
    w[sa + L.S_QUEUE] = q
    w[sa + L.S_STATE] = L.WAITING
    w[sa + L.S_SEQ] = s
    qa = led._qa(lb, q)
    led._link_tail_locked(lb, qa, s, sa)
    w[lb + L.L_WAITING] += 1
    w[lb + L.L_SEATS_WAITING] += initial
    u[qa + L.Q_NDR] = ndr_seat_seconds * SS_SCALE
    led._touch_locked(lb, q)
    return s


# -- TestFindDispatchQueueLocked (8.3) -----------------------------------------------------------

FIND_CASES = [
    # (C, in use, [(R, head seats) per queue], [(in use before attempt or None, queue or None,
    #  robin after)])
    ("less virtual start wins", 1, 0, [(200, 1), (100, 1)], [(None, 1, 1)]),
    ("all seats occupied", 1, 1, [(200, 1)], [(None, None, 0)]),
    ("width>1 fits", 50, 25, [(200, 50), (100, 25)], [(None, 1, 1)]),
    ("width>1 does not fit", 50, 26, [(200, 10), (100, 25)],
     [(None, None, 1), (None, None, 1), (None, None, 1)]),
    ("seats free up before 3rd attempt", 50, 26, [(200, 10), (100, 25)],
     [(None, None, 1), (None, None, 1), (25, 1, 1)]),
]


@pytest.mark.parametrize("name,c,in_use,queues,attempts", FIND_CASES, ids=[c[0] for c in FIND_CASES])
def test_find_dispatch_queue(name, c, in_use, queues, attempts) -> None:
    led, level = make(len(queues), c)
    lb = led._lb(level)
    w = led._w
    for q, (r, seats) in enumerate(queues):
        put_waiting(led, level, q, seats, r)
    w[lb + L.L_SEATS_IN_USE] = in_use
    w[lb + L.L_ROBIN] = -1
    for set_in_use, want_queue, want_robin in attempts:
        if set_in_use is not None:
            w[lb + L.L_SEATS_IN_USE] = set_in_use
        granted: list = []
        picked = led._queueset.dispatch_one_locked(led, lb, 0, granted)
        assert picked == (want_queue is not None)
        if want_queue is None:
            assert granted == []
        else:
            (slot, _gen, _owner), = granted
            assert w[led._sa(slot) + L.S_QUEUE] == want_queue
        assert w[lb + L.L_ROBIN] == want_robin


# -- TestFinishRequestLocked (4.2) ---------------------------------------------------------------

@pytest.mark.parametrize("initial,final,al", [(1, 10, 60 * S), (10, 0, 0)])
def test_finish_request_locked(initial: int, final: int, al: int) -> None:
    led, level = make(1, 1000, g=S)
    lb = led._lb(level)
    w = led._w
    other = led.admit(level, 0, 12, 0, 0, 0, 0)  # rOther: the queue's seatsInUse becomes 22
    r = led.admit(level, 0, initial, final, al, 0, 0)
    assert other.outcome == r.outcome == EXECUTE
    # the Go test's qs totals: 111 executing, 222 seats in use
    w[lb + L.L_EXECUTING] += 109
    w[lb + L.L_SEATS_IN_USE] += 200
    qa = led._qa(lb, 0)
    assert w[qa + L.Q_SEATS] == 22
    _granted, until = led.finish(r.slot, r.gen, 2 * S)
    assert w[lb + L.L_EXECUTING] == 110
    assert w[qa + L.Q_EXECUTING] == 1
    assert w[led._sa(other.slot) + L.S_STATE] == L.EXECUTING
    if al:
        assert until == 2 * S + al
        assert w[lb + L.L_SEATS_IN_USE] == 222  # MaxSeats held while lingering
        led.release(r.slot, r.gen, until)
    else:
        assert until == 0
    assert w[lb + L.L_SEATS_IN_USE] == 212
    assert w[qa + L.Q_SEATS] == 12


# -- TestRequestWork / TestRequestSeats (1.2) ----------------------------------------------------

def test_request_work_with_g_2s() -> None:
    led, level = make(-1, 0, g=2 * S)
    res = led.admit(level, 0, 3, 50, 70 * S, 0, 0)
    sa = led._sa(res.slot)
    assert led._u[sa + L.S_TOTAL_WORK] == (6 + 3500) * SS_SCALE


@pytest.mark.parametrize("initial,final", [(3, 3), (1, 3), (3, 1)])
def test_request_seats_is_max(initial: int, final: int) -> None:
    led, level = make(-1, 0)
    led.admit(level, 0, initial, final, S, 0, 0)
    assert led.snapshot(0).levels[0].seats_in_use == 3


# -- integrator (7) -------------------------------------------------------------------------------

def test_integrator_vectors() -> None:
    led, level = make(-1, 0)
    lb = led._lb(level)
    led._set_demand_locked(lb, 0, 3.0)  # Add(3)
    got = led.demand_stats(level, S)
    assert got == (1.0, 3.0, 0.0, 0.0, 3.0)
    assert led.take_demand_stats(level, S) == got
    led._set_demand_locked(lb, S, 2.0)  # Set(2)
    got = led.demand_stats(level, S)
    assert got.duration_s == 0 and math.isnan(got.average) and math.isnan(got.deviation)
    assert (got.min, got.max) == (2.0, 3.0)
    led._set_demand_locked(lb, S + MS, 1.0)  # step 1ms, Add(-1)
    got = led.demand_stats(level, S + 2 * MS)
    assert got.duration_s == pytest.approx(0.002, rel=1e-12)
    assert got.average == pytest.approx(1.5, rel=1e-9)
    assert got.deviation == pytest.approx(0.5, rel=1e-6)
    assert (got.min, got.max) == (1.0, 3.0)


def test_seat_demand_counts_executing_and_waiting_seats() -> None:
    led, level = make(1, 1)
    a = led.admit(level, 0, 1, 0, 0, 0, 0)
    b = led.admit(level, 0, 1, 0, 0, 0, 0)
    assert (a.outcome, b.outcome) == (EXECUTE, QUEUED)
    granted, _ = led.finish(a.slot, a.gen, S)  # demand 2 for 1 s
    assert granted == [(b.slot, b.gen, 0)]
    led.finish(b.slot, b.gen, 2 * S)  # demand 1 for 1 s
    stats = led.take_demand_stats(level, 4 * S)  # then 0 for 2 s
    assert stats.duration_s == 4.0
    assert stats.average == pytest.approx(0.75)
    assert stats.max == 2.0 and stats.min == 0.0


# -- final-seat cap, too-wide, head-of-line ---------------------------------------------------

@pytest.mark.parametrize("busy", [False, True])
def test_final_seat_cap_preserves_the_tail_area(busy: bool) -> None:
    led, level = make(4, 2)
    blocker = led.admit(level, 7, 2, 0, 0, 0, 0) if busy else None
    res = led.admit(level, 1, 1, 5, 10 * MS, 0, 0)
    if busy:
        assert res.outcome == QUEUED
        granted, _ = led.finish(blocker.slot, blocker.gen, S)
        assert granted == [(res.slot, res.gen, 0)]
    else:
        assert res.outcome == EXECUTE
    sa = led._sa(res.slot)
    w, u = led._w, led._u
    assert w[sa + L.S_FINAL] == 2
    assert w[sa + L.S_AL] == 25 * MS  # 5 seats x 10 ms kept as 2 seats x 25 ms
    assert w[sa + L.S_HELD] == 2
    assert u[sa + L.S_TOTAL_WORK] == (1 * 3 * MS + 5 * 10 * MS) // 10  # not recomputed
    snap = led.snapshot(S).levels[0]
    assert snap.seats_in_use == 2 and snap.seats_waiting == 0
    assert verify(led) == []


def test_too_wide_request_runs_alone() -> None:
    led, level = make(8, 2, hand=1)
    small = led.admit(level, 1, 1, 0, 0, 0, 0)
    wide = led.admit(level, 2, 3, 0, 0, 0, 0)
    assert (small.outcome, wide.outcome) == (EXECUTE, QUEUED)
    granted, _ = led.finish(small.slot, small.gen, S)
    assert granted == [(wide.slot, wide.gen, 0)]
    assert led.snapshot(S).levels[0].seats_in_use == 3  # over C
    late = led.admit(level, 3, 1, 0, 0, 0, S)
    assert late.outcome == QUEUED
    granted, _ = led.finish(wide.slot, wide.gen, 2 * S)
    assert granted == [(late.slot, late.gen, 0)]


def test_head_of_line_blocking_and_no_dispatch_after_cancel() -> None:
    led, level = make(9, 2, hand=1)  # hash 1001001001 -> queue 4, 2002002002 -> queue 8
    first = led.admit(level, 5, 1, 0, 0, 0, 0)
    wide = led.admit(level, 1001001001, 2, 0, 0, 0, 1)
    narrow = led.admit(level, 2002002002, 1, 0, 0, 0, 10 * MS)
    assert (first.outcome, wide.outcome, narrow.outcome) == (EXECUTE, QUEUED, QUEUED)
    # the wide head has the smaller virtual finish; one seat is free but nothing dispatches
    assert led.snapshot(10 * MS).levels[0].seats_in_use == 1
    assert led.cancel(wide.slot, wide.gen, 20 * MS, "time-out")
    snap = led.snapshot(20 * MS).levels[0]
    assert snap.requests_waiting == 1 and snap.seats_in_use == 1  # Kubernetes: no dispatch
    assert (snap.rejected, snap.cancelled, snap.timedout) == (1, 1, 1)
    assert not led.cancel(wide.slot, wide.gen, 20 * MS)  # already gone
    other = led.admit(level, 77, 1, 0, 0, 0, 30 * MS)  # the next event dispatches
    assert other.outcome == QUEUED and (narrow.slot, narrow.gen, 0) in other.granted
    assert verify(led) == []


# -- rejections ---------------------------------------------------------------------------------

def test_queue_full_needs_all_seats_busy_and_a_full_queue() -> None:
    led, level = make(1, 1, qll=2)
    runs = led.admit(level, 0, 1, 0, 0, 0, 0)
    waits = [led.admit(level, 0, 1, 0, 0, 0, 0) for _ in range(2)]
    full = led.admit(level, 0, 1, 0, 0, 0, 0)
    assert runs.outcome == EXECUTE
    assert [r.outcome for r in waits] == [QUEUED, QUEUED]
    assert (full.outcome, full.reason) == (REJECTED, "queue-full")
    assert led._w[led._lb(level) + L.L_ENQUEUES] == 4  # rejected requests are dealt too


def test_reject_type_and_exempt_levels() -> None:
    led, _ = make(1, 1)
    levels, _ = led.configure([LevelSpec("r", 0, 0, 0, 2), LevelSpec("x", -1, 0, 0, 0)], [], 0)
    a = led.admit(levels["r"], 0, 2, 0, 0, 0, 0)
    b = led.admit(levels["r"], 0, 1, 0, 0, 0, 0)
    assert a.outcome == EXECUTE and (b.outcome, b.reason) == (REJECTED, "concurrency-limit")
    for _ in range(5):
        assert led.admit(levels["x"], 0, 3, 0, 0, 0, 0).outcome == EXECUTE
    by_name = {lv.name: lv for lv in led.snapshot(0).levels}
    assert by_name["x"].seats_in_use == 15
    assert "l" not in by_name  # not named and idle: dropped at once


def test_running_out_of_slots_is_a_clean_rejection() -> None:
    cap = Capacity(levels=2, queues=8, slots=3, workers=1, flow_schemas=1, detail_bytes=0)
    led, level = make(2, 1, cap=cap)
    got = [led.admit(level, 0, 1, 0, 0, 0, 0) for _ in range(4)]
    assert [r.outcome for r in got] == [EXECUTE, QUEUED, QUEUED, REJECTED]
    assert got[3].reason == "no-slot"
    led.finish(got[0].slot, got[0].gen, S)
    assert led.admit(level, 0, 1, 0, 0, 0, S).outcome == QUEUED
    assert verify(led) == []


# -- reconfiguration ----------------------------------------------------------------------------

def test_limit_increase_dispatches_at_once() -> None:
    led, level = make(4, 1)
    a = led.admit(level, 1, 1, 0, 0, 0, 0)
    b = led.admit(level, 2, 1, 0, 0, 0, 0)
    assert b.outcome == QUEUED
    assert led.set_limits({level: 2}, S) == [(b.slot, b.gen, 0)]
    c = led.admit(level, 3, 1, 0, 0, 0, S)
    assert c.outcome == QUEUED
    granted: list = []
    led.configure([LevelSpec("l", 4, 1, 100, 3)], [], 2 * S, granted=granted)
    assert granted == [(c.slot, c.gen, 0)]
    assert a.outcome == EXECUTE


def test_queue_count_shrinks_by_attrition_with_index_compaction() -> None:
    led, level = make(4, 10, hand=1)
    lb = led._lb(level)
    w = led._w
    by_queue = {}
    for h in range(200):
        by_queue.setdefault(deal(h, 4, 1)[0], h)
        if len(by_queue) == 4:
            break
    reqs = {q: led.admit(level, h, 1, 0, 0, 0, 0) for q, h in sorted(by_queue.items())}
    assert all(r.outcome == EXECUTE for r in reqs.values())
    led.configure([LevelSpec("l", 2, 1, 100, 10)], [], S)
    assert w[lb + L.L_NQ] == 4  # nothing removed until a queue empties
    w[lb + L.L_ROBIN] = 3
    led.finish(reqs[1].slot, reqs[1].gen, 2 * S)  # queue 1 empties: removed, 2,3 -> 1,2
    assert w[lb + L.L_NQ] == 3
    assert w[lb + L.L_ROBIN] == 2
    assert w[led._sa(reqs[3].slot) + L.S_QUEUE] == 2
    assert w[led._sa(reqs[2].slot) + L.S_QUEUE] == 1
    assert verify(led) == []
    led.finish(reqs[3].slot, reqs[3].gen, 3 * S)
    assert w[lb + L.L_NQ] == 2
    led.finish(reqs[0].slot, reqs[0].gen, 3 * S)
    led.finish(reqs[2].slot, reqs[2].gen, 3 * S)
    assert w[lb + L.L_NQ] == 2  # never below the desired count
    assert verify(led) == []


def test_queue_count_grows_at_once_and_moves_regions() -> None:
    led, level = make(2, 1)
    a = led.admit(level, 5, 1, 0, 0, 0, 0)
    b = led.admit(level, 6, 1, 0, 0, 0, 0)
    levels, _ = led.configure([LevelSpec("l", 40, 3, 100, 1), LevelSpec("m", 8, 2, 5, 4)],
                              [], S)
    assert led._w[led._lb(level) + L.L_NQ] == 40
    assert verify(led) == []
    granted, _ = led.finish(a.slot, a.gen, 2 * S)
    assert granted == [(b.slot, b.gen, 0)]
    assert levels["m"] != level


def test_desired_zero_keeps_old_queue_settings_and_drains() -> None:
    led, level = make(4, 1, hand=2, qll=7)
    a = led.admit(level, 1, 1, 0, 0, 0, 0)
    b = led.admit(level, 2, 1, 0, 0, 0, 0)
    led.configure([LevelSpec("l", 0, 0, 0, 1)], [], S)
    lb = led._lb(level)
    assert (led._w[lb + L.L_QLL], led._w[lb + L.L_HAND]) == (7, 2)
    c = led.admit(level, 3, 1, 0, 0, 0, S)
    assert (c.outcome, c.reason) == (REJECTED, "concurrency-limit")
    granted, _ = led.finish(a.slot, a.gen, 2 * S)  # old queues still dispatch
    assert granted == [(b.slot, b.gen, 0)]
    led.finish(b.slot, b.gen, 3 * S)
    # the two queues that emptied were removed; the two that never held a request stay
    # (Kubernetes removes a queue only when a seat release leaves it empty)
    assert led._w[lb + L.L_NQ] == 2
    assert verify(led) == []


def test_removed_level_quiesces_then_goes_away() -> None:
    led, level = make(2, 1)
    a = led.admit(level, 1, 1, 0, 0, 0, 0)
    levels, _ = led.configure([LevelSpec("other", 2, 1, 5, 1)], [], S)
    snap = led.snapshot(S)
    assert [(lv.name, lv.quiescing) for lv in snap.levels] == [("l", True), ("other", False)]
    led.finish(a.slot, a.gen, 2 * S)
    assert [lv.name for lv in led.snapshot(2 * S).levels] == ["other"]
    assert "l" not in led.level_indices()


def test_invalid_shuffle_sharding_config_is_refused_with_kubernetes_text() -> None:
    led, _ = make(2, 1)
    with pytest.raises(ValueError, match=r"invalid shuffle sharding config \(DesiredNumQueues is "
                                         r"deckSize\): handSize 9 is greater than deckSize 8"):
        led.configure([LevelSpec("l", 8, 9, 5, 1)], [], 0)


def test_flow_schema_names_are_interned_append_only() -> None:
    led, _ = make(2, 1)
    _, fs = led.configure([LevelSpec("l", 2, 1, 5, 1)], ["a", "b"], 0)
    assert fs == {"a": 0, "b": 1}
    _, fs = led.configure([LevelSpec("l", 2, 1, 5, 1)], ["c", "a"], 0)
    assert fs == {"c": 2, "a": 0}
    assert led.flow_schema_names() == ["a", "b", "c"]


# -- epoch advance (1.7) ------------------------------------------------------------------------

def test_epoch_advance_at_high_r() -> None:
    led, level = make(3, 1, hand=1)
    lb = led._lb(level)
    w, u = led._w, led._u
    a = led.admit(level, 0, 1, 0, 0, 0, 0)
    b = led.admit(level, 0, 1, 0, 0, 0, 0)
    assert b.outcome == QUEUED
    q = w[led._sa(a.slot) + L.S_QUEUE]
    idle = (q + 1) % 3
    u[led._qa(lb, idle) + L.Q_NDR] = 12345
    base = HIGH_R - 10
    u[lb + L.L_R] = base
    u[led._qa(lb, q) + L.Q_NDR] = base + 100
    u[led._sa(b.slot) + L.S_ARRIVAL_R] = base
    led._rebuild_tree_locked(lb)
    # rate = min(2 seats, C=1) / 1 active queue = 1 seat: 100 ns -> 10 units
    led.admit(level, 99, 1, 0, 0, 0, 100)
    assert u[lb + L.L_R] == base + 10 - R_DECREMENT
    assert u[led._qa(lb, idle) + L.Q_NDR] == 0
    assert u[led._qa(lb, q) + L.Q_NDR] == base + 100 - R_DECREMENT
    assert u[led._sa(b.slot) + L.S_ARRIVAL_R] == base - R_DECREMENT
    assert led.snapshot(100).levels[0].epoch_advances == 1
    assert verify(led) == []


def test_stale_slot_operations_are_no_ops() -> None:
    led, level = make(2, 1)
    a = led.admit(level, 0, 1, 0, 0, 0, 0)
    led.finish(a.slot, a.gen, S)
    assert led.finish(a.slot, a.gen, 2 * S) == ([], 0)
    b = led.admit(level, 0, 1, 0, 0, 0, 2 * S)
    assert b.slot == a.slot and b.gen == a.gen + 1
    assert led.finish(a.slot, a.gen, 3 * S) == ([], 0)
    assert led.snapshot(3 * S).levels[0].requests_executing == 1
