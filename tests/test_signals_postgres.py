"""psycopg_pool's pools and Django's pool found with no code in the app, against a real
PostgreSQL the fixture starts in a temp dir (tests/apps/pgserver.py; skipped, saying why,
where PostgreSQL is not installed)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from apf_gunicorn.signals import pools, psycopg_pools
from tests.apps.pgserver import PostgresServer, Unavailable
from tests.conftest import ROOT

psycopg_pool = pytest.importorskip("psycopg_pool")


@pytest.fixture(scope="module")
def pg():
    try:
        with PostgresServer.start() as server:
            server.wait_ready()
            yield server
    except Unavailable as e:
        pytest.skip(f"no PostgreSQL server: {e}")


def wait_for(predicate, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    return predicate()


def of(name: str):
    found = [r for r in pools.readings() if r.name == name]
    return found[0] if found else None


def test_connection_pool_found_when_constructed_and_read_from_its_stats(pg):
    assert psycopg_pools.install()
    # min_size = max_size: no connection is being opened when the test takes them
    pool = psycopg_pool.ConnectionPool(pg.dsn, min_size=2, max_size=2, name="pg-sync",
                                       open=False, timeout=30)
    assert of("pg-sync") is None  # not open: not counted
    pool.open(wait=True)
    try:
        r = of("pg-sync")
        assert (r.kind, r.capacity, r.in_use, r.waiting) == ("psycopg_pool", 2, 0, 0)
        held = [pool.getconn(), pool.getconn()]
        assert of("pg-sync").in_use == 2
        got = []
        t = threading.Thread(target=lambda: got.append(pool.getconn()))
        t.start()
        assert wait_for(lambda: of("pg-sync").waiting == 1), of("pg-sync")
        time.sleep(0.05)  # a wait of at least this long: not synchronisation
        pool.putconn(held.pop())
        t.join(30)
        assert got
        r = of("pg-sync")
        assert (r.waiting, r.waits, r.in_use) == (0, 1, 2) and r.wait_ns >= 40_000_000
        for conn in held + got:
            pool.putconn(conn)
    finally:
        pool.close()
    assert of("pg-sync") is None  # closed: not counted


def test_async_connection_pool(pg):
    assert psycopg_pools.install()

    async def main():
        pool = psycopg_pool.AsyncConnectionPool(pg.dsn, min_size=1, max_size=3,
                                                name="pg-async", open=False)
        await pool.open(wait=True)
        try:
            async with pool.connection() as conn:
                await conn.execute("SELECT 1")
                return of("pg-async")
        finally:
            await pool.close()

    r = asyncio.run(main())
    assert (r.kind, r.capacity, r.in_use) == ("psycopg_pool", 3, 1)


DJANGO = """
import json, os, sys
from apf_gunicorn.signals import importhook, pools
importhook.install()   # as a worker does before loading the app
import django
from django.conf import settings
settings.configure(DATABASES={"default": {
    "ENGINE": "django.db.backends.postgresql", "NAME": "postgres", "USER": "postgres",
    "HOST": "127.0.0.1", "PORT": sys.argv[1],
    "OPTIONS": {"pool": {"min_size": 1, "max_size": 3}}}})
django.setup()
from django.db import connection
with connection.cursor() as cur:
    cur.execute("SELECT 1")
    inside = [r.__dict__ for r in pools.readings()]
connection.close()
print(json.dumps(inside))
"""


def test_django_pool_found_by_alias(pg):
    pytest.importorskip("django", minversion="5.1")
    out = subprocess.run([sys.executable, "-c", DJANGO, str(pg.port)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    (r,) = json.loads(out.stdout)
    assert (r["name"], r["kind"], r["capacity"]) == ("django:default", "django", 3)
    # one connection out; psycopg_pool may be opening a second (counted in use: see
    # signals/psycopg_pools.py)
    assert 1 <= r["in_use"] <= 2


def test_asyncpg_pool_found_when_initialised_and_its_waits_measured(pg):
    """asyncpg has no statistics: capacity and in use are read from the pool, the waiting
    measured around Pool._acquire (signals/asyncpg_pools.py)."""
    asyncpg = pytest.importorskip("asyncpg")
    from apf_gunicorn.signals import asyncpg_pools

    assert asyncpg_pools.install()
    name = f"asyncpg://127.0.0.1:{pg.port}/postgres"

    async def main():
        pool = asyncpg.create_pool(f"postgresql://postgres:secret@127.0.0.1:{pg.port}/postgres",
                                   min_size=2, max_size=2)
        assert of(name) is None  # not initialised: not counted
        await pool
        try:
            r = of(name)
            assert (r.kind, r.capacity, r.in_use, r.waiting, r.waits) == (
                "asyncpg", 2, 0, 0, 0), r
            held = [await pool.acquire(), await pool.acquire()]
            assert of(name).in_use == 2
            third = asyncio.ensure_future(pool.fetchval("SELECT 1"))
            for _ in range(1000):  # until the third acquire waits (the loop runs it)
                if of(name).waiting == 1:
                    break
                await asyncio.sleep(0.005)
            assert of(name).waiting == 1, of(name)
            await asyncio.sleep(0.05)  # a wait of at least this long: not synchronisation
            await pool.release(held.pop())
            assert await asyncio.wait_for(third, 30) == 1
            r = of(name)
            assert (r.waiting, r.waits, r.in_use) == (0, 1, 1) and r.wait_ns >= 40_000_000, r
            await pool.release(held.pop())
            assert of(name).in_use == 0
        finally:
            await pool.close()
        assert of(name) is None  # closed: not counted

    asyncio.run(main())


def test_asyncpg_pool_names():
    from types import SimpleNamespace as NS

    from apf_gunicorn.signals.asyncpg_pools import pool_name

    def named(*args, **kwargs):
        return pool_name(NS(_connect_args=args, _connect_kwargs=kwargs))

    assert named("postgres://u:pw@db.example:6543/app?sslmode=off") == \
        "asyncpg://db.example:6543/app"
    assert named(host="10.0.0.1", port=5432, database="app", user="u", password="pw") == \
        "asyncpg://10.0.0.1:5432/app"
    assert named("postgresql://u@h1:5432,h2:5433/app") == "asyncpg://h1:5432,h2:5433/app"
    assert named() == "asyncpg"


UVICORN = ("-c", "python:apf_gunicorn.conf", "-k", "apf_gunicorn.asgi.UvicornWorker")


def _async_pool_seen(server_factory, pg, kind: str, name: str, args: tuple = ()) -> None:
    """Under the uvicorn worker (2 workers), tests/apps/async_pool_app.py's pool (2 connections
    per worker) appears server-wide before any request, and requests waiting for it are seen
    and counted, in /metrics and in dump_pools."""
    pytest.importorskip("uvicorn_worker")
    from tests.apps.flood import Flood
    from tests.conftest import free_port
    from tests.test_server_observability import DUMP, admin_get
    from tests.test_signals_server import pool_samples

    admin = free_port()
    env = {"APF_ADMIN_BIND": f"127.0.0.1:{admin}", "APF_CONCURRENCY_LIMIT": "32",
           "ASYNC_POOL_KIND": kind, "ASYNC_POOL_DSN": pg.dsn}
    with server_factory(workers=2, conf=UVICORN, env=env, args=args,
                        app="tests.apps.async_pool_app:app") as srv:
        before = srv.wait_for(lambda: pool_samples(admin, name).get("apf_pool_capacity") == 4
                              and pool_samples(admin, name))
        assert before, (pool_samples(admin, name), srv.log())
        assert before["apf_pool_in_use"] == 0 and before["apf_pool_waiting"] == 0, before
        seen: dict[str, float] = {}

        def waiting() -> bool:
            seen.update(pool_samples(admin, name))
            return seen.get("apf_pool_waiting", 0) > 0

        # 12 connections on 4 connections server-wide (the /work level has 16 of 32 seats)
        with Flood(srv.port, "/work?ms=50", user="heavy", connections=12) as flood:
            assert srv.wait_for(waiting, timeout=60), (seen, srv.log())
            assert 2 <= seen["apf_pool_in_use"] <= 4, seen
            dump = admin_get(admin, DUMP + "dump_pools")
        assert flood.statuses.get(200, 0) > 0 and not flood.errors, flood.statuses
        cells = [c.strip() for c in next(line for line in dump.splitlines()
                                         if line.startswith(name)).split(",")]
        assert cells[1:4] == [kind if kind == "asyncpg" else "psycopg_pool", "2", "4"], dump
        after = srv.wait_for(lambda: (s := pool_samples(admin, name))
                             .get("apf_pool_waits_total", 0) > 0 and s)
        assert after and after["apf_pool_wait_seconds_total"] > 0, after


@pytest.mark.server
def test_asyncpg_pool_under_the_uvicorn_worker(server_factory, pg):
    pytest.importorskip("asyncpg")
    _async_pool_seen(server_factory, pg, "asyncpg", f"asyncpg://127.0.0.1:{pg.port}/postgres")


@pytest.mark.server
def test_psycopg_async_pool_made_in_a_preloading_master_under_the_uvicorn_worker(
        server_factory, pg):
    """The AsyncConnectionPool is made when gunicorn's master loads the app (``--preload``),
    before any worker exists, and opened in each worker's loop (its lifespan): found in the
    master and inherited by the workers, read from the worker's publisher thread
    (``get_stats()`` is synchronous)."""
    _async_pool_seen(server_factory, pg, "psycopg", "apool", args=("--preload",))
