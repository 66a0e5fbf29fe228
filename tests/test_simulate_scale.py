"""10,000 distinct flows for 10 simulated minutes, in seconds of wall time, without memory that
grows with the number of flows (the ledger keeps no per-flow state)."""

from __future__ import annotations

import gc
import os
import time
import tracemalloc

from apf_gunicorn.flowcontrol.shufflesharding import deal
from apf_gunicorn.simulate import load_scenario, parse_scenario, simulate
from apf_gunicorn.simulate.backends import LedgerBackend

HERE = os.path.dirname(os.path.abspath(__file__))
SCALE = os.path.join(HERE, "scenarios", "scale", "10k-flows.yaml")
LEDGER_DIR = os.path.join(os.path.dirname(HERE), "apf_gunicorn", "ledger")


def _flows(n: int, calls: int) -> dict:
    """n flows spread evenly over 100 s, each making ``calls`` 1 s calls 100 s apart."""
    return {
        "queueSet": {"concurrencyLimit": 100, "queues": 128, "handSize": 6, "queueLengthLimit": 50},
        "clients": [{"name": "f", "count": n, "stagger": f"{100_000_000 // n}us", "calls": calls,
                     "exec": "1s", "think": "99s"}],
        "evaluate": ["100s"],
    }


def test_ten_thousand_flows_for_ten_minutes_in_seconds(capsys) -> None:
    scenario = load_scenario(SCALE)
    assert len({c.hash for c in scenario.clients}) == 10_000
    started = time.perf_counter()
    result = simulate(scenario)
    elapsed = time.perf_counter() - started
    totals = result.clients.values()
    dispatched = sum(t.dispatched for t in totals)
    rejected = sum(sum(t.rejected.values()) for t in totals)
    assert dispatched + rejected == 60_000
    assert sum(t.completed for t in totals) == dispatched
    assert result.end_ns >= 600 * 10**9
    # the seat demand the backend integrated agrees with the harness's own
    assert all(w.seat_demand["queueSet"]["match"] for w in result.windows)
    # executing seats never exceed the limit: the per-window sum of averages is at most 100
    for w in result.windows:
        assert sum(c.average_executing_seats for c in w.clients.values()) <= 100 + 1e-9
    with capsys.disabled():
        print(f"\n10,000 flows, {result.requests} requests, {result.events} events, "
              f"virtual {result.end_ns / 1e9:.0f} s, wall {elapsed:.2f} s (ledger), "
              f"rejected {rejected}")


def test_ledger_memory_does_not_grow_with_flows() -> None:
    kept: list[LedgerBackend] = []

    def factory(qs, clients):
        # The same capacity for both runs, so only the number of flows differs.
        backend = LedgerBackend.create(
            [("queueSet", qs.queues, qs.hand_size, qs.queue_length_limit, qs.concurrency_limit)],
            slots=2048)
        kept.append(backend)
        return backend

    def ledger_bytes(n: int) -> int:
        kept.clear()
        tracemalloc.start(1)
        try:
            simulate(parse_scenario(_flows(n, 1)), factory)
            # Dealt hands are memoised process-wide (bounded LRU, see below), not ledger state.
            deal.cache_clear()
            gc.collect()  # the LRU links are cyclic
            snap = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        stats = snap.filter_traces([tracemalloc.Filter(True, os.path.join(LEDGER_DIR, "*"))])
        return sum(s.size for s in stats.statistics("filename"))

    small, large = ledger_bytes(250), ledger_bytes(5_000)
    # 20 times the flows may not cost more than a few KiB of ledger-held memory
    assert large - small < 16 * 1024, (small, large)
    # The hand cache grows with flows only up to a fixed bound (about 190 bytes a flow).
    assert deal.cache_info().maxsize is not None and deal.cache_info().maxsize <= 1 << 16
