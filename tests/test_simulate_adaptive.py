"""The adaptive concurrency limit (``auto``) in virtual time: the production controller
(apf_gunicorn.control.adaptive) against backends whose service time depends on
concurrency (apf_gunicorn.simulate.capacity), under both fairnesses (kubernetes, maxmin). No wall clock."""

from __future__ import annotations

import os

import pytest
import yaml

from apf_gunicorn.control.adaptive import (
    AdaptiveLimit,
    AdaptiveSettings,
    KindSample,
    Tick,
    parse_auto,
)
from apf_gunicorn.flowcontrol.borrowing import BorrowingStates
from apf_gunicorn.flowcontrol.loader import digest_objects, load_text
from apf_gunicorn.flowcontrol.relimit import follow_server_limit
from apf_gunicorn.ledger import EXECUTE, QUEUED, Capacity, Ledger, LevelSpec
from apf_gunicorn.ledger.lock import NullLock
from apf_gunicorn.simulate import ScenarioError, format_table, parse_scenario, simulate, to_json

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scenarios", "adaptive")
POLICIES = ["kubernetes", "maxmin"]


def raw(name: str) -> dict:
    with open(os.path.join(HERE, name + ".yaml"), encoding="utf-8") as fh:
        return yaml.safe_load(fh)


def run(doc: dict, policy: str) -> dict:
    return to_json(simulate(parse_scenario(doc, base_dir=HERE), fairness=policy))


def static(doc: dict, limit: int) -> dict:
    doc = dict(doc, queueSet=dict(doc["queueSet"], concurrencyLimit=limit))
    doc.pop("controller", None)
    return doc


def limit_mean(doc: dict, window: int) -> float:
    return doc["evaluations"][window]["concurrencyLimit"]["mean"]


def latency(doc: dict, window: int, client: str) -> dict:
    return doc["evaluations"][window]["latency"][client]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("start", [32, 2])
def test_converges_from_a_wrong_start_to_near_the_pool(policy: str, start: int) -> None:
    doc = raw("pool-long")
    doc["controller"]["start"] = start
    out = run(doc, policy)
    assert 6 <= limit_mean(out, 1) <= 11  # 10..20 s: the pool holds 8
    for client in out["clients"].values():
        assert sum(client["rejected"].values()) == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_a_capacity_drop_lowers_the_limit_and_it_recovers(policy: str) -> None:
    doc = raw("pool-long")
    auto = run(doc, policy)
    hand = run(static(doc, 10), policy)  # tuned by hand to the pool of 8
    before, during, after = limit_mean(auto, 1), limit_mean(auto, 3), limit_mean(auto, 5)
    assert during <= 6 < before  # 30..40 s: the pool holds 4
    assert after >= 7  # 50..60 s: 8 again
    # the light user's latency recovers while the pool is 4; a fixed limit cannot
    assert latency(auto, 3, "alice")["p99"] <= 0.8 * latency(hand, 3, "alice")["p99"]
    assert latency(auto, 3, "alice")["p99"] <= 0.11
    # and the flood keeps the pool busy
    assert latency(auto, 5, "bob")["throughput"] >= 0.9 * latency(hand, 5, "bob")["throughput"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("jitter,seed", [(0.0, 1), (0.2, 1), (0.2, 2), (0.2, 4), (0.2, 5)])
def test_the_issue_pool_scenario_meets_its_targets(policy: str, jitter: float, seed: int) -> None:
    """Issue 19's Done-means on its timeline: pool 8, 4 from 8 s to 15 s, 8 again."""
    doc = raw("pool-issue")  # windows 0-2, 2-8, 8-10, 10-15, 15-18, 18-24 s
    doc["backend"].update(jitter=jitter, seed=seed)
    auto, hand = run(doc, policy), run(static(doc, 10), policy)  # 10: tuned by hand to 8

    def p99(out: dict, window: int) -> float:
        return latency(out, window, "alice")["p99"]

    def rate(out: dict, window: int) -> float:
        return latency(out, window, "bob")["throughput"]

    # pool 8: as good as the hand-tuned limit
    assert p99(auto, 1) <= 1.3 * p99(hand, 1) + 0.010
    assert rate(auto, 1) >= 0.9 * rate(hand, 1)
    # pool 4, once the tick that sees the drop and the next have passed: better than any
    # fixed limit tuned to 8
    assert p99(auto, 3) <= 0.8 * p99(hand, 3)
    # pool 8 again: the flood's throughput is back within 3 s
    assert rate(auto, 4) >= 0.85 * rate(hand, 4)
    # once cut, it holds a seat past the pool of 4: no blind probe up while latency is
    # inflated against no-load baselines (it would only queue inside the app)
    assert [v for t, v in auto["concurrencyLimit"]["series"] if 11 <= t < 15] == [5] * 4
    # the limit is lower while the pool is 4 than before, and higher again after
    assert limit_mean(auto, 3) < limit_mean(auto, 1)
    assert limit_mean(auto, 4) > limit_mean(auto, 3) < limit_mean(auto, 5)
    assert sum(auto["clients"]["alice"]["rejected"].values()) == 0


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("offset", [0.3, 0.5, 0.8])
def test_a_change_inside_a_tick_is_followed_at_once(policy: str, offset: float) -> None:
    """The pool drops to 4 ``offset`` s after a tick: the tick that sees it sees it in part
    (a partial jump, or only a step of the curve); the next one, by Little's law, sees what
    the pool now serves, and finishes the cut. It returns to 8 as far into a tick."""
    doc = raw("pool-issue")
    doc["backend"]["changes"] = [{"at": f"{8 + offset}s", "pool": 4},
                                 {"at": f"{15 + offset}s", "pool": 8}]
    # window 3: from 11 s to the return; window 4: the 3 s after it
    doc["evaluate"] = ["2s", "8s", "11s", f"{15 + offset}s", f"{18 + offset}s", "24s"]
    auto, hand = run(doc, policy), run(static(doc, 10), policy)
    series = dict(auto["concurrencyLimit"]["series"])
    assert series[10.0] <= 6  # two ticks after the drop: the pool of 4 plus the margin
    assert latency(auto, 3, "alice")["p99"] <= 0.8 * latency(hand, 3, "alice")["p99"]
    assert limit_mean(auto, 3) < limit_mean(auto, 1)
    # the return inside a tick: a tick that sees most of it falls to calm, and the limit goes
    # back; one that sees 0.2 s of it does not, and the next does (0.84 of the hand-tuned
    # throughput in the 3 s after the return: docs/adaptive.md, failure modes)
    rate = latency(auto, 4, "bob")["throughput"]
    assert rate >= (0.85 if offset < 0.8 else 0.8) * latency(hand, 4, "bob")["throughput"]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_mix_shift_is_not_taken_for_overload(policy: str) -> None:
    out = run(raw("mix-shift"), policy)  # carol's 100 ms queries join bob's 10 ms at 20 s
    before, after = limit_mean(out, 1), limit_mean(out, 3)
    assert after >= 0.85 * before
    assert after >= 7
    assert latency(out, 3, "carol")["completed"] > 0


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", [7, 2, 5])
def test_noise_does_not_make_it_oscillate(policy: str, seed: int) -> None:
    doc = raw("noise")  # each query 50 ms +-40 %
    doc["backend"]["seed"] = seed
    out = run(doc, policy)
    series = [v for t, v in out["concurrencyLimit"]["series"] if 20 <= t <= 60]
    # around the pool's 8: excursions of a few ticks, at most 5 seats above, 3 below
    assert 5 <= min(series) and max(series) <= 13
    moves = sum(1 for a, b in zip(series, series[1:], strict=False) if a != b)
    assert moves <= len(series) // 2
    assert 7 <= limit_mean(out, 1) <= 10.5 and 7 <= limit_mean(out, 2) <= 10.5


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", [3, 4])
def test_cpu_bound_keeps_the_throughput(policy: str, seed: int) -> None:
    doc = raw("cpu-gil")  # latency grows with concurrency while throughput grows too
    doc["backend"]["seed"] = seed  # which worker each request lands in
    auto = run(doc, policy)
    low, high = run(static(doc, 2), policy), run(static(doc, 8), policy)
    rate = latency(auto, 2, "bob")["throughput"]
    best = max(latency(low, 2, "bob")["throughput"], latency(high, 2, "bob")["throughput"])
    assert rate >= 0.9 * best
    worse = max(latency(low, 2, "alice")["p99"], latency(high, 2, "alice")["p99"])
    assert latency(auto, 2, "alice")["p99"] <= 1.3 * worse + 0.005


@pytest.mark.parametrize("policy", POLICIES)
def test_levels_follow_the_server_limit(policy: str) -> None:
    out = run(raw("levels-pool"), policy)
    assert limit_mean(out, 3) < limit_mean(out, 1)  # the pool of 4 (20..40 s)
    for window in out["evaluations"]:
        levels = window["priorityLevels"]
        server = window["concurrencyLimit"]["end"]
        # nominal seats are the shares of the server limit in force at the window's end
        assert levels["test-pl0"]["nominalLimit"] == levels["test-pl1"]["nominalLimit"]
        assert levels["test-pl0"]["nominalLimit"] <= server
    # flood0's one flow outgrows its queue (queueLengthLimit 10) when seats shrink; flood1 not
    assert sum(out["clients"]["flood1"]["rejected"].values()) == 0


def test_fixed_limit_scenarios_report_no_auto_fields() -> None:
    out = run(static(raw("pool-long"), 10), "kubernetes")
    assert "concurrencyLimit" not in out
    assert "concurrencyLimit" not in out["evaluations"][0]
    assert "latency" in out["evaluations"][0]


def test_the_table_shows_latency_and_the_limit_over_time() -> None:
    text = format_table(simulate(parse_scenario(raw("pool-drop"), base_dir=HERE)))
    assert "p99 ms" in text
    assert "concurrency limit (auto): 20 at the start" in text
    assert "concurrency limit auto:2-64 over time (to the last window's end): 0s 20" in text


# -- levels follow the limit, on a ledger ---------------------------------------------------------

OBJECTS = """
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata: {name: a}
spec:
  type: Limited
  limited:
    nominalConcurrencyShares: 30
    lendablePercent: 0
    limitResponse: {type: Queue, queuing: {queues: 4, handSize: 2, queueLengthLimit: 50}}
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata: {name: b}
spec:
  type: Limited
  limited:
    nominalConcurrencyShares: 10
    lendablePercent: 0
    limitResponse: {type: Queue, queuing: {queues: 4, handSize: 2, queueLengthLimit: 50}}
"""


def test_follow_server_limit_keeps_queues_executing_and_exempt() -> None:
    objects, errors = load_text(OBJECTS, "objects")
    assert not errors
    cfg = digest_objects(objects, sources=["objects"])
    pls = list(cfg.priority_levels.values())
    cap = Capacity()
    led = Ledger.create(bytearray(Ledger.size(cap)), cap, lock=NullLock())
    specs = [LevelSpec(pl.name, pl.desired_queues, pl.queuing.hand_size if pl.queuing else 0,
                       pl.queuing.queue_length_limit if pl.queuing else 0, 0)
             for pl in pls]
    index, _ = led.configure(specs, ["fs"], 0)
    levels = [(pl.name, index[pl.name], pl.is_exempt) for pl in pls]
    states = BorrowingStates()
    limits, _ = follow_server_limit(led, pls, levels, states, 40, 1)
    assert limits["a"].nominal > limits["b"].nominal
    a = index["a"]
    running = [led.admit(a, 7, 1, 0, 0, 0, 2) for _ in range(limits["a"].nominal)]
    assert all(r.outcome == EXECUTE for r in running)
    queued = [led.admit(a, 7, 1, 0, 0, 0, 3) for _ in range(5)]
    assert all(r.outcome == QUEUED for r in queued)
    # a lower server limit: nothing executing is stopped, nothing waiting is dropped
    limits2, granted = follow_server_limit(led, pls, levels, states, 10, 4)
    assert limits2["a"].nominal < limits["a"].nominal and granted == []
    snap = {lv.name: lv for lv in led.snapshot(5).levels}
    assert snap["a"].requests_executing == len(running)
    assert snap["a"].requests_waiting == 5
    assert snap["a"].concurrency_limit == states["a"].current_limit <= limits2["a"].upper
    # the exempt level is never limited
    exempt = index["exempt"]
    assert all(led.admit(exempt, 9, 1, 0, 0, 0, 6).outcome == EXECUTE for _ in range(50))
    # a higher one dispatches the waiting requests
    _, granted = follow_server_limit(led, pls, levels, states, 200, 7)
    assert len(granted) == 5


# -- the pure controller --------------------------------------------------------------------------

def tick(n: int, service_ms: float, concurrency: float, waiting: bool = True,
         kind: str = "k", count: int = 100) -> Tick:
    return Tick(n * 10**9, {kind: KindSample(count, int(count * service_ms * 1e6))},
                concurrency, waiting)


def test_the_baseline_comes_down_and_does_not_creep_up() -> None:
    ctl = AdaptiveLimit(AdaptiveSettings(minimum=2, maximum=64), start=16)
    ctl.update(tick(1, 50, 16))
    for n in range(2, 200):  # sustained load, ever slower: the baseline stays
        ctl.update(tick(n, 50 + n, ctl.limit))
    assert ctl.baselines["k"] == 50e6
    ctl.update(tick(200, 40, ctl.limit))
    assert ctl.baselines["k"] < 50e6


def test_the_floor_holds_under_real_overload() -> None:
    ctl = AdaptiveLimit(AdaptiveSettings(minimum=3, maximum=64), start=32)
    ctl.update(tick(1, 10, 32))
    seen = []
    for n in range(2, 120):  # latency far above the baseline whatever the concurrency
        seen.append(ctl.update(tick(n, 10 * ctl.limit, ctl.limit)))
    assert min(seen) == 3
    assert seen[-20:].count(3) >= 10


def test_a_uniform_slowdown_keeps_the_limit_at_the_knee() -> None:
    ctl = AdaptiveLimit(AdaptiveSettings(minimum=2, maximum=64), start=8)
    seen = []
    for n in range(1, 121):  # a pool of 8; from tick 40 every query takes twice as long
        base = 50 if n < 40 else 100
        service = base * max(1.0, ctl.limit / 8)
        count = int(ctl.limit * 1000 / service)
        seen.append(ctl.update(tick(n, service, ctl.limit, count=count)))
    # a slowdown looks like lost capacity (latency doubles at the same concurrency): the
    # limit is cut by half (the jump, finished by the next tick), a step more as latency stays
    # inflated against the old baseline, and the curve brings it back within 15 ticks
    assert seen[40] < 8 and min(seen[40:]) >= 3 and max(seen[40:55]) >= 8
    # then around the knee, as before the slowdown (the margin: 9 for a pool of 8)
    assert 6 <= min(seen[50:]) and max(seen[50:]) <= 12
    assert ctl.baselines["k"] == 50e6


def test_a_return_of_capacity_in_a_settle_tick_is_not_missed() -> None:
    """A pool of 8, then 4 from tick 20; it returns to 8 on the tick after the cut, whose
    requests straddle the cut: that tick is read anyway, and latency falling below what the
    cut explains restores the limit at once."""
    ctl = AdaptiveLimit(AdaptiveSettings(minimum=2, maximum=64), start=20)
    pool, n, back = 8, 0, None
    while n < 80 and back is None:
        n += 1
        if n == 20:
            pool = 4
        service = 50 * max(1.0, ctl.limit / pool)
        before = ctl.limit
        ctl.update(tick(n, service, ctl.limit, count=int(ctl.limit * 1000 / service)))
        if n >= 20 and ctl.limit != before:
            back = n + 1  # the settle tick of this move
            pool = 8
    assert back is not None
    cut = ctl.limit
    ctl.update(tick(back, 50 * max(1.0, cut / pool), cut, count=int(cut * 1000 / 50)))
    assert ctl.last.reason == "up: latency fell back" and ctl.limit >= 8


def test_a_return_late_in_a_tick_is_seen_beyond_the_noise() -> None:
    """At the margin past a pool of 4, steady; the pool returns to 8 a third of the way into
    a tick, whose latency falls short of calm but beyond the point's noise: that is enough."""
    ctl = AdaptiveLimit(AdaptiveSettings(minimum=2, maximum=64), start=20)
    pool = 8
    for n in range(1, 31):
        if n == 20:
            pool = 4
        service = 50 * max(1.0, ctl.limit / pool)
        ctl.update(tick(n, service, ctl.limit, count=int(ctl.limit * 1000 / service)))
    assert ctl.limit == 5 and ctl.last.reason == "hold: the margin past the knee"
    straddled = 2 / 3 * 50 * 5 / 4 + 1 / 3 * 50  # 2/3 of the tick at 4, 1/3 at 8
    ctl.update(tick(31, straddled, 5, count=int(5 * 1000 / straddled)))
    assert ctl.last.inflation > 1.125  # not calm
    assert ctl.last.reason == "up: latency fell back" and ctl.limit >= 8


def test_an_idle_server_does_not_drift() -> None:
    ctl = AdaptiveLimit(AdaptiveSettings(minimum=2, maximum=64), start=20)
    for n in range(1, 100):
        assert ctl.update(tick(n, 50, 3, waiting=False, count=5)) == 20


@pytest.mark.parametrize("text,want", [("auto", (1, 1024)), ("auto:2-64", (2, 64)),
                                       ("12", None)])
def test_parse_auto(text: str, want) -> None:
    assert parse_auto(text) == want


@pytest.mark.parametrize("text", ["auto:", "auto:5-2", "auto:0-4", "auto:a-b", "auto:3"])
def test_parse_auto_refuses_bad_bounds(text: str) -> None:
    with pytest.raises(ValueError, match="auto"):
        parse_auto(text)


@pytest.mark.parametrize("change,field", [
    (lambda d: d["queueSet"].update(concurrencyLimit="auto:9-3"), "queueSet.concurrencyLimit"),
    (lambda d: d["queueSet"].update(concurrencyLimit="often"), "queueSet.concurrencyLimit"),
    (lambda d: d["backend"].update(cores=2), "backend"),
    (lambda d: d["backend"].update(pool=0), "backend.pool"),
    (lambda d: d["backend"].update(workers=2), "backend.workers"),
    (lambda d: d["backend"].update(jitter=1.5), "backend.jitter"),
    (lambda d: d["backend"].update(busy=3), "backend.busy"),
    (lambda d: d["backend"].update(busy={"slowdown": -1}), "backend.busy.slowdown"),
    (lambda d: d["backend"].update(busy={"slowdown": 1, "period": "0s"}), "backend.busy.period"),
    (lambda d: d["backend"].update(busy={"speed": 1}), "backend.busy.speed"),
    (lambda d: d["backend"]["changes"].append({"at": "1s", "pool": 2}), "backend.changes[2].at"),
    (lambda d: d["backend"]["changes"].append({"at": "30s", "cores": 2}),
     "backend.changes[2].cores"),
    (lambda d: d["controller"].update(start=100), "controller.start"),
    (lambda d: d["controller"].update(often=1), "controller.often"),
    (lambda d: d["clients"][0].update(overhead="1x"), "clients[0].overhead"),
])
def test_scenario_errors_name_the_field(change, field: str) -> None:
    doc = raw("pool-drop")
    change(doc)
    with pytest.raises(ScenarioError) as info:
        parse_scenario(doc, base_dir=HERE)
    assert field in [e.field for e in getattr(info.value, "errors", [info.value])]


def test_controller_needs_an_auto_limit_and_overhead_a_backend() -> None:
    doc = static(raw("pool-drop"), 10)
    doc["controller"] = {"start": 4}
    del doc["backend"]
    doc["clients"][0]["overhead"] = "1ms"
    with pytest.raises(ScenarioError) as info:
        parse_scenario(doc, base_dir=HERE)
    fields = [e.field for e in info.value.errors]
    assert "controller" in fields and "clients[0].overhead" in fields


# -- the backends ---------------------------------------------------------------------------------

def test_connection_pool_is_first_come_first_served_and_resizes() -> None:
    from apf_gunicorn.simulate.capacity import ConnectionPool
    from apf_gunicorn.simulate.engine import EventLoop

    loop = EventLoop()
    pool = ConnectionPool(loop, 2)
    done = {}
    for name in "abcd":
        pool.begin(10, lambda n=name: done.setdefault(n, loop.now))
    loop.run_until(5)
    pool.set_capacity(1)  # the two holders keep their connections
    loop.run()
    assert done == {"a": 10, "b": 10, "c": 20, "d": 30}
    pool.set_capacity(3)
    for name in "efg":
        pool.begin(10, lambda n=name: done.setdefault(n, loop.now))
    loop.run()
    assert [done[n] for n in "efg"] == [40, 40, 40]


def test_shared_cores_process_sharing_and_the_gil() -> None:
    from apf_gunicorn.simulate.capacity import SharedCores
    from apf_gunicorn.simulate.engine import EventLoop

    loop = EventLoop()
    cores = SharedCores(loop, 2)
    done = []
    for _ in range(4):  # 4 requests of 10 ns on 2 cores: each at half speed
        cores.begin(10, lambda: done.append(loop.now))
    loop.run()
    assert done == [20, 20, 20, 20]
    loop = EventLoop()
    gil = SharedCores(loop, 8, workers=1)  # one process: one request at a time, 8 cores or not
    done = []
    for _ in range(4):
        gil.begin(10, lambda: done.append(loop.now))
    loop.run()
    assert done == [40, 40, 40, 40]
    loop = EventLoop()
    cores = SharedCores(loop, 1)
    done = []
    cores.begin(10, lambda: done.append(("a", loop.now)))
    loop.run_until(5)
    cores.set_capacity(2)  # alone, it never runs faster than one core
    cores.begin(10, lambda: done.append(("b", loop.now)))
    loop.run()
    assert done == [("a", 10), ("b", 15)]


def test_with_a_backend_clients_are_closed_loops_that_stop_at_the_last_window() -> None:
    doc = {"queueSet": {"concurrencyLimit": 4, "queues": 4, "handSize": 2,
                        "queueLengthLimit": 10},
           "backend": {"pool": 1},
           "clients": [{"name": "a", "hash": 1, "calls": 1000, "exec": "10ms", "think": "5ms"}],
           "evaluate": ["100ms"]}
    out = run(doc, "kubernetes")
    # calls at 0, 15, ..., 90 ms: each ends 10 ms later, the next follows 5 ms after that
    assert out["clients"]["a"]["dispatched"] == 7
    assert latency(out, 0, "a") == {"completed": 7, "throughput": 70.0, "p50": 0.01,
                                    "p99": 0.01, "max": 0.01}


# -- issue 26: the knee, not past it; the light users first; a busy host; a mix of routes -------

def _window_lines(auto: dict, hand: dict) -> list[tuple[bool, str]]:
    """Issue 26's pool lines on its timeline (windows: 0-4, 4-12, 12-18 P8, 18-20, 20-28 P4,
    28-33 R, 33-34, 34-40 R8), auto against the hand-tuned limit."""
    def p99(out: dict, w: int) -> float:
        return latency(out, w, "alice")["p99"]

    def rate(out: dict, w: int) -> float:
        return latency(out, w, "bob")["throughput"]

    lines = []
    for w, name in ((2, "P8"), (7, "R8")):
        lines.append((p99(auto, w) <= 1.2 * p99(hand, w) + 0.005, f"{name} p99"))
        lines.append((rate(auto, w) >= 0.9 * rate(hand, w), f"{name} flood"))
    lines.append((p99(auto, 4) <= 0.8 * p99(hand, 4), "P4 p99"))
    lines.append((rate(auto, 5) >= 0.85 * rate(hand, 5), "R flood"))
    lines.append((limit_mean(auto, 4) < min(limit_mean(auto, 2), limit_mean(auto, 7)),
                  "limit lower in P4"))
    lines.append((sum(auto["clients"]["alice"]["rejected"].values()) == 0, "alice never rejected"))
    return lines


@pytest.mark.parametrize("policy", POLICIES)
def test_at_the_high_it_sits_at_the_knee_not_past_it(policy: str) -> None:
    """Issue 26, decision 1: at steady state the limit sits at the pool's knee (8: the level
    gets the whole limit here), not a seat past it, where one of the light user's requests in
    a few waits for a connection. The margin past the knee is kept only while recovering."""
    out = run(raw("pool-long"), policy)
    steady = [v for t, v in out["concurrencyLimit"]["series"] if 45 <= t < 60]
    assert max(steady) <= 8, steady
    during = [v for t, v in out["concurrencyLimit"]["series"] if 25 <= t < 40]
    assert max(during) == 5  # recovering: the pool of 4 plus the margin


@pytest.mark.parametrize("policy", POLICIES)
def test_the_issue_26_timeline_meets_its_lines(policy: str) -> None:
    """Light users alone for 4 s (their latency is the no-load one: the baselines are
    anchored), then the flood; pool 8, 4 from 18 s to 28 s, 8 again."""
    doc = raw("pool-timeline")
    auto, hand = run(doc, policy), run(static(doc, 10), policy)
    missed = [name for ok, name in _window_lines(auto, hand) if not ok]
    assert missed == []


def test_light_traffic_alone_anchors_the_baselines() -> None:
    """A tick with at most one request at a time and nothing waiting saw no contention: its
    latency is the no-load one. A later cut does not then undershoot a pool of 4 (without the
    anchor the curve's far step took the limit to 3 with a pool of 4 and 5 seats calm)."""
    ctl = AdaptiveLimit(AdaptiveSettings(minimum=1, maximum=40), start=20)
    for n in range(1, 4):
        ctl.update(tick(n, 54, 0.2, waiting=False, count=4))
    assert ctl._anchored


def test_past_the_knee_from_a_far_lower_point_it_steps_towards_calm() -> None:
    """The look below lands at 10 for a pool of 8 plus a little Python: the seats above the
    light traffic's single seat paid on the whole, but 10 is past the knee (latency x1.16):
    the limit steps towards calm instead of holding there."""
    ctl = AdaptiveLimit(AdaptiveSettings(minimum=1, maximum=40), start=20)
    for n in range(1, 4):
        ctl.update(tick(n, 58, 0.2, waiting=False, count=4))
    ctl.update(tick(4, 129.0, 20.0, count=152))  # the flood: the look below, 20 -> 10
    assert ctl.limit == 10
    ctl.update(tick(5, 71.0, 10.1, count=160))  # the settle tick
    ctl.update(tick(6, 67.3, 10.0, count=160))  # two seats past the pool's 8 x 58/50
    assert ctl.limit == 9 and ctl.last.reason == "down: past the knee, towards calm"


@pytest.mark.parametrize("policy", POLICIES)
def test_an_app_that_only_sleeps_ends_where_the_limit_does_not_bind(policy: str) -> None:
    """Issue 26, decision 3: a cheap and a 200 ms route under one FlowSchema, no shared
    resource; the kinds are routes (as on the server: admission/routekinds.py). With auto:2-20
    more seats always pay: the limit ends at its bound and stays there (moves of less than a
    quarter a second once the flood has run 5 s). With plain auto the limit never binds."""
    doc = raw("mixed-sleep")
    out = run(doc, policy)
    series = [v for t, v in out["concurrencyLimit"]["series"] if t >= 7]
    assert series[-1] == 20
    assert all(abs(b - a) < 0.25 * a for a, b in zip(series, series[1:], strict=False)), series
    doc["queueSet"]["concurrencyLimit"] = "auto:1-128"
    doc["controller"]["start"] = 64  # where the server starts for 2 x 64 threads
    out = run(doc, policy)
    assert {v for _, v in out["concurrencyLimit"]["series"]} == {64}


@pytest.mark.parametrize("policy", POLICIES)
def test_a_busy_host_does_not_drag_the_limit_down_at_steady_state(policy: str) -> None:
    """Issue 26, decision 3: another process stretches every request's Python by 1 to 9
    every second (pool-busy.yaml), latency our seats do not cause. With nothing known around
    the limit and latency within the tolerance, the limit holds instead of stepping down on
    that noise; before, it drifted to 5-8 after the pool's return (R8's flood 0.75 of the
    hand-tuned limit's on the same host). Still missed here, and documented: P4's p99 and the
    flood in the 5 s after the return (docs/adaptive.md, failure modes). Under ``maxmin`` P8's
    p99 is not asserted either: there the limit is still on its way down from the start in
    12-18 s, and the lockstep hold (docs/fairness.md) took the hand-tuned run's p99 from 156
    to 128 ms, below 1.2 x of which auto's 185 ms does not come (under ``kubernetes``, with no
    hold: 162 against 156)."""
    doc = raw("pool-busy")
    auto, hand = run(doc, policy), run(static(doc, 10), policy)
    lines = dict((name, ok) for ok, name in _window_lines(auto, hand))
    held = ["P8 flood", "R8 p99", "R8 flood", "limit lower in P4", "alice never rejected"]
    if policy == "kubernetes":
        held.append("P8 p99")
    assert [name for name in held if not lines[name]] == []


def test_a_few_light_users_anchor_the_baselines_too() -> None:
    """Five light users run about 1.2 requests at a time: still no contention for a pool of
    8. Without the anchor the margin and the fall back stay off after a drop, and on the real
    server the limit drifted below a pool of 4 and came back 6 s after its return."""
    ctl = AdaptiveLimit(AdaptiveSettings(minimum=1, maximum=40), start=20)
    for n in range(1, 4):
        ctl.update(tick(n, 52, 1.2, waiting=False, count=23))
    assert ctl._anchored
