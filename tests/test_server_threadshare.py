"""Threads shared fairly on a real gunicorn: a flood parked on every non-exempt thread gives
one up to a light user's request, instead of the light user being turned away before fair
queuing sees it (gthread/threadshare.py)."""

from __future__ import annotations

import pytest

from tests.apps.loadgen import Client
from tests.apps.overload import scrape, total
from tests.conftest import free_port

pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_a_light_flow_is_served_while_a_flood_parks_on_every_thread(server_factory):
    """1 worker × 6 threads, 2 kept for exempt requests; "work" has 2 seats. The heavy user
    runs 2 requests and parks 2: every non-exempt thread is held. The light user's request
    takes the thread of the newest parked heavy request, which answers 429 thread-share; the
    light request is served, and the ledger is clean after."""
    admin = free_port()
    env = {"APF_ADMIN_BIND": f"127.0.0.1:{admin}", "APF_EXEMPT_THREADS": "2",
           "APF_CONCURRENCY_LIMIT": "4"}
    with server_factory(workers=1, threads=6, env=env) as srv:
        work = srv.level("work")
        assert work.concurrency_limit == 2, work
        heavy = [Client(srv.port, "/work?ms=2500", user="heavy", count=1, timeout=30)
                 for _ in range(4)]
        for c in heavy:
            c.start()

        def flood_parked():
            lv = srv.level("work")
            return lv.requests_executing == 2 and lv.requests_waiting == 2

        assert srv.wait_for(flood_parked, timeout=10), srv.level("work")
        status, headers, _ = srv.request("/work?ms=10", headers={"X-Remote-User": "light"})
        for c in heavy:
            c.join(30)
        statuses = sorted(s for c in heavy for s in c.statuses)
        assert status == 200, (status, headers)
        assert statuses == [200, 200, 200, 429], statuses
        (rejected,) = [c.headers[0] for c in heavy if c.statuses == [429]]
        assert int(rejected["Retry-After"]) >= 1
        assert srv.idle() is not None
        m = scrape(admin)
        labels = {"priority_level": "work", "flow_schema": "work"}
        assert total(m, "apf_rejected_requests_total", reason="thread-share", **labels) == 1
        assert total(m, "apf_rejected_requests_total", reason="thread-reserve", **labels) == 0
        assert total(m, "apf_rejected_requests_total", **labels) == 1
        assert total(m, "apf_dispatched_requests_total", **labels) == 4
        assert "Traceback" not in srv.log()
