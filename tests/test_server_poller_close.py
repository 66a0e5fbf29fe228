"""How the poller closes a connection after its last answer (``gthread/linger.py``), on real
servers: as gunicorn closes after a response (the write side first, then what the client
still sends is read and dropped until it closes), so a client that pipelined a request behind
one answered ``429`` with ``Connection: close`` reads that ``429`` and then the end of input,
not a reset; and a TLS client gets a ``close_notify`` before the end (a client that refuses
truncated TLS streams, ``suppress_ragged_eofs=False``, sees a clean end).

The pipelined request must arrive after the poller read the first head and before it closes:
the poller answers a whole head with nothing behind it, so the first ``429`` is one the poller
holds (its flow came back before its Retry-After, ``pollreject.py``), and the second request
is sent once the ledger counts that hold.
"""

from __future__ import annotations

import socket

import pytest

from tests.apps.tlsclient import client_context, make_cert
from tests.conftest import APPS
from tests.test_server_pollreject import OTHER, TIGHT, delayed, hold_other, read_response

pytestmark = pytest.mark.server

#: the held seat's request would keep a stopping worker for the default 5 s
QUICK_STOP = ("--graceful-timeout", "1")
CLOSING = b"GET /other HTTP/1.1\r\nHost: t\r\nConnection: close\r\nX-Remote-User: mallory\r\n\r\n"


def _held_429_then_end(srv, connect) -> tuple[bytes, bytes]:
    """mallory asks three times at once (her next 429 will be held), then on a new connection
    asks once more with ``Connection: close`` and, while that 429 is held, pipelines another
    request: (the answer read, what the next read gives: b"" at a clean end)."""
    hold_other(srv)
    with connect() as s:
        for _ in range(3):
            s.sendall(OTHER % b"mallory")
            assert read_response(s).startswith(b"HTTP/1.1 429 ")
    before = delayed(srv)
    with connect() as s:
        s.sendall(CLOSING)
        assert srv.wait_for(lambda: delayed(srv) > before), "the 429 was not held"
        s.sendall(OTHER % b"mallory")  # unread when the held 429 is written and the socket closed
        answer = read_response(s)
        return answer, s.recv(65536)


def test_a_pipelining_client_reads_its_closing_429_and_a_clean_end(server_factory):
    with server_factory(workers=1, threads=4, config=str(APPS / "tight.yaml"),
                        env=TIGHT, args=QUICK_STOP) as srv:
        answer, end = _held_429_then_end(
            srv, lambda: socket.create_connection(("127.0.0.1", srv.port), timeout=30))
        assert answer.startswith(b"HTTP/1.1 429 ") and b"Connection: close" in answer
        assert end == b""  # the end of input, not ECONNRESET
        assert "Traceback" not in srv.log()


def test_a_tls_client_gets_close_notify_after_its_closing_429(server_factory, tmp_path):
    certfile, keyfile = make_cert(tmp_path)
    ctx = client_context()

    def connect() -> socket.socket:
        raw = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        # a truncated stream (no close_notify) raises SSLEOFError instead of reading b""
        return ctx.wrap_socket(raw, suppress_ragged_eofs=False)

    with server_factory(workers=1, threads=4, config=str(APPS / "tight.yaml"), env=TIGHT,
                        args=("--certfile", certfile, "--keyfile", keyfile, *QUICK_STOP)) as srv:
        answer, end = _held_429_then_end(srv, connect)
        assert answer.startswith(b"HTTP/1.1 429 ") and b"Connection: close" in answer
        assert end == b""  # close_notify: a clean end of the TLS stream
        assert "Traceback" not in srv.log()
