"""Answering 429 from the worker's poller, without a thread, and holding a storm's 429s.

The accept-gated worker (``server/worker.py``) reads request heads in its poller. While this
worker has lately rejected something (or its thread reserve is reached), it asks
:class:`PollerRejector` about each complete head before handing it to a thread: the head is
turned into the few environ keys the built-in resolver reads (:class:`HeadReader`), classified
by the middleware's own code (``APFMiddleware.reject_early``: its shape cache, the thread
reserve, the ledger's exact ``reject_if_full``) and, when the middleware would certainly reject
it, answered 429 here with the same bytes gunicorn would write for the middleware's 429
(:class:`RejectionBytes`, built by gunicorn's own ``Response`` once per FlowSchema, Retry-After,
HTTP version, keep-alive and second). Everything else goes to a thread as before::

    rejector = PollerRejector(middleware, cfg)      # None-equivalent: rejector.enabled False
    verdict = rejector.answer(head_bytes, conn.client, keepalive_room=True)
    if verdict is not None: data, keep_alive, hold_s, route, reason = verdict

What a head must be for this (anything else goes to a thread, which decides as today): a
whole HTTP/1.0 or 1.1 head with nothing after it (no body: no ``Content-Length`` but 0, no
``Transfer-Encoding``; no pipelined request), an origin-form target, no ``Expect`` or
``Upgrade``, no folded lines, no header name with ``_``, a TCP peer. So a request with a body
is never answered here: its body would have to be read or the connection closed, and the
thread path already drains it and keeps the connection alive.

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
from typing import Any

from gunicorn import util
from gunicorn.http.wsgi import Response

from apf_gunicorn.server.middleware import REJECTED_STATUS, TOO_MANY, rejection_headers

#: How long after this worker's last rejection the poller keeps asking about each head (each
#: ask classifies the head and, unless a lock-free look says the level has room, takes the
#: ledger's lock): a calm worker pays one dict read per request.
HOT_S = 1.0
#: The longest a 429 is held. Retry-After starts at 1 s and only a level that keeps rejecting
#: raises it; holding longer than 1 s would hold more sockets (holds = storm rate x hold) and
#: bring a held client nearer its own timeout, for no more throttling than the first second
#: gives (a held connection sends nothing meanwhile).
HOLD_CAP_S = 1.0
#: Early returns in a row before a flow's 429s are held: one early retry is a client's normal
#: race (its request was under way when the 429 came); a second one is a pattern.
STRIKES = 2
#: Flows remembered per worker (the book is cleared when full: a storm's flows return at once).
BOOK_SIZE = 4096


_REFUSED = frozenset(("HTTP_TRANSFER_ENCODING", "HTTP_EXPECT", "HTTP_UPGRADE"))
#: Heads remembered per worker with what they read (cleared when full), and the largest kept
HEAD_CACHE_SIZE = 1024
HEAD_CACHE_BYTES = 2048
_UNREAD = object()


class HeadReader:
    """Reads a complete request head into the environ keys the built-in resolver reads, as
    gunicorn would set them, when the head qualifies for an answer from the poller (see the
    module docstring); one per worker, for the resolver's ``environ_keys``."""

    def __init__(self, environ_keys: tuple[str, ...] | frozenset) -> None:
        """Args:
            environ_keys: the keys the resolver reads (``RequestInfoResolver.environ_keys``);
                of the ``HTTP_*`` ones, only these are read from the head.
        """
        self._wanted = frozenset(environ_keys)
        # (head, client address) -> what it reads: a storm repeats the same few heads
        self._cache: dict[tuple[bytes, str], Any] = {}

    def __call__(self, buf: bytes, client: Any
                 ) -> tuple[dict, tuple[int, int], bool, str] | None:
        """The head's environ and what the answer needs (the environ is shared between calls
        for the same head and address: read it, never change it).

        Args:
            buf: the head's bytes (a whole head qualifies only with nothing after it).
            client: the peer address as gunicorn has it (a TCP ``(host, port)``).
        Returns:
            ``(environ, version, client_keep_alive, method)``, or None: give it to a thread.
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

    def _read(self, buf: bytes, client: tuple
              ) -> tuple[dict, tuple[int, int], bool, str] | None:
        n = len(buf)
        if buf.find(b"\r\n\r\n") != n - 4:
            return None  # bytes after the head (a body, a pipelined request), or no head
        head = buf[2 if buf[:2] == b"\r\n" else 0:n - 4]
        if not head.isascii():
            return None  # gunicorn decodes latin-1: such rare heads go to a thread
        lines = head.decode("ascii").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3:
            return None
        method, target, version = parts
        if version == "HTTP/1.1":
            ver = (1, 1)
        elif version == "HTTP/1.0":
            ver = (1, 0)
        else:
            return None
        if not (3 <= len(method) <= 20 and method.isalpha() and method.isupper()):
            return None
        if target[:1] != "/" or "#" in target or not target.isprintable():
            return None
        path, _, query = target.partition("?")
        if "%" in path:
            path = util.unquote_to_wsgi_str(path)
        environ = {"REQUEST_METHOD": method, "QUERY_STRING": query, "PATH_INFO": path,
                   "REMOTE_ADDR": client[0]}
        wanted = self._wanted
        connection = None
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or "_" in name or " " in name or "\t" in name:
                return None  # a folded line, a header gunicorn maps or drops, an odd name
            if not line.isprintable() and not line.replace("\t", " ").isprintable():
                return None  # a control character: gunicorn answers 400
            key = "HTTP_" + name.upper().replace("-", "_")
            if key == "HTTP_CONTENT_LENGTH":
                if value.strip(" \t") != "0":
                    return None
                continue
            if key in _REFUSED:
                return None
            if key == "HTTP_CONNECTION" and connection is None:
                connection = value.strip(" \t").lower()
            if key in wanted:
                value = value.strip(" \t")
                if key in environ:  # repeated fields joined as gunicorn joins them
                    environ[key] = environ[key] + "," + value
                else:
                    environ[key] = value
        if connection == "close":
            keep = False
        elif connection == "keep-alive":
            keep = True
        else:  # gunicorn: HTTP/1.1 keeps the connection, 1.0 closes it
            keep = ver == (1, 1)
        return environ, ver, keep, method


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
        self._cache: dict[tuple, bytes] = {}

    def get(self, route: Any, retry: int, version: tuple[int, int], method: str,
            keep: bool) -> bytes:
        """The 429's bytes.

        Args:
            route: the request's FlowSchema route (``middleware._Route``); retry: seconds.
            version: the request's HTTP version; method: its method (HEAD: no body).
            keep: the response keeps the connection alive (else ``Connection: close``).
        Returns:
            The response, ready to send.
        """
        second = int(time.time())
        if second != self._second:
            self._second = second
            self._cache.clear()
        key = (route, retry, version, method == "HEAD", keep)
        data = self._cache.get(key)
        if data is None:
            sink = _Capture()
            resp = Response(_Head(version, method, keep), sink, self._cfg)
            resp.start_response(REJECTED_STATUS, rejection_headers(route, retry))
            resp.write(TOO_MANY)
            resp.close()
            data = self._cache[key] = bytes(sink.data)
        return data


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
        self.bytes = RejectionBytes(cfg)
        self.strikes = Strikes()
        self.read_head = HeadReader(getattr(middleware.ctx.resolver, "environ_keys", ()))
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

    def answer(self, buf: bytes, client: Any, keepalive_room: bool
               ) -> tuple[bytes, bool, float, Any, str] | None:
        """The poller's answer to a complete head, if it is a 429.

        Args:
            buf: the head's bytes; client: the peer address.
            keepalive_room: the worker would keep the connection alive after a response
                (alive, keep-alive on, room among its kept-alive connections).
        Returns:
            ``(response bytes, keep the connection alive, seconds to hold it first, route,
            reason)``: the request's FlowSchema route (``middleware._Route``: its ``level``
            and ``fs_index``) and the reason its rejection was counted with, for counting
            a held one; or None: hand the request to a thread (nothing was counted).
        Raises:
            Exception: classification or the ledger failed (the caller hands it to a thread).
        """
        parsed = self.read_head(buf, client)
        if parsed is None:
            return None
        environ, version, keep, method = parsed
        now = time.monotonic_ns()
        got = self.mw.reject_early(environ, now)
        if got is None:
            return None
        route, retry, flow_hash, reason = got
        keep = keep and keepalive_room
        hold = self.strikes.hold_for((flow_hash, client[0]), now / 1e9, retry)
        return self.bytes.get(route, retry, version, method, keep), keep, hold, route, reason
