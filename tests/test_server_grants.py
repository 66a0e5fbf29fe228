"""Grants are hints, the ledger is the truth: forged grant datagrams sent to every grant socket of
a real server while requests are parked neither run a request beyond its level's seats nor
leave anything executing or waiting in the ledger once the traffic ends."""

from __future__ import annotations

import concurrent.futures as cf
import re
import socket
import threading

import msgpack
import pytest

pytestmark = pytest.mark.server


def _grant_sockets(instance: str) -> list[bytes]:
    """The abstract names of a server's grant sockets, as /proc/net/unix lists them."""
    names = set()
    with open("/proc/net/unix") as f:
        for line in f.read().splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 8 and parts[7].startswith(f"@apf-{instance}_"):
                names.add(b"\0" + parts[7][1:].encode())
    return sorted(names)


def _forge(srv, targets: list[bytes], stop: threading.Event, sent: list[int]) -> None:
    """Until ``stop``: every waiting request's exact (slot, gen), read from the ledger, plus a
    sweep of small slots and generations, to every grant socket."""
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    raw.setblocking(False)
    sweep = msgpack.packb([[s, g] for s in range(64) for g in range(1, 33)])
    try:
        while not stop.is_set():
            waiting = [[r.slot, r.gen] for lv in srv.ledger_snapshot().levels
                       for r in lv.requests if r.state == "waiting"]
            for data in (msgpack.packb(waiting), sweep):
                for name in targets:
                    try:
                        raw.sendto(data, name)
                        sent[0] += 1
                    except OSError:
                        pass  # a full socket: the next round sends again
    finally:
        raw.close()


def test_forged_grant_datagrams_neither_exceed_the_seats_nor_leak(server_factory):
    with server_factory(workers=2, threads=16, env={"APF_CONCURRENCY_LIMIT": "8"}) as srv:
        seats = srv.level("work").concurrency_limit
        assert seats < 8, seats
        # (the second worker may still be booting when the first answers)
        targets = srv.wait_for(lambda: len(_grant_sockets(srv.instance)) == 2 and
                               _grant_sockets(srv.instance), 20)
        assert targets, _grant_sockets(srv.instance)
        srv.reset_counters()
        n = 24
        stop = threading.Event()
        sent = [0]
        with cf.ThreadPoolExecutor(n + 1) as pool:
            futures = [pool.submit(srv.request, f"/work?ms=300&i={i}",
                                   {"X-Remote-User": f"u{i}"}) for i in range(n)]
            assert srv.wait_for(lambda: srv.level("work").requests_waiting >= 4, 20), \
                "no request ever waited"
            forger = pool.submit(_forge, srv, targets, stop, sent)
            statuses = [f.result(timeout=120)[0] for f in futures]
            stop.set()
            forger.result(timeout=30)
        assert sent[0] > 0
        assert statuses == [200] * n, statuses
        _, most = srv.counters()["work"]
        assert most <= seats, f"the app ran {most} requests of a {seats}-seat level at once"
        snap = srv.idle(20)
        assert snap is not None, [(lv.name, lv.requests_executing, lv.requests_waiting)
                                  for lv in srv.ledger_snapshot().levels]
        refused = {int(pid) for pid in
                   re.findall(r"grant datagrams from pid (\d+) .*not a process", srv.log())}
        assert refused, "no forged datagram was refused"
        assert not refused & {srv.pid, *srv.workers()}, "the server's own grants were refused"
