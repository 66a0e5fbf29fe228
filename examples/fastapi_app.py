"""An example FastAPI app for apf_gunicorn's ASGI worker: a costly route, normal ones, probes.

Routes: ``/`` (hello), ``/work?ms=N`` (awaits N ms, to see queuing), ``/reports/{year}`` (a
report that awaits ~100 ms and costs 4 seats: ``@cost(seats=4)``), ``/healthz`` and
``/readyz`` (probes: GETs of them are exempt in the built-in configurations, never queued or
rejected; ``examples/mysite/apf.yaml`` exempts ``/healthz``).

Serve it from the root of a checkout (``pip install '.[asgi,fastapi]'``)::

    gunicorn -c python:apf_gunicorn.conf -k apf_gunicorn.asgi.UvicornWorker examples.fastapi_app:app

On the built-in configuration Kubernetes' rule clamps a request to 15% of its level's seats
(1 seat on an 8-seat server), and the first worker logs that the report's ``@cost`` is
clamped. ``examples/mysite/apf.yaml`` sends ``/reports/*`` to a level annotated
``apf-gunicorn.io/max-seats: "4"``, where a report takes its 4 seats (one report at a time on
an 8-seat server)::

    APF_CONFIG=examples/mysite/apf.yaml APF_CONCURRENCY_LIMIT=8 \\
        gunicorn -c python:apf_gunicorn.conf -k apf_gunicorn.asgi.UvicornWorker examples.fastapi_app:app
    apf-gunicorn explain --app examples.fastapi_app:app --config examples/mysite/apf.yaml \\
        --concurrency-limit 8 --request "GET /reports/2024"    # names the endpoint, 4 seats
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Query
from fastapi.responses import PlainTextResponse

from apf_gunicorn.starlette import cost

app = FastAPI(title="apf_gunicorn example")


@app.get("/", response_class=PlainTextResponse)
async def hello() -> str:
    return "hello\n"


@app.get("/work", response_class=PlainTextResponse)
async def work(ms: int = Query(100, ge=0, le=60_000)) -> str:
    await asyncio.sleep(ms / 1000)
    return f"worked {ms} ms\n"


@app.get("/reports/{year}", response_class=PlainTextResponse)
@cost(seats=4)  # below FastAPI's decorator (above it works too: both tag the same function)
async def report(year: int) -> str:
    await asyncio.sleep(0.1)  # the costly query, awaited: the worker serves others meanwhile
    return f"report {year}\n"


@app.get("/healthz", response_class=PlainTextResponse)
@app.get("/readyz", response_class=PlainTextResponse)
async def probe() -> str:
    return "ok\n"
