"""A small threaded HTTP load generator for the server tests (keep-alive connections)."""

from __future__ import annotations

import http.client
import threading
import time


class Client(threading.Thread):
    """One connection issuing requests in a loop until ``stop`` is set or ``count`` is done."""

    def __init__(self, port, path, *, user=None, count=None, pause=0.0, stop=None,
                 timeout=30.0):
        super().__init__(daemon=True)
        self.port, self.path, self.user = port, path, user
        self.count, self.pause, self.timeout = count, pause, timeout
        self.stop_event = stop or threading.Event()
        self.statuses: list[int] = []
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self.headers: list[dict] = []

    def run(self):
        conn = None
        headers = {"X-Remote-User": self.user} if self.user else {}
        n = 0
        while not self.stop_event.is_set() and (self.count is None or n < self.count):
            n += 1
            t0 = time.monotonic()
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port,
                                                      timeout=self.timeout)
                conn.request("GET", self.path, headers=headers)
                resp = conn.getresponse()
                resp.read()
                self.statuses.append(resp.status)
                self.latencies.append(time.monotonic() - t0)
                if len(self.headers) < 3:
                    self.headers.append(dict(resp.getheaders()))
                if resp.getheader("Connection", "").lower() == "close":
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException) as e:
                self.errors.append(repr(e))
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.05)
            if self.pause:
                time.sleep(self.pause)
        if conn is not None:
            conn.close()


def run_clients(clients, duration=None, timeout=60.0):
    for c in clients:
        c.start()
    if duration is not None:
        time.sleep(duration)
        for c in clients:
            c.stop_event.set()
    deadline = time.monotonic() + timeout
    for c in clients:
        c.join(max(0.1, deadline - time.monotonic()))
    return clients
