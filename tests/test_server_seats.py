"""Request costs on a real gunicorn (2 workers): a 4-seat route on an 8-seat level runs at
most two at once across processes; a cost above the level's max seats is clamped; final seats
stay taken after the response for the additional latency; a long-running stream gives its
seats back once the app has returned its iterable, while the same stream without
``long_running`` holds them until the body is sent. App: tests/apps/seats_app.py, config
tests/apps/seats.yaml, route costs tests/apps/seats_routes.yaml."""

from __future__ import annotations

import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from apf_gunicorn.ledger import ledger as ledger_module
from tests.conftest import APPS

pytestmark = pytest.mark.server

ENV = {"APF_CONCURRENCY_LIMIT": "16", "APF_ROUTES": str(APPS / "seats_routes.yaml")}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from tests.conftest import serve

    with serve(tmp_path_factory.mktemp("seats"), workers=2, threads=8, env=ENV,
               config=str(APPS / "seats.yaml"), args=("tests.apps.seats_app:app",)) as server:
        yield server


def _concurrent(srv, path: str, n: int) -> list[int]:
    barrier = threading.Barrier(n)

    def one(_):
        barrier.wait()
        return srv.request(path, timeout=20)[0]

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_four_seat_route_runs_two_at_a_time(srv) -> None:
    srv.reset_counters()
    # 2 s each: the five overlap even when the machine is slow to send them
    statuses = _concurrent(srv, "/wide?ms=2000", 5)
    running, most = srv.counters()["heavy"]
    assert running == 0
    assert most == 2, statuses  # 8 seats / 4 per request, across both workers
    assert statuses.count(200) >= 2
    assert set(statuses) <= {200, 429}  # "wide" does not queue: the rest is rejected
    assert statuses.count(429) >= 1
    snap = srv.idle()
    assert snap is not None


def test_cost_above_max_seats_is_clamped(srv) -> None:
    srv.reset_counters()
    # "narrow" has 8 seats and Kubernetes' max seats 2: @cost(seats=4) is admitted as 2, so
    # four run at once and the rest queue (all succeed).
    statuses = _concurrent(srv, "/clamped?ms=2000", 6)
    assert statuses == [200] * 6
    assert srv.counters()["light"][1] == 4
    assert "admits at most 2 seat(s) per request; clamped to 2" in srv.log()
    assert srv.idle() is not None


def test_final_seats_linger_after_the_response(srv) -> None:
    srv.idle()
    t0 = time.monotonic()
    status, _, body = srv.request("/linger")
    assert (status, body) == (200, b"lingering\n")
    # gunicorn closes the body (our finish) just after sending it: wait for that (within the
    # 6 s tail: seen later, the seats would be back and the check below fails)
    level = srv.wait_for(lambda: (lv := srv.level("narrow")).requests_executing == 0 and lv,
                         timeout=5)
    assert level, "the request did not finish"
    assert level.requests_executing == 0  # as Kubernetes: done executing, seats still held
    assert level.seats_in_use == 2, "the 2 final seats, after the response"
    (req,) = [r for r in level.requests]
    assert (req.initial_seats, req.final_seats, req.additional_latency_ns) == (1, 2, 6 * 10**9)
    # released by the owner's dispatcher once the 6 s have passed, not before
    snap = srv.wait_for(lambda: srv.level("narrow").seats_in_use == 0, timeout=30)
    assert snap
    assert time.monotonic() - t0 >= 5.9


def _open_stream(srv, path: str):
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=10)
    conn.request("GET", path)
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.read1(64) == b"first\n"  # the stream has started (chunked)
    return conn, resp


def test_long_running_stream_releases_seats_once_the_app_returns(srv) -> None:
    srv.idle()
    conn, resp = _open_stream(srv, "/feed?gap=2")
    try:
        level = srv.level("narrow")
        # mid-stream, the seats are back, the slot is gone
        assert (level.seats_in_use, level.requests_executing) == (0, 0)
        assert resp.read() == b"second\n"
    finally:
        conn.close()


def test_regular_stream_holds_seats_until_the_body_is_sent(srv) -> None:
    srv.idle()
    conn, resp = _open_stream(srv, "/download?gap=1")
    try:
        level = srv.level("narrow")
        assert (level.seats_in_use, level.requests_executing) == (2, 1)
        assert resp.read() == b"second\n"
    finally:
        conn.close()
    assert srv.wait_for(lambda: srv.level("narrow").seats_in_use == 0, timeout=30)


def test_the_workers_ledger_runs_the_paths_this_test_run_runs(srv) -> None:
    """scripts/test.sh runs these tests a second time with APF_NO_ACCELERATOR=1: the workers
    inherit it and run the pure-Python fast paths, or the C ones when it is unset."""
    expected = ledger_module._ACCEL is not None  # False under APF_NO_ACCELERATOR=1
    seen = {}
    for _ in range(6):
        status, _, body = srv.request("/ledger-path")
        assert status == 200
        answer = json.loads(body)
        seen[answer["pid"]] = answer["accelerated"]
    assert set(seen.values()) == {expected}, seen
