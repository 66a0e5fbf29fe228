"""The ASGI front end in process, no server: the scope's environ (``asgi/scope.py``), the event
loop's parking (``admission/asyncparking.py``) and the middleware (``asgi/middleware.py``) on a
real :class:`~apf_gunicorn.ledger.ledger.Ledger` in a bytearray, on a real event loop.

Waits are for conditions: a coroutine yields to the loop (``asyncio.sleep(0)``) a bounded number
of times until what it waits for is true, and the result is checked. Time is an injected clock
wherever the code takes one (the wait limit, ``?timeout=``).
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace as NS

import pytest

from apf_gunicorn.admission.asyncparking import AsyncParking
from apf_gunicorn.admission.core import STOPPING_BODY, TOO_MANY, WorkerContext
from apf_gunicorn.admission.dispatcher import CANCELLED, GRANTED, STOPPING
from apf_gunicorn.asgi.middleware import ASGIMiddleware
from apf_gunicorn.asgi.scope import ScopeEnviron, header_key
from apf_gunicorn.flowcontrol.requestinfo import RequestInfoResolver
from apf_gunicorn.ledger.ledger import Capacity, Ledger, LevelSpec
from apf_gunicorn.ledger.records import EXECUTE

LEVEL = NS(name="lvl", uid="uid-pl", is_exempt=False)
SCHEMA = NS(name="fs", uid="uid-fs")
FAR = 10**18  # a deadline that never comes


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _until(predicate, tries: int = 2000):
    """``predicate()``'s value once true, yielding to the loop between tries (no time waited);
    its last (falsy) value after ``tries`` turns of the loop."""
    for _ in range(tries):
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0)
    return predicate()


# -- ScopeEnviron -------------------------------------------------------------------------------


def _scope(path="/x", query=b"", headers=(), typ="http", method="GET", client=("10.0.0.1", 4711),
           **extra) -> dict:
    scope = {"type": typ, "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
             "headers": [(b"host", b"testserver"), *headers], "client": client,
             "server": ("127.0.0.1", 8000), **extra}
    if typ == "http":
        scope["method"] = method
    return scope


def test_header_names_become_wsgi_keys():
    assert header_key(b"x-api-key") == "HTTP_X_API_KEY"
    assert header_key(b"content-type") == "CONTENT_TYPE"
    assert header_key(b"content-length") == "CONTENT_LENGTH"
    assert header_key(b"host") == "HTTP_HOST"


def test_every_header_when_the_resolver_may_read_anything():
    env = ScopeEnviron(None)(_scope(
        path="/a", query=b"timeout=4s&x=%C3%A9",
        headers=[(b"x-tenant", b"a"), (b"x-tenant", b"b"), (b"content-type", b"text/plain"),
                 (b"content-length", b"3")], method="POST"))
    assert env["REQUEST_METHOD"] == "POST"
    assert env["PATH_INFO"] == "/a"
    assert env["QUERY_STRING"] == "timeout=4s&x=%C3%A9"
    assert env["HTTP_X_TENANT"] == "a,b"  # repeats joined, as a WSGI server joins them
    assert env["CONTENT_TYPE"] == "text/plain" and "HTTP_CONTENT_TYPE" not in env
    assert env["CONTENT_LENGTH"] == "3"
    assert env["HTTP_HOST"] == "testserver"
    assert env["REMOTE_ADDR"] == "10.0.0.1"
    assert env["SERVER_PROTOCOL"] == "HTTP/1.1"
    assert env["asgi.scope"]["path"] == "/a"


def test_only_the_wanted_headers_are_copied():
    to_environ = ScopeEnviron(["HTTP_X_REMOTE_USER", "CONTENT_TYPE", "PATH_INFO",
                               "REQUEST_METHOD"])
    env = to_environ(_scope(headers=[(b"x-remote-user", b"alice"), (b"x-other", b"1"),
                                     (b"content-type", b"a/b"), (b"x-remote-user", b"bob")]))
    headers = {k for k in env if k.startswith("HTTP_") or k.startswith("CONTENT_")}
    assert headers == {"HTTP_X_REMOTE_USER", "CONTENT_TYPE"}
    assert env["HTTP_X_REMOTE_USER"] == "alice,bob"


def test_a_non_ascii_path_is_carried_as_wsgi_does_and_classified_the_same():
    env = ScopeEnviron(None)(_scope(path="/café/ü"))
    assert env["PATH_INFO"] == "/café/ü".encode().decode("latin-1")
    # what a WSGI server puts in PATH_INFO for the same request
    assert env["PATH_INFO"].encode("latin-1").decode("utf-8") == "/café/ü"
    assert env["PATH_INFO"] == ScopeEnviron(None)(_scope(path="/caf\u00e9/\u00fc"))["PATH_INFO"]


def test_a_websocket_handshake_is_a_get_and_a_missing_client_leaves_no_address():
    env = ScopeEnviron(None)(_scope(typ="websocket", client=None))
    assert env["REQUEST_METHOD"] == "GET"
    assert "REMOTE_ADDR" not in env
    minimal = ScopeEnviron([])({"type": "http"})  # a scope with nothing optional
    assert minimal["PATH_INFO"] == "/" and minimal["QUERY_STRING"] == ""


def test_header_names_with_an_underscore_are_dropped_as_gunicorns_wsgi_environ_drops_them():
    """Item 3: a hook's environ (every header) never folds X_Remote_Group into X-Remote-Group;
    the resolver's own keys never took it."""
    headers = [(b"x-remote-group", b"dev"), (b"x_remote_group", b"system:masters"),
               (b"x_api_key", b"k")]
    env = ScopeEnviron(None)(_scope(headers=headers))
    assert env["HTTP_X_REMOTE_GROUP"] == "dev"
    assert "HTTP_X_API_KEY" not in env
    only = ScopeEnviron(["HTTP_X_REMOTE_GROUP", "HTTP_X_API_KEY"])(_scope(headers=headers))
    assert only["HTTP_X_REMOTE_GROUP"] == "dev" and "HTTP_X_API_KEY" not in only


@pytest.mark.parametrize("server", [("/run/apf.sock", None),  # uvicorn
                                    ("/", "r"), ("x",)])       # gunicorn: the path, cut up
def test_a_unix_socket_peer_is_remote_addr_empty_as_under_wsgi(server):
    """Item 2: both servers give a Unix-socket peer no client; REMOTE_ADDR is then "", which
    APF_TRUSTED_PROXIES=unix trusts, as gunicorn's WSGI environ has it."""
    env = ScopeEnviron(None)(_scope(client=None, server=server))
    assert env["REMOTE_ADDR"] == ""
    assert RequestInfoResolver(trusted_proxies=["unix"]).is_trusted(env["REMOTE_ADDR"])
    assert not RequestInfoResolver(trusted_proxies=["127.0.0.1"]).is_trusted(env["REMOTE_ADDR"])
    # a TCP listener, or none said: no address, trusted by nothing
    for tcp in (("127.0.0.1", 8000), ("::1", 8000), None):
        assert "REMOTE_ADDR" not in ScopeEnviron(None)(_scope(client=None, server=tcp))


@pytest.mark.parametrize("root, path, path_info, script_name", [
    ("/api", "/api/x", "/x", "/api"),
    ("/api", "/api", "/", "/api"),
    ("/api", "/api/", "/", "/api"),
    ("/api", "/apiadmin/x", "/apiadmin/x", ""),   # not a segment of the root: routed whole
    ("/api", "/other", "/other", ""),
    ("/api/", "/api/x", "/api/x", ""),            # as Starlette's get_route_path
    ("", "/api/x", "/api/x", ""),
])
def test_the_root_path_is_stripped_at_a_segment_boundary_as_starlette_routes(
        root, path, path_info, script_name):
    """Item 7: PATH_INFO is the path Starlette routes on (``starlette._utils.get_route_path``)."""
    env = ScopeEnviron(None)(_scope(path=path, root_path=root))
    assert (env["PATH_INFO"], env["SCRIPT_NAME"]) == (path_info, script_name)
    from starlette._utils import get_route_path
    assert (get_route_path({"path": path, "root_path": root}) or "/") == path_info


def test_the_apps_own_root_path_wins_over_the_servers():
    """Item 8: FastAPI(root_path=...) puts its root path in the scope over the server's."""
    to_environ = ScopeEnviron(None, "/api")
    assert to_environ(_scope(path="/api/wide"))["PATH_INFO"] == "/wide"
    assert to_environ(_scope(path="/apiwide"))["PATH_INFO"] == "/apiwide"
    assert to_environ(_scope(path="/srv/api/x", root_path="/srv"))["PATH_INFO"] == "/srv/api/x"


def test_scope_environ_classifies_like_a_wsgi_environ():
    resolver = RequestInfoResolver()
    env = ScopeEnviron(resolver.environ_keys)(_scope(path="/api/v1/namespaces/n/pods",
                                                     query=b"watch=true"))
    assert resolver(env).verb == "watch"


# -- AsyncParking -------------------------------------------------------------------------------


class Flag:
    """A ``dispatched(slot, gen)`` the test sets: what the ledger says."""

    def __init__(self):
        self.value = False
        self.asked = 0

    def __call__(self, slot, gen):
        self.asked += 1
        return self.value


def _clock(t=[0]):  # noqa: B006 - a clock that stands still unless a test moves it
    return t[0]


def test_a_grant_from_another_thread_wakes_the_waiter():
    async def main():
        p = AsyncParking()
        ledger = Flag()
        w = p.park(3, 7)
        task = asyncio.ensure_future(p.wait(w, FAR, _clock, ledger))
        assert await _until(lambda: ledger.asked == 1)
        assert p.waiting(FAR) == {3: 7}

        def dispatcher():
            ledger.value = True
            p.grant(3, 7)

        t = threading.Thread(target=dispatcher)
        t.start()
        t.join(10)
        assert await asyncio.wait_for(task, 10) == GRANTED
        assert len(p) == 0 and p.false_wakeups == 0

    _run(main())


def test_a_grant_the_ledger_does_not_confirm_waits_on_and_counts_a_false_wakeup():
    async def main():
        p = AsyncParking()
        ledger = Flag()
        w = p.park(3, 7)
        task = asyncio.ensure_future(p.wait(w, FAR, _clock, ledger))
        assert await _until(lambda: ledger.asked == 1)
        p.grant(3, 8)  # another generation of the slot: nobody's
        p.grant(4, 7)  # another slot: nobody's
        await asyncio.sleep(0)
        assert ledger.asked == 1
        threading.Thread(target=p.grant, args=(3, 7)).start()  # a forged or stale grant
        assert await _until(lambda: p.false_wakeups == 1)
        assert not task.done() and len(p) == 1
        assert p.waiting(FAR) == {3: 7}  # waiting again
        ledger.value = True
        p.grant(3, 7)  # the real one, on the loop thread
        assert await asyncio.wait_for(task, 10) == GRANTED
        assert p.false_wakeups == 1

    _run(main())


def test_a_deadline_already_passed_ends_the_wait_at_once():
    async def main():
        p = AsyncParking()
        w = p.park(1, 1)
        now = [5_000]
        assert await p.wait(w, 4_000, lambda: now[0], Flag()) == 0
        assert len(p) == 0

    _run(main())


def test_a_deadline_that_passes_while_waiting_ends_it():
    """The loop's timer woke the waiter; its clock (injected) says the deadline passed."""
    async def main():
        p = AsyncParking()
        now = [0]
        w = p.park(1, 1)
        task = asyncio.ensure_future(p.wait(w, 1_000, lambda: now[0], Flag()))
        assert await _until(lambda: len(p.waiting(FAR)) == 1)
        now[0] = 2_000
        p.grant(1, 1)  # any wake-up re-reads the clock
        assert await asyncio.wait_for(task, 10) == 0
        assert len(p) == 0

    _run(main())


def test_cancel_wakes_with_cancelled_and_wins_over_an_unconfirmed_grant():
    async def main():
        p = AsyncParking()
        w = p.park(1, 1)
        task = asyncio.ensure_future(p.wait(w, FAR, _clock, Flag()))
        await asyncio.sleep(0)
        p.grant(1, 1)  # a hint, not yet looked at
        p.cancel(w)
        assert await asyncio.wait_for(task, 10) == CANCELLED
        assert len(p) == 0

    _run(main())


def test_stop_all_wakes_every_waiter_and_every_later_one_with_stopping():
    async def main():
        p = AsyncParking()
        ws = [p.park(i, 1) for i in range(3)]
        tasks = [asyncio.ensure_future(p.wait(w, FAR, _clock, Flag())) for w in ws]
        assert await _until(lambda: len(p.waiting(FAR)) == 3)
        n = await asyncio.get_running_loop().run_in_executor(None, p.stop_all)
        assert n == 3
        assert await asyncio.wait_for(asyncio.gather(*tasks), 10) == [STOPPING] * 3
        assert len(p) == 0
        late = p.park(9, 1)
        assert late.outcome == STOPPING and len(p) == 0
        assert await p.wait(late, FAR, _clock, Flag()) == STOPPING

    _run(main())


def test_waiting_lists_only_waiters_parked_before_the_mark_and_not_woken():
    async def main():
        p = AsyncParking()
        a = p.park(1, 1)
        b = p.park(2, 5)
        assert p.waiting(FAR) == {1: 1, 2: 5}
        assert p.waiting(min(a.since_ns, b.since_ns)) == {}  # parked after the mark
        p.cancel(a)
        assert p.waiting(FAR) == {2: 5}  # woken: the dispatcher's backstop leaves it
        p.unpark(a)
        p.unpark(b)
        assert len(p) == 0

    _run(main())


def test_a_task_cancelled_while_waiting_is_unparked():
    async def main():
        p = AsyncParking()
        w = p.park(1, 1)
        ledger = Flag()
        task = asyncio.ensure_future(p.wait(w, FAR, _clock, ledger))
        assert await _until(lambda: ledger.asked == 1)  # awaiting its future
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(p) == 0
        p.grant(1, 1)  # a grant after it left wakes nobody and raises nothing

    _run(main())


# -- ASGIMiddleware on a real ledger ------------------------------------------------------------


class Classifier:
    def classify(self, attrs):
        return NS(flow_schema=SCHEMA, priority_level=LEVEL, distinguisher="", flow_hash=7)


class Clock:
    """The middleware's clock (ns), moved by the test."""

    def __init__(self):
        self.now = 1_000_000_000

    def __call__(self) -> int:
        return self.now


class Bench:
    """A ledger with one level ``lvl`` of ``seats`` seats, and an ASGIMiddleware (worker 0)
    over it; ``hold()`` takes seats as another worker's request would."""

    def __init__(self, app, seats=1, queues=4, wait_limit_ns=30 * 10**9, **kw):
        self.clock = Clock()
        cap = Capacity()
        self.ledger = Ledger.create(bytearray(Ledger.size(cap)), cap)
        self.levels, self.schemas = self.ledger.configure(
            [LevelSpec("lvl", queues, 2 if queues else 0, 10 if queues else 0, seats)], ["fs"],
            self.clock())
        self.parking = AsyncParking()
        led = self.ledger

        def deliver(granted):  # worker 0's grants to its parking; none go elsewhere here
            for slot, gen, owner in granted:
                if owner == 0:
                    self.parking.grant(slot, gen)

        ctx = WorkerContext(
            ledger=led, resolver=RequestInfoResolver(), classifier=Classifier(),
            level_index=self.levels, fs_index=self.schemas, owner=0, parking=self.parking,
            deliver=deliver, add_linger=lambda until, slot, gen: led.release(slot, gen, until),
            queue_wait_limit_ns=wait_limit_ns, alive=lambda: True, max_seats={"lvl": seats},
            clock=self.clock, **kw)
        self.mw = ASGIMiddleware(app, ctx)

    def hold(self):
        """Another worker's request, executing: returns its AdmitResult."""
        r = self.ledger.admit(self.levels["lvl"], 99, 1, 0, 0, 1, self.clock())
        assert r.outcome == EXECUTE
        return r

    def release(self, r):
        granted, _ = self.ledger.finish(r.slot, r.gen, self.clock())
        for slot, gen, owner in granted:
            if owner == 0:
                self.parking.grant(slot, gen)

    def level(self):
        return self.ledger.snapshot(self.clock()).levels[self.levels["lvl"]]

    def seats(self) -> int:
        return self.level().seats_in_use

    def waiting(self) -> int:
        return self.level().requests_waiting


class Conn:
    """One ASGI connection: what the server would hand the app (``receive`` from a queue the
    test fills, ``send`` recorded)."""

    def __init__(self, *messages):
        self.inbox: asyncio.Queue = asyncio.Queue()
        for m in messages or ({"type": "http.request", "body": b"", "more_body": False},):
            self.inbox.put_nowait(m)
        self.sent: list[dict] = []

    async def receive(self):
        return await self.inbox.get()

    async def send(self, message):
        self.sent.append(message)

    def status(self):
        starts = [m for m in self.sent if m["type"] == "http.response.start"]
        return starts[0]["status"] if starts else None

    def headers(self) -> dict:
        start = next(m for m in self.sent if m["type"].endswith("response.start"))
        return {n.decode(): v.decode() for n, v in start["headers"]}

    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"].endswith(".body"))


def _ok_app(seen=None):
    async def app(scope, receive, send):
        if seen is not None:
            seen.append(scope["path"])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


def test_a_served_request_carries_the_pf_uid_headers_and_gives_its_seat_back():
    async def main():
        b = Bench(_ok_app())
        c = Conn()
        await b.mw(_scope(), c.receive, c.send)
        assert c.status() == 200 and c.body() == b"ok"
        h = c.headers()
        assert h["x-kubernetes-pf-flowschema-uid"] == "uid-fs"
        assert h["x-kubernetes-pf-prioritylevel-uid"] == "uid-pl"
        assert h["content-type"] == "text/plain"  # the app's own kept
        assert b.seats() == 0 and b.level().dispatched == 1
        assert b.mw.stats["served"] == 1

    _run(main())


def test_a_full_level_without_queues_answers_429_with_retry_after():
    async def main():
        ran = []
        b = Bench(_ok_app(ran), queues=0)
        b.hold()
        c = Conn()
        await b.mw(_scope(), c.receive, c.send)
        assert c.status() == 429 and c.body() == TOO_MANY and ran == []
        h = c.headers()
        assert h["retry-after"].isdigit() and int(h["retry-after"]) >= 1
        assert h["content-length"] == str(len(TOO_MANY))
        assert h["content-type"].startswith("text/plain")
        assert h["x-kubernetes-pf-flowschema-uid"] == "uid-fs"
        assert h["x-kubernetes-pf-prioritylevel-uid"] == "uid-pl"
        assert b.mw.stats["rejected"] == 1 and b.level().rejected == 1

    _run(main())


def test_repeated_429s_reuse_their_headers_built_once_per_route_and_retry_after(monkeypatch):
    import apf_gunicorn.asgi.middleware as middleware

    built = []
    real = middleware.raw_headers
    monkeypatch.setattr(middleware, "raw_headers", lambda h: built.append(h) or real(h))

    async def main():
        b = Bench(_ok_app(), queues=0)
        b.hold()
        conns = [Conn() for _ in range(3)]
        for c in conns:
            await b.mw(_scope(), c.receive, c.send)
        assert [c.status() for c in conns] == [429] * 3
        assert conns[0].sent == conns[2].sent  # the same answer, Retry-After included
        assert b.mw.stats["rejected"] == 3 and b.level().rejected == 3
        assert len(built) == 1  # the first 429 built them; the others reused them

    _run(main())


def test_a_queued_request_is_granted_by_anothers_finish():
    async def main():
        go = asyncio.Event()
        order = []

        async def app(scope, receive, send):
            order.append(scope["path"])
            if scope["path"] == "/first":
                await go.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        b = Bench(app)
        first, second = Conn(), Conn()
        t1 = asyncio.ensure_future(b.mw(_scope("/first"), first.receive, first.send))
        assert await _until(lambda: order == ["/first"])
        t2 = asyncio.ensure_future(b.mw(_scope("/second"), second.receive, second.send))
        assert await _until(lambda: b.waiting() == 1 and len(b.parking) == 1)
        assert order == ["/first"] and b.mw.stats["queued"] == 1
        go.set()  # the first finishes: its finish dispatches the second, delivered on the loop
        await asyncio.wait_for(asyncio.gather(t1, t2), 10)
        assert order == ["/first", "/second"]
        assert first.status() == 200 and second.status() == 200
        assert b.seats() == 0 and b.waiting() == 0 and b.level().dispatched == 2

    _run(main())


def test_a_grant_from_another_workers_finish_on_another_thread_runs_the_queued_request():
    async def main():
        b = Bench(_ok_app())
        other = b.hold()
        c = Conn()
        task = asyncio.ensure_future(b.mw(_scope(), c.receive, c.send))
        assert await _until(lambda: b.waiting() == 1 and len(b.parking) == 1)
        t = threading.Thread(target=b.release, args=(other,))  # the dispatcher thread's part
        t.start()
        t.join(10)
        await asyncio.wait_for(task, 10)
        assert c.status() == 200 and b.seats() == 0

    _run(main())


def test_a_disconnect_while_queued_frees_the_queue_slot_at_once():
    async def main():
        ran = []
        b = Bench(_ok_app(ran))
        other = b.hold()
        c = Conn()
        task = asyncio.ensure_future(b.mw(_scope(), c.receive, c.send))
        assert await _until(lambda: b.waiting() == 1)
        c.inbox.put_nowait({"type": "http.disconnect"})
        await asyncio.wait_for(task, 10)
        # gone from the queue while the seat is still held elsewhere: cancelled, not dispatched
        lv = b.level()
        assert lv.requests_waiting == 0 and lv.cancelled == 1 and lv.seats_in_use == 1
        assert b.mw.stats["cancelled"] == 1 and ran == [] and len(b.parking) == 0
        assert c.status() == 429  # answered anyway, for the server's bookkeeping
        b.release(other)
        assert b.seats() == 0

    _run(main())


def test_the_body_the_watcher_read_is_replayed_to_the_app():
    async def main():
        got = []

        async def app(scope, receive, send):
            while True:
                m = await receive()
                got.append(m)
                if not m.get("more_body"):
                    break
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body",
                        "body": b"".join(m["body"] for m in got)})

        b = Bench(app)
        other = b.hold()
        c = Conn({"type": "http.request", "body": b"abc", "more_body": True},
                 {"type": "http.request", "body": b"def", "more_body": False})
        task = asyncio.ensure_future(b.mw(_scope(method="POST"), c.receive, c.send))
        assert await _until(lambda: b.waiting() == 1 and c.inbox.empty())  # watcher read both
        b.release(other)
        await asyncio.wait_for(task, 10)
        assert c.status() == 200 and c.body() == b"abcdef"
        assert [m["body"] for m in got] == [b"abc", b"def"]

    _run(main())


def test_a_streamed_response_holds_its_seat_until_the_app_returns():
    async def main():
        go = asyncio.Event()

        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"a", "more_body": True})
            await go.wait()
            await send({"type": "http.response.body", "body": b"b"})

        b = Bench(app)
        c = Conn()
        task = asyncio.ensure_future(b.mw(_scope("/stream"), c.receive, c.send))
        assert await _until(lambda: len(c.sent) == 2)
        assert b.seats() == 1  # streaming: the seat is held
        go.set()
        await asyncio.wait_for(task, 10)
        assert c.body() == b"ab" and b.seats() == 0

    _run(main())


def _long_running_app(go, started):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        started.set()
        await go.wait()
        await send({"type": "http.response.body", "body": b"done"})

    return app


def test_a_watch_gives_its_seat_back_when_its_response_starts():
    async def main():
        go, started = asyncio.Event(), asyncio.Event()
        b = Bench(_long_running_app(go, started))
        c = Conn()
        task = asyncio.ensure_future(
            b.mw(_scope("/api/v1/namespaces/n/pods", query=b"watch=true"), c.receive, c.send))
        await asyncio.wait_for(started.wait(), 10)
        assert b.seats() == 0 and b.level().dispatched == 1  # released, the app still running
        go.set()
        await asyncio.wait_for(task, 10)
        assert c.body() == b"done" and b.seats() == 0
        assert "x-kubernetes-pf-flowschema-uid" in c.headers()

    _run(main())


def test_a_request_declared_long_running_gives_its_seat_back_when_its_response_starts():
    from apf_gunicorn.flowcontrol.workestimate import WorkEstimate

    async def main():
        go, started = asyncio.Event(), asyncio.Event()
        hook_calls = []

        def estimator(environ, attrs, c):
            hook_calls.append(environ["PATH_INFO"])
            return WorkEstimate(1, 0, 0, long_running=True)

        b = Bench(_long_running_app(go, started), work_estimator=estimator)
        c = Conn()
        task = asyncio.ensure_future(b.mw(_scope("/events"), c.receive, c.send))
        await asyncio.wait_for(started.wait(), 10)
        assert hook_calls == ["/events"] and b.seats() == 0
        go.set()
        await asyncio.wait_for(task, 10)
        assert b.seats() == 0

    _run(main())


def test_a_websocket_holds_its_seat_only_until_it_is_accepted():
    async def main():
        go = asyncio.Event()
        seats_before_accept = []

        async def app(scope, receive, send):
            assert (await receive())["type"] == "websocket.connect"
            seats_before_accept.append(b.seats())
            await send({"type": "websocket.accept"})
            await go.wait()
            await send({"type": "websocket.close", "code": 1000})

        b = Bench(app)
        c = Conn({"type": "websocket.connect"})
        task = asyncio.ensure_future(b.mw(_scope(typ="websocket"), c.receive, c.send))
        assert await _until(lambda: c.sent)
        assert seats_before_accept == [1]
        assert c.sent[0]["type"] == "websocket.accept" and b.seats() == 0
        go.set()
        await asyncio.wait_for(task, 10)
        assert b.seats() == 0 and b.level().dispatched == 1

    _run(main())


def test_a_refused_websocket_gets_429_through_the_http_response_extension():
    async def main():
        ran = []
        b = Bench(_ok_app(ran), queues=0)
        b.hold()
        c = Conn({"type": "websocket.connect"})
        await b.mw(_scope(typ="websocket", extensions={"websocket.http.response": {}}),
                   c.receive, c.send)
        assert [m["type"] for m in c.sent] == ["websocket.http.response.start",
                                               "websocket.http.response.body"]
        assert c.sent[0]["status"] == 429 and c.body() == TOO_MANY
        assert "retry-after" in c.headers() and ran == []

    _run(main())


def test_a_refused_websocket_without_the_extension_is_closed_1013():
    async def main():
        b = Bench(_ok_app(), queues=0)
        b.hold()
        c = Conn({"type": "websocket.connect"})
        await b.mw(_scope(typ="websocket"), c.receive, c.send)
        assert c.sent == [{"type": "websocket.close", "code": 1013}]
        assert b.mw.stats["rejected"] == 1

    _run(main())


def test_an_app_exception_gives_the_seats_back():
    async def main():
        async def app(scope, receive, send):
            assert b.seats() == 1
            raise RuntimeError("boom")

        b = Bench(app)
        c = Conn()
        with pytest.raises(RuntimeError, match="boom"):
            await b.mw(_scope(), c.receive, c.send)
        assert b.seats() == 0 and b.waiting() == 0

    _run(main())


def test_an_app_exception_after_the_response_started_gives_the_seats_back():
    async def main():
        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": 200, "headers": []})
            raise RuntimeError("mid-stream")

        b = Bench(app)
        c = Conn()
        with pytest.raises(RuntimeError):
            await b.mw(_scope(), c.receive, c.send)
        assert b.seats() == 0

    _run(main())


def test_lifespan_passes_through_untouched():
    async def main():
        calls = []

        async def app(scope, receive, send):
            calls.append((scope, receive, send))

        b = Bench(app)
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}}
        c = Conn({"type": "lifespan.startup"})
        await b.mw(scope, c.receive, c.send)
        ((s, r, se),) = calls
        assert s is scope and r == c.receive and se == c.send  # not wrapped
        assert b.level().dispatched == 0 and b.mw.stats["served"] == 0

    _run(main())


def test_the_wait_limit_answers_429_as_a_time_out():
    async def main():
        ran = []
        b = Bench(_ok_app(ran), wait_limit_ns=2 * 10**9)
        b.hold()
        c = Conn()
        task = asyncio.ensure_future(b.mw(_scope(), c.receive, c.send))
        assert await _until(lambda: len(b.parking.waiting(FAR)) == 1)
        b.clock.now += 2 * 10**9 + 1  # past the limit; any wake-up re-reads the clock
        ((slot, gen, _),) = b.ledger.owned_slots(0)
        b.parking.grant(slot, gen)
        await asyncio.wait_for(task, 10)
        assert c.status() == 429 and ran == []
        assert b.mw.stats["timeout"] == 1 and b.level().timedout == 1
        assert b.waiting() == 0 and b.parking.false_wakeups == 1

    _run(main())


@pytest.mark.parametrize("query,expired", [(b"timeout=4s", True), (b"", False)])
def test_timeout_in_the_query_shortens_the_wait_limit(query, expired):
    """?timeout=4s waits a quarter of it (1 s); at 1.5 s it has ended, the default has not."""
    async def main():
        ran = []
        b = Bench(_ok_app(ran), wait_limit_ns=30 * 10**9)
        other = b.hold()
        c = Conn()
        task = asyncio.ensure_future(b.mw(_scope(query=query), c.receive, c.send))
        assert await _until(lambda: len(b.parking.waiting(FAR)) == 1)
        b.clock.now += 1_500_000_000
        ((slot, gen, _),) = b.ledger.owned_slots(0)
        b.parking.grant(slot, gen)
        assert await _until(lambda: task.done() or b.parking.false_wakeups == 1)
        if expired:
            await asyncio.wait_for(task, 10)
            assert c.status() == 429 and b.mw.stats["timeout"] == 1
        else:
            assert not task.done() and b.waiting() == 1
            b.release(other)
            await asyncio.wait_for(task, 10)
            assert c.status() == 200 and ran == ["/x"]

    _run(main())


def test_a_queued_request_of_a_stopping_worker_is_answered_503():
    async def main():
        b = Bench(_ok_app())
        b.hold()
        c = Conn()
        task = asyncio.ensure_future(b.mw(_scope(), c.receive, c.send))
        assert await _until(lambda: len(b.parking.waiting(FAR)) == 1)
        b.parking.stop_all()  # the dispatcher's tick once the worker stops
        await asyncio.wait_for(task, 10)
        assert c.status() == 503 and c.body() == STOPPING_BODY
        assert c.headers()["connection"] == "close" and b.waiting() == 0
        assert b.mw.stats["stopping"] == 1

    _run(main())


def test_the_request_task_cancelled_while_queued_leaves_the_ledger():
    """The server cancels the request's task (it closes the connection): the request is unparked
    and taken out of the ledger; the seat it waited for is not taken."""
    async def main():
        b = Bench(_ok_app())
        other = b.hold()
        c = Conn()
        task = asyncio.ensure_future(b.mw(_scope(), c.receive, c.send))
        assert await _until(lambda: b.waiting() == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert b.waiting() == 0 and len(b.parking) == 0 and b.level().cancelled == 1
        b.release(other)
        assert b.seats() == 0

    _run(main())


@pytest.mark.filterwarnings("ignore:The `root_path` parameter is deprecated")
def test_a_fastapi_apps_own_root_path_keeps_its_costs():
    """Item 8 in process: FastAPI(root_path="/api") serves /api/report as /report; the
    middleware admits it with the endpoint's @cost, and /apireport is not /report."""
    fastapi = pytest.importorskip("fastapi")
    from apf_gunicorn.starlette import cost

    app = fastapi.FastAPI(root_path="/api")

    @app.get("/report")
    @cost(seats=3)
    async def report():
        return "r"

    mw = Bench(app, seats=4).mw
    env = mw._to_environ(_scope(path="/api/report"))
    assert env["PATH_INFO"] == "/report" and mw.shape_of(env)[2] == 3
    env = mw._to_environ(_scope(path="/apireport"))
    assert env["PATH_INFO"] == "/apireport" and mw.shape_of(env)[2] == 1


def test_asgi2_apps_are_told_apart_as_uvicorn_tells_them():
    """Item 9: what gunicorn's ASGIWorker warns about at start (it calls every app as ASGI3):
    the apps uvicorn's ``interface="auto"`` serves as ASGI2."""
    from apf_gunicorn.asgi.workers import looks_asgi2
    from tests.apps.asgi2_app import App
    from tests.apps.asgi_app import app as asgi3

    class Three:
        async def __call__(self, scope, receive, send): ...

    def two(scope):
        return App(scope)

    assert looks_asgi2(App) and looks_asgi2(two)
    assert not looks_asgi2(asgi3) and not looks_asgi2(Three())
    assert not looks_asgi2(Bench(asgi3).mw)


def test_admission_that_fails_serves_the_request_without_apf(caplog):
    async def main():
        b = Bench(_ok_app())

        def broken(*a, **k):
            raise RuntimeError("ledger gone")

        b.mw._admit = broken
        c = Conn()
        await b.mw(_scope(), c.receive, c.send)
        assert c.status() == 200 and b.mw.stats["bypassed"] == 1

    _run(main())
    assert "admission failed" in caplog.text

