"""The accept-gated gthread worker (server/worker.py) against stock gthread, no APF involved.

gunicorn-ipc.md 1.4: with 2 workers x 1 thread, eight concurrent 1 s requests took 5 s on stock
gthread (one worker accepted 5 and queued them in its executor). A worker that stops accepting
while its threads are busy leaves the extra connections in the shared listen backlog, so the
8 requests split 4/4 and finish in 4 s.
"""

import collections
import threading
import time

import pytest

pytestmark = [pytest.mark.server, pytest.mark.slow]

WORKER = "apf_gunicorn.server.worker.ApfThreadWorker"


def _burst(srv, n=8, ms=500):
    results = []

    def one():
        status, _, body = srv.request(f"/work?ms={ms}&c=heavy", timeout=30)
        results.append((status, body.decode().split("pid=")[-1].strip(), time.monotonic()))

    t0 = time.monotonic()
    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
        time.sleep(0.005)
    for t in threads:
        t.join(30)
    return results, max(r[2] for r in results) - t0


@pytest.mark.parametrize("worker_class,expect_balanced", [(WORKER, True), ("gthread", False)])
def test_accept_gating_balances_workers(server_factory, worker_class, expect_balanced):
    conf = ("-k", worker_class, "--no-control-socket")
    with server_factory(workers=2, threads=1, conf=conf) as srv:
        srv.request("/hello")
        results, makespan = _burst(srv)
    assert all(r[0] == 200 for r in results)
    split = sorted(collections.Counter(r[1] for r in results).values())
    print(f"{worker_class}: split {split}, makespan {makespan:.2f}s")
    if expect_balanced:
        assert split == [4, 4]
        assert makespan < 2.4  # 4 rounds of 0.5 s
    else:
        # Stock gthread: documents the problem; it usually splits unevenly (not asserted,
        # it depends on scheduling).
        assert sum(split) == 8
