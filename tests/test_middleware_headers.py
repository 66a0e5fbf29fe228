"""The X-Kubernetes-PF-* response headers (SPEC 5): added to every response the app makes, under
gunicorn straight into its header list once they passed gunicorn's own checks (per route, not
per request), otherwise through ``start_response`` like any header."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest
from gunicorn.http.errors import InvalidResponseHeader
from gunicorn.http.wsgi import Response
from werkzeug.test import EnvironBuilder

from apf_gunicorn.admission.dispatcher import Parking
from apf_gunicorn.flowcontrol.requestinfo import RequestInfoResolver
from apf_gunicorn.gthread.wsgi import APFMiddleware, WorkerContext
from apf_gunicorn.ledger.ledger import Capacity, Ledger, LevelSpec

T0 = 1_000_000_000_000
PF = [("X-Kubernetes-PF-FlowSchema-UID", "uid-fs"), ("X-Kubernetes-PF-PriorityLevel-UID", "uid-pl")]


def middleware(app, fs_uid="uid-fs", pl_uid="uid-pl") -> APFMiddleware:
    cap = Capacity()
    led = Ledger.create(bytearray(Ledger.size(cap)), cap)
    levels, schemas = led.configure([LevelSpec("lvl", 0, 0, 0, 10)], ["fs"], T0)
    level = NS(name="lvl", uid=pl_uid, is_exempt=False)
    schema = NS(name="fs", uid=fs_uid)

    class Classifier:
        def classify(self, attrs):
            return NS(flow_schema=schema, priority_level=level, distinguisher="", flow_hash=7)

    ctx = WorkerContext(
        ledger=led, resolver=RequestInfoResolver(), classifier=Classifier(), level_index=levels,
        fs_index=schemas, owner=0, parking=Parking(), deliver=lambda granted: None,
        add_linger=lambda *a: None, queue_wait_limit_ns=10**9, alive=lambda: True,
        clock=lambda: T0)
    return APFMiddleware(app, ctx)


def app_with(headers):
    def app(environ, start_response):
        start_response("200 OK", list(headers))
        return [b"ok"]
    return app


def gunicorn_response() -> Response:
    req = NS(version=(1, 1), method="GET", should_close=lambda: False)
    return Response(req, sock=None, cfg=NS(protocol="http"))


def run(mw, start_response) -> None:
    body = mw(EnvironBuilder(path="/x").get_environ(), start_response)
    b"".join(body)
    body.close()


def test_under_gunicorn_the_headers_join_its_list_once_after_the_apps() -> None:
    resp = gunicorn_response()
    run(middleware(app_with([("Content-Type", "text/plain"), ("Content-Length", "2")])),
        resp.start_response)
    assert resp.headers == [("Content-Type", "text/plain"), ("Content-Length", "2"), *PF]
    assert resp.response_length == 2  # the app's headers were processed by gunicorn as usual


def test_under_gunicorn_the_apps_headers_are_still_checked() -> None:
    resp = gunicorn_response()
    with pytest.raises(InvalidResponseHeader):
        run(middleware(app_with([("X-Bad", "a\r\nInjected: 1")])), resp.start_response)


def test_headers_gunicorn_would_refuse_are_not_slipped_past_it() -> None:
    # The config loader refuses such a uid; a route built around it anyway goes the checked way.
    resp = gunicorn_response()
    with pytest.raises(InvalidResponseHeader):
        run(middleware(app_with([]), fs_uid="a\r\nInjected: 1"), resp.start_response)


def test_any_other_server_gets_them_through_start_response() -> None:
    seen = []

    def start_response(status, headers, exc_info=None):
        seen.append(headers)

    run(middleware(app_with([("Content-Type", "text/plain")])), start_response)
    assert seen == [[("Content-Type", "text/plain"), *PF]]
