"""gthread/head.py against gunicorn's own parser: for every prefix of a set of request heads
(valid, bare LF, over-long lines, too many header bytes, garbage), ``head_state`` says COMPLETE
only when gunicorn's HTTP/1.x parser can decide from those bytes alone (parse the request or
reject it), so a thread never waits on a socket; and MORE only when the parser would wait for
more, or would reject the request line itself (an invalid request line is answered once the
head is complete, or 408 at the head deadline: it costs a socket, not a thread)."""

from __future__ import annotations

import pytest
from gunicorn.config import Config
from gunicorn.http.errors import (
    InvalidHTTPVersion,
    InvalidRequestLine,
    InvalidRequestMethod,
    LimitRequestHeaders,
    LimitRequestLine,
    NoMoreData,
    ParseException,
)
from gunicorn.http.parser import RequestParser

from apf_gunicorn.gthread.head import COMPLETE, MORE, TOO_LARGE, HeadLimits, head_state


def _cfg(**settings) -> Config:
    cfg = Config()
    for k, v in settings.items():
        cfg.set(k, v)
    return cfg


def parse(cfg: Config, buf: bytes) -> str:
    """What gunicorn's parser does with ``buf`` and then the end of input: "more" (it ran out
    of input: on a socket it would have waited), "line" (it rejected the request line),
    "done" (it parsed the head or rejected something else). Any error that is not one of the
parser's own verdicts (``ParseException``) is raised: a broken call is a test error, never
an outcome."""
    try:
        next(RequestParser(cfg, iter([buf]), ("127.0.0.1", 1)))
    except (NoMoreData, StopIteration):
        return "more"
    except (InvalidRequestLine, InvalidRequestMethod, InvalidHTTPVersion):
        return "line"
    except ParseException:
        return "done"
    return "done"


def parser_too_large(cfg: Config, buf: bytes) -> bool:
    """Whether gunicorn's parser rejects ``buf`` as too large once it reads one byte more (any
    other verdict of the parser's is False; an error that is not a verdict is raised)."""
    try:
        next(RequestParser(cfg, iter([buf, b"x"]), ("127.0.0.1", 1)))
    except (LimitRequestHeaders, LimitRequestLine):
        return True
    except (NoMoreData, StopIteration, ParseException):
        return False
    return False


HEADS = [
    b"GET /hello HTTP/1.1\r\nHost: x\r\nX-Remote-User: alice\r\n\r\n",
    b"GET / HTTP/1.1\r\n\r\n",
    b"\r\nGET /after-empty-line HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc",
    b"GET /bare-lf HTTP/1.1\nHost: x\r\n\r\n",
    b"GET /bare-lf-header HTTP/1.1\r\nHost: x\nX: y\r\n\r\n",
    b"GET /" + b"a" * 300 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\n" + b"X-Many: " + b"b" * 600 + b"\r\n\r\n",
    b"\x00\xff garbage\r\n\r\n",
]


@pytest.mark.parametrize("head", HEADS, ids=range(len(HEADS)))
def test_every_prefix_agrees_with_gunicorns_parser(head):
    # small limits so that the over-long cases are reached by short prefixes
    cfg = _cfg(limit_request_line=120, limit_request_fields=4, limit_request_field_size=100)
    limits = HeadLimits.of(cfg)
    for n in range(1, len(head) + 1):
        buf = head[:n]
        state = head_state(bytearray(buf), limits)
        if state == TOO_LARGE:  # the worker answers 431 itself: past gunicorn's header limit
            assert len(buf) - buf.index(b"\r\n") - 2 > limits.headers, (n, buf)
            assert parser_too_large(cfg, buf), (n, buf)
            continue
        outcome = parse(cfg, buf)
        if state == COMPLETE:
            assert outcome != "more", (n, buf)
        else:
            assert outcome in ("more", "line"), (n, buf, outcome)


def test_limits_follow_gunicorns_clamping():
    assert HeadLimits.of(_cfg()) == HeadLimits(4094, 100 * (8190 + 2) + 4)
    assert HeadLimits.of(_cfg(limit_request_line=0, limit_request_fields=0,
                              limit_request_field_size=0)) == HeadLimits(0, 32768 * 8192 + 4)
    assert HeadLimits.of(_cfg(limit_request_line=99999)).line == 8190


def test_an_unlimited_request_line_stops_at_a_mebibyte_only_with_the_fast_parser():
    from apf_gunicorn.gthread.head import HeadRules

    limits = HeadLimits(line=0, headers=100)  # limit_request_line = 0: no limit of its own
    long_line = bytearray(b"GET /" + b"a" * (1 << 20))
    assert head_state(bytearray(b"GET /" + b"a" * 200), limits) == MORE
    # gunicorn's Python parser has no line limit then (the worker's head budget bounds it)
    assert head_state(long_line, limits) == MORE
    # its fast parser stops at 1 MiB
    assert head_state(long_line, HeadRules(limits, fast=True)) == TOO_LARGE
