"""The middleware's work estimates, in process against a ledger on a bytearray: initial seats
from a route file and from Flask ``@cost``, final seats and their lingering release, early
release of long-running responses, the precedence hook > @cost > route file > default, the
clamp, hook failures falling back, and the per-shape cache keeping the cost."""

from __future__ import annotations

import logging
from types import SimpleNamespace as NS

import pytest
from flask import Flask, Response
from flask.views import MethodView
from werkzeug.test import EnvironBuilder

from apf_gunicorn.admission.dispatcher import Parking
from apf_gunicorn.flask import ViewCosts, cost, view_cost
from apf_gunicorn.flowcontrol.requestinfo import RequestInfoResolver
from apf_gunicorn.flowcontrol.routes import parse_routes
from apf_gunicorn.flowcontrol.workestimate import WorkEstimate
from apf_gunicorn.gthread.wsgi import APFMiddleware, WorkerContext
from apf_gunicorn.ledger.ledger import Capacity, Ledger, LevelSpec  # noqa: E402

T0 = 1_000_000_000_000
LEVEL = NS(name="lvl", uid="uid-pl", is_exempt=False)
SCHEMA = NS(name="fs", uid="uid-fs")

ROUTES = parse_routes([
    {"path": "/routed", "seats": 2},
    {"path": "/both", "seats": 2},
    {"path": "/wide", "seats": 20},
    {"path": "/tail", "finalSeats": 3, "additionalLatency": "50ms"},
    {"path": "/stream", "seats": 2, "longRunning": True},
], "routes.yaml")


class Classifier:
    def classify(self, attrs):
        return NS(flow_schema=SCHEMA, priority_level=LEVEL, distinguisher="", flow_hash=7)


class Env:
    """A ledger with one Reject level of 10 seats, a clock, and what the middleware sees."""

    def __init__(self, limit: int = 10, max_seats: int = 6):
        cap = Capacity()
        self.led = Ledger.create(bytearray(Ledger.size(cap)), cap)
        self.levels, self.schemas = self.led.configure([LevelSpec("lvl", 0, 0, 0, limit)],
                                                       ["fs"], T0)
        self.now = T0
        self.lingers: list[tuple[int, int, int]] = []
        self.max_seats = max_seats
        self.seen: list[int] = []  # seats in use seen from inside the app
        self.auto_release = True  # release lingering seats at once (the dispatcher's job)

    def clock(self) -> int:
        return self.now

    def add_linger(self, until: int, slot: int, gen: int) -> None:
        self.lingers.append((until, slot, gen))
        if self.auto_release:
            self.led.release(slot, gen, until)

    def seats(self) -> int:
        (lv,) = [lv for lv in self.led.snapshot(self.now).levels if lv.name == "lvl"]
        return lv.seats_in_use

    def middleware(self, app, routes=ROUTES, hook=None) -> APFMiddleware:
        ctx = WorkerContext(
            ledger=self.led, resolver=RequestInfoResolver(), classifier=Classifier(),
            level_index=self.levels, fs_index=self.schemas, owner=0, parking=Parking(),
            deliver=lambda granted: None, add_linger=self.add_linger,
            queue_wait_limit_ns=10**9, alive=lambda: True, clock=self.clock,
            max_seats={"lvl": self.max_seats}, routes=routes, work_estimator=hook)
        return APFMiddleware(app, ctx)


def wsgi_app(env: Env):
    def app(environ, start_response):
        env.seen.append(env.seats())
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]
    return app


def start(mw, path, method="GET", **extra):
    """Call the middleware; returns (status, body iterable) without consuming the body."""
    seen = {}

    def start_response(status, headers, exc_info=None):
        seen["status"] = int(status.split()[0])

    environ = EnvironBuilder(path=path, method=method).get_environ()
    environ.update(REMOTE_ADDR="10.0.0.1", **extra)
    body = mw(environ, start_response)
    return seen.get("status"), body


def call(mw, path, **kw) -> int:
    status, body = start(mw, path, **kw)
    b"".join(body)
    getattr(body, "close", lambda: None)()
    return status


@pytest.fixture
def env():
    return Env()


def test_route_file_initial_seats(env) -> None:
    mw = env.middleware(wsgi_app(env))
    assert call(mw, "/routed") == 200
    assert call(mw, "/other") == 200
    assert env.seen == [2, 1]
    assert env.seats() == 0


def test_seats_limit_concurrency(env) -> None:
    mw = env.middleware(wsgi_app(env), routes=parse_routes([{"path": "/four", "seats": 4}]))
    held = [start(mw, "/four") for _ in range(3)]
    assert [s for s, _ in held] == [200, 200, 429]  # 10 seats: two 4-seat requests fit
    assert env.seats() == 8
    assert call(mw, "/one") == 200  # one seat still fits beside them
    for _, body in held:
        getattr(body, "close", lambda: None)()  # the 429's body is a plain list
    assert env.seats() == 0


def test_final_seats_linger_until_released(env) -> None:
    env.auto_release = False
    mw = env.middleware(wsgi_app(env))
    status, body = start(mw, "/tail")
    assert status == 200 and env.seen == [3]  # max(initial, final) reserved from the start
    env.now += 1_000_000
    body.close()
    assert env.seats() == 3  # the tail holds the final seats
    ((until, slot, gen),) = env.lingers
    assert until == env.now + 50_000_000
    env.now = until
    env.led.release(slot, gen, env.now)  # what the dispatcher does at `until`
    assert env.seats() == 0


def test_long_running_releases_when_the_app_returns(env) -> None:
    def streaming(environ, start_response):
        env.seen.append(env.seats())
        start_response("200 OK", [])

        def gen():
            env.seen.append(env.seats())
            yield b"a"
        return gen()

    mw = env.middleware(streaming)
    status, body = start(mw, "/stream")
    assert env.seats() == 0  # released before a byte of the body was produced
    assert b"".join(body) == b"a"
    body.close()
    assert env.seen == [2, 0]
    # the same app on a path without longRunning holds its seats while streaming
    env.seen.clear()
    status, body = start(mw, "/routed")
    assert env.seats() == 2
    assert b"".join(body) == b"a"
    body.close()
    assert env.seen == [2, 2] and env.seats() == 0


def flask_app(env: Env) -> Flask:
    app = Flask("seats")

    @app.route("/decorated")
    @cost(seats=3)
    def decorated():
        env.seen.append(env.seats())
        return "ok"

    @cost(seats=4, final_seats=1, additional_latency="10ms")  # above @app.route works too
    @app.route("/both")
    def both():
        env.seen.append(env.seats())
        return "ok"

    @app.route("/routed")
    def routed():
        env.seen.append(env.seats())
        return "ok"

    @app.route("/feed")
    @cost(seats=2, long_running=True)
    def feed():
        def gen():
            env.seen.append(env.seats())
            yield "x"
        return Response(gen())

    @app.route("/items/<int:n>")
    def plain(n):
        env.seen.append(env.seats())
        return "ok"

    class Items(MethodView):
        @cost(seats=5)
        def post(self):
            env.seen.append(env.seats())
            return "ok"

        def get(self):
            env.seen.append(env.seats())
            return "ok"

    app.add_url_rule("/items", view_func=Items.as_view("items"))
    return app


def test_flask_decorator_and_precedence_over_routes(env) -> None:
    mw = env.middleware(flask_app(env))
    assert call(mw, "/decorated") == 200
    assert call(mw, "/both") == 200  # @cost (4) beats the route file (2)
    assert call(mw, "/routed") == 200  # no @cost: the route file
    assert call(mw, "/items/3") == 200  # neither: one seat
    assert call(mw, "/items", method="POST") == 200  # MethodView method's @cost
    assert call(mw, "/items") == 200
    assert env.seen == [3, 4, 2, 1, 5, 1]
    ((until, _, _),) = env.lingers  # /both's final seat, for 10 ms
    assert until == env.now + 10_000_000
    assert call(mw, "/feed") == 200
    assert env.seen[-1] == 0  # /feed's 2 seats were back before its body ran


def test_hook_beats_everything_and_none_falls_through(env, caplog) -> None:
    def hook(environ, attrs, c):
        wanted = environ.get("HTTP_X_SEATS")
        if wanted == "boom":
            raise ValueError("cannot count")
        return None if wanted is None else {"seats": int(wanted)}

    mw = env.middleware(flask_app(env), hook=hook)
    caplog.set_level(logging.ERROR)
    # same request shape (the header is not in the cache key): the hook runs every time
    assert call(mw, "/both", HTTP_X_SEATS="6") == 200
    assert call(mw, "/both", HTTP_X_SEATS="1") == 200
    assert call(mw, "/both") == 200  # None: @cost
    assert call(mw, "/routed", HTTP_X_SEATS="boom") == 200  # failure: the route file
    assert call(mw, "/routed", HTTP_X_SEATS="boom") == 200
    assert call(mw, "/items/1", HTTP_X_SEATS="9") == 200  # clamped to the level's 6
    assert env.seen == [6, 1, 4, 2, 2, 6]
    failures = [r for r in caplog.records if "APF_WORK_ESTIMATOR" in r.getMessage()]
    assert len(failures) == 1  # logged once per distinct error
    assert mw.stats["bypassed"] == 0


def test_clamp_to_level_max_seats_logs_once(env, caplog) -> None:
    caplog.set_level(logging.WARNING, "apf_gunicorn.middleware")
    mw = env.middleware(wsgi_app(env))
    assert call(mw, "/wide") == 200
    assert call(mw, "/wide", QUERY_STRING="x=1") == 200  # another shape, same clamp
    assert env.seen == [6, 6]
    (record,) = [r for r in caplog.records if "clamped" in r.getMessage()]
    assert ("APF_ROUTES for GET /wide asks for 20 seat(s) (final 0) but priority level 'lvl' "
            "admits at most 6 seat(s) per request; clamped to 6") in record.getMessage()
    # the warning says where the maximum comes from and how to change it
    assert ("that maximum is Kubernetes' rule: 15% of its nominal seats, at most nominal / "
            "handSize; set it with the apf-gunicorn.io/max-seats annotation"
            ) in record.getMessage()


def test_cost_is_computed_once_per_shape(env, monkeypatch) -> None:
    calls = []
    original = ViewCosts.lookup

    def counting(self, method, path):
        calls.append((method, path))
        return original(self, method, path)

    monkeypatch.setattr(ViewCosts, "lookup", counting)
    mw = env.middleware(flask_app(env))
    for _ in range(5):
        assert call(mw, "/decorated") == 200
    assert calls == [("GET", "/decorated")]
    assert env.seen == [3] * 5


def test_non_flask_apps_and_apps_without_costs_skip_the_lookup(env) -> None:
    mw = env.middleware(wsgi_app(env), routes=None)
    assert mw._view_costs is None and not mw._shape_costs
    plain = Flask("plain")
    plain.route("/x")(lambda: "x")
    mw = env.middleware(plain, routes=parse_routes([{"path": "/x", "resource": "r"}]))
    assert mw._view_costs is None and not mw._shape_costs
    assert call(mw, "/x") == 200


def test_view_cost_lookup_details() -> None:
    app = Flask("lookup")

    @app.route("/a", methods=["GET", "POST"])
    @cost(seats=2)
    def a():
        return "a"

    @cost(seats=7)
    class Whole(MethodView):
        def get(self):
            return "w"

    app.add_url_rule("/w", view_func=Whole.as_view("whole"))
    costs = ViewCosts.for_app(app)
    assert costs.lookup("GET", "/a") == costs.lookup("HEAD", "/a") == WorkEstimate(2)
    assert costs.lookup("POST", "/a/") is None  # strict slashes: a redirect runs no view
    assert costs.lookup("OPTIONS", "/a") is None  # Flask answers it itself
    assert costs.lookup("DELETE", "/a") is None  # 405
    assert costs.lookup("GET", "/w") == WorkEstimate(7)  # class-level @cost
    assert view_cost(lambda: None, "GET") is None
    with pytest.raises(ValueError, match="seats"):
        cost(seats=0)
