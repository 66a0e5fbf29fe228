"""What a 429 answered by the poller costs in Python calls (``gthread/pollanswer.py`` with
``gthread/pollreject.py``), counted exactly: a storm's retries are answered there, one after
another on the worker's main thread, and each Python-level call is about a thousand
instructions of CPython 3.11. A head seen before, the middleware's verdict stubbed (the ledger's
part is measured by ``bench_instructions.py --rejecting``), gunicorn's access log off (its
default): the poller's own work is the six functions of ``BUDGET`` and nothing else (no
logging call, no ``NamedTuple`` constructor in Python)."""

from __future__ import annotations

import socket
import sys
from collections import deque
from types import SimpleNamespace

import pytest
from gunicorn.config import Config
from gunicorn.glogging import Logger

from apf_gunicorn.admission.core import Route
from apf_gunicorn.gthread.pollanswer import PollerAnswers
from apf_gunicorn.gthread.pollreject import Answer, PollerRejector

HEAD = b"GET /work?ms=20 HTTP/1.1\r\nHost: h\r\nX-Remote-User: mallory\r\n\r\n"
#: the Python functions a kept-alive connection's 429 runs in the poller's own code
BUDGET = ["apf_reject_here", "answer", "__call__", "hold_for", "get", "_apf_answer"]


class _Middleware:
    """What ``PollerRejector`` reads of ``APFMiddleware``; every request rejected."""

    poller_classifies = True

    def __init__(self) -> None:
        keys = ("REQUEST_METHOD", "PATH_INFO", "QUERY_STRING", "REMOTE_ADDR",
                "HTTP_X_REMOTE_USER")
        self.ctx = SimpleNamespace(resolver=SimpleNamespace(environ_keys=keys))
        self.stats = {"rejected": 0}
        self.route = Route(1, 0, [("X-Kubernetes-PF-FlowSchema-UID", "fs")], "users", "fs", 1,
                           False)

    def reject_early(self, environ: dict, now: int):
        self.stats["rejected"] += 1
        return self.route, 1, 7, "queue-full"


class _Worker(PollerAnswers):
    """The worker fields the poller's 429 uses, as ``ApfThreadWorker`` has them."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.log = Logger(cfg)
        self.alive = True
        self._apf_keepalive_on = True
        self._apf_keepalive_s = 2.0
        self.keepalived_conns: deque = deque()
        self.max_keepalived = 100
        self.nr = 0
        self.max_requests = sys.maxsize
        self.nr_conns = 1
        self.apf_held: list = []
        self.apf_held_max = 128
        self._apf_held_seq = 0
        self.apf_on_delayed = None
        self.apf_rejector = PollerRejector(_Middleware(), cfg)
        self.apf_access_log = bool(self.log.access_log_enabled)


@pytest.fixture
def kept_alive():
    """A worker and a kept-alive connection whose client end is read by the test."""
    worker = _Worker(Config())
    ours, theirs = socket.socketpair()
    conn = SimpleNamespace(sock=ours, client=("192.0.2.7", 5000), server=("127.0.0.1", 8000),
                           timeout=0.0)
    worker.keepalived_conns.append(conn)
    yield worker, conn, theirs
    ours.close()
    theirs.close()


def _python_calls(fn) -> list[str]:
    """The names of the Python functions ``fn()`` calls (itself not included)."""
    calls: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls[1:]


def test_a_kept_alive_429_runs_only_the_pollers_own_calls(kept_alive) -> None:
    worker, conn, client = kept_alive
    assert worker.apf_reject_here(conn, HEAD, True)  # the head is read and cached
    calls = _python_calls(lambda: worker.apf_reject_here(conn, HEAD, True))
    assert b"429" in client.recv(4096).split(b"\r\n")[0]
    assert list(worker.keepalived_conns) == [conn] and worker.nr == 2
    ours = [name for name in calls if name != "reject_early"]  # (the stubbed middleware)
    # With the access log off, no logging call (log_access, gunicorn's access_log_enabled),
    # and the answer is built without the NamedTuple's Python-level __new__ ("<lambda>").
    assert ours == BUDGET, calls


def test_the_answer_is_still_an_answer_with_its_fields(kept_alive) -> None:
    worker, conn, _client = kept_alive
    got = worker.apf_rejector.answer(HEAD, conn.client, True)
    assert type(got) is Answer
    assert got.data.startswith(b"HTTP/1.1 429 ") and got.keep is True and got.hold == 0
    assert got.route is worker.apf_rejector.mw.route and got.reason == "queue-full"
    assert got.req.path == "/work" and got.resp.status_code == 429 and got.at > 0
