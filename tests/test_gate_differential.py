"""The C request gate (``Gate`` in ``ledger/_fastpath.c``: request -> admitted in one call,
finished in one) against the Python path it shortcuts (``shape_of`` -> thread reserve ->
``ledger.admit``; ``finish_timed``), request by request.

Two front ends on the same configuration, each on its own bytearray ledger, replay the same
mixed request log: one with its gate, one with the gate taken away. After every step they must
agree on the shape key, the classification (level, FlowSchema, flow hash, seats), the answer
(status, every header, the body), the counters, the thread reserve, and the ledger's bytes.
The log mixes users and groups from a trusted proxy, the same headers from untrusted peers,
API keys (a digest in the key), exempt and Kubernetes API paths, watches, paths and headers
with odd bytes, long values, methods, repeated headers, and requests held open so that levels
fill: queued requests time out, others are rejected, and the thread reserve turns some away.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from apf_gunicorn.admission.asyncparking import AsyncParking
from apf_gunicorn.admission.core import WorkerContext
from apf_gunicorn.admission.dispatcher import GRANTED, Parking
from apf_gunicorn.asgi.middleware import ASGIMiddleware
from apf_gunicorn.flowcontrol.retryafter import RetryAfterTracker
from apf_gunicorn.gthread.wsgi import APFMiddleware, hidden
from apf_gunicorn.ledger.fastpath import _ACCEL
from apf_gunicorn.ledger.ledger import Capacity, Ledger
from apf_gunicorn.server.dumps import encode_detail
from apf_gunicorn.server.generation import (
    configure_ledger,
    level_max_seats,
    load_generation,
    route_table,
)
from apf_gunicorn.server.resolver import build_resolver
from apf_gunicorn.server.settings import load_settings

pytestmark = pytest.mark.skipif(_ACCEL is None, reason="the C extension is not built (or "
                                "APF_NO_ACCELERATOR=1): there is no gate to compare")

T0 = 10**12
KUBE = {"APF_CONFIG": "builtin:kubernetes", "APF_CONCURRENCY_LIMIT": "24",
        "APF_TRUSTED_PROXIES": "10.0.0.0/8,unix"}
WEBAPP = {"APF_CONFIG": "builtin:webapp", "APF_CONCURRENCY_LIMIT": "6",
          "APF_USER_FROM": "proxy,header:X-Api-Key,remote_user"}

PATHS = ["/hello", "/hello", "/api/v1/namespaces/default/pods", "/apis/apps/v1/deployments",
         "/api/v1/namespaces/ns1/configmaps/x", "/healthz", "/livez", "/readyz", "/metrics",
         "/", "/caf\xc3\xa9", "/\xff\xfe", "/a b", "/x" * 3000, "//api/v1/pods", "/static/x.css"]
QUERIES = ["", "", "watch=true", "timeout=5s", "a=\xe9&b", "watch=1&timeout=1m"]
METHODS = ["GET", "GET", "GET", "POST", "PUT", "DELETE", "PATCH", "get", "WEIRD"]
PEERS = ["10.1.2.3", "10.9.9.9", "192.168.0.5", "", "::ffff:10.0.0.9", "8.8.8.8"]
USERS = [None, None, "alice", "bob", "system:admin", "alice,eve", "u" * 20000, "\xc3\xa9t\xc3\xa9"]
GROUPS = [None, "system:masters", "g1,g2", "system:authenticated", "g" * 300, "a, b,,c"]
KEYS = [None, None, "k1", "k2", "k" * 5000]


def _requests(seed: int, n: int) -> list[dict]:
    """A mixed request log: what each request carries (and whether it is held open)."""
    rnd = random.Random(seed)
    # clients repeat themselves: a few dozen request shapes, most of them seen many times
    shapes = [{"method": rnd.choice(METHODS), "path": rnd.choice(PATHS),
               "query": rnd.choice(QUERIES), "peer": rnd.choice(PEERS),
               "user": rnd.choice(USERS), "groups": rnd.choice(GROUPS), "key": rnd.choice(KEYS),
               "remote_user": rnd.choice([None, None, None, "carol"]),
               "repeat": rnd.random() < 0.1} for _ in range(n // 12)]
    return [{**rnd.choice(shapes), "hold": rnd.random() < 0.35} for _ in range(n)]


def _environ(req: dict) -> dict:
    env = {"REQUEST_METHOD": req["method"], "PATH_INFO": req["path"],
           "QUERY_STRING": req["query"], "REMOTE_ADDR": req["peer"], "SCRIPT_NAME": "",
           "SERVER_PROTOCOL": "HTTP/1.1", "wsgi.url_scheme": "http"}
    for key, value in (("HTTP_X_REMOTE_USER", req["user"]),
                       ("HTTP_X_REMOTE_GROUP", req["groups"]), ("HTTP_X_API_KEY", req["key"]),
                       ("REMOTE_USER", req["remote_user"])):
        if value is not None:
            # gunicorn joins a repeated header with ","
            env[key] = value + "," + value if req["repeat"] and key.startswith("HTTP") else value
    return env


def _scope(req: dict) -> dict:
    headers = [(b"host", b"x")]
    for name, value in ((b"x-remote-user", req["user"]), (b"x-remote-group", req["groups"]),
                        (b"x-api-key", req["key"])):
        if value is not None:
            headers += [(name, value.encode("latin-1"))] * (2 if req["repeat"] else 1)
    path = req["path"].encode("latin-1").decode("utf-8", "replace")  # ASGI's decoded path
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": req["method"].upper(), "scheme": "http", "path": path,
             "raw_path": req["path"].encode("latin-1"), "root_path": "",
             "query_string": req["query"].encode("latin-1"), "headers": headers,
             "server": ("127.0.0.1", 8000)}
    if req["peer"]:
        scope["client"] = (req["peer"], 5000)
    return scope


class _WaitEnds(Parking):
    """A queued request's wait ends at once: granted if the ledger dispatched it meanwhile,
    else its deadline passed (the log's ``?timeout=`` then changes only the deadline)."""

    def wait(self, w, deadline_ns, clock, dispatched):
        self.unpark(w)
        return GRANTED if dispatched(w.slot, w.gen) else 0


class _AsyncWaitEnds(AsyncParking):
    async def wait(self, w, deadline_ns, clock, dispatched):
        self.unpark(w)
        return GRANTED if dispatched(w.slot, w.gen) else 0


class _SameSecond(RetryAfterTracker):
    """Retry-After as the real tracker computes it, at one wall-clock second for both sides
    (the real one reads ``time.time()``, which may tick between them)."""

    def observe_total(self, level, total_rejected, second=None):
        return super().observe_total(level, total_rejected, 1_000_000)


class _Side:
    """One front end on its own ledger (same configuration, same clock readings)."""

    def __init__(self, env: dict, front: str, clock, gate: bool, threads: int = 0):
        settings = load_settings(env, workers=1, threads=4)
        gen = load_generation(settings)
        cap = Capacity(levels=16, queues=2048, slots=64, workers=4, flow_schemas=64,
                       stats_entries=256)
        self.buf = bytearray(Ledger.size(cap))
        self.ledger = Ledger.create(self.buf, cap)
        configure_ledger(self.ledger, gen, T0)
        resolver = build_resolver(settings, gen.configuration)
        self.later: list = []
        if front == "wsgi":
            parking, deliver = _WaitEnds(), (lambda granted: None)
            extra = {"inflight": [], "nonexempt_threads": threads}
        else:
            parking = _AsyncWaitEnds()

            def deliver(granted):
                parking.grant_many((s, g) for s, g, _ in granted)

            extra = {}
        ctx = WorkerContext(
            ledger=self.ledger, resolver=resolver, classifier=gen.classifier,
            level_index=gen.level_index, fs_index=gen.fs_index, owner=0, parking=parking,
            deliver=deliver, add_linger=lambda until, slot, gen: None,
            queue_wait_limit_ns=0, alive=lambda: True,
            max_seats=level_max_seats(gen, settings), routes=route_table(resolver),
            retry_after=_SameSecond(), encode_detail=encode_detail, clock=clock,
            finish_later=lambda slot, gen: self.later.append((slot, gen)), **extra)
        mw_type = APFMiddleware if front == "wsgi" else ASGIMiddleware
        self.mw = mw_type(_app if front == "wsgi" else _asgi_app, ctx)
        self.gate = getattr(self.mw, "_admit_environ" if front == "wsgi" else "_admit_scope")
        assert self.gate is not None, "the gate must be bound here (C extension, builtin resolver)"
        self.gated = self.declined = 0
        if gate:
            inner = self.gate

            def counting(request):
                fast = inner(request)
                self.gated += fast is not None
                self.declined += fast is None
                return fast

            setattr(self.mw, "_admit_environ" if front == "wsgi" else "_admit_scope", counting)
        else:
            setattr(self.mw, "_admit_environ" if front == "wsgi" else "_admit_scope", None)
            del self.mw.finish_timed  # the Python method again
            if front == "wsgi":
                self.mw._body = None  # and the Python response body

    def classification(self, environ: dict) -> tuple:
        """What the request's shape decides (cached by now: nothing changes)."""
        s = self.mw.shape_of(environ)
        return (s.level, s.flow_hash, s.initial, s.final, s.al, s.fs_index, s.detail, s.early,
                s.kind, s.route.fs_name, s.route.level_name, s.route.headers)


def _app(environ, start_response):
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"hi"]


async def _asgi_app(scope, receive, send):
    hold = scope.get("_hold")
    if hold is not None:
        hold[0].set()
        await hold[1]
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"hi"})


def _same(a: _Side, b: _Side) -> bool:
    """The same ledger bytes, counters and finishes handed to the dispatcher."""
    return a.buf == b.buf and a.mw.stats == b.mw.stats and a.later == b.later


@pytest.mark.parametrize(("env", "threads", "rejects"),
                         [(KUBE, 2, "turned_away"), (WEBAPP, 8, "timeout")],
                         ids=["kubernetes", "webapp"])
def test_wsgi_gate_and_python_path_agree_request_by_request(env, threads, rejects) -> None:
    """``threads``: the thread reserve's non-exempt threads; ``rejects``: the 429s it sees
    most (a small reserve turns requests away before their levels fill; a large one lets
    them queue, and the queued ones time out)."""
    now = [T0]
    clock = lambda: now[0]  # noqa: E731 - both sides read the same instant
    sides = [_Side(env, "wsgi", clock, True, threads), _Side(env, "wsgi", clock, False, threads)]
    gated, python = sides
    assert _same(gated, python)
    held: list[tuple] = []  # (bodies, held flags) of requests kept open
    rnd = random.Random(7)
    statuses = set()
    for i, req in enumerate(_requests(11, 700)):
        now[0] += 1_000_000 + 17 * i
        if held and (rnd.random() < 0.3 or len(held) > 12):
            bodies, flags = held.pop(rnd.randrange(len(held)))
            for side, body, flag in zip(sides, bodies, flags, strict=True):
                body.close()
                if flag:  # the worker gives the thread's reserve entry back
                    side.mw.ctx.inflight.pop()
            assert _same(gated, python), f"step {i}: finishing a held request"
            continue
        environ = _environ(req)
        key = python.mw._shape_key(environ.get)
        assert gated.gate.__self__.key(environ, False) == key, f"step {i}: shape key"
        answers, bodies, flags = [], [], []
        for side in sides:
            hidden.held = False
            seen = {}

            def start_response(status, headers, exc_info=None, seen=seen):
                seen["status"], seen["headers"] = status, list(headers)

            body = side.mw(dict(environ), start_response)
            flags.append(hidden.held)
            content = list(body) if type(body) is list else list(iter(body))
            answers.append((seen.get("status"), seen.get("headers"), content))
            bodies.append(body)
        assert answers[0] == answers[1], f"step {i}: the answer"
        assert flags[0] == flags[1], f"step {i}: the thread reserve entry"
        statuses.add(answers[0][0])
        assert gated.classification(environ) == python.classification(environ), f"step {i}"
        if req["hold"] and all(hasattr(body, "close") for body in bodies):
            held.append((bodies, flags))
        else:
            for side, body, flag in zip(sides, bodies, flags, strict=True):
                if hasattr(body, "close"):
                    body.close()
                if flag:
                    side.mw.ctx.inflight.pop()
        assert _same(gated, python), f"step {i}: ledger bytes and counters"
        assert gated.mw.ctx.inflight == python.mw.ctx.inflight
    # the log did reach every path: the gate's, and the declines (misses, watches, full
    # levels, a full thread reserve)
    assert gated.gated > 200 and gated.declined > 50
    assert statuses >= {"200 OK", "429 Too Many Requests"}
    stats = gated.mw.stats
    assert stats["rejected"] > 0 and stats[rejects] > 0, stats


@pytest.mark.parametrize("env", [KUBE, WEBAPP], ids=["kubernetes", "webapp"])
def test_asgi_gate_and_python_path_agree_request_by_request(env) -> None:
    now = [T0]
    clock = lambda: now[0]  # noqa: E731
    sides = [_Side(env, "asgi", clock, gate=True), _Side(env, "asgi", clock, gate=False)]
    gated, python = sides

    async def call(side: _Side, scope: dict, hold) -> tuple:
        sent: list = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        if hold is not None:
            scope = {**scope, "_hold": hold}
        task = asyncio.ensure_future(side.mw(scope, receive, send))
        if hold is not None:  # until the app runs (admitted) or the request is answered
            started = asyncio.ensure_future(hold[0].wait())
            await asyncio.wait([task, started], return_when=asyncio.FIRST_COMPLETED)
            started.cancel()
        else:
            await task
        return task, sent

    async def main() -> None:
        rnd = random.Random(5)
        held: list = []
        statuses = set()
        for i, req in enumerate(_requests(23, 600)):
            now[0] += 1_000_000 + 13 * i
            if held and (rnd.random() < 0.3 or len(held) > 12):
                tasks, releases = held.pop(rnd.randrange(len(held)))
                for task, release in zip(tasks, releases, strict=True):
                    release.set_result(None)
                    await task
                assert _same(gated, python), f"step {i}: finishing a held request"
                continue
            scope = _scope(req)
            environ = python.mw._to_environ(scope)
            key = python.mw._shape_key(environ.get)
            c_key = gated.gate.__self__.key(scope, True)
            # the gate reads every plain scope (it declines only what it does not read)
            plain = req["path"].isascii() and (
                bool(req["peer"]) or "REMOTE_ADDR" not in python.mw.ctx.resolver.environ_keys)
            assert c_key == (key if plain else None), f"step {i}: shape key"
            results, releases = [], []
            for side in sides:
                hold = ((asyncio.Event(), asyncio.get_running_loop().create_future())
                        if req["hold"] else None)
                releases.append(hold[1] if hold else None)
                results.append(await call(side, dict(scope), hold))
            answers = [[m for m in sent] for _, sent in results]
            assert answers[0] == answers[1], f"step {i}: the answer"
            done = [task.done() for task, _ in results]
            assert done[0] == done[1], f"step {i}: held or answered"
            if answers[0]:
                statuses.add(answers[0][0]["status"])
            assert gated.classification(environ) == python.classification(environ), f"step {i}"
            if not done[0]:
                held.append(([t for t, _ in results], releases))
            assert _same(gated, python), f"step {i}: ledger bytes and counters"
        for tasks, releases in held:
            for task, release in zip(tasks, releases, strict=True):
                release.set_result(None)
                await task
        assert _same(gated, python), "after the held requests finished"
        assert gated.gated > 150 and gated.declined > 50
        assert statuses >= {200, 429}
        assert gated.mw.stats["rejected"] > 0

    asyncio.run(main())


def test_the_c_body_gives_the_seats_back_once_and_a_dropped_one_through_finish_later() -> None:
    """The gate's response body (``Body``, ``gthread/wsgi.py``'s ``_Body`` in C): ``close``
    finishes once even when the app's ``close`` raises; a body nobody closed hands its finish
    to ``finish_later`` when collected (a finalizer never takes the ledger lock)."""
    now = [T0]
    side = _Side(KUBE, "wsgi", lambda: now[0], gate=True, threads=4)
    environ = _environ({"method": "GET", "path": "/hello", "query": "", "peer": "10.1.2.3",
                        "user": "alice", "groups": None, "key": None, "remote_user": None,
                        "repeat": False})

    class Result(list):
        def close(self):
            raise RuntimeError("the app's close")

    def executing() -> int:
        return sum(lv.requests_executing for lv in side.ledger.snapshot(now[0]).levels)

    side.mw(dict(environ), lambda *a: None).close()  # the shape is cached: the gate admits
    side.mw.app = lambda environ, start_response: Result([b"x"])
    before = executing()
    body = side.mw(dict(environ), lambda *a: None)
    assert type(body).__name__ == "Body" and executing() == before + 1
    assert list(body) == [b"x"]
    with pytest.raises(RuntimeError, match="the app's close"):
        body.close()
    assert executing() == before
    side.mw.app = lambda environ, start_response: [b"y"]
    other = side.mw(dict(environ), lambda *a: None)
    with pytest.raises(RuntimeError, match="the app's close"):
        body.close()  # (as _Body: the app's close again) the seats went back once only
    assert executing() == before + 1 and side.later == []
    del body, other  # nobody closes it
    assert len(side.later) == 1 and executing() == before + 1  # the dispatcher's to finish
    side.ledger.finish(*side.later[0], now[0])
    assert executing() == before


def _refuse(*args, **kwargs):
    raise AssertionError("the Python path ran for a request the gate admits")


@pytest.mark.parametrize("front", ["wsgi", "asgi"])
def test_a_cached_request_that_runs_at_once_takes_no_python_admission_step(front) -> None:
    """Issue 34: the common request (shape cached, no hook, a free seat) is admitted in one C
    call and finished in one: neither ``shape_of`` nor the ledger's Python entries run."""
    now = [T0]
    side = _Side(KUBE, front, lambda: now[0], gate=True, threads=4)
    req = {"method": "GET", "path": "/hello", "query": "", "peer": "10.1.2.3", "user": "alice",
           "groups": "g1", "key": None, "remote_user": None, "repeat": False}
    led = side.ledger

    def serve() -> int:
        if front == "wsgi":
            seen = []
            body = side.mw(_environ(req), lambda status, headers, exc=None: seen.append(status))
            list(body)
            body.close()
            return int(seen[0].split()[0])
        sent: list = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        asyncio.run(side.mw(_scope(req), receive, send))
        return sent[0]["status"]

    assert serve() == 200  # classifies the shape (the Python path) and caches it
    side.mw.shape_of = side.mw._to_environ = _refuse
    led._admit_resume = led._finish_resume = _refuse
    side.mw._finish_at = _refuse
    for _ in range(3):
        assert serve() == 200
    assert side.mw.stats["bypassed"] == 0 and side.mw.stats["served"] == 4
    assert sum(lv.requests_executing for lv in led.snapshot(now[0]).levels) == 0
