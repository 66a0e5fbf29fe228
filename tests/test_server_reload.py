"""HUP reload under load, and graceful stop with parked requests."""

import os
import shutil
import signal
import threading
import time

import pytest

from tests.apps.loadgen import Client, run_clients

pytestmark = [pytest.mark.server, pytest.mark.slow]

EXTRA = """
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata: {name: extra, uid: uid-pl-extra}
spec:
  type: Limited
  limited:
    nominalConcurrencyShares: 1000
    lendablePercent: 0
    limitResponse:
      type: Queue
      queuing: {queues: 8, handSize: 2, queueLengthLimit: 20}
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {name: extra, uid: uid-fs-extra}
spec:
  matchingPrecedence: 200
  priorityLevelConfiguration: {name: extra}
  distinguisherMethod: {type: ByUser}
  rules:
  - subjects:
    - {kind: Group, group: {name: system:authenticated}}
    nonResourceRules:
    - {verbs: ["*"], nonResourceURLs: ["/other", "/other/*"]}
"""


def test_reload_under_load(server_factory, tmp_path):
    cfg = tmp_path / "apf.yaml"
    shutil.copy(os.path.join(os.path.dirname(__file__), "apps", "apf.yaml"), cfg)
    # the HUP path alone: the file watcher would apply each written file before the HUP
    with server_factory(workers=3, threads=16, config=str(cfg),
                        env={"APF_CONFIG_WATCH": "off"}) as srv:
        old_workers = set(srv.workers())
        stop = threading.Event()
        load = [Client(srv.port, "/work?ms=50", user=f"r{i}", stop=stop, timeout=10)
                for i in range(6)]
        load += [Client(srv.port, "/other?ms=20", user=f"o{i}", stop=stop, timeout=10)
                 for i in range(2)]
        for c in load:
            c.start()
        try:
            assert srv.wait_for_answers(load), "not served under load"
            # An invalid file first: the running configuration must stay.
            cfg.write_text("kind: FlowSchema\nmetadata: {name: bad}\nspec: {}\n")
            os.kill(srv.pid, signal.SIGHUP)
            assert srv.wait_for(lambda: "reload rejected" in srv.log(), timeout=60)
            # gunicorn replaces the workers on every HUP, a refused one too: wait for those,
            # so that the applied reload's workers are told apart from them below
            assert srv.wait_for(lambda: not (old_workers & set(srv.workers()))
                                and len(srv.workers()) == 3, timeout=60)
            old_workers = set(srv.workers())
            assert srv.wait_for_answers(load), "not served under load"
            shutil.copy(os.path.join(os.path.dirname(__file__), "apps", "apf.yaml"), cfg)
            with open(cfg, "a") as f:
                f.write(EXTRA)
            os.kill(srv.pid, signal.SIGHUP)
            assert srv.wait_for(lambda: "generation 2 applied" in srv.log(), timeout=60)
            assert srv.wait_for(lambda: not (old_workers & set(srv.workers()))
                                and len(srv.workers()) == 3, timeout=60)
            assert srv.wait_for_answers(load), "not served under load"
        finally:
            stop.set()
            run_clients([], timeout=0)
            for c in load:
                c.join(15)
        statuses = [s for c in load for s in c.statuses]
        print(f"{len(statuses)} responses during two reloads; "
              f"non-200: {sorted(set(statuses) - {200})}")
        assert statuses and not [s for s in statuses if s >= 500]
        status, headers, _ = srv.request("/other?ms=1", headers={"X-Remote-User": "z"})
        assert status == 200 and headers["X-Kubernetes-PF-PriorityLevel-UID"] == "uid-pl-extra"
        names = {lv.name: lv for lv in srv.ledger_snapshot().levels}
        assert "extra" in names
        assert srv.idle() is not None


def test_graceful_stop_answers_parked_requests_503(server_factory):
    with server_factory(workers=2, threads=24) as srv:
        # 4 s: served within the fixture's 5 s graceful timeout, and still executing when the
        # parked requests are answered
        hold = [Client(srv.port, "/work?ms=4000", user=f"h{i}", count=1) for i in range(8)]
        for c in hold:
            c.start()
        assert srv.wait_for(lambda: srv.level("work").seats_in_use == 8, timeout=30)
        parked = [Client(srv.port, "/work?ms=1", user=f"p{i}", count=1) for i in range(4)]
        for c in parked:
            c.start()
        assert srv.wait_for(lambda: srv.level("work").requests_waiting == 4, timeout=30)
        t0 = time.monotonic()
        os.kill(srv.pid, signal.SIGTERM)
        for c in parked:
            c.join(30)
        parked_time = time.monotonic() - t0
        for c in hold:
            c.join(30)
        print(f"parked answered in {parked_time:.2f}s: {[c.statuses for c in parked]}; "
              f"executing: {[c.statuses for c in hold]}")
        # 503: answered by the stop (not served once a seat freed: 200; not timed out: 429)
        assert [c.statuses for c in parked] == [[503]] * 4
        assert [c.statuses for c in hold] == [[200]] * 8
        srv.proc.wait(10)
