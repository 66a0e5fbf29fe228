"""The ledger decides exactly as a literal port of Kubernetes' queueset (tests/oracle_queueset.py).

Random request streams (admit, finish, release, time passing) drive both; after every step the
outcome, the granted requests, R, the robin index, the enqueue counter and every queue's
nextDispatchR, waiting count and seats must be identical. Final seats stay <= C here because the
oracle keeps Kubernetes' totSeatsWaiting drift and the ledger does not (see docs/ledger.md).
"""

from __future__ import annotations

import math
import random

import pytest

from apf_gunicorn.ledger import EXECUTE, QUEUED, REJECTED, Capacity, Ledger, LevelSpec, verify
from apf_gunicorn.ledger import layout as L
from tests.oracle_queueset import OracleQueueSet

CAP = Capacity(levels=4, queues=256, slots=512, workers=4, flow_schemas=4, detail_bytes=0)


def _compare(led: Ledger, level: int, qs: OracleQueueSet) -> None:
    w, u = led._w, led._u
    lb = led._lb(level)
    assert u[lb + L.L_R] == qs.current_r
    assert w[lb + L.L_ENQUEUES] == qs.enqueues
    if qs.queues:
        assert w[lb + L.L_ROBIN] == qs.robin_index
    assert w[lb + L.L_WAITING] == qs.tot_requests_waiting
    assert w[lb + L.L_EXECUTING] == qs.tot_requests_executing
    assert w[lb + L.L_SEATS_IN_USE] == qs.tot_seats_in_use
    assert w[lb + L.L_SEATS_WAITING] == qs.tot_seats_waiting
    for q in qs.queues:
        qa = led._qa(lb, q.index)
        assert u[qa + L.Q_NDR] == q.next_dispatch_r, f"queue {q.index}"
        assert w[qa + L.Q_WAITING] == len(q.waiting)
        assert w[qa + L.Q_EXECUTING] == len(q.executing)
        assert w[qa + L.Q_SEATS] == q.seats_in_use


def _run(seed: int, queues: int, hand: int, qll: int, c: int, steps: int) -> None:
    rnd = random.Random(seed)
    led = Ledger.create(bytearray(Ledger.size(CAP)), CAP)
    levels, _ = led.configure([LevelSpec("l", queues, hand, qll, c)], [], 0)
    level = levels["l"]
    qs = OracleQueueSet(queues, hand, qll, c, 0)
    now = 0
    hashes = [rnd.getrandbits(64) for _ in range(rnd.randint(1, 12))]
    executing: list = []  # (oracle request, slot, gen)
    lingering: list = []  # (oracle request, slot, gen, until)
    waiting: dict = {}  # (slot, gen) -> oracle request
    for _ in range(steps):
        now += rnd.choice([0, 1, 7, 1000, 3_000_000, 250_000_000, 1_000_000_000])
        op = rnd.random()
        if len(waiting) > 12:
            op = 0.6
        if op < 0.45 or not (executing or lingering):
            initial = rnd.randint(1, max(1, min(3, c + 1)))
            final = rnd.randint(0, max(c, 0))
            al = rnd.choice([0, 0, 5_000_000, 700_000_000])
            h = rnd.choice(hashes)
            res = led.admit(level, h, initial, final, al, 0, now)
            r, reason, granted = qs.start_request(h, initial, final, al, now)
            if r is None:
                assert res.outcome == REJECTED and res.reason == reason
            else:
                started = r.executing
                assert res.outcome == (EXECUTE if started else QUEUED)
                if started:
                    executing.append((r, res.slot, res.gen))
                else:
                    waiting[(res.slot, res.gen)] = r
                granted = [g for g in granted if g is not r]
            got = res.granted
        elif op < 0.85 and executing:
            r, s, g = executing.pop(rnd.randrange(len(executing)))
            got, until = led.finish(s, g, now)
            granted, o_until = qs.finish(r, now)
            assert until == o_until
            if until:
                lingering.append((r, s, g, until))
        else:
            if not lingering:
                continue
            lingering.sort(key=lambda x: x[3])
            r, s, g, until = lingering.pop(0)
            now = max(now, until)
            got = led.release(s, g, now)
            granted = qs.release(r, now)
        want = []
        for req in granted:
            key = next(k for k, v in waiting.items() if v is req)
            del waiting[key]
            executing.append((req, key[0], key[1]))
            want.append(key)
        assert [(s, g) for s, g, _owner in got] == want
        _compare(led, level, qs)
    assert verify(led) == []
    mine = led.take_demand_stats(level, now + 1)
    theirs = qs.seat_demand.reset(now + 1)
    for a, b in zip(mine, theirs, strict=True):
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("seed", range(12))
def test_random_streams_match_the_oracle(seed: int) -> None:
    rnd = random.Random(1000 + seed)
    queues = rnd.choice([1, 2, 3, 9, 64])
    hand = rnd.randint(1, min(queues, 6))
    _run(seed, queues, hand, qll=rnd.randint(1, 8), c=rnd.randint(1, 6), steps=400)


@pytest.mark.parametrize("desired", [0, -1])
def test_queueless_levels_match_the_oracle(desired: int) -> None:
    _run(7, desired, 0, qll=0, c=3, steps=300)
