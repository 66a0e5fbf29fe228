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
  'apf_gunicorn[asgi]'``); its ``_serve`` is the stock one plus a reference to uvicorn's
  server, whose ``should_exit`` says when it stops.
* :class:`ASGIWorker` subclasses gunicorn's ``gunicorn.workers.gasgi.ASGIWorker`` (``-k
  asgi``, beta in gunicorn), which needs no extra package; its app is ``worker.asgi``.

What the gthread worker adds beyond the middleware (heads read in the poller, 429s from the
poller, the accept gate, the thread reserve for exempt requests) has no counterpart here: the
server reads heads and accepts connections itself, and a waiting request holds no thread.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from gunicorn.workers.gasgi import ASGIWorker as _GunicornASGIWorker

from apf_gunicorn.admission.asyncparking import AsyncParking
from apf_gunicorn.admission.boot import FrontEnd
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

    def apf_parking(self) -> AsyncParking:
        return AsyncParking()

    def apf_app(self) -> Any:
        return self.asgi

    def apf_attach(self, ctx, ledger) -> ASGIMiddleware:
        ledger.never_wait_on(threading.get_ident())  # the loop runs on this (main) thread
        middleware = ASGIMiddleware(self.asgi, ctx)
        self.asgi = middleware
        return middleware


if _StockUvicornWorker is not None:
    from uvicorn.server import Server

    class UvicornWorker(FrontEnd, _StockUvicornWorker):
        """uvicorn-worker's ``UvicornWorker`` with APF in front of its app."""

        apf_server: Any = None
        apf_holds_threads = False

        def apf_parking(self) -> AsyncParking:
            return AsyncParking()

        def apf_alive(self) -> bool:
            server = self.apf_server
            return self.alive and not (server is not None and server.should_exit)

        def apf_app(self) -> Any:
            return self.wsgi

        def apf_attach(self, ctx, ledger) -> ASGIMiddleware:
            ledger.never_wait_on(threading.get_ident())  # the loop runs on this (main) thread
            middleware = ASGIMiddleware(self.wsgi, ctx)
            self.wsgi = middleware  # uvicorn-worker serves self.wsgi (config.app = self.wsgi)
            return middleware

        async def _serve(self) -> None:
            # the stock _serve, keeping the server: apf_alive reads its should_exit
            self.config.app = self.wsgi
            server = self.apf_server = Server(config=self.config)
            self._install_sigquit_handler()
            await server.serve(sockets=self.sockets)
            if not server.started:
                from gunicorn.arbiter import Arbiter

                sys.exit(Arbiter.WORKER_BOOT_ERROR)
else:
    UvicornWorker = None  # type: ignore[assignment,misc]
