"""A gthread worker that gives a thread only to a complete request it has a thread for.

Design. Stock gthread hands a new connection to a thread as soon as its first byte arrives and
lets the thread parse the rest of the head in blocking mode, so clients that send their head
slowly hold every thread (gunicorn #3518/#3519); and it keeps accepting while every thread is
busy, queueing connections in its executor where APF cannot see them (gunicorn #908, #3433;
``reference/gunicorn-ipc.md`` 1.4). This subclass changes three things:

* **Heads are read in the poller.** A new connection, and a kept-alive one that becomes
  readable, is read non-blocking by the main thread into a buffer until ``gthread/head.py``
  says gunicorn's parser can take it without waiting; the buffer then goes into the parser's
  unreader and the connection to a thread. A head must be complete within
  ``APF_HEADER_TIMEOUT`` (default 10 s) counted from accept, or from its first byte on a
  kept-alive connection, not per read: a late head is answered ``408`` and closed (a
  connection that sent nothing is just closed) and counted in the ledger. So a slow or silent
  client costs a socket, never a thread, and the accept gate only for its first
  ``APF_ACCEPT_GRACE`` (``apf_load``: a burst of connects is spread over the workers). A worker holds at most
  ``APF_HEAD_CONNECTIONS`` reading connections (past it the oldest that sent nothing, else the
  oldest, is closed) and buffers at most ``APF_HEAD_BUFFER_LIMIT`` bytes of incomplete heads
  (past it the largest is answered ``431``); both counted in the ledger. A TLS connection's
  handshake is driven from here too, non-blocking, within the same deadline (``gthread/tls.py``),
  and its head read decrypted: a TLS record
  that arrives in parts is "nothing yet", not the end
  of input. HTTP/2 prior knowledge and uWSGI connections keep gthread's own handling, and so
  does an HTTP/2 connection negotiated by ALPN once its handshake is done.
* **Accepting stops at the thread count.** While the connections that want a thread
  (``apf_load``) reach ``threads - APF_EXEMPT_THREADS`` and another worker has room, or the
  connections handed to threads (open connections less those in the poller: kept alive,
  pending, or reading their head) reach ``threads + APF_ACCEPT_SLACK`` (default 0), the
  listening sockets leave the poller; extra
  connections wait in the kernel's listen backlog shared by all workers, so the next worker
  with a free thread takes them. Kept-alive connections still come back to their worker.
* **Threads are kept for exempt requests.** ``apf_inflight`` holds one entry per thread that a
  non-exempt request holds (running or parked in a queue); the middleware answers a non-exempt
  request 429 (reason ``thread-reserve``) rather than let it take one of the last
  ``APF_EXEMPT_THREADS`` threads, and this class removes the entry when the request's thread
  is done with it (``handle``, ``handle_http2_request``).

While the worker is rejecting (it did in the last second, or its reserve is reached), a
complete head is first offered to ``gthread/pollreject.py``: a request the middleware would
certainly reject is answered ``429`` here, without a thread, and the connection stays in the
poller; a flow that keeps retrying before its Retry-After has its ``429`` held (a socket and a
heap entry, at most ``APF_HELD_REJECTIONS``, not counted by the accept gate) until that is due,
at most 1 s (``apf_reject_here``, ``_apf_release_held``). Each such ``429`` counts towards
gunicorn's ``max_requests`` and is written to gunicorn's access log, as a thread's response is.

It also stamps each connection when it is queued for a thread, so the middleware's wait limit
counts the time spent in gthread's queue (``middleware.hidden.enqueued_ns``).

Override points: ``apf_head_readable`` (a reading connection has bytes),
``apf_start_request`` (a complete head goes to a thread), ``apf_head_expired`` (deadline).

Use ``worker_class = "apf_gunicorn.gthread.worker.ApfThreadWorker"`` (conf.py does).
"""

from __future__ import annotations

import errno
import logging
import selectors
import time
from functools import partial
from time import monotonic_ns

from gunicorn import http
from gunicorn.http.errors import LimitRequestHeaders, LimitRequestLine
from gunicorn.http2 import negotiation
from gunicorn.workers.gthread import STOP_KEEPALIVE_LINGER, ThreadWorker

from apf_gunicorn.admission.boot import FrontEnd
from apf_gunicorn.admission.dispatcher import Parking
from apf_gunicorn.gthread.head import COMPLETE, MORE, HeadRules, HeadScan
from apf_gunicorn.gthread.linger import Lingering, LingeringConn
from apf_gunicorn.gthread.pollanswer import PollerAnswers
from apf_gunicorn.gthread.pollreject import PollerRejector
from apf_gunicorn.gthread.tls import RECV_BYTES, WANT_WRITE, TlsConn, TlsHandshakes, recv_tls
from apf_gunicorn.gthread.wsgi import APFMiddleware, hidden
from apf_gunicorn.server import state, tlscontext
from apf_gunicorn.server.settings import (
    DEFAULT_ACCEPT_GRACE_S,
    DEFAULT_HEAD_BUFFER_LIMIT,
    DEFAULT_HEAD_CONNECTIONS,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_HELD_REJECTIONS,
)

RESERVE_AFTER_S = 0.03
TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\n"
               b"Content-Type: text/plain; charset=utf-8\r\nContent-Length: 24\r\n\r\n"
               b"request head timed out.\n")
HEAD_BUFFER_431 = (b"HTTP/1.1 431 Request Header Fields Too Large\r\nConnection: close\r\n"
                   b"Content-Type: text/plain; charset=utf-8\r\nContent-Length: 33\r\n\r\n"
                   b"server busy with request headers\n")
# reasons of apf_connections_dropped_total (the ledger counts them server-wide)
DROP_HEAD_CONNECTIONS = "head-connections"  # past APF_HEAD_CONNECTIONS: the oldest idle one
DROP_HEAD_BUFFER = "head-buffer"  # past APF_HEAD_BUFFER_LIMIT: the largest head, 431
log = logging.getLogger("apf_gunicorn.worker")


class ApfThreadWorker(FrontEnd, TlsHandshakes, PollerAnswers, Lingering, ThreadWorker):
    #: with ``certfile``, it serves with the master's TLS context (server/tlscontext.py)
    apf_tls_from_master = True

    # Per kept-alive request this class adds, on the main thread, its own readable handler
    # (one recv there instead of in the thread) and enqueue_req, and a sum per main-loop pass
    # (wait_for_and_dispatch_events); on the request thread, handle. They call the base class
    # directly, not through super().

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        m = state.MASTER
        settings = m.settings if m is not None else None
        slack = settings.accept_slack if settings is not None else 0
        reserve = settings.exempt_threads if settings is not None else 0
        self.apf_accept_limit = self.cfg.threads + slack
        # APF_ACCEPT_GRACE: how long a just-accepted connection still sending its head counts
        # as wanting a thread (apf_load)
        self.apf_accept_grace = (settings.accept_grace_s if settings is not None
                                 else DEFAULT_ACCEPT_GRACE_S)
        # below this many busy threads a worker has room for a non-exempt request (the
        # middleware's nonexempt_threads: boot._thread_reserve)
        self.apf_room_limit = self.cfg.threads - reserve
        self._apf_room = None  # last published room flag
        self._apf_load = 0  # connections wanting a thread, at the last apf_load()
        self._apf_all_full_since = 0.0  # when this worker last saw every worker out of room
        # set by post_worker_init to the ledger's worker table; alone, a worker has no peers
        self.apf_publish_room = _no_op
        self.apf_others_have_room = _false
        self.apf_header_timeout = (settings.header_timeout_ns / 1e9 if settings is not None
                                   else DEFAULT_HEADER_TIMEOUT_S)
        self.apf_head_rules = HeadRules.of(self.cfg)
        self.apf_tls = self.cfg.is_ssl
        # reads what a reading or kept-alive connection has (a TLS one: decrypted)
        self.apf_recv = recv_tls if self.apf_tls else _recv
        self.apf_tls_context = None  # set by init_process when apf_tls
        self._apf_proxy = self.apf_head_rules.proxy != "off"
        # reading connections -> None, in deadline order (one timeout, so insertion order)
        self.apf_reading: dict = {}
        # the reading connections that have sent nothing yet, in accept order: they cost a
        # socket and are the first dropped when the worker holds too many (never the gate)
        self.apf_silent: dict = {}
        # the reading connections accepted less than APF_ACCEPT_GRACE ago -> when that ends,
        # in accept order: they count as wanting a thread (apf_load)
        self.apf_young: dict = {}
        self.apf_head_connections = (settings.head_connections if settings is not None
                                     else DEFAULT_HEAD_CONNECTIONS)
        self.apf_head_budget = (settings.head_buffer_limit if settings is not None
                                else DEFAULT_HEAD_BUFFER_LIMIT)
        self.apf_head_bytes = 0  # bytes buffered by the reading connections
        # connections closing after the poller's last answer -> their deadline (linger.py)
        self.apf_lingering: dict = {}
        self.apf_on_drop = None  # callable(reason): count a dropped connection (ledger)
        self.apf_inflight: list = []  # one entry per thread a non-exempt request holds
        self.apf_on_head_timeout = None  # callable(): count a 408 (set by post_worker_init)
        # server/pollreject.PollerRejector (set by post_worker_init): answers 429 without a
        # thread; None: every request goes to a thread
        self.apf_rejector = None
        # 429s held before they are written: a heap of (due, seq, conn, PollerRejector answer)
        self.apf_held: list = []
        self._apf_held_seq = 0
        # APF_HELD_REJECTIONS: past it, 429s are written at once (each held one costs a
        # socket and a heap entry)
        self.apf_held_max = (settings.held_rejections if settings is not None
                             else DEFAULT_HELD_REJECTIONS)
        self._apf_keepalive_s = self.cfg.keepalive  # (read once: the config's getattr is slow)
        self._apf_keepalive_on = bool(self._apf_keepalive_s)
        # gunicorn's access log is on: the poller's 429s are logged there (set by apf_attach)
        self.apf_access_log = True
        # callable(level, fs_index, reason): count a held 429 (ledger.count_rejection_delayed)
        self.apf_on_delayed = None
        self.apf_hidden_wait_max_ns = 0
        self.apf_hidden_wait_sum_ns = 0
        self.apf_handled = 0

    # -- the front end's override points (admission/boot.py: FrontEnd) ------------------------

    def apf_parking(self) -> Parking:
        return Parking()

    def apf_context(self) -> dict:
        # the thread reserve: the threads non-exempt requests hold, and how many they may
        return {"inflight": self.apf_inflight, "nonexempt_threads": self.apf_room_limit}

    def apf_app(self):
        return self.wsgi

    def apf_attach(self, ctx, ledger) -> APFMiddleware:
        index = ctx.owner
        self.apf_on_head_timeout = ledger.count_head_timeout
        self.apf_on_drop = ledger.count_connection_dropped
        self.apf_publish_room = partial(ledger.set_worker_room, index)
        self.apf_others_have_room = partial(ledger.other_worker_has_room, index)
        middleware = APFMiddleware(self.wsgi, ctx)
        self.wsgi = middleware
        rejector = PollerRejector(middleware, self.cfg)
        self.apf_rejector = rejector if rejector.enabled else None
        # gunicorn decides it once per logger (Logger.setup), and a worker's logger is set up
        # once: a reload starts new workers
        self.apf_access_log = bool(getattr(self.log, "access_log_enabled", True))
        self.apf_on_delayed = ledger.count_rejection_delayed
        return middleware

    def init_process(self):
        # The TLS context is the master's (server/tlscontext.py: made at start and on HUP,
        # kept when a reload's files fail), so a worker never fails its boot over the files,
        # which would halt the server. Stock gthread makes one per connection, in its thread.
        if self.apf_tls:
            context = tlscontext.current()
            if context is None:  # the master's hooks are not installed: make it here
                try:
                    context = tlscontext.make(self.cfg)
                except tlscontext.TlsContextError as e:
                    self.log.error("apf: %s", e)
                    raise
            self.apf_tls_context = context
        super().init_process()

    def apf_load(self) -> int:
        """Connections that want a thread now: handed to the executor (running or queued
        there), kept alive (they come back to this worker), or accepted less than
        ``APF_ACCEPT_GRACE`` ago and still sending their head (a burst of connects is
        accepted before its heads arrive: counting them spreads it over the workers). Not
        counted: one reading its head past that grace (it costs a socket, not a thread, until
        its head is complete), one waiting for its first byte after a thread deferred it
        (``pending_conns``), a held 429. The one sum the accept gate, :attr:`apf_busy` and
        ``max_keepalived`` use; kept as ``_apf_load``."""
        young = self.apf_young
        if young:
            self._apf_age_young()
        load = self._apf_load = (self.nr_conns - len(self.pending_conns)
                                 - len(self.apf_reading) + len(young) - len(self.apf_held))
        return load

    def _apf_age_young(self) -> None:
        """Stop counting the connections whose accept grace is over."""
        young = self.apf_young
        now = time.monotonic()
        while young:
            first = next(iter(young))  # accept order is expiry order
            if young[first] > now:
                return
            del young[first]

    @property
    def apf_busy(self) -> int:
        """Connections handed to the executor and not yet back (running or queued there):
        :meth:`apf_load` less the kept-alive and the just-accepted ones. (Just-accepted ones
        only move the room: connections that never send must not stop a worker whose every
        peer is out of room from accepting on its reserve.)"""
        return self.apf_load() - len(self.keepalived_conns) - len(self.apf_young)

    # -- the accept gate ----------------------------------------------------------------------

    def apf_may_accept(self) -> bool:
        """Whether to accept now: while this worker has room for a non-exempt request (its
        connections in threads, arriving, or kept alive stay below ``threads -
        APF_EXEMPT_THREADS``), or, when every worker is out of room, while its reserve has a
        thread (then the exempt requests among new connections run, the others are answered
        429 at once). Publishes this worker's room flag when it changes."""
        load = self.apf_load()
        room = load < self.apf_room_limit and self.alive
        if room is not self._apf_room:
            self._apf_room = room
            self.apf_publish_room(room)
        if room:
            self._apf_all_full_since = 0.0
            return True
        if self.apf_others_have_room():
            self._apf_all_full_since = 0.0
            return False
        if self.apf_busy >= self.apf_accept_limit:
            return False  # (every worker still out of room: no new grace period after this)
        # Every worker is out of room. Accept on the reserve only once that has lasted
        # RESERVE_AFTER_S: a flag another worker has not yet updated (it has not run since a
        # request finished) must not turn a request away that it could have served.
        now = time.monotonic()
        if not self._apf_all_full_since:
            self._apf_all_full_since = now
        return now - self._apf_all_full_since >= RESERVE_AFTER_S

    def set_accept_enabled(self, enabled):
        if enabled and not self.apf_may_accept():
            return  # stays off; run() asks again on its next pass
        ThreadWorker.set_accept_enabled(self, enabled)

    def wait_for_and_dispatch_events(self, timeout):
        # Once per pass of the main loop: the accept gate (the common case, room and
        # accepting, costs one sum), gthread's poll and dispatch (as its own method does, one
        # Python frame less per pass), then the request heads past their deadline.
        reading = self.apf_reading
        held = self.apf_held
        lingering = self.apf_lingering
        if self.apf_load() >= self.apf_room_limit or not (self._accepting and self._apf_room):
            timeout = self._apf_gate(timeout)
        if held:
            timeout = max(0.0, min(timeout, held[0][0] - time.monotonic()))
        try:
            for key, _ in self.poller.select(timeout):
                key.data(key.fileobj)
        except OSError as e:
            if e.errno != errno.EINTR:
                raise
        if reading:
            self._apf_expire_heads()
        if held:
            self._apf_release_held()
        if lingering:
            self.apf_expire_lingering()

    def _apf_gate(self, timeout: float) -> float:
        """Accept or not, as :meth:`apf_may_accept` says; the poll timeout to use."""
        if self.apf_may_accept() or not self.alive:
            return timeout
        if self._accepting:
            ThreadWorker.set_accept_enabled(self, False)
        if self.apf_busy < self.apf_accept_limit:
            # out of room with a free reserve thread: look again soon, so when the other
            # workers run out too, exempt requests are accepted within ~50 ms
            return min(timeout, 0.025)
        young = self.apf_young
        if young:  # look again when the first accept grace ends
            return min(timeout, max(0.0, next(iter(young.values())) - time.monotonic()))
        return timeout

    @property
    def max_keepalived(self) -> int:
        """gthread closes a connection after its response when this many are kept alive: here
        also when the worker holds more connections that may come back than it has threads
        for non-exempt requests (it accepted on its exempt reserve): those clients would come
        back to no thread while other workers may have one, so they reconnect through the
        accept gate instead. Keeping a connection alive does not add to the load, which counts
        it already, so a worker at exactly its room keeps its clients. (The load is the one the
        main loop's last pass computed.)"""
        return self._apf_keepalive_max if self._apf_load <= self.apf_room_limit else 0

    @max_keepalived.setter
    def max_keepalived(self, value: int) -> None:
        self._apf_keepalive_max = value

    # -- reading heads in the poller --------------------------------------------------------

    def _apf_reads_heads(self, client) -> bool:
        cfg = self.cfg
        # (HTTP/2 prior knowledge is for cleartext connections only: gthread checks TLS first)
        return (getattr(cfg, "protocol", "http") == "http"
                and (self.apf_tls or not negotiation.prior_knowledge_allowed(cfg, client)))

    def accept(self, listener):
        if not self.apf_may_accept():  # a connection earlier in this poll took the last room
            ThreadWorker.set_accept_enabled(self, False)
            return
        try:
            client_sock, client_addr = listener.accept()
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        self.nr_conns += 1
        reads = self._apf_reads_heads(client_addr)
        conn = _new_conn(self, client_sock, client_addr, listener.getsockname(),
                         reads and self.apf_tls)
        if not reads:
            self.enqueue_req(conn)
            return
        now = time.monotonic()
        if self.apf_tls:
            self._apf_tls_accept(conn, now + self.apf_header_timeout)
        else:
            conn.parser = http.get_parser(self.cfg, conn.sock, client_addr)
            self._apf_read_head(conn, now + self.apf_header_timeout)
        reading = self.apf_reading
        if conn in reading:
            self.apf_young[conn] = now + self.apf_accept_grace
            if not conn.apf_buf:  # nothing arrived yet
                self.apf_silent[conn] = None
        if reading and (len(reading) > self.apf_head_connections
                        or self.nr_conns >= self.worker_connections):
            self._apf_drop_idle(conn)

    def _apf_leave_reading(self, conn) -> None:
        """A connection leaves the reading state without closing (a TLS one whose ALPN chose
        HTTP/2, before it sent a byte of a head)."""
        buf = conn.apf_buf
        self.apf_head_bytes -= len(buf)
        conn.apf_buf = conn.apf_scan = None
        self.apf_silent.pop(conn, None)
        self.apf_young.pop(conn, None)
        if self.apf_reading.pop(conn, 0) is None:
            self.poller.unregister(conn.sock)

    def _apf_drop_idle(self, new) -> None:
        """The worker holds more reading connections than ``APF_HEAD_CONNECTIONS`` (or as many
        connections as gthread's ``worker_connections``, at which it would stop accepting):
        close the oldest that has sent nothing, else the oldest reading one. A client sends
        its head right after it connects, so a connection that has sent nothing for longest
        is the likeliest to be idle (a pre-opened pool, a scan, an attack), and the oldest
        reading one has had the most time to finish its head: both are nearest their
        deadline anyway. ``new`` (just accepted) is spared while an older one can go, so a
        client whose head is a moment behind its connection is not the one dropped."""
        silent = self.apf_silent
        victim = next(iter(silent)) if silent else None
        if victim is None or victim is new:
            victim = next(iter(self.apf_reading))
        self._apf_count_drop(DROP_HEAD_CONNECTIONS)
        self._apf_close(victim)

    def _apf_count_drop(self, reason: str) -> None:
        count = self.apf_on_drop
        if count is not None:
            count(reason)

    def on_client_socket_readable(self, conn, client):
        """A kept-alive connection has bytes: read its next head here, not in a thread."""
        data = self.apf_recv(conn.sock)
        if data and data.find(b"\r\n\r\n") >= 0:  # the usual case: the whole head at once
            rejector = self.apf_rejector
            # (a 429 answered here leaves the connection registered and kept alive)
            if (rejector is not None and (rejector.hot() or self._apf_reserve_full())
                    and self.apf_reject_here(conn, data, True)):
                return
            self.poller.unregister(client)
            self.keepalived_conns.remove(conn)
            self._apf_to_thread(conn, data)
            return
        self.poller.unregister(client)
        self.keepalived_conns.remove(conn)
        self._apf_read_head(conn, time.monotonic() + self.apf_header_timeout, data)

    def _apf_read_head(self, conn, deadline: float, first: bytes | None = None) -> None:
        """Read the connection's head in the poller until ``deadline``; ``first``: what was
        already received (b"": the end of input), None: nothing yet."""
        conn.apf_buf = bytearray()
        conn.apf_scan = None
        conn.timeout = deadline
        if self.apf_head_readable(conn, first):  # usually the whole head is there already
            return
        self.apf_reading[conn] = None
        # (a TLS one's read may wait for room to write: conn.apf_events, _apf_tls_event)
        self.poller.register(conn.sock, conn.apf_events,
                             partial(self._apf_on_tls_event if self.apf_tls
                                     else self._apf_on_readable, conn))

    def _apf_on_readable(self, conn, client) -> None:
        if conn.apf_buf is None:  # closed earlier in this poll's events (dropped)
            return
        # (a head that is done leaves the reading state in apf_start_request or _apf_close)
        self.apf_head_readable(conn)

    def apf_head_readable(self, conn, data: bytes | None = None) -> bool:
        """Read what the connection has (or take ``data``, already read); True when it has
        left the reading state (handed to a thread or closed)."""
        buf = conn.apf_buf
        if data is None:
            data = self.apf_recv(conn.sock)
            if data is None:
                return False
        if not data:  # end of input (or reset): the parser reports what is incomplete
            if data is WANT_WRITE:  # TLS must send first: wait for room, then read again
                self._apf_tls_wait(conn, selectors.EVENT_WRITE)
                return False
            if not buf:
                self._apf_close(conn)
                return True
            self.apf_start_request(conn)
            return True
        if not buf and self.apf_silent:
            self.apf_silent.pop(conn, None)
        buf += data
        self.apf_head_bytes += len(data)
        scan = conn.apf_scan
        if scan is None:
            first = conn.parser.req_count == 0
            if (not (first and self._apf_proxy)) and buf.find(b"\r\n\r\n") >= 0:
                self.apf_start_request(conn)  # the usual case: the whole head in one read
                return True
            scan = conn.apf_scan = HeadScan(first, conn.client)
        st = scan.state(buf, self.apf_head_rules)
        if st == MORE:
            if self.apf_head_bytes > self.apf_head_budget:
                return self._apf_over_budget(conn)
            return False
        if st == COMPLETE:
            self.apf_start_request(conn)
        else:  # TOO_LARGE: answered here as gunicorn would, without reading on
            exc = (LimitRequestHeaders("max buffer headers") if scan.line_ended
                   else LimitRequestLine(len(buf), self.apf_head_rules.limits.line))
            self.handle_error(None, conn.sock, conn.client, exc)
            self._apf_close(conn, answered=True)
        return True

    def _apf_over_budget(self, conn) -> bool:
        """The reading connections buffer more than ``APF_HEAD_BUFFER_LIMIT``: answer 431 to
        the largest heads (``conn``, just read, among them) until they fit again. A real head
        is rarely more than a few KiB; the largest buffers are the likeliest abuse and free
        the most. Complete heads have left the buffer already and are never touched. Returns
        whether ``conn`` was one of them (it has left the reading state)."""
        reading = self.apf_reading
        size = _buffered
        while self.apf_head_bytes > self.apf_head_budget:
            victim = max(reading, key=size) if reading else conn
            if conn.apf_buf is not None and size(conn) >= size(victim):
                victim = conn
            try:
                victim.sock.send(HEAD_BUFFER_431)
            except OSError:
                pass
            self._apf_count_drop(DROP_HEAD_BUFFER)
            self._apf_close(victim, answered=True)
        return conn.apf_buf is None

    def apf_start_request(self, conn) -> None:
        """The head is complete: its bytes go to the parser's buffer, the connection to a
        thread (gunicorn's ``handle`` finds ``data_ready`` and does not wait again)."""
        buf = conn.apf_buf
        self.apf_head_bytes -= len(buf)
        conn.apf_buf = conn.apf_scan = None
        if self.apf_reading.pop(conn, 0) is None:  # it was read over several polls
            self.apf_young.pop(conn, None)
            try:
                self.poller.unregister(conn.sock)
            except (KeyError, ValueError, OSError):
                pass
        data = bytes(buf)
        rejector = self.apf_rejector
        if (rejector is not None and (rejector.hot() or self._apf_reserve_full())
                and self.apf_reject_here(conn, data)):
            return
        self._apf_to_thread(conn, data)

    def _apf_to_thread(self, conn, data: bytes) -> None:
        """Hand a connection whose head the poller read (``data``) to a thread: the bytes go
        to the parser's buffer, and ``data_ready`` tells gthread's ``handle`` not to wait on
        the socket for them (a connection whose requests were all answered 429 here was
        never initialized by a thread; without it, handle would wait, defer, and the client
        would get no answer). gthread's handle makes the socket blocking again."""
        conn.parser.unreader.unread(data)
        conn.data_ready = True
        self.enqueue_req(conn)

    def apf_head_expired(self, conn) -> None:
        """Past the head deadline: 408 if the client sent part of a head, then close."""
        answered = bool(conn.apf_buf)
        if answered:
            count = self.apf_on_head_timeout
            if count is not None:
                count()
            try:
                conn.sock.send(TIMEOUT_408)
            except OSError:
                pass
        self._apf_close(conn, answered)

    def _apf_close(self, conn, answered: bool = False) -> None:
        """Close a reading connection; ``answered``: after an answer written to it (then
        gracefully, as gunicorn closes after a response: ``linger.py``)."""
        buf = conn.apf_buf
        if buf is not None:
            self.apf_head_bytes -= len(buf)
            conn.apf_buf = conn.apf_scan = None
        self.apf_reading.pop(conn, None)
        self.apf_silent.pop(conn, None)
        self.apf_young.pop(conn, None)
        try:
            self.poller.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        self.nr_conns -= 1
        if answered:
            self.apf_close_answered(conn)
        else:
            conn.close()

    def _apf_expire_heads(self) -> None:
        """Close the reading connections past their head deadline (408 if they sent part of
        a head)."""
        now = time.monotonic()
        if not self.alive:  # stopping: finish a head within the keep-alive linger, at most
            cap = now + STOP_KEEPALIVE_LINGER
            for conn in self.apf_reading:
                if conn.timeout > cap:
                    conn.timeout = cap
        expired = []
        for conn in self.apf_reading:  # insertion order is deadline order while alive
            if conn.timeout > now:
                if self.alive:
                    break
                continue
            expired.append(conn)
        for conn in expired:
            self.apf_head_expired(conn)

    # -- handing connections to threads ---------------------------------------------------

    def enqueue_req(self, conn):
        conn.apf_enqueued_ns = monotonic_ns()
        ThreadWorker.enqueue_req(self, conn)
        # (no accept check here: the main loop's next pass makes it before it accepts again)

    def handle(self, conn):
        t = conn.apf_enqueued_ns
        hidden.enqueued_ns = t
        hidden.held = False
        waited = monotonic_ns() - t
        self.apf_handled += 1
        self.apf_hidden_wait_sum_ns += waited
        if waited > self.apf_hidden_wait_max_ns:
            self.apf_hidden_wait_max_ns = waited
        try:
            return ThreadWorker.handle(self, conn)
        finally:
            if hidden.held:
                hidden.held = False
                self.apf_inflight.pop()

    def handle_http2_request(self, req, conn, h2_conn):
        # One thread serves every stream of an HTTP/2 connection: give each stream's entry
        # back when that stream is done. The first stream waited in gthread's queue with its
        # connection; a later one arrived when it was read (0: the middleware takes its
        # admission time), not when the connection did, or it would start past its wait limit.
        hidden.held = False
        hidden.enqueued_ns = conn.apf_enqueued_ns
        conn.apf_enqueued_ns = 0
        try:
            return ThreadWorker.handle_http2_request(self, req, conn, h2_conn)
        finally:
            if hidden.held:
                hidden.held = False
                self.apf_inflight.pop()


def _recv(sock) -> bytes | None:
    """What a non-blocking socket has: None if nothing yet, b"" at its end or on an error."""
    try:
        return sock.recv(RECV_BYTES)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


def _buffered(conn) -> int:
    return len(conn.apf_buf)


def _no_op(_room: bool) -> None:
    pass


def _false() -> bool:
    return False


def _new_conn(worker, sock, client, server, tls: bool = False):
    """A gthread connection (non-blocking from here) with this worker's fields; ``tls``: one
    whose handshake the poller makes."""
    conn = (TlsConn if tls else LingeringConn)(worker.cfg, sock, client, server)
    conn.apf_worker = worker  # its graceful close lingers in the worker's poller (linger.py)
    conn.apf_handshake = False
    conn.apf_events = selectors.EVENT_READ
    conn.apf_buf = None
    conn.apf_enqueued_ns = 0
    conn.apf_scan = None
    return conn
