"""ASGI app for tests/test_asgi_receive.py: frameworks that read ``receive()`` after a request
waited in APF's queue, behind one path dispatch (all on the ``work`` level of
``tests/apps/apf.yaml``):

* ``/work/hold?until=PATH``: holds its seat until the file PATH exists (the test ends it);
* ``/work/django/echo``: Django's ``ASGIHandler``, a sync view answering the request body
  (Django listens for ``http.disconnect`` while the view runs and drops the view on one);
* ``/work/starlette/echo``: Starlette, answering ``<body> connected=<not is_disconnected()>``
  after 10 ms of the endpoint's work;
* ``/work/starlette/events?n=N``: a Starlette server-sent-event stream of up to N events,
  10 ms apart, that ends early once ``is_disconnected()`` says the client left;
* ``/healthz``: 200.
"""

from __future__ import annotations

import asyncio
import os
from urllib.parse import parse_qs

import django
from django.conf import settings
from django.http import HttpResponse
from django.urls import path
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from tests.apps.asgi_app import lifespan

if not settings.configured:
    settings.configure(DEBUG=False, ALLOWED_HOSTS=["*"], ROOT_URLCONF=__name__,
                       INSTALLED_APPS=[], MIDDLEWARE=[], DATABASES={}, USE_TZ=True,
                       TIME_ZONE="UTC", SECRET_KEY="test-only")
    django.setup()

from django.core.handlers.asgi import ASGIHandler  # noqa: E402 - after the settings


def django_echo(request):  # a sync view: Django runs it on a thread, its listener meanwhile
    return HttpResponse(request.body, content_type="application/octet-stream")


urlpatterns = [path("work/django/echo", django_echo)]
_django = ASGIHandler()


async def starlette_echo(request: Request) -> PlainTextResponse:
    body = await request.body()
    await asyncio.sleep(0.01)  # the endpoint's own work, as a real one has
    connected = not await request.is_disconnected()
    return PlainTextResponse(body + f" connected={connected}".encode())


async def starlette_events(request: Request) -> StreamingResponse:
    async def events():
        for i in range(int(request.query_params.get("n", "3"))):
            if await request.is_disconnected():
                return
            yield f"data: {i}\n\n"
            await asyncio.sleep(0.01)  # the next event's work

    return StreamingResponse(events(), media_type="text/event-stream")


_starlette = Starlette(routes=[Route("/work/starlette/echo", starlette_echo, methods=["POST"]),
                               Route("/work/starlette/events", starlette_events)])


async def _hold(scope, send) -> None:
    until = parse_qs(scope["query_string"].decode())["until"][0]
    while not os.path.exists(until):
        await asyncio.sleep(0.01)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"held"})


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        return await lifespan(receive, send)
    p = scope["path"]
    if p.startswith("/work/django/"):
        return await _django(scope, receive, send)
    if p.startswith("/work/starlette/"):
        return await _starlette(scope, receive, send)
    if p == "/work/hold":
        return await _hold(scope, send)
    await send({"type": "http.response.start", "status": 200 if p == "/healthz" else 404,
                "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})
