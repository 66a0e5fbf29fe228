"""Pure ASGI app whose requests each hold a pooled PostgreSQL connection from an async pool, 2
per worker, for the pool signals' server tests under the ASGI workers
(tests/test_signals_postgres.py). Nothing in it knows about apf_gunicorn.

``ASYNC_POOL_KIND`` picks the pool: ``asyncpg`` (``asyncpg.create_pool``, made at the
lifespan's startup: an asyncpg pool belongs to the loop it was made on) or ``psycopg``
(psycopg_pool's ``AsyncConnectionPool`` named ``apool``, made when the module is imported, so
in the master under ``--preload``, and opened at the lifespan's startup in each worker).
``ASYNC_POOL_DSN`` is the libpq connection string. ``/work?ms=N`` holds a connection N ms
(``pg_sleep``; 50 by default); ``/healthz`` answers without the database.
"""

from __future__ import annotations

import os
from urllib.parse import parse_qs

KIND = os.environ.get("ASYNC_POOL_KIND", "asyncpg")
DSN = os.environ["ASYNC_POOL_DSN"]  # "host=... port=... user=... dbname=..."
SIZE = 2

if KIND == "asyncpg":
    import asyncpg

    _p = dict(part.split("=", 1) for part in DSN.split())
    URL = f"postgresql://{_p['user']}@{_p['host']}:{_p['port']}/{_p['dbname']}"
    POOL = None

    async def open_pool() -> None:
        global POOL
        POOL = await asyncpg.create_pool(URL, min_size=SIZE, max_size=SIZE)

    async def close_pool() -> None:
        await POOL.close()

    async def query(seconds: float) -> None:
        async with POOL.acquire() as conn:
            await conn.execute("SELECT pg_sleep($1)", seconds)

elif KIND == "psycopg":
    from psycopg_pool import AsyncConnectionPool

    POOL = AsyncConnectionPool(DSN, min_size=SIZE, max_size=SIZE, name="apool", open=False,
                               timeout=60)

    async def open_pool() -> None:
        await POOL.open(wait=True)

    async def close_pool() -> None:
        await POOL.close()

    async def query(seconds: float) -> None:
        async with POOL.connection() as conn:
            await conn.execute("SELECT pg_sleep(%s)", (seconds,))

else:
    raise SystemExit(f"ASYNC_POOL_KIND must be asyncpg or psycopg, not {KIND!r}")


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await open_pool()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await close_pool()
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    if scope["path"].startswith("/work"):
        ms = float(parse_qs(scope.get("query_string", b"").decode()).get("ms", ["50"])[0])
        await query(ms / 1000)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})
