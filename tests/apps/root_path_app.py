"""FastAPI and Starlette apps for the root-path tests of the ASGI workers (``tests/
test_asgi_server.py``): what the apps route on, and the ``@cost`` of each route.

* ``fastapi_app``: ``FastAPI(root_path="/api")``, which sets the scope's ``root_path`` itself
  before it routes;
* ``starlette_app``: a plain Starlette app, for a server's ``--root-path``.

Both: ``/healthz`` -> 200; ``/wide`` and ``/apiwide`` (each ``@cost(seats=2)``, the widest
request of level ``work`` in ``tests/apps/apf.yaml``) hold until the file ``?until=PATH``
exists (at most 60 s), then answer their path.
"""

from __future__ import annotations

import asyncio
import os

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse as StarletteText
from starlette.routing import Route

from apf_gunicorn.starlette import cost


async def _hold(request: Request) -> StarletteText:
    until = request.query_params.get("until", "")
    for _ in range(3000):
        if not until or os.path.exists(until):
            break
        await asyncio.sleep(0.02)
    return StarletteText(request.url.path)


async def healthz(request: Request) -> StarletteText:
    return StarletteText("ok")


@cost(seats=2)
async def wide(request: Request) -> StarletteText:
    return await _hold(request)


@cost(seats=2)
async def apiwide(request: Request) -> StarletteText:
    return await _hold(request)


starlette_app = Starlette(routes=[Route("/healthz", healthz), Route("/wide", wide),
                                  Route("/apiwide", apiwide)])

fastapi_app = FastAPI(root_path="/api")
fastapi_app.get("/healthz", response_class=PlainTextResponse)(healthz)
fastapi_app.get("/wide", response_class=PlainTextResponse)(wide)
fastapi_app.get("/apiwide", response_class=PlainTextResponse)(apiwide)
