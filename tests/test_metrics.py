"""Metrics: multiprocess per-request series (real forked processes), the derived dispatched
counter, merging dead workers' files, and the ledger collector."""

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
from apf_gunicorn.server.metrics import LedgerCollector, MasterView

CHILD = textwrap.dedent(r'''
    import json, os, sys, time
    from apf_gunicorn.server import metrics as m
    path = m.setup_multiprocess_dir("test", base=sys.argv[1])
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    def work(n_ok, n_exempt):
        rm = m.RequestMetrics("apf")
        for _ in range(n_ok):
            rm.observe_work("wl", "fs1", 2)
            rm.observe_dispatched("wl", "fs1", 0.01)
            rm.observe_execution("wl", "fs1", 0.2)
        for _ in range(n_exempt):
            rm.observe_work("exempt", "exempt", 1)
            rm.observe_dispatched("exempt", "exempt", None)
            rm.observe_execution("exempt", "exempt", 0.001, watch=True)
        rm.observe_work("wl", "fs1", 1)
        rm.observe_rejected("wl", "fs1", "queue-full", 0.0)
        rm.observe_work("wl", "fs1", 1)
        rm.observe_rejected("wl", "fs1", "time-out", 3.0)

    def scrape(reg):
        out = {}
        for fam in text_string_to_metric_families(generate_latest(reg).decode()):
            for s in fam.samples:
                if s.name.endswith("_bucket"):
                    continue
                key = s.name + json.dumps(dict(sorted(s.labels.items())))
                out[key] = s.value
        return out

    pids = []
    for i, (n_ok, n_ex) in enumerate([(5, 1), (7, 2)]):
        pid = os.fork()
        if pid == 0:
            work(n_ok, n_ex)
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


def test_multiprocess_series_derived_dispatched_and_dead_workers(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    before, after = res["before"], res["after"]
    wl = {"priority_level": "wl", "flow_schema": "fs1"}
    ex = {"priority_level": "exempt", "flow_schema": "exempt"}
    # 12 non-exempt dispatches derived from the wait histogram (14 execute=true observations
    # minus the 2 timed-out ones); 3 exempt dispatches counted directly
    assert before[_k("apf_dispatched_requests_total", **wl)] == 12
    assert before[_k("apf_dispatched_requests_total", **ex)] == 3
    assert before[_k("apf_rejected_requests_total", reason="time-out", **wl)] == 2
    assert before[_k("apf_rejected_requests_total", reason="queue-full", **wl)] == 2
    assert before[_k("apf_request_wait_duration_seconds_count", execute="false", **wl)] == 2
    assert before[_k("apf_request_wait_duration_seconds_count", execute="true", **wl)] == 14
    assert before[_k("apf_request_execution_seconds_count", type="watch", **ex)] == 3
    assert before[_k("apf_work_estimated_seats_count", **wl)] == 16
    assert before[_k("apf_work_estimated_seats_sum", **wl)] == 28
    # after both workers died: identical numbers from the merged archive, files folded
    assert after == before
    pids = res["pids"]
    assert any(str(pids[0]) in f for f in res["files_before"])
    assert not any(str(p) in f for p in pids for f in res["files_after"])
    assert set(res["files_after"]) == {"counter_archive.db", "histogram_archive.db"}


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


def _req(level_fs, state, initial=1, final=0):
    return NS(fs_index=level_fs, state=state, initial_seats=initial, final_seats=final)


def test_ledger_collector_exact_gauges() -> None:
    snap = NS(now=0, flow_schema_names=["exempt", "global-default", "catch-all"], levels=[
        NS(name="global-default", concurrency_limit=56, current_r=150_000_000, requests=[
            _req(1, "executing", 2), _req(1, "waiting", 1, 3), _req(1, "waiting"),
            _req(1, 3, 1, 4),  # lingering (numeric state): seats held, not executing
        ]),
        NS(name="exempt", concurrency_limit=0, current_r=0, requests=[_req(0, 2)]),
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
    assert got[_k("apf_nominal_limit_seats", priority_level="global-default")] == 49
    assert got[_k("apf_lower_limit_seats", priority_level="global-default")] == 24
    assert got[_k("apf_upper_limit_seats", priority_level="global-default")] == 649
    assert got[_k("apf_demand_seats_smoothed", priority_level="global-default")] == 3.5
    assert got[_k("apf_demand_seats_high_watermark", priority_level="global-default")] == 4
    assert got[_k("apf_target_seats", priority_level="global-default")] == 24
    assert got[_k("apf_seat_fair_frac")] == 2.25
    # when everything drains the series stay, at 0 (no stale values, no vanishing series)
    for lv in snap.levels:
        lv.requests = []
    got = _scrape(col)
    assert got[_k("apf_current_executing_seats", **gd)] == 0
    assert got[_k("apf_current_inqueue_requests", **gd)] == 0


def test_ledger_collector_before_configuration_is_empty() -> None:
    col = LedgerCollector("apf", lambda: MasterView())
    assert _scrape(col) == {}
