"""APF_CONCURRENCY_LIMIT=auto on a real server: it starts low and says so, exports its gauges,
looks below its start and comes back near the knee of an app limited by a pool of 4
"connections", comes down when the pool drops to 2, and stays within its bounds. Real latency
drives the controller, so the test asserts directions, bounds and where it ends up (printing
the moves), not an exact sequence of moves."""

from __future__ import annotations

import http.client
import os
import re
import signal
import threading
import uuid

import posix_ipc

from tests.apps.loadgen import Client
from tests.conftest import free_port


def metrics(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def gauge(text: str, name: str) -> float | None:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return None if m is None else float(m.group(1))


def test_auto_limit_starts_reports_and_follows_a_pool(server_factory) -> None:
    admin = free_port()
    name = f"/apf-test-pool-{uuid.uuid4().hex[:8]}"
    sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, initial_value=4)
    held = 0
    env = {"APF_CONCURRENCY_LIMIT": "auto:2-16", "APF_ADAPTIVE_TICK": "0.25",
           "APF_ADMIN_BIND": f"127.0.0.1:{admin}", "APP_POOL_SEMAPHORE": name}
    stop = threading.Event()
    clients = []
    try:
        with server_factory(workers=2, threads=8, env=env) as srv:
            # the default 2 x 8 / 2
            assert srv.wait_for(lambda: "limit auto (now 8) seats, within 2-16" in srv.log()), \
                srv.log()
            text = metrics(admin)
            assert gauge(text, "apf_server_concurrency_limit_seats") == 8.0
            assert gauge(text, "apf_adaptive_latency_ratio") is not None
            clients = [Client(srv.port, "/work/pool?ms=50", user=f"u{i}", stop=stop)
                       for i in range(12)]
            for c in clients:
                c.start()

            limits: list[float] = []  # every value the limit gauge was scraped with

            def limit() -> float:
                value = gauge(metrics(admin), "apf_server_concurrency_limit_seats")
                if value is None:
                    return -1.0
                limits.append(value)
                return value

            def moves() -> list[tuple[int, int, str]]:
                """The controller's logged moves (those by more than a quarter)."""
                return [(int(a), int(b), why) for a, b, why in re.findall(
                    r"concurrency limit auto: (\d+) -> (\d+) seats \(([^;]*);", srv.log())]

            def report(when: str) -> None:
                print(f"{when}: limit samples {sorted(set(limits))}, moves {moves()}")

            # What the controller must do, not the exact moves (real latency drives them): the
            # "work" level holds about half the server's seats, so a pool of 4 is its knee near
            # a server limit of 8, a pool of 2 near 4. From 8 it looks below the start once
            # it binds, and with the pool at 4 it comes back to 7 or more.
            assert srv.wait_for(lambda: any(b < a for a, b, _ in moves()), timeout=120), \
                srv.log()
            assert srv.wait_for(lambda: limit() >= 7, timeout=120, step=0.5), srv.log()
            report("pool of 4")
            for _ in range(2):  # the pool drops to 2: the test holds two connections
                sem.acquire(60)
                held += 1

            def lowered() -> bool:
                return 0 <= limit() <= 6

            assert srv.wait_for(lowered, timeout=120, step=0.5), srv.log()
            report("pool of 2")
            served = [s for c in clients for s in list(c.statuses)]
            assert served and not [s for s in served if s >= 500]
            # a HUP reloads the configuration; the controller goes on from where it is (the
            # old workers answer their parked requests 503 as they stop: docs/server.md)
            os.kill(srv.pid, signal.SIGHUP)
            assert srv.wait_for(lambda: "configuration generation 2 applied" in srv.log(),
                                timeout=60), srv.log()
            assert srv.wait_for(lowered, timeout=120, step=0.5), srv.log()
            report("after the reload")
            # every limit it set or exported stayed within auto:2-16
            assert all(2 <= a <= 16 and 2 <= b <= 16 for a, b, _ in moves()), moves()
            assert all(2 <= x <= 16 for x in limits), limits
            text = metrics(admin)
            # the kinds are routes (admission/routekinds.py): the path's shape, digits as *
            assert re.search(r'^apf_adaptive_baseline_seconds\{flow_schema="work",'
                             r'priority_level="work",route="/work/pool"\} ', text, re.M), text
            stop.set()
            for c in clients:
                c.join(timeout=60)
            statuses = [s for c in clients for s in c.statuses]
            assert not [s for s in statuses if s >= 500 and s != 503]
    finally:
        stop.set()
        for _ in range(held):
            sem.release()
        sem.unlink()
        sem.close()
