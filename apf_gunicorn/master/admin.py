"""The admin HTTP endpoint the master serves: metrics, debug dumps, health.

    admin = AdminServer("127.0.0.1:9180", state_provider, prefix="apf")
    admin.start()          # when_ready: a daemon thread; False (logged) if the port is taken
    admin.close_in_child() # post_fork: the worker must not hold the listening socket
    admin.stop()           # on_exit

``state_provider()`` returns a :class:`~apf_gunicorn.master.metrics.MasterView` (ledger,
level limits, borrowing states, number of registered workers); a ``server.state.MasterState``
may be passed instead and is read through ``view_of_master_state`` (its settings also give the
metrics prefix). Paths:

* ``/metrics``: Prometheus text read from the shared ledger at scrape time (per-request
  counters and histograms, exact gauges), plus the application's own multiprocess files when
  ``PROMETHEUS_MULTIPROC_DIR`` is set;
* ``/debug/api_priority_and_fairness/dump_priority_levels``, ``.../dump_queues``,
  ``.../dump_requests`` (``?includeRequestDetails=1`` adds the request columns), Kubernetes'
  text; ``?includeFairness=1`` appends each level's fairness and virtual time to the
  first two, ``?includeSeats=1`` its nominal, current and used seats to the first, and a
  last line with the applied configuration's generation and digest;
  ``.../dump_flows`` lists the active flows of ``maxmin`` levels, ``.../dump_pools`` the
  app's connection pools server-wide, ``.../dump_cpu`` the workers' and the host's CPU
  (``dumps.py``);
* ``/healthz``: 200 while the master serves; ``/readyz``: 200 once the ledger is configured and
  at least one worker has registered, else 503;
* anything else: 404.

One thread serves every connection from a selector loop, non-blocking: a connection holds no
thread while its request arrives, only a buffer of at most :data:`MAX_HEAD_BYTES`. Each
connection has one deadline, ``timeout`` seconds (default 10) from accept, covering its request
head, any body and the response: a client still sending when it passes is answered ``408`` and
closed, whatever the pace of its bytes (a per-read timeout would let a trickle live forever). A
complete request is answered at once, from the loop, and the connection closed
(``Connection: close``: scrapes are seconds apart). So a slowloris or a flood costs sockets,
never the scrapes: up to :data:`MAX_CONNECTIONS` (256) may be open at once, and a connection
beyond that takes the place of the one idle the longest (no byte received or sent for the
longest time: a client that connected and sent nothing, a trickler, a reader that stopped
reading), which is closed and counted (``dropped``). A scraper sends its request as soon as it
connects and is answered in the same pass, so it is never the one idle the longest unless the
cap's worth of connections arrive in between. Only when no connection can make room (a
``max_connections`` of 0) is a new one answered ``503`` and closed. The listening socket is
close-on-exec (Python's default), so a USR2 re-exec does not inherit it; forked workers close
it in ``post_fork`` through :meth:`close_in_child`. A second master (USR2) finding the port
taken logs a clear message and runs without an admin endpoint.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import threading
import time
from collections import OrderedDict
from typing import Any
from urllib.parse import parse_qs, urlsplit

from apf_gunicorn.master.metrics import view_of_master_state
from apf_gunicorn.server import dumps

log = logging.getLogger("apf_gunicorn.admin")

DEFAULT_BIND = "127.0.0.1:9180"
DUMP_PREFIX = "/debug/api_priority_and_fairness/"
DUMPS = ("dump_priority_levels", "dump_queues", "dump_requests", "dump_flows", "dump_pools",
         "dump_cpu")
TEXT = "text/plain; charset=utf-8"
# Connections open at once; one more takes the place of the one idle the longest.
MAX_CONNECTIONS = 256
MAX_HEAD_BYTES = 16384  # request line + headers; longer: 431
_BUSY_BODY = b"too many admin connections, try again\n"
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Content-Length: %d\r\nConnection: close\r\nRetry-After: 1\r\n\r\n%s"
        % (len(_BUSY_BODY), _BUSY_BODY))
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 503: "Service Unavailable",
            505: "HTTP Version Not Supported"}
_DRAIN_S = 1.0  # after the response: how long unread request bytes are drained before close
MAX_DRAINING = 1024  # answered connections draining at once (each at most _DRAIN_S)


def _configuration(view: object) -> str | None:
    """``generation 3, digest sha256:0123456789abcdef`` of the applied configuration, for the
    levels dump (None when the view does not know it)."""
    generation = getattr(view, "generation", None)
    if generation is None:
        return None
    from apf_gunicorn.server.generation import short_digest

    return f"generation {generation}, digest {short_digest(getattr(view, 'digest', ''))}"


def _flag(query: dict[str, list[str]], name: str) -> bool:
    """A dump's boolean query parameter: any non-empty value turns it on (Kubernetes'
    ``includeRequestDetails`` rule)."""
    return any(v for v in query.get(name, []))


def parse_bind(bind: str | tuple[str, int]) -> tuple[str, int]:
    """``"host:port"`` / ``"[::1]:port"`` / ``(host, port)`` -> ``(host, port)``."""
    if isinstance(bind, tuple):
        return bind[0], int(bind[1])
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"admin bind must be host:port, got {bind!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def response(status: int, ctype: str, body: bytes, head: bool = False) -> bytes:
    """A complete ``Connection: close`` HTTP/1.1 response."""
    lines = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: {ctype}\r\n"
             f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\n"
             f"Connection: close\r\nServer: apf-gunicorn-admin\r\n\r\n")
    return lines.encode("latin-1") + (b"" if head else body)


class _Conn:
    __slots__ = ("sock", "buf", "deadline", "out", "closing")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.deadline = deadline
        self.out: memoryview | None = None  # what is left to send
        self.closing = False  # response sent: draining until EOF, then close


class _Loop:
    """The selector loop: accept, read heads, answer, write, close; one deadline per
    connection. Runs in one daemon thread; :meth:`stop` ends it from any thread."""

    def __init__(self, addr: tuple[str, int], admin: AdminServer) -> None:
        family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        lsock = socket.socket(family, socket.SOCK_STREAM)
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # rebind after restart
            lsock.bind(addr)
            lsock.listen(64)
        except BaseException:
            lsock.close()
            raise
        lsock.setblocking(False)
        self.socket = lsock
        self.server_address = lsock.getsockname()
        self.admin = admin
        self.refused = 0  # connections answered BUSY since start
        self.timed_out = 0  # connections answered 408 since start
        self.closing = 0  # connections answered and draining (not counted against the cap)
        self.dropped = 0  # connections closed to make room for a new one (idle the longest)
        self.conns: dict[socket.socket, _Conn] = {}
        # the connections counted against the cap, the one idle the longest first: moved to
        # the end on every byte received or sent; left when answered (draining) or closed
        self.active: OrderedDict[socket.socket, _Conn] = OrderedDict()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stopped = False

    def fileno(self) -> int:
        return self.socket.fileno()

    def serve_forever(self) -> None:
        sel = self._sel
        sel.register(self.socket, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while not self._stopped:
                now = time.monotonic()
                wait = 0.5
                for c in self.conns.values():
                    if c.deadline - now < wait:
                        wait = max(0.0, c.deadline - now)
                for key, mask in sel.select(wait):
                    if key.fileobj is self.socket:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    else:
                        c = self.conns.get(key.fileobj)
                        if c is not None:
                            self._step(c, mask)
                self._expire(time.monotonic())
        finally:
            for c in list(self.conns.values()):
                self._close(c)
            sel.close()
            self.socket.close()
            self._wake_r.close()
            self._wake_w.close()

    def close_in_child(self) -> None:
        """In a forked child: close every descriptor of the loop (the thread is not there)."""
        for sock in (self.socket, self._wake_r, self._wake_w, *self.conns):
            with contextlib.suppress(OSError):
                sock.close()
        self.conns.clear()
        self.active.clear()
        with contextlib.suppress(OSError):
            self._sel.close()

    def stop(self) -> None:
        self._stopped = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _accept(self) -> None:
        for _ in range(64):  # what is pending now, without starving the open connections
            try:
                sock, _addr = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                log.debug("admin: accept failed", exc_info=True)
                return
            sock.setblocking(False)
            while len(self.active) >= self.admin.max_connections and self.active:
                _sock, idlest = self.active.popitem(last=False)
                self.dropped += 1
                self._close(idlest)
            if len(self.active) >= self.admin.max_connections:
                self._refuse(sock)
                continue
            c = _Conn(sock, time.monotonic() + self.admin.timeout)
            self.conns[sock] = c
            self.active[sock] = c
            self._sel.register(sock, selectors.EVENT_READ, None)

    def _refuse(self, sock: socket.socket) -> None:
        """BUSY, then the usual half-close and short drain (closing at once could reset the
        connection before the client has read the answer); with MAX_DRAINING connections
        already draining, just close."""
        self.refused += 1
        if self.closing >= MAX_DRAINING:
            sock.close()
            return
        c = _Conn(sock, time.monotonic() + _DRAIN_S)
        self.conns[sock] = c
        self._sel.register(sock, selectors.EVENT_READ, None)
        self._answer(c, BUSY)

    def _step(self, c: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_READ:
            try:
                data = c.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                data = None
            except OSError:
                data = b""
            if data == b"":
                if c.closing or not c.buf or c.out is not None:
                    self._close(c)
                    return
                self._answer(c, response(400, TEXT, b"incomplete request\n"))
                return
            if data and not c.closing and c.out is None:
                self._progress(c)
                c.buf += data
                self._parse(c)
        if mask & selectors.EVENT_WRITE and c.out is not None:
            self._send(c)

    def _parse(self, c: _Conn) -> None:
        end = c.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(c.buf) > MAX_HEAD_BYTES:
                self._answer(c, response(431, TEXT, b"request head too large\n"))
            return
        head = bytes(c.buf[:end]).decode("latin-1")
        line = head.split("\r\n", 1)[0]
        parts = line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            self._answer(c, response(400, TEXT, b"bad request line\n"))
            return
        method, target, version = parts
        if version not in ("HTTP/1.0", "HTTP/1.1"):
            self._answer(c, response(505, TEXT, b"HTTP/1.0 or HTTP/1.1 only\n"))
            return
        if method not in ("GET", "HEAD"):
            self._answer(c, response(405, TEXT, b"GET or HEAD only\n"))
            return
        admin = self.admin
        try:
            url = urlsplit(target)
            with admin.guard:
                status, ctype, body = admin.respond(url.path, parse_qs(url.query))
        except Exception:
            log.exception("admin: %s failed", target)
            status, ctype, body = 500, TEXT, b"internal error\n"
        self._answer(c, response(status, ctype, body, head=method == "HEAD"))

    def _answer(self, c: _Conn, data: bytes) -> None:
        c.buf = bytearray()
        c.out = memoryview(data)
        self._send(c)

    def _send(self, c: _Conn) -> None:
        try:
            n = c.sock.send(c.out)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError:
            self._close(c)
            return
        c.out = c.out[n:]
        if n:
            self._progress(c)
        if len(c.out):
            self._sel.modify(c.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, None)
            return
        # sent: half-close, drain what the client still sends, close on its EOF
        c.out = None
        if not c.closing:
            c.closing = True
            self.closing += 1
            self.active.pop(c.sock, None)
        c.deadline = min(c.deadline, time.monotonic() + _DRAIN_S)
        c.buf = bytearray()
        with contextlib.suppress(OSError):
            c.sock.shutdown(socket.SHUT_WR)
        self._sel.modify(c.sock, selectors.EVENT_READ, None)

    def _expire(self, now: float) -> None:
        for c in [c for c in self.conns.values() if c.deadline <= now]:
            if not c.closing and c.out is None and c.buf:
                # a request still arriving: 408, then the usual half-close and short drain
                self.timed_out += 1
                c.deadline = now + _DRAIN_S
                self._answer(c, response(408, TEXT, b"request timed out\n"))
            else:
                self._close(c)

    def _progress(self, c: _Conn) -> None:
        """A byte received or sent: ``c`` is the last to be dropped for room."""
        if c.sock in self.active:
            self.active.move_to_end(c.sock)

    def _close(self, c: _Conn) -> None:
        if self.conns.pop(c.sock, None) is not None and c.closing:
            self.closing -= 1
        self.active.pop(c.sock, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(c.sock)
        c.sock.close()


class AdminServer:
    def __init__(self, bind: str | tuple[str, int], state_provider: Any,
                 prefix: str | None = None, metrics_source: Any = None,
                 timeout: float = 10.0, max_connections: int = MAX_CONNECTIONS,
                 guard: Any = None) -> None:
        if not isinstance(bind, str | tuple) and isinstance(state_provider, str | tuple):
            bind, state_provider = state_provider, bind  # tolerate (state, bind)
        self.address = parse_bind(bind)
        if not callable(state_provider):
            # a MasterState itself: read it afresh on every request
            master = state_provider
            if prefix is None:
                prefix = getattr(getattr(master, "settings", None), "metrics_prefix", None)
            state_provider = lambda: view_of_master_state(master)  # noqa: E731
        self.state_provider = state_provider
        self.prefix = prefix or "apf"
        self.timeout = timeout
        self.max_connections = max_connections
        # Held around every response: the master passes the lock its fork hook takes, so no
        # worker is forked while a response imports a module (prometheus_client on the first
        # scrape): a child would inherit that module's import lock held, and hang for good.
        self.guard = guard if guard is not None else contextlib.nullcontext()
        self._metrics_source = metrics_source
        self._registry: Any = None
        self._server: _Loop | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def port(self) -> int | None:
        return self._server.server_address[1] if self._server else None

    def start(self, quiet: bool = False) -> bool:
        """Bind and serve in a daemon thread. Returns False (and logs why, unless ``quiet``)
        when the address is in use, e.g. by the old master during a USR2 upgrade."""
        try:
            self._server = _Loop(self.address, self)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                if quiet:
                    return False
                log.error("apf admin endpoint: %s:%d is already in use (another gunicorn master, "
                          "e.g. during a USR2 upgrade?); running without it until it is free. Set "
                          "APF_ADMIN_BIND to another host:port or 'off'.", *self.address)
                return False
            raise
        os.set_inheritable(self._server.fileno(), False)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="apf-admin", daemon=True)
        self._thread.start()
        # at start the server's "ready" line names the address (server/startup.py); a retry
        # that succeeds later is news
        (log.info if quiet else log.debug)("apf admin endpoint on http://%s:%d/",
                                           self.address[0], self.port)
        return True

    def stop(self) -> None:
        srv, self._server = self._server, None
        if srv is None:
            return
        srv.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def close_in_child(self) -> None:
        """In a forked worker: close the inherited listening socket (the master keeps its own)."""
        srv, self._server = self._server, None
        self._thread = None
        if srv is not None:
            srv.close_in_child()

    # -- responses --------------------------------------------------------------------------

    def registry(self) -> Any:
        if self._registry is None:
            from apf_gunicorn.master.metrics import build_registry

            self._registry = build_registry(self.prefix, self.state_provider,
                                            self._metrics_source)
        return self._registry

    def respond(self, path: str, query: dict[str, list[str]]) -> tuple[int, str, bytes]:
        if path == "/healthz":
            return 200, TEXT, b"ok\n"
        if path == "/readyz":
            view = self.state_provider()
            if view is not None and view.ready:
                return 200, TEXT, b"ok\n"
            why = "ledger not configured" if view is None or view.ledger is None \
                else "no worker registered yet"
            return 503, TEXT, f"not ready: {why}\n".encode()
        if path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry())
        if path.startswith(DUMP_PREFIX):
            name = path[len(DUMP_PREFIX):]
            if name not in DUMPS:
                return 404, TEXT, b"404 page not found\n"
            view = self.state_provider()
            if view is None or view.ledger is None:
                return 503, TEXT, b"not ready: ledger not configured\n"
            if name == "dump_pools":
                pools = view.pools() if view.pools is not None else {}
                return 200, TEXT, dumps.dump_pools(pools).encode()
            if name == "dump_cpu":
                cpu = view.cpu() if view.cpu is not None else None
                return 200, TEXT, dumps.dump_cpu(cpu).encode()
            snap = view.ledger.snapshot(view.clock())
            fairness = _flag(query, "includeFairness")
            if name == "dump_priority_levels":
                seats = (view.level_limits or {}) if _flag(query, "includeSeats") else None
                text = dumps.dump_priority_levels(snap, include_fairness=fairness, seats=seats,
                                                  configuration=_configuration(view))
            elif name == "dump_queues":
                text = dumps.dump_queues(snap, include_fairness=fairness)
            elif name == "dump_flows":
                text = dumps.dump_flows(snap)
            else:
                text = dumps.dump_requests(snap, include_details=_flag(query,
                                                                       "includeRequestDetails"))
            return 200, TEXT, text.encode()
        return 404, TEXT, b"404 page not found\n"
