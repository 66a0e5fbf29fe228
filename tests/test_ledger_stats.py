"""Per-request stats kept in the ledger: every event counted exactly, once, in the right entry."""

from __future__ import annotations

import pytest

from apf_gunicorn.ledger import (
    EXECUTE,
    QUEUED,
    REASONS,
    REJECTED,
    Capacity,
    Ledger,
    LevelSpec,
    rebuild,
    verify,
)
from apf_gunicorn.ledger.stats import DURATION_BOUNDS_S, ND, NW, WORK_BOUNDS

MS = 1_000_000
CAP = Capacity(levels=4, queues=32, slots=16, workers=4, flow_schemas=8, detail_bytes=0,
               stats_entries=16)


def make(cap: Capacity = CAP) -> tuple[Ledger, dict, dict]:
    led = Ledger.create(bytearray(Ledger.size(cap)), cap)
    levels, schemas = led.configure(
        [LevelSpec("q", 4, 1, 1, 2), LevelSpec("exempt", -1, 0, 0, 0),
         LevelSpec("reject", 0, 0, 0, 1)], ["fs-a", "fs-b"], 0)
    return led, levels, schemas


def stats(led: Ledger) -> dict:
    return {(st.level, st.flow_schema): st for st in led.request_stats()}


def dur_counts(*values_s: float) -> tuple:
    counts = [0] * ND
    for v in values_s:
        counts[next((i for i, b in enumerate(DURATION_BOUNDS_S) if v <= b), ND - 1)] += 1
    return tuple(counts)


def no_rejections() -> dict:
    return dict.fromkeys(REASONS, 0)


def test_fast_path_counts_work_dispatch_zero_wait_and_execution() -> None:
    led, lv, fs = make()
    a = led.admit(lv["q"], 1, 3, 0, 0, 0, 10, fs_index=fs["fs-a"])
    assert a.outcome == EXECUTE
    led.finish(a.slot, a.gen, 10 + 7 * MS)
    (st,) = led.request_stats()
    assert (st.level, st.flow_schema) == ("q", "fs-a")
    assert st.work.bounds == tuple(float(b) for b in WORK_BOUNDS)
    assert st.work.counts == (0, 0, 1) + (0,) * (NW - 3)
    assert (st.work.sum, st.work.count) == (3.0, 1)
    assert st.dispatched == 1
    assert st.rejected == no_rejections()
    assert st.wait_executed.counts == dur_counts(0)
    assert (st.wait_executed.sum, st.wait_executed.count) == (0.0, 1)
    assert st.wait_rejected.count == 0
    assert st.execution_regular.counts == dur_counts(0.007)
    assert st.execution_regular.sum == pytest.approx(0.007)
    assert st.execution_watch.count == 0


def test_watch_requests_go_to_the_watch_execution_histogram() -> None:
    led, lv, fs = make()
    a = led.admit(lv["q"], 1, 1, 0, 0, 0, 0, fs_index=fs["fs-b"], watch=True)
    b = led.admit(lv["q"], 2, 1, 0, 0, 0, 0, fs_index=fs["fs-b"])
    led.finish(a.slot, a.gen, 2 * MS)
    led.finish(b.slot, b.gen, 40 * MS)
    st = stats(led)[("q", "fs-b")]
    assert st.execution_watch.counts == dur_counts(0.002)
    assert st.execution_regular.counts == dur_counts(0.04)
    assert st.dispatched == 2


def test_exempt_counts_work_and_dispatch_but_no_wait() -> None:
    led, lv, fs = make()
    a = led.admit(lv["exempt"], 1, 5, 9, 0, 0, 0, fs_index=fs["fs-a"])
    led.finish(a.slot, a.gen, 1 * MS)
    st = stats(led)[("exempt", "fs-a")]
    assert st.work.sum == 9.0 and st.work.counts[4] == 1  # max(5, 9) seats: the "16" bucket
    assert st.dispatched == 1
    assert st.wait_executed.count == 0 and st.wait_rejected.count == 0
    assert st.execution_regular.count == 1


def test_reject_type_level_rejects_on_arrival_with_a_zero_wait() -> None:
    led, lv, fs = make()
    a = led.admit(lv["reject"], 1, 1, 0, 0, 0, 0, fs_index=fs["fs-a"])
    b = led.admit(lv["reject"], 1, 1, 0, 0, 0, 5, fs_index=fs["fs-a"])
    assert (a.outcome, b.outcome, b.reason) == (EXECUTE, REJECTED, "concurrency-limit")
    st = stats(led)[("reject", "fs-a")]
    assert st.work.count == 2
    assert st.dispatched == 1
    assert st.wait_executed.counts == dur_counts(0)
    assert st.rejected == {**no_rejections(), "concurrency-limit": 1}
    assert st.wait_rejected.counts == dur_counts(0)
    assert led.rejected_total(lv["reject"]) == 1


def test_queue_then_dispatch_observes_the_wait_and_queue_full_rejects() -> None:
    led, lv, fs = make()
    q = lv["q"]
    r1 = led.admit(q, 1, 1, 0, 0, 0, 0, fs_index=0)
    r2 = led.admit(q, 1, 1, 0, 0, 0, 0, fs_index=0)
    r3 = led.admit(q, 1, 1, 0, 0, 0, 1 * MS, fs_index=1)
    r4 = led.admit(q, 1, 1, 0, 0, 0, 2 * MS, fs_index=1)  # queue length limit 1
    assert [r.outcome for r in (r1, r2, r3, r4)] == [EXECUTE, EXECUTE, QUEUED, REJECTED]
    assert r4.reason == "queue-full"
    granted, _ = led.finish(r1.slot, r1.gen, 31 * MS)
    assert [g[:2] for g in granted] == [(r3.slot, r3.gen)]
    st = stats(led)
    a, b = st[("q", "fs-a")], st[("q", "fs-b")]
    assert (a.dispatched, b.dispatched) == (2, 1)
    assert b.wait_executed.counts == dur_counts(0.030)
    assert b.wait_executed.sum == pytest.approx(0.030)
    assert b.rejected == {**no_rejections(), "queue-full": 1}
    assert b.wait_rejected.counts == dur_counts(0)
    assert a.execution_regular.counts == dur_counts(0.031)
    assert led.rejected_total(q) == 1


@pytest.mark.parametrize("reason", ["time-out", "cancelled"])
def test_time_out_and_cancel_count_the_reason_and_observe_the_wait(reason: str) -> None:
    led, lv, _ = make()
    q = lv["q"]
    for _ in range(2):
        led.admit(q, 1, 1, 0, 0, 0, 0)
    w = led.admit(q, 1, 1, 0, 0, 0, 0)
    assert w.outcome == QUEUED
    assert led.cancel(w.slot, w.gen, 600 * MS, reason)
    assert not led.cancel(w.slot, w.gen, 700 * MS, reason)  # stale: nothing more
    (st,) = led.request_stats()
    assert st.rejected == {**no_rejections(), reason: 1}
    assert st.dispatched == 2
    assert st.wait_executed.counts == dur_counts(0, 0, 0.6)  # Kubernetes' execute=true quirk
    assert st.wait_rejected.count == 0
    assert led.rejected_total(q) == 1


def test_no_slot_rejection_is_counted() -> None:
    cap = Capacity(levels=2, queues=4, slots=1, workers=1, flow_schemas=2, detail_bytes=0,
                   stats_entries=8)
    led = Ledger.create(bytearray(Ledger.size(cap)), cap)
    levels, _ = led.configure([LevelSpec("e", -1, 0, 0, 0), LevelSpec("q", 4, 1, 5, 9)],
                              ["fs"], 0)
    led.admit(levels["e"], 1, 1, 0, 0, 0, 0)
    assert led.admit(levels["e"], 1, 1, 0, 0, 0, 0).reason == "no-slot"
    assert led.admit(levels["q"], 1, 1, 0, 0, 0, 0).reason == "no-slot"
    st = stats(led)
    assert st[("e", "fs")].rejected["no-slot"] == 1
    assert st[("e", "fs")].wait_rejected.count == 0  # exempt: no wait histogram
    assert st[("q", "fs")].rejected["no-slot"] == 1
    assert st[("q", "fs")].wait_rejected.counts == dur_counts(0)
    assert st[("q", "fs")].work.count == 1


def test_stale_generation_does_nothing() -> None:
    led, lv, _ = make()
    a = led.admit(lv["q"], 1, 1, 0, 0, 0, 0)
    led.finish(a.slot, a.gen, MS)
    before = led.request_stats()
    led.finish(a.slot, a.gen, 2 * MS)
    assert led.release(a.slot, a.gen, 3 * MS) == []
    assert not led.cancel(a.slot, a.gen, 4 * MS)
    assert led.request_stats() == before


def test_lingering_release_is_not_a_second_execution() -> None:
    led, lv, _ = make()
    a = led.admit(lv["q"], 1, 1, 1, 10 * MS, 0, 0)
    _, linger = led.finish(a.slot, a.gen, 5 * MS)
    assert linger == 15 * MS
    led.release(a.slot, a.gen, linger)
    (st,) = led.request_stats()
    assert st.execution_regular.counts == dur_counts(0.005)


def test_reap_counts_waiters_as_cancelled_and_does_not_observe_executions() -> None:
    led, lv, _ = make()
    q = lv["q"]
    led.admit(q, 1, 1, 0, 0, owner=1, now=0)
    led.admit(q, 1, 1, 0, 0, owner=1, now=0)
    w = led.admit(q, 1, 1, 0, 0, owner=1, now=0)
    assert w.outcome == QUEUED
    led.reap_worker(1, 50 * MS)
    assert verify(led) == []
    (st,) = led.request_stats()
    assert st.dispatched == 2
    assert st.rejected == {**no_rejections(), "cancelled": 1}
    assert st.wait_executed.counts == dur_counts(0, 0, 0.05)
    assert st.execution_regular.count == 0


def test_repair_neither_loses_nor_double_counts() -> None:
    led, lv, _ = make()
    q = lv["q"]
    a = led.admit(q, 1, 1, 0, 0, 0, 0)
    led.admit(q, 1, 1, 0, 0, 0, 0)
    w = led.admit(q, 1, 1, 0, 0, 0, 0)
    before = led.request_stats()
    led._w[led._lb(q) + 18] += 5  # scribble an aggregate (seats in use)
    rebuild(led, MS)
    assert led.request_stats() == before  # counters are not derived from slots
    granted, _ = led.finish(a.slot, a.gen, 2 * MS)
    assert [g[:2] for g in granted] == [(w.slot, w.gen)]
    (st,) = led.request_stats()
    assert st.dispatched == 3 and st.execution_regular.count == 1


def test_dropped_level_keeps_its_entry_and_a_reused_index_gets_a_new_one() -> None:
    led, lv, fs = make()
    a = led.admit(lv["q"], 1, 1, 0, 0, 0, 0, fs_index=fs["fs-a"])
    led.finish(a.slot, a.gen, MS)
    led.configure([LevelSpec("exempt", -1, 0, 0, 0), LevelSpec("reject", 0, 0, 0, 1)],
                  ["fs-a"], 2 * MS)
    assert "q" not in led.level_indices()
    levels, _ = led.configure([LevelSpec("new", 2, 1, 5, 3)], ["fs-a"], 3 * MS)
    assert levels["new"] == lv["q"]  # the index is reused
    b = led.admit(levels["new"], 1, 1, 0, 0, 0, 4 * MS, fs_index=fs["fs-a"])
    led.finish(b.slot, b.gen, 5 * MS)
    st = stats(led)
    assert st[("q", "fs-a")].dispatched == 1
    assert st[("new", "fs-a")].dispatched == 1


def test_full_table_folds_into_level_overflow_then_the_catch_all() -> None:
    cap = Capacity(levels=3, queues=4, slots=4, workers=1, flow_schemas=8, detail_bytes=0,
                   stats_entries=4)  # 2 regular entries, 2 for overflow
    led = Ledger.create(bytearray(Ledger.size(cap)), cap)
    levels, fs = led.configure([LevelSpec("a", -1, 0, 0, 0), LevelSpec("b", -1, 0, 0, 0)],
                               [f"f{i}" for i in range(6)], 0)

    def run(level: str, f: int) -> None:
        r = led.admit(levels[level], 1, 1, 0, 0, 0, 0, fs_index=f)
        led.finish(r.slot, r.gen, 0)

    for f in range(4):
        run("a", f)
    run("b", 5)
    run("b", 0)
    # the table is full now: a third level's overflow entry has no room
    led.configure([LevelSpec(n, -1, 0, 0, 0) for n in "abc"], ["f0"], 0)
    c = led.level_indices()["c"]
    r = led.admit(c, 1, 1, 0, 0, 0, 0, fs_index=0)
    led.finish(r.slot, r.gen, 0)
    st = {(s.level, s.flow_schema): s.dispatched for s in led.request_stats()}
    assert st == {("a", "f0"): 1, ("a", "f1"): 1, ("a", "(overflow)"): 2,
                  ("b", "(overflow)"): 2, ("(overflow)", "(overflow)"): 1}


def test_attached_ledger_sees_entries_created_elsewhere() -> None:
    led, lv, fs = make()
    other = Ledger.attach(led._mv)
    a = led.admit(lv["q"], 1, 1, 0, 0, 0, 0, fs_index=fs["fs-a"])
    b = other.admit(lv["q"], 1, 1, 0, 0, 1, 0, fs_index=fs["fs-a"])
    other.finish(a.slot, a.gen, MS)
    led.finish(b.slot, b.gen, MS)
    (st,) = other.request_stats()
    assert st.dispatched == 2 and st.execution_regular.count == 2
    assert other.capacity == CAP


def test_a_worker_turning_a_request_away_counts_as_a_rejection() -> None:
    led, lv, fs = make()
    before = led.rejected_total(lv["q"])
    led.turn_away(lv["q"], fs["fs-a"], 3, "thread-reserve", 5 * MS)
    st = stats(led)[("q", "fs-a")]
    assert st.rejected == {**no_rejections(), "thread-reserve": 1}
    assert (st.work.sum, st.work.count) == (3.0, 1)
    assert st.wait_rejected.counts == dur_counts(0) and st.dispatched == 0
    assert led.rejected_total(lv["q"]) == before + 1  # what Retry-After follows
    snap = led.snapshot(5 * MS)
    assert next(x for x in snap.levels if x.name == "q").rejected == 1
    assert verify(led) == []
    with pytest.raises(ValueError, match="unknown rejection reason"):
        led.turn_away(lv["q"], fs["fs-a"], 1, "no-such-reason", 5 * MS)
    with pytest.raises(ValueError):
        led.turn_away(99, fs["fs-a"], 1, "thread-reserve", 5 * MS)


def test_held_rejections_are_counted_per_level_flow_schema_and_reason() -> None:
    """A 429 a poller held is counted in its own entry, by reason, from any process attached
    to the ledger (each worker counts its own; a scrape reads the sum)."""
    led, lv, fs = make()
    other = Ledger.attach(led._mv)
    for _ in range(2):
        led.turn_away(lv["q"], fs["fs-a"], 1, "thread-reserve", 5 * MS)
    led.count_rejection_delayed(lv["q"], fs["fs-a"], "thread-reserve")
    other.count_rejection_delayed(lv["q"], fs["fs-a"], "thread-reserve")
    other.turn_away(lv["q"], fs["fs-b"], 1, "thread-reserve", 5 * MS)
    other.count_rejection_delayed(lv["q"], fs["fs-b"], "thread-reserve")
    got = stats(led)
    assert got[("q", "fs-a")].delayed == {**no_rejections(), "thread-reserve": 2}
    assert got[("q", "fs-b")].delayed == {**no_rejections(), "thread-reserve": 1}
    # counting a held one changes nothing else: the rejection was counted when it was made
    assert got[("q", "fs-a")].rejected == {**no_rejections(), "thread-reserve": 2}
    assert got[("q", "fs-a")].work.count == 2
    assert verify(led) == []
    with pytest.raises(ValueError, match="unknown rejection reason"):
        led.count_rejection_delayed(lv["q"], fs["fs-a"], "impatience")
    with pytest.raises(ValueError):
        led.count_rejection_delayed(99, fs["fs-a"], "thread-reserve")


def test_head_timeouts_are_counted_server_wide() -> None:
    led, _, _ = make()
    assert led.head_timeouts == 0 and led.snapshot(0).head_timeouts == 0
    led.count_head_timeout()
    led.count_head_timeout()
    assert led.head_timeouts == 2 and led.snapshot(0).head_timeouts == 2


def test_worker_room_flags_are_published_and_cleared_on_reap() -> None:
    led, _, _ = make()
    for owner in range(3):
        led.register_worker(owner, 1000 + owner, 0)
    assert not led.other_worker_has_room(0)
    led.set_worker_room(1, True)
    assert led.other_worker_has_room(0) and not led.other_worker_has_room(1)
    led.set_worker_room(0, True)
    assert led.other_worker_has_room(1)
    led.reap_worker(1, 0)  # a dead worker has no room
    assert not led.other_worker_has_room(0) and led.other_worker_has_room(2)
