"""TLS in the gthread worker's poller: the handshake, then the head, without a thread.

Stock gthread wraps a new TLS connection and makes its handshake in a request thread, which
waits for the client meanwhile; the APF worker drives the handshake from its poller, each
non-blocking step made on one handshake thread of its own (so the key work of a flood of
ClientHellos never stalls the poller's accepts and head reads), then reads the head in the
poller, so a TLS connection is gated, timed out (408), budgeted (431) and rejected (429) from
its head like a plaintext one, and holds no request thread while it sends nothing.
:class:`TlsHandshakes` is the worker's mixin (``ApfThreadWorker`` calls ``_apf_tls_accept`` for
each connection it accepts on a TLS listener); :func:`recv_tls` reads what a TLS socket has,
decrypted; :class:`TlsConn` is the connection a thread then serves. Limits (docs/server.md):
a worker makes one handshake at a time; a renewed certificate needs a HUP.
"""

from __future__ import annotations

import os
import selectors
import ssl
import sys
import threading
import time
from functools import partial

from gunicorn import http
from gunicorn import sock as gsock

from apf_gunicorn.gthread.linger import LingeringConn

RECV_BYTES = 8192  # gunicorn reads 8 KiB at a time too; a larger head takes more passes


#: a handshake step's outcome: the handshake is done
DONE = "done"
#: The handshake thread's nice value (Linux: per thread), above the worker's other threads:
#: when the CPU is contended the poller and the request threads come first, and the handshakes
#: still get about a tenth of a contended core (CFS weights 110 against 1024); an idle core
#: they get whole. (benchmarks/bench_tls_flood.py measures why: docs/server.md.)
HANDSHAKE_NICE = 10


def handshake_thread_priority() -> None:
    """Lower the calling thread's CPU priority by :data:`HANDSHAKE_NICE` (Linux only: there
    ``setpriority`` on a thread id changes that thread alone; elsewhere it is left as is)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid)
                       + HANDSHAKE_NICE)
    except OSError:
        pass


class TlsHandshakes:
    """The poller's TLS handshakes, their key work on the handshake thread; a mixin of
    ``ApfThreadWorker`` (uses its reading-state tables, ``poller``, ``method_queue``, ``cfg``,
    ``log``, ``apf_head_readable``, ``_apf_close`` and ``apf_tls_pool``: one thread)."""

    def _apf_tls_accept(self, conn, deadline: float) -> None:
        """Wrap a new connection for TLS and make its handshake, then read its head in the
        poller (:meth:`_apf_tls_event`); all within ``deadline``. Until its handshake is done
        it is a reading connection that has sent nothing (``apf_silent``), so it is among
        the first dropped past ``APF_HEAD_CONNECTIONS``."""
        try:
            conn.sock = self.apf_tls_context.wrap_socket(
                conn.sock, server_side=True, do_handshake_on_connect=False,
                suppress_ragged_eofs=self.cfg.suppress_ragged_eofs)
        except OSError as e:
            # A client that reset the connection before it was accepted: the wrap's own
            # probe (getpeername ENOTCONN, then recv) raises ECONNRESET. gthread wraps in a
            # thread for this reason; here, on the main thread, it closes this connection
            # only (the wrap detached the socket: the fd closes with the lost SSLSocket).
            self.log.debug("TLS wrap of %s failed: %s", conn.client, e)
            self._apf_close(conn)
            return
        conn.apf_buf = bytearray()
        conn.apf_scan = None
        conn.apf_handshake = True
        conn.timeout = deadline
        self.apf_reading[conn] = None
        self._apf_tls_submit(conn)  # (its ClientHello has usually arrived with it)

    def _apf_on_tls_event(self, conn, client) -> None:
        if conn.apf_buf is None:  # closed earlier in this poll's events (dropped)
            return
        self._apf_tls_event(conn)

    def _apf_tls_event(self, conn) -> bool:
        """The connection is readable (or writable, when it waited for room): a handshake
        takes its next step on the handshake thread; a done one reads its head. True when
        the connection has left the reading state (handed to a thread or closed)."""
        if conn.apf_handshake:
            self.poller.unregister(conn.sock)  # (its step's outcome registers it again)
            self._apf_tls_submit(conn)
            return False
        if conn.apf_events != selectors.EVENT_READ:
            # it waited for room to write (recv_tls said WANT_WRITE): read again
            self._apf_tls_wait(conn, selectors.EVENT_READ)
        return self.apf_head_readable(conn)

    def _apf_tls_submit(self, conn) -> None:
        """Make the connection's next handshake step (the ClientHello's: the key share and
        the certificate's signature, the costly part) on the handshake thread, not on the
        poller, which meanwhile reads heads and accepts. The connection is not registered
        in the poller until the step's outcome is back (:meth:`_apf_tls_stepped`), and is
        not closed meanwhile (``_apf_close`` marks it ``apf_doomed``)."""
        conn.apf_stepping = True
        self.apf_tls_steps += 1
        self.apf_tls_pool.submit(self._apf_tls_step, conn)

    def _apf_tls_step(self, conn) -> None:
        """On the handshake thread: one non-blocking step (OpenSSL releases the GIL in it),
        skipped for a connection closed while it waited; its outcome goes to the poller."""
        outcome: object = None
        if not conn.apf_doomed:
            try:
                conn.sock.do_handshake()
                outcome = DONE
            except ssl.SSLWantReadError:
                outcome = selectors.EVENT_READ
            except ssl.SSLWantWriteError:  # the kernel's send buffer is full: wait for room
                outcome = selectors.EVENT_WRITE
            except Exception as e:  # (ssl.SSLError, OSError among them) a failed handshake
                outcome = e
        self.method_queue.defer(self._apf_tls_stepped, conn, outcome)

    def _apf_tls_stepped(self, conn, outcome) -> None:
        """On the poller: a handshake step's outcome (see :meth:`_apf_tls_step`)."""
        conn.apf_stepping = False
        self.apf_tls_steps -= 1
        if conn.apf_doomed:  # closed while its step ran (dropped, past its deadline)
            conn.close()
            return
        if isinstance(outcome, int):  # wait for bytes (or room), then step again
            conn.apf_events = outcome
            self.poller.register(conn.sock, outcome, partial(self._apf_on_tls_event, conn))
            return
        if outcome is not DONE:  # a failed handshake: no answer
            self.log.debug("TLS handshake with %s failed: %s", conn.client, outcome)
            self._apf_close(conn)
            return
        conn.apf_handshake = False
        conn.apf_events = selectors.EVENT_READ
        # from now on it may send a head: it counts as wanting a thread for its accept grace
        # (apf_load; a connection queued for its handshake does not: it cannot send one yet,
        # and a flood of ClientHellos would otherwise close the accept gate and kept-alive
        # connections)
        self.apf_young[conn] = time.monotonic() + self.apf_accept_grace
        tls = conn.sock
        self.poller.register(tls, selectors.EVENT_READ, partial(self._apf_on_tls_event, conn))
        if gsock.is_http2_negotiated(tls):
            # ALPN chose HTTP/2: its thread makes the HTTP/2 parser (TlsConn.init)
            self._apf_leave_reading(conn)
            self.enqueue_req(conn)
            return
        conn.parser = http.get_parser(self.cfg, tls, conn.client)
        self.apf_head_readable(conn)  # (the head may have come with the client's Finished)

    def _apf_tls_wait(self, conn, events: int) -> None:
        """Wait for ``events`` on a reading TLS connection whose handshake is done (a read
        that wants to write waits for room in the send buffer, then reads again); registered
        or not yet (then its registration takes ``conn.apf_events``)."""
        if conn in self.apf_reading and conn.apf_events != events:
            self.poller.modify(conn.sock, events, partial(self._apf_on_tls_event, conn))
        conn.apf_events = events


class _WantWrite:
    """:func:`recv_tls`'s answer when TLS must write before it reads on: false, like the end
    of input, so the common path tests it only where it tests for that end."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "WANT_WRITE"


WANT_WRITE = _WantWrite()


def recv_tls(sock) -> bytes | _WantWrite | None:
    """What a non-blocking TLS socket has, decrypted: None if nothing yet (also when only
    part of a TLS record has arrived: ``SSLWantReadError``), b"" at its end or on an error,
    :data:`WANT_WRITE` when TLS has to send first and the send buffer is full
    (``SSLWantWriteError``: a renegotiation or key update; the caller waits for room to
    write, not for bytes to read, which might never come). Reads what the TLS layer holds
    decrypted too (``pending``): it would not make the socket readable again."""
    try:
        data = sock.recv(RECV_BYTES)
    except ssl.SSLWantReadError:
        return None
    except ssl.SSLWantWriteError:
        return WANT_WRITE
    except OSError:  # (ssl.SSLError among them)
        return b""
    while data:
        more = sock.pending()
        if not more:
            break
        try:
            data += sock.recv(more)
        except OSError:
            break
    return data


class TlsConn(LingeringConn):
    """A TLS connection whose handshake the poller made (``ApfThreadWorker._apf_tls_event``):
    its socket is wrapped already, and its parser set (HTTP/1) or left to make here
    (HTTP/2 chosen by ALPN), where stock gthread's ``init`` would wrap the socket again."""

    def init(self):
        if self.initialized:
            return
        self.initialized = True
        self.sock.setblocking(True)
        if self.parser is None:
            self.is_http2 = True
            self.parser = http.get_parser(self.cfg, self.sock, self.client,
                                          http2_connection=True)
            self.parser.initiate_connection()
