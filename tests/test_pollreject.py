"""The poller's side of a 429 without a thread (``gthread/pollreject.py``), pure: which heads it
reads and what it reads of them, and which flows have their 429s held."""

from __future__ import annotations

import pytest

from apf_gunicorn.gthread.pollreject import HOLD_CAP_S, HeadReader, Strikes

PEER = ("192.0.2.7", 5000)
read = HeadReader(("REQUEST_METHOD", "PATH_INFO", "QUERY_STRING", "REMOTE_ADDR",
                   "HTTP_X_REMOTE_USER", "HTTP_X_REMOTE_GROUP"))


def test_a_plain_head_gives_the_resolvers_keys_as_gunicorn_sets_them() -> None:
    env, ver, keep, method, _req = read(
        b"GET /a%20b?x=1 HTTP/1.1\r\nHost: h\r\nX-Remote-User:  alice \r\n"
        b"X-Remote-Group: a\r\nx-remote-group: b\r\nContent-Length: 0\r\n\r\n", PEER)
    assert env == {"REQUEST_METHOD": "GET", "PATH_INFO": "/a b", "QUERY_STRING": "x=1",
                   "REMOTE_ADDR": "192.0.2.7", "HTTP_X_REMOTE_USER": "alice",
                   "HTTP_X_REMOTE_GROUP": "a,b"}  # (Host is not read: the resolver does not)
    assert (ver, keep, method) == ((1, 1), True, "GET")


@pytest.mark.parametrize("head, keep", [
    (b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n", False),
    (b"GET / HTTP/1.0\r\n\r\n", False),
    (b"GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n", True),
    (b"\r\nGET / HTTP/1.1\r\n\r\n", True),  # one empty line before the request is allowed
])
def test_keep_alive_follows_gunicorn(head: bytes, keep: bool) -> None:
    assert read(head, PEER)[2] is keep


@pytest.mark.parametrize("head", [
    b"POST / HTTP/1.1\r\nContent-Length: 3\r\n\r\n",  # a body
    b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
    b"GET / HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\n\r\n",  # pipelined
    b"GET / HTTP/1.1\r\nExpect: 100-continue\r\n\r\n",
    b"GET / HTTP/1.1\r\nUpgrade: h2c\r\n\r\n",
    b"GET / HTTP/1.1\r\nX-A: 1\r\n folded\r\n\r\n",
    b"GET / HTTP/1.1\r\nX-A: \x01\r\n\r\n",
    b"GET http://h/ HTTP/1.1\r\n\r\n",  # absolute form
    b"get / HTTP/1.1\r\n\r\n",
    b"GET / HTTP/2.0\r\n\r\n",
    b"GET /\xe9 HTTP/1.1\r\n\r\n",
    b"GET / HTTP/1.1\r\n",  # not a whole head
])
def test_anything_else_goes_to_a_thread(head: bytes) -> None:
    assert read(head, PEER) is None


def test_a_unix_socket_peer_goes_to_a_thread() -> None:
    assert read(b"GET / HTTP/1.1\r\n\r\n", "/run/app.sock") is None


def test_a_flow_that_waits_its_retry_after_is_never_held() -> None:
    s = Strikes()
    t = 100.0
    for _ in range(10):
        assert s.hold_for((1, "a"), t, 1) == 0
        t += 1.0  # comes back when told to


def test_a_flow_that_comes_back_early_again_and_again_is_held_up_to_its_retry_after() -> None:
    s = Strikes()
    assert s.hold_for((1, "a"), 100.0, 2) == 0
    assert s.hold_for((1, "a"), 100.1, 2) == 0  # one early retry: a race, not a pattern
    hold = s.hold_for((1, "a"), 100.2, 2)  # the second in a row: held until due, capped
    assert hold == HOLD_CAP_S
    assert s.hold_for((1, "b"), 100.2, 2) == 0  # the same flow from another address: never
    assert s.hold_for((2, "a"), 100.2, 2) == 0  # another flow: never
    # after a held 429, the next early retry is held until that one's Retry-After is due
    assert s.hold_for((1, "a"), 100.2 + hold + 1.5, 2) == pytest.approx(0.5)
