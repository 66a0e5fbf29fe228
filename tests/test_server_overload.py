"""Overload on a real gunicorn: a slow request head holds no thread and is cut at its deadline,
exempt requests find a thread while the queues park every other one, and the workers offer
themselves to the OOM killer before the master.

The pacing figures (probe latency percentiles, goodput) are measured by
``benchmarks/bench_overload.py``; these tests check outcomes: every probe and every normal
request answered 200, every slow head answered 408, and the server's counters equal to what
the clients saw.
"""

from __future__ import annotations

import pytest

from tests.apps.flood import Flood
from tests.apps.loadgen import Client, run_clients
from tests.apps.overload import Prober, SlowHeads, scrape, total
from tests.conftest import free_port

pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_slow_heads_hold_no_thread_and_get_408_at_their_deadline(server_factory):
    admin = free_port()
    env = {"APF_HEADER_TIMEOUT": "3", "APF_ADMIN_BIND": f"127.0.0.1:{admin}"}
    with server_factory(workers=2, threads=4, env=env) as srv:
        with SlowHeads(srv.port, 60, every=0.5) as slow:
            # 60 trickling heads against 8 threads: probes and a normal user are served
            probes = Prober(srv.port, "/healthz", every=0.1).run(1.5)
            user = Client(srv.port, "/other", user="alice", count=10, timeout=5)
            run_clients([user], timeout=20)
            assert not probes.failures, probes.failures
            assert user.statuses == [200] * 10, (user.statuses, user.errors)
            # still trickling, yet cut at their 3 s deadline (counted from accept; not before
            # it: min(late) below, whatever the time the probes and the user took)
            assert slow.wait_closed(timeout=30)
        late = [t - slow.opened_at for t in slow.closed_at]
        print(f"slow heads closed {min(late):.2f}-{max(late):.2f} s after opening; probe p99 "
              f"{probes.quantile(0.99) * 1e3:.0f} ms")
        assert all(r.startswith(b"HTTP/1.1 408 ") for r in slow.replies), slow.replies[:3]
        assert min(late) >= 3.0
        assert total(scrape(admin), "apf_request_head_timeouts_total") == 60
        assert "Traceback" not in srv.log()


def test_exempt_requests_find_a_thread_while_queues_park_every_other(server_factory):
    """2 workers x 8 threads, 2 of them kept for exempt requests; "work" has 8 seats and
    queues deep enough to park every thread. 64 connections of 1 s requests: the 12
    non-exempt threads run 8 and park 4, every other flood request is answered 429
    (thread-reserve) at once, and the health checks are all served."""
    admin = free_port()
    with server_factory(workers=2, threads=8,
                        env={"APF_ADMIN_BIND": f"127.0.0.1:{admin}"}) as srv:
        with Flood(srv.port, "/work?ms=1000", user="heavy", connections=64) as flood:
            probes = Prober(srv.port, "/healthz", every=0.1).run(4.0)
        assert not probes.failures, probes.failures
        print(f"probes p50 {probes.quantile(0.5) * 1e3:.0f} ms, p99 "
              f"{probes.quantile(0.99) * 1e3:.0f} ms; flood {flood.statuses}")
        assert flood.errors == 0, flood.error_samples
        assert set(flood.statuses) == {200, 429}
        assert srv.idle() is not None
        m = scrape(admin)
        work = {"priority_level": "work", "flow_schema": "work"}
        rejected = total(m, "apf_rejected_requests_total", **work)
        assert rejected == flood.statuses[429]
        assert total(m, "apf_rejected_requests_total", reason="thread-reserve", **work) > 0
        assert total(m, "apf_dispatched_requests_total", **work) == flood.statuses[200]
        _, top = srv.counters()["work"]
        assert top == 8
        assert "Traceback" not in srv.log()


def _oom_score_adj(pid: int) -> int:
    with open(f"/proc/{pid}/oom_score_adj") as f:
        return int(f.read())


@pytest.mark.parametrize("setting,step", [(None, 500), ("200", 200), ("off", 0)])
def test_workers_rank_above_the_master_for_the_oom_killer(server_factory, setting, step):
    env = {} if setting is None else {"APF_WORKER_OOM_SCORE_ADJ": setting}
    with server_factory(workers=2, threads=2, env=env) as srv:
        master = _oom_score_adj(srv.pid)
        want = [min(1000, master + step)] * 2

        def scores():  # a worker just forked sets its score in post_fork, a moment later
            workers = srv.workers()
            return len(workers) == 2 and [_oom_score_adj(w) for w in workers] == want

        assert srv.wait_for(scores), [_oom_score_adj(w) for w in srv.workers()]
