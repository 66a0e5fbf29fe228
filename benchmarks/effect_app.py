"""The app behind the README's picture (``benchmarks/plot_effect.py``): a backend that can do
only a few things at once, as a database with a small connection pool.

``GET /query?ms=N`` takes one of ``EFFECT_POOL`` "connections" (a POSIX semaphore shared by
every worker process, named by ``EFFECT_SEMAPHORE``), holds it N ms, and answers. Requests
beyond the pool wait for a connection inside the app, holding their worker thread, as they
would on a real pool. ``GET /cpu?ms=N`` runs N ms of Python (thread CPU time: under the GIL,
a worker runs one such request at a time). ``GET /sleep?ms=N`` only waits N ms (no shared
resource: more threads always serve more). ``GET /ok`` answers at once (readiness, and the
cheap route). Plain WSGI: no Flask needed.

    EFFECT_SEMAPHORE=/effect-1 EFFECT_POOL=8 gunicorn -k gthread --pythonpath benchmarks \\
        effect_app:app
"""

from __future__ import annotations

import os
import time
from urllib.parse import parse_qs

import posix_ipc

_SEM = None


def _semaphore() -> posix_ipc.Semaphore:
    global _SEM
    if _SEM is None:
        _SEM = posix_ipc.Semaphore(os.environ["EFFECT_SEMAPHORE"], posix_ipc.O_CREAT,
                                   initial_value=int(os.environ.get("EFFECT_POOL", "8")))
    return _SEM


def app(environ, start_response):
    path = environ.get("PATH_INFO", "/")
    if path == "/query":
        query = parse_qs(environ.get("QUERY_STRING", ""))
        ms = min(max(int(query.get("ms", ["50"])[0]), 0), 10_000)
        sem = _semaphore()
        sem.acquire()
        try:
            time.sleep(ms / 1000)
        finally:
            sem.release()
        body = f"queried {ms} ms\n".encode()
    elif path == "/cpu":
        query = parse_qs(environ.get("QUERY_STRING", ""))
        ms = min(max(int(query.get("ms", ["5"])[0]), 0), 10_000)
        end = time.thread_time() + ms / 1000
        spins = 0
        while time.thread_time() < end:
            spins += sum(range(100))
        body = f"computed {ms} ms\n".encode()
    elif path == "/sleep":
        query = parse_qs(environ.get("QUERY_STRING", ""))
        ms = min(max(int(query.get("ms", ["200"])[0]), 0), 10_000)
        time.sleep(ms / 1000)
        body = f"slept {ms} ms\n".encode()
    elif path == "/ok":
        body = b"ok\n"
    else:
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
