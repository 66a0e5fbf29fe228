"""APF end to end on a real gunicorn with several workers: the server-wide limit, fairness,
isolation, exempt requests, rejections, disconnects, errors in the app.

The test config (tests/apps/apf.yaml, APF_CONCURRENCY_LIMIT=16) gives levels "work" and
"other" 8 seats each; the app counts executing requests across processes.
"""

import socket
import statistics
import threading
import time

import pytest

from tests.apps.fairness import FAIRNESS
from tests.apps.flood import Flood
from tests.apps.loadgen import Client, run_clients

pytestmark = pytest.mark.server


def test_limit_holds_across_processes(server_factory):
    # APF_ACCEPT_GRACE: 64 client threads of this process may take longer than the default
    # 0.25 s between a connect and its head on a loaded machine
    with server_factory(workers=4, threads=24, env={"APF_ACCEPT_GRACE": "2"}) as srv:
        clients = [Client(srv.port, "/work?ms=100", user=f"u{i % 8}", count=5)
                   for i in range(64)]
        run_clients(clients, timeout=60)
        statuses = [s for c in clients for s in c.statuses]
        errors = [e for c in clients for e in c.errors]
        cur, top = srv.counters()["work"]
        print(f"max executing {top}, {len(statuses)} responses, errors {errors[:3]}")
        assert not errors
        served = statuses.count(200)
        assert served + statuses.count(429) == 64 * 5
        # The queues hold every request, and 64 clients connecting at once are spread over
        # the workers by the accept gate (a just-accepted connection counts for it while its
        # head is on the way): no 429 at all.
        assert served == 64 * 5, f"{64 * 5 - served} answered 429"
        assert top == 8, f"at most 8 seats, and all 8 used while demand lasts (saw {top})"
        assert cur == 0
        snap = srv.idle()
        assert snap is not None, "seats or waiting requests left in the ledger"
        work = next(lv for lv in snap.levels if lv.name == "work")
        assert work.dispatched == served


def test_burst_of_connects_spreads_over_workers(server_factory):
    """18 connections opened at once, their heads sent only once all are open, on 3 workers
    with 6 non-exempt threads each (8 threads, APF_EXEMPT_THREADS=2): every request is served.
    A worker counts a connection it just accepted for its accept gate while the head is on the
    way (``APF_ACCEPT_GRACE``), so it stops accepting at its 6th and the others take the rest;
    without that, the first worker to wake accepts most of the burst (they have sent nothing)
    and answers what is past its threads 429 (``thread-reserve``)."""
    # (a grace longer than this loaded machine may take to run all three workers' accepts;
    # the default, 0.25 s, is for a server that is not starved of CPU)
    with server_factory(workers=3, threads=8, env={"APF_ACCEPT_GRACE": "5"}) as srv:
        socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=30)
                 for _ in range(18)]
        try:
            # the heads go out once the workers took every connection from the listen
            # backlog (as when a burst's heads are a moment behind their connects)
            assert srv.wait_for(lambda: _listen_backlog(srv.port) == 0, 30)
            for i, s in enumerate(socks):
                s.sendall(f"GET /work?ms=300 HTTP/1.1\r\nHost: t\r\nX-Remote-User: u{i}\r\n"
                          f"Connection: close\r\n\r\n".encode())
            statuses = []
            for s in socks:
                data = b""
                while True:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                statuses.append(int(data.split(b" ", 2)[1]) if data else None)
        finally:
            for s in socks:
                s.close()
        assert statuses == [200] * 18, statuses


def _listen_backlog(port: int) -> int:
    """Connections waiting in the accept queue of the socket listening on 127.0.0.1:``port``
    (a listening socket's rx_queue in /proc/net/tcp)."""
    local = f"0100007F:{port:04X}"
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[1] == local and fields[3] == "0A":
                return int(fields[4].split(":")[1], 16)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


@pytest.mark.parametrize("fairness", FAIRNESS)
def test_fairness_light_client_keeps_its_share(server_factory, fairness):
    """A light client (2 connections, 100 ms pause after each answer) keeps at least 90% of the
    throughput it gets alone while a heavy client floods the same level with 48 connections;
    95% under a fairness that is max-min fair (``APF_FAIRNESS``, tests/apps/fairness.py).

    The flood runs in a process of its own and has requests waiting before the light client is
    measured: the measure is the server's, not the load generator's GIL, and
    the flood's first second (a new flow starting with the flood) is the subject of
    tests/test_ledger_service_estimate.py, deterministically. A light client that re-sends at
    once is measured too: its loss per request is printed against service time / limit.

    Asserted: every light request is served and the flood really flooded. The throughput kept
    is printed, not bounded: on a loaded machine the light client's latency moves with the
    machine, alone and under the flood alike, so a ratio bound fails for reasons of the
    machine's. The fairness claim itself is checked in virtual time by
    tests/test_ledger_service_estimate.py (the light flow's waits, seeded); the measured kept
    share (93-97%) is reported in docs/ledger.md ("A learnt service estimate")."""
    with server_factory(workers=4, threads=24, env={"APF_FAIRNESS": fairness}) as srv:
        def light_run(pause):
            stop = threading.Event()
            light = [Client(srv.port, "/work?ms=50", user="light", pause=pause, stop=stop)
                     for _ in range(2)]
            run_clients(light, duration=3.0)
            return light

        def flooded(pause):
            with Flood(srv.port, "/work?ms=50", user="heavy", connections=48) as flood:
                # the flood's steady state: it has requests waiting
                assert srv.wait_for(lambda: srv.level("work").requests_waiting > 0, timeout=60)
                light = light_run(pause)
            return light, flood

        solo = light_run(0.1)
        mixed, flood = flooded(0.1)
        solo_n = sum(s == 200 for c in solo for s in c.statuses)
        mixed_n = sum(s == 200 for c in mixed for s in c.statuses)
        mixed_bad = [s for c in mixed for s in c.statuses if s != 200]
        # A closed-loop client's throughput is 1 / (latency + pause): compared over every
        # request, not as counts in a 3 s window, where one request more or less is 2.5%.
        solo_lat = statistics.mean(lat for c in solo for lat in c.latencies)
        mixed_lat = statistics.mean(lat for c in mixed for lat in c.latencies)
        share = (solo_lat + 0.1) / (mixed_lat + 0.1)
        print(f"APF_FAIRNESS={fairness}: "
              f"light solo {solo_n}, light under flood {mixed_n} ({mixed_n / solo_n:.0%}), "
              f"throughput kept {share:.1%} (latency {solo_lat * 1000:.1f} -> "
              f"{mixed_lat * 1000:.1f} ms), heavy {flood.statuses}")
        assert flood.count > 2 * mixed_n and not flood.errors, flood.error_samples  # it flooded
        assert set(flood.statuses) <= {200, 429}
        assert not mixed_bad, "no light request rejected"
        assert solo_n and mixed_n, "the light client was served, alone and under the flood"

        eager_solo = light_run(0.0)
        eager, _ = flooded(0.0)
        loss = (statistics.mean(lat for c in eager for lat in c.latencies)
                - statistics.mean(lat for c in eager_solo for lat in c.latencies))
        print(f"light client re-sending at once: {loss * 1000:.1f} ms lost per request under "
              f"the flood; a seat frees every {50 / 8:.2f} ms (service time / limit)")
        assert not [s for c in eager for s in c.statuses if s != 200]
        assert srv.idle() is not None


def test_isolation_and_exempt(server_factory):
    with server_factory(workers=2, threads=40) as srv:
        stop = threading.Event()
        flood = [Client(srv.port, "/work?ms=200", user=f"f{i}", stop=stop) for i in range(40)]
        for c in flood:
            c.start()
        try:
            queued = srv.wait_for(lambda: srv.level("work").requests_waiting > 0, timeout=60)
            # ?timeout=4ms: a 1 ms wait limit, so a request of "other" that had to queue (behind
            # the flood of "work", were the levels not isolated) is answered 429. It is served
            # only when it executes at once, however slow the machine is.
            t0 = time.monotonic()
            status, headers, _ = srv.request("/other?ms=10&timeout=4ms",
                                             headers={"X-Remote-User": "o"})
            other_latency = time.monotonic() - t0
            t0 = time.monotonic()
            ex = [srv.request("/healthz") for _ in range(10)]
            exempt_latency = (time.monotonic() - t0) / 10
            work = srv.level("work")
        finally:
            stop.set()
            run_clients([], timeout=0)
            for c in flood:
                c.join(30)
        print(f"other {other_latency * 1000:.1f} ms, exempt {exempt_latency * 1000:.1f} ms, "
              f"work waiting {work.requests_waiting}")
        assert queued and work.requests_waiting > 0  # the flood is really queued
        assert status == 200 and headers["X-Kubernetes-PF-PriorityLevel-UID"] == "uid-pl-other"
        assert srv.level("other").timedout == 0
        # Exempt: served beside the flood, never queued. (Their latency under a flood is a
        # benchmark's: benchmarks/bench_overload.py scenario a, reported in docs/server.md.)
        assert [st for st, _, _ in ex] == [200] * 10
        assert all(h["X-Kubernetes-PF-FlowSchema-UID"] == "uid-fs-probes" for _, h, _ in ex)
        assert srv.idle(timeout=60) is not None


def test_rejection_429_headers_and_body(server_factory):
    # "work" gets 1 seat; ?timeout=1s gives each request a 250 ms wait limit: of 20
    # concurrent 300 ms requests most time out in the queue.
    env = {"APF_CONCURRENCY_LIMIT": "2"}
    with server_factory(workers=2, threads=16, env=env) as srv:
        clients = [Client(srv.port, "/work?ms=300&timeout=1s", user=f"x{i}", count=1)
                   for i in range(20)]
        run_clients(clients, timeout=60)
        statuses = [s for c in clients for s in c.statuses]
        rejected = [c.headers[0] for c in clients if c.statuses == [429]]
        print(f"statuses {sorted(statuses)}")
        assert statuses.count(200) >= 1 and len(rejected) >= 10
        hdrs = rejected[0]
        assert int(hdrs["Retry-After"]) >= 1
        assert hdrs["Content-Type"] == "text/plain; charset=utf-8"
        assert hdrs["X-Kubernetes-PF-FlowSchema-UID"] == "uid-fs-work"
        assert hdrs["X-Kubernetes-PF-PriorityLevel-UID"] == "uid-pl-work"
        status, _, body = srv.request("/work?ms=300&timeout=1s")
        assert status == 200
        conn = socket.create_connection(("127.0.0.1", srv.port))
        conn.sendall(b"GET /work?ms=1 HTTP/1.1\r\nHost: x\r\n\r\n")
        conn.close()
        assert srv.level("work").timedout >= 10
        assert srv.idle() is not None

        # the body: a request with a 25 ms wait limit behind 3 x 1.5 s on the level's one seat
        clients = [Client(srv.port, "/work?ms=1500", user=f"y{i}", count=1) for i in range(3)]
        for c in clients:
            c.start()
        assert srv.wait_for(lambda: (lv := srv.level("work")).seats_in_use == 1
                            and lv.requests_waiting == 2, timeout=30)
        status, _, body = srv.request("/work?ms=1&timeout=100ms")
        for c in clients:
            c.join(30)
        assert status == 429 and body == b"Too many requests, please try again later.\n"


def test_app_exception_releases_seats(server_factory):
    with server_factory(workers=2, threads=8) as srv:
        for _ in range(20):
            assert srv.request("/boom")[0] == 500
        assert srv.idle(timeout=30) is not None
        assert srv.request("/work?ms=1")[0] == 200


def test_disconnect_while_queued_frees_slot(server_factory):
    with server_factory(workers=2, threads=24) as srv:
        stop = threading.Event()
        # held long enough that the queued requests are cancelled (by their clients leaving),
        # not dispatched, however slow the machine is
        hold = [Client(srv.port, "/work?ms=8000", user=f"h{i}", stop=stop, count=1)
                for i in range(8)]
        for c in hold:
            c.start()
        assert srv.wait_for(lambda: srv.level("work").seats_in_use == 8, timeout=30)
        socks = []
        for i in range(4):
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(f"GET /work?ms=1 HTTP/1.1\r\nHost: x\r\nX-Remote-User: q{i}\r\n\r\n"
                      .encode())
            socks.append(s)
        assert srv.wait_for(lambda: srv.level("work").requests_waiting == 4, timeout=30)
        t0 = time.monotonic()
        for s in socks:
            s.close()
        freed = srv.wait_for(lambda: (lv := srv.level("work")).requests_waiting == 0 and lv,
                             timeout=30)
        print(f"4 queued requests whose clients left were removed in "
              f"{time.monotonic() - t0:.3f}s")
        assert freed, "the queued requests of clients that left are still waiting"
        # cancelled, while the 8 seats were still held: not dispatched and run
        assert freed.cancelled == 4 and freed.seats_in_use == 8 and freed.dispatched == 8
        for c in hold:
            c.join(30)
        assert srv.idle() is not None


def test_admin_endpoint_metrics_and_dumps(server_factory):
    from tests.conftest import free_port

    port = free_port()
    with server_factory(workers=2, threads=16,
                        env={"APF_ADMIN_BIND": f"127.0.0.1:{port}"}) as srv:
        for i in range(5):
            assert srv.request("/work?ms=1", headers={"X-Remote-User": f"m{i}"})[0] == 200
        assert srv.request("/other?ms=200")[0] == 200
        import http.client

        def get(path):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                c.request("GET", path)
                r = c.getresponse()
                return r.status, r.read().decode()
            finally:
                c.close()

        assert srv.wait_for(lambda: get("/readyz")[0] == 200, timeout=30)
        status, text = get("/metrics")
        assert status == 200
        line = next(ln for ln in text.splitlines()
                    if ln.startswith("apf_dispatched_requests_total")
                    and 'priority_level="work"' in ln)
        assert float(line.split()[-1]) == 5.0
        assert "apf_current_executing_seats" in text
        # each queuing level learnt its own service time from the requests it finished
        g = {ln.split('"')[1]: float(ln.split()[-1]) for ln in text.splitlines()
             if ln.startswith("apf_service_estimate_seconds{")}
        assert 0.001 <= g["work"] < 0.1 and 0.2 <= g["other"] < 0.4, g
        status, text = get("/debug/api_priority_and_fairness/dump_priority_levels")
        assert status == 200 and "work" in text
