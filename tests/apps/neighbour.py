"""A neighbour tenant inside an app's workers: a job that takes some of the app's pooled
connections for a while, then gives them back (``bench_pool.py --neighbour``,
``tests/apps/neighbour_app.py``).

It stands for what takes a shared pool's connections in a real app besides its requests: a
report or batch job of another tenant, a long transaction, a ``LISTEN`` connection. It checks
its connections out of the app's own pool and holds them until told to give them back. While
it holds them the pool's size is unchanged and the requests wait for the connections left:
the capacity the requests can use moved, and only the pool's waiting says so.

Told through a control file, polled every 20 ms: its content is the number of connections to
hold in each worker (``0`` or no file: none; anything else: no change). When a worker's holders
all have their connections, or have all given them back, it appends
``<time.monotonic()> <pid> <connections held>`` to ``<control file>.log`` (the clock is
system-wide), so a benchmark times the limit from when the capacity actually moved::

    start(lambda: pool_resource, path)             # any context manager that holds one
    start(holder("sqlalchemy", globals()), path)   # pool_bench_app.py's pools
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator

POLL = 0.02

Hold = Callable[[], contextlib.AbstractContextManager]


def holder(kind: str, app: dict) -> Hold:
    """For ``benchmarks/pool_bench_app.py`` (``app``: its globals): a context manager factory
    that checks out one connection of the app's pool and runs ``SELECT 1`` on it (a real
    session, then idle in transaction)."""
    if kind == "sqlalchemy":
        import sqlalchemy as sa

        @contextlib.contextmanager
        def hold() -> Iterator[None]:
            with app["ENGINE"].connect() as conn:
                conn.execute(sa.text("SELECT 1"))
                yield

    elif kind == "psycopg_pool":
        @contextlib.contextmanager
        def hold() -> Iterator[None]:
            with app["POOL"].connection() as conn:
                conn.execute("SELECT 1")
                yield

    elif kind == "django":
        @contextlib.contextmanager
        def hold() -> Iterator[None]:
            connection = app["connection"]  # thread-local: each holder thread has its own
            try:
                with connection.cursor() as cur:
                    cur.execute("SELECT 1")
                yield
            finally:
                connection.close()  # back to the pool

    else:
        raise ValueError(f"no neighbour for pool kind {kind!r}")
    return hold


def _wanted(path: str, held: int) -> int:
    try:
        with open(path) as f:
            return max(0, int(f.read().strip()))
    except FileNotFoundError:
        return 0
    except ValueError:
        return held  # not a number (yet): no change


def start(hold: Hold, path: str) -> threading.Thread:
    """Start this worker's neighbour (a daemon thread) following the control file ``path``;
    ``hold()`` is a context manager that holds one connection."""

    def one(got: threading.Barrier, release: threading.Event) -> None:
        with hold():
            got.wait()
            release.wait()

    def run() -> None:
        held, release, holders = 0, threading.Event(), []
        while True:
            want = _wanted(path, held)
            if want != held:
                release.set()
                for t in holders:
                    t.join()
                release, holders = threading.Event(), []
                if want:
                    got = threading.Barrier(want + 1)
                    holders = [threading.Thread(target=one, args=(got, release), daemon=True,
                                                name="neighbour-hold") for _ in range(want)]
                    for t in holders:
                        t.start()
                    got.wait()
                held = want
                with open(path + ".log", "a") as log:
                    log.write(f"{time.monotonic():.3f} {os.getpid()} {held}\n")
            time.sleep(POLL)

    thread = threading.Thread(target=run, daemon=True, name="neighbour")
    thread.start()
    return thread


def tell(path: str, connections: int) -> None:
    """Tell every worker's neighbour to hold ``connections`` (written whole: a worker never
    reads half of it)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(str(connections))
    os.replace(tmp, path)


def moves(path: str, t0: float = 0.0) -> list[tuple[float, int, int]]:
    """The neighbours' log: ``(seconds after t0, pid, connections held)`` per move."""
    try:
        with open(path + ".log") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        at, pid, held = line.split()
        out.append((float(at) - t0, int(pid), int(held)))
    return out
