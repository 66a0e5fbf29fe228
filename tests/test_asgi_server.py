"""Real gunicorn servers with both ASGI workers (issue 28 item 8): ``-c python:apf_gunicorn.conf
-k apf_gunicorn.asgi.UvicornWorker`` and ``-k apf_gunicorn.asgi.ASGIWorker``, 2 workers,
serving ``tests/apps/asgi_app.py`` on 127.0.0.1, with ``tests/apps/apf.yaml`` (levels ``work``
and ``other`` of 8 seats each at limit 16; ``/healthz`` exempt) unless a test says otherwise.

Every test waits for conditions (the server's ledger, read from its shared memory; the app's
cross-process counters; the log), never for a time.
"""

from __future__ import annotations

import http.client
import importlib.util
import os
import re
import shutil
import signal
import socket
import threading
import time
import uuid
from urllib.parse import quote

import pytest

from apf_gunicorn.flowcontrol.objects import KIND_FLOW_SCHEMA, derived_uid
from tests.apps.loadgen import Client
from tests.conftest import APPS, Server, free_port, serve
from tests.promtool import check_metrics
from tests.test_server_crash import _Pinned
from tests.test_server_reload import EXTRA  # the same extra level and FlowSchema

pytestmark = [pytest.mark.server, pytest.mark.slow]

WORKERS = ["apf_gunicorn.asgi.UvicornWorker", "apf_gunicorn.asgi.ASGIWorker"]
WORK_SEATS = 8  # the "work" level's seats at APF_CONCURRENCY_LIMIT=16 (tests/apps/apf.yaml)


def serve_asgi(tmp_path, worker: str, *, conf: str = "python:apf_gunicorn.conf",
               boot_timeout: float = 60.0, **kw):
    """``gunicorn -c CONF -k WORKER tests.apps.asgi_app:app``: ``tests/conftest.py``'s
    ``serve`` (its other keywords: ``env``, ``config``, ``workers``, ``app``, ``args``) with
    the gunicorn config ``conf`` given by name and a longer boot."""
    return serve(tmp_path, worker=worker, conf=("-c", conf), boot_timeout=boot_timeout, **kw)


@pytest.fixture(params=WORKERS, ids=["uvicorn", "gunicorn-asgi"])
def asgi_worker(request) -> str:
    """The worker class of this run (``-k``)."""
    if request.param.endswith("UvicornWorker"):
        pytest.importorskip("uvicorn_worker")
    return request.param


@pytest.fixture
def asgi(asgi_worker, tmp_path):
    """``with asgi(env=..., config=...) as srv:`` a server on the parametrized worker class."""
    return lambda **kw: serve_asgi(tmp_path, asgi_worker, **kw)


@pytest.fixture
def asgi_one(tmp_path):
    """Like ``asgi``, on one worker class only (uvicorn-worker's when installed): for cases
    whose path is the same middleware code under both workers (each server costs seconds of
    the suite); issue 28's list of real-server cases runs on both."""
    worker = WORKERS[0] if importlib.util.find_spec("uvicorn_worker") else WORKERS[1]
    return lambda **kw: serve_asgi(tmp_path, worker, **kw)


def _start(clients):
    for c in clients:
        c.start()
    return clients


def _finish(clients, stop_event=None, timeout=60.0):
    if stop_event is not None:
        stop_event.set()
    deadline = time.monotonic() + timeout
    for c in clients:
        c.join(max(0.1, deadline - time.monotonic()))
    assert not [c for c in clients if c.is_alive()], "a client never finished"


def _statuses(clients) -> list[int]:
    return [s for c in clients for s in c.statuses]


def _queue(srv: Server, n: int, path: str = "/work?ms=1", user: str = "q") -> list[socket.socket]:
    """``n`` requests on raw connections (to be queued), each its own user (flow)."""
    socks = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Remote-User: {user}{i}\r\n\r\n".encode())
        socks.append(s)
    return socks


def _hold(srv: Server, n: int, ms: int, user: str = "h") -> list[Client]:
    """``n`` requests of ``ms`` each on the ``work`` level, started; returns once they hold
    ``n`` seats."""
    hold = _start([Client(srv.port, f"/work?ms={ms}", user=f"{user}{i}", count=1,
                          timeout=60) for i in range(n)])
    assert srv.wait_for(lambda: srv.level("work").seats_in_use == n, timeout=60), (
        f"{n} requests never held their seats:\n{srv.log()}")
    return hold


def test_the_limit_holds_across_workers_under_a_flood(asgi):
    """24 connections flood the 8-seat level from both workers: the app never sees more than 8
    at once, and does see 8 (the seats are used)."""
    with asgi() as srv:
        clients = _start([Client(srv.port, "/work?ms=30", user=f"f{i}", count=15, timeout=60)
                          for i in range(24)])
        _finish(clients, timeout=120)
        statuses = _statuses(clients)
        now, top = srv.counters()["work"]
        print(f"{len(statuses)} answers: {statuses.count(200)} x 200, "
              f"{statuses.count(429)} x 429; most executing at once: {top}")
        assert not [e for c in clients for e in c.errors]
        assert set(statuses) <= {200, 429} and statuses.count(200) > 0
        assert now == 0 and top == WORK_SEATS, top
        assert srv.idle() is not None


def test_a_light_flow_is_served_beside_a_heavy_one(asgi):
    """One user floods the level with 16 connections; another user's requests, one at a time,
    are all served, and wait less than the flood's (fair queuing: her own queue)."""
    with asgi() as srv:
        stop_event = threading.Event()
        heavy = _start([Client(srv.port, "/work?ms=50", user="heavy", stop=stop_event,
                               timeout=60) for _ in range(16)])
        try:
            assert srv.wait_for(lambda: srv.level("work").requests_waiting > 0, timeout=60)
            light = Client(srv.port, "/work?ms=50", user="light", count=20, timeout=60)
            light.start()
            light.join(120)
            assert not light.is_alive()
        finally:
            _finish(heavy, stop_event)
        lat = sorted(light.latencies)
        hv = sorted(x for c in heavy for s, x in zip(c.statuses, c.latencies, strict=True)
                    if s == 200)
        print(f"light: {len(lat)} answers {sorted(set(light.statuses))}, median "
              f"{lat[len(lat) // 2] * 1000:.0f} ms; heavy: {len(hv)} served, median "
              f"{hv[len(hv) // 2] * 1000:.0f} ms, 429s {_statuses(heavy).count(429)}")
        assert light.statuses == [200] * 20 and not light.errors
        assert lat[len(lat) // 2] < hv[len(hv) // 2]


def test_exempt_probes_never_wait_while_the_level_is_full(asgi):
    """The built-in configuration (APF_CONFIG unset): every seat of ``anonymous`` held and its
    queues full, GET /healthz, /readyz and /livez are still answered 200, through the exempt
    level, with nothing of it ever waiting; the held seats stay held meanwhile."""
    with asgi(config="") as srv:
        names = [lv.name for lv in srv.ledger_snapshot().levels]
        assert "anonymous" in names and "exempt" in names, names
        limit = srv.level("anonymous").concurrency_limit
        stop_event = threading.Event()
        # one client address, one flow: its 3 queues of 2 fill, the rest is answered 429
        hold = _start([Client(srv.port, "/x?ms=3000", stop=stop_event, timeout=60)
                       for _ in range(limit + 8)])
        try:
            full = srv.wait_for(lambda: (lv := srv.level("anonymous")).seats_in_use == limit
                                and lv.requests_waiting > 0 and lv, timeout=60)
            assert full, f"the level never filled:\n{srv.log()}"
            before = srv.level("exempt").dispatched
            for path in ("/healthz", "/readyz", "/livez") * 5:
                status, headers, body = srv.request(path)
                assert (status, body) == (200, b"ok"), (path, status)
            lv = srv.level("anonymous")
            ex = srv.level("exempt")
            assert lv.seats_in_use == limit  # not served by seats freed meanwhile
            assert ex.dispatched - before == 15
            assert ex.requests_waiting == 0 and ex.rejected == 0 and ex.timedout == 0
        finally:
            _finish(hold, stop_event)


def _owned(srv: Server) -> dict[int, int]:
    """{worker pid: slots its requests hold} from the ledger."""
    with srv.attached_ledger() as led:
        return {pid: len(led.owned_slots(index)) for index, pid, _, _ in led.workers()
                if pid in srv.workers()}


def test_a_killed_workers_seats_come_back(asgi):
    """SIGKILL the worker whose requests hold seats: its seats are reclaimed, and once the
    survivors' requests end, all 8 seats run requests at once again."""
    with asgi() as srv:
        hold = _hold(srv, WORK_SEATS, ms=6000)
        owned = srv.wait_for(lambda: (o := _owned(srv)) and sum(o.values()) == WORK_SEATS
                             and o, timeout=30)
        assert owned, _owned(srv)
        victim = max(owned, key=owned.get)
        os.kill(victim, signal.SIGKILL)
        assert srv.wait_for(lambda: srv.level("work").seats_in_use
                            <= WORK_SEATS - owned[victim], timeout=60), (
            f"the killed worker's {owned[victim]} seats never came back:\n{srv.log()}")
        _finish(hold, timeout=90)
        assert srv.wait_for(lambda: len(srv.workers()) == 2, timeout=60)
        assert srv.idle(timeout=60) is not None
        srv.reset_counters()
        full = _start([Client(srv.port, "/work?ms=2000", user=f"a{i}", count=1, timeout=60)
                       for i in range(WORK_SEATS)])
        assert srv.wait_for(lambda: srv.counters()["work"][0] == WORK_SEATS, timeout=60), (
            srv.counters())
        lv = srv.level("work")
        assert lv.seats_in_use == WORK_SEATS and lv.requests_waiting == 0
        _finish(full, timeout=90)
        assert _statuses(full) == [200] * WORK_SEATS
        print(f"killed {victim} holding {owned[victim]} of {WORK_SEATS} seats; all "
              f"{WORK_SEATS} usable again")


def _threads(pids) -> int:
    """The threads of processes ``pids``, from /proc."""
    return sum(len(os.listdir(f"/proc/{pid}/task")) for pid in pids)


# Threads an ASGI worker may add while requests queue: the middleware's ledger pool (for a
# ledger call whose lock another process holds; asgi/middleware.py), made on first use.
LEDGER_POOL = 2


def test_a_disconnect_while_queued_frees_the_slot(asgi):
    """40 requests queued behind 8 held seats cost the workers no thread each (at most the
    ledger pool's few); their clients leave: they are gone from the queue while the seats are
    still held (counted cancelled, not dispatched)."""
    queued = 40
    with asgi() as srv:
        workers = srv.workers()
        # each worker's own threads up (the event loop's and the dispatcher's): a worker still
        # booting starts its dispatcher later
        assert srv.wait_for(lambda: all(_threads([pid]) >= 2 for pid in workers), timeout=30)
        hold = _hold(srv, WORK_SEATS, ms=8000)
        threads = _threads(workers)
        socks = _queue(srv, queued)
        try:
            assert srv.wait_for(lambda: srv.level("work").requests_waiting == queued,
                                timeout=30), srv.level("work")
            now = _threads(workers)
            print(f"{queued} queued: {now} threads in {len(workers)} workers, {threads} before")
            assert now <= threads + LEDGER_POOL * len(workers), (
                f"{queued} queued requests: {now} threads, {threads} before")
        finally:
            for s in socks:
                s.close()
        freed = srv.wait_for(lambda: (lv := srv.level("work")).requests_waiting == 0 and lv,
                             timeout=30)
        assert freed, "the queued requests of clients that left are still waiting"
        assert freed.cancelled == queued and freed.seats_in_use == WORK_SEATS
        assert freed.dispatched == WORK_SEATS
        _finish(hold, timeout=60)
        assert _statuses(hold) == [200] * WORK_SEATS
        assert srv.idle() is not None




def test_a_hup_applies_a_new_configuration(asgi, tmp_path):
    """A new priority level and FlowSchema after HUP: the new workers classify by it (the PF
    UID headers say so) and the ledger has the level; an invalid file is refused first."""
    cfg = tmp_path / "apf.yaml"
    shutil.copy(APPS / "apf.yaml", cfg)
    # the HUP path alone (the file watcher would apply each file before the HUP)
    with asgi(config=str(cfg), env={"APF_CONFIG_WATCH": "off"}) as srv:
        headers = {"X-Remote-User": "z"}
        status, h, _ = srv.request("/other?ms=1", headers=headers)
        assert status == 200 and h["x-kubernetes-pf-prioritylevel-uid"] == "uid-pl-other"
        old = set(srv.workers())
        cfg.write_text("kind: FlowSchema\nmetadata: {name: bad}\nspec: {}\n")
        os.kill(srv.pid, signal.SIGHUP)
        assert srv.wait_for(lambda: "reload rejected" in srv.log(), timeout=60)
        # gunicorn replaces the workers on every HUP, a refused one too: the next reload's
        # workers are told apart from these
        assert srv.wait_for(lambda: not (old & set(srv.workers()))
                            and len(srv.workers()) == 2, timeout=60)
        old = set(srv.workers())
        status, h, _ = srv.request("/other?ms=1", headers=headers)
        assert status == 200 and h["x-kubernetes-pf-prioritylevel-uid"] == "uid-pl-other"
        shutil.copy(APPS / "apf.yaml", cfg)
        with open(cfg, "a") as f:
            f.write(EXTRA)
        os.kill(srv.pid, signal.SIGHUP)
        assert srv.wait_for(lambda: "generation 2 applied" in srv.log(), timeout=60), srv.log()
        assert srv.wait_for(lambda: not (old & set(srv.workers()))
                            and len(srv.workers()) == 2, timeout=60)
        status, h, _ = srv.request("/other?ms=1", headers=headers)
        assert status == 200 and h["x-kubernetes-pf-prioritylevel-uid"] == "uid-pl-extra"
        assert h["x-kubernetes-pf-flowschema-uid"] == "uid-fs-extra"
        assert "extra" in {lv.name for lv in srv.ledger_snapshot().levels}
        assert srv.idle() is not None


def _get(port: int, path: str) -> tuple[int, str]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


def test_admin_metrics_count_the_asgi_requests_and_pass_promtool(asgi):
    port = free_port()
    with asgi(env={"APF_ADMIN_BIND": f"127.0.0.1:{port}"}) as srv:
        for i in range(5):
            assert srv.request("/work?ms=1", headers={"X-Remote-User": f"m{i}"})[0] == 200
        assert srv.request("/stream?n=3&ms=1")[0] == 200
        assert srv.wait_for(lambda: _get(port, "/readyz")[0] == 200, timeout=30)
        status, text = _get(port, "/metrics")
        assert status == 200
        line = next(ln for ln in text.splitlines()
                    if ln.startswith("apf_dispatched_requests_total")
                    and 'priority_level="work"' in ln)
        assert float(line.split()[-1]) == 6.0, line
        check_metrics(text)


def test_graceful_stop_answers_queued_requests_503(asgi):
    """SIGTERM with 8 requests executing and 4 queued: the queued ones are answered 503 by the
    stop (not served once a seat frees, nor timed out), the executing ones are served."""
    with asgi() as srv:
        hold = _hold(srv, WORK_SEATS, ms=4000)  # served within the 5 s graceful timeout
        queued = _start([Client(srv.port, "/work?ms=1", user=f"p{i}", count=1, timeout=60)
                         for i in range(4)])
        assert srv.wait_for(lambda: srv.level("work").requests_waiting == 4, timeout=30)
        os.kill(srv.pid, signal.SIGTERM)
        _finish(queued, timeout=60)
        _finish(hold, timeout=60)
        print(f"queued: {[c.statuses for c in queued]} {[c.errors for c in queued]}; "
              f"executing: {[c.statuses for c in hold]}")
        assert [c.statuses for c in queued] == [[503]] * 4
        assert [c.statuses for c in hold] == [[200]] * WORK_SEATS
        srv.proc.wait(30)


def test_no_thread_budget_warning_for_an_event_loop(asgi_one, server_factory):
    """The master warned that ``--threads`` (which apf_gunicorn.conf sets for gthread, and an
    ASGI worker ignores) could not hold the configuration's queued requests, and that they would
    be answered 429 (thread-reserve): an event loop's queued request holds no thread. The
    gthread worker, whose queued requests do, still gets the warning."""
    with asgi_one() as srv:
        assert "APF_EXEMPT_THREADS" not in srv.log(), srv.log()
    with server_factory(workers=2, threads=8) as srv:
        assert "threads - APF_EXEMPT_THREADS" in srv.log() and "thread-reserve" in srv.log()


def test_a_streamed_response_holds_its_seat_until_it_ends(asgi_one, tmp_path):
    """The stream's chunks arrive while its seat is held; the seat goes back at its end."""
    end = tmp_path / "end-stream"
    with asgi_one() as srv:
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
        try:
            conn.request("GET", f"/stream?until={quote(str(end))}")
            resp = conn.getresponse()
            assert resp.status == 200
            assert resp.read(2) == b"x\n"
            assert srv.wait_for(lambda: srv.level("work").seats_in_use == 1, timeout=30)
            assert resp.read(20) == b"x\n" * 10  # more chunks: still streaming, still held
            assert srv.level("work").seats_in_use == 1
            end.touch()
            assert resp.read().endswith(b"end\n")
        finally:
            conn.close()
        assert srv.idle() is not None
        assert srv.level("work").dispatched == 1


@pytest.mark.parametrize("size", [10_000, 200_000])
def test_a_queued_requests_body_reaches_the_app_whole(asgi_one, size):
    """A POST queued behind the full level: its body (some of which the disconnect watcher
    reads while it waits: up to 64 KiB) reaches the app unchanged once it runs."""
    body = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
    with asgi_one() as srv:
        hold = _hold(srv, WORK_SEATS, ms=3000)
        answers = []

        def post():
            conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
            try:
                conn.request("POST", "/work/echo", body=body,
                             headers={"X-Remote-User": "poster"})
                resp = conn.getresponse()
                answers.append((resp.status, resp.read()))
            finally:
                conn.close()

        t = threading.Thread(target=post, daemon=True)
        t.start()
        assert srv.wait_for(lambda: srv.level("work").requests_waiting == 1, timeout=30)
        _finish(hold, timeout=60)
        t.join(60)
        ((status, echoed),) = answers
        assert status == 200 and len(echoed) == size and echoed == body
        assert srv.idle() is not None


def test_an_app_exception_gives_the_seats_back(asgi_one):
    with asgi_one() as srv:
        for _ in range(10):
            assert srv.request("/boom")[0] == 500
        assert srv.idle() is not None
        assert srv.level("work").dispatched == 10
        assert srv.request("/work?ms=1")[0] == 200


def test_timeout_in_the_query_shortens_the_wait(asgi_one):
    """?timeout=2s waits at most 0.5 s: answered 429 (counted timed out) while the 8 seats it
    waited for are still held (for 8 s)."""
    with asgi_one() as srv:
        hold = _hold(srv, WORK_SEATS, ms=8000)
        status, headers, body = srv.request("/work?ms=1&timeout=2s",
                                            headers={"X-Remote-User": "t"})
        lv = srv.level("work")
        assert status == 429 and headers["retry-after"].isdigit()
        assert lv.timedout == 1 and lv.seats_in_use == WORK_SEATS, lv
        _finish(hold, timeout=60)


def _handshake(port: int, path: str) -> tuple[socket.socket, bytes]:
    """A WebSocket handshake on a raw connection: (the socket, the response head)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
              "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
              "Sec-WebSocket-Version: 13\r\nX-Remote-User: ws\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        if not chunk:
            break
        head += chunk
    return s, head


def _needs_websockets(worker: str) -> None:
    if worker.endswith("UvicornWorker") and not any(
            importlib.util.find_spec(m) for m in ("websockets", "wsproto")):
        pytest.skip("uvicorn serves WebSockets with the websockets or wsproto package")


def test_a_websocket_holds_its_seat_only_until_accepted(asgi, asgi_worker):
    """Classified at the handshake (the work level dispatches it), its seat back once accepted,
    while the connection stays open."""
    _needs_websockets(asgi_worker)
    with asgi() as srv:
        s, head = _handshake(srv.port, "/work/ws")
        try:
            assert head.startswith(b"HTTP/1.1 101"), head
            # the seat goes back just after the 101 is sent: wait for it
            assert srv.wait_for(lambda: (lv := srv.level("work")).dispatched == 1
                                and lv.seats_in_use == 0, timeout=30), srv.level("work")
            # while the connection is open and the app serves it: a message is echoed
            mask = b"\x01\x02\x03\x04"
            text = b"hello"
            s.sendall(bytes([0x81, 0x80 | len(text)]) + mask
                      + bytes(b ^ mask[i % 4] for i, b in enumerate(text)))
            frame = b""
            while len(frame) < 2 + len(text):
                chunk = s.recv(64)
                assert chunk, "the connection closed"
                frame += chunk
            assert frame[:2 + len(text)] == bytes([0x81, len(text)]) + text, frame
            assert srv.level("work").seats_in_use == 0
        finally:
            s.close()
        assert srv.idle() is not None


def test_a_refused_websocket_handshake(asgi, asgi_worker):
    """The level full and without queues (tests/apps/tight.yaml's ``other``): the handshake is
    refused; uvicorn sends our 429 with Retry-After (the websocket.http.response extension),
    gunicorn's ASGI worker (without it) answers the 1013 close as 403."""
    _needs_websockets(asgi_worker)
    with asgi(config=str(APPS / "tight.yaml")) as srv:
        hold = _start([Client(srv.port, "/other?ms=6000", user=f"h{i}", count=1, timeout=60)
                       for i in range(WORK_SEATS)])
        assert srv.wait_for(lambda: srv.level("other").seats_in_use == WORK_SEATS, timeout=60)
        s, head = _handshake(srv.port, "/other/ws")
        s.close()
        status = int(head.split(b" ", 2)[1]) if head else None
        print(f"{asgi_worker}: {head.splitlines()[:1]}")
        if asgi_worker.endswith("UvicornWorker"):
            assert status == 429 and b"retry-after" in head.lower(), head
        else:
            assert status == 403, head
        assert srv.level("other").rejected == 1
        _finish(hold, timeout=60)


def test_a_worker_killed_holding_the_ledger_lock(asgi_one):
    """A worker SIGKILLs itself inside its 40th ledger critical section
    (``tests/apps/dying_conf.py``), on its event loop or its dispatcher thread: the next locker
    repairs the ledger, a new worker replaces it, the dead worker's seats come back and the
    survivors keep serving."""
    with asgi_one(env={"APF_TEST_DIE_IN_LOCK": "40"}, conf="python:tests.apps.dying_conf") as srv:
        found = srv.wait_for(
            lambda: re.search(r"apf test: worker (\d+) dies in its", srv.log()), timeout=30)
        assert found, "no worker took the dying lock"
        victim = int(found.group(1))
        repairs = srv.ledger_repairs()
        stop_event = threading.Event()
        # half the clients on the dying worker (keep-alive connections stay with the worker
        # that accepted them: unpinned ones may all be served by the other), half anywhere
        pinned = _start([_Pinned(srv.port, victim, f"p{i}", stop_event) for i in range(6)])
        clients = _start([Client(srv.port, "/work?ms=20", user=f"d{i}", stop=stop_event,
                                 timeout=30) for i in range(6)])
        try:
            died = srv.wait_for(
                lambda: f"Worker (pid:{victim}) was sent SIGKILL" in srv.log(), timeout=120)
            assert died, f"worker {victim} did not die:\n{srv.log()}"
            assert srv.wait_for(lambda: srv.ledger_repairs() > repairs, timeout=30), (
                "nobody repaired the ledger after its lock holder died")
            assert srv.wait_for(lambda: victim not in srv.workers()
                                and len(srv.workers()) == 2, timeout=60)
            assert srv.wait_for_answers(clients, more=50), "not served after the death"
        finally:
            _finish([*pinned, *clients], stop_event)
        statuses = _statuses(clients)
        by_victim = sum(p == victim for c in pinned for p in c.served_by)
        print(f"{by_victim} answers by the dying worker; {len(statuses)} unpinned answers: "
              f"{ {s: statuses.count(s) for s in set(statuses)} }")
        assert set(statuses) <= {200, 429}
        assert srv.idle(timeout=60) is not None
        # the dead worker's requests never counted themselves out: they stay in "now"
        ghosts, top = srv.counters()["work"]
        print(f"most executing at once: {top}, of which {ghosts} of the dead worker")
        assert top <= WORK_SEATS + ghosts


def test_route_costs_take_their_seats(asgi_one, tmp_path):
    """APF_ROUTES gives /work/wide 2 seats (the level's widest request here): four of them fill the 8-seat level, a fifth waits."""
    routes = tmp_path / "routes.yaml"
    routes.write_text("routes:\n  - path: /work/wide\n    seats: 2\n")
    with asgi_one(env={"APF_ROUTES": str(routes)}) as srv:
        wide = _start([Client(srv.port, "/work/wide?ms=3000", user=f"w{i}", count=1,
                              timeout=60) for i in range(5)])
        full = srv.wait_for(lambda: (lv := srv.level("work")).seats_in_use == WORK_SEATS
                            and lv.requests_waiting == 1 and lv, timeout=60)
        assert full, srv.level("work")
        assert full.requests_executing == 4
        _finish(wide, timeout=60)
        assert _statuses(wide) == [200] * 5
        assert srv.counters()["work"][1] == 4  # the app saw at most 4 at once
        assert srv.idle() is not None
        assert "clamped" not in srv.log()


# -- identity and paths (issue 32 items 1, 2, 7, 8, 9) -----------------------------------------

MASTERS = {"X-Remote-User": "admin", "X-Remote-Group": "system:masters"}
#: the mandatory exempt FlowSchema's (it matches the group system:masters)
EXEMPT = derived_uid(KIND_FLOW_SCHEMA, "exempt")


class _UnixConnection(http.client.HTTPConnection):
    """An HTTP connection over a Unix socket."""

    def __init__(self, path: str, timeout: float = 30.0):
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def _ask(conn: http.client.HTTPConnection, path: str, headers: dict) -> tuple[int, dict, str]:
    """(status, headers with lower-case names, body) of one request on ``conn``, closed."""
    try:
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
    finally:
        conn.close()


def _schema(headers: dict) -> str:
    return headers.get("x-kubernetes-pf-flowschema-uid", "?")


def test_trust_is_decided_on_the_socket_peer_whatever_the_servers_proxy_settings(
        asgi, asgi_worker):
    """Item 1: with FORWARDED_ALLOW_IPS='*' uvicorn rewrites ``client`` from X-Forwarded-For;
    APF still decides APF_TRUSTED_PROXIES on the socket's peer. A direct client (127.0.0.2)
    naming the trusted proxy (127.0.0.1) in X-Forwarded-For is not exempt, and is the peer the
    warning names; the real proxy's identity is honoured whatever address it forwards; the
    app still sees the address its server gives it."""
    uvicorn = asgi_worker.endswith("UvicornWorker")
    with asgi(env={"FORWARDED_ALLOW_IPS": "*", "APF_TRUSTED_PROXIES": "127.0.0.1"}) as srv:
        spoof = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30,
                                           source_address=("127.0.0.2", 0))
        status, h, seen = _ask(spoof, "/work/client", {
            "X-Forwarded-For": "127.0.0.1", **MASTERS})
        assert status == 200 and _schema(h) == "uid-fs-work", (h, srv.log())
        assert seen == ("127.0.0.1" if uvicorn else "127.0.0.2")  # the server's own view

        proxy = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        status, h, seen = _ask(proxy, "/work/client", {
            "X-Forwarded-For": "203.0.113.9", **MASTERS})
        assert status == 200 and _schema(h) == EXEMPT, (h, srv.log())
        assert seen == ("203.0.113.9" if uvicorn else "127.0.0.1")

        warnings = [ln for ln in srv.log().splitlines() if "identity header" in ln]
        assert warnings and all("peer 127.0.0.2 " in ln for ln in warnings), warnings


def test_a_unix_socket_peer_is_trusted_with_unix(asgi, tmp_path):
    """Item 2: APF_TRUSTED_PROXIES=unix trusts a proxy on a Unix socket (the server also
    listens on TCP, whose peers it does not trust)."""
    path = str(tmp_path / "apf.sock")
    with asgi(env={"APF_TRUSTED_PROXIES": "unix"}, args=("-b", f"unix:{path}")) as srv:
        status, h, _ = _ask(_UnixConnection(path), "/work?ms=1", MASTERS)
        assert status == 200 and _schema(h) == EXEMPT, (h, srv.log())
        status, h, _ = srv.request("/work?ms=1", headers=MASTERS)  # over TCP: not trusted
        assert status == 200 and _schema(h) == "uid-fs-work", h


def _everything_to_work(tmp_path) -> str:
    """tests/apps/apf.yaml plus a FlowSchema that puts every other path on level ``work``."""
    config = tmp_path / "all-work.yaml"
    config.write_text((APPS / "apf.yaml").read_text() + """
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {name: all, uid: uid-fs-all}
spec:
  matchingPrecedence: 900
  priorityLevelConfiguration: {name: work}
  distinguisherMethod: {type: ByUser}
  rules:
  - subjects:
    - {kind: Group, group: {name: system:authenticated}}
    - {kind: Group, group: {name: system:unauthenticated}}
    nonResourceRules:
    - {verbs: ["*"], nonResourceURLs: ["*"]}
""")
    return str(config)


def _seats_of(srv: Server, tmp_path, paths: list[str]) -> int:
    """The seats the requests to ``paths`` hold at once on level ``work`` (each holds until
    the test lets it go); all answered 200."""
    until = tmp_path / f"go-{uuid.uuid4().hex[:8]}"
    held = _start([Client(srv.port, f"{p}?until={until}", user=f"r{i}", count=1, timeout=60)
                   for i, p in enumerate(paths)])
    try:
        level = srv.wait_for(lambda: (lv := srv.level("work")).requests_executing
                             == len(paths) and lv, timeout=60)
        assert level, (srv.level("work"), srv.log())
        seats = level.seats_in_use
    finally:
        until.write_text("")
        _finish(held)
    assert _statuses(held) == [200] * len(paths), _statuses(held)
    return seats


def test_fastapis_own_root_path_keeps_the_costs(asgi, tmp_path):
    """Item 8 (and 7 on the app's root path): FastAPI(root_path="/api") sets the scope's
    root_path itself: /api/wide runs /wide, /apiwide runs /apiwide (2 seats each; a path
    the app does not route on would cost 1)."""
    with asgi(config=_everything_to_work(tmp_path),
              app="tests.apps.root_path_app:fastapi_app") as srv:
        assert _seats_of(srv, tmp_path, ["/api/wide", "/apiwide"]) == 4
        assert srv.idle() is not None


def test_the_servers_root_path_is_stripped_only_at_a_segment_boundary(tmp_path):
    """Item 7: gunicorn's ASGIWorker with --root-path /api: /apiwide is routed whole, /api/wide
    as /wide (2 seats each). (uvicorn puts its root path in front of every path, so it
    always ends at a boundary; uvicorn-worker does not pass --root-path on.)"""
    with serve_asgi(tmp_path, WORKERS[1], config=_everything_to_work(tmp_path),
                    app="tests.apps.root_path_app:starlette_app",
                    args=("--root-path", "/api")) as srv:
        assert _seats_of(srv, tmp_path, ["/apiwide", "/api/wide"]) == 4
        assert srv.idle() is not None


def test_an_asgi2_app_is_served_as_uvicorn_serves_it_bare(tmp_path):
    """Item 9: uvicorn detects an ASGI2 app behind APF as it does bare (lifespan included);
    APF classifies its requests."""
    pytest.importorskip("uvicorn_worker")
    with serve_asgi(tmp_path, WORKERS[0], app="tests.apps.asgi2_app:app",
                    boot_timeout=30) as srv:
        status, h, body = srv.request("/work")
        assert (status, body) == (200, b"asgi2 /work") and _schema(h) == "uid-fs-work", h
        assert "Traceback" not in srv.log()


def test_a_stopping_uvicorn_worker_serves_a_connection_it_just_accepted(tmp_path):
    """Issue 32 item 17: uvicorn's graceful shutdown closed every connection without a request
    in progress, one whose request it had not read yet included (probes reset during HUPs).
    ``UvicornWorker`` gives such a connection the keep-alive time to bring its request."""
    pytest.importorskip("uvicorn_worker")
    with serve_asgi(tmp_path, WORKERS[0], workers=1, args=("--keep-alive", "60")) as srv:
        [pid] = srv.workers()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=60) as fresh:
            fresh.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # the head, not yet ended
            # a request on a later connection answered: the worker accepted the first one
            # too (accepts are in order) and read what it sent
            assert srv.request("/healthz")[0] == 200
            os.kill(pid, signal.SIGTERM)
            assert srv.wait_for(lambda: f"[{pid}] [INFO] apf: stopping; waiting" in srv.log()
                                or f"[{pid}] [INFO] Shutting down" in srv.log(), 30)
            fresh.sendall(b"Connection: close\r\n\r\n")
            answer = b""
            while chunk := fresh.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200 "), (answer, srv.log()[-3000:])
