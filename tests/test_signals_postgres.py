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
