"""Differential test through the simulator's backend adapters: the production ledger against
the reference port (tests/oracle_queueset.py), decision by decision.

The same random workload (arrivals with random flows, widths and tails, including too-wide
requests and tails wider than the limit; completions and lingering releases at random later
times) is applied to both; every admission outcome, rejection reason, set of requests
dispatched, lingering deadline and the epoch count must agree, and so must the seat-demand
statistics until a tail wider than the limit appears (the ledger deliberately does not keep
Kubernetes' totSeatsWaiting drift for those; see docs/ledger.md).
(``tests/test_ledger_vs_oracle.py`` compares the internal state of the two as well.)
"""

from __future__ import annotations

import heapq
import random

import pytest
from oracle_queueset import OracleBackend

from apf_gunicorn.simulate.backends import LedgerBackend

CONFIGS = [
    # (queues, hand, queue length limit, concurrency limit)
    (9, 3, 8, 4),
    (64, 7, 13, 6),
    (1, 1, 5, 2),
    (0, 0, 0, 5),
    (-1, 0, 0, 3),
    (128, 6, 50, 20),
]


def _ledger(queues, hand, qll, limit):
    return LedgerBackend.create([("l", queues, hand, qll, limit)], slots=4096)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "q{}-h{}-qll{}-c{}".format(*c))
@pytest.mark.parametrize("seed", range(3))
def test_same_decisions_as_reference(config, seed) -> None:
    rng = random.Random(seed * 1000 + hash(config) % 1000)
    queues, hand, qll, limit = config
    ledger = _ledger(*config)
    oracle = OracleBackend(queues, hand, qll, limit)
    flows = [rng.getrandbits(64) for _ in range(rng.choice([3, 12, 40]))]
    led_of: dict[int, object] = {}  # request id -> ledger handle
    ora_of: dict[int, object] = {}  # request id -> oracle handle
    id_of_led: dict[object, int] = {}
    id_of_ora: dict[object, int] = {}
    timers: list[tuple[int, int, str, int]] = []  # (when, seq, what, request id)
    seq = 0
    now = 0
    exec_ns: dict[int, int] = {}
    drift = False
    wide_tails = seed == 2  # seeds 0 and 1 keep the seat-demand comparison on all along

    def started(led_granted, ora_granted, context):
        nonlocal seq
        a = sorted(id_of_led[h] for h in led_granted)
        b = sorted(id_of_ora[h] for h in ora_granted)
        assert a == b, (context, now, a, b)
        for rid in a:
            seq += 1
            heapq.heappush(timers, (now + exec_ns[rid], seq, "finish", rid))

    for rid in range(600):
        now += rng.choice([0, 1, 10_000, 3_000_000, 50_000_000, 400_000_000])
        while timers and timers[0][0] <= now:
            when, _, what, tid = heapq.heappop(timers)
            if what == "finish":
                lg, ll = ledger.finish(led_of[tid], when)
                og, ol = oracle.finish(ora_of[tid], when)
                assert ll == ol, ("linger", when, tid)
                if ll:
                    seq += 1
                    heapq.heappush(timers, (ll, seq, "release", tid))
                started(lg, og, f"finish {tid}")
            else:
                started(ledger.release(led_of[tid], when), oracle.release(ora_of[tid], when),
                        f"release {tid}")
        seats = rng.choice([1, 1, 1, 2, 3, limit + 1])
        final = rng.choice([0, 0, 1, seats, seats] + ([limit + 2] if wide_tails else []))
        drift |= final > limit and final > seats
        tail = rng.choice([0, 0, 5_000_000, 1_000_000_000]) if final else 0
        exec_ns[rid] = rng.choice([1_000_000, 250_000_000, 1_000_000_000, 3_000_000_000])
        flow = rng.choice(flows)
        la = ledger.admit(0, flow, seats, final, tail, now)
        oa = oracle.admit(0, flow, seats, final, tail, now)
        assert (la.handle is None) == (oa.handle is None), ("admit", rid, now, la, oa)
        assert la.reason == oa.reason
        if la.handle is not None:
            led_of[rid], ora_of[rid] = la.handle, oa.handle
            id_of_led[la.handle], id_of_ora[oa.handle] = rid, rid
            started(la.granted, oa.granted, f"admit {rid}")
        if rid % 97 == 0 and not drift:
            got, want = ledger.demand_stats(0, now), oracle.demand_stats(0, now)
            assert got.duration == pytest.approx(want.duration, rel=1e-9, abs=1e-9)
            assert got.average == pytest.approx(want.average, rel=1e-9, nan_ok=True)
            assert got.max == want.max
    assert ledger.epoch_advances() == oracle.epoch_advances()
