"""The event loop never waits for the ledger lock: while another holder keeps it, a request's
admit runs on a thread and the loop goes on serving (issue 28: a blocked loop is fatal, the
arbiter kills the worker as timed out). Real POSIX shared memory and the real ProcessLock."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace as NS

import pytest

from apf_gunicorn.admission.asyncparking import AsyncParking
from apf_gunicorn.admission.core import WorkerContext
from apf_gunicorn.asgi.middleware import ASGIMiddleware
from apf_gunicorn.flowcontrol.requestinfo import RequestInfoResolver
from apf_gunicorn.ledger import LevelSpec
from apf_gunicorn.ledger.lock import LockBusy

LEVEL = NS(name="lvl", uid="uid-pl", is_exempt=False)
SCHEMA = NS(name="fs", uid="uid-fs")


class Classifier:
    def classify(self, attrs):
        return NS(flow_schema=SCHEMA, priority_level=LEVEL, distinguisher="", flow_hash=7)


def _middleware(app, led):
    levels, schemas = led.configure([LevelSpec("lvl", 4, 2, 10, 4)], ["fs"],
                                    time.monotonic_ns())
    parking = AsyncParking()
    finished_later = []
    ctx = WorkerContext(
        ledger=led, resolver=RequestInfoResolver(), classifier=Classifier(),
        level_index=levels, fs_index=schemas, owner=0, parking=parking,
        deliver=lambda granted: parking.grant_many((s, g) for s, g, _ in granted),
        add_linger=lambda until, slot, gen: None, queue_wait_limit_ns=10**10,
        alive=lambda: True, max_seats={"lvl": 4},
        finish_later=lambda slot, gen: finished_later.append((slot, gen)))
    return ASGIMiddleware(app, ctx), finished_later


async def _hello(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hi"})


def _scope():
    return {"type": "http", "method": "GET", "path": "/x", "query_string": b"",
            "headers": [], "client": ("127.0.0.1", 5000), "http_version": "1.1"}


def test_a_busy_ledger_lock_never_blocks_the_loop(shm_ledger) -> None:
    led, _ = shm_ledger
    mw, _ = _middleware(_hello, led)
    held, release = threading.Event(), threading.Event()

    def holder() -> None:  # another holder keeps the lock until told
        led._lock.acquire()
        held.set()
        release.wait(30)
        led._lock.release()

    async def main() -> tuple[list, int]:
        led.never_wait_on(threading.get_ident())
        sent: list = []

        async def send(message):
            sent.append(message)

        async def receive():
            await asyncio.sleep(3600)

        t = threading.Thread(target=holder)
        t.start()
        assert held.wait(10)
        request = asyncio.ensure_future(mw(_scope(), receive, send))
        ticks = 0
        # the loop keeps running while the request's admit waits for the lock on a thread
        while ticks < 50 and not request.done():
            await asyncio.sleep(0)
            ticks += 1
        assert not request.done()  # still waiting for the lock, off the loop
        release.set()
        await asyncio.wait_for(request, 30)
        t.join(10)
        return sent, ticks

    sent, ticks = asyncio.run(main())
    assert ticks == 50
    assert sent[0]["status"] == 200
    assert led.snapshot(time.monotonic_ns()).levels[0].seats_in_use == 0  # finished


def test_lock_busy_is_raised_only_on_the_marked_thread(shm_ledger) -> None:
    led, _ = shm_ledger
    levels, _ = led.configure([LevelSpec("lvl", 4, 2, 10, 4)], ["fs"], 0)
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        led._lock.acquire()
        held.set()
        release.wait(30)
        led._lock.release()

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(10)
    led.never_wait_on(threading.get_ident())
    try:
        with pytest.raises(LockBusy):
            led.admit(levels["lvl"], 1, 1, 0, 0, 0, 1)
        # nothing was done: the level holds no request
        release.set()
        t.join(10)
        assert led.snapshot(2).levels[0].seats_in_use == 0
        led.admit(levels["lvl"], 1, 1, 0, 0, 0, 3)  # free again: no LockBusy
    finally:
        release.set()
        led.never_wait_on(0)

