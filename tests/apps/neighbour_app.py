"""WSGI app whose requests each hold a unit of a declared resource (``apf_gunicorn.resource
("db", capacity=4)``, per worker), with a neighbour tenant in each worker that holds some of
the units when told through the control file ``NEIGHBOUR_FILE`` (tests/apps/neighbour.py), for
the pool rule's server test (tests/test_poollimit.py).

``/work?ms=N`` holds a unit N ms (50 by default); ``/healthz`` answers ``ok``.
"""

from __future__ import annotations

import os
import time
from urllib.parse import parse_qs

import apf_gunicorn
from tests.apps import neighbour

DB = apf_gunicorn.resource("db", capacity=4)


def app(environ, start_response):
    if environ["PATH_INFO"].startswith("/work"):
        ms = float(parse_qs(environ.get("QUERY_STRING", "")).get("ms", ["50"])[0])
        with DB:
            time.sleep(ms / 1000)
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
    return [b"ok"]


neighbour.start(lambda: DB, os.environ["NEIGHBOUR_FILE"])
