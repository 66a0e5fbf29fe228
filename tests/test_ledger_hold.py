"""The ``maxmin`` lockstep hold, rule by rule, on the production ledger with an injected clock
(``MaxMinFairness.hold_locked``; docs/fairness.md, "Lockstep"; the issue-27 scenario is in
``test_simulate_lockstep.py``).

One level of 4 seats; flow A learns a 100 ms estimate, then has 4 requests executing and 4
waiting, and the 4 executing end at the same instant. The spacing is ``gap = 0.9 x 100 ms x 1
/ 4 = 22.5 ms``, a hold lasts at most 100 ms / 2, and only a request that ran within half a
gap of its flow's estimate is held.
"""

from __future__ import annotations

import pytest

from apf_gunicorn.ledger import EXECUTE, QUEUED, Capacity, Ledger, LevelSpec, NullLock

MS = 1_000_000
A, B = 11, 22
GAP = 22_500_000


def _ledger(fairness: str) -> tuple[Ledger, int]:
    cap = Capacity(slots=32, levels=4, queues=64)
    led = Ledger.create(bytearray(Ledger.size(cap)), cap, lock=NullLock())
    names, _ = led.configure([LevelSpec("l", 8, 3, 50, 4, fairness)], ["fs"], 0)
    return led, names["l"]


def _burst(fairness: str, other_waits: bool = False) -> tuple[Ledger, list, list, list]:
    """A learns 100 ms; at 100 ms 4 of its requests run and 4 wait (and one of B, if
    asked); at 200 ms the 4 running end. Returns the ledger, the four ``(grants, linger)``,
    the requests that waited and the four that ran."""
    led, lv = _ledger(fairness)
    first = led.admit(lv, A, 1, 0, 0, 0, 0)
    assert first.outcome == EXECUTE
    assert led.finish(first.slot, first.gen, 100 * MS) == ([], 0)  # nothing waits: fast path
    running = [led.admit(lv, A, 1, 0, 0, 0, 100 * MS) for _ in range(4)]
    assert all(r.outcome == EXECUTE for r in running)
    waiting = [led.admit(lv, A, 1, 0, 0, 0, 100 * MS) for _ in range(4)]
    if other_waits:
        waiting.insert(0, led.admit(lv, B, 1, 0, 0, 0, 150 * MS))
    assert all(r.outcome == QUEUED for r in waiting)
    ends = [led.finish(r.slot, r.gen, 200 * MS) for r in running]
    return led, ends, waiting, running


def test_a_burst_of_ends_frees_one_gap_apart_under_maxmin() -> None:
    led, ends, waiting, _running = _burst("maxmin")
    t = 200 * MS
    # the first end sets the pace, the second is within one gap of tolerance; the third is
    # held until the pace, the fourth until the cap (the pace would be 3 gaps = 67.5 ms away)
    assert [linger for _g, linger in ends] == [0, 0, t + 2 * GAP, t + 50 * MS]
    assert [len(g) for g, _l in ends] == [1, 1, 0, 0]
    # two run, two seats are held (busy, lingering), two requests still wait
    snap = led.snapshot(t).levels[0]
    assert (snap.seats_in_use, snap.requests_executing, snap.requests_waiting) == (4, 2, 2)


def test_a_request_off_its_flows_usual_time_is_not_held() -> None:
    """A request that ran 85 ms, 15 ms off its flow's 100 ms, more than half a gap (11.25 ms):
    its end is not in step with the others (jitter spreads such ends by itself), so it frees
    its seat though the pace is ahead; the next, on time, is held."""
    led, lv = _ledger("maxmin")
    first = led.admit(lv, A, 1, 0, 0, 0, 0)
    led.finish(first.slot, first.gen, 100 * MS)
    running = [led.admit(lv, A, 1, 0, 0, 0, 100 * MS) for _ in range(3)]
    running.append(led.admit(lv, A, 1, 0, 0, 0, 115 * MS))  # will have run 85 ms
    assert all(r.outcome == EXECUTE for r in running)
    waiting = [led.admit(lv, A, 1, 0, 0, 0, 115 * MS) for _ in range(4)]
    assert all(r.outcome == QUEUED for r in waiting)
    t = 200 * MS
    order = [running[0], running[1], running[3], running[2]]
    lingers = [led.finish(r.slot, r.gen, t)[1] for r in order]
    # held until the cap: half the estimate learnt from 100, 100, 100 and 85 ms
    assert lingers == [0, 0, 0, t + (3 * 100 + 85) * MS // 4 // 2]


def test_a_held_seat_frees_at_its_time_and_dispatches() -> None:
    led, lv = _ledger("maxmin")
    first = led.admit(lv, A, 1, 0, 0, 0, 0)
    led.finish(first.slot, first.gen, 100 * MS)
    running = [led.admit(lv, A, 1, 0, 0, 0, 100 * MS) for _ in range(4)]
    waiting = [led.admit(lv, A, 1, 0, 0, 0, 100 * MS) for _ in range(4)]
    ends = [led.finish(r.slot, r.gen, 200 * MS) for r in running]
    held = running[2]
    assert ends[2][1] == 200 * MS + 2 * GAP
    granted = led.release(held.slot, held.gen, ends[2][1])
    assert [(g[0], g[1]) for g in granted] == [(waiting[2].slot, waiting[2].gen)]


def test_no_hold_while_another_flow_waits() -> None:
    """B waits: the first end's seat goes to B at once; only then does A alone wait."""
    _led, ends, waiting, _running = _burst("maxmin", other_waits=True)
    grants, linger = ends[0]
    assert linger == 0
    assert [(g[0], g[1]) for g in grants] == [(waiting[0].slot, waiting[0].gen)]  # B's


def test_another_flow_starting_to_wait_ends_the_holds() -> None:
    """A hold lasts only while one flow waits: B arrives while two seats are held and runs at
    once in the one that would free first; the other stays held; the ended hold's timer is
    then a no-op."""
    led, ends, waiting, running = _burst("maxmin")
    t = 210 * MS
    b = led.admit(0, B, 1, 0, 0, 0, t)
    assert b.outcome == EXECUTE and b.granted == []
    snap = led.snapshot(t).levels[0]
    assert (snap.seats_in_use, snap.requests_executing, snap.requests_waiting) == (4, 3, 2)
    # the third end's hold (until 245 ms) ended for B: its timer frees nothing
    assert led.release(running[2].slot, running[2].gen, ends[2][1]) == []
    # the fourth's (until 250 ms) still holds, and dispatches A's next request when it ends
    granted = led.release(running[3].slot, running[3].gen, ends[3][1])
    assert [(g[0], g[1]) for g in granted] == [(waiting[2].slot, waiting[2].gen)]


@pytest.mark.parametrize("fairness", ["kubernetes"])
def test_kubernetes_never_holds(fairness) -> None:
    _led, ends, _waiting, _running = _burst(fairness)
    assert [linger for _g, linger in ends] == [0, 0, 0, 0]
    assert all(len(g) == 1 for g, _l in ends)


@pytest.mark.parametrize("accelerated", [True, False], ids=["c", "python"])
def test_a_reused_flow_entry_does_not_inherit_a_pace(accelerated: bool) -> None:
    """A flow entry freed or evicted keeps its old flow's pace word; the flow that gets the
    entry next must start without one, or its first burst is held for a flood it never was.
    Every entry's pace word is set far in the future before any flow exists (what earlier
    flows leave behind); flow A's burst then frees exactly as on a fresh ledger. On the C and
    the Python allocation (``accelerated``)."""
    from apf_gunicorn.ledger.layout import F_PACE, FLOW_WORDS

    cap = Capacity(slots=32, levels=4, queues=64)
    led = Ledger.create(bytearray(Ledger.size(cap)), cap, lock=NullLock(),
                        accelerate=accelerated)
    names, _ = led.configure([LevelSpec("l", 8, 3, 50, 4, "maxmin")], ["fs"], 0)
    lv = names["l"]
    if accelerated and not led.accelerated:
        pytest.skip("the C fast paths are not built (or APF_NO_ACCELERATOR is set)")
    base = led._maxmin._fb
    for f in range(cap.slots):
        led._w[base + f * FLOW_WORDS + F_PACE] = 10**15
    first = led.admit(lv, A, 1, 0, 0, 0, 0)
    assert led.finish(first.slot, first.gen, 100 * MS) == ([], 0)
    running = [led.admit(lv, A, 1, 0, 0, 0, 100 * MS) for _ in range(4)]
    waiting = [led.admit(lv, A, 1, 0, 0, 0, 100 * MS) for _ in range(4)]
    assert all(r.outcome == QUEUED for r in waiting)
    ends = [led.finish(r.slot, r.gen, 200 * MS) for r in running]
    t = 200 * MS
    assert [linger for _g, linger in ends] == [0, 0, t + 2 * GAP, t + 50 * MS]
