"""Overload helpers shared by the overload tests and ``benchmarks/bench_overload.py``: clients
that send their request head slowly, idle connections opened at a pace, a prober that times
one request at a fixed pace, and a scrape of the admin endpoint's ``/metrics``.

    with SlowHeads(port, 60, every=0.5) as slow:   # 60 connections, a header line each 0.5 s
        ...
    slow.replies                                   # what each connection got back, once closed
    SlowHeads(port, 250, every=0.05, pad=8000, until=630_000)   # big heads, then silence

    probe = Prober(port, "/healthz", every=0.1)    # a fresh connection per probe
    probe.run(seconds=10)
    probe.failures, probe.latencies
    LineProber(agent_port, every=0.1).run(seconds=10)   # the same for a one-line protocol

    with IdleConnects(port, rate=30, prefill=256):   # connections that never send a byte
        ...

    samples = scrape(admin_port)                   # {(name, sorted labels): value}
    total(samples, "apf_rejected_requests_total", reason="thread-reserve")
"""

from __future__ import annotations

import collections
import http.client
import socket
import threading
import time

from prometheus_client.parser import text_string_to_metric_families


class SlowHeads:
    """``n`` connections that send a request head one header line every ``every`` seconds and
    never finish it, until stopped or the server closes them; one thread drives them all."""

    def __init__(self, port: int, n: int, *, every: float = 0.5, path: str = "/hello",
                 host: str = "127.0.0.1", pad: int = 10, until: int | None = None) -> None:
        """``pad``: bytes of each header line's value; ``until``: stop sending (but keep the
        connection open) once a head has this many bytes."""
        self.port, self.n, self.every, self.path, self.host = port, n, every, path, host
        self.pad, self.until = pad, until
        self.sent = [0] * n
        self.replies: list[bytes] = [b""] * n
        self.closed_at: list[float | None] = [None] * n
        self.opened_at = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.socks: list[socket.socket] = []

    def __enter__(self) -> SlowHeads:
        self.opened_at = time.monotonic()
        for _ in range(self.n):
            s = socket.create_connection((self.host, self.port), timeout=5)
            s.sendall(f"GET {self.path} HTTP/1.1\r\nHost: x\r\n".encode())
            s.setblocking(False)
            self.socks.append(s)
        self._thread.start()
        return self

    def _run(self) -> None:
        line = 0
        while not self._stop.is_set() and any(t is None for t in self.closed_at):
            line += 1
            for i, s in enumerate(self.socks):
                if self.closed_at[i] is not None:
                    continue
                try:
                    while chunk := s.recv(4096):
                        self.replies[i] += chunk
                    self.closed_at[i] = time.monotonic()  # EOF: the server closed it
                    continue
                except BlockingIOError:
                    pass
                except OSError:
                    self.closed_at[i] = time.monotonic()
                    continue
                if self.until is not None and self.sent[i] >= self.until:
                    continue
                try:
                    self.sent[i] += s.send(f"X-Slow-{line}: {'a' * self.pad}\r\n".encode())
                except OSError:
                    pass
            self._stop.wait(self.every)

    def wait_closed(self, timeout: float) -> bool:
        """Until the server closed every connection (True) or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(t is None for t in self.closed_at):
            time.sleep(0.05)
        return all(t is not None for t in self.closed_at)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        for s in self.socks:
            s.close()


class IdleConnects:
    """``rate`` new connections a second that never send, read or close anything until
    stopped (``prefill`` more at the start, at once); what the server does with them is its
    business. One thread opens them all.

        with IdleConnects(admin_port, rate=30, prefill=256):
            ...
    """

    def __init__(self, port: int, rate: float = 30.0, *, prefill: int = 0,
                 host: str = "127.0.0.1") -> None:
        self.port, self.rate, self.prefill, self.host = port, rate, prefill, host
        self.socks: list[socket.socket] = []
        self.errors = 0  # connects that failed (refused, timed out)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _open(self) -> None:
        try:
            self.socks.append(socket.create_connection((self.host, self.port), timeout=5))
        except OSError:
            self.errors += 1

    def __enter__(self) -> IdleConnects:
        for _ in range(self.prefill):
            self._open()
        self._thread.start()
        return self

    def _run(self) -> None:
        nxt = time.monotonic()
        while not self._stop.is_set():
            self._open()
            nxt += 1.0 / self.rate
            self._stop.wait(max(0.0, nxt - time.monotonic()))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        for s in self.socks:
            s.close()


class Prober:
    """One request every ``every`` seconds on a fresh connection (as a load balancer's health
    check does); a failure is anything but a 200 within ``timeout``."""

    def __init__(self, port: int, path: str = "/healthz", *, every: float = 0.1,
                 timeout: float = 5.0, headers: dict | None = None) -> None:
        self.port, self.path, self.every, self.timeout = port, path, every, timeout
        self.headers = headers or {}
        self.latencies: list[float] = []
        self.failures: list[str] = []

    def once(self) -> None:
        t0 = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        try:
            conn.request("GET", self.path, headers=self.headers)
            resp = conn.getresponse()
            resp.read()
            if resp.status != 200:
                self.failures.append(f"status {resp.status}")
                return
            self.latencies.append(time.monotonic() - t0)
        except (OSError, http.client.HTTPException) as e:
            self.failures.append(repr(e))
        finally:
            conn.close()

    def run(self, seconds: float) -> Prober:
        end = time.monotonic() + seconds
        nxt = time.monotonic()
        while nxt < end:
            self.once()
            nxt += self.every
            time.sleep(max(0.0, nxt - time.monotonic()))
        return self

    def quantile(self, q: float) -> float:
        lat = sorted(self.latencies)
        return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")


class LineProber(Prober):
    """A Prober for a line protocol (the HAProxy agent-check port): connect, read until the
    server closes; a failure is an empty or failed read within ``timeout``."""

    def once(self) -> None:
        t0 = time.monotonic()
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=self.timeout) as s:
                reply = b""
                while chunk := s.recv(256):
                    reply += chunk
            if not reply:
                self.failures.append("empty reply")
                return
            self.latencies.append(time.monotonic() - t0)
        except OSError as e:
            self.failures.append(repr(e))


def scrape(port: int) -> dict:
    """``{(sample name, sorted label items): value}`` of the admin endpoint's ``/metrics``
    (samples that differ only in labels left out of the key are summed)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    out: dict = collections.defaultdict(float)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] += s.value
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, lab), v in samples.items()
               if n == name and all(dict(lab).get(k) == x for k, x in labels.items()))
