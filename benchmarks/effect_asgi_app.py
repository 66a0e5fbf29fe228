"""The ASGI app behind ``benchmarks/bench_asgi.py`` (issue 28): ``effect_app.py``'s backend that
does only a few things at once, with endpoints that *await* it instead of blocking a thread.

A POSIX semaphore cannot be awaited, so the backend is a process of its own: a small asyncio
server on a unix socket holding ``--pool`` permits (8 by default), as a database with a pool
of 8 connections shared by every worker of every server that talks to it. A query is one
round trip: the client writes ``<ms>\\n``; the backend takes a permit (queries beyond the pool
wait for one, first come first served), holds it ``ms`` milliseconds, gives it back and answers
``ok\\n`` (``error <why>\\n`` for a line that is not a number of milliseconds).

The app, plain ASGI (no framework), reads the backend's socket path from ``EFFECT_BACKEND``:

* ``GET /query?ms=N`` (0 <= N <= 10000, default 50): one backend query of N ms, awaited, so the
  event loop serves other requests meanwhile. Each worker process keeps its idle backend
  connections for the next query (a connection per query in flight, opened when none is idle):
  no thread, no lock, nothing that blocks the loop. 502 if the backend cannot be reached.
* ``GET /ok``: answers at once (readiness, and the cheap route).
* ``GET /hello``: ``Hello, World!`` as plain text (for instruction counts per request).

Start the backend, then the server (``--pythonpath`` is not enough for ``-k``: gunicorn imports
the worker class before it reads that setting, hence ``PYTHONPATH``)::

    python benchmarks/effect_asgi_app.py backend --socket /tmp/effect.sock --pool 8 &
    EFFECT_BACKEND=/tmp/effect.sock PYTHONPATH=benchmarks \\
        gunicorn -k uvicorn_worker.UvicornWorker -w 2 effect_asgi_app:app

:class:`LimitedUvicornWorker` is uvicorn's worker with ``limit_concurrency`` (from
``EFFECT_LIMIT_CONCURRENCY``, 4 by default), the peer's only admission control, for
``-k effect_asgi_app.LimitedUvicornWorker``. It exists only when ``uvicorn-worker`` is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
from urllib.parse import parse_qs

MAX_MS = 10_000
_TEXT = [(b"content-type", b"text/plain")]


class BackendClient:
    """One process's connections to the backend, for one event loop: :meth:`query` reuses an
    idle connection or opens one, and keeps it after a clean round trip (a connection whose
    query failed or was cancelled is closed: its answer could still be on the way)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.loop = asyncio.get_running_loop()
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def query(self, ms: int) -> bytes:
        """Hold one of the backend's connections ``ms`` milliseconds; its answer line."""
        if self.idle:
            reader, writer = self.idle.pop()
        else:
            reader, writer = await asyncio.open_unix_connection(self.path)
        try:
            writer.write(b"%d\n" % ms)
            line = await reader.readline()
        except BaseException:
            writer.close()
            raise
        if not line.endswith(b"\n"):
            writer.close()
            raise ConnectionError("the backend closed the connection")
        self.idle.append((reader, writer))
        return line

    def close(self) -> None:
        while self.idle:
            self.idle.pop()[1].close()


_CLIENT: BackendClient | None = None


def _client() -> BackendClient:
    global _CLIENT
    if _CLIENT is None or _CLIENT.loop is not asyncio.get_running_loop():
        path = os.environ.get("EFFECT_BACKEND")
        if not path:
            raise RuntimeError("EFFECT_BACKEND is not set: the backend's unix socket path")
        _CLIENT = BackendClient(path)
    return _CLIENT


async def _answer(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [*_TEXT, (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            if _CLIENT is not None:
                _CLIENT.close()
            await send({"type": "lifespan.shutdown.complete"})
            return


async def app(scope, receive, send) -> None:
    """The ASGI application (see the module's docstring for its routes)."""
    if scope["type"] == "lifespan":
        await _lifespan(receive, send)
        return
    if scope["type"] != "http":  # a WebSocket: refused at the handshake
        await send({"type": "websocket.close", "code": 1003})
        return
    path = scope["path"]
    if path == "/query":
        raw = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("ms", ["50"])[0]
        try:
            ms = int(raw)
        except ValueError:
            ms = -1
        if not 0 <= ms <= MAX_MS:
            await _answer(send, 400, b"ms must be a whole number of milliseconds in [0, %d], "
                          b"not %r\n" % (MAX_MS, raw.encode()))
            return
        try:
            line = await _client().query(ms)
        except OSError as exc:
            await _answer(send, 502, f"backend unreachable: {exc}\n".encode())
            return
        if line != b"ok\n":
            await _answer(send, 502, b"backend: " + line)
            return
        await _answer(send, 200, b"queried %d ms\n" % ms)
    elif path == "/ok":
        await _answer(send, 200, b"ok\n")
    elif path == "/hello":
        await _answer(send, 200, b"Hello, World!\n")
    else:
        await _answer(send, 404, b"not found\n")


async def serve_backend(socket_path: str, pool: int, ready: asyncio.Event | None = None) -> None:
    """The backend: ``pool`` permits behind a unix socket at ``socket_path``; runs until
    cancelled. Sets ``ready`` once it listens."""
    permits = asyncio.Semaphore(pool)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                try:
                    ms = int(line)
                except ValueError:
                    ms = -1
                if not 0 <= ms <= MAX_MS:
                    writer.write(b"error: not a number of milliseconds in [0, %d]: %r\n"
                                 % (MAX_MS, line[:40]))
                else:
                    async with permits:
                        await asyncio.sleep(ms / 1000)
                    writer.write(b"ok\n")
                await writer.drain()
        except ConnectionError:
            pass  # the app closed a connection whose query it gave up on
        finally:
            writer.close()

    server = await asyncio.start_unix_server(handle, socket_path, backlog=1024)
    async with server:
        if ready is not None:
            ready.set()
        await server.serve_forever()


try:
    from uvicorn_worker import UvicornWorker as _UvicornWorker
except ImportError:  # the peer's worker needs the uvicorn-worker package
    _UvicornWorker = None

if _UvicornWorker is not None:
    def _limit_concurrency() -> int:
        raw = os.environ.get("EFFECT_LIMIT_CONCURRENCY", "4")
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"EFFECT_LIMIT_CONCURRENCY must be a whole number >= 1, not {raw!r}")
        return int(raw)

    class LimitedUvicornWorker(_UvicornWorker):
        """uvicorn's worker with ``limit_concurrency`` per process: beyond it (open
        connections or tasks), uvicorn answers 503."""

        CONFIG_KWARGS = {**_UvicornWorker.CONFIG_KWARGS, "limit_concurrency": _limit_concurrency()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="The backend of effect_asgi_app (see its docstring).")
    sub = ap.add_subparsers(dest="command", required=True)
    backend = sub.add_parser("backend", help="serve the backend on a unix socket")
    backend.add_argument("--socket", required=True, help="the unix socket's path (created)")
    backend.add_argument("--pool", type=int, default=8, help="permits (default 8)")
    args = ap.parse_args(argv)
    if args.pool < 1:
        ap.error("--pool must be >= 1")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_backend(args.socket, args.pool))
    return 0


if __name__ == "__main__":
    sys.exit(main())
