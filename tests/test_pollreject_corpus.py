"""The poller reads a head only when gunicorn would hand it to the app, and reads it as gunicorn
does (``gthread/pollreject.py`` ``HeadReader`` against gunicorn's own ``RequestParser`` and
``wsgi.create``), over a corpus of heads gunicorn accepts and rejects.

A head gunicorn answers 400 (or 417, 501) or closes must never get the poller's 429 with the
connection kept alive: the client would go on sending on a connection gunicorn gave up, and a
request smuggled behind a malformed head would be read as the next one.
"""

from __future__ import annotations

import pytest
from gunicorn.config import Config
from gunicorn.http import wsgi
from gunicorn.http.parser import RequestParser

from apf_gunicorn.gthread.pollreject import HeadReader

PEER = ("192.0.2.7", 5000)
PROXY = ("127.0.0.1", 5000)
KEYS = ("REQUEST_METHOD", "PATH_INFO", "QUERY_STRING", "REMOTE_ADDR", "HTTP_X_REMOTE_USER",
        "HTTP_X_REMOTE_GROUP", "HTTP_USER_AGENT", "CONTENT_TYPE", "HTTP_X_A")

R = b"GET /other HTTP/1.1\r\nHost: t\r\nX-Remote-User: m\r\n"
#: heads ending in CRLF CRLF, nothing after them: (name, bytes)
CORPUS = {
    # the issue's three (gunicorn: 400, 400, and a CONNECT answered with the connection closed)
    "invalid-header-name": R + b"X(A): 1\r\n\r\n",
    "two-content-lengths": R + b"Content-Length: 0\r\nContent-Length: 0\r\n\r\n",
    "connect": b"CONNECT /other HTTP/1.1\r\nHost: t\r\nX-Remote-User: m\r\n\r\n",
    # heads gunicorn rejects
    "space-before-colon": R + b"X-A : 1\r\n\r\n",
    "empty-name": R + b": 1\r\n\r\n",
    "no-colon": R + b"X-A\r\n\r\n",
    "folded": R + b"X-A: 1\r\n  more\r\n\r\n",
    "control-in-value": R + b"X-A: a\x01b\r\n\r\n",
    "del-in-value": R + b"X-A: a\x7fb\r\n\r\n",
    "nul-in-value": R + b"X-A: a\x00b\r\n\r\n",
    "two-hosts": R + b"Host: u\r\n\r\n",
    "two-content-types": R + b"Content-Type: a/b\r\nContent-Type: c/d\r\n\r\n",
    "negative-length": R + b"Content-Length: -1\r\n\r\n",
    "signed-length": R + b"Content-Length: +0\r\n\r\n",
    "hex-length": R + b"Content-Length: 0x0\r\n\r\n",
    "length-list": R + b"Content-Length: 0, 0\r\n\r\n",
    "te-gzip": R + b"Transfer-Encoding: gzip\r\n\r\n",
    "te-unknown": R + b"Transfer-Encoding: foo\r\n\r\n",
    "te-chunked-http10": b"GET /other HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
    "te-and-length": R + b"Transfer-Encoding: chunked\r\nContent-Length: 0\r\n\r\n",
    "expect-other": R + b"Expect: something\r\n\r\n",
    "underscore-script-name": R + b"SCRIPT_NAME: /x\r\n\r\n",
    "lowercase-method": b"get /other HTTP/1.1\r\nHost: t\r\n\r\n",
    "method-with-hash": b"G#T /other HTTP/1.1\r\nHost: t\r\n\r\n",
    "long-method": b"ABCDEFGHIJKLMNOPQRSTUVWXYZ /other HTTP/1.1\r\nHost: t\r\n\r\n",
    "double-space": b"GET  /other HTTP/1.1\r\nHost: t\r\n\r\n",
    "space-in-target": b"GET /oth er HTTP/1.1\r\nHost: t\r\n\r\n",
    "latin1-target": b"GET /oth\xe9r HTTP/1.1\r\nHost: t\r\n\r\n",
    "tab-in-target": b"GET /oth\ter HTTP/1.1\r\nHost: t\r\n\r\n",
    "authority-form": b"GET t:80 HTTP/1.1\r\nHost: t\r\n\r\n",
    "asterisk-get": b"GET * HTTP/1.1\r\nHost: t\r\n\r\n",
    "http2": b"GET /other HTTP/2.0\r\nHost: t\r\n\r\n",
    "http09": b"GET /other HTTP/0.9\r\nHost: t\r\n\r\n",
    "version-lowercase": b"GET /other http/1.1\r\nHost: t\r\n\r\n",
    "version-two-digits": b"GET /other HTTP/1.10\r\nHost: t\r\n\r\n",
    "no-version": b"GET /other\r\nHost: t\r\n\r\n",
    "bare-lf-in-head": R + b"X-A: 1\nX-B: 2\r\n\r\n",
    "cr-in-value": R + b"X-A: a\rb\r\n\r\n",
    "two-empty-lines-first": b"\r\n\r\nGET /other HTTP/1.1\r\nHost: t\r\n\r\n",
    # from a trusted proxy (127.0.0.1, gunicorn's forwarded_allow_ips) 400, from others ignored
    "scheme-conflict": R + b"X-Forwarded-Proto: https\r\nX-Forwarded-Ssl: off\r\n\r\n",
    # heads gunicorn hands to the app: the poller may answer them, read as gunicorn reads them
    "plain": R + b"\r\n",
    "http10": b"GET /other HTTP/1.0\r\nX-Remote-User: m\r\n\r\n",
    "http10-keep-alive": b"GET /other HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
    "connection-close": R + b"Connection: close\r\n\r\n",
    "connection-close-upper": R + b"Connection: CLOSE\r\n\r\n",
    "head": b"HEAD /other HTTP/1.1\r\nHost: t\r\nX-Remote-User: m\r\n\r\n",
    "zero-length": R + b"Content-Length: 0\r\n\r\n",
    "zero-length-padded": R + b"Content-Length:  00 \r\n\r\n",
    "content-type": R + b"Content-Type: text/plain\r\n\r\n",
    "repeated-user": R + b"x-remote-user: n\r\n\r\n",
    "groups": R + b"X-Remote-Group: a\r\nX-Remote-Group: b\r\n\r\n",
    "underscore-dropped": R + b"X_Remote_User: admin\r\n\r\n",
    "latin1-value": R + b"User-Agent: caf\xe9\r\n\r\n",
    "tab-in-value": R + b"X-A: a\tb\r\n\r\n",
    "empty-value": R + b"X-A:\r\n\r\n",
    "token-name": R + b"X-!#$%&'*+.^`|~: 1\r\n\r\n",
    "percent-path": b"GET /other/a%20b%2Fc?x=%41 HTTP/1.1\r\nHost: t\r\n\r\n",
    "bad-percent": b"GET /other/%zz HTTP/1.1\r\nHost: t\r\n\r\n",
    "double-slash": b"GET //other HTTP/1.1\r\nHost: t\r\n\r\n",
    "fragment": b"GET /other?x=1#frag HTTP/1.1\r\nHost: t\r\n\r\n",
    "empty-line-first": b"\r\nGET /other HTTP/1.1\r\nHost: t\r\n\r\n",
    "no-host": b"GET /other HTTP/1.1\r\n\r\n",
    "odd-method": b"PROPFIND /other HTTP/1.1\r\nHost: t\r\n\r\n",
    "options-asterisk": b"OPTIONS * HTTP/1.1\r\nHost: t\r\n\r\n",
    "absolute-form": b"GET http://t/other HTTP/1.1\r\nHost: t\r\n\r\n",
    "expect-continue-http10": b"GET /other HTTP/1.0\r\nExpect: 100-continue\r\n\r\n",
    "expect-continue": R + b"Expect: 100-continue\r\n\r\n",
    "upgrade": R + b"Connection: Upgrade\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n",
    "chunked": R + b"Transfer-Encoding: chunked\r\n\r\n",
    "a-body": R + b"Content-Length: 5\r\n\r\n",
}


class _Sock:
    """What ``wsgi.create`` may write to (a ``100 Continue``)."""

    def send(self, data: bytes) -> int:
        return len(data)

    sendall = send


def gunicorn_reads(head: bytes, cfg: Config, peer: tuple = PEER) -> tuple[dict, bool] | None:
    """What gunicorn makes of ``head`` from ``peer``: None when it answers it with an error
    (or closes), else the environ ``wsgi.create`` gives the app and whether it keeps the
    connection."""
    try:
        req = next(RequestParser(cfg, iter([head]), peer))
        _resp, environ = wsgi.create(req, _Sock(), peer, "127.0.0.1:8000", cfg)
    except Exception:  # noqa: BLE001 - any error: gunicorn answers it (400, 417, 501, ...)
        return None
    return environ, not req.should_close()


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_the_poller_reads_only_what_gunicorn_accepts_and_as_gunicorn_reads_it(name):
    cfg = Config()
    head = CORPUS[name]
    got = HeadReader(KEYS, cfg)(head, PEER)
    ref = gunicorn_reads(head, cfg)
    if ref is None:
        assert got is None, f"{name}: gunicorn rejects it, the poller would answer it"
        return
    if got is None:
        return  # a thread answers it (a body, Expect, Upgrade, an absolute target ...)
    environ, keep = ref
    assert got.environ == {k: environ[k] for k in KEYS if k in environ}, name
    assert got.keep_alive is keep, name
    assert got.version == req_version(head)


def req_version(head: bytes) -> tuple[int, int]:
    return (1, 0) if b" HTTP/1.0\r\n" in head else (1, 1)


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_from_a_trusted_proxy_too(name):
    """Scheme and forwarder headers count only from ``forwarded_allow_ips``: the same head
    can be gunicorn's 400 from there and fine from elsewhere."""
    cfg = Config()
    got = HeadReader(KEYS, cfg)(CORPUS[name], PROXY)
    ref = gunicorn_reads(CORPUS[name], cfg, PROXY)
    assert ref is not None or got is None, name


def test_the_issues_heads_are_left_to_gunicorn_and_connect_closes():
    cfg = Config()
    read = HeadReader(KEYS, cfg)
    for name in ("invalid-header-name", "two-content-lengths"):
        assert read(CORPUS[name], PEER) is None
    connect = read(CORPUS["connect"], PEER)
    assert connect is None or connect.keep_alive is False


def test_the_corpus_covers_both_sides():
    """The comparison means something only if the poller answers some of the corpus."""
    cfg = Config()
    read = HeadReader(KEYS, cfg)
    answered = [n for n, h in CORPUS.items() if read(h, PEER) is not None]
    rejected = [n for n, h in CORPUS.items() if gunicorn_reads(h, cfg) is None]
    assert len(answered) >= 20 and len(rejected) >= 30, (answered, rejected)
