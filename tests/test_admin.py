"""The admin endpoint, in-process over real HTTP on 127.0.0.1 against a ledger on a bytearray."""

from __future__ import annotations

import http.client
import logging
import select
import socket
import time

import pytest

from apf_gunicorn.flowcontrol.borrowing import BorrowingStates, run_borrowing
from apf_gunicorn.ledger.ledger import Capacity, Ledger, LevelSpec
from apf_gunicorn.master.admin import AdminServer
from apf_gunicorn.master.metrics import MasterView
from apf_gunicorn.server.dumps import encode_detail_fields

T0 = 1_000_000_000_000


class EmptySource:
    """Stands in for the multiprocess files (covered by test_metrics)."""

    def collect(self):
        return []


@pytest.fixture
def served():
    cap = Capacity()
    led = Ledger.create(bytearray(Ledger.size(cap)), cap)
    levels, schemas = led.configure(
        [LevelSpec("exempt", -1, 0, 0, 0), LevelSpec("catch-all", 0, 0, 0, 13),
         LevelSpec("workload-low", 8, 2, 5, 1)],
        ["exempt", "catch-all", "service-accounts"], T0)
    wl, fs = levels["workload-low"], schemas["service-accounts"]
    detail = encode_detail_fields(d="alice", u="alice", v="list", p="/api/v1/pods", r="pods",
                                  ver="v1")
    first = led.admit(wl, 12345, 1, 0, 0, 0, T0, fs_index=fs, detail=detail)
    second = led.admit(wl, 12345, 1, 0, 0, 0, T0 + 1000, fs_index=fs, detail=detail)
    assert (first.outcome, second.outcome) == ("execute", "queued")
    limits = {"exempt": _Lim(0, 0, 0, 13), "catch-all": _Lim(13, 0, 13, 26),
              "workload-low": _Lim(1, 0, 1, 14)}
    states = BorrowingStates()
    run_borrowing(led, limits, states, T0 + 2000, server_limit=13,
                  levels=[(n, i, n == "exempt") for n, i in levels.items()])
    view = MasterView(ledger=led, level_limits=limits, borrowing=states, workers=0,
                      clock=lambda: T0 + 5000)
    admin = AdminServer("127.0.0.1:0", lambda: view, metrics_source=EmptySource(), timeout=1.0)
    assert admin.start()
    try:
        yield admin, view
    finally:
        admin.stop()


class _Lim:
    def __init__(self, nominal, lendable, lower, upper):
        self.nominal, self.lendable, self.lower, self.upper = nominal, lendable, lower, upper


def get(admin: AdminServer, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", admin.port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def test_endpoints(served) -> None:
    admin, view = served
    assert get(admin, "/healthz") == (200, "ok\n")
    assert get(admin, "/readyz") == (503, "not ready: no worker registered yet\n")
    view.workers = 2
    assert get(admin, "/readyz") == (200, "ok\n")
    assert get(admin, "/nope")[0] == 404
    assert get(admin, "/debug/api_priority_and_fairness/dump_nothing")[0] == 404

    status, text = get(admin, "/debug/api_priority_and_fairness/dump_priority_levels")
    assert status == 200
    rows = [r.replace(" ", "").split(",") for r in text.splitlines()]
    assert [r[0] for r in rows] == ["PriorityLevelName", "catch-all", "exempt", "workload-low"]
    assert rows[3][1:6] == ["1", "false", "false", "1", "1"]  # 1 active queue, 1 waiting, 1 exec

    status, text = get(admin, "/debug/api_priority_and_fairness/dump_queues")
    assert status == 200 and len(text.splitlines()) == 1 + 8

    # the fairness columns only when asked (any non-empty value, as includeRequestDetails)
    plain = get(admin, "/debug/api_priority_and_fairness/dump_priority_levels")[1]
    assert get(admin, "/debug/api_priority_and_fairness/dump_priority_levels"
                      "?includeFairness=")[1] == plain
    status, text = get(admin, "/debug/api_priority_and_fairness/dump_priority_levels"
                              "?includeFairness=1")
    rows = [r.replace(" ", "").split(",") for r in text.splitlines()]
    assert status == 200 and rows[0][10:] == ["Fairness", "VirtualTime", "ActiveFlows",
                                              "ReservedFlow", "Reservations"]
    # no fairness on the exempt and the Reject-type (no queues) levels
    assert {r[0]: r[10] for r in rows[1:]} == {"catch-all": "", "exempt": "",
                                               "workload-low": "kubernetes"}
    assert [r[:10] for r in rows] == [r.replace(" ", "").split(",") for r in plain.splitlines()]
    status, text = get(admin, "/debug/api_priority_and_fairness/dump_queues?includeFairness=1")
    assert status == 200 and text.splitlines()[0].endswith("Fairness,   VirtualTime")
    status, text = get(admin, "/debug/api_priority_and_fairness/dump_flows")
    assert status == 200 and text.startswith("PriorityLevelName, FlowHash,")
    assert len(text.splitlines()) == 1  # no maxmin level: no flows

    status, text = get(admin, "/debug/api_priority_and_fairness/dump_requests")
    lines = text.splitlines()
    assert status == 200 and len(lines) == 3 and "UserName" not in lines[0]
    assert all(",service-accounts," in ln.replace(" ", "") for ln in lines[1:])
    status, text = get(admin, "/debug/api_priority_and_fairness/dump_requests"
                              "?includeRequestDetails=1")
    assert "UserName" in text.splitlines()[0]
    assert text.splitlines()[1].replace(" ", "").endswith("alice,list,/api/v1/pods,,,v1,pods,")

    status, text = get(admin, "/metrics")
    assert status == 200
    assert 'apf_current_executing_requests{flow_schema="service-accounts",priority_level="workload-low"} 1.0' in text
    assert 'apf_current_inqueue_requests{flow_schema="service-accounts",priority_level="workload-low"} 1.0' in text
    assert 'apf_nominal_limit_seats{priority_level="catch-all"} 13.0' in text
    assert "apf_seat_fair_frac" in text and "apf_current_limit_seats" in text


def test_malformed_and_slow_clients_do_not_kill_it(served) -> None:
    _, view = served
    # a 30 s deadline: a server that waited on the slow connection would answer nothing else
    # before cutting it (counted in timed_out)
    admin = AdminServer("127.0.0.1:0", lambda: view, metrics_source=EmptySource(), timeout=30.0)
    assert admin.start()
    slow = socket.create_connection(("127.0.0.1", admin.port))  # sends nothing
    try:
        for junk in (b"\x00\xff garbage\r\n\r\n", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
                     b"GET /healthz HTTP/9.9\r\n\r\n", b"BREW /healthz HTTP/1.1\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", admin.port), timeout=5) as s:
                s.sendall(junk)
                s.shutdown(socket.SHUT_WR)
                reply = s.recv(200)
                # an error status (HTTP/0.9-style body for a garbled request line) or a close
                assert reply == b"" or reply.startswith(b"HTTP/") or b"Error code: " in reply
        assert get(admin, "/healthz") == (200, "ok\n")
        assert admin._server.timed_out == 0  # served while the slow one idles, not after it
    finally:
        slow.close()
        admin.stop()


def test_port_in_use_is_reported_not_raised(served, caplog) -> None:
    admin, view = served
    second = AdminServer(("127.0.0.1", admin.port), lambda: view)
    with caplog.at_level(logging.ERROR, logger="apf_gunicorn.admin"):
        assert second.start() is False
    assert "already in use" in caplog.text
    assert get(admin, "/healthz")[0] == 200


def test_listening_socket_not_inherited_and_closed_in_child(served) -> None:
    import os

    admin, _ = served
    fd = admin._server.fileno()
    assert os.get_inheritable(fd) is False  # close-on-exec: a USR2 exec does not keep it
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            admin.close_in_child()
            try:
                os.fstat(fd)
                os.write(w, b"open")
            except OSError:
                os.write(w, b"closed")
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    assert os.read(r, 10) == b"closed"
    os.close(r)
    assert get(admin, "/healthz")[0] == 200  # the parent still serves


def test_cli_dump_fetches_and_reports_nothing_listening(served, capsys) -> None:
    from apf_gunicorn.cli import main

    admin, _ = served
    assert main(["dump", "--admin", f"127.0.0.1:{admin.port}", "levels"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("PriorityLevelName,") and "workload-low" in out
    assert "Fairness" in out.splitlines()[0]  # the fairness columns by default
    assert main(["dump", "--admin", f"127.0.0.1:{admin.port}", "levels", "--kubernetes"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("CancelledRequests")  # Kubernetes' exact layout
    assert main(["dump", "--admin", f"127.0.0.1:{admin.port}", "flows"]) == 0
    assert capsys.readouterr().out.startswith("PriorityLevelName, FlowHash,")
    assert main(["dump", "--admin", f"127.0.0.1:{admin.port}", "requests", "--details"]) == 0
    assert "UserName" in capsys.readouterr().out
    assert main(["dump", "--admin", f"127.0.0.1:{admin.port}", "pools"]) == 0
    assert capsys.readouterr().out.startswith("PoolName, ")  # (this view has no pools)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert main(["dump", "--admin", f"127.0.0.1:{free}", "queues", "--timeout", "2"]) == 1
    assert "cannot reach the admin endpoint" in capsys.readouterr().err


def test_accepts_a_master_state(served) -> None:
    from types import SimpleNamespace as NS

    _, view = served
    m = NS(ledger=view.ledger, generation=NS(limits=view.level_limits),
           borrowing_states=view.borrowing, workers={0: 0}, reload_errors=2,
           settings=NS(metrics_prefix="myapp", concurrency_limit=13))
    admin = AdminServer(m, ("127.0.0.1", 0), metrics_source=EmptySource())  # either order
    assert admin.start()
    try:
        assert get(admin, "/readyz")[0] == 503  # worker 0 still booting
        m.workers[0] = 1234
        assert get(admin, "/readyz")[0] == 200
        text = get(admin, "/metrics")[1]
        assert "myapp_config_reload_errors_total 2.0" in text
        assert 'myapp_current_limit_seats{priority_level="workload-low"}' in text
    finally:
        admin.stop()


def _admin_threads() -> int:
    import threading

    return sum(1 for t in threading.enumerate() if t.name == "apf-admin")


def _read_all(s: socket.socket) -> bytes:
    reply = b""
    while chunk := s.recv(4096):
        reply += chunk
    return reply


def _wait(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (ok := predicate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return ok


def _server_peers(admin: AdminServer) -> list[int]:
    """The client ports of the connections counted against the cap, the idlest first."""
    out = []
    for c in list(admin._server.active.values()):
        try:
            out.append(c.sock.getpeername()[1])
        except OSError:  # closed by the loop meanwhile
            out.append(None)
    return out


def _gone(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (EOF or reset), without waiting long."""
    s.settimeout(2)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_full_slots_drop_the_connection_idle_the_longest(served) -> None:
    """Idle and trickling connections fill every place: each new connection takes the place of
    the one idle the longest (a byte received moves a connection to the back), which is closed
    and counted; /metrics is answered 200 throughout, and the loop keeps one thread."""
    _, view = served
    cap = 8
    admin = AdminServer("127.0.0.1:0", lambda: view, metrics_source=EmptySource(), timeout=30.0,
                        max_connections=cap)
    assert admin.start()
    held: list[socket.socket] = []
    try:
        for _ in range(cap):  # idle connections fill every place
            held.append(socket.create_connection(("127.0.0.1", admin.port), timeout=5))
        ports = [s.getsockname()[1] for s in held]
        assert _wait(lambda: len(admin._server.conns) == cap)  # all accepted
        held[0].sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")  # the oldest trickles a byte
        assert _wait(lambda: any(c.buf for c in list(admin._server.conns.values())))

        status, text = get(admin, "/metrics")  # one place more: held[1] is idle the longest

        assert status == 200 and "apf_current_limit_seats" in text, (status, text)
        assert admin._server.dropped == 1
        assert _gone(held[1])
        # (the answered connection leaves the count just after its last byte is sent)
        assert _wait(lambda: _server_peers(admin) == ports[2:] + ports[:1]), \
            _server_peers(admin)
        for _ in range(3 * cap):  # a flood of idle connections beyond the cap
            held.append(socket.create_connection(("127.0.0.1", admin.port), timeout=5))
        newest = [s.getsockname()[1] for s in held[-cap:]]
        assert _wait(lambda: _server_peers(admin) == newest), _server_peers(admin)
        assert admin._server.dropped == 1 + 3 * cap - 1  # the first one took the free place
        assert all(_gone(s) for s in held[:-cap])  # the oldest went first, held[0] too
        assert get(admin, "/metrics")[0] == 200
        assert admin._server.refused == 0
        assert _admin_threads() == 2  # the fixture's endpoint and this one: one thread each
    finally:
        for s in held:
            s.close()
        admin.stop()


def test_trickling_clients_get_one_deadline_and_never_block_scrapes(served) -> None:
    """40 connections that send their head one byte every 0.2 s: the deadline is per
    connection, not per read (1.5 s here), and /metrics answers meanwhile.

    The trickle goes on until every connection is answered: a per-read deadline would never
    cut a connection that sends a byte every 0.2 s, so each must be answered 408 long before
    its 140-byte head is sent (28 s)."""
    _, view = served
    admin = AdminServer("127.0.0.1:0", lambda: view, metrics_source=EmptySource(), timeout=1.5)
    assert admin.start()
    trickle = [socket.create_connection(("127.0.0.1", admin.port), timeout=5) for _ in range(40)]
    head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    scrapes = []
    replies: dict[socket.socket, bytes] = {}
    try:
        i = 0
        while len(replies) < len(trickle) and i < len(head):
            open_ = [s for s in trickle if s not in replies]
            readable, _, _ = select.select(open_, [], [], 0)
            for s in readable:
                replies[s] = _read_all(s)
            for s in open_:
                if s not in replies:
                    try:
                        s.send(head[i:i + 1])
                    except OSError:  # cut between the select and the send
                        replies[s] = _read_all(s)
            i += 1
            t0 = time.monotonic()
            status, text = get(admin, "/metrics")
            scrapes.append((status, time.monotonic() - t0))
            time.sleep(0.2)  # the trickle's pace
        assert scrapes and all(st == 200 for st, _ in scrapes), scrapes
        print(f"cut after {i} bytes; scrape seconds under the trickle:",
              [round(d, 3) for _, d in scrapes])
        assert len(replies) == len(trickle), \
            f"{len(trickle) - len(replies)} connections never cut while they sent {i} bytes"
        assert all(r.startswith(b"HTTP/1.1 408 ") for r in replies.values()), replies
        assert i < len(head), "cut only once the whole head was sent"
        assert admin._server.timed_out == 40
    finally:
        for s in trickle:
            s.close()
        admin.stop()
