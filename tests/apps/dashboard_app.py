"""Plain WSGI app for the dashboard's test (tests/test_dashboard_prometheus.py): ``/work?ms=N``
holds a unit of a declared resource (``apf_gunicorn.resource("backend", capacity=1)`` per
worker, so requests wait for it and ``apf_pool_*`` has something to show) for N ms (50 by
default); anything else (``/healthz``) answers ``ok`` at once."""

from __future__ import annotations

import time
from urllib.parse import parse_qs

import apf_gunicorn

BACKEND = apf_gunicorn.resource("backend", capacity=1)


def app(environ, start_response):
    if environ["PATH_INFO"].startswith("/work"):
        ms = float(parse_qs(environ.get("QUERY_STRING", "")).get("ms", ["50"])[0])
        with BACKEND:
            time.sleep(ms / 1000)
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok\n"]
