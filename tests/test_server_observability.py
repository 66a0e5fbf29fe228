"""Observability acceptance tests on a real gunicorn (2 workers, admin endpoint on a free
127.0.0.1 port): borrowing seen in /metrics and in the app, /metrics consistent with the dumps
and with what the clients saw across a worker SIGKILL and a HUP, the dumps' Kubernetes layout
and their consistency at one instant, and the server-wide Retry-After.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.apps.loadgen import Client
from tests.conftest import APPS, free_port
from tests.promtool import check_metrics

pytestmark = pytest.mark.server

DUMP = "/debug/api_priority_and_fairness/"


def admin_env(port: int, **extra: str) -> dict:
    return {"APF_ADMIN_BIND": f"127.0.0.1:{port}", **extra}


def admin_get(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read().decode()
        assert resp.status == 200, (path, resp.status, body)
        return body
    finally:
        conn.close()


def scrape(port: int) -> dict[tuple, float]:
    """``{(sample name, sorted label items): value}`` of /metrics."""
    out = {}
    for fam in text_string_to_metric_families(admin_get(port, "/metrics")):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in samples.items()
               if n == name and all(dict(lab).get(k) == x for k, x in labels.items()))


def gauge(samples: dict, name: str, level: str) -> float:
    return samples[(name, (("priority_level", level),))]


def parse_dump(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.split(",")] for line in text.splitlines()]


def tabwriter(rows: list[list[str]]) -> str:
    """Kubernetes' layout: cells joined by ",\\t" through Go text/tabwriter (minwidth 8,
    padding 1): every column but the last padded to max(8, longest cell + comma + 1)."""
    widths = [max(8, max(len(r[i]) + 2 for r in rows)) for i in range(len(rows[0]) - 1)]
    lines = []
    for r in rows:
        cells = [(c + ",").ljust(w) for c, w in zip(r, widths, strict=False)]
        lines.append("".join(cells) + r[-1])
    return "\n".join(lines) + "\n"


LEVEL_HEADER = ("PriorityLevelName, ActiveQueues, IsIdle, IsQuiescing, WaitingRequests, "
                "ExecutingRequests, DispatchedRequests, RejectedRequests, TimedoutRequests, "
                "CancelledRequests")
QUEUE_HEADER = ("PriorityLevelName, Index,  PendingRequests, ExecutingRequests, SeatsInUse, "
                "NextDispatchR, InitialSeatsSum, MaxSeatsSum, TotalWorkSum")
REQUEST_COLUMNS = ["PriorityLevelName", "FlowSchemaName", "QueueIndex", "RequestIndexInQueue",
                   "FlowDistingsher", "ArriveTime", "InitialSeats", "FinalSeats",
                   "AdditionalLatency", "StartTime"]
DETAIL_COLUMNS = ["UserName", "Verb", "APIPath", "Namespace", "Name", "APIVersion", "Resource",
                  "SubResource"]


# -- borrowing --------------------------------------------------------------------------------

def test_borrowing_lends_idle_seats_and_gives_them_back(server_factory):
    aport = free_port()
    env = admin_env(aport, APF_BORROWING_PERIOD="1")
    with server_factory(workers=2, threads=40, config=str(APPS / "borrow.yaml"),
                        env=env) as srv:
        m = scrape(aport)
        assert gauge(m, "apf_nominal_limit_seats", "work") == 8
        assert gauge(m, "apf_lower_limit_seats", "work") == 4
        stop_work, stop_other = threading.Event(), threading.Event()
        work = [Client(srv.port, "/work?ms=100", user=f"w{i}", stop=stop_work)
                for i in range(24)]
        light = [Client(srv.port, "/other?ms=20", user="light", pause=0.2, stop=stop_other)]
        for c in work + light:
            c.start()
        try:
            # the flooded level borrows the light level's lendable seats (the adjustment, its
            # period and numbers, is tested with Kubernetes' vectors in tests/test_borrowing.py;
            # here: that the server runs it; how soon is printed, not bounded)
            t0 = time.monotonic()
            raised = srv.wait_for(
                lambda: gauge(scrape(aport), "apf_current_limit_seats", "work") > 8,
                timeout=30, step=0.1)
            took = time.monotonic() - t0
            m = scrape(aport)
            print(f"work limit {gauge(m, 'apf_current_limit_seats', 'work')} after {took:.1f}s, "
                  f"other {gauge(m, 'apf_current_limit_seats', 'other')}")
            assert raised, "work did not borrow in 30 s of 1 s periods"
            assert gauge(m, "apf_current_limit_seats", "other") < 8
            # most ever executing at once: 8 without borrowing
            assert srv.wait_for(lambda: srv.counters()["work"][1] > 8, timeout=30), \
                f"the app saw at most {srv.counters()['work'][1]} executing: no extra concurrency"

            # the light level's demand returns: its seats come back within two periods
            other = [Client(srv.port, "/other?ms=100", user=f"o{i}", stop=stop_other)
                     for i in range(24)]
            for c in other:
                c.start()
            light += other
            t0 = time.monotonic()
            back = srv.wait_for(
                lambda: gauge(scrape(aport), "apf_current_limit_seats", "other") >= 8,
                timeout=30, step=0.1)
            m = scrape(aport)
            print(f"other limit back to {gauge(m, 'apf_current_limit_seats', 'other')} after "
                  f"{time.monotonic() - t0:.1f}s; work {gauge(m, 'apf_current_limit_seats', 'work')}")
            assert back, "the lender did not get its seats back in 30 s of 1 s periods"
            assert gauge(m, "apf_current_limit_seats", "work") <= 9
        finally:
            stop_work.set()
            stop_other.set()
            for c in work + light:
                c.join(10)
        assert not [e for c in work + light for e in c.errors]


# -- metrics consistency across SIGKILL and HUP ------------------------------------------------

def test_metrics_match_dumps_and_clients_across_kill_and_hup(server_factory):
    aport = free_port()
    env = admin_env(aport, APF_QUEUE_WAIT_LIMIT="0.3")
    with server_factory(workers=2, threads=32, config=str(APPS / "tight.yaml"),
                        env=env) as srv:
        stop = threading.Event()
        clients = {
            "work": [Client(srv.port, "/work?ms=120", user=f"w{i % 6}", stop=stop, timeout=10)
                     for i in range(20)],
            "other": [Client(srv.port, "/other?ms=100", user=f"o{i}", stop=stop, timeout=10)
                      for i in range(12)],
            "exempt": [Client(srv.port, "/healthz", stop=stop, pause=0.02, timeout=10)
                       for _ in range(2)],
        }
        everyone = [c for cs in clients.values() for c in cs]
        # the fixture's readiness probe (GET /healthz, exempt) was counted before the clients
        before = scrape(aport)
        base = {level: (total(before, "apf_dispatched_requests_total", priority_level=level),
                        total(before, "apf_rejected_requests_total", priority_level=level),
                        total(before, "apf_work_estimated_seats_count", priority_level=level))
                for level in clients}
        for c in everyone:
            c.start()
        try:
            # mid-load: requests executing, queued and rejected on several levels
            def mid_load():
                m = scrape(aport)
                return (total(m, "apf_current_executing_requests", priority_level="work") > 0
                        and total(m, "apf_rejected_requests_total", priority_level="other",
                                  reason="concurrency-limit") > 0
                        and total(m, "apf_rejected_requests_total", priority_level="work",
                                  reason="queue-full") > 0)

            assert srv.wait_for(mid_load, timeout=60, step=0.1), scrape(aport)
            workers = srv.workers()
            victim = workers[0]
            os.kill(victim, signal.SIGKILL)
            # reaped and replaced; then served under load again before the HUP
            assert srv.wait_for(lambda: victim not in srv.workers()
                                and len(srv.workers()) == 2, timeout=30), srv.workers()
            assert srv.wait_for_answers(everyone), "not served under load"
            before_hup = set(srv.workers())
            os.kill(srv.pid, signal.SIGHUP)
            # the HUP replaces every worker; then served under load again
            assert srv.wait_for(lambda: len(srv.workers()) == 2
                                and not before_hup & set(srv.workers()), timeout=60), \
                (before_hup, srv.workers())
            assert srv.wait_for_answers(everyone), "not served under load"
        finally:
            stop.set()
            for c in everyone:
                c.join(15)
        assert srv.idle(timeout=10) is not None
        m = scrape(aport)
        levels = {r[0]: r for r in parse_dump(admin_get(aport, DUMP + "dump_priority_levels"))}
        header = levels.pop("PriorityLevelName")
        col = {name: i for i, name in enumerate(header)}
        for level, cs in clients.items():
            seen = Counter(s for c in cs for s in c.statuses)
            errors = sum(len(c.errors) for c in cs)
            answered = sum(seen.values())
            dispatched = total(m, "apf_dispatched_requests_total", priority_level=level)
            rejected = total(m, "apf_rejected_requests_total", priority_level=level)
            dispatched_0, rejected_0, estimated_0 = base[level]
            print(f"{level}: clients saw {dict(seen)} + {errors} errors; metrics dispatched "
                  f"{dispatched:.0f} rejected {rejected:.0f}")
            # every answered request is counted once; a request lost with the killed worker or
            # a connection closed by the HUP is counted if it had been admitted
            sent = (dispatched - dispatched_0) + (rejected - rejected_0)
            assert answered <= sent <= answered + errors
            assert dispatched - dispatched_0 >= seen[200]
            assert rejected - rejected_0 >= seen[429] + seen[503] - errors
            # the dumps' counters are the same numbers
            row = levels[level]
            assert int(row[col["DispatchedRequests"]]) == dispatched
            assert int(row[col["RejectedRequests"]]) == rejected
            if level != "exempt":
                waited = total(m, "apf_request_wait_duration_seconds_count",
                               priority_level=level)
                assert waited > 0
            # every request's seats were estimated exactly once
            assert total(m, "apf_work_estimated_seats_count", priority_level=level) - \
                estimated_0 == sent
        executed = total(m, "apf_request_execution_seconds_count", priority_level="work")
        assert executed <= total(m, "apf_dispatched_requests_total", priority_level="work")
        assert total(m, "apf_current_executing_requests") == 0
        assert total(m, "apf_current_inqueue_requests") == 0


def test_the_readiness_probe_is_counted_once_when_workers_boot_slowly(server_factory):
    # The test above takes its baseline right after the fixture's probe is answered. A probe
    # the fixture gave up on (it waited 2 s) while no worker had booted stayed in the listen
    # backlog, was served later and counted: one exempt request nobody sent, which broke
    # "sent <= answered + errors" whenever the exempt clients saw no error.
    aport = free_port()
    with server_factory(workers=1, threads=4, env=admin_env(aport, APP_IMPORT_DELAY="2.5")):
        def exempt() -> float:
            return total(scrape(aport), "apf_dispatched_requests_total",
                         priority_level="exempt")

        late = exempt()
        time.sleep(1.0)  # a probe left behind is accepted no later than the one answered
        late = max(late, exempt())
    assert late == 1


# -- dumps ------------------------------------------------------------------------------------

def test_dumps_layout_and_consistency_with_parked_requests(server_factory):
    aport = free_port()
    with server_factory(workers=2, threads=16, env=admin_env(aport)) as srv:
        stop = threading.Event()
        # 8 seats of "work" busy for 4 s, 7 more requests parked in its queues
        clients = [Client(srv.port, "/work?ms=4000", user=f"u{i}", count=1, stop=stop)
                   for i in range(15)]
        for c in clients:
            c.start()
        try:
            assert srv.wait_for(lambda: srv.level("work").requests_waiting == 7, timeout=15)
            levels = admin_get(aport, DUMP + "dump_priority_levels")
            queues = admin_get(aport, DUMP + "dump_queues")
            requests = admin_get(aport, DUMP + "dump_requests")
            details = admin_get(aport, DUMP + "dump_requests?includeRequestDetails=1")
        finally:
            stop.set()
            for c in clients:
                c.join(15)
        # golden header rows and Kubernetes' tabwriter layout
        assert levels.splitlines()[0] == LEVEL_HEADER
        assert queues.splitlines()[0] == QUEUE_HEADER
        for text in (levels, queues, requests, details):
            assert tabwriter(parse_dump(text)) == text
        assert parse_dump(requests)[0] == REQUEST_COLUMNS
        assert parse_dump(details)[0] == REQUEST_COLUMNS + DETAIL_COLUMNS

        lv = {r[0]: r for r in parse_dump(levels)[1:]}
        waiting, executing = int(lv["work"][4]), int(lv["work"][5])
        assert (waiting, executing) == (7, 8)
        qrows = [r for r in parse_dump(queues)[1:] if r[0] == "work"]
        assert len(qrows) == 16
        assert sum(int(r[2]) for r in qrows) == waiting
        assert sum(int(r[3]) for r in qrows) == executing
        assert int(lv["work"][1]) == sum(1 for r in qrows if int(r[2]) > 0)  # ActiveQueues
        rrows = [r for r in parse_dump(requests)[1:] if r[0] == "work"]
        assert sum(1 for r in rrows if r[3] != "-1") == waiting
        assert sum(1 for r in rrows if r[3] == "-1") == executing
        assert all(r[9] == "0001-01-01T00:00:00Z" for r in rrows if r[3] != "-1")
        per_queue = Counter(int(r[2]) for r in rrows if r[3] != "-1")
        assert per_queue == {i: int(r[2]) for i, r in enumerate(qrows) if int(r[2])}
        drows = [r for r in parse_dump(details)[1:] if r[0] == "work"]
        assert {r[10] for r in drows} <= {f"u{i}" for i in range(15)}
        assert {r[12] for r in drows} == {"/work"}
        assert all(c.statuses == [200] for c in clients)


def test_maxmin_state_in_dumps_metrics_and_the_cli(server_factory):
    """Under APF_FAIRNESS=maxmin, 22 one-seat requests hold 22 of the level's 24 seats and a
    4-seat request waits: the level reserves for it. The admin endpoint shows that state the
    same way in every view: the fairness columns of dump_priority_levels, dump_flows, /metrics
    (also checked by promtool: tests/promtool.py) and `apf-gunicorn dump`; Kubernetes'
    default text is unchanged."""
    import contextlib
    import io

    from apf_gunicorn.cli import main as cli_main

    aport = free_port()
    env = admin_env(aport, APF_CONCURRENCY_LIMIT="24", APF_FAIRNESS="maxmin",
                    APP_FAIR_LOG=os.devnull)
    with server_factory(workers=2, threads=32, env=env, config=str(APPS / "fair.yaml"),
                        args=("tests.apps.fair_app:app",)) as srv:
        # the wide flow finishes one request first: it has a learnt service time
        assert srv.request("/w4?ms=1", headers={"X-Remote-User": "wide"})[0] == 200
        stop = threading.Event()
        narrow = [Client(srv.port, "/w1?ms=8000", user=f"n{i}", count=1, stop=stop)
                  for i in range(22)]
        wide = Client(srv.port, "/w4?ms=1", user="wide", count=1, stop=stop)
        for c in narrow:
            c.start()
        try:
            assert srv.wait_for(lambda: srv.level("fair").requests_executing == 22, timeout=15)
            wide.start()
            assert srv.wait_for(
                lambda: gauge(scrape(aport), "apf_reserved_seats", "fair") == 4, timeout=30)
            m = scrape(aport)
            plain = admin_get(aport, DUMP + "dump_priority_levels")
            levels = admin_get(aport, DUMP + "dump_priority_levels?includeFairness=1")
            flows = admin_get(aport, DUMP + "dump_flows")
            metrics_text = admin_get(aport, "/metrics")
            cli = {}
            for what in ("levels", "flows"):  # in-process: quick while the state holds
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    rc = cli_main(["dump", what, "--admin", f"127.0.0.1:{aport}"])
                cli[what] = (rc, out.getvalue())
            still_waiting = srv.level("fair").requests_waiting
        finally:
            stop.set()
            for c in [*narrow, wide]:
                c.join(30)
        assert still_waiting == 1, "the wide request ran before the views were read"
        assert all(c.statuses == [200] for c in [*narrow, wide])

    # Kubernetes' text by default; the fairness columns only when asked
    assert plain.splitlines()[0] == LEVEL_HEADER
    assert tabwriter(parse_dump(levels)) == levels
    rows = parse_dump(levels)
    col = {name: i for i, name in enumerate(rows[0])}
    assert rows[0][:10] == LEVEL_HEADER.split(", ")
    fair = next(r for r in rows if r[0] == "fair")
    assert fair[col["Fairness"]] == "maxmin"
    assert fair[col["ActiveFlows"]] == "23"
    assert int(fair[col["Reservations"]]) >= 1
    assert fair[col["VirtualTime"]].endswith("ss")
    exempt = next(r for r in rows if r[0] == "exempt")
    assert exempt[col["Fairness"]] == ""  # exempt levels have no fairness

    frows = parse_dump(flows)
    fcol = {name: i for i, name in enumerate(frows[0])}
    by_user = {r[fcol["FlowDistinguisher"]]: r for r in frows[1:] if r[0] == "fair"}
    assert set(by_user) == {"wide"} | {f"n{i}" for i in range(22)}
    w = by_user["wide"]
    assert (w[fcol["WaitingRequests"]], w[fcol["ExecutingRequests"]], w[fcol["Reserved"]]) == \
        ("1", "0", "true")
    assert w[fcol["FlowHash"]] == fair[col["ReservedFlow"]]
    assert w[fcol["ServiceEstimate"]] != ""  # learnt from its first request
    assert w[fcol["FlowSchemaName"]] == "fair"
    for i in range(22):
        n = by_user[f"n{i}"]
        assert (n[fcol["ExecutingRequests"]], n[fcol["SeatsInUse"]], n[fcol["Reserved"]]) == \
            ("1", "1", "false")

    assert m[("apf_fairness_info", (("fairness", "maxmin"),
                                           ("priority_level", "fair")))] == 1
    assert gauge(m, "apf_active_flows", "fair") == 23
    assert m[("apf_virtual_time_seat_seconds", (("fairness", "maxmin"),
                                                ("priority_level", "fair")))] >= 0
    assert gauge(m, "apf_reservations_total", "fair") >= 1

    assert cli["levels"][0] == 0
    cli_fair = next(r for r in parse_dump(cli["levels"][1]) if r[0] == "fair")
    assert cli_fair[col["Fairness"]] == "maxmin"
    assert cli["flows"][0] == 0 and "wide" in cli["flows"][1]
    check_metrics(metrics_text)  # last: without promtool it skips (fails under CI)


# -- server-wide Retry-After ------------------------------------------------------------------

def test_retry_after_grows_on_every_worker(server_factory):
    with server_factory(workers=2, threads=16, config=str(APPS / "tight.yaml")) as srv:
        stop = threading.Event()
        seen: list[tuple[int, int, float]] = []  # (worker pid, Retry-After, time)
        lock = threading.Lock()

        def client(i: int) -> None:
            conn, pid, n = None, 0, 0
            while not stop.is_set():
                try:
                    if conn is None or n >= 20:
                        # a fresh connection every 20 requests, so both workers get some; the
                        # exempt /pid names the worker that holds it (keep-alive stays there)
                        if conn is not None:
                            conn.close()
                        conn, n = http.client.HTTPConnection("127.0.0.1", srv.port,
                                                             timeout=10), 0
                        conn.request("GET", "/pid")
                        pid = json.loads(conn.getresponse().read())["pid"]
                    n += 1
                    conn.request("GET", "/other?ms=150", headers={"X-Remote-User": f"o{i}"})
                    resp = conn.getresponse()
                    resp.read()
                    if resp.status == 429:
                        with lock:
                            seen.append((pid, int(resp.getheader("Retry-After")),
                                         time.monotonic()))
                except (OSError, http.client.HTTPException, ValueError):
                    if conn is not None:
                        conn.close()
                    conn = None
            if conn is not None:
                conn.close()

        def late_by_worker() -> dict[int, int]:
            """The highest Retry-After per worker among the 429s after 4 s of overload."""
            with lock:
                late = [(pid, ra) for pid, ra, t in seen if t - start > 4.0]
            return {pid: max(ra for p, ra in late if p == pid) for pid, _ in late}

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(24)]
        start = time.monotonic()
        for t in threads:
            t.start()
        try:
            # until every worker answered a 429 with a grown Retry-After (or 60 s)
            grown = srv.wait_for(lambda: (by := late_by_worker()).keys() >= set(srv.workers())
                         and all(v > 1 for v in by.values()), timeout=60, step=0.2)
        finally:
            stop.set()
            for t in threads:
                t.join(15)
        workers = set(srv.workers())
        by_worker = late_by_worker()
        print(f"{len(seen)} 429s; highest Retry-After per worker after 4 s: {by_worker}")
        assert grown, f"workers {workers}; highest Retry-After per worker after 4 s {by_worker}"
        assert set(by_worker) == workers, "429s seen from every worker"
        assert all(v > 1 for v in by_worker.values())


def test_per_pair_gauges_exist_at_zero_on_a_server_scraped_only_while_idle(server_factory):
    """Kubernetes keeps the gauge series of every (level, FlowSchema) pair that has seen a
    request: a server whose /metrics is scraped only while idle still shows them, at 0 (not
    only pairs an earlier scrape happened to catch executing)."""
    aport = free_port()
    names = ("apf_current_executing_seats", "apf_current_executing_requests",
             "apf_current_inqueue_requests", "apf_current_inqueue_seats")
    with server_factory(workers=2, threads=8, env=admin_env(aport)) as srv:
        for path in ("/work?ms=1", "/other?ms=1", "/work?ms=1"):
            assert srv.request(path)[0] == 200
        assert srv.idle(timeout=10) is not None
        samples = scrape(aport)  # the first scrape of this server, while idle
        for level, fs in (("work", "work"), ("other", "other"), ("exempt", "probes")):
            for name in names:
                key = (name, (("flow_schema", fs), ("priority_level", level)))
                assert samples.get(key) == 0, (key, sorted(k for k in samples if k[0] == name))
        # a pair that never saw a request has no series
        assert not any(dict(lab).get("flow_schema") == "catch-all"
                       for (n, lab) in samples if n in names)
