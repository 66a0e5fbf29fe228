"""When a request head read so far is complete enough to hand to gunicorn's parser.

The accept-gated worker (``gthread/worker.py``) reads each connection's request head in its
poller, without a thread, and hands the connection to a thread only once gunicorn's HTTP/1.x
parser can process what is buffered without waiting for the client. That is when the buffer
holds the blank line that ends the head, or when it already breaks a rule the parser rejects
from buffered bytes alone: a bare LF, a request line longer than ``limit_request_line``, an
invalid request line ended by CRLF (gunicorn's Python parser checks it before reading the
headers), a PROXY protocol header gunicorn refuses. The parser then answers its usual 400, 403
or 414 at once. The bytes are not parsed here beyond that: gunicorn parses them once more, from
its unreader buffer, and its own functions decide (``Request.parse_request_line`` and its PROXY
protocol code are called on the buffered bytes; they never read from a socket here).

    rules = HeadRules.of(worker.cfg)      # limits, parser, proxy_protocol (once per worker)
    scan = HeadScan(first=True, peer=addr)  # one per head; first: a new connection's first
    state = scan.state(buf, rules)        # MORE, COMPLETE or TOO_LARGE; call again as buf grows

A scan remembers where it stopped (the end-of-head search, the request line's end, the bare-LF
check), so a head that arrives in many pieces is scanned a bounded number of times per byte,
not once per read.

``TOO_LARGE``: a header section longer than gunicorn's header buffer (``limit_request_fields``
x ``limit_request_field_size``), or, with ``limit_request_line = 0`` and gunicorn's fast (C)
parser, a request line past the 1 MiB that parser allows (gunicorn's Python parser has no line
limit then). gunicorn's parser only notices after one more read from the socket, which could
wait for ever, so the worker answers it itself, as gunicorn would (``431``, or ``414`` when
:attr:`HeadScan.line_ended` is False), and buffers no more.
"""

from __future__ import annotations

from typing import NamedTuple

from gunicorn.http import message
from gunicorn.http.errors import NoMoreData

MORE, COMPLETE, TOO_LARGE = 0, 1, 2

# gunicorn.http.message: MAX_REQUEST_LINE, MAX_HEADERS, DEFAULT_MAX_HEADERFIELD_SIZE
_MAX_REQUEST_LINE = 8190
_MAX_HEADERS = 32768
_DEFAULT_MAX_HEADERFIELD_SIZE = 8190
_FAST_UNLIMITED_LINE = 1024 * 1024  # gunicorn's fast parser's line limit for limit 0
_PROXY_V2_PREFIX = 16  # signature (12 bytes), version/command, family, length (2)


class HeadLimits(NamedTuple):
    """gunicorn's size limits for one request head, as its ``Request`` computes them."""

    line: int  # longest request line (0: no limit of its own)
    headers: int  # longest header section (gunicorn's max_buffer_headers)

    @classmethod
    def of(cls, cfg) -> HeadLimits:
        """The limits of a gunicorn config (``limit_request_line``, ``limit_request_fields``,
        ``limit_request_field_size``), clamped exactly as gunicorn's ``Request`` clamps them.

        Args:
            cfg: a gunicorn ``Config``.
        Returns:
            The limits.
        """
        line = cfg.limit_request_line
        if line < 0 or line >= _MAX_REQUEST_LINE:
            line = _MAX_REQUEST_LINE
        fields = cfg.limit_request_fields
        if fields <= 0 or fields > _MAX_HEADERS:
            fields = _MAX_HEADERS
        size = cfg.limit_request_field_size
        if size <= 0:
            size = _DEFAULT_MAX_HEADERFIELD_SIZE
        return cls(line, fields * (size + 2) + 4)


class HeadRules(NamedTuple):
    """What decides how gunicorn's parser reads a head under one config: its limits, which
    parser it uses, whether a PROXY protocol header may come first."""

    limits: HeadLimits
    fast: bool = False  # gunicorn's fast (C) parser, not its Python one
    proxy: str = "off"  # gunicorn's proxy_protocol (a new connection's first head)
    cfg: object = None  # the gunicorn config: gunicorn's own checks are called with it

    @classmethod
    def of(cls, cfg) -> HeadRules:
        """The rules of a gunicorn config.

        Args:
            cfg: a gunicorn ``Config``.
        Returns:
            The rules.
        """
        check = getattr(message, "_check_fast_parser", None)
        try:
            fast = bool(check(cfg)) if check is not None else False
        except RuntimeError:  # http_parser = "fast" unavailable: gunicorn says so per request
            fast = False
        proxy = str(getattr(cfg, "proxy_protocol", "off") or "off")
        return cls(HeadLimits.of(cfg), fast, proxy, cfg)


def head_state(buf: bytes | bytearray, rules: HeadRules | HeadLimits,
               first: bool = False) -> int:
    """Whether gunicorn's parser can take ``buf`` (the bytes a connection sent so far) without
    reading more; one look, without a scan kept between calls (see :class:`HeadScan`).

    Args:
        buf: the connection's bytes so far, from the start of a request.
        rules: ``HeadRules.of(cfg)``, or bare ``HeadLimits`` (the Python parser, no PROXY
            protocol, the request line not checked).
        first: the connection's first request (a PROXY protocol header may come first).
    Returns:
        MORE, COMPLETE or TOO_LARGE.
    """
    if isinstance(rules, HeadLimits):
        rules = HeadRules(rules)
    return HeadScan(first).state(buf, rules)


class _Probe(message.Request):
    """A gunicorn ``Request`` that was never read from a socket: its checks of a request line
    and of a PROXY protocol header, called on buffered bytes. Reading past them raises
    ``NoMoreData`` (the source is empty), which means "gunicorn would wait for more"."""

    def __init__(self, cfg, peer) -> None:  # (Request.__init__ would parse from a source)
        self.cfg = cfg
        self.peer_addr = peer
        self.proxy_protocol_info = None


def _empty_read():
    return b""


class _NoSource:
    read = staticmethod(_empty_read)


_NO_SOURCE = _NoSource()


class HeadScan:
    """Where the scan of one buffered request head stopped, so each byte is looked at a bounded
    number of times however many pieces the head arrives in.

    Attributes:
        line_ended: the request line's CRLF has arrived (a TOO_LARGE head is then answered
            431, else 414).
    """

    __slots__ = ("first", "base", "start", "searched", "line_from", "line_end", "lf_from",
                 "peer")

    def __init__(self, first: bool = False, peer=None) -> None:
        """A scan of a head not looked at yet.

        Args:
            first: the connection's first head (a PROXY protocol header may come first).
            peer: the client's address, for gunicorn's ``proxy_allow_ips`` check.
        """
        self.first = first  # a PROXY protocol header may come before the request
        self.peer = peer  # the client's address (gunicorn's PROXY allow-list check)
        self.base = 0  # where the request begins: after a PROXY protocol header
        self.start = -1  # where the request line starts, once known
        self.searched = 0  # the end-of-head search covered buf[:searched]
        self.line_from = 0  # the request line's LF is not in buf[start:line_from]
        self.line_end = -1  # index of the request line's LF
        self.lf_from = 0  # every LF in the header section before this index follows a CR

    @property
    def line_ended(self) -> bool:
        return self.line_end >= 0

    def state(self, buf: bytes | bytearray, rules: HeadRules) -> int:
        """MORE, COMPLETE or TOO_LARGE for ``buf``, which holds every byte given before.

        Args:
            buf: the connection's bytes so far, from the start of a request (only ever grows
                between calls on one scan).
            rules: ``HeadRules.of(cfg)``.
        Returns:
            MORE (gunicorn's parser would wait for more), COMPLETE (it can parse or reject
            ``buf`` without reading), TOO_LARGE (past its limits; it would read once more).
        """
        n = len(buf)
        start = self.start
        if start < 0:
            start = self._find_start(buf, rules)
            if start < 0:
                return -start - 1  # MORE or COMPLETE, decided before the request line
        # the blank line that ends the head (a CRLF CRLF straddling two reads is found too)
        if buf.find(b"\r\n\r\n", max(start, self.searched - 3)) >= 0:
            return COMPLETE
        self.searched = n
        limits = rules.limits
        if self.line_end < 0:
            nl = buf.find(b"\n", self.line_from)
            if nl < 0:  # the request line goes on: gunicorn's read_line raises past the limit
                self.line_from = n
                if limits.line:
                    return COMPLETE if n - start - 2 > limits.line else MORE
                if rules.fast:  # limit 0: the fast parser's own 1 MiB
                    return TOO_LARGE if n - start > _FAST_UNLIMITED_LINE else MORE
                return MORE  # no limit (Python parser): the worker's head budget bounds it
            if nl == start or buf[nl - 1] != 13:  # a bare LF (or LF first): rejected as it is
                return COMPLETE
            if limits.line and nl - 1 - start > limits.line:
                return COMPLETE
            self.line_end = nl
            if not rules.fast and rules.cfg is not None:
                try:  # gunicorn's Python parser checks the line before it reads a header
                    _Probe(rules.cfg, self.peer).parse_request_line(bytes(buf[start:nl - 1]))
                except Exception:
                    return COMPLETE
            self.lf_from = nl + 1
        # gunicorn's Python parser rejects a bare LF among the headers before reading more
        j = buf.find(b"\n", self.lf_from)
        while j >= 0:
            if buf[j - 1] != 13:
                return COMPLETE
            j = buf.find(b"\n", j + 1)
        self.lf_from = n
        return TOO_LARGE if n - self.line_end - 1 > limits.headers else MORE

    def _find_start(self, buf: bytes | bytearray, rules: HeadRules) -> int:
        """Where the request line starts: after a PROXY protocol header (on a first request,
        when gunicorn's ``proxy_protocol`` is on) and one empty line (RFC 9112 2.2). Returns it,
        or ``-1 - MORE``/``-1 - COMPLETE`` while that is not known or gunicorn decides before."""
        n = len(buf)
        if self.first and rules.proxy != "off":
            if n < 12:  # gunicorn reads 12 bytes before it looks
                return -1 - MORE
            # gunicorn's own code decides, on a copy, only once it can: when the v1 line has
            # ended or the v2 header is whole (so a trickled header is not parsed per read);
            # before that only whether the peer may send one (gunicorn checks it first)
            probe = _Probe(rules.cfg, self.peer)
            wait = False
            if buf[:6] == b"PROXY " and rules.proxy in ("v1", "auto"):
                wait = buf.find(b"\n", max(6, self.searched - 1)) < 0
                self.searched = n
            elif (buf[:12] == message.PP_V2_SIGNATURE and rules.proxy in ("v2", "auto")
                  and n >= _PROXY_V2_PREFIX):
                wait = n < _PROXY_V2_PREFIX + int.from_bytes(buf[14:16], "big")
            try:
                if wait:
                    probe.proxy_protocol_access_check()
                    return -1 - MORE
                rest = probe._handle_proxy_protocol(_NO_SOURCE, bytearray(buf), rules.proxy)
            except NoMoreData:  # the PROXY header is not complete yet
                return -1 - MORE
            except Exception:  # gunicorn refuses it from these bytes (400, 403, ...)
                return -1 - COMPLETE
            self.base = n - len(rest)
            self.first = False
        start = self.base
        if n - start < 2 and buf[start:start + 1] in (b"", b"\r"):
            return -1 - MORE  # one CR could still be the start of an empty line
        if buf[start:start + 2] == b"\r\n":
            start += 2
        self.start = self.searched = self.line_from = self.lf_from = start
        return start
