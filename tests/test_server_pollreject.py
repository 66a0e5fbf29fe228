"""429s answered by the worker's poller without a thread, and held for a flow that ignores its
Retry-After (``gthread/pollreject.py``), on real servers over real sockets.

A configuration the poller cannot classify (``APF_REQUEST_INFO``) answers every 429 from the
middleware on a thread: the reference the poller's answers are compared with. gunicorn's
access log lists both; the environ key ``apf_gunicorn.poller`` (``True`` in the poller's
lines, ``-`` in a thread's) tells them apart.
"""

from __future__ import annotations

import http.client
import re
import socket
import threading
import time

from tests.apps.overload import scrape, total
from tests.conftest import APPS, free_port
from tests.promtool import check_metrics

OTHER = b"GET /other HTTP/1.1\r\nHost: t\r\nX-Remote-User: %s\r\n\r\n"
HELLO = b"GET /hello HTTP/1.1\r\nHost: t\r\n\r\n"
TIGHT = {"APF_CONCURRENCY_LIMIT": "2"}  # "other" (Reject) gets one seat
HOOKED = {**TIGHT, "APF_REQUEST_INFO": "tests.apps.passthrough:request_info"}


def read_response(sock: socket.socket) -> bytes:
    """One whole response (its head and Content-Length bytes of body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?im)^content-length:\s*(\d+)", head).group(1))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed within the body"
        body += chunk
    assert len(body) == length  # nothing beyond: one request, one response
    return head + b"\r\n\r\n" + body


def without_date(response: bytes) -> bytes:
    return re.sub(rb"\r\nDate: [^\r]*", b"", response)


def in_background(srv, path: str) -> threading.Thread:
    """``srv.request(path)`` on a daemon thread, started; the server stopping under it (the
    test is over) ends it quietly."""
    def request() -> None:
        try:
            srv.request(path)
        except (OSError, http.client.HTTPException):
            pass
    t = threading.Thread(target=request, daemon=True)
    t.start()
    return t


def hold_other(srv, ms: int = 8000) -> threading.Thread:
    """Take the "other" level's one seat with a request of ``ms`` ms; returns once it runs."""
    t = in_background(srv, f"/other?ms={ms}")
    assert srv.wait_for(lambda: srv.level("other").seats_in_use == 1)
    return t


#: gunicorn's default access log format, and whether the poller wrote the response
FORMAT = ('%(h)s %(l)s %(u)s %(t)s "%(r)s" %(s)s %(b)s "%(f)s" "%(a)s" '
          '%({apf_gunicorn.poller}e)s')


def logged(path) -> tuple[str, ...]:
    """gunicorn's arguments for an access log in ``path`` with :data:`FORMAT`."""
    return ("--access-logfile", str(path), "--access-logformat", FORMAT)


def access_429s(path) -> int:
    """The 429s a thread wrote, in the access log."""
    return sum(1 for line in path.read_text().splitlines()
               if '" 429 ' in line and not line.endswith(" True"))


def poller_429s(path) -> int:
    """The 429s the poller wrote, in the access log."""
    return sum(1 for line in path.read_text().splitlines()
               if '" 429 ' in line and line.endswith(" True"))


def rejected_stats(srv) -> dict:
    with srv.attached_ledger() as led:
        st = next(s for s in led.request_stats() if s.level == "other")
    return {"rejected": dict(st.rejected), "work": st.work, "wait_rejected": st.wait_rejected,
            "level_rejected": srv.level("other").rejected}


def storm_of_three(server_factory, tmp_path, env: dict) -> tuple[list[bytes], bytes, int, dict]:
    """Three GET /other on one kept-alive connection while the level's seat is held, then
    GET /hello on it: the responses, the 429s in the access log, the ledger's counts."""
    log = tmp_path / f"access-{len(env)}.log"
    with server_factory(workers=1, threads=4, config=str(APPS / "tight.yaml"), env=env,
                        args=logged(log)) as srv:
        hold_other(srv)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            answers = []
            for _ in range(3):
                s.sendall(OTHER % b"mallory")
                answers.append(read_response(s))
            s.sendall(HELLO)
            hello = read_response(s)
        stats = rejected_stats(srv)
        assert srv.wait_for(lambda: access_429s(log) + poller_429s(log) >= 3)
        return answers, hello, access_429s(log), stats


def test_poller_429_is_the_middleware_429_and_the_connection_lives_on(server_factory, tmp_path):
    answers, hello, logged, stats = storm_of_three(server_factory, tmp_path, TIGHT)
    ref_answers, ref_hello, ref_logged, ref_stats = storm_of_three(server_factory, tmp_path,
                                                                   HOOKED)
    assert ref_logged == 3  # the reference: every 429 from a thread
    assert logged == 1  # the first on a thread (the worker was calm), then the poller's
    for got, ref in zip(answers, ref_answers, strict=True):
        assert got.startswith(b"HTTP/1.1 429 Too Many Requests\r\n")
        assert b"\r\nConnection: keep-alive\r\n" in got
        assert without_date(got) == without_date(ref)
    assert hello.startswith(b"HTTP/1.1 200 ") and ref_hello.startswith(b"HTTP/1.1 200 ")
    # the same counters and histograms (what /metrics exports)
    assert stats == ref_stats
    assert stats["rejected"]["concurrency-limit"] == 3 and stats["level_rejected"] == 3


def test_connection_close_and_http10_are_answered_as_gunicorn_does(server_factory, tmp_path):
    log = tmp_path / "access.log"
    with server_factory(workers=1, threads=4, config=str(APPS / "tight.yaml"),
                        env=TIGHT, args=logged(log)) as srv:
        hold_other(srv)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            for _ in range(2):  # the second comes to a worker that just rejected
                s.sendall(OTHER % b"m")
                read_response(s)
            s.sendall(b"GET /other HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            closing = read_response(s)
            assert s.recv(10) == b""  # closed after it
        assert b"\r\nConnection: close\r\n" in closing
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(b"HEAD /other HTTP/1.0\r\n\r\n")
            head = s.recv(65536)
            assert head.startswith(b"HTTP/1.0 429 Too Many Requests\r\n")
            assert head.endswith(b"\r\n\r\n")  # no body for HEAD
            assert s.recv(10) == b""
        assert srv.wait_for(lambda: access_429s(log) + poller_429s(log) >= 4)
        assert access_429s(log) == 1  # the poller answered all but the first
        assert poller_429s(log) == 3


def test_thread_reserve_is_answered_by_the_poller(server_factory, tmp_path):
    log = tmp_path / "access.log"
    # 4 threads, 2 kept for exempt requests: two /work requests take the others
    with server_factory(workers=1, threads=4, config=str(APPS / "tight.yaml"),
                        env={"APF_CONCURRENCY_LIMIT": "4"},
                        args=logged(log)) as srv:
        for _ in range(2):
            in_background(srv, "/work?ms=6000")
        assert srv.wait_for(lambda: srv.level("work").requests_executing == 2)
        status, headers, _ = srv.request("/other", headers={"X-Remote-User": "late"})
        assert status == 429 and headers["Retry-After"] == "1"
        with srv.attached_ledger() as led:
            st = next(s for s in led.request_stats() if s.level == "other")
        assert st.rejected["thread-reserve"] == 1
        assert srv.wait_for(lambda: poller_429s(log) == 1)
        assert access_429s(log) == 0  # no thread answered it


def delayed(srv) -> int:
    """The 429s the server's pollers held so far, summed over levels, FlowSchemas, reasons."""
    with srv.attached_ledger() as led:
        return sum(sum(st.delayed.values()) for st in led.request_stats())


def test_only_a_flow_that_ignores_retry_after_is_held(server_factory):
    with server_factory(workers=1, threads=4, config=str(APPS / "tight.yaml"),
                        env=TIGHT) as srv:
        hold_other(srv)
        # alice waits each Retry-After before she asks again: never held
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            for _ in range(4):
                s.sendall(OTHER % b"alice")
                answer = read_response(s)
                assert answer.startswith(b"HTTP/1.1 429 ")
                retry = int(re.search(rb"Retry-After: (\d+)", answer).group(1))
                time.sleep(retry + 0.05)  # what she is told to do (not a synchronisation)
        assert delayed(srv) == 0
        # mallory asks again at once, again and again: her next 429s are held
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            for _ in range(5):
                s.sendall(OTHER % b"mallory")
                assert read_response(s).startswith(b"HTTP/1.1 429 ")
        assert delayed(srv) >= 2


def test_held_rejections_are_exported_with_their_level_flow_schema_and_reason(server_factory,
                                                                             tmp_path):
    """The scraped ``apf_rejections_delayed_total`` names whose 429s were held, as
    ``apf_rejected_requests_total`` does: level "other" through a FlowSchema of another name,
    with the reason its rejections were counted with."""
    config = tmp_path / "storms.yaml"
    config.write_text((APPS / "tight.yaml").read_text().replace(
        "metadata: {name: other, uid: uid-fs-other}", "metadata: {name: storms, uid: uid-fs-other}"))
    aport = free_port()
    with server_factory(workers=1, threads=4, config=str(config),
                        env={**TIGHT, "APF_ADMIN_BIND": f"127.0.0.1:{aport}"}) as srv:
        hold_other(srv)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            for _ in range(5):  # mallory asks again at once: her next 429s are held
                s.sendall(OTHER % b"mallory")
                assert read_response(s).startswith(b"HTTP/1.1 429 ")
        name = "apf_rejections_delayed_total"
        samples = scrape(aport)
        held = total(samples, name)
        assert held >= 2
        mine = {"priority_level": "other", "flow_schema": "storms",
                "reason": "concurrency-limit"}
        assert [dict(labels) for n, labels in samples if n == name] == [mine]
        assert total(samples, name, **mine) == held == delayed(srv)
        # held 429s are among the rejections counted for the same level and FlowSchema
        assert total(samples, "apf_rejected_requests_total", **mine) >= held + 1
        conn = http.client.HTTPConnection("127.0.0.1", aport, timeout=10)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        check_metrics(text)  # last: without promtool it skips (fails under CI)


def test_held_connections_are_bounded(server_factory):
    rounds = 5
    # (8 threads: room to keep both connections alive beside the held seat)
    with server_factory(workers=1, threads=8, config=str(APPS / "tight.yaml"),
                        env={**TIGHT, "APF_HELD_REJECTIONS": "1"}) as srv:
        hold_other(srv)
        a = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        b = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        with a, b:
            for _ in range(rounds):
                a.sendall(OTHER % b"mallory")
                b.sendall(OTHER % b"mallory")
                assert read_response(a).startswith(b"HTTP/1.1 429 ")
                assert read_response(b).startswith(b"HTTP/1.1 429 ")
        # both ignore Retry-After, but only one of each round's two can be held at a time
        assert 1 <= delayed(srv) <= rounds


def test_a_connection_first_answered_by_the_poller_gets_its_next_request_served(
        server_factory, tmp_path):
    """A connection whose first request the poller answered 429 was never initialized by a
    thread; its next request, which goes to a thread, must be served, not left waiting on a
    socket whose head the poller already read (the CI flake: a flood client's
    "Remote end closed connection without response")."""
    log = tmp_path / "access.log"
    with server_factory(workers=1, threads=4, config=str(APPS / "tight.yaml"), env=TIGHT,
                        args=logged(log)) as srv:
        hold_other(srv)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as warm:
            warm.sendall(OTHER % b"mallory")  # a thread rejects it: the worker is now "hot"
            assert read_response(warm).startswith(b"HTTP/1.1 429 ")
        assert srv.wait_for(lambda: access_429s(log) == 1)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(OTHER % b"mallory")
            first = read_response(s)
            assert first.startswith(b"HTTP/1.1 429 ")
            assert b"\r\nConnection: keep-alive\r\n" in first
            s.sendall(HELLO)  # not rejected: the poller hands it to a thread
            assert read_response(s).startswith(b"HTTP/1.1 200 ")
        assert srv.wait_for(lambda: poller_429s(log) == 1)
        assert access_429s(log) == 1, "the new connection's 429 came from a thread"


# -- the 429 path agrees with gunicorn's parser (a saturated level, a corpus of heads) ----------

def _answer(sock: socket.socket, head_only: bool) -> str:
    """The status line of one answer on ``sock`` (its body read), or "closed"."""
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return "closed" if not data else data.split(b"\r\n")[0].decode("latin-1")
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
        want = 0 if head_only or length is None else int(length.group(1))
        while len(body) < want:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    except ConnectionResetError:
        return "closed"
    return head.split(b"\r\n")[0].decode("latin-1")


def _replay(srv, corpus: dict[str, bytes]) -> dict[str, tuple[str, str]]:
    """Each head on a new connection while the worker is rejecting: its answer's status line,
    and what the connection does with a next request (its answer's status line, or
    "closed")."""
    got = {}
    for name, head in corpus.items():
        # HELLO's level ("catch-all", one seat, Reject) is free again: the previous HELLO's
        # thread gives its seat back when gunicorn closes the response, after writing it, so
        # the client may have read the 200 and sent the next HELLO before then (a 429 here)
        assert srv.wait_for(lambda: srv.level("catch-all").seats_in_use == 0)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as warm:
            warm.sendall(OTHER % b"warm")  # a 429 just now: the worker asks its poller
            assert read_response(warm).startswith(b"HTTP/1.1 429 ")
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            s.sendall(head)
            first = _answer(s, head.startswith(b"HEAD "))
            try:
                s.sendall(HELLO)
                then = _answer(s, False)
            except (BrokenPipeError, ConnectionResetError):
                then = "closed"
        got[name] = (first, then)
    return got


def test_the_poller_answers_every_head_of_the_corpus_as_gunicorn_does(server_factory):
    """On a saturated level, a head gunicorn answers 400 (an invalid header name, two
    Content-Length fields, ...) got the poller's 429 with the connection kept alive, and a
    ``CONNECT`` (which gunicorn closes after) kept alive too. The reference: the same server
    with a request-info hook, where every head goes to a thread (``HOOKED``)."""
    from tests.test_pollreject_corpus import CORPUS

    # (not sent: heads a thread waits on for a body, or answered 100/101 first)
    skip = {"a-body", "chunked", "expect-continue", "upgrade"}
    corpus = {k: v for k, v in CORPUS.items() if k not in skip}
    env = {"APF_HELD_REJECTIONS": "0"}  # the corpus is one flow, retrying at once
    # (8 threads: a worker over its room closes connections after a response, whoever wrote
    # it, and a closed warm connection is counted until the worker reads its end)
    answers = {}
    for name, conf in (("apf", TIGHT), ("reference", HOOKED)):
        with server_factory(workers=1, threads=8, config=str(APPS / "tight.yaml"),
                            env={**conf, **env}) as srv:
            hold_other(srv, ms=3_600_000)  # held until the server stops, however slow the replay
            answers[name] = _replay(srv, corpus)
    ref = answers["reference"]
    assert ref["invalid-header-name"] == ("HTTP/1.1 400 Bad Request", "closed")
    assert ref["two-content-lengths"] == ("HTTP/1.1 400 Bad Request", "closed")
    assert ref["connect"] == ("HTTP/1.1 429 Too Many Requests", "closed")
    assert ref["plain"] == ("HTTP/1.1 429 Too Many Requests", "HTTP/1.1 200 OK")
    differ = {k: (answers["apf"][k], ref[k]) for k in corpus if answers["apf"][k] != ref[k]}
    assert not differ, differ


# -- the poller's 429s in gunicorn's access log and max_requests -----------------------------

def test_poller_429s_are_in_the_access_log_as_a_threads_are(server_factory):
    """Operators grep access logs for 429s: the poller's were missing. Now each is logged
    with gunicorn's own Logger.access and the configured format, the same line a thread
    writes for the middleware's 429 but for the mark."""
    fmt = ('ACCESS %(h)s "%(r)s" %(s)s %(b)s %(m)s %(U)s %(q)s %(H)s %({x-remote-user}i)s '
           '%({retry-after}o)s %({content-type}o)s %({apf_gunicorn.poller}e)s')
    with server_factory(workers=1, threads=8, config=str(APPS / "tight.yaml"),
                        env={**TIGHT, "APF_HELD_REJECTIONS": "0"},
                        args=("--access-logfile", "-", "--access-logformat", fmt)) as srv:
        hold_other(srv)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            for _ in range(3):
                s.sendall(b"GET /other?x=1 HTTP/1.1\r\nHost: t\r\nX-Remote-User: mallory\r\n\r\n")
                assert read_response(s).startswith(b"HTTP/1.1 429 ")

        def lines() -> list[str]:
            return [ln[ln.index("ACCESS "):] for ln in srv.log().splitlines()
                    if "ACCESS " in ln and '" 429 ' in ln]

        assert srv.wait_for(lambda: len(lines()) >= 3), srv.log()[-3000:]
    got = lines()
    thread = ('ACCESS 127.0.0.1 "GET /other?x=1 HTTP/1.1" 429 43 GET /other x=1 HTTP/1.1 '
              'mallory 1 text/plain; charset=utf-8 -')
    assert got == [thread] + [thread[:-1] + "True"] * 2, got


def test_poller_429s_count_towards_max_requests(server_factory):
    """A worker answering a storm from its poller never reached ``max_requests``: the 429s it
    wrote were not counted, and it kept every connection alive. Now each counts as gthread
    counts a request: the one that reaches the limit is answered ``Connection: close`` and the
    worker restarts."""
    limit = 12
    with server_factory(workers=1, threads=8, config=str(APPS / "tight.yaml"),
                        env={**TIGHT, "APF_HELD_REJECTIONS": "0"},
                        args=("--max-requests", str(limit), "--max-requests-jitter", "0")
                        ) as srv:
        hold_other(srv)
        answers = []
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
            for _ in range(3 * limit):
                s.sendall(OTHER % b"mallory")
                try:
                    answer = read_response(s)
                except (AssertionError, ConnectionResetError):
                    break  # closed after the previous answer
                answers.append(answer)
                if b"\r\nConnection: close\r\n" in answer:
                    assert s.recv(10) == b""  # and closed
                    break
        assert answers and b"\r\nConnection: close\r\n" in answers[-1], (
            f"{len(answers)} answers on one connection, none closing it")
        assert all(a.startswith(b"HTTP/1.1 429 ") for a in answers)
        assert len(answers) < limit  # (the seat holder and the server's probes counted too)
        assert srv.wait_for(lambda: "Autorestarting worker after current request." in srv.log())
