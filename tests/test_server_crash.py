"""Crash safety: workers SIGKILLed under load, and a worker killed while holding the ledger lock.

Afterwards the ledger must hold nothing (no seat in use, nothing waiting, no slot owned by a
dead pid) and new requests must be served at once.
"""

import os
import random
import signal
import threading
import time

import pytest

from tests.apps.loadgen import Client, run_clients

pytestmark = [pytest.mark.server, pytest.mark.slow]


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _assert_clean(srv):
    snap = srv.idle(timeout=10)
    assert snap is not None, [
        (lv.name, lv.seats_in_use, lv.requests_waiting, lv.requests_executing)
        for lv in srv.ledger_snapshot().levels]
    owners = {r.owner for lv in snap.levels for r in lv.requests}
    assert not owners, f"slots still owned: {owners}"
    t0 = time.monotonic()
    statuses = [srv.request("/work?ms=1", headers={"X-Remote-User": f"n{i}"})[0]
                for i in range(8)]
    assert statuses == [200] * 8
    assert time.monotonic() - t0 < 2.0


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
            time.sleep(0.5)
            while len(killed) < 20:
                workers = srv.workers()
                if len(workers) < 4:
                    time.sleep(0.05)
                    continue
                victim = rng.choice(workers)
                os.kill(victim, signal.SIGKILL)
                killed.append(victim)
                time.sleep(rng.uniform(0.1, 0.3))
        finally:
            stop.set()
            run_clients([], timeout=0)
            for c in clients:
                c.join(15)
        served = sum(s == 200 for c in clients for s in c.statuses)
        print(f"killed {len(killed)} workers; {served} requests served meanwhile")
        assert served > 100
        assert not any(_alive(p) for p in killed)
        srv.wait_for(lambda: len(srv.workers()) == 4, timeout=10)
        _assert_clean(srv)


def test_worker_killed_while_holding_the_ledger_lock(server_factory):
    env = {"APF_TEST_DIE_IN_LOCK": "40"}  # read by tests/apps/dying_conf.py
    with server_factory(workers=2, threads=16, env=env,
                        conf=("-c", "python:tests.apps.dying_conf")) as srv:
        first = set(srv.workers())
        stop = threading.Event()
        clients = [Client(srv.port, "/work?ms=20", user=f"d{i}", stop=stop, timeout=10)
                   for i in range(12)]
        for c in clients:
            c.start()
        # Load until the worker has died: on a loaded machine the first worker may get few of
        # the connections and reach its Nth critical section late. (It also takes the lock
        # for its 100 ms backstop scans while requests wait.)
        try:
            died = srv.wait_for(lambda: "was sent SIGKILL" in srv.log(), timeout=30)
        finally:
            stop.set()
            run_clients([], timeout=0)
            for c in clients:
                c.join(15)
        assert died, "the dying worker did not die"
        assert not first <= set(srv.workers()), "a replacement worker was started"
        served = sum(s == 200 for c in clients for s in c.statuses)
        print(f"{served} served around the holder's death")
        _assert_clean(srv)
