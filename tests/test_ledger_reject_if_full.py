"""``Ledger.reject_if_full``: it rejects exactly what ``admit`` would reject, with the same
counts, and writes nothing when ``admit`` would run or queue the request (the poller's
rejection without a thread, ``server/pollreject.py``)."""

from __future__ import annotations

import random

import pytest

from apf_gunicorn.ledger import EXECUTE, REJECTED, Capacity, Ledger, LevelSpec, verify
from apf_gunicorn.ledger.layout import UNDO_PAIRS

MS = 1_000_000
CAP = Capacity(levels=4, queues=32, slots=24, workers=4, flow_schemas=8, detail_bytes=0,
               stats_entries=16)


def make(fairness: str) -> tuple[bytearray, Ledger, dict]:
    buf = bytearray(Ledger.size(CAP))
    led = Ledger.create(buf, CAP)
    levels, _ = led.configure(
        [LevelSpec("q", 4, 2, 2, 3, fairness), LevelSpec("exempt", -1, 0, 0, 0),
         LevelSpec("reject", 0, 0, 0, 2)], ["fs-a", "fs-b"], 0)
    return buf, led, levels


def words(led: Ledger) -> tuple[list, list]:
    """Every word of the ledger but its undo log (whose stale pairs depend on how an event
    was logged, not on what it did)."""
    w, ub = led._w, led._ub
    return w[:ub].tolist(), w[ub + 2 * UNDO_PAIRS:].tolist()


@pytest.mark.parametrize("fairness", ["kubernetes", "maxmin"])
def test_reject_if_full_agrees_with_admit_word_for_word(fairness: str) -> None:
    rng = random.Random(20)
    buf_a, a, levels = make(fairness)  # asked reject_if_full first, then admit if it declined
    buf_b, b, _ = make(fairness)  # only admit
    live: list[tuple[int, int]] = []
    rejected = declined = 0
    for step in range(3000):
        now = (step + 1) * MS
        if live and rng.random() < 0.35:
            slot, gen = live.pop(rng.randrange(len(live)))
            got_a, got_b = a.finish(slot, gen, now), b.finish(slot, gen, now)
            assert got_a == got_b
            live += [(s, g) for s, g, _ in got_a[0]]
        else:
            level = levels[rng.choice(["q", "q", "reject", "exempt"])]
            flow = rng.randrange(6)
            seats = rng.choice([1, 1, 1, 2])
            reason = a.reject_if_full(level, flow, seats, 0, 0, 0, now, 0)
            res_b = b.admit(level, flow, seats, 0, 0, 0, now, 0)
            if reason:
                rejected += 1
                assert res_b.outcome == REJECTED and res_b.reason == reason
            else:
                declined += 1
                assert res_b.outcome != REJECTED
                res_a = a.admit(level, flow, seats, 0, 0, 0, now, 0)
                assert res_a == res_b
                if res_a.outcome == EXECUTE:
                    live.append((res_a.slot, res_a.gen))
                live += [(s, g) for s, g, _ in res_a.granted]
        assert words(a) == words(b)
    assert a.snapshot(now) == b.snapshot(now)
    assert a.request_stats() == b.request_stats()
    assert rejected > 100 and declined > 100  # both answers were exercised
    assert verify(a) == [] and verify(b) == []


def test_reject_if_full_writes_nothing_when_admit_would_not_reject() -> None:
    buf, led, levels = make("kubernetes")
    before = bytes(buf)
    assert led.reject_if_full(levels["q"], 1, 1, 0, 0, 0, 0, 0) == ""
    assert led.reject_if_full(levels["exempt"], 1, 1, 0, 0, 0, 0, 0) == ""
    assert led.reject_if_full(levels["reject"], 1, 2, 0, 0, 0, 0, 0) == ""
    assert bytes(buf) == before
    with pytest.raises(ValueError):
        led.reject_if_full(99, 1, 1, 0, 0, 0, 0, 0)
