"""The accept-gated worker's poller on a real gunicorn: connections that send nothing, or send
a head slowly, cost a socket and a bounded buffer, never a thread (and the accept gate only for
their first APF_ACCEPT_GRACE); and what stock gthread answers at once (a bad request or PROXY
line, a long line with no line limit), the poller answers the same.

Outcomes only: every probe answered 200 (within a generous timeout), every user request
served, the dropped counters, the workers' RSS. The latency figures are measured by
``benchmarks/bench_overload.py`` (scenarios g and h).
"""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from tests.apps.loadgen import Client
from tests.apps.overload import IdleConnects, Prober, SlowHeads, scrape, total
from tests.conftest import free_port

pytestmark = [pytest.mark.server, pytest.mark.slow]

STOCK = ("-k", "gthread", "--no-control-socket")


def test_idle_connections_never_close_the_gate(server_factory):
    """100 connections a second that never send a byte, against 2 workers x 8 threads that
    hold at most 20 reading connections each: probes and a signed-in user are all served,
    and the oldest idle connections are dropped (counted)."""
    admin = free_port()
    env = {"APF_ADMIN_BIND": f"127.0.0.1:{admin}", "APF_HEAD_CONNECTIONS": "20",
           "APF_HEADER_TIMEOUT": "30"}
    with server_factory(workers=2, threads=8, env=env) as srv:
        with IdleConnects(srv.port, rate=100) as idle:
            user = Client(srv.port, "/other", user="alice", count=20, timeout=10)
            user.start()
            probes = Prober(srv.port, "/healthz", every=0.1, timeout=10).run(3.0)
            user.join(60)
        assert len(idle.socks) >= 200, idle.errors
        assert not probes.failures, probes.failures
        assert user.statuses == [200] * 20, (user.statuses, user.errors)
        dropped = total(scrape(admin), "apf_connections_dropped_total",
                        reason="head-connections")
        print(f"idle {len(idle.socks)}, dropped {dropped:.0f}; probe p99 "
              f"{probes.quantile(0.99) * 1e3:.0f} ms, user p99 "
              f"{sorted(user.latencies)[-1] * 1e3:.0f} ms")
        assert dropped > 0
        assert "Traceback" not in srv.log()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class _RssPeak(threading.Thread):
    """The largest sum of the workers' RSS seen every 20 ms."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.pids, self.peak = pids, 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.02):
            self.peak = max(self.peak, sum(_rss(p) for p in self.pids))


def test_trickled_heads_stay_within_the_head_buffer_limit(server_factory):
    """100 connections each trickling a 630 KB head (never finished) against workers that
    buffer at most 4 MiB of incomplete heads each: the largest are answered 431 (counted),
    RSS grows by about the budget, not by the 63 MB sent, and probes keep answering."""
    admin = free_port()
    limit = 4 << 20
    env = {"APF_ADMIN_BIND": f"127.0.0.1:{admin}", "APF_HEAD_BUFFER_LIMIT": str(limit),
           "APF_HEADER_TIMEOUT": "30"}
    with server_factory(workers=2, threads=4, env=env) as srv:
        srv.request("/hello")
        pids = srv.workers()
        base = sum(_rss(p) for p in pids)
        peak = _RssPeak(pids)
        peak.start()
        with SlowHeads(srv.port, 100, every=0.02, pad=8000, until=630_000) as slow:
            assert srv.wait_for(lambda: all(n >= 630_000 or t is not None
                                            for n, t in zip(slow.sent, slow.closed_at, strict=True)),
                                timeout=60), slow.sent
            probes = Prober(srv.port, "/healthz", every=0.1, timeout=10).run(1.0)
        peak.stop.set()
        peak.join(5)
        grown = peak.peak - base
        dropped = total(scrape(admin), "apf_connections_dropped_total", reason="head-buffer")
        answered = sum(r.startswith(b"HTTP/1.1 431 ") for r in slow.replies)
        print(f"sent {sum(slow.sent) / 2**20:.1f} MiB; RSS grew {grown / 2**20:.1f} MiB; "
              f"dropped {dropped:.0f}, 431 seen {answered}")
        assert not probes.failures, probes.failures
        assert dropped > 0 and answered > 0
        assert grown <= 2 * limit + (12 << 20), grown / 2**20
        assert "Traceback" not in srv.log()


# -- what stock gthread answers at once -------------------------------------------------------

def _exchange(port: int, pieces: list[bytes], *, wait: float = 10.0) -> str:
    """Send ``pieces`` (50 ms apart) on one connection, keep it open, and return the status
    line of the first answer, or "closed" / "no answer" within ``wait`` seconds."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        for i, p in enumerate(pieces):
            if i:
                time.sleep(0.05)
            s.sendall(p)
        got = b""
        deadline = time.monotonic() + wait
        while b"\r\n" not in got and time.monotonic() < deadline:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = s.recv(4096)
            except TimeoutError:
                break
            except OSError:
                return "closed"
            if not chunk:
                return got.decode("latin-1") or "closed"
            got += chunk
        return got.split(b"\r\n")[0].decode("latin-1") if got else "no answer"


V2 = (b"\r\n\r\n\x00\r\nQUIT\n" + bytes([0x21, 0x11]) + struct.pack(">H", 12)
      + bytes([127, 0, 0, 9, 127, 0, 0, 1]) + struct.pack(">HH", 1234, 80))
LONG = b"/" + b"a" * (3 << 19)  # 1.5 MiB
GET = b" HTTP/1.1\r\nHost: x\r\n\r\n"

CASES = {
    # (gunicorn args, pieces): sent whole and in pieces, the head left open where it is not
    # complete: gunicorn rejects these from the bytes sent, without waiting for more
    "bad-proxy-line": ((), [b"PROXY TCP4 1.2.3.4 5.6.7.8 80 nope\r\n"]),
    "bad-method": ((), [b"get /hello HTTP/1.1\r\n", b"Host: x\r\n"]),
    "bad-version": ((), [b"GET /hello HTTP/7.1\r\n"]),
    "proxy-v1-bad": (("--proxy-protocol", "v1"), [b"PROXY TCP4 1.2.3.4 5.6.7.8 80 nope\r\n"]),
    "proxy-v2": (("--proxy-protocol", "v2"), [V2[:14], V2[14:], b"GET /hello", GET]),
    "no-line-limit": (("--limit-request-line", "0"), [b"GET " + LONG[:1 << 20],
                                                      LONG[1 << 20:] + GET]),
    "no-line-limit-crlf": (("--limit-request-line", "0"), [b"\r\nGET " + LONG + GET]),
    "long-line-crlf": ((), [b"\r\nGET " + LONG[:9000]]),
}


@pytest.mark.parametrize("args", sorted({c[0] for c in CASES.values()}), ids=str)
def test_the_poller_answers_what_stock_gthread_answers(server_factory, args):
    env = {"APF_HEADER_TIMEOUT": "60"}
    cases = {k: pieces for k, (a, pieces) in CASES.items() if a == args}
    got: dict[str, dict] = {}
    for name, conf in (("stock", STOCK), ("apf", ("-c", "python:apf_gunicorn.conf"))):
        with server_factory(workers=1, threads=4, env=env, conf=conf, args=args) as srv:
            for case, pieces in cases.items():
                got.setdefault(case, {})[name] = (_exchange(srv.port, [b"".join(pieces)]),
                                                  _exchange(srv.port, pieces))
    print(got)
    for case, answers in got.items():
        assert answers["apf"] == answers["stock"], (case, answers)
        assert "no answer" not in answers["stock"], (case, answers)


def test_an_incomplete_proxy_v2_header_holds_no_thread(server_factory):
    """Its signature starts with CRLF CRLF. Stock gthread, and the poller before, gave it to a
    thread, which waited in recv for the rest: 4 of them took every thread of this worker."""
    with server_factory(workers=1, threads=4, env={"APF_HEADER_TIMEOUT": "60"},
                        args=("--proxy-protocol", "v2")) as srv:
        held = []
        for _ in range(6):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.sendall(V2[:20])
            held.append(s)
        try:
            # a probe (with its own PROXY header) finds a thread
            assert _exchange(srv.port, [V2 + b"GET /healthz" + GET]).startswith(
                "HTTP/1.1 200"), srv.log()[-2000:]
            for s in held:  # and the held ones complete as gunicorn would have them
                s.sendall(V2[20:] + b"GET /healthz" + GET)  # (exempt: never a 429)
                s.settimeout(10)
                assert s.recv(4096).startswith(b"HTTP/1.1 200")
        finally:
            for s in held:
                s.close()
