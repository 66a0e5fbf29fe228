"""gunicorn workers for ASGI apps with APF: on uvicorn, or on gunicorn's own ASGI worker.

    gunicorn -c python:apf_gunicorn.conf -k apf_gunicorn.asgi.UvicornWorker app:app
    gunicorn -c python:apf_gunicorn.conf -k apf_gunicorn.asgi.ASGIWorker app:app

Both are the stock worker plus :class:`~apf_gunicorn.admission.boot.FrontEnd`'s override
points: queued requests wait on the event loop (``AsyncParking``), the app is wrapped in
:class:`~apf_gunicorn.asgi.middleware.ASGIMiddleware`, and the worker counts as stopping as
soon as its server begins a graceful shutdown (queued requests are then answered 503 within
the dispatcher's 100 ms tick). The master side (ledger, hooks, services) is the same as for
WSGI apps.

* :class:`UvicornWorker` subclasses ``uvicorn_worker.UvicornWorker`` (``pip install
  'apf_gunicorn[asgi]'``). uvicorn is given the app as loaded, so it serves it as it would
  bare (it tells an ASGI2 app from an ASGI3 one and wraps it, and puts its proxy-headers
  middleware in front); the APF middleware then goes in front of everything uvicorn built
  (``Config.loaded_app``). So APF sees the scope as the connection made it: ``client`` is the
  socket's peer, and ``APF_TRUSTED_PROXIES`` is decided on it whatever uvicorn's
  ``forwarded_allow_ips`` says, while the app still gets the address uvicorn rewrote from
  ``X-Forwarded-For``. Its ``_serve`` keeps a reference to uvicorn's server, whose
  ``should_exit`` says when it stops. Beyond stock uvicorn-worker, the worker stops when its
  master is gone (as gunicorn's own workers do), and a stopping worker serves the connections
  it accepted but has not read a request from yet, where uvicorn would reset them.
* :class:`ASGIWorker` subclasses gunicorn's ``gunicorn.workers.gasgi.ASGIWorker`` (``-k
  asgi``, beta in gunicorn), which needs no extra package; its app is ``worker.asgi``, which
  it calls with the scope it built from the socket (``client`` is the peer, or the PROXY
  protocol's address). It serves ASGI3 apps only, with APF as bare: an app that looks like
  an ASGI2 one is warned about at start (:func:`looks_asgi2`).

Both accept through :class:`~apf_gunicorn.asgi.acceptgate.AcceptGate` instead of asyncio's
server, which takes every pending connection at each wake-up: a worker holding more
connections than the least-loaded other one stops accepting (docs/asgi.md, "The accept gate").

What else the gthread worker adds beyond the middleware (heads read in the poller, 429s from
the poller, the thread reserve for exempt requests) has no counterpart here: the server reads
heads itself, and a waiting request holds no thread.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import sys
import threading
from typing import Any

from gunicorn.workers.gasgi import ASGIWorker as _GunicornASGIWorker

from apf_gunicorn.admission.asyncparking import AsyncParking
from apf_gunicorn.admission.boot import FrontEnd
from apf_gunicorn.asgi.acceptgate import AcceptGate
from apf_gunicorn.asgi.middleware import ASGIMiddleware

try:
    from uvicorn_worker import UvicornWorker as _StockUvicornWorker
except ImportError:  # the asgi extra is not installed: only ASGIWorker is available
    _StockUvicornWorker = None


class ASGIWorker(FrontEnd, _GunicornASGIWorker):
    """gunicorn's ASGI worker with APF in front of its app."""

    @classmethod
    def check_config(cls, cfg, log) -> None:
        # The stock check warns that threads are unused: apf_gunicorn.conf sets them for its
        # gthread worker, and an ASGI worker rightly ignores them.
        pass

    apf_holds_threads = False
    #: ``(publish, fewest_elsewhere)`` for the accept gate (set by apf_attach; None: no peers)
    apf_peers: tuple | None = None
    _apf_gates: tuple = ()  # one per listening socket
    _apf_nr_conns = 0

    @property
    def nr_conns(self) -> int:
        # gunicorn's protocol counts its connections here (connection_made, connection_lost):
        # a close may give the accept gate room
        return self._apf_nr_conns

    @nr_conns.setter
    def nr_conns(self, value: int) -> None:
        closed = value < self._apf_nr_conns
        self._apf_nr_conns = value
        if closed:
            for gate in self._apf_gates:
                gate.connection_closed()

    def _setup_event_loop(self) -> None:
        # gunicorn's _serve makes its servers with self.loop.create_server: this loop makes
        # accept gates instead
        super()._setup_event_loop()
        self.loop = _GatedLoop(self.loop, self)

    def _cleanup(self) -> None:
        # asyncio.all_tasks(self.loop) there must see the real loop
        if isinstance(self.loop, _GatedLoop):
            self.loop = self.loop._apf_loop
        super()._cleanup()

    def apf_parking(self) -> AsyncParking:
        return AsyncParking()

    def apf_app(self) -> Any:
        return self.asgi

    def apf_attach(self, ctx, ledger) -> ASGIMiddleware:
        ledger.never_wait_on(threading.get_ident())  # the loop runs on this (main) thread
        self.apf_peers = _peers(ledger, ctx.owner)
        if looks_asgi2(self.asgi):
            self.log.warning("apf: the app %r looks like an ASGI2 (double-callable) app, which "
                             "gunicorn's ASGIWorker does not serve (it calls every app as "
                             "ASGI3, with or without APF); use apf_gunicorn.asgi.UvicornWorker, "
                             "or wrap the app with asgiref's guarantee_single_callable",
                             self.asgi)
        middleware = ASGIMiddleware(self.asgi, ctx)
        self.asgi = middleware
        return middleware


class _GatedLoop:
    """gunicorn's ASGIWorker's event loop, whose ``create_server`` on a listening socket
    returns an :class:`AcceptGate` (started) instead of an ``asyncio.Server``; the rest is the
    loop's own. (The worker keeps it as ``self.loop``; asyncio's running loop is the real one.)"""

    def __init__(self, loop: asyncio.AbstractEventLoop, worker: ASGIWorker) -> None:
        self._apf_loop = loop
        self._apf_worker = worker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._apf_loop, name)

    async def create_server(self, protocol_factory: Any, sock: Any = None, ssl: Any = None,
                            **kwargs: Any) -> Any:
        if sock is None:
            return await self._apf_loop.create_server(protocol_factory, ssl=ssl, **kwargs)
        worker = self._apf_worker
        gate = _gate(self._apf_loop, [sock], protocol_factory, ssl,
                     lambda: worker._apf_nr_conns, worker.apf_peers)
        worker._apf_gates += (gate,)
        if len(worker._apf_gates) >= len(worker.sockets):
            # every listening socket has its gate: the worker (its protocols, per request)
            # uses the loop itself from now on
            worker.loop = self._apf_loop
        return gate


def _peers(ledger: Any, owner: int | None) -> tuple | None:
    """The accept gate's view of the other workers: ``(publish, fewest_elsewhere)`` on the
    ledger's worker record ``owner`` (None: this worker has none)."""
    if owner is None:
        return None
    return (functools.partial(ledger.set_worker_connections, owner),
            functools.partial(ledger.fewest_connections_elsewhere, owner))


def _gate(loop: Any, sockets: list, factory: Any, ssl: Any, open_connections: Any,
          peers: tuple | None) -> AcceptGate:
    publish, fewest = peers if peers is not None else (None, None)
    gate = AcceptGate(loop, sockets, factory, ssl, open_connections, publish, fewest)
    gate.start()
    return gate


def looks_asgi2(app: Any) -> bool:
    """Whether uvicorn would serve ``app`` as an ASGI2 (double-callable) app: a class without
    ``__await__``, or a callable that is not a coroutine function (uvicorn's ``interface=
    "auto"`` test)."""
    if inspect.isclass(app):
        return not hasattr(app, "__await__")
    if inspect.isfunction(app):
        return not inspect.iscoroutinefunction(app)
    return not inspect.iscoroutinefunction(getattr(app, "__call__", None))  # noqa: B004


if _StockUvicornWorker is not None:
    from uvicorn.server import Server

    class _Server(Server):
        """uvicorn's server, with two changes to its lifecycle (none per request).

        It stops when its worker's master is gone: uvicorn-worker never looks at its parent, so
        after a master's SIGKILL its workers would keep serving on the old socket and a new
        master's bind would fail. gunicorn's own workers check ``os.getppid()`` once a second;
        this does the same on uvicorn's tick. And when it stops, it serves the connections it
        accepted but has not read a request from yet (see :meth:`shutdown`)."""

        def __init__(self, config: Any, worker: Any) -> None:
            super().__init__(config=config)
            self.apf_worker = worker

        async def startup(self, sockets: list | None = None) -> None:
            # uvicorn makes an asyncio server per listening socket; this accepts through an
            # accept gate instead, with uvicorn's own protocol factory, so its connection
            # accounting (server_state.connections, limit_concurrency, shutdown) is unchanged
            if sockets is None:
                await super().startup(sockets)
                return
            await super().startup(sockets=[])  # lifespan; no server
            config = self.config
            connections = _CountedConnections(self.server_state.connections)
            self.server_state.connections = connections
            factory = functools.partial(config.http_protocol_class, config=config,
                                        server_state=self.server_state,
                                        app_state=self.lifespan.state)
            gate = _gate(asyncio.get_running_loop(), sockets, factory, config.ssl,
                         connections.__len__, self.apf_worker.apf_peers)
            connections.gate = gate
            self.servers = [gate]

        async def on_tick(self, counter: int) -> bool:
            if counter % 10 == 0 and not self.should_exit:
                self.apf_worker.apf_check_parent(self)
            return await super().on_tick(counter)

        async def shutdown(self, sockets: list | None = None) -> None:
            # uvicorn's shutdown closes at once every connection with no request in progress,
            # including one it accepted a moment ago whose request it has not read yet: that
            # client (a probe during a HUP, say) gets a reset. Stop accepting first, and give
            # such fresh connections the keep-alive time (gunicorn's --keep-alive) to bring
            # their request, which uvicorn then serves before it closes them. An idle
            # keep-alive connection is closed at once, as before.
            for server in self.servers:
                server.close()
            fresh = sum(map(_awaits_first_request, self.server_state.connections))
            if fresh:
                grace = self.config.timeout_keep_alive
                self.apf_worker.log.info("apf: stopping; waiting up to %s s for the request of "
                                         "%d connection(s) just accepted", grace, fresh)
                loop = asyncio.get_running_loop()
                deadline = loop.time() + grace
                while any(map(_awaits_first_request, self.server_state.connections)):
                    if loop.time() >= deadline or self.force_exit:
                        break
                    await asyncio.sleep(0.01)
            await super().shutdown(sockets)

    class _CountedConnections(set):
        """uvicorn's set of open connections, telling the accept gate when one leaves."""

        gate: AcceptGate | None = None

        def discard(self, item: Any) -> None:
            set.discard(self, item)
            if self.gate is not None:
                self.gate.connection_closed()

        def remove(self, item: Any) -> None:
            set.remove(self, item)
            if self.gate is not None:
                self.gate.connection_closed()

    def _awaits_first_request(connection: Any) -> bool:
        """Whether an HTTP connection of uvicorn's is open and has not begun a request yet
        (its ``cycle`` is set once a request's head is parsed, and stays after it)."""
        return (getattr(connection, "cycle", False) is None
                and not connection.transport.is_closing())

    class UvicornWorker(FrontEnd, _StockUvicornWorker):
        """uvicorn-worker's ``UvicornWorker`` with APF in front of its app."""

        apf_server: Any = None
        apf_holds_threads = False
        #: ``(publish, fewest_elsewhere)`` for the accept gate (set by apf_attach; None: none)
        apf_peers: tuple | None = None

        def apf_parking(self) -> AsyncParking:
            return AsyncParking()

        def apf_alive(self) -> bool:
            server = self.apf_server
            return self.alive and not (server is not None and server.should_exit)

        def apf_app(self) -> Any:
            return self.wsgi

        def apf_check_parent(self, server: Any) -> None:
            """Stop ``server`` gracefully if this worker's master is gone (orphaned workers
            would keep the port). ``should_exit`` also stops admission (``apf_alive``). No
            master will SIGKILL this worker after ``graceful_timeout`` any more, so the graceful
            shutdown is cut off there by uvicorn's ``force_exit``."""
            if os.getppid() == self.ppid:
                return
            self.log.info("Parent changed, shutting down: %s", self)
            server.should_exit = True
            asyncio.get_running_loop().call_later(self.cfg.graceful_timeout, setattr, server,
                                                  "force_exit", True)

        apf_middleware: ASGIMiddleware | None = None

        def apf_attach(self, ctx, ledger) -> ASGIMiddleware:
            ledger.never_wait_on(threading.get_ident())  # the loop runs on this (main) thread
            self.apf_peers = _peers(ledger, ctx.owner)
            # self.wsgi stays the app: _serve puts the middleware in front of what uvicorn
            # builds around it
            self.apf_middleware = ASGIMiddleware(self.wsgi, ctx)
            return self.apf_middleware

        async def _serve(self) -> None:
            # the stock _serve, with APF in front of the app uvicorn loaded, and keeping the
            # server (apf_alive reads its should_exit), which stops when orphaned
            config = self.config
            config.app = self.wsgi
            middleware = self.apf_middleware
            if middleware is not None:
                # uvicorn wraps the app (ASGI2, proxy headers) when it loads it; the server
                # loads it only if not loaded yet
                config.load()
                middleware.app = config.loaded_app
                config.loaded_app = middleware
            server = self.apf_server = _Server(config, self)
            self._install_sigquit_handler()
            await server.serve(sockets=self.sockets)
            if not server.started:
                from gunicorn.arbiter import Arbiter

                sys.exit(Arbiter.WORKER_BOOT_ERROR)
else:
    UvicornWorker = None  # type: ignore[assignment,misc]
