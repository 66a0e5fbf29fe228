"""The request thread's side of grants, in process: a wake-up runs a request only when the ledger
says it was dispatched; a response's finalizer never takes the ledger lock; a grant that cannot
be sent neither escapes as a 500 nor leaks seats; an HTTP/2 stream's wait limit counts from the
stream, not from its connection."""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace as NS

from werkzeug.test import EnvironBuilder

from apf_gunicorn.admission.channel import GrantInbox, GrantSender
from apf_gunicorn.admission.dispatcher import Dispatcher, Parking
from apf_gunicorn.flowcontrol.requestinfo import RequestInfoResolver
from apf_gunicorn.gthread.wsgi import APFMiddleware, WorkerContext
from apf_gunicorn.ledger.ledger import Capacity, Ledger, LevelSpec
from apf_gunicorn.ledger.records import EXECUTE, AdmitResult

LEVEL = NS(name="lvl", uid="uid-pl", is_exempt=False)
SCHEMA = NS(name="fs", uid="uid-fs")


class Classifier:
    def classify(self, attrs):
        return NS(flow_schema=SCHEMA, priority_level=LEVEL, distinguisher="", flow_hash=7)


class ReentryCheckingLock:
    """A non-reentrant ledger lock that raises, instead of deadlocking, when the thread holding
    it asks for it again (what a finalizer inside a ledger call did)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._holder = None
        self.reentries = 0

    def bind(self, buf, words, create):
        pass

    def acquire(self):
        if self._holder == threading.get_ident():
            self.reentries += 1
            raise RuntimeError("the ledger lock asked for by its holder: a deadlock")
        self._lock.acquire()
        self._holder = threading.get_ident()
        return None

    def consistent(self):
        pass

    def release(self):
        self._holder = None
        self._lock.release()


def _ledger(seats: int, lock=None):
    cap = Capacity()
    led = Ledger.create(bytearray(Ledger.size(cap)), cap, lock=lock)
    levels, schemas = led.configure([LevelSpec("lvl", 4, 2, 10, seats)], ["fs"],
                                    time.monotonic_ns())
    return led, levels, schemas


def _middleware(app, led, levels, schemas, parking, **kw) -> APFMiddleware:
    kw.setdefault("deliver", lambda granted: [parking.grant(s, g) for s, g, o in granted
                                              if o == 0])
    ctx = WorkerContext(
        ledger=led, resolver=RequestInfoResolver(), classifier=Classifier(),
        level_index=levels, fs_index=schemas, owner=0, parking=parking,
        add_linger=lambda until, slot, gen: led.release(slot, gen, until),
        queue_wait_limit_ns=30 * 10**9, alive=lambda: True, max_seats={"lvl": 1}, **kw)
    return APFMiddleware(app, ctx)


def _call(mw, path="/x"):
    seen = {}

    def start_response(status, headers, exc_info=None):
        seen["status"] = int(status.split()[0])

    environ = EnvironBuilder(path=path).get_environ()
    environ["REMOTE_ADDR"] = "10.0.0.1"
    body = mw(environ, start_response)
    return seen.get("status"), body


def _wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    return predicate()


def _executing(led) -> int:
    return sum(lv.requests_executing + lv.requests_waiting
               for lv in led.snapshot(time.monotonic_ns()).levels)


def test_a_forged_grant_does_not_run_a_waiting_request():
    """Forged [slot, gen] datagrams woke parked requests, which ran beyond the level's seats;
    their ledger slots stayed waiting, and executing once dispatched, for good."""
    led, levels, schemas = _ledger(seats=1)
    parking = Parking()
    ran = []

    def app(environ, start_response):
        ran.append(led.snapshot(time.monotonic_ns()).levels[0].seats_in_use)
        start_response("200 OK", [])
        return [b"ok"]

    mw = _middleware(app, led, levels, schemas, parking)
    other = led.admit(levels["lvl"], 99, 1, 0, 0, 1, time.monotonic_ns())  # worker 1's request
    assert other.outcome == EXECUTE
    answers = []
    t = threading.Thread(target=lambda: answers.append(_call(mw)))
    t.start()
    try:
        assert _wait_for(lambda: len(parking) == 1), "the request never parked"
        ((slot, gen, state),) = led.owned_slots(0)
        assert state == "waiting"
        parking.grant(slot, gen)  # what a forged datagram does
        assert _wait_for(lambda: ran or getattr(parking, "false_wakeups", 0) >= 1)
        assert ran == [], "a forged grant ran the request beyond the level's seat"
        granted, _ = led.finish(other.slot, other.gen, time.monotonic_ns())  # the real one
        assert [(s, g) for s, g, _ in granted] == [(slot, gen)]
        parking.grant(slot, gen)
        t.join(10)
        ((status, body),) = answers
        assert status == 200 and ran == [1]
        body.close()
        assert _executing(led) == 0
    finally:
        parking.stop_all()
        t.join(10)


def test_a_response_finalizer_never_takes_the_ledger_lock():
    """``_Body.__del__`` finished the request in the ledger: run on a thread already inside a
    ledger call (the lock is not reentrant), it deadlocked that thread, and every worker with
    it."""
    lock = ReentryCheckingLock()
    led, levels, schemas = _ledger(seats=4, lock=lock)
    parking = Parking()
    token = f"fin{os.getpid()}"
    inbox = GrantInbox(token, 0)
    d = Dispatcher(parking, inbox, led, owner=0, deliver=lambda granted: None,
                   alive=lambda: True)
    d.start()

    def app(environ, start_response):
        start_response("200 OK", [])
        return iter([b"ok"])

    mw = _middleware(app, led, levels, schemas, parking)
    mw.ctx.finish_later = getattr(d, "finish_later", None)
    try:
        status, body = _call(mw)
        assert status == 200 and _executing(led) == 1
        bodies = [body]
        del body

        def inside_a_ledger_call():
            lock.acquire()
            try:
                bodies.pop()  # the last reference: the finalizer runs here, lock held
            finally:
                lock.release()

        t = threading.Thread(target=inside_a_ledger_call)
        t.start()
        t.join(10)
        assert lock.reentries == 0, "the finalizer took the ledger lock its thread held"
        assert _wait_for(lambda: _executing(led) == 0), "the seat was never given back"
    finally:
        d.stop()
        d.join(2)
        inbox.close()


def test_a_grant_that_cannot_be_sent_is_no_500_and_no_leak(caplog):
    """An admission that dispatched another worker's request, whose datagram failed with EPERM:
    the error escaped as a 500 and the admitted request never finished (its seat leaked)."""
    from apf_gunicorn.admission.boot import _deliverer

    class Refusing:
        def sendto(self, data, addr):
            raise PermissionError(1, "Operation not permitted")

        def close(self):
            pass

    class OneLedger:
        """admit: run now, having dispatched worker 5's request; finish recorded."""

        def __init__(self):
            self.finished = []

        def admit(self, *args):
            return AdmitResult(EXECUTE, 3, 1, "", [(9, 1, 5)])

        def finish(self, slot, gen, now):
            self.finished.append((slot, gen))
            return [], 0

        def rejected_total(self, level):
            return 0

        def dispatched(self, slot, gen):
            return False

    sender = GrantSender(f"eperm{os.getpid()}", lambda owner: 1)
    sender.sock.close()
    sender.sock = Refusing()
    parking = Parking()
    led = OneLedger()

    def app(environ, start_response):
        start_response("200 OK", [])
        return [b"ok"]

    mw = _middleware(app, led, {"lvl": 0}, {"fs": 0}, parking,
                     deliver=_deliverer(parking, sender, 0))
    status, body = _call(mw)
    assert status == 200
    b"".join(body)
    body.close()
    assert led.finished == [(3, 1)]
    assert sender.dropped == 1
    assert "could not be sent" in caplog.text


def test_an_http2_stream_waits_from_its_own_arrival_not_its_connections(monkeypatch):
    """Every stream of an HTTP/2 connection got the connection's queue stamp as its arrival, so
    on a connection older than the wait limit a stream that had to wait was answered 429 at
    once."""
    from gunicorn.workers.gthread import ThreadWorker

    from apf_gunicorn.gthread import wsgi as middleware
    from apf_gunicorn.gthread.worker import ApfThreadWorker

    arrivals = []

    def streams(self, conn):  # gthread's handle_http2: its streams, one after another
        for req in (1, 2):
            self.handle_http2_request(req, conn, None)
        return False

    monkeypatch.setattr(ThreadWorker, "handle", streams)
    monkeypatch.setattr(ThreadWorker, "handle_http2_request",
                        lambda self, req, conn, h2: arrivals.append(middleware.hidden.enqueued_ns))
    worker = object.__new__(ApfThreadWorker)
    worker.apf_handled = worker.apf_hidden_wait_sum_ns = worker.apf_hidden_wait_max_ns = 0
    worker.apf_inflight = []
    queued = time.monotonic_ns() - 20 * 10**9  # the connection came 20 s ago
    conn = NS(apf_enqueued_ns=queued)
    worker.handle(conn)
    first, second = arrivals
    assert first == queued  # the first stream did wait in gthread's queue with its connection
    # 0: the middleware takes the stream's own admission time
    assert second == 0, f"stream 2 arrived {(time.monotonic_ns() - second) / 1e9:.0f} s ago"
