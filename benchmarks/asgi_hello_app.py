"""A minimal plain ASGI app (no framework) for the ASGI instruction counts of bench_instructions.py.

    gunicorn -k uvicorn_worker.UvicornWorker benchmarks.asgi_hello_app:app
    gunicorn -c python:apf_gunicorn.conf -k apf_gunicorn.asgi.UvicornWorker \
        benchmarks.asgi_hello_app:app

``GET /hello`` answers ``hello`` (200, text/plain), ``GET /work?ms=N`` the same after N ms
(bench_instructions.py ``--asgi --rejecting`` holds a level's one seat with it), every other
path 404. It reads no request
body and keeps no state, so what a request costs in the worker is the server's and APF's work,
not the app's. ``lifespan`` is answered (startup and shutdown complete), so servers that run it
do not log its absence.
"""

from __future__ import annotations

import asyncio
from typing import Any

_HEADERS = [(b"content-type", b"text/plain"), (b"content-length", b"6")]
_NOT_FOUND = [(b"content-type", b"text/plain"), (b"content-length", b"10")]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The ASGI application: ``/hello`` over HTTP, lifespan acknowledged."""
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    if scope["path"] == "/hello":
        await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
        await send({"type": "http.response.body", "body": b"hello\n"})
    elif scope["path"] == "/work":
        query = scope["query_string"].decode("latin-1")
        ms = int(query[3:]) if query.startswith("ms=") and query[3:].isdigit() else 0
        await asyncio.sleep(ms / 1000)
        await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
        await send({"type": "http.response.body", "body": b"hello\n"})
    else:
        await send({"type": "http.response.start", "status": 404, "headers": _NOT_FOUND})
        await send({"type": "http.response.body", "body": b"not found\n"})
