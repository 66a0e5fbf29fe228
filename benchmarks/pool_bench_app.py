"""The app for ``bench_pool.py``: each ``/query`` runs one ``SELECT pg_sleep(0.05)`` on a
pooled PostgreSQL connection, 4 connections per worker; nothing in it knows about apf_gunicorn.
A Flask app (WSGI, the gthread worker) for the synchronous pools, a Starlette app (ASGI, the
uvicorn worker) for the async ones.

``POOL_BENCH_KIND`` picks the pool: ``sqlalchemy`` (``create_engine(pool_size=4,
max_overflow=0)``), ``psycopg_pool`` (``ConnectionPool(min_size=4, max_size=4)``) or ``django``
(Django 5.2's postgresql backend with ``OPTIONS: {"pool": {"min_size": 4, "max_size": 4}}``,
used from the Flask view through ``django.db.connection``). ``POOL_BENCH_DSN`` is the libpq
connection string. ``/ok`` answers without the database (readiness).

The async kinds, under ``-k apf_gunicorn.asgi.UvicornWorker``: ``asyncpg``
(``asyncpg.create_pool(min_size=4, max_size=4)``, made at the lifespan's startup: an asyncpg
pool belongs to the loop it is made on) and ``psycopg_async`` (psycopg_pool's
``AsyncConnectionPool(min_size=4, max_size=4)``, made at import and opened at the lifespan's
startup).

With ``POOL_BENCH_NEIGHBOUR`` (a control file) each worker also runs a neighbour tenant that
holds some of the pool's connections when told (``tests/apps/neighbour.py``; sync kinds).
"""

import os

from flask import Flask, request

KIND = os.environ.get("POOL_BENCH_KIND", "sqlalchemy")
DSN = os.environ["POOL_BENCH_DSN"]  # "host=... port=... user=... dbname=..."
SIZE = 4
app = Flask(__name__)


def _params() -> dict:
    return dict(part.split("=", 1) for part in DSN.split())


if KIND == "sqlalchemy":
    import sqlalchemy as sa

    p = _params()
    ENGINE = sa.create_engine(
        f"postgresql+psycopg://{p['user']}@{p['host']}:{p['port']}/{p['dbname']}",
        pool_size=SIZE, max_overflow=0, pool_timeout=60)

    def query(seconds: float) -> None:
        with ENGINE.connect() as conn:
            conn.execute(sa.text("SELECT pg_sleep(:s)"), {"s": seconds})

elif KIND == "psycopg_pool":
    from psycopg_pool import ConnectionPool

    POOL = ConnectionPool(DSN, min_size=SIZE, max_size=SIZE, timeout=60, open=True)

    def query(seconds: float) -> None:
        with POOL.connection() as conn:
            conn.execute("SELECT pg_sleep(%s)", (seconds,))

elif KIND == "django":
    import django
    from django.conf import settings

    p = _params()
    settings.configure(DATABASES={"default": {
        "ENGINE": "django.db.backends.postgresql", "NAME": p["dbname"], "USER": p["user"],
        "HOST": p["host"], "PORT": p["port"],
        "OPTIONS": {"pool": {"min_size": SIZE, "max_size": SIZE, "timeout": 60}}}},
        USE_TZ=True)
    django.setup()
    from django.db import connection

    def query(seconds: float) -> None:
        try:
            with connection.cursor() as cur:
                cur.execute("SELECT pg_sleep(%s)", [seconds])
        finally:
            connection.close()  # back to the pool, as Django does at a request's end

elif KIND == "asyncpg":
    import asyncpg

    p = _params()
    URL = f"postgresql://{p['user']}@{p['host']}:{p['port']}/{p['dbname']}"
    APOOL = None

    async def open_pool() -> None:
        global APOOL
        APOOL = await asyncpg.create_pool(URL, min_size=SIZE, max_size=SIZE)

    async def query_async(seconds: float) -> None:
        async with APOOL.acquire() as conn:
            await conn.execute("SELECT pg_sleep($1)", seconds)

elif KIND == "psycopg_async":
    from psycopg_pool import AsyncConnectionPool

    APOOL = AsyncConnectionPool(DSN, min_size=SIZE, max_size=SIZE, timeout=60, open=False)

    async def open_pool() -> None:
        await APOOL.open(wait=True)

    async def query_async(seconds: float) -> None:
        async with APOOL.connection() as conn:
            await conn.execute("SELECT pg_sleep(%s)", (seconds,))

else:
    raise SystemExit("POOL_BENCH_KIND must be sqlalchemy, psycopg_pool, django, asyncpg or "
                     f"psycopg_async, not {KIND!r}")


@app.route("/ok")
def ok():
    return "ok"


@app.route("/query")
def db():
    query(float(request.args.get("ms", "50")) / 1000)
    return "ok"


if KIND in ("asyncpg", "psycopg_async"):
    import contextlib

    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def ok_async(request):
        return PlainTextResponse("ok")

    async def db_async(request):
        await query_async(float(request.query_params.get("ms", "50")) / 1000)
        return PlainTextResponse("ok")

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await open_pool()
        try:
            yield
        finally:
            await APOOL.close()

    app = Starlette(routes=[Route("/ok", ok_async), Route("/query", db_async)],
                    lifespan=lifespan)

if os.environ.get("POOL_BENCH_NEIGHBOUR"):  # bench_pool.py --neighbour: another tenant's job
    from tests.apps import neighbour

    neighbour.start(neighbour.holder(KIND, globals()), os.environ["POOL_BENCH_NEIGHBOUR"])
