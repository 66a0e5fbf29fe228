"""FastAPI and Starlette endpoints with a cost (apf_gunicorn.starlette): matched through the
app's own route objects (path parameters, mounts, included routers, methods, HEAD, 405, slash
redirects) and checked against what the app itself runs; the decorator on either side of
FastAPI's; explain naming the endpoint; costs that cannot take effect reported; and the
example app (examples/fastapi_app.py), in process and under a real gunicorn with each ASGI
worker (the last test)."""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")  # the test extra installs it; apf_gunicorn does not need it

import httpx  # noqa: E402
from fastapi import APIRouter, FastAPI  # noqa: E402
from fastapi.responses import PlainTextResponse  # noqa: E402
from flask import Flask  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.endpoints import HTTPEndpoint  # noqa: E402
from starlette.middleware.cors import CORSMiddleware  # noqa: E402
from starlette.middleware.gzip import GZipMiddleware  # noqa: E402
from starlette.responses import PlainTextResponse as StarletteText  # noqa: E402
from starlette.routing import Mount, Route, Router  # noqa: E402

from apf_gunicorn import flask as apf_flask  # noqa: E402
from apf_gunicorn import starlette as apf_starlette  # noqa: E402
from apf_gunicorn.appcosts import (  # noqa: E402
    declared_view_costs,
    declared_view_routes,
    unusable_costs,
    view_costs_for_app,
    view_names_for_app,
)
from apf_gunicorn.cli import main  # noqa: E402
from apf_gunicorn.flowcontrol.workestimate import WorkEstimate  # noqa: E402
from apf_gunicorn.starlette import StarletteViewCosts, cost  # noqa: E402
from tests.apps.overload import scrape, total  # noqa: E402
from tests.conftest import ROOT, free_port  # noqa: E402

EXAMPLE_CONFIG = str(ROOT / "examples" / "mysite" / "apf.yaml")
HERE = __name__


@pytest.fixture(autouse=True)
def _no_apf_environment(monkeypatch):
    """explain reads APF_* as the server does: start every test from none."""
    for name in list(os.environ):
        if name.startswith("APF_"):
            monkeypatch.delenv(name)


def _said(request) -> StarletteText:
    """Every endpoint answers with its own dotted name: what the app ran."""
    return StarletteText(request.scope["endpoint"].__qualname__)


# --- a Starlette app: path parameters, methods, an HTTPEndpoint, mounts ----------------------

@cost(seats=2)
async def s_report(request):
    return _said(request)


@cost(seats=3, final_seats=1, additional_latency="10ms")
def s_sync_write(request):  # a sync endpoint: Starlette runs it in its thread pool
    return _said(request)


async def s_plain(request):
    return _said(request)


@cost(seats=5)
async def s_deep(request):
    return _said(request)


class SItems(HTTPEndpoint):
    async def get(self, request):
        return StarletteText("SItems")

    @cost(seats=6)
    async def post(self, request):
        return StarletteText("SItems")


@cost(seats=7)
class SWhole(HTTPEndpoint):  # a cost on the class: every method it serves
    async def get(self, request):
        return StarletteText("SWhole")


class Tagged:
    """A mounted plain ASGI app (no routes) carrying a cost."""

    async def __call__(self, scope, receive, send):
        await StarletteText("Tagged")(scope, receive, send)


def starlette_app() -> Starlette:
    inner = Starlette(routes=[Route("/deep/{name}", s_deep, methods=["GET", "POST"])])
    return Starlette(routes=[
        Route("/reports/{year:int}", s_report),
        Route("/reports/{year:int}", s_sync_write, methods=["POST"]),
        Route("/reports/latest", s_plain),  # after the int route: "latest" is not an int
        Route("/items", SItems),
        Route("/whole", SWhole),
        Mount("/api", routes=[Route("/v1/{rest:path}", s_plain),
                              Mount("/inner", app=GZipMiddleware(inner))]),
        Mount("/files", app=cost(seats=2)(Tagged())),
    ])


# --- a FastAPI app: typed parameters, routers with prefixes, both decorator orders -------------

api = APIRouter(prefix="/orders")
nested = APIRouter(prefix="/lines")


@nested.get("/{line}", response_class=PlainTextResponse)
@cost(seats=2)
def f_line(line: int) -> str:  # a sync endpoint: FastAPI runs it in AnyIO's thread pool
    return "f_line"


@cost(seats=3)  # above the router's decorator: it tags the same function
@api.post("/", response_class=PlainTextResponse)
async def f_create() -> str:
    return "f_create"


api.include_router(nested)


def fastapi_app() -> FastAPI:
    app = FastAPI()

    @app.get("/reports/{year}", response_class=PlainTextResponse)
    @cost(seats=4)
    async def f_report(year: int) -> str:
        return "f_report"

    @cost(seats=5, long_running=True)
    @app.get("/events", response_class=PlainTextResponse)
    async def f_events() -> str:
        return "f_events"

    @app.put("/events", response_class=PlainTextResponse)
    async def f_replace() -> str:
        return "f_replace"

    def logged(view):  # a decorator of the app's own that keeps the function's attributes
        @functools.wraps(view)
        async def wrapper(*args, **kwargs):
            return await view(*args, **kwargs)
        return wrapper

    @app.get("/wrapped", response_class=PlainTextResponse)
    @logged
    @cost(seats=2)
    async def f_wrapped() -> str:
        return "f_wrapped"

    app.include_router(api, prefix="/v1")
    app.mount("/legacy", CORSMiddleware(starlette_app(), allow_origins=["*"]))
    return app


# --- the lookup, checked against what the app runs ----------------------------------------------

STARLETTE_REQUESTS = [
    ("GET", "/reports/2024", "s_report", WorkEstimate(2)),
    ("HEAD", "/reports/2024", "s_report", WorkEstimate(2)),  # Starlette: GET routes take HEAD
    ("POST", "/reports/2024", "s_sync_write", WorkEstimate(3, 1, 10_000_000)),
    ("DELETE", "/reports/2024", None, None),  # 405: no endpoint runs
    ("GET", "/reports/latest", "s_plain", None),  # a route without a cost
    ("GET", "/reports/2024/", None, None),  # a redirect to the path without the slash
    ("GET", "/nowhere", None, None),  # 404
    ("GET", "/items", "SItems", None),  # the undecorated method
    ("POST", "/items", "SItems", WorkEstimate(6)),
    ("DELETE", "/items", "SItems", None),  # the HTTPEndpoint answers 405 itself
    ("GET", "/whole", "SWhole", WorkEstimate(7)),
    ("HEAD", "/whole", "SWhole", WorkEstimate(7)),  # HTTPEndpoint: HEAD is get
    ("GET", "/api/v1/a/b/c", "s_plain", None),
    ("POST", "/api/inner/deep/x", "s_deep", WorkEstimate(5)),  # a mount behind middleware
    ("GET", "/api/inner/nowhere", None, None),  # the mounted app's own 404
    ("GET", "/files/a.txt", "Tagged", WorkEstimate(2)),  # a mounted ASGI app with a cost
]

FASTAPI_REQUESTS = [
    ("GET", "/reports/2024", "f_report", WorkEstimate(4)),
    ("GET", "/reports/twenty", "f_report", WorkEstimate(4)),  # matched; FastAPI answers 422
    ("HEAD", "/reports/2024", None, None),  # FastAPI: a GET route does not take HEAD (405)
    ("GET", "/events", "f_events", WorkEstimate(5, long_running=True)),
    ("PUT", "/events", "f_replace", None),  # same path, the other method's endpoint
    ("POST", "/events", None, None),  # 405
    ("GET", "/wrapped", "f_wrapped", WorkEstimate(2)),
    ("POST", "/v1/orders/", "f_create", WorkEstimate(3)),
    ("GET", "/v1/orders/lines/3", "f_line", WorkEstimate(2)),  # a router in a router
    ("GET", "/v1/orders", None, None),  # redirect to /v1/orders/... which takes POST only
    ("GET", "/legacy/reports/2024", "s_report", WorkEstimate(2)),  # a mounted Starlette app
    ("POST", "/legacy/api/inner/deep/x", "s_deep", WorkEstimate(5)),
    ("GET", "/docs", "swagger_ui_html", None),  # FastAPI's own routes
]


def _ran(app, method: str, path: str) -> str | None:
    """The endpoint the app ran for the request (its answer), None if it answered 404, 405 or
    a redirect without running one."""
    async def send() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://127.0.0.1") as client:
            return await client.request(method, path)

    response = asyncio.run(send())
    if response.status_code in (307, 404, 405):
        return None
    if response.status_code == 422:  # FastAPI ran the route, whose parameters failed
        return "f_report"
    return response.text.rsplit(".", 1)[-1] if method != "HEAD" else "HEAD"


@pytest.mark.parametrize("make, requests", [(starlette_app, STARLETTE_REQUESTS),
                                            (fastapi_app, FASTAPI_REQUESTS)],
                         ids=["starlette", "fastapi"])
def test_lookup_finds_the_endpoint_the_app_runs(make, requests) -> None:
    app = make()
    costs = view_costs_for_app(app)
    assert isinstance(costs, StarletteViewCosts)
    for method, path, endpoint, expected in requests:
        name = costs.name(method, path)
        where = f"{method} {path}: {name}"
        assert costs.lookup(method, path) == expected, where
        assert (name is None) == (endpoint is None), where
        if endpoint is not None:
            assert name.split(" (")[0].rsplit(".", 1)[-1] == endpoint, where
        ran = _ran(app, method, path)
        if (method, path) == ("DELETE", "/items"):  # the endpoint ran, and answered 405
            assert ran is None, where
        elif method == "HEAD":  # no body to tell the endpoint by: it ran or it did not
            assert (ran is None) == (endpoint is None), where
        elif endpoint not in ("swagger_ui_html",):
            assert ran == endpoint, where


def test_names_give_the_endpoint_and_its_route() -> None:
    costs = StarletteViewCosts.for_app(fastapi_app())
    assert costs.name("GET", "/v1/orders/lines/3") == f"{HERE}.f_line (/v1/orders/lines/{{line}})"
    assert costs.name("POST", "/legacy/api/inner/deep/x") == (
        f"{HERE}.s_deep (/legacy/api/inner/deep/{{name}})")
    assert costs.name("POST", "/legacy/items") == f"{HERE}.SItems (/legacy/items)"
    assert costs.name("GET", "/legacy/files/x") == f"{HERE}.Tagged (/legacy/files/{{path:path}})"
    assert costs.name("GET", "/reports/2024") == (
        f"{HERE}.fastapi_app.<locals>.f_report (/reports/{{year}})")


@pytest.mark.filterwarnings("ignore:The `root_path` parameter is deprecated")
def test_the_root_path_a_fastapi_app_sets_itself() -> None:
    """Item 8: the ASGI front end strips FastAPI's own root_path as FastAPI routes on it."""
    from apf_gunicorn.starlette import app_root_path

    assert app_root_path(FastAPI(root_path="/api")) == "/api"
    assert app_root_path(GZipMiddleware(FastAPI(root_path="/api"))) == "/api"
    assert app_root_path(FastAPI()) == ""
    assert app_root_path(Starlette()) == ""
    assert app_root_path(Flask(__name__)) == ""


def test_only_starlette_apps_get_starlette_costs() -> None:
    app = starlette_app()
    assert apf_starlette.starlette_app(app) is app
    wrapped = CORSMiddleware(GZipMiddleware(app), allow_origins=["*"])  # pure ASGI, in .app
    assert apf_starlette.starlette_app(wrapped) is app
    assert isinstance(view_costs_for_app(wrapped), StarletteViewCosts)
    assert view_costs_for_app(wrapped).lookup("GET", "/reports/1") == WorkEstimate(2)
    router = Router(routes=[Route("/r", s_report)])  # a bare Router is an app too
    assert view_costs_for_app(router).lookup("GET", "/r") == WorkEstimate(2)

    async def bare(scope, receive, send):
        pass

    assert apf_starlette.starlette_app(bare) is None and view_costs_for_app(bare) is None
    assert StarletteViewCosts.for_app(Flask("x")) is None
    # an app without any cost: nothing to look up, but explain still names its endpoints
    plain = Starlette(routes=[Route("/p", s_plain)])
    assert view_costs_for_app(plain) is None
    assert view_names_for_app(plain).name("GET", "/p") == f"{HERE}.s_plain (/p)"


def test_costs_behind_a_wrapper_that_hides_the_app_are_reported() -> None:
    class Hiding:  # keeps the app where nobody looks
        def __init__(self, inner):
            self._inner = inner

        async def __call__(self, scope, receive, send):
            await self._inner(scope, receive, send)

    app = fastapi_app()
    assert view_costs_for_app(Hiding(app)) is None
    (hidden,) = [m for m in unusable_costs(Hiding(app)) if m.startswith("FastAPI/Starlette")]
    assert hidden.startswith("FastAPI/Starlette endpoints declare @cost (")
    assert hidden.endswith(f"but the app ({HERE}.test_costs_behind_a_wrapper_that_hides_the_app_"
                           "are_reported.<locals>.Hiding) is not a Starlette app and keeps none "
                           "in .app: the costs have no effect (give gunicorn the FastAPI or "
                           "Starlette app, or declare the costs in APF_ROUTES)")
    # a reachable app, a Flask app: not suspected
    assert not [m for m in unusable_costs(app) if m.startswith("FastAPI/Starlette")]
    assert not [m for m in unusable_costs(Flask("f")) if m.startswith("FastAPI/Starlette")]


def test_declared_costs_and_their_routes() -> None:
    app = fastapi_app()
    declared = dict(declared_view_costs(app))
    assert declared["@cost on GET /reports/{year}"] == WorkEstimate(4)
    assert declared["@cost on POST /v1/orders/"] == WorkEstimate(3)
    assert declared["@cost on GET /legacy/reports/{year:int}"] == WorkEstimate(2)
    assert declared["@cost on POST /legacy/items"] == WorkEstimate(6)
    assert "@cost on GET /legacy/items" not in declared
    assert declared["@cost on GET /legacy/whole"] == WorkEstimate(7)
    assert declared["@cost on /legacy/files/{path:path}"] == WorkEstimate(2)
    assert declared["@cost on GET /events"] == WorkEstimate(5, long_running=True)
    assert "@cost on PUT /events" not in declared
    # the routes in the brackets the start-up checks read (a literal start, then parameters)
    routes = declared_view_routes(app)
    assert routes["@cost on GET /reports/{year}"] == "/reports/<year>"
    assert routes["@cost on /legacy/files/{path:path}"] == "/legacy/files/<path:path>"
    assert set(routes) == set(declared)


def test_wrong_frameworks_decorators_are_reported() -> None:
    app = FastAPI()

    @app.get("/flasky")
    @apf_flask.cost(seats=2)
    async def flasky():
        return ""

    costs = StarletteViewCosts.for_app(app, require_costs=False)
    assert costs.lookup("GET", "/flasky") is None  # Flask's decorator is not read
    assert StarletteViewCosts.for_app(app) is None  # no cost of its own
    assert unusable_costs(app) == [
        f"@cost from apf_gunicorn.flask on the FastAPI/Starlette view {HERE}.test_wrong_"
        "frameworks_decorators_are_reported.<locals>.flasky (/flasky) has no effect: use "
        "apf_gunicorn.starlette.cost"]

    flask_app = Flask("wrong")

    @flask_app.get("/r")
    @cost(seats=2)
    def r():
        return ""

    assert apf_flask.ViewCosts.for_app(flask_app) is None
    assert unusable_costs(flask_app) == [
        "@cost from apf_gunicorn.starlette on the Flask view 'r' (/r) has no effect: use "
        "apf_gunicorn.flask.cost"]


def test_lookups_are_cached_per_method_and_path(monkeypatch) -> None:
    costs = StarletteViewCosts(starlette_app(), cache_size=2)
    calls = []
    match = costs._match
    monkeypatch.setattr(costs, "_match", lambda m, p: calls.append((m, p)) or match(m, p))
    for _ in range(3):
        assert costs.lookup("GET", "/reports/2024") == WorkEstimate(2)
    assert calls == [("GET", "/reports/2024")]
    costs.lookup("GET", "/reports/2025")  # another path: its own entry
    costs.lookup("POST", "/reports/2025")
    costs.lookup("GET", "/reports/2024")  # evicted by the bound of 2
    assert len(calls) == 4
    long = "/api/v1/" + "x" * 5000  # a long path: matched every time, never kept
    assert costs.lookup("GET", long) is None and costs.lookup("GET", long) is None
    assert calls[-2:] == [("GET", long)] * 2


def test_hostile_paths_and_unreadable_routes_cost_one_seat(caplog) -> None:
    costs = StarletteViewCosts.for_app(starlette_app())
    assert costs.lookup("GET", "/reports/" + "9" * 100) == WorkEstimate(2)
    # past Python's 4300 digits int() fails, in the app's router as here: no endpoint runs
    assert costs.lookup("GET", "/reports/" + "9" * 5000) is None
    assert costs.lookup("GET", "") is None and costs.lookup("GET", "reports/1") is None

    class Broken(Route):  # a route whose matching fails: no endpoint, no exception
        def matches(self, scope):
            raise RuntimeError("broken route")

    app = Starlette(routes=[Broken("/b", s_report), Route("/ok", s_report)])
    costs = StarletteViewCosts.for_app(app)
    assert costs.lookup("GET", "/b") is None and costs.name("GET", "/b") is None

    class Unreadable(Route):  # a route whose endpoint cannot be read: logged, no costs
        @property
        def endpoint(self):
            raise RuntimeError("broken endpoint")

        @endpoint.setter
        def endpoint(self, value):
            pass

    with caplog.at_level(logging.ERROR, logger="apf_gunicorn.starlette"):
        assert StarletteViewCosts.for_app(Starlette(routes=[Unreadable("/u", s_report)])) is None
    assert "cannot read the Starlette routes; @cost declarations are ignored" in caplog.text


def test_cost_arguments_are_checked_as_flasks() -> None:
    with pytest.raises(ValueError, match="seats"):
        cost(seats=0)
    with pytest.raises(ValueError, match="additional_latency"):
        cost(final_seats=1, additional_latency="soon")


def test_flask_and_django_apps_never_walk_starlette_routes(monkeypatch) -> None:
    """Flask is asked first: a Flask app's costs never reach the Starlette module."""
    flask_app = Flask("first")

    @flask_app.get("/x")
    @apf_flask.cost(seats=2)
    def x():
        return ""

    monkeypatch.setattr(apf_starlette, "starlette_app",
                        lambda app: pytest.fail("Starlette asked about a Flask app"))
    assert isinstance(view_costs_for_app(flask_app), apf_flask.ViewCosts)


def _explain(capsys, *argv: str) -> dict:
    assert main(["explain", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_example_app_serves_and_explain_names_its_report(capsys) -> None:
    from examples.fastapi_app import app

    for path, body in (("/", "hello\n"), ("/healthz", "ok\n"), ("/readyz", "ok\n"),
                       ("/work?ms=1", "worked 1 ms\n"), ("/reports/2024", "report 2024\n")):
        async def get(path=path) -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://127.0.0.1") as client:
                return await client.get(path)

        response = asyncio.run(get())
        assert (response.status_code, response.text) == (200, body), path
    costs = view_costs_for_app(app)
    assert costs.lookup("GET", "/reports/2024") == WorkEstimate(4)
    assert costs.lookup("GET", "/healthz") is None and costs.lookup("GET", "/") is None
    assert unusable_costs(app) == []
    argv = ["--app", "examples.fastapi_app:app", "--config", EXAMPLE_CONFIG,
            "--concurrency-limit", "8"]
    out = _explain(capsys, *argv, "--request", "GET /reports/2024")
    assert out["seats"]["view"] == "examples.fastapi_app.report (/reports/{year})"
    assert (out["seats"]["initial"], out["seats"]["source"]) == (4, "@cost")
    assert out["priorityLevel"] == "reports"
    out = _explain(capsys, *argv, "--request", "GET /healthz")
    assert out["seats"]["view"] == "examples.fastapi_app.probe (/healthz)"
    assert out["priorityLevel"] == "exempt"


def test_example_reports_reach_only_the_level_wide_enough(monkeypatch) -> None:
    """What the first worker logs for the example: nothing on examples/mysite/apf.yaml (the
    report reaches only the 4-seat level), a clamp note on a configuration without it."""
    from apf_gunicorn.server import startup
    from apf_gunicorn.server.generation import level_max_seats, load_generation
    from apf_gunicorn.server.settings import load_settings
    from examples.fastapi_app import app

    warnings = []

    class Log:
        def warning(self, fmt, *args):
            warnings.append(fmt % args)

        def exception(self, msg):
            raise AssertionError(msg)

    for config, clamped in ((EXAMPLE_CONFIG, False), (str(ROOT / "tests" / "apps" / "rest.yaml"),
                                                      True)):
        warnings.clear()
        settings = load_settings({"APF_CONFIG": config, "APF_CONCURRENCY_LIMIT": "8"})
        gen = load_generation(settings)
        startup.log_route_notes(Log(), app, None, level_max_seats(gen, settings), gen)
        notes = [w for w in warnings if w.startswith("apf: @cost on GET /reports/{year} asks "
                                                     "for 4 seat(s): clamped to ")]
        assert bool(notes) == clamped, warnings
        if not clamped:
            assert warnings == []


def test_endpoints_tagged_then_dropped_are_forgotten() -> None:
    """The hidden-app report names live endpoints only (a weak set)."""
    def make():
        @cost(seats=9)
        async def transient(request):
            return None
        return transient

    make()
    gc.collect()
    assert not [e for e in apf_starlette._tagged if e.__name__ == "transient"]


@pytest.mark.server
@pytest.mark.parametrize("worker", ["apf_gunicorn.asgi.UvicornWorker",
                                    "apf_gunicorn.asgi.ASGIWorker"])
def test_example_app_admits_its_report_with_four_seats(server_factory, worker) -> None:
    """The example under a real gunicorn with each ASGI worker, on examples/mysite/apf.yaml
    (8 seats; /reports/* on a level annotated for 4): six concurrent reports are each admitted
    with their 4 seats (the level's work_estimated_seats counts six of 4), the probe and the
    hello with one, and the log has no warning (no cost clamped, none unreadable)."""
    aport = free_port()
    env = {"APF_CONCURRENCY_LIMIT": "8", "APF_ADMIN_BIND": f"127.0.0.1:{aport}",
           "APF_QUEUE_WAIT_LIMIT": "60"}
    with server_factory(workers=2, env=env, config=EXAMPLE_CONFIG,
                        args=("-k", worker, "examples.fastapi_app:app")) as srv:
        barrier = threading.Barrier(6)

        def report(_):
            barrier.wait()
            return srv.request("/reports/2024", timeout=60)[:3:2]

        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(report, range(6)))
        assert answers == [(200, b"report 2024\n")] * 6, srv.log()
        assert srv.request("/")[::2] == (200, b"hello\n")
        samples = scrape(aport)
        assert (total(samples, "apf_work_estimated_seats_count", priority_level="reports"),
                total(samples, "apf_work_estimated_seats_sum", priority_level="reports")) \
            == (6, 24), samples
        assert (total(samples, "apf_work_estimated_seats_count", priority_level="web"),
                total(samples, "apf_work_estimated_seats_sum", priority_level="web")) == (1, 1)
        log = srv.log()
    assert "clamped" not in log and "has no effect" not in log, log
    assert "[WARNING]" not in log and "Traceback" not in log, log
