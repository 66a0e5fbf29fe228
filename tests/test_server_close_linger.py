"""How the worker closes a connection after a thread's response that does not keep it alive
(``gthread/linger.py``: ``LingeringConn``), on real servers: gracefully, as gunicorn does (the
write side first, then what the client still sends is read and dropped until it closes, 64 KiB
or 2 s), but from the poller's events. Stock gthread waits for the client's end on the
worker's main loop (``util.close_graceful``), so a client that sends ``Connection: close`` and
keeps its socket open held every accept of the worker, exempt probes too, for up to 2 s per
connection.

Whether the server still holds a connection is read from /proc/net/tcp (Linux): the server's
end of it has an inode while a process holds its socket, none once it is closed.
"""

from __future__ import annotations

import socket

import pytest

from tests.apps.tlsclient import client_context, make_cert
from tests.test_server_pollreject import read_response

pytestmark = pytest.mark.server

CLOSING = b"GET /work?ms=1 HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
PROBE = b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
CLIENTS = 3


def _held_by_server(port: int, client_port: int) -> bool:
    """Whether a process still holds the server's end (127.0.0.1:``port``) of the connection
    from 127.0.0.1:``client_port`` (/proc/net/tcp: its inode, 0 once closed; gone later)."""
    local, remote = f"0100007F:{port:04X}", f"0100007F:{client_port:04X}"
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[1] == local and fields[2] == remote:
                return fields[9] != "0"
    return False


def _lingering_clients_and_a_probe(srv, connect) -> None:
    """``CLIENTS`` clients each send one request with ``Connection: close`` and read its
    answer, and keep their sockets open; once the first of them read the end of input (the
    server shut its write side: it lingers), an exempt probe on a new connection is answered
    while the server still holds every one of them (it lingers up to 2 s, or until they
    close, which they do not). Then each reads the end of input."""
    clients = [connect() for _ in range(CLIENTS)]
    try:
        for c in clients:
            c.sendall(CLOSING)
        for c in clients:
            assert read_response(c).startswith(b"HTTP/1.1 200 ")
        ports = [c.getsockname()[1] for c in clients]
        assert clients[0].recv(65536) == b""  # the server's end of output (TLS: close_notify)
        assert _held_by_server(srv.port, ports[0]), "closed at once: not lingering"
        with connect() as probe:
            probe.sendall(PROBE)
            assert read_response(probe).startswith(b"HTTP/1.1 200 ")
        # Stock gthread lingers on its main loop: it accepts the probe only once it has closed
        # at least the first of them (2 s after its answer: the clients never close)
        still = [_held_by_server(srv.port, p) for p in ports]
        assert all(still), f"the probe waited for lingering clients to be closed: {still}"
        for c in clients[1:]:
            assert c.recv(65536) == b""
    finally:
        for c in clients:
            c.close()
    # the lingering connections end (their time is up) and the worker serves on
    assert srv.wait_for(lambda: not any(_held_by_server(srv.port, p) for p in ports))
    assert srv.request("/work?ms=1")[0] == 200
    assert "Traceback" not in srv.log()


def test_a_client_that_keeps_its_socket_open_after_connection_close_stalls_nothing(
        server_factory):
    with server_factory(workers=1, threads=8) as srv:
        _lingering_clients_and_a_probe(
            srv, lambda: socket.create_connection(("127.0.0.1", srv.port), timeout=30))


def test_a_tls_client_that_keeps_its_socket_open_stalls_nothing_and_gets_close_notify(
        server_factory, tmp_path):
    certfile, keyfile = make_cert(tmp_path)
    ctx = client_context()

    def connect() -> socket.socket:
        raw = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        # a truncated stream (no close_notify, as gthread's close_graceful leaves it) raises
        # SSLEOFError instead of reading b""
        return ctx.wrap_socket(raw, suppress_ragged_eofs=False)

    with server_factory(workers=1, threads=8,
                        args=("--certfile", certfile, "--keyfile", keyfile)) as srv:
        _lingering_clients_and_a_probe(srv, connect)
