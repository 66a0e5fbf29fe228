"""``Ledger.reject_if_full``: it rejects exactly what ``admit`` would reject, with the same
counts, and writes nothing when ``admit`` would run or queue the request (the poller's
rejection without a thread, ``gthread/pollreject.py``)."""

from __future__ import annotations

import random

import pytest

from apf_gunicorn.ledger import (
    EXECUTE,
    QUEUED,
    REJECTED,
    Capacity,
    Ledger,
    LevelSpec,
    requestpath,
    verify,
)
from apf_gunicorn.ledger.layout import UNDO_PAIRS
from apf_gunicorn.ledger.stats import REASONS

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


@pytest.mark.parametrize("fairness", ["kubernetes", "maxmin"])
def test_admit_and_reject_if_full_take_one_decision(fairness: str, monkeypatch) -> None:
    """One copy of admit's decision (``Ledger._verdict_locked``): admit's general path and
    ``reject_if_full`` each ask it once per arrival and do what it says (a rejection with its
    reason, run, or wait); admit's fast path runs a request without asking."""
    verdicts: list[int] = []
    decide = Ledger._verdict_locked

    def spy(self, lb: int, flow_hash: int, ms: int) -> tuple[int, int, int]:
        got = decide(self, lb, flow_hash, ms)
        verdicts.append(got[0])
        return got

    monkeypatch.setattr(Ledger, "_verdict_locked", spy)
    rng = random.Random(7)
    # 24 slots, and requests held long: every verdict comes up, no-slot too
    _, led, levels = make(fairness)
    live: list[tuple[int, int]] = []
    seen: set = set()
    for step in range(3000):
        now = (step + 1) * MS
        if live and rng.random() < 0.3:
            slot, gen = live.pop(rng.randrange(len(live)))
            live += [(s, g) for s, g, _ in led.finish(slot, gen, now)[0]]
            continue
        level = levels[rng.choice(["q", "q", "reject", "exempt", "exempt"])]
        flow, seats = rng.randrange(6), rng.choice([1, 1, 1, 2])
        verdicts.clear()
        reason = led.reject_if_full(level, flow, seats, 0, 0, 0, now, 0)
        assert len(verdicts) == 1
        assert reason == (REASONS[verdicts[0]] if verdicts[0] >= 0 else "")
        if reason:
            seen.add(reason)
            continue
        verdicts.clear()
        res = led.admit(level, flow, seats, 0, 0, 0, now, 0)
        assert len(verdicts) <= 1
        if not verdicts:  # the fast path ran it
            assert res.outcome == EXECUTE
        elif verdicts[0] >= 0:  # the state did not change since reject_if_full: no rejection
            raise AssertionError(f"admit rejected {REASONS[verdicts[0]]} after reject_if_full "
                                 "let the request through")
        elif verdicts[0] == requestpath._RUN:
            assert res.outcome == EXECUTE
        else:
            assert verdicts[0] == requestpath._WAIT and res.outcome in (EXECUTE, QUEUED)
        if verdicts:
            seen.add(verdicts[0])
        if res.outcome == EXECUTE:
            live.append((res.slot, res.gen))
        live += [(s, g) for s, g, _ in res.granted]
    assert seen >= {"queue-full", "concurrency-limit", "no-slot", requestpath._RUN,
                    requestpath._WAIT}, seen
    assert verify(led) == []
