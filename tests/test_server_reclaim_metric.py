"""``apf_reclaimed_workers_total`` on a real server: a worker killed while it serves a request
counts; a worker that exits on its own (SIGTERM: gunicorn's graceful exit, as on a HUP or
``max_requests``) does not. The alert ``APFWorkersDying`` (deploy/prometheus/apf-rules.yml)
reads it."""

from __future__ import annotations

import http.client
import os
import re
import signal
import threading

import pytest

from tests.conftest import free_port

pytestmark = pytest.mark.server


def reclaimed(admin: int) -> float | None:
    conn = http.client.HTTPConnection("127.0.0.1", admin, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    m = re.search(r"^apf_reclaimed_workers_total (\S+)$", text, re.M)
    return None if m is None else float(m.group(1))


def test_a_worker_killed_mid_request_counts_and_a_graceful_exit_does_not(server_factory):
    admin = free_port()
    with server_factory(workers=1, threads=4, env={"APF_ADMIN_BIND": f"127.0.0.1:{admin}"}) as srv:
        assert reclaimed(admin) == 0.0
        # a graceful exit while idle: gunicorn replaces the worker after our child_exit ran
        (first,) = srv.workers()
        os.kill(first, signal.SIGTERM)
        assert srv.wait_for(lambda: srv.workers() and first not in srv.workers()), srv.log()
        assert srv.wait_for(lambda: srv.request("/hello")[0] == 200), srv.log()
        assert reclaimed(admin) == 0.0, srv.log()

        # a worker killed while it executes a request
        (second,) = srv.workers()
        errors: list[BaseException] = []

        def slow() -> None:
            try:
                srv.request("/work?ms=30000", timeout=60)
            except OSError as e:  # the worker's death resets the connection
                errors.append(e)

        t = threading.Thread(target=slow, daemon=True)
        t.start()
        assert srv.wait_for(lambda: srv.level("work").requests_executing == 1), srv.log()
        os.kill(second, signal.SIGKILL)
        assert srv.wait_for(lambda: reclaimed(admin) == 1.0), (reclaimed(admin), srv.log())
        t.join(30)
        assert not t.is_alive() and errors, "the killed worker's request was not cut"
