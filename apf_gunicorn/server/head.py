"""When a request head read so far is complete enough to hand to gunicorn's parser.

The accept-gated worker (``server/worker.py``) reads each connection's request head in its
poller, without a thread, and hands the connection to a thread only once gunicorn's HTTP/1.x
parser can process what is buffered without waiting for the client. That is when the buffer
holds the blank line that ends the head, or when it already breaks a rule the parser rejects
from buffered bytes alone (a bare LF, a request line longer than ``limit_request_line``): the
parser then answers its usual 400 or 414 at once. The bytes are not parsed here beyond finding
line ends; gunicorn parses them once, from its unreader buffer. (So a malformed request line is
answered once its head is complete, or 408 at the head deadline, not after its first line.)

    limits = HeadLimits.of(worker.cfg)
    state = head_state(buf, limits)    # MORE, COMPLETE or TOO_LARGE

``TOO_LARGE``: a header section longer than gunicorn's header buffer (``limit_request_fields``
x ``limit_request_field_size``), or with ``limit_request_line = 0`` a request line past the
1 MiB gunicorn's fast parser allows. gunicorn's parser only notices the former after one more
read from the socket, which could wait for ever, so the worker answers it itself, as gunicorn
would (``431``, or ``414``), and buffers no more.
"""

from __future__ import annotations

from typing import NamedTuple

MORE, COMPLETE, TOO_LARGE = 0, 1, 2

# gunicorn.http.message: MAX_REQUEST_LINE, MAX_HEADERS, DEFAULT_MAX_HEADERFIELD_SIZE
_MAX_REQUEST_LINE = 8190
_MAX_HEADERS = 32768
_DEFAULT_MAX_HEADERFIELD_SIZE = 8190
_UNLIMITED_LINE = 1024 * 1024  # what gunicorn's fast parser uses for limit_request_line = 0


class HeadLimits(NamedTuple):
    """gunicorn's size limits for one request head, as its ``Request`` computes them."""

    line: int  # longest request line (0: no limit of its own)
    headers: int  # longest header section (gunicorn's max_buffer_headers)

    @classmethod
    def of(cls, cfg) -> HeadLimits:
        """The limits of a gunicorn config (``limit_request_line``, ``limit_request_fields``,
        ``limit_request_field_size``), clamped exactly as gunicorn's ``Request`` clamps them."""
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



def head_state(buf: bytes | bytearray, limits: HeadLimits) -> int:
    """Whether gunicorn's parser can take ``buf`` (the bytes a connection sent so far) without
    reading more: MORE (not yet), COMPLETE (the head ends in it, or the parser rejects it from
    these bytes), TOO_LARGE (past gunicorn's limits; its parser would read once more first).

    Args:
        buf: the connection's bytes so far, from the start of a request.
        limits: ``HeadLimits.of(cfg)``.
    Returns:
        MORE, COMPLETE or TOO_LARGE.
    """
    if buf.find(b"\r\n\r\n") >= 0:  # (``in`` would first try the operand as an int)
        return COMPLETE
    n = len(buf)
    start = 2 if buf[:2] == b"\r\n" else 0  # RFC 9112 2.2: one empty line may come first
    nl = buf.find(b"\n", start)
    if nl < 0:  # the request line goes on: gunicorn's read_line raises past the limit
        if limits.line:
            return COMPLETE if n - start - 2 > limits.line else MORE
        return TOO_LARGE if n - start > _UNLIMITED_LINE else MORE
    if nl == start or buf[nl - 1] != 13:  # a bare LF (or LF first): rejected as it is
        return COMPLETE
    if limits.line and nl - 1 - start > limits.line:
        return COMPLETE
    rest = buf[nl + 1:]
    if rest.count(b"\n") != rest.count(b"\r\n"):
        return COMPLETE
    return TOO_LARGE if len(rest) > limits.headers else MORE
