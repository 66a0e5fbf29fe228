"""The admin HTTP endpoint the master serves: metrics, debug dumps, health.

    admin = AdminServer("127.0.0.1:9180", state_provider, prefix="apf")
    admin.start()          # when_ready: a daemon thread; False (logged) if the port is taken
    admin.close_in_child() # post_fork: the worker must not hold the listening socket
    admin.stop()           # on_exit

``state_provider()`` returns a :class:`~apf_gunicorn.server.metrics.MasterView` (ledger,
level limits, borrowing states, number of registered workers); a ``server.state.MasterState``
may be passed instead and is read through ``view_of_master_state`` (its settings also give the
metrics prefix). Paths:

* ``/metrics``: Prometheus text read from the shared ledger at scrape time (per-request
  counters and histograms, exact gauges), plus the application's own multiprocess files when
  ``PROMETHEUS_MULTIPROC_DIR`` is set;
* ``/debug/api_priority_and_fairness/dump_priority_levels``, ``.../dump_queues``,
  ``.../dump_requests`` (``?includeRequestDetails=1`` adds the request columns);
* ``/healthz``: 200 while the master serves; ``/readyz``: 200 once the ledger is configured and
  at least one worker has registered, else 503;
* anything else: 404.

Each connection gets its own thread with a socket timeout, so a slow or malformed client costs
one thread for at most ``timeout`` seconds of silence and never stops the server. At most
``max_connections`` (:data:`MAX_CONNECTIONS`, 16) are served at once: the accept loop answers
any further connection ``503`` and closes it without starting a thread, so a connection flood
or slowloris cannot grow the master's thread count; scrapes are served again as soon as the
held connections close or time out. The listening socket is
close-on-exec (Python's default), so a USR2 re-exec does not inherit it; forked workers close
it in ``post_fork`` through :meth:`close_in_child`. A second master (USR2) finding the port
taken logs a clear message and runs without an admin endpoint.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from apf_gunicorn.server import dumps
from apf_gunicorn.server.metrics import view_of_master_state

log = logging.getLogger("apf_gunicorn.admin")

DEFAULT_BIND = "127.0.0.1:9180"
DUMP_PREFIX = "/debug/api_priority_and_fairness/"
TEXT = "text/plain; charset=utf-8"
# Concurrent connections (= handler threads) the endpoint serves; more are answered BUSY at
# once, from the accept loop, so a flood cannot grow the master's thread count.
MAX_CONNECTIONS = 16
_BUSY_BODY = b"too many admin connections, try again\n"
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Content-Length: %d\r\nConnection: close\r\nRetry-After: 1\r\n\r\n%s"
        % (len(_BUSY_BODY), _BUSY_BODY))


def parse_bind(bind: str | tuple[str, int]) -> tuple[str, int]:
    """``"host:port"`` / ``"[::1]:port"`` / ``(host, port)`` -> ``(host, port)``."""
    if isinstance(bind, tuple):
        return bind[0], int(bind[1])
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"admin bind must be host:port, got {bind!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True  # SO_REUSEADDR: rebind right after a restart
    request_queue_size = 64

    def __init__(self, addr: tuple[str, int], handler: type, admin: AdminServer,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.address_family = socket.AF_INET6 if ":" in addr[0] else socket.AF_INET
        self.admin = admin
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0  # connections answered BUSY since start
        super().__init__(addr, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # Runs in the accept loop: a thread only while a connection slot is free.
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)  # starts the thread
        except BaseException:
            self._slots.release()
            self.shutdown_request(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request: socket.socket) -> None:
        """Answer 503 and close without blocking the accept loop on the client."""
        try:
            request.setblocking(False)
            try:  # read what already arrived, so closing does not reset the connection
                request.recv(65536)
            except (BlockingIOError, InterruptedError):
                pass
            request.send(BUSY)
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("admin: error serving %s", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "apf-gunicorn-admin"
    timeout = 10.0  # socket timeout per connection (slow clients)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("admin %s: " + format, self.address_string(), *args)

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def do_GET(self) -> None:
        self._dispatch(head=False)

    def _dispatch(self, head: bool) -> None:
        admin = self.server.admin
        try:
            url = urlsplit(self.path)
            status, ctype, body = admin.respond(url.path, parse_qs(url.query))
        except Exception:
            log.exception("admin: %s failed", self.path)
            status, ctype, body = 500, TEXT, b"internal error\n"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if not head:
            self.wfile.write(body)


class AdminServer:
    def __init__(self, bind: str | tuple[str, int], state_provider: Any,
                 prefix: str | None = None, metrics_source: Any = None,
                 timeout: float = 10.0, max_connections: int = MAX_CONNECTIONS) -> None:
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
        self._metrics_source = metrics_source
        self._registry: Any = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def port(self) -> int | None:
        return self._server.server_address[1] if self._server else None

    def start(self, quiet: bool = False) -> bool:
        """Bind and serve in a daemon thread. Returns False (and logs why, unless ``quiet``)
        when the address is in use, e.g. by the old master during a USR2 upgrade."""
        handler = type("Handler", (_Handler,), {"timeout": self.timeout})
        try:
            self._server = _Server(self.address, handler, self, self.max_connections)
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
                                        kwargs={"poll_interval": 0.5},
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
        srv.shutdown()
        srv.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def close_in_child(self) -> None:
        """In a forked worker: close the inherited listening socket (the master keeps its own)."""
        srv, self._server = self._server, None
        self._thread = None
        if srv is not None:
            try:
                srv.socket.close()
            except OSError:
                pass

    # -- responses --------------------------------------------------------------------------

    def registry(self) -> Any:
        if self._registry is None:
            from apf_gunicorn.server.metrics import build_registry

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
            if name not in ("dump_priority_levels", "dump_queues", "dump_requests"):
                return 404, TEXT, b"404 page not found\n"
            view = self.state_provider()
            if view is None or view.ledger is None:
                return 503, TEXT, b"not ready: ledger not configured\n"
            snap = view.ledger.snapshot(view.clock())
            if name == "dump_priority_levels":
                text = dumps.dump_priority_levels(snap)
            elif name == "dump_queues":
                text = dumps.dump_queues(snap)
            else:
                details = any(v for v in query.get("includeRequestDetails", []))
                text = dumps.dump_requests(snap, include_details=details)
            return 200, TEXT, text.encode()
        return 404, TEXT, b"404 page not found\n"
