"""Metrics: the per-request series read from the ledger's request stats, the courtesy export of
the application's own multiprocess files (real forked processes, dead-worker merging), and the
ledger collector's gauges."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace as NS

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from apf_gunicorn.flowcontrol.borrowing import BorrowingState, BorrowingStates
from apf_gunicorn.master.metrics import (
    LedgerCollector,
    MasterView,
    RequestStatsCollector,
    build_registry,
)
from tests.promtool import check_metrics

# The application (not apf_gunicorn) uses multiprocess mode: two worker processes count, die,
# and the master's /metrics registry serves the aggregate before and after the merge.
CHILD = textwrap.dedent(r'''
    import json, os, sys
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path = sys.argv[1]
    from prometheus_client import Counter, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from apf_gunicorn.master import metrics as m

    def work(n):
        c = Counter("app_orders", "orders", ["kind"])
        h = Histogram("app_latency_seconds", "latency", buckets=(0.1, 1))
        for _ in range(n):
            c.labels("web").inc()
            h.observe(0.5)

    def scrape(reg):
        out = {}
        for fam in text_string_to_metric_families(generate_latest(reg).decode()):
            for s in fam.samples:
                out[s.name + json.dumps(dict(sorted(s.labels.items())))] = s.value
        return out

    pids = []
    for n in (5, 7):
        pid = os.fork()
        if pid == 0:
            work(n)
            os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    reg = m.build_registry("apf", None)
    before = scrape(reg)
    files_before = sorted(os.listdir(path))
    for pid in pids:
        m.mark_process_dead(pid)
    after = scrape(reg)
    print(json.dumps({"before": before, "after": after, "files_before": files_before,
                      "files_after": sorted(os.listdir(path)), "pids": pids}))
''')


def _k(name: str, **labels: str) -> str:
    return name + json.dumps(dict(sorted(labels.items())))


def test_application_multiprocess_files_are_served_and_dead_workers_merged(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    before, after = res["before"], res["after"]
    assert before[_k("app_orders_total", kind="web")] == 12
    assert before[_k("app_latency_seconds_count")] == 12
    assert before[_k("app_latency_seconds_bucket", le="1.0")] == 12
    assert before[_k("app_latency_seconds_bucket", le="0.1")] == 0
    # after both workers died: the same numbers, from the merged archive
    assert after == before
    pids = res["pids"]
    assert any(str(pids[0]) in f for f in res["files_before"])
    assert not any(str(p) in f for p in pids for f in res["files_after"])
    assert set(res["files_after"]) == {"counter_archive.db", "histogram_archive.db"}


def test_without_multiprocess_dir_nothing_of_it_is_registered(monkeypatch, tmp_path) -> None:
    from apf_gunicorn.master import metrics

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    reg = build_registry("apf", lambda: MasterView())
    assert not any(isinstance(c, metrics.UserMultiprocessCollector)
                   for c in reg._collector_to_names)
    metrics.mark_process_dead(12345)  # no directory: a no-op, no files created
    assert os.listdir(tmp_path) == []


DUR = (0.0, 0.005, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 30.0)
WORK = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 100.0)


def _hist(bounds, values):
    """A ledger-style Hist (non-cumulative counts, +Inf last) of ``values``."""
    counts = [0] * (len(bounds) + 1)
    for v in values:
        counts[next((i for i, b in enumerate(bounds) if v <= b), len(bounds))] += 1
    return NS(bounds=bounds, counts=tuple(counts), sum=float(sum(values)), count=len(values))


def _stats(level, fs, *, work=(), dispatched=0, rejected=None, wait_x=(), wait_r=(),
           exec_r=(), exec_w=(), delayed=None):
    reasons = dict.fromkeys(("queue-full", "concurrency-limit", "time-out", "cancelled",
                             "no-slot"), 0)
    reasons.update(rejected or {})
    return NS(level=level, flow_schema=fs, work=_hist(WORK, work), dispatched=dispatched,
              rejected=reasons, wait_executed=_hist(DUR, wait_x),
              wait_rejected=_hist(DUR, wait_r), execution_regular=_hist(DUR, exec_r),
              execution_watch=_hist(DUR, exec_w),
              delayed={**dict.fromkeys(reasons, 0), **(delayed or {})})


class StatsLedger:
    def __init__(self, stats) -> None:
        self.stats = stats

    def request_stats(self):
        return self.stats


def test_request_stats_become_kubernetes_series() -> None:
    stats = [
        _stats("workload-low", "service-accounts", work=[1, 1, 3, 150], dispatched=3,
               rejected={"queue-full": 1, "time-out": 2}, wait_x=[0.003, 0.5, 40.0],
               wait_r=[0.0], exec_r=[0.01, 0.3], exec_w=[0.001], delayed={"queue-full": 1}),
        _stats("exempt", "exempt", work=[1, 1], dispatched=2, exec_r=[0.002, 0.004]),
    ]
    view = MasterView(ledger=StatsLedger(stats))
    got = _scrape(RequestStatsCollector("myapf", lambda: view))
    wl = {"priority_level": "workload-low", "flow_schema": "service-accounts"}
    ex = {"priority_level": "exempt", "flow_schema": "exempt"}
    assert got[_k("myapf_dispatched_requests_total", **wl)] == 3
    assert got[_k("myapf_dispatched_requests_total", **ex)] == 2
    assert got[_k("myapf_rejected_requests_total", reason="queue-full", **wl)] == 1
    assert got[_k("myapf_rejected_requests_total", reason="time-out", **wl)] == 2
    # a reason, execute value or type that never happened is not a series (as Kubernetes)
    assert _k("myapf_rejected_requests_total", reason="no-slot", **wl) not in got
    # the 429s a poller held, with the same labels as the rejections they are among
    assert got[_k("myapf_rejections_delayed_total", reason="queue-full", **wl)] == 1
    assert [k for k in got if k.startswith("myapf_rejections_delayed_total")] == \
        [_k("myapf_rejections_delayed_total", reason="queue-full", **wl)]
    assert not any(k.startswith("myapf_request_wait_duration_seconds") and '"exempt"' in k
                   for k in got)
    assert _k("myapf_request_execution_seconds_count", type="watch", **ex) not in got
    # cumulative buckets with Kubernetes' bounds; +Inf equals the count
    b = "myapf_request_wait_duration_seconds_bucket"
    assert got[_k(b, execute="true", le="0.0", **wl)] == 0
    assert got[_k(b, execute="true", le="0.005", **wl)] == 1
    assert got[_k(b, execute="true", le="0.2", **wl)] == 1
    assert got[_k(b, execute="true", le="0.5", **wl)] == 2
    assert got[_k(b, execute="true", le="30.0", **wl)] == 2
    assert got[_k(b, execute="true", le="+Inf", **wl)] == 3
    assert got[_k("myapf_request_wait_duration_seconds_count", execute="true", **wl)] == 3
    assert got[_k("myapf_request_wait_duration_seconds_sum", execute="true", **wl)] == 40.503
    assert got[_k(b, execute="false", le="0.0", **wl)] == 1
    assert got[_k("myapf_request_execution_seconds_count", type="regular", **wl)] == 2
    assert got[_k("myapf_request_execution_seconds_count", type="watch", **wl)] == 1
    assert got[_k("myapf_request_execution_seconds_bucket", type="regular", le="0.02",
                  **wl)] == 1
    w = "myapf_work_estimated_seats_bucket"
    assert got[_k(w, le="1.0", **wl)] == 2
    assert got[_k(w, le="2.0", **wl)] == 2
    assert got[_k(w, le="4.0", **wl)] == 3
    assert got[_k(w, le="100.0", **wl)] == 3
    assert got[_k(w, le="+Inf", **wl)] == 4
    assert got[_k("myapf_work_estimated_seats_sum", **wl)] == 155


def test_request_stats_collector_before_configuration_is_empty() -> None:
    assert _scrape(RequestStatsCollector("apf", lambda: MasterView())) == {}


def _scrape(collector) -> dict[str, float]:
    from prometheus_client import generate_latest

    reg = CollectorRegistry(auto_describe=False)
    reg.register(collector)
    out = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            out[s.name + json.dumps(dict(sorted(s.labels.items())))] = s.value
    return out


class SnapLedger:
    def __init__(self, snap) -> None:
        self.snap = snap

    def snapshot(self, now):
        return self.snap

    def request_stats(self):
        return []


def _req(level_fs, state, initial=1, final=0):
    return NS(fs_index=level_fs, state=state, initial_seats=initial, final_seats=final)


def test_ledger_collector_exact_gauges() -> None:
    snap = NS(now=0, head_timeouts=3, flow_schema_names=["exempt", "global-default",
                                                         "catch-all"], levels=[
        NS(name="global-default", concurrency_limit=56, current_r=150_000_000,
           desired_queues=128, service_estimate_ns=42_000_000, requests=[
            _req(1, "executing", 2), _req(1, "waiting", 1, 3), _req(1, "waiting"),
            _req(1, 3, 1, 4),  # lingering (numeric state): seats held, not executing
        ]),
        NS(name="exempt", concurrency_limit=0, current_r=0, desired_queues=-1,
           service_estimate_ns=3_000_000, requests=[_req(0, 2)]),
    ])
    states = BorrowingStates()
    states["global-default"] = BorrowingState(current_limit=56, smoothed=3.5, avg=3.0,
                                              stddev=0.5, high_watermark=4, target=24.0)
    states.fair_frac = 2.25
    limits = {"global-default": NS(nominal=49, lower=24, upper=649)}
    view = MasterView(ledger=SnapLedger(snap), level_limits=limits, borrowing=states, workers=1)
    col = LedgerCollector("apf", lambda: view)
    got = _scrape(col)
    gd = {"priority_level": "global-default", "flow_schema": "global-default"}
    assert got[_k("apf_current_executing_requests", **gd)] == 1
    assert got[_k("apf_current_executing_seats", **gd)] == 6  # 2 + lingering max(1, 4)
    assert got[_k("apf_current_inqueue_requests", **gd)] == 2
    assert got[_k("apf_current_inqueue_seats", **gd)] == 4
    assert got[_k("apf_current_executing_requests", priority_level="exempt",
                  flow_schema="exempt")] == 1
    assert got[_k("apf_current_limit_seats", priority_level="global-default")] == 56
    assert got[_k("apf_current_r", priority_level="global-default")] == 1.5
    assert got[_k("apf_service_estimate_seconds", priority_level="global-default")] == 0.042
    assert _k("apf_service_estimate_seconds", priority_level="exempt") not in got
    assert got[_k("apf_nominal_limit_seats", priority_level="global-default")] == 49
    assert got[_k("apf_lower_limit_seats", priority_level="global-default")] == 24
    assert got[_k("apf_upper_limit_seats", priority_level="global-default")] == 649
    assert got[_k("apf_demand_seats_smoothed", priority_level="global-default")] == 3.5
    assert got[_k("apf_demand_seats_high_watermark", priority_level="global-default")] == 4
    assert got[_k("apf_target_seats", priority_level="global-default")] == 24
    assert got[_k("apf_seat_fair_frac")] == 2.25
    assert got[_k("apf_request_head_timeouts_total")] == 3
    # when everything drains the series stay, at 0 (no stale values, no vanishing series)
    for lv in snap.levels:
        lv.requests = []
    got = _scrape(col)
    assert got[_k("apf_current_executing_seats", **gd)] == 0
    assert got[_k("apf_current_inqueue_requests", **gd)] == 0


def test_ledger_collector_exports_every_pair_seen_at_zero_when_idle() -> None:
    """A collector that never saw a request executing (first scrape while idle) still exports
    the four per-(level, FlowSchema) gauges, at 0, for every pair that has seen a request,
    rejected ones included; a pair that never saw one has no series."""
    from apf_gunicorn.ledger import EXECUTE, Capacity, Ledger, LevelSpec

    cap = Capacity(levels=4, queues=16, slots=16, workers=2, flow_schemas=4, detail_bytes=16)
    led = Ledger.create(bytearray(Ledger.size(cap)), cap)
    levels, schemas = led.configure([LevelSpec("a", 3, 1, 1, 1), LevelSpec("b", 3, 1, 1, 1)],
                                    ["fs-a", "fs-b", "fs-never"], 0)
    a, b = levels["a"], levels["b"]
    r = led.admit(a, 1, 1, 0, 0, 0, 0, schemas["fs-a"])
    assert r.outcome == EXECUTE
    led.finish(r.slot, r.gen, 10)
    r = led.admit(b, 2, 1, 0, 0, 0, 20, schemas["fs-b"])
    assert r.outcome == EXECUTE
    led.finish(r.slot, r.gen, 30)
    col = LedgerCollector("apf", lambda: MasterView(ledger=led, workers=1, clock=lambda: 40))
    got = _scrape(col)
    names = ("apf_current_executing_seats", "apf_current_executing_requests",
             "apf_current_inqueue_requests", "apf_current_inqueue_seats")
    for level, fs in (("a", "fs-a"), ("b", "fs-b")):
        for name in names:
            assert got[_k(name, priority_level=level, flow_schema=fs)] == 0, (name, level, fs)
    assert not any("fs-never" in k for k in got)
    assert sum(1 for k in got if k.startswith("apf_current_executing_seats")) == 2


def test_ledger_collector_before_configuration_is_empty() -> None:
    col = LedgerCollector("apf", lambda: MasterView())
    assert _scrape(col) == {}


def _wind_to_high_r(led, level: int, underflow: bool) -> None:
    """Put level's R just below Kubernetes' highR with one executing and one waiting request on
    one queue (as tests/test_ledger_k8s.py does); the next time sync advances the epoch.
    With ``underflow`` the busy queue's nextDispatchR is below rDecrement, so winding it back
    underflows and the advance counts as failed."""
    from apf_gunicorn.ledger import layout as L
    from apf_gunicorn.ledger.seatseconds import HIGH_R, R_DECREMENT

    lb = led._lb(level)
    w, u = led._w, led._u
    base = HIGH_R - 10
    u[lb + L.L_R] = base
    ndr = R_DECREMENT - 1 if underflow else base + 100
    for q in range(w[lb + L.L_NQ]):
        qa = led._qa(lb, q)
        if w[qa + L.Q_WAITING] or w[qa + L.Q_EXECUTING]:
            u[qa + L.Q_NDR] = ndr
            s = w[qa + L.Q_HEAD]
            while s != L.NIL:
                u[led._sa(s) + L.S_ARRIVAL_R] = base
                s = w[led._sa(s) + L.S_NEXT]
    led._rebuild_tree_locked(lb)


def test_epoch_advance_total_follows_the_ledger() -> None:
    from apf_gunicorn.ledger import EXECUTE, QUEUED, Capacity, Ledger, LevelSpec

    cap = Capacity(levels=4, queues=16, slots=16, workers=2, flow_schemas=2, detail_bytes=16)
    led = Ledger.create(bytearray(Ledger.size(cap)), cap)
    levels, _ = led.configure([LevelSpec("busy", 3, 1, 100, 1), LevelSpec("idle", 3, 1, 100, 1)],
                              ["fs"], 0)
    busy = levels["busy"]
    view = MasterView(ledger=led, workers=1, clock=lambda: 0)
    col = LedgerCollector("apf", lambda: view)
    key_ok = _k("apf_epoch_advance_total", priority_level="busy", success="true")
    key_fail = _k("apf_epoch_advance_total", priority_level="busy", success="false")
    got = _scrape(col)
    # every level has its success="true" series from the start; "false" only once it happened
    assert got[key_ok] == 0
    assert got[_k("apf_epoch_advance_total", priority_level="idle", success="true")] == 0
    assert not any('"success": "false"' in k for k in got)

    a = led.admit(busy, 0, 1, 0, 0, 0, 0)
    b = led.admit(busy, 0, 1, 0, 0, 0, 0)
    assert (a.outcome, b.outcome) == (EXECUTE, QUEUED)
    _wind_to_high_r(led, busy, underflow=False)
    led.admit(busy, 99, 1, 0, 0, 0, 100)  # the time sync crosses highR: a clean advance
    got = _scrape(col)
    assert got[key_ok] == 1
    assert key_fail not in got
    assert got[_k("apf_epoch_advance_total", priority_level="idle", success="true")] == 0

    _wind_to_high_r(led, busy, underflow=True)
    led.admit(busy, 7, 1, 0, 0, 0, 1_000_000)
    got = _scrape(col)
    assert got[key_ok] == 1
    assert got[key_fail] == 1
    snap_level = next(lv for lv in led.snapshot(0).levels if lv.name == "busy")
    assert (snap_level.epoch_advances, snap_level.epoch_advance_failures) == (1, 1)


def test_fairness_and_virtual_time_per_level() -> None:
    """Each queuing level names its fairness (an info series) and exports the virtual time that
    fairness orders by: R under kubernetes, V under maxmin; maxmin levels also export their
    active flows and the seats held for a reserved wide head. Exempt levels have none."""
    from apf_gunicorn.ledger import QUEUED, Capacity, Ledger, LevelSpec

    sec = 1_000_000_000
    cap = Capacity(levels=4, queues=32, slots=16, workers=2, flow_schemas=2, detail_bytes=16)
    led = Ledger.create(bytearray(Ledger.size(cap)), cap)
    levels, _ = led.configure([LevelSpec("mm", 8, 2, 8, 4, "maxmin"), LevelSpec("k8s", 8, 2, 8, 4),
                               LevelSpec("exempt", -1, 0, 0, 0, None)], ["fs"], 0)
    mm, k8s = levels["mm"], levels["k8s"]
    col = LedgerCollector("apf", lambda: MasterView(ledger=led, workers=1, clock=lambda: 0))
    got = _scrape(col)
    assert got[_k("apf_fairness_info", priority_level="mm", fairness="maxmin")] == 1
    assert got[_k("apf_fairness_info", priority_level="k8s", fairness="kubernetes")] == 1
    assert not any('"exempt"' in k for k in got if "fairness_info" in k or "virtual" in k)
    assert got[_k("apf_active_flows", priority_level="mm")] == 0
    assert got[_k("apf_reserved_seats", priority_level="mm")] == 0
    assert not any("k8s" in k for k in got if "flows" in k or "reserv" in k)

    first = [led.admit(mm, 1, 1, 0, 0, 0, 10) for _ in range(3)]
    assert led.admit(mm, 2, 4, 0, 0, 0, 20).outcome == QUEUED  # 4 seats wide, 1 free
    led.finish(first[0].slot, first[0].gen, sec)
    for _ in range(6):
        led.admit(k8s, 5, 1, 0, 0, 0, 40)
    led.admit(k8s, 6, 1, 0, 0, 0, 2 * sec)  # R moves while k8s's queues are busy
    snap = led.snapshot(3 * sec)
    lv = {x.name: x for x in snap.levels}
    got = _scrape(col)
    assert got[_k("apf_virtual_time_seat_seconds", priority_level="mm", fairness="maxmin")] == \
        lv["mm"].maxmin["v"] / 1e9 > 0
    assert got[_k("apf_virtual_time_seat_seconds", priority_level="k8s",
                  fairness="kubernetes")] == lv["k8s"].current_r / 1e8 > 0
    assert got[_k("apf_active_flows", priority_level="mm")] == 2
    assert got[_k("apf_reserved_seats", priority_level="mm")] == 4
    assert got[_k("apf_reservations_total", priority_level="mm")] == 1


def test_metrics_text_passes_promtool(tmp_path) -> None:
    """The whole /metrics text (both fairnesses, borrowing, request stats) passes
    ``promtool check metrics``, Prometheus' own linter (tests/promtool.py: without it the
    test skips, or fails under CI)."""
    from prometheus_client import generate_latest

    from apf_gunicorn.ledger import Capacity, Ledger, LevelSpec
    cap = Capacity(levels=4, queues=32, slots=16, workers=2, flow_schemas=2, detail_bytes=16)
    led = Ledger.create(bytearray(Ledger.size(cap)), cap)
    levels, _ = led.configure([LevelSpec("mm", 8, 2, 8, 4, "maxmin"), LevelSpec("k8s", 8, 2, 8, 4),
                               LevelSpec("exempt", -1, 0, 0, 0, None)], ["fs"], 0)
    for level in ("mm", "k8s"):
        for h in range(6):
            led.admit(levels[level], h % 3, 1 + h % 2, 0, 0, 0, 10 + h)
    led.turn_away(levels["k8s"], 0, 1, "thread-reserve", 20)
    led.count_rejection_delayed(levels["k8s"], 0, "thread-reserve")  # held by a poller
    states = BorrowingStates()
    states["mm"] = BorrowingState(current_limit=4, smoothed=3.5, avg=3.0, stddev=0.5,
                                  high_watermark=4, target=4.0)
    view = MasterView(ledger=led, level_limits={"mm": NS(nominal=4, lower=2, upper=8)},
                      borrowing=states, workers=1, clock=lambda: 100)
    text = generate_latest(build_registry("apf", lambda: view)).decode()
    assert "apf_virtual_time_seat_seconds{" in text and "apf_reserved_seats{" in text
    assert "apf_rejections_delayed_total{" in text
    check_metrics(text)
