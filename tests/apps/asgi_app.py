"""Pure ASGI app for the ASGI worker tests: the routes of ``tests/apps/app.py`` (the Flask app),
async, counting how many requests execute at once across all worker processes in the same
shared counter file (``APP_COUNTER``).

* ``/hello`` -> 200 ``hello`` at once;
* ``/healthz`` -> 200 ``ok`` (exempt in ``tests/apps/apf.yaml``; ``/readyz`` and ``/livez`` too,
  exempt in the built-in configuration);
* ``/work``, ``/other``, ``/light``, ``/heavy`` (and their sub-paths), ``?ms=N``: awaits N ms
  (100 by default) counted under the path's first segment; answers ``pid=<the worker's>``;
* ``/stream?n=N&ms=M``: N chunks M ms apart; ``/stream?until=PATH``: a chunk, then more
  until the file PATH exists (the test ends the stream);
* ``/work/tracked?ms=N``: the chaos tests' request (``tests/apps/chaos.py``), as the Flask
  app's: reads the request body first, as Django's handler and Starlette's ``request.body()``
  do, then awaits N ms between a start and an end record in ``APP_TRACK``
  (``tests.apps.app.track``), listening meanwhile for the client leaving as Django's handler
  does; a ``http.disconnect`` ends it without an answer (the server then answers 500 if the
  client is in fact still there);
* ``/echo``, ``/work/echo`` (any method): answers the request body;
* ``/work/client``: answers the scope's ``client`` host (``-`` without one);
* ``/boom``: raises;
* a WebSocket connection (any path): accepted, each text message echoed, until the client
  closes.
"""

from __future__ import annotations

import asyncio
import os
from urllib.parse import parse_qs

from tests.apps.app import _update, track

_COUNTED = ("work", "other", "light", "heavy")


async def _answer(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def lifespan(receive, send) -> None:
    """Acknowledge the server's lifespan startup and shutdown."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        return await lifespan(receive, send)
    if scope["type"] == "websocket":
        return await _websocket(receive, send)
    if scope["type"] != "http":
        return
    path = scope["path"]
    args = {k: v[0] for k, v in parse_qs(scope.get("query_string", b"").decode()).items()}
    if path in ("/healthz", "/readyz", "/livez"):
        return await _answer(send, 200, b"ok")
    if path == "/hello":
        return await _answer(send, 200, b"hello\n")
    if path == "/work/tracked":
        return await _tracked(receive, send, float(args.get("ms", "100")))
    if path == "/boom":
        raise RuntimeError("boom")
    if path == "/work/client":
        client = scope.get("client")
        return await _answer(send, 200, (client[0] if client else "-").encode())
    if path.endswith("/echo"):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        return await _answer(send, 200, body)
    if path == "/stream" and "until" in args:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while not os.path.exists(args["until"]):
            await send({"type": "http.response.body", "body": b"x\n", "more_body": True})
            await asyncio.sleep(0.02)
        return await send({"type": "http.response.body", "body": b"end\n"})
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(int(args.get("n", "5"))):
            await send({"type": "http.response.body", "body": b"x\n", "more_body": True})
            await asyncio.sleep(float(args.get("ms", "20")) / 1000)
        return await send({"type": "http.response.body", "body": b""})
    name = path.strip("/").split("/")[0]
    counted = name in _COUNTED
    if counted:
        _update(name, 1)
    try:
        await asyncio.sleep(float(args.get("ms", "100")) / 1000)
    finally:
        if counted:
            _update(name, -1)
    await _answer(send, 200, f"pid={os.getpid()}\n".encode())


async def _read_body(receive) -> bytes | None:
    """The request body, or None when the client left (``http.disconnect``)."""
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


async def _tracked(receive, send, ms: float) -> None:
    if await _read_body(receive) is None:
        return
    rid = os.urandom(6).hex()
    track("S", rid)
    # the work races a listener for the client leaving, as Django's ASGIHandler runs a view
    # beside listen_for_disconnect: a client gone (or said to be) ends it without an answer
    work = asyncio.ensure_future(asyncio.sleep(ms / 1000))
    listen = asyncio.ensure_future(receive())
    try:
        done, _ = await asyncio.wait({work, listen}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        work.cancel()
        listen.cancel()
        track("E", rid)
    if work in done:
        await _answer(send, 200, f"tracked pid={os.getpid()}\n".encode())


async def _websocket(receive, send) -> None:
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    while True:
        message = await receive()
        if message["type"] == "websocket.disconnect":
            return
        await send({"type": "websocket.send", "text": message.get("text") or ""})
