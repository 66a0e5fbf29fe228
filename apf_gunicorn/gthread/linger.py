"""Closing a connection after the poller's last answer on it as gunicorn does, without waiting.

gunicorn closes a connection after a response with ``util.close_graceful``: it shuts the write
side (the client reads the response, then the end of input), reads and drops what the client
still sends until the client closes, 64 KiB or 2 s, then closes. A plain ``close()`` with bytes
unread (a client that pipelined a request behind one answered ``Connection: close``) makes the
kernel send a reset, which can destroy the answer before the client has read it and ends the
connection with ``ECONNRESET`` instead of the end of input. ``close_graceful`` blocks while it
reads; the poller must not, so :class:`Lingering` makes the same steps from the poller's
events. A TLS connection first sends its ``close_notify`` alert (``unwrap``, non-blocking: the
alert is written at once, the client's own is not waited for), so a client that checks for a
truncation attack sees a clean end. Used for the poller's ``429`` (``pollanswer.py``) and its
``408`` and ``431`` (``worker.py``); a connection closed without an answer (a dropped idle one,
a failed handshake) is closed at once.

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

#: gunicorn's ``close_graceful``: how long to wait for the client's end, and how much to read
LINGER_S = 2.0
LINGER_BYTES = 65536


class Lingering:
    """The poller's graceful close; a mixin of ``ApfThreadWorker`` (uses its ``poller`` and
    ``worker_connections``)."""

    #: connections lingering -> when they are closed at the latest, in that order
    apf_lingering: dict

    def apf_close_answered(self, conn) -> None:
        """Close ``conn`` after its last answer was written: shut its write side (a TLS one
        sends ``close_notify`` first), then read and drop what it still sends until it ends,
        ``LINGER_BYTES`` or ``LINGER_S``. ``conn`` is in no table of the worker and not
        registered in the poller; ``nr_conns`` no longer counts it."""
        sock = conn.sock
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
