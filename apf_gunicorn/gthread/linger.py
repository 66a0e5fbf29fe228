"""Closing a connection after its last answer as gunicorn does, without waiting.

gunicorn closes a connection after a response with ``util.close_graceful``: it shuts the write
side (the client reads the response, then the end of input), reads and drops what the client
still sends until the client closes, 64 KiB or 2 s, then closes. A plain ``close()`` with bytes
unread (a client that pipelined a request behind one answered ``Connection: close``) makes the
kernel send a reset, which can destroy the answer before the client has read it and ends the
connection with ``ECONNRESET`` instead of the end of input. ``close_graceful`` blocks while it
reads, and gthread calls it on the worker's main loop (``finish_request``, after a thread's
response that does not keep the connection alive: ``Connection: close``, an error, the end of
an HTTP/2 connection), so a client that keeps its socket open after such a response stalled
every accept and poller event of the worker for up to 2 s per connection. The main loop must
not block, so :class:`Lingering` makes the same steps from the poller's events. A TLS
connection first sends its ``close_notify`` alert (``unwrap``, non-blocking: the alert is
written at once, the client's own is not waited for), so a client that checks for a
truncation attack sees a clean end (gthread's ``close_graceful`` sends none). Used for every
graceful close on the main loop: the poller's ``429`` (``pollanswer.py``), its ``408`` and
``431`` (``worker.py``), and gthread's close after a thread's response (:class:`LingeringConn`,
the class of the worker's connections); a connection closed without an answer (a dropped idle
one, a failed handshake, a kept-alive one timed out) is closed at once. (A thread that closes
its connection itself, gthread's ``handle_request`` after an error in a started response,
still blocks that thread only.)

Limits: a lingering connection is no longer counted in ``nr_conns`` (it wants no thread, and
holds neither the accept gate nor ``worker_connections``); at most ``worker_connections`` of them
linger per worker (past that the oldest is closed at once); a stopping worker closes those left
when it exits.
"""

from __future__ import annotations

import selectors
import socket
import ssl
import time
from functools import partial

from gunicorn.workers.gthread import TConn

#: gunicorn's ``close_graceful``: how long to wait for the client's end, and how much to read
LINGER_S = 2.0
LINGER_BYTES = 65536


class Lingering:
    """The main loop's graceful close, made from the poller's events; a mixin of
    ``ApfThreadWorker`` (uses its ``poller`` and ``worker_connections``)."""

    #: connections lingering -> when they are closed at the latest, in that order
    apf_lingering: dict

    def apf_close_answered(self, conn) -> None:
        """Close ``conn`` after its last answer was written: shut its write side (a TLS one
        sends ``close_notify`` first), then read and drop what it still sends until it ends,
        ``LINGER_BYTES`` or ``LINGER_S``. ``conn`` is in no table of the worker and not
        registered in the poller; ``nr_conns`` no longer counts it. Blocking or not (a
        thread's connection is blocking), or already closed by its thread."""
        sock = conn.sock
        try:
            # (a thread left it blocking: unwrap would wait for the client's close_notify)
            sock.setblocking(False)
        except OSError:  # closed already (gthread's handle after an SSL EOF)
            conn.close()
            return
        if isinstance(sock, ssl.SSLSocket):
            try:
                sock.unwrap()  # writes close_notify; the client's is not awaited (non-blocking)
            except (OSError, ValueError):  # (SSLWantReadError among them: the usual case)
                pass
        try:
            # (an SSLSocket's shutdown also drops its TLS layer: what follows reads raw bytes)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the client is gone already
            conn.close()
            return
        lingering = self.apf_lingering
        if len(lingering) >= max(1, self.worker_connections):
            self._apf_end_linger(next(iter(lingering)))
        conn.apf_drained = 0
        lingering[conn] = time.monotonic() + LINGER_S
        self.poller.register(sock, selectors.EVENT_READ, partial(self._apf_on_lingering, conn))

    def _apf_on_lingering(self, conn, sock) -> None:
        try:
            data = sock.recv(LINGER_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            conn.apf_drained += len(data)
            if conn.apf_drained < LINGER_BYTES:
                return
        self._apf_end_linger(conn)

    def _apf_end_linger(self, conn) -> None:
        del self.apf_lingering[conn]
        try:
            self.poller.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        conn.close()

    def apf_expire_lingering(self) -> None:
        """Close the lingering connections whose time is up (once per pass of the main
        loop while any linger)."""
        lingering = self.apf_lingering
        now = time.monotonic()
        while lingering:
            first = next(iter(lingering))  # insertion order is deadline order
            if lingering[first] > now:
                return
            self._apf_end_linger(first)


class LingeringConn(TConn):
    """gthread's connection, whose graceful close (gthread's ``finish_request`` on the main
    loop, after a response that does not keep it alive) lingers in the poller
    (:meth:`Lingering.apf_close_answered`) instead of blocking the main loop up to 2 s.
    ``apf_worker`` is the worker (set when it is made); ``nr_conns`` no longer counts it when
    it is closed gracefully (``finish_request`` decrements before it closes). Its graceful
    close must be called on the main loop only (as gthread does): it registers in the
    poller."""

    apf_worker: Lingering

    def close(self, graceful: bool = False) -> None:
        if graceful:
            self.apf_worker.apf_close_answered(self)
        else:
            TConn.close(self)
