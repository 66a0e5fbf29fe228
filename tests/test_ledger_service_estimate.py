"""The service estimate G: fixed as in Kubernetes, or learnt per level from finished requests.

A dispatched request charges its queue ``initial seats x G`` and its completion corrects that to
the time it really ran. With Kubernetes' fixed G = 3 ms, a queue whose requests run 50 ms looks
47 ms per executing request cheaper than it is until they finish, so a flow that arrives fresh
(at R) waits behind it. A learnt G removes most of that lag; the last test shows the effect on
a flooded level, driven by the production ledger on the simulator's virtual clock.
"""

from __future__ import annotations

import random
import statistics

import pytest

from apf_gunicorn.ledger import EXECUTE, REJECTED, Capacity, Ledger, LevelSpec, verify
from apf_gunicorn.ledger.ledger import (
    DEFAULT_SERVICE_ESTIMATE_NS,
    MAX_SERVICE_ESTIMATE_NS,
    SERVICE_WINDOW,
    learn_service,
)
from apf_gunicorn.simulate.engine import EventLoop

MS = 1_000_000
CAP = Capacity(levels=4, queues=64, slots=128, workers=4, flow_schemas=2, stats_entries=8)


def _ledger(learn: bool, accelerate: bool = True) -> Ledger:
    return Ledger.create(bytearray(Ledger.size(CAP)), CAP, learn_service=learn,
                         accelerate=accelerate)


def _ndr(led: Ledger, level: int, now: int) -> int:
    (queue,) = [q for q in led.snapshot(now).levels[level].queues if q.executing]
    return queue.next_dispatch_r


def test_learn_service_is_a_mean_then_an_exponential_average() -> None:
    assert learn_service(3 * MS, 1, 50 * MS) == 50 * MS  # the first finish replaces the prior
    assert learn_service(50 * MS, 2, 10 * MS) == 30 * MS
    assert learn_service(50 * MS, SERVICE_WINDOW, 66 * MS) == 51 * MS
    assert learn_service(50 * MS, SERVICE_WINDOW, 34 * MS) == 49 * MS
    assert learn_service(5, 1, -7) == 0  # clamped to [0, 60 s]
    assert learn_service(0, 1, 10**15) == MAX_SERVICE_ESTIMATE_NS
    g = 0
    for n in range(1, 200):
        g = learn_service(g, min(n, SERVICE_WINDOW), 40 * MS)
    assert g == 40 * MS


@pytest.mark.parametrize("accelerate", [True, False], ids=["c", "python"])
@pytest.mark.parametrize("learn", [False, True], ids=["fixed", "learnt"])
def test_each_request_is_corrected_by_the_g_it_was_charged(learn: bool, accelerate: bool) -> None:
    led = _ledger(learn, accelerate)
    lv = led.configure([LevelSpec("a", 1, 1, 10, 4)], ["fs"], 0)[0]["a"]
    admit = lambda now: led.admit(lv, 7, 1, 0, 0, 0, now)  # noqa: E731 - one flow, one queue
    a, b = admit(0), admit(0)
    assert _ndr(led, lv, 0) == 2 * 300_000  # 2 x G = 3 ms, in 1e-8 seat-seconds
    led.finish(a.slot, a.gen, 50 * MS)  # ran 50 ms: corrected by +47 ms
    assert _ndr(led, lv, 50 * MS) == 5_300_000
    assert led.level_service_estimate_ns(lv) == (50 * MS if learn else 3 * MS)
    # R ran at 2 seats for 50 ms: 10_000_000, and C, the queue's head, starts from that floor
    c = admit(50 * MS)  # charged the level's G of now
    assert _ndr(led, lv, 50 * MS) == 10_000_000 + (5_000_000 if learn else 300_000)
    led.finish(b.slot, b.gen, 60 * MS)  # ran 60 ms, charged 3 ms
    assert led.level_service_estimate_ns(lv) == (55 * MS if learn else 3 * MS)
    led.finish(c.slot, c.gen, 80 * MS)  # ran 30 ms, corrected from the G it was charged
    # the net charge is the time each request ran from the floor on, B's 57 ms and C's 30 ms,
    # whatever G was (correcting C by the level's 55 ms would leave 18_200_000)
    queues = led.snapshot(80 * MS).levels[lv].queues
    assert max(q.next_dispatch_r for q in queues) == 18_700_000
    assert verify(led) == []


def test_exempt_and_reaped_requests_teach_nothing_and_levels_learn_apart() -> None:
    led = _ledger(True)
    ids = led.configure([LevelSpec("a", 4, 2, 10, 4), LevelSpec("b", 4, 2, 10, 4),
                         LevelSpec("x", -1, 0, 0, 0)], ["fs"], 0)[0]
    led.register_worker(1, 4242, 0)
    for name in ("x", "b"):
        res = led.admit(ids[name], 9, 1, 0, 0, 1, 0)
        assert res.outcome == EXECUTE
    led.finish(res.slot, res.gen, 20 * MS)  # level b learns 20 ms
    res = led.admit(ids["a"], 9, 1, 0, 0, 1, 0)
    led.reap_worker(1, 900 * MS)  # the worker died: its requests' times are not service times
    g = {name: led.level_service_estimate_ns(i) for name, i in ids.items()}
    assert g == {"a": DEFAULT_SERVICE_ESTIMATE_NS, "b": 20 * MS, "x": DEFAULT_SERVICE_ESTIMATE_NS}
    assert led.snapshot(900 * MS).levels[ids["b"]].service_estimate_ns == 20 * MS
    # a reload keeps what a level learnt; a new level starts from the configured G
    ids = led.configure([LevelSpec("b", 8, 2, 10, 4), LevelSpec("c", 4, 2, 10, 4)], ["fs"],
                        1000 * MS)[0]
    assert led.level_service_estimate_ns(ids["b"]) == 20 * MS
    assert led.level_service_estimate_ns(ids["c"]) == DEFAULT_SERVICE_ESTIMATE_NS
    assert verify(led) == []


def _light_waits(seed: int, learn: bool, pause_ms: int) -> list[float]:
    """Milliseconds waited by a light flow (2 clients, ``pause_ms`` between a response and
    the next request) while a heavy flow floods with 48 connections: 8 seats, 16 queues, hand
    size 4, requests of 45-55 ms, both flows starting together, 3 s of virtual time."""
    rnd = random.Random(seed)
    led = _ledger(learn)
    lv = led.configure([LevelSpec("l", 16, 4, 50, 8)], ["fs"], 0)[0]["l"]
    loop = EventLoop()
    heavy, light = rnd.getrandbits(64), rnd.getrandbits(64)
    waits: list[float] = []
    arrived: dict = {}

    def call(flow: int) -> None:
        res = led.admit(lv, flow, 1, 0, 0, 0, loop.now)
        assert res.outcome != REJECTED
        arrived[(res.slot, res.gen)] = (flow, loop.now)
        start([(s, g) for s, g, _ in res.granted]
              + ([(res.slot, res.gen)] if res.outcome == EXECUTE else []))

    def start(handles: list) -> None:
        for h in handles:
            flow, t0 = arrived.pop(h)
            if flow == light:
                waits.append((loop.now - t0) / MS)
            loop.after(int(MS * rnd.uniform(45, 55)), lambda h=h, flow=flow: end(h, flow))

    def end(h: tuple, flow: int) -> None:
        granted, _ = led.finish(h[0], h[1], loop.now)
        start([(s, g) for s, g, _ in granted])
        if loop.now < 3000 * MS:
            loop.after(pause_ms * MS if flow == light else 0, lambda: call(flow))

    for i in range(48):
        loop.at(i * 1000, lambda: call(heavy))
    for i in range(2):
        loop.at(100_000 + i * 3 * MS, lambda: call(light))
    loop.run()
    return waits


@pytest.mark.parametrize("pause_ms", [100, 0])
def test_a_learnt_g_shortens_a_light_flows_waits_under_a_flood(pause_ms: int) -> None:
    fixed = statistics.mean(statistics.mean(_light_waits(s, False, pause_ms)) for s in range(4))
    learnt = statistics.mean(statistics.mean(_light_waits(s, True, pause_ms)) for s in range(4))
    print(f"light flow's mean wait, pause {pause_ms} ms: fixed G {fixed:.1f} ms, "
          f"learnt G {learnt:.1f} ms (a seat frees every {50 / 8:.2f} ms)")
    # the wait for the next seat to free is 50 ms / 8 seats on average; the first requests
    # also wait for the flood's 8 requests that took every seat at the start
    assert learnt <= 2 * 50 / 8
    if pause_ms:  # a client that pauses finds its queue idle, so R lag hits it every time
        assert learnt <= 0.8 * fixed
