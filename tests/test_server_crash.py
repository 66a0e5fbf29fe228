"""Crash safety: workers SIGKILLed under load, and a worker killed while holding the ledger lock.

Afterwards the ledger must hold nothing (no seat in use, nothing waiting, no slot owned by a
dead pid) and new requests must be served at once.
"""

import http.client
import os
import random
import re
import signal
import threading
import time

import pytest

from tests.apps.loadgen import Client, run_clients

pytestmark = [pytest.mark.server, pytest.mark.slow]


def _assert_clean(srv):
    snap = srv.idle(timeout=30)
    assert snap is not None, [
        (lv.name, lv.seats_in_use, lv.requests_waiting, lv.requests_executing)
        for lv in srv.ledger_snapshot().levels]
    owners = {r.owner for lv in snap.levels for r in lv.requests}
    assert not owners, f"slots still owned: {owners}"
    # Served, not queued behind a leaked seat: with none in use (above), 8 requests of
    # different users fill the level's 8 seats and none waits for another.
    statuses = [srv.request("/work?ms=1", headers={"X-Remote-User": f"n{i}"})[0]
                for i in range(8)]
    assert statuses == [200] * 8


def _served(clients):
    return sum(s == 200 for c in clients for s in c.statuses)


def test_sigkill_random_workers_under_load(server_factory):
    rng = random.Random(1234)
    with server_factory(workers=4, threads=16) as srv:
        stop = threading.Event()
        clients = [Client(srv.port, "/work?ms=30", user=f"c{i % 6}", stop=stop, timeout=10)
                   for i in range(24)]
        for c in clients:
            c.start()
        killed = []
        try:
            # Each kill lands under load: requests were answered since the previous one.
            while len(killed) < 20:
                seen = _served(clients)
                assert srv.wait_for(lambda s=seen: _served(clients) >= s + 5, timeout=60), \
                    f"no request answered in 60 s after {len(killed)} kills"
                workers = srv.workers()
                if len(workers) < 4:
                    assert srv.wait_for(lambda: len(srv.workers()) == 4, timeout=30), \
                        f"the master did not replace its workers: {srv.workers()}"
                    continue
                victim = rng.choice(workers)
                os.kill(victim, signal.SIGKILL)
                killed.append(victim)
                time.sleep(rng.uniform(0.1, 0.3))  # spacing between kills, not a wait
        finally:
            stop.set()
            run_clients([], timeout=0)
            for c in clients:
                c.join(15)
        served = _served(clients)
        print(f"killed {len(killed)} workers; {served} requests served meanwhile")
        assert served >= 20 * 5
        # reaped by the master (a killed pid stays a child, a zombie, until then) and replaced
        assert srv.wait_for(lambda: not set(killed) & set(srv.workers())
                            and len(srv.workers()) == 4, timeout=30), \
            f"workers {srv.workers()}, killed {killed}"
        _assert_clean(srv)


class _Pinned(threading.Thread):
    """Requests ``/work`` in a loop on a keep-alive connection to one worker (``pid``): a
    connection another worker accepted is closed and made again, until ``stop``. (Keep-alive
    connections stay with the worker that accepted them, so unpinned clients may all be
    served by another worker, which is what a worker that booted late, on a loaded machine,
    sees.)"""

    def __init__(self, port: int, pid: int, user: str, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.port, self.pid, self.user, self.stop = port, pid, user, stop
        self.served_by: list[int] = []  # the pid that answered each 200
        self.errors = 0

    def run(self) -> None:
        conn = None
        while not self.stop.is_set():
            try:
                if conn is None:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                conn.request("GET", "/work?ms=20", headers={"X-Remote-User": self.user})
                resp = conn.getresponse()
                body = resp.read().decode()
                m = re.search(r"pid=(\d+)", body)
                if resp.status == 200 and m:
                    self.served_by.append(int(m.group(1)))
                if not (m and int(m.group(1)) == self.pid) \
                        or resp.getheader("Connection", "").lower() == "close":
                    conn.close()
                    conn = None
            except (OSError, http.client.HTTPException):
                self.errors += 1
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.05)  # the dying worker's connections break; pace the retries
        if conn is not None:
            conn.close()


def test_worker_killed_while_holding_the_ledger_lock(server_factory):
    env = {"APF_TEST_DIE_IN_LOCK": "40"}  # read by tests/apps/dying_conf.py
    with server_factory(workers=2, threads=16, env=env,
                        conf=("-c", "python:tests.apps.dying_conf")) as srv:
        found = srv.wait_for(
            lambda: re.search(r"apf test: worker (\d+) dies in its", srv.log()), timeout=30)
        assert found, "no worker took the dying lock"
        victim = int(found.group(1))
        repairs = srv.ledger_repairs()
        stop = threading.Event()
        # Half the clients on the dying worker, so that it reaches its 40th critical section
        # whichever worker the others' keep-alive connections land on; half anywhere, so that
        # the survivor has requests in the ledger when the holder dies.
        pinned = [_Pinned(srv.port, victim, f"p{i}", stop) for i in range(6)]
        clients = [Client(srv.port, "/work?ms=20", user=f"d{i}", stop=stop, timeout=10)
                   for i in range(6)]
        for c in (*pinned, *clients):
            c.start()
        try:
            died = srv.wait_for(
                lambda: f"Worker (pid:{victim}) was sent SIGKILL" in srv.log(), timeout=120)
        finally:
            stop.set()
            for c in (*pinned, *clients):
                c.join(15)
        by_victim = sum(p == victim for c in pinned for p in c.served_by)
        assert died, f"worker {victim} did not die; it answered {by_victim} pinned requests"
        # It died holding the lock: the next locker (the survivor or the master) repaired.
        assert srv.wait_for(lambda: srv.ledger_repairs() > repairs, timeout=30), \
            "nobody repaired the ledger after its lock holder died"
        assert srv.wait_for(lambda: victim not in srv.workers() and len(srv.workers()) == 2,
                            timeout=30), f"no replacement worker: {srv.workers()}"
        served = _served(clients) + sum(len(c.served_by) for c in pinned)
        print(f"{served} served around the holder's death ({by_victim} by the dying worker)")
        _assert_clean(srv)
