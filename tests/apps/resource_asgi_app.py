"""Pure ASGI app whose requests each hold a unit of a declared resource
(``apf_gunicorn.resource("backend", capacity=2)``: the one line the app adds), for the pool
signals' server test under the ASGI workers (tests/test_signals_server.py).

``/work?ms=N`` holds a unit N ms (50 by default); ``/healthz`` answers ``ok``.
"""

from __future__ import annotations

import asyncio
from urllib.parse import parse_qs

import apf_gunicorn

BACKEND = apf_gunicorn.resource("backend", capacity=2)


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    if scope["path"].startswith("/work"):
        ms = float(parse_qs(scope.get("query_string", b"").decode()).get("ms", ["50"])[0])
        async with BACKEND:
            await asyncio.sleep(ms / 1000)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})
