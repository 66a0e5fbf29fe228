"""Answering 429 from the worker's poller, without a thread, and holding a storm's 429s.

The accept-gated worker (``gthread/worker.py``) reads request heads in its poller. While this
worker has lately rejected something (or its thread reserve is reached), it asks
:class:`PollerRejector` about each complete head before handing it to a thread: the head is
turned into the few environ keys the built-in resolver reads (:class:`HeadReader`), classified
by the middleware's own code (``APFMiddleware.reject_early``: its shape cache, the thread
reserve, the ledger's exact ``reject_if_full``) and, when the middleware would certainly reject
it, answered 429 here with the same bytes gunicorn would write for the middleware's 429
(:class:`RejectionBytes`, built by gunicorn's own ``Response`` once per FlowSchema, Retry-After,
HTTP version, keep-alive and second). Everything else goes to a thread as before::

    rejector = PollerRejector(middleware, cfg)      # None-equivalent: rejector.enabled False
    answer = rejector.answer(head_bytes, conn.client, keepalive_room=True)
    if answer is not None: ...send answer.data after answer.hold s, keep it if answer.keep...
    rejector.log_access(worker.log, answer, conn.client, conn.server)   # once written

The worker counts each answer towards gunicorn's ``max_requests`` and logs it in gunicorn's
access log (:meth:`PollerRejector.log_access`: gunicorn's own ``Logger.access`` with the
configured ``access_log_format``), as gthread does for a response a thread wrote.

What a head must be for this (anything else goes to a thread, which decides as today): a
whole head with nothing after it that gunicorn's own parser (``gunicorn.http.message.Request``,
with the worker's config) accepts, so that gunicorn would have handed it to the app too: a
head it answers 400, 417 or 501 (an invalid header name, two ``Content-Length`` fields, ...)
or closes is answered by a thread, as gunicorn answers it. Beyond that: HTTP/1.0 or 1.1, no
body (no ``Content-Length`` but 0, no ``Transfer-Encoding``; no pipelined request), an
origin-form target, no ``Expect`` or ``Upgrade``, no header name with ``_`` left after
gunicorn's ``header_map``, a TCP peer. So a request with a body is never answered here: its
body would have to be read or the connection closed, and the thread path already drains it and
keeps the connection alive. The connection is kept alive exactly when gunicorn's
``should_close`` says so (``CONNECT`` and ``Connection: close`` close it).

Holding (:class:`Strikes`): a flow, per client address, that comes back before the
Retry-After of its previous 429 again and again (``STRIKES`` times in a row) gets its next 429
held in the poller until that Retry-After is due, at most ``HOLD_CAP_S``. A client that waits
its Retry-After is never held. Kubernetes answers every 429 at once; HAProxy's ``tarpit``
holds a denied request for ``timeout tarpit`` whatever the client did; this holds only what
a client asked for too early, and only on that flow's connections.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any, NamedTuple

from gunicorn import util
from gunicorn.config import Config
from gunicorn.http import wsgi
from gunicorn.http.body import LengthReader
from gunicorn.http.message import Request
from gunicorn.http.unreader import IterUnreader
from gunicorn.http.wsgi import Response

from apf_gunicorn.gthread.wsgi import REJECTED_STATUS, TOO_MANY, rejection_headers

#: How long after this worker's last rejection the poller keeps asking about each head (each
#: ask classifies the head and takes the ledger's lock for ``reject_if_full``): a calm worker
#: pays one dict read per request.
HOT_S = 1.0
#: The longest a 429 is held. Retry-After starts at 1 s and only a level that keeps rejecting
#: raises it; holding longer than 1 s would hold more sockets (holds = storm rate x hold) and
#: bring a held client nearer its own timeout, for no more throttling than the first second
#: gives (a held connection sends nothing meanwhile).
HOLD_CAP_S = 1.0
#: Early returns in a row before a flow's 429s are held: one early retry is a client's normal
#: race (its request was under way when the 429 came); a second one is a pattern.
STRIKES = 2
#: The environ key set (True) in the access log's environ of a 429 the poller wrote
POLLER_KEY = "apf_gunicorn.poller"
#: Flows remembered per worker (the book is cleared when full: a storm's flows return at once).
BOOK_SIZE = 4096


#: Headers (as gunicorn's parser names them) whose request goes to a thread: gunicorn writes a
#: ``100 Continue`` for an ``Expect``, may switch protocols for an ``Upgrade``
_REFUSED = frozenset(("EXPECT", "UPGRADE"))
#: Fields gunicorn's ``wsgi.create`` maps to other keys than ``HTTP_*``
_SPECIAL = {"CONTENT-TYPE": "CONTENT_TYPE", "CONTENT-LENGTH": "CONTENT_LENGTH"}
_VERSIONS = frozenset(((1, 0), (1, 1)))
#: Heads remembered per worker with what they read (cleared when full), and the largest kept
HEAD_CACHE_SIZE = 1024
HEAD_CACHE_BYTES = 2048
_UNREAD = object()


class Head(NamedTuple):
    """What the poller read of a request head it may answer."""

    environ: dict  # the keys the resolver reads, as gunicorn sets them (shared: never change)
    version: tuple[int, int]
    keep_alive: bool  # the client's side: gunicorn's ``should_close`` is False
    method: str
    req: Any  # gunicorn's parsed ``Request`` (for the access log)


class ParserConfig:
    """A gunicorn config as its request parser reads it, every setting a plain attribute: each
    read of a ``Config`` attribute goes through ``Config.__getattr__`` and the setting's
    ``get`` (1.7 us measured here), and ``Request`` reads about 16 per head, which was 40 %
    of the parse. The values are the worker's for its whole life (a reload starts new
    workers); anything else is read from the config itself."""

    def __init__(self, cfg: Any) -> None:
        """Args:
            cfg: a gunicorn ``Config``.
        """
        self._cfg = cfg
        for name, setting in cfg.settings.items():
            if not hasattr(type(cfg), name):  # (Config's properties, e.g. worker_class, stay its)
                setattr(self, name, setting.get())
        self.is_ssl = cfg.is_ssl
        self.forwarded_allow_networks = cfg.forwarded_allow_networks
        self.proxy_allow_networks = cfg.proxy_allow_networks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cfg, name)


class HeadReader:
    """Reads a complete request head into the environ keys the built-in resolver reads, as
    gunicorn would set them, when the head qualifies for an answer from the poller (see the
    module docstring); one per worker, for the resolver's ``environ_keys``.

    The head is parsed by gunicorn's own ``Request`` with the worker's config (its parser, its
    limits, its header rules), so a head gunicorn answers 400, 417 or 501 is never answered 429
    here, and ``Connection`` is decided by gunicorn's own ``should_close`` (``CONNECT`` closes).
    """

    def __init__(self, environ_keys: tuple[str, ...] | frozenset, cfg: Any = None) -> None:
        """Args:
            environ_keys: the keys the resolver reads (``RequestInfoResolver.environ_keys``);
                of the ``HTTP_*`` ones, only these are read from the head.
            cfg: the worker's gunicorn config (None: gunicorn's defaults).
        """
        self._wanted = frozenset(environ_keys)
        self._cfg = ParserConfig(cfg if cfg is not None else Config())
        # (head, client address) -> what it reads: a storm repeats the same few heads
        self._cache: dict[tuple[bytes, str], Any] = {}

    def __call__(self, buf: bytes, client: Any) -> Head | None:
        """What the answer needs of the head (its environ is shared between calls for the same
        head and address: read it, never change it).

        Args:
            buf: the head's bytes (a whole head qualifies only with nothing after it).
            client: the peer address as gunicorn has it (a TCP ``(host, port)``).
        Returns:
            The head, or None: give it to a thread.
        """
        if type(client) is not tuple:
            return None
        key = (buf, client[0])
        cache = self._cache
        got = cache.get(key, _UNREAD)
        if got is _UNREAD:
            got = self._read(buf, client)
            if len(buf) <= HEAD_CACHE_BYTES:
                if len(cache) >= HEAD_CACHE_SIZE:
                    cache.clear()
                cache[key] = got
        return got

    def _read(self, buf: bytes, client: tuple) -> Head | None:
        if buf.find(b"\r\n\r\n") != len(buf) - 4:
            return None  # bytes after the head (a body, a pipelined request), or no head
        try:
            # req_number 2: no PROXY header (the poller is off with proxy_protocol)
            req = Request(self._cfg, IterUnreader((buf,)), client, 2)
        except Exception:  # noqa: BLE001 - gunicorn rejects it: a thread answers as gunicorn does
            return None
        version = req.version
        reader = req.body.reader
        if (version not in _VERSIONS or req.uri[:1] != "/"
                or type(reader) is not LengthReader or reader.length):
            # an absolute or asterisk target, a body (or a chunked one)
            return None
        environ = {"REQUEST_METHOD": req.method, "QUERY_STRING": req.query,
                   "PATH_INFO": util.unquote_to_wsgi_str(req.path), "REMOTE_ADDR": client[0]}
        wanted = self._wanted
        for name, value in req.headers:
            if name in _REFUSED or "_" in name:
                # a 100-continue, an upgrade; a header gunicorn kept with "_" in its name
                # (SCRIPT_NAME from a trusted proxy moves PATH_INFO; header_map "dangerous")
                return None
            key = _SPECIAL.get(name) or "HTTP_" + name.replace("-", "_")
            if key in wanted:  # repeated fields joined as gunicorn's wsgi.create joins them
                environ[key] = environ[key] + "," + value if key in environ else value
        return Head(environ, version, not req.should_close(), req.method, req)


class _Head:
    """What gunicorn's ``Response`` reads of a request to write its status line and
    ``Connection`` header."""

    def __init__(self, version: tuple[int, int], method: str, keep: bool) -> None:
        self.version = version
        self.method = method
        self._keep = keep

    def should_close(self) -> bool:
        return not self._keep


class _Capture:
    """A socket stand-in that keeps what gunicorn's ``Response`` writes to it."""

    def __init__(self) -> None:
        self.data = bytearray()

    def sendall(self, data: bytes) -> None:
        self.data += data

    send = sendall


class RejectionBytes:
    """The bytes of a 429 as gunicorn writes the middleware's 429 (status line, ``Server``,
    ``Date``, ``Connection``, the middleware's headers, the body), built by gunicorn's own
    ``Response`` once per (FlowSchema route, Retry-After, HTTP version, HEAD or not,
    keep-alive) and second (the ``Date`` header), then reused."""

    def __init__(self, cfg: Any) -> None:
        self._cfg = cfg
        self._second = -1
        self._cache: dict[tuple, tuple[bytes, Any]] = {}

    def get(self, route: Any, retry: int, version: tuple[int, int], method: str,
            keep: bool) -> tuple[bytes, Any]:
        """The 429's bytes, and the gunicorn ``Response`` that wrote them (what gunicorn's
        access log reads of a response: ``status``, ``headers``, ``sent``; never change it).

        Args:
            route: the request's FlowSchema route (``admission.core.Route``); retry: seconds.
            version: the request's HTTP version; method: its method (HEAD: no body).
            keep: the response keeps the connection alive (else ``Connection: close``).
        Returns:
            ``(the response ready to send, its Response)``.
        """
        second = int(time.time())
        if second != self._second:
            self._second = second
            self._cache.clear()
        key = (route, retry, version, method == "HEAD", keep)
        got = self._cache.get(key)
        if got is None:
            sink = _Capture()
            resp = Response(_Head(version, method, keep), sink, self._cfg)
            resp.start_response(REJECTED_STATUS, rejection_headers(route, retry))
            resp.write(TOO_MANY)
            resp.close()
            got = self._cache[key] = (bytes(sink.data), resp)
        return got


class Strikes:
    """Which flows come back before their Retry-After, and how long to hold their next 429.

    Keyed by (flow hash, client address): clients that share a flow but not an address (behind
    no common proxy) are told apart, so one that honours Retry-After is never held because
    another ignores it."""

    def __init__(self, cap_s: float = HOLD_CAP_S, strikes: int = STRIKES,
                 size: int = BOOK_SIZE) -> None:
        self.cap_s = cap_s
        self.strikes = strikes
        self.size = size
        self._book: dict[tuple, tuple[float, int]] = {}  # key -> (Retry-After due, early)

    def hold_for(self, key: tuple, now: float, retry: int) -> float:
        """Seconds to hold the 429 answered now to ``key`` (0: answer at once); records it.

        Args:
            key: (flow hash, client address); now: monotonic seconds; retry: its Retry-After.
        Returns:
            The hold: until the previous 429's Retry-After is due, at most ``cap_s``, once the
            flow came back early ``strikes`` times in a row; else 0.
        """
        book = self._book
        seen = book.get(key)
        early = 0
        hold = 0.0
        if seen is not None and now < seen[0]:
            early = seen[1] + 1
            if early >= self.strikes:
                hold = min(seen[0] - now, self.cap_s)
        elif len(book) >= self.size:
            book.clear()
        book[key] = (now + hold + retry, early)
        return hold


class Answer(NamedTuple):
    """The poller's 429 for one head."""

    data: bytes  # the response, ready to send
    keep: bool  # keep the connection alive after it
    hold: float  # seconds to hold it first (0: at once)
    route: Any  # the request's FlowSchema route (``admission.core.Route``: level, fs_index)
    reason: str  # the reason its rejection was counted with (to count a held one)
    req: Any  # gunicorn's parsed ``Request`` (for the access log)
    resp: Any  # gunicorn's ``Response`` that wrote ``data`` (for the access log)
    at: float  # when it was answered (monotonic seconds)


_new_tuple = tuple.__new__


class _NoSocket:
    """The socket ``wsgi.create`` is given for a request it builds an environ for only: it
    would write to it only for ``Expect: 100-continue``, which the poller never answers."""

    def send(self, data: bytes) -> int:
        return len(data)

    sendall = send


_NO_SOCK = _NoSocket()


class PollerRejector:
    """The poller's side of rejecting without a thread: whether to ask, and the answer."""

    def __init__(self, middleware: Any, cfg: Any) -> None:
        """Args:
            middleware: the worker's ``APFMiddleware``.
            cfg: the worker's gunicorn config.
        """
        self.mw = middleware
        self.enabled = bool(middleware.poller_classifies and not os.environ.get("SCRIPT_NAME")
                            and str(getattr(cfg, "proxy_protocol", "off") or "off") == "off")
        self._cfg = cfg
        self.bytes = RejectionBytes(cfg)
        self.strikes = Strikes()
        self.read_head = HeadReader(getattr(middleware.ctx.resolver, "environ_keys", ()), cfg)
        self._stats = middleware.stats
        self._seen = 0
        self._until = 0.0

    def hot(self) -> bool:
        """Whether this worker rejected something in the last ``HOT_S`` seconds (then each
        complete head is asked about)."""
        n = self._stats["rejected"]
        if n != self._seen:
            self._seen = n
            self._until = time.monotonic() + HOT_S
            return True
        return bool(self._until) and time.monotonic() < self._until

    def answer(self, buf: bytes, client: Any, keepalive_room: bool) -> Answer | None:
        """The poller's answer to a complete head, if it is a 429.

        Args:
            buf: the head's bytes; client: the peer address.
            keepalive_room: the worker would keep the connection alive after a response
                (alive, keep-alive on, room among its kept-alive connections, not its last
                request before ``max_requests``).
        Returns:
            The answer, or None: hand the request to a thread (nothing was counted).
        Raises:
            Exception: classification or the ledger failed (the caller hands it to a thread).
        """
        parsed = self.read_head(buf, client)
        if parsed is None:
            return None
        environ, version, keep, method, req = parsed
        now = time.monotonic_ns()
        got = self.mw.reject_early(environ, now)
        if got is None:
            return None
        route, retry, flow_hash, reason = got
        keep = keep and keepalive_room
        at = now / 1e9
        hold = self.strikes.hold_for((flow_hash, client[0]), at, retry)
        data, resp = self.bytes.get(route, retry, version, method, keep)
        # (built as a tuple: Answer(...) runs the NamedTuple's Python-level __new__, ~2k more
        # instructions per 429 under callgrind)
        return _new_tuple(Answer, (data, keep, hold, route, reason, req, resp, at))

    def log_access(self, log: Any, answer: Answer, client: Any, server: Any) -> None:
        """Log a 429 written here in gunicorn's access log, as gthread logs a response: with
        gunicorn's own ``Logger.access``, the configured ``access_log_format``, the request's
        environ as gunicorn's ``wsgi.create`` builds it and the ``Response`` that wrote the
        bytes; the request time runs from when the head was answered to now (a held 429's
        hold included). The environ also holds ``apf_gunicorn.poller: True``, so a format with
        ``%({apf_gunicorn.poller}e)s`` tells these lines apart (``-`` on a thread's).

        Args:
            log: the worker's gunicorn logger (``worker.log``).
            answer: what :meth:`answer` returned; client, server: the connection's peer and
                listener addresses (``conn.client``, ``conn.server``).
        """
        if not getattr(log, "access_log_enabled", True):
            return  # (no access log: no environ built)
        try:
            _resp, environ = wsgi.create(answer.req, _NO_SOCK, client, server, self._cfg)
            environ[POLLER_KEY] = True
            took = timedelta(seconds=max(0.0, time.monotonic() - answer.at))
            log.access(answer.resp, answer.req, environ, took)
        except Exception:  # noqa: BLE001 - a log line must not cost the answer
            log.exception("apf: logging a 429 answered by the poller failed")
