"""A queued ASGI request's ``receive()`` channel and its cancellation (issue 32 items 4-6).

* Items 4 and 5 on real servers, both ASGI workers (``tests/apps/receive_app.py``, the ``work``
  level at one seat): a request that waited in the queue behind a held seat reaches Django and
  Starlette with its whole body and no false ``http.disconnect``; then, in process, the race
  where gunicorn's body receiver swallows a cancellation (``asyncio.wait_for``, Python 3.11)
  driven on gunicorn's own ``BodyReceiver``.
* Item 6 on a real ledger in POSIX shared memory whose real lock another thread holds: a
  request's task cancelled while its ledger call runs on the pool thread leaves no seat held
  and nobody queued.

Every wait is for a condition (the ledger, the file the holder waits for), never for a time.
"""

from __future__ import annotations

import asyncio
import http.client
import socket
import threading
import time
from types import SimpleNamespace as NS

import pytest

from tests.test_asgi_lock_bound import _middleware
from tests.test_asgi_server import WORKERS, serve_asgi
from tests.test_asgi_units import Bench, _scope, _until

pytest.importorskip("django")
pytest.importorskip("starlette")

RECEIVE_APP = "tests.apps.receive_app:app"


@pytest.fixture(params=WORKERS, ids=["uvicorn", "gunicorn-asgi"])
def receive_server(request, tmp_path):
    """``with receive_server() as srv``: the receive app on this run's worker class, one
    worker, the ``work`` level at one seat (``APF_CONCURRENCY_LIMIT=2``)."""
    if request.param.endswith("UvicornWorker"):
        pytest.importorskip("uvicorn_worker")
    return lambda: serve_asgi(tmp_path, request.param, env={"APF_CONCURRENCY_LIMIT": "2"},
                              workers=1, app=RECEIVE_APP)


def _send(port: int, head: str, body: bytes = b"") -> socket.socket:
    """A request on a raw connection (``Connection: close``), its answer read later."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(head.encode() + b"\r\n" + body)
    return s


def _post(port: int, path: str, user: str, body: bytes, length: int | None = None):
    length = len(body) if length is None else length
    return _send(port, f"POST {path} HTTP/1.1\r\nHost: x\r\nX-Remote-User: {user}\r\n"
                       f"Content-Length: {length}\r\nConnection: close\r\n", body)


def _get(port: int, path: str, user: str):
    return _send(port, f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Remote-User: {user}\r\n"
                       f"Connection: close\r\n")


def _answer(s: socket.socket) -> tuple[int, bytes]:
    s.settimeout(60)
    resp = http.client.HTTPResponse(s)
    try:
        resp.begin()
        return resp.status, resp.read()
    finally:
        s.close()


def _held(srv, tmp_path, name: str):
    """A request holding the ``work`` level's one seat until the returned file is made."""
    release = tmp_path / f"release-{name}"
    holder = _get(srv.port, f"/work/hold?until={release}", f"holder-{name}")
    assert srv.wait_for(lambda: srv.level("work").seats_in_use == 1, timeout=60), srv.log()
    return holder, release


@pytest.mark.server
@pytest.mark.slow
def test_a_queued_request_reads_its_whole_body_and_no_false_disconnect(receive_server,
                                                                       tmp_path):
    """Items 4 and 5: three requests wait behind the held seat with their bodies sent; a
    fourth sends half its body while queued and the rest once it runs. Django answers 200 with
    the body (not 500: its disconnect listener saw no ``http.disconnect``), Starlette's
    ``is_disconnected()`` stays false and its event stream runs to its end."""
    with receive_server() as srv:
        holder, release = _held(srv, tmp_path, "a")
        queued = [_post(srv.port, "/work/django/echo", "d", b"helloworld"),
                  _post(srv.port, "/work/starlette/echo", "s", b"hello"),
                  _get(srv.port, "/work/starlette/events?n=3", "e")]
        assert srv.wait_for(lambda: srv.level("work").requests_waiting == 3, timeout=60)
        release.touch()
        assert _answer(holder) == (200, b"held")
        answers = [_answer(s) for s in queued]
        print(answers)
        assert answers[0] == (200, b"helloworld"), answers[0]
        assert answers[1] == (200, b"hello connected=True"), answers[1]
        assert answers[2] == (200, b"data: 0\n\ndata: 1\n\ndata: 2\n\n"), answers[2]

        # the body split: half while queued (the watcher reads it), half once it runs
        holder, release = _held(srv, tmp_path, "b")
        split = _post(srv.port, "/work/django/echo", "p", b"hello", length=10)
        assert srv.wait_for(lambda: srv.level("work").requests_waiting == 1, timeout=60)
        release.touch()
        assert _answer(holder) == (200, b"held")
        assert srv.wait_for(lambda: srv.level("work").requests_waiting == 0, timeout=60)
        split.sendall(b"world")
        assert _answer(split) == (200, b"helloworld")
        assert srv.idle() is not None


# -- item 5: the cancel gunicorn's body receiver swallows ----------------------------------------


def _gunicorn_receiver(length: int):
    """gunicorn's own ``BodyReceiver`` of a request with a ``length``-byte body, on a stand-in
    for its protocol (what the receiver reads of it)."""
    protocol_mod = pytest.importorskip("gunicorn.asgi.protocol")
    request = NS(content_length=length, chunked=False, _expect_100_continue=False)
    protocol = NS(_closed=False, cfg=NS(timeout=30), _maybe_resume_reading=lambda: None,
                  _safe_write=lambda data: None)
    return protocol_mod.BodyReceiver(request, protocol)


@pytest.mark.parametrize("turns", [0, 3])
def test_a_chunk_arriving_with_the_grant_is_not_lost(turns):
    """The first body chunk arrives in the same turn of the loop as the grant: gunicorn's
    receive() (``asyncio.wait_for``, Python 3.11) would swallow a cancel of the watcher's read
    and keep the chunk; the app, reading at once or after ``turns`` turns of the loop of its
    own (a framework's awaits before it reads the body), gets the whole body, in order."""
    async def main():
        got = []

        async def app(scope, receive, send):
            for _ in range(turns):
                await asyncio.sleep(0)
            while True:
                m = await receive()
                got.append(m)
                if m["type"] != "http.request" or not m.get("more_body"):
                    break
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        b = Bench(app)
        other = b.hold()
        receiver = _gunicorn_receiver(10)
        sent = []

        async def send(message):
            sent.append(message)

        task = asyncio.ensure_future(b.mw(_scope(method="POST"), receiver.receive, send))
        # queued, its watcher's read in flight
        assert await _until(lambda: b.waiting() == 1 and receiver._waiter is not None)
        receiver.feed(b"hello")  # the chunk and the grant, in one turn of the loop
        b.release(other)
        assert await _until(lambda: got or receiver._waiter is not None)
        receiver.feed(b"world")
        receiver.set_complete()
        await asyncio.wait_for(task, 10)
        assert [m.get("body") for m in got] == [b"hello", b"world"], got
        assert sent[0]["status"] == 200 and b.seats() == 0

    asyncio.run(main())


def test_the_watchers_read_in_flight_ends_with_the_app():
    """A queued GET: the watcher has read its empty body and waits for a disconnect (gunicorn
    ends that read only when the connection closes). The app does not read; once it returns,
    the read is cancelled: no task is left behind on a kept-alive connection."""
    async def main():
        b = Bench(lambda scope, receive, send: _answer_ok(send))
        other = b.hold()
        receiver = _gunicorn_receiver(0)
        sent = []

        async def send(message):
            sent.append(message)

        task = asyncio.ensure_future(b.mw(_scope(), receiver.receive, send))
        assert await _until(lambda: b.waiting() == 1 and receiver._waiter is not None)
        b.release(other)
        await asyncio.wait_for(task, 10)
        assert sent[0]["status"] == 200 and b.seats() == 0
        assert await _until(lambda: asyncio.all_tasks() == {asyncio.current_task()})

    asyncio.run(main())


async def _answer_ok(send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})


# -- item 6: a task cancelled while its ledger call runs on the pool -----------------------------


def _lock_holder(led):
    """A thread holding ``led``'s lock until the returned event is set."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        led._lock.acquire()
        held.set()
        release.wait(30)
        led._lock.release()

    t = threading.Thread(target=hold)
    t.start()
    assert held.wait(10)
    return t, release


def _entered_off_loop(mw, name: str) -> threading.Event:
    """An event set when ``mw.<name>`` is called off the loop (on the pool thread)."""
    entered = threading.Event()
    loop_thread = threading.get_ident()
    real = getattr(mw, name)

    def spy(*args):
        if threading.get_ident() != loop_thread:
            entered.set()
        return real(*args)

    setattr(mw, name, spy)
    return entered


def _settled(led, lv: int, timeout: float = 10.0):
    """The level's snapshot once it holds no seat and queues nobody (the pool's undo has run),
    else its last snapshot after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        level = led.snapshot(time.monotonic_ns()).levels[lv]
        if (level.seats_in_use == 0 and level.requests_waiting == 0) or (
                time.monotonic() > deadline):
            return level
        time.sleep(0.01)


async def _never_receive():
    await asyncio.sleep(3600)


async def _noop_send(message):
    pass


@pytest.mark.parametrize("full", [False, True], ids=["admitted", "queued"])
def test_a_task_cancelled_during_an_off_loop_admit_leaves_nothing_held(shm_ledger, full):
    """admit ran on the pool (another holder kept the lock) and the task was cancelled
    meanwhile: the pool's admit still happened, and is undone (its seat given back, or its
    queued request taken out)."""
    led, _ = shm_ledger
    mw, _ = _middleware(lambda scope, receive, send: _noop_send(None), led)
    lv = mw.ctx.level_index["lvl"]
    other = led.admit(lv, 99, 4, 0, 0, 1, time.monotonic_ns()) if full else None

    async def main():
        led.never_wait_on(threading.get_ident())
        entered = _entered_off_loop(mw, "_admit")
        t, release = _lock_holder(led)
        try:
            request = asyncio.ensure_future(mw(_scope(), _never_receive, _noop_send))
            loop = asyncio.get_running_loop()
            assert await loop.run_in_executor(None, entered.wait, 10)
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
        finally:
            release.set()
            t.join(10)
            led.never_wait_on(0)

    asyncio.run(main())
    if other is not None:
        level = led.snapshot(time.monotonic_ns()).levels[lv]
        assert level.seats_in_use == 4
        # its ghost, if left queued, would be dispatched here and hold a seat for nobody
        led.finish(other.slot, other.gen, time.monotonic_ns())
    level = _settled(led, lv)
    assert level.seats_in_use == 0 and level.requests_waiting == 0, level


def test_a_task_cancelled_during_an_off_loop_after_wait_leaves_nothing_held(shm_ledger):
    """A queued request's wait ended (the worker stopping) after the ledger had dispatched
    it; after_wait ran on the pool and says RUN, but the task was cancelled meanwhile: the
    seats it was given go back."""
    led, _ = shm_ledger
    mw, _ = _middleware(lambda scope, receive, send: _noop_send(None), led)
    lv = mw.ctx.level_index["lvl"]
    other = led.admit(lv, 99, 4, 0, 0, 1, time.monotonic_ns())

    async def main():
        led.never_wait_on(threading.get_ident())
        entered = _entered_off_loop(mw, "after_wait")
        request = asyncio.ensure_future(mw(_scope(), _never_receive, _noop_send))
        assert await _until(lambda: len(mw._parking) == 1)
        loop = asyncio.get_running_loop()
        # the seats freed elsewhere dispatch it in the ledger; the grant is not delivered
        await loop.run_in_executor(None, led.finish, other.slot, other.gen,
                                   time.monotonic_ns())
        t, release = _lock_holder(led)
        try:
            mw._parking.stop_all()  # its wait ends STOPPING: after_wait's cancel meets the lock
            assert await loop.run_in_executor(None, entered.wait, 10)
            request.cancel()
            with pytest.raises(asyncio.CancelledError):
                await request
        finally:
            release.set()
            t.join(10)
            led.never_wait_on(0)

    asyncio.run(main())
    level = _settled(led, lv)
    assert level.seats_in_use == 0 and level.requests_waiting == 0, level
