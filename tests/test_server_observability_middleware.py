"""The middleware's observability duties, in process against a ledger on a bytearray: the
server-wide Retry-After (two "workers" share one ledger, each with its own tracker) and the
per-request events landing in the ledger's request stats (watch vs regular execution)."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from apf_gunicorn.admission.dispatcher import Parking
from apf_gunicorn.flowcontrol import retryafter
from apf_gunicorn.flowcontrol.retryafter import RetryAfterTracker
from apf_gunicorn.gthread.wsgi import APFMiddleware, WorkerContext
from apf_gunicorn.ledger.ledger import Capacity, Ledger, LevelSpec  # noqa: E402

T0 = 1_000_000_000_000
LEVEL = NS(name="rej", uid="uid-pl", is_exempt=False)
SCHEMA = NS(name="fs", uid="uid-fs")


class Classifier:
    def classify(self, attrs):
        return NS(flow_schema=SCHEMA, priority_level=LEVEL, distinguisher="", flow_hash=7)


def app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


def make(led, levels, schemas, owner, clock):
    ctx = WorkerContext(
        ledger=led, resolver=lambda environ: NS(verb=environ["VERB"]), classifier=Classifier(),
        level_index=levels, fs_index=schemas, owner=owner, parking=Parking(),
        deliver=lambda granted: None, add_linger=lambda *a: None,
        queue_wait_limit_ns=10**9, alive=lambda: True, retry_after=RetryAfterTracker(),
        clock=clock)
    return APFMiddleware(app, ctx)


def call(mw, verb="get"):
    seen = {}

    def start_response(status, headers, exc_info=None):
        seen["status"] = int(status.split()[0])
        seen["headers"] = dict(headers)

    body = mw({"REQUEST_METHOD": "GET", "PATH_INFO": "/x", "VERB": verb}, start_response)
    list(body)
    getattr(body, "close", lambda: None)()
    return seen["status"], seen["headers"]


@pytest.fixture
def shared():
    cap = Capacity()
    led = Ledger.create(bytearray(Ledger.size(cap)), cap)
    levels, schemas = led.configure([LevelSpec("rej", 0, 0, 0, 1)], ["fs"], T0)
    now = [T0]
    clock = lambda: now[0]  # noqa: E731
    return led, levels, schemas, clock, now


def test_retry_after_is_server_wide(shared, monkeypatch) -> None:
    led, levels, schemas, clock, now = shared
    second = [100]
    monkeypatch.setattr(retryafter, "time", NS(time=lambda: second[0]))
    a = make(led, levels, schemas, 0, clock)
    b = make(led, levels, schemas, 1, clock)
    hold = led.admit(levels["rej"], 7, 1, 0, 0, 0, T0)  # the only seat: everything else is 429
    assert hold.outcome == "execute"

    assert call(a)[0] == call(b)[0] == 429  # both workers have seen the level once
    for _ in range(9):
        assert call(a)[1]["Retry-After"] == "1"  # worker a rejects a burst at second 100
    second[0] = 101
    assert call(b)[1]["Retry-After"] == "1"
    second[0] = 102
    # b itself rejected one request per second, yet it answers the level's back-off: its
    # tracker counted a's burst through the ledger's server-wide rejected count
    assert call(b)[1]["Retry-After"] == "2"
    alone = RetryAfterTracker()  # what b's own rejections alone would give
    for s in (100, 101, 102):
        alone.record("rej", s)
    assert alone.retry_after("rej") == 1

    # sustained rejections on the level: both workers follow the same growing value (a
    # doubling reaches the other worker within the 2 s a tracker waits between doublings)
    values = []
    for s in range(103, 140):
        second[0] = s
        for _ in range(20):
            ra, rb = call(a)[1]["Retry-After"], call(b)[1]["Retry-After"]
        values.append((int(ra), int(rb)))
    assert values[-1][0] == values[-1][1] == 32
    assert all(max(x, y) <= 2 * min(x, y) for x, y in values)
    assert sum(x == y for x, y in values) >= 0.7 * len(values)
    assert led.rejected_total(levels["rej"]) == 2 + 9 + 2 + 37 * 40

    # load stops: the value decays by 1 per rejection-second below the threshold
    second[0] = 200
    assert call(a)[1]["Retry-After"] == "31"
    second[0] = 201
    assert call(a)[1]["Retry-After"] == "30"


def test_request_events_are_counted_in_the_ledger(shared) -> None:
    led, levels, schemas, clock, now = shared
    mw = make(led, levels, schemas, 0, clock)
    assert call(mw)[0] == 200
    assert call(mw, verb="watch")[0] == 200
    hold = led.admit(levels["rej"], 7, 1, 0, 0, 0, T0)
    assert call(mw)[0] == 429
    led.finish(hold.slot, hold.gen, T0)
    (st,) = [s for s in led.request_stats() if s.level == "rej"]
    assert st.flow_schema == "fs"
    assert st.dispatched == 3  # two through the middleware, the held one
    assert st.rejected["concurrency-limit"] == 1
    assert st.execution_watch.count == 1
    assert st.execution_regular.count == 2
    assert st.work.count == 4 and st.work.sum == 4
    assert st.wait_rejected.count == 1 and st.wait_rejected.counts[0] == 1


def test_borrowing_period_setting() -> None:
    from apf_gunicorn.server.settings import SettingsError, load_settings

    assert load_settings({}).borrowing_period_s == 10.0
    assert load_settings({"APF_BORROWING_PERIOD": "1"}).borrowing_period_s == 1.0
    assert load_settings({"APF_BORROWING_PERIOD": "0.5"}).borrowing_period_s == 0.5
    for bad in ("0", "-1", "abc", "0.01", "3601", "nan"):
        with pytest.raises(SettingsError, match="invalid APF_BORROWING_PERIOD="):
            load_settings({"APF_BORROWING_PERIOD": bad})
