"""TLS in the gthread worker's poller: the handshake, then the head, without a thread.

Stock gthread wraps a new TLS connection and makes its handshake in a thread; the APF worker
makes both in its poller, so a TLS connection is gated, timed out (408), budgeted (431) and
rejected (429) from its head like a plaintext one, and holds no thread while it sends nothing.
:class:`TlsHandshakes` is the worker's mixin (``ApfThreadWorker`` calls ``_apf_tls_accept`` for
each connection it accepts on a TLS listener); :func:`recv_tls` reads what a TLS socket has,
decrypted; :class:`TlsConn` is the connection a thread then serves. Limits (docs/server.md):
handshakes run one at a time on the worker's main thread; a renewed certificate needs a HUP.
"""

from __future__ import annotations

import selectors
import ssl
from functools import partial

from gunicorn import http
from gunicorn import sock as gsock

from apf_gunicorn.gthread.linger import LingeringConn

RECV_BYTES = 8192  # gunicorn reads 8 KiB at a time too; a larger head takes more passes


class TlsHandshakes:
    """The poller's TLS handshake; a mixin of ``ApfThreadWorker`` (uses its reading-state
    tables, ``poller``, ``cfg``, ``log`` and ``apf_head_readable``)."""

    def _apf_tls_accept(self, conn, deadline: float) -> None:
        """Wrap a new connection for TLS and make its handshake in the poller, then read its
        head there (:meth:`_apf_tls_event`); all within ``deadline``. Until its handshake is
        done it is a reading connection that has sent nothing (``apf_silent``), so it is
        among the first dropped past ``APF_HEAD_CONNECTIONS``."""
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
        if self._apf_tls_event(conn):
            return
        self.apf_reading[conn] = None
        self.poller.register(conn.sock, conn.apf_events, partial(self._apf_on_tls_event, conn))

    def _apf_on_tls_event(self, conn, client) -> None:
        if conn.apf_buf is None:  # closed earlier in this poll's events (dropped)
            return
        self._apf_tls_event(conn)

    def _apf_tls_event(self, conn) -> bool:
        """Advance the handshake while it lasts, then read the head; True when the connection
        has left the reading state (handed to a thread or closed)."""
        if conn.apf_handshake:
            tls = conn.sock
            try:
                tls.do_handshake()
            except ssl.SSLWantReadError:
                self._apf_tls_wait(conn, selectors.EVENT_READ)
                return False
            except ssl.SSLWantWriteError:  # the kernel's send buffer is full: wait for room
                self._apf_tls_wait(conn, selectors.EVENT_WRITE)
                return False
            except OSError as e:  # (ssl.SSLError among them) a failed handshake: no answer
                self.log.debug("TLS handshake with %s failed: %s", conn.client, e)
                self._apf_close(conn)
                return True
            conn.apf_handshake = False
            self._apf_tls_wait(conn, selectors.EVENT_READ)
            if gsock.is_http2_negotiated(tls):
                # ALPN chose HTTP/2: its thread makes the HTTP/2 parser (TlsConn.init)
                self._apf_leave_reading(conn)
                self.enqueue_req(conn)
                return True
            conn.parser = http.get_parser(self.cfg, tls, conn.client)
        elif conn.apf_events != selectors.EVENT_READ:
            # it waited for room to write (recv_tls said WANT_WRITE): read again
            self._apf_tls_wait(conn, selectors.EVENT_READ)
        return self.apf_head_readable(conn)

    def _apf_tls_wait(self, conn, events: int) -> None:
        """Wait for ``events`` on a reading TLS connection (one whose handshake or read wants
        to write waits for room in the send buffer, then reads again); registered or not yet
        (then its registration takes ``conn.apf_events``)."""
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
