"""Fairness between flows of different widths on a real gunicorn (2 workers).

One queuing level of 24 seats (tests/apps/fair.yaml; 24 rather than 8 so that a 4-seat request
is not clamped to the level's max seats, 15% of its limit) and three flows, users ``flow1``,
``flow2`` and ``flow4``, each a process of 12 keep-alive connections looping on a view of 1, 2
or 4 seats (Flask ``@cost``, tests/apps/fair_app.py) that sleeps 100 ms. Twelve connections
keep every flow backlogged: its max-min share, 24 / 3 = 8 seats, is 8, 4 or 2 requests. The
app records each request's width, flow, start and end; from those records alone the test
computes each flow's average executing seats over 4 s of 250 ms sample intervals in which every
flow was waiting in the ledger at both ends (gathered within 120 s, after every flow first
queued) and compares it with the max-min fair split (:func:`tests.apps.fairness.maxmin_split`).
Only backlogged intervals count: on a loaded machine the flood processes fall behind at times,
and a flow that is not waiting has no claim to its share.

Parametrized by ``APF_FAIRNESS`` (tests/apps/fairness.py ``FAIRNESS``). For a fairness that
is max-min fair (``MAXMIN``) each flow must be within 10% of its share. For
``kubernetes`` the split is printed, not asserted (Kubernetes' queueset is fair between
queues, not flows, and idles seats behind a wide head: issue 12); what is asserted holds for
any fairness: the app never runs more than the limit in seats, every flow is served, 4 s of
backlogged intervals were found (else the comparison means nothing), nothing fails, and the
ledger drains.

Run with ``-s`` to see the numbers.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from tests.apps.fair_app import WIDTHS, read_records
from tests.apps.fairness import FAIRNESS, MAXMIN, average_seats, maxmin_split, peak_seats
from tests.apps.flood import Flood
from tests.conftest import APPS

LIMIT = 24  # tests/apps/fair.yaml with APF_CONCURRENCY_LIMIT=24
CONNECTIONS = 12  # per flow
MS = 100  # every request's service time
MEASURE_S, SAMPLE_S = 4.0, 0.25
GATHER_S = 120  # the deadline for gathering MEASURE_S of backlogged intervals
BOUND = 0.10  # max-min fairnesses: each flow within 10% of its fair share


def _flow(width: int) -> str:
    return f"flow{width}"


@pytest.mark.server
@pytest.mark.parametrize("fairness", FAIRNESS)
def test_flows_of_widths_1_2_4_share_the_seats(server_factory, tmp_path, fairness) -> None:
    log = tmp_path / "fair.log"
    env = {"APF_CONCURRENCY_LIMIT": str(LIMIT), "APF_FAIRNESS": fairness,
           "APP_FAIR_LOG": str(log)}
    with server_factory(workers=2, threads=32, env=env, config=str(APPS / "fair.yaml"),
                        args=("tests.apps.fair_app:app",)) as srv:
        level = srv.level("fair")
        assert level.concurrency_limit == LIMIT
        floods = {}
        samples = []  # per sample: {width: (waiting, executing seats)}
        windows = []  # [start, end) ns of the sample intervals with every flow waiting
        with contextlib.ExitStack() as stack:
            for w in WIDTHS:
                floods[w] = stack.enter_context(
                    Flood(srv.port, f"/w{w}?ms={MS}", user=_flow(w), connections=CONNECTIONS))
            assert srv.wait_for(lambda: _all_waiting(_sample(srv)), timeout=60), \
                "the flows never all queued"
            deadline = time.monotonic() + GATHER_S
            prev = (time.monotonic_ns(), _sample(srv))
            while len(windows) < MEASURE_S / SAMPLE_S and time.monotonic() < deadline:
                time.sleep(SAMPLE_S)  # the sampling period
                now = (time.monotonic_ns(), _sample(srv))
                samples.append(now[1])
                if _all_waiting(prev[1]) and _all_waiting(now[1]):
                    windows.append((prev[0], now[0]))
                prev = now
        assert srv.idle(timeout=60) is not None, "seats or waiting requests left in the ledger"

    records = read_records(str(log))
    spans = [(r.user, r.seats, r.start_ns, r.end_ns) for r in records]
    measured = sum(t1 - t0 for t0, t1 in windows)
    got: dict[str, float] = {}
    for t0, t1 in windows:
        for f, seats in average_seats(spans, t0, t1).items():
            got[f] = got.get(f, 0.0) + seats * (t1 - t0) / measured
    demands = {_flow(w): CONNECTIONS * w for w in WIDTHS}
    fair = maxmin_split(LIMIT, demands)
    deviation = {f: got.get(f, 0.0) / fair[f] - 1 for f in fair}
    backlogged = sum(all(s[w][0] > 0 for w in WIDTHS) for s in samples) / len(samples)
    print(f"\nAPF_FAIRNESS={fairness}: limit {LIMIT}, {CONNECTIONS} connections per flow, "
          f"{MS} ms requests, {measured / 1e9:.1f} s of backlogged intervals")
    for f in fair:
        print(f"  {f}: {got.get(f, 0.0):5.2f} seats (max-min share {fair[f]:.2f}, "
              f"{deviation[f]:+.1%})")
    print(f"  in use {sum(got.values()):.2f} of {LIMIT} seats; peak {peak_seats(spans)}; "
          f"every flow waiting in {backlogged:.0%} of {len(samples)} samples; statuses "
          + ", ".join(f"{_flow(w)} {floods[w].statuses}" for w in WIDTHS))

    assert {r.user for r in records} == set(fair), "a request of an unknown flow"
    assert {(r.user, r.seats) for r in records} == {(_flow(w), w) for w in WIDTHS}
    for w in WIDTHS:
        assert not floods[w].errors and set(floods[w].statuses) <= {200, 429}, floods[w].statuses
    assert peak_seats(spans) <= LIMIT, "the app ran more seats at once than the limit"
    assert all(got.get(f, 0.0) > 0 for f in fair), f"a flow was starved: {got}"
    assert len(windows) >= MEASURE_S / SAMPLE_S, (
        f"only {len(windows)} backlogged intervals in {GATHER_S} s: the split would mean nothing")
    if fairness in MAXMIN:
        far = {f: f"{d:+.1%}" for f, d in deviation.items() if abs(d) > BOUND}
        assert not far, f"beyond {BOUND:.0%} of the max-min share: {far}"


def _sample(srv) -> dict[int, list[int]]:
    """{width: [requests waiting, seats executing]} of the level's requests now."""
    seen = {w: [0, 0] for w in WIDTHS}
    for req in srv.level("fair").requests:
        if req.initial_seats in seen:
            if req.state == "waiting":
                seen[req.initial_seats][0] += 1
            elif req.state == "executing":
                seen[req.initial_seats][1] += req.initial_seats
    return seen


def _all_waiting(sample: dict[int, list[int]]) -> bool:
    return all(sample[w][0] > 0 for w in WIDTHS)


# -- the arithmetic (no server) ------------------------------------------------------------------


def test_maxmin_split_water_fills() -> None:
    assert maxmin_split(24, {"a": 12, "b": 24, "c": 48}) == {"a": 8, "b": 8, "c": 8}
    assert maxmin_split(24, {"a": 2, "b": 100, "c": 5}) == {"a": 2, "b": 17, "c": 5}
    assert maxmin_split(24, {"a": 2, "b": 3}) == {"a": 2, "b": 3}  # under-demand: no more


def test_average_and_peak_seats_from_spans() -> None:
    s = 1_000_000_000
    spans = [("a", 1, 0, 2 * s), ("b", 4, s, 3 * s), ("a", 2, 2 * s, 4 * s), ("c", 1, 5 * s, 6 * s)]
    # window [1 s, 3 s): a holds 1 seat for 1 s then 2 seats for 1 s; b 4 seats for 2 s
    assert average_seats(spans, s, 3 * s) == {"a": 1.5, "b": 4.0}
    assert peak_seats(spans) == 6  # b with a's second request; a's first ends as it starts
    assert peak_seats([("a", 3, 0, s), ("b", 3, s, 2 * s)]) == 3
