"""gthread/head.py's incremental scan: the same answers as a fresh look at the whole buffer,
each byte looked at a bounded number of times however the head is cut, and what gunicorn's
parser decides at once (an invalid request line, a PROXY protocol header, no line limit)."""

from __future__ import annotations

import struct

import pytest
from gunicorn.config import Config
from gunicorn.http.errors import NoMoreData
from gunicorn.http.parser import RequestParser

from apf_gunicorn.gthread.head import COMPLETE, MORE, TOO_LARGE, HeadRules, HeadScan, head_state
from tests.test_head import _cfg


def _decides(cfg: Config, buf: bytes) -> bool:
    """Whether gunicorn's parser parses or rejects ``buf`` without reading more."""
    try:
        next(RequestParser(cfg, iter([buf]), ("127.0.0.1", 1)))
    except (NoMoreData, StopIteration):
        return False
    except Exception:
        return True
    return True


V2 = (b"\r\n\r\n\x00\r\nQUIT\n" + bytes([0x21, 0x11]) + struct.pack(">H", 12)
      + bytes([10, 0, 0, 1, 10, 0, 0, 2]) + struct.pack(">HH", 1234, 80))
HEADS = [
    b"GET /hello HTTP/1.1\r\nHost: x\r\nX-Remote-User: alice\r\n\r\n",
    b"\r\nGET /after-empty-line HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /bare-lf-header HTTP/1.1\r\nHost: x\nX: y\r\n\r\n",
    b"PROXY TCP4 1.2.3.4 5.6.7.8 80 nope\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1 extra\r\nHost: x\r\n\r\n",
    b"get / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/9.9\r\nHost: x\r\n\r\n",
]


@pytest.mark.parametrize("head", HEADS, ids=range(len(HEADS)))
def test_every_prefix_agrees_with_gunicorns_parser_including_the_request_line(head):
    """COMPLETE exactly when gunicorn's parser decides from the prefix alone: an invalid
    request line ended by CRLF is one of those (gunicorn answers it 400 at once)."""
    cfg = _cfg()
    rules = HeadRules.of(cfg)
    scan = HeadScan(first=True)
    for n in range(1, len(head) + 1):
        buf = bytearray(head[:n])
        st = scan.state(buf, rules)  # one scan, fed every prefix in turn
        assert st == head_state(buf, rules, first=True), (n, buf)
        assert st != TOO_LARGE
        assert (st == COMPLETE) == _decides(cfg, bytes(buf)), (n, bytes(buf), st)
        if st == COMPLETE:
            break


@pytest.mark.parametrize("mode", ["v2", "auto"])
def test_a_proxy_v2_header_is_complete_only_with_the_request_head_behind_it(mode):
    """Its signature starts with CRLF CRLF, which is not the end of a head."""
    cfg = _cfg(proxy_protocol=mode)
    rules = HeadRules.of(cfg)
    head = V2 + b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
    scan = HeadScan(first=True, peer=("127.0.0.1", 1))
    for n in range(1, len(head) + 1):
        st = scan.state(bytearray(head[:n]), rules)
        assert st == (COMPLETE if n == len(head) else MORE), (n, st)


def test_a_proxy_header_gunicorn_refuses_is_answered_at_once():
    rules = HeadRules.of(_cfg(proxy_protocol="v1"))
    bad = b"PROXY TCP4 1.2.3.4 5.6.7.8 80 nope\r\n"
    assert HeadScan(first=True, peer=("127.0.0.1", 1)).state(bytearray(bad), rules) == COMPLETE
    good = b"PROXY TCP4 1.2.3.4 5.6.7.8 80 90\r\nGET / HTTP/1.1\r\n"
    assert HeadScan(first=True, peer=("127.0.0.1", 1)).state(bytearray(good), rules) == MORE
    # from a peer outside proxy_allow_ips: 403 at once, after 12 bytes
    far = HeadScan(first=True, peer=("10.9.9.9", 1))
    assert far.state(bytearray(good[:12]), rules) == COMPLETE
    # a kept-alive connection's next head has no PROXY header: "PROXY" is its method
    assert HeadScan(first=False).state(bytearray(bad), rules) == COMPLETE


def test_an_unlimited_request_line_is_unlimited_with_the_python_parser():
    rules = HeadRules.of(_cfg(limit_request_line=0))
    assert not rules.fast
    line = bytearray(b"\r\nGET /" + b"a" * (3 << 20))
    assert head_state(line, rules) == MORE
    line += b" HTTP/1.1\r\nHost: x\r\n\r\n"
    assert head_state(line, rules) == COMPLETE


def test_an_over_long_line_is_414_whatever_comes_before_it():
    """The fast parser's 1 MiB (limit 0): TOO_LARGE while the line has not ended, which the
    worker answers 414, with or without the empty line RFC 9112 allows before it."""
    rules = HeadRules.of(_cfg(limit_request_line=0))._replace(fast=True)
    for prefix in (b"", b"\r\n"):
        scan = HeadScan()
        assert scan.state(bytearray(prefix + b"GET /" + b"a" * (1 << 20)), rules) == TOO_LARGE
        assert not scan.line_ended
    scan = HeadScan()
    big = b"\r\nGET / HTTP/1.1\r\n" + b"X-Pad: " + b"b" * 900_000
    assert scan.state(bytearray(big), rules) == TOO_LARGE
    assert scan.line_ended


class _CountingBuf(bytearray):
    """A bytearray that adds up how many bytes each ``find`` looks at."""

    looked = 0

    def find(self, sub, start=0, end=None):  # noqa: D102 - bytearray.find, counted
        stop = len(self) if end is None else end
        i = bytearray.find(self, sub, start, stop)
        _CountingBuf.looked += (stop if i < 0 else i + len(sub)) - max(start, 0)
        return i


@pytest.mark.parametrize("piece", [1, 7, 100])
def test_a_trickled_head_is_scanned_a_bounded_number_of_times_per_byte(piece):
    rules = HeadRules.of(_cfg())
    head = b"GET / HTTP/1.1\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 60)
                                            for i in range(300))
    buf = _CountingBuf()
    scan = HeadScan(first=True)
    _CountingBuf.looked = 0
    for i in range(0, len(head), piece):
        buf += head[i:i + piece]
        assert scan.state(buf, rules) == MORE
    # two searches run over the header section (end of head, bare LF), each resumes where it
    # stopped, give or take the 3 bytes a CRLF CRLF may straddle: linear, not quadratic
    assert _CountingBuf.looked <= 3 * len(head) + 8 * (len(head) // piece + 1), \
        (_CountingBuf.looked, len(head))
