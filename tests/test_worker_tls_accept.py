"""The accept-gated worker's TLS accept on the main thread (gthread/worker.py,
``_apf_tls_accept``), without a server: a connection whose client reset it before the worker
accepted it makes ``SSLContext.wrap_socket`` raise (``getpeername`` says ENOTCONN, then the
wrap's probing ``recv`` ECONNRESET). gthread wraps in the request thread for that reason
("ENOTCONN from ssl_wrap_socket would crash main thread otherwise"); in the poller the error
must close that one connection, not escape the main loop and end the worker.
"""

from __future__ import annotations

import logging
import selectors
import socket
import ssl
import struct
import time

from gunicorn.config import Config

from apf_gunicorn.gthread.worker import ApfThreadWorker
from tests.apps.tlsclient import make_cert


class _Log:
    def __getattr__(self, name):
        return getattr(logging.getLogger("test.worker"), name)


def _tls_worker(tmp_path) -> ApfThreadWorker:
    certfile, keyfile = make_cert(tmp_path)
    cfg = Config()
    cfg.set("certfile", certfile)
    cfg.set("keyfile", keyfile)
    cfg.set("threads", 4)
    worker = ApfThreadWorker(0, 0, [], None, 30, cfg, _Log())
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certfile, keyfile)
    worker.apf_tls_context = ctx
    worker.poller = selectors.DefaultSelector()
    return worker


def test_a_tls_connection_reset_before_accept_closes_only_itself(tmp_path):
    worker = _tls_worker(tmp_path)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    try:
        client = socket.create_connection(listener.getsockname())
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # an RST, before the worker accepts
        time.sleep(0.1)
        worker.accept(listener)  # must not raise: it would end the worker's main loop
        assert worker.nr_conns == 0
        assert not worker.apf_reading and not worker.apf_young and not worker.apf_silent
        assert worker.apf_head_bytes == 0
        # and the worker still accepts and handshakes the next one
        good = socket.create_connection(listener.getsockname())
        try:
            time.sleep(0.05)
            worker.accept(listener)
            assert worker.nr_conns == 1
            assert len(worker.apf_reading) == 1
            for conn in list(worker.apf_reading):
                worker._apf_close(conn)
        finally:
            good.close()
    finally:
        listener.close()
        worker.poller.close()


class _WantsWrite:
    """A TLS socket stand-in whose reads say what ``answers`` holds in turn: an exception
    class to raise, or bytes. Its file descriptor is a real socket's, for the poller."""

    def __init__(self, real: socket.socket, answers: list) -> None:
        self._real = real
        self.answers = answers

    def fileno(self) -> int:
        return self._real.fileno()

    def recv(self, _n: int) -> bytes:
        got = self.answers.pop(0)
        if isinstance(got, type):
            raise got()
        return got

    def pending(self) -> int:
        return 0

    def close(self) -> None:
        self._real.close()


def test_a_tls_read_that_wants_to_write_waits_for_room_to_write(tmp_path):
    """A kept-alive TLS connection whose read says ``SSLWantWriteError`` (TLS must send, a
    key update or renegotiation, and the send buffer is full): the poller waits until the
    socket is writable, not readable (bytes the client may never send, as it waits for
    ours), then reads again and goes back to waiting for bytes."""
    worker = _tls_worker(tmp_path)
    a, b = socket.socketpair()
    try:
        from gunicorn.workers.gthread import TConn
        sock = _WantsWrite(a, [ssl.SSLWantWriteError, ssl.SSLWantReadError,
                               b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"])
        conn = TConn(worker.cfg, a, ("127.0.0.1", 1), ("127.0.0.1", 2))
        conn.sock = sock
        conn.apf_handshake = False
        conn.apf_events = selectors.EVENT_READ
        conn.apf_buf = conn.apf_scan = None
        conn.parser = type("P", (), {"req_count": 1})()
        worker.keepalived_conns.append(conn)
        worker.poller.register(sock, selectors.EVENT_READ, None)
        worker.on_client_socket_readable(conn, sock)  # the read wants to write
        assert worker.poller.get_key(sock).events == selectors.EVENT_WRITE
        key = worker.poller.get_key(sock)
        key.data(sock)  # writable: it reads again, nothing yet: it waits for bytes again
        assert worker.poller.get_key(sock).events == selectors.EVENT_READ
        started = []
        worker.apf_start_request = started.append
        worker.poller.get_key(sock).data(sock)  # the head arrives
        assert started == [conn]
    finally:
        worker.poller.close()
        a.close()
        b.close()
