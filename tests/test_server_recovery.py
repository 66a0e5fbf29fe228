"""Recovery that no user hook can switch off (issue 18, item 6).

A config following prometheus_client's multiprocess recipe replaces apf_gunicorn's
``child_exit``; the master must still reclaim a dead worker's seats (``master/reclaim.py``),
log the replaced hook at start, and leave the application's non-live gauge files alone, as
prometheus_client's own ``mark_process_dead`` does. Unit tests drive the hooks and the master's
check with stand-ins for gunicorn's Arbiter and Worker; the others run a real gunicorn.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import types
import urllib.request

import pytest

from apf_gunicorn.gthread.worker import ApfThreadWorker
from apf_gunicorn.ledger import LevelSpec
from apf_gunicorn.master import hookcheck, hooks, reclaim
from apf_gunicorn.master.master import MasterServices
from tests.conftest import free_port
from tests.test_server_review import master  # noqa: F401 - the fixture

RECIPE = ("-c", "python:tests.apps.prometheus_conf")


# -- unit: the master's check against stand-ins ----------------------------------------------

@pytest.fixture
def configured(request):
    """test_server_review's ``master`` fixture (a MasterState over an in-memory ledger) with
    one level of 2 seats."""
    m = request.getfixturevalue("master")
    m.ledger.configure([LevelSpec("l", 8, 2, 8, 2)], ["fs"], 0)
    return m


class Arbiter:
    """gunicorn's Arbiter as the hooks see it: a log, the worker class, a config without TLS
    and the worker table (pid -> Worker)."""

    worker_class = ApfThreadWorker

    def __init__(self):
        self.log = logging.getLogger("test.recovery")
        self.cfg = types.SimpleNamespace(is_ssl=False)
        self.WORKERS = {}

    def fork(self, pid):
        worker = types.SimpleNamespace(pid="[booting]", age=1)
        hooks.pre_fork(self, worker)
        worker.pid = pid
        self.WORKERS[pid] = worker
        return worker


def _hold_a_seat(m, worker):
    """Register the worker and make it run one request in the level of 2 seats."""
    now = time.monotonic_ns()
    m.ledger.register_worker(worker.apf_index, worker.pid, now)
    res = m.ledger.admit(0, 7, 1, 0, 0, worker.apf_index, now)
    assert res.outcome == "execute"
    return res


def _seats(m):
    return m.ledger.snapshot(time.monotonic_ns()).levels[0].seats_in_use


def _reaped_by_gunicorn_only(m):
    """A worker (pid 1001) that holds a seat, then leaves gunicorn's table, and the master's
    check that has seen it missing once. Returns (arbiter, services, worker)."""
    arb = Arbiter()
    services = MasterServices(m, arb.log, arbiter=arb)
    worker = arb.fork(1001)
    _hold_a_seat(m, worker)
    del arb.WORKERS[1001]  # gunicorn reaped it; the config's child_exit did not call ours
    services.reclaim_gone()  # first seen missing: not yet (it might be a fork in progress)
    assert _seats(m) == 1
    return arb, services, worker


def _later(services, seconds):
    """As if the check had first seen its suspects ``seconds`` earlier."""
    services._suspects = {i: (w, t - seconds) for i, (w, t) in services._suspects.items()}


def test_the_master_reclaims_a_worker_whose_child_exit_was_replaced(configured, caplog):
    m = configured
    arb, services, _worker = _reaped_by_gunicorn_only(m)
    _later(services, reclaim.CONFIRM_S)
    with caplog.at_level(logging.WARNING, "test.recovery"):
        services.reclaim_gone()
    assert _seats(m) == 0
    assert services.reclaimed == 1
    assert "the master reclaimed its seats" in caplog.text
    assert arb.fork(1002).apf_index == 0, "the dead worker's index was not freed"


def test_a_worker_not_yet_in_gunicorns_table_is_not_reclaimed(configured):
    """Between the fork and ``WORKERS[pid] = worker`` a live worker is missing from the table:
    one check must not reclaim it."""
    m = configured
    arb, services, worker = _reaped_by_gunicorn_only(m)
    arb.WORKERS[1001] = worker  # recorded now
    _later(services, 10)
    services.reclaim_gone()
    assert _seats(m) == 1 and services.reclaimed == 0


def test_child_exit_and_the_check_reclaim_once_and_never_a_successor(configured):
    m = configured
    arb, services, first = _reaped_by_gunicorn_only(m)
    hooks.child_exit(arb, first)  # our hook runs after all (a chained config)
    assert _seats(m) == 0
    second = arb.fork(1002)  # takes the freed index
    assert second.apf_index == first.apf_index
    _hold_a_seat(m, second)
    _later(services, 10)
    services.reclaim_gone()
    hooks.child_exit(arb, first)  # a late duplicate
    assert _seats(m) == 1, "the successor's seat was reaped"
    assert services.reclaimed == 0


def test_concurrent_reclaims_reap_once(configured, monkeypatch):
    m = configured
    arb = Arbiter()
    worker = arb.fork(1001)
    _hold_a_seat(m, worker)
    calls = []
    real = m.ledger.reap_worker

    def slow_reap(index, now):
        calls.append(index)
        time.sleep(0.05)
        return real(index, now)

    monkeypatch.setattr(m.ledger, "reap_worker", slow_reap)
    threads = [threading.Thread(target=reclaim.reclaim_worker, args=(m, worker))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert calls == [worker.apf_index]


# -- unit: replaced hooks are logged ---------------------------------------------------------

def _recipe_child_exit(server, worker):
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def _chained_child_exit(server, worker):
    hooks.child_exit(server, worker)


def _cfg(**replaced):
    return types.SimpleNamespace(**{**{name: getattr(hooks, name) for name in hookcheck.LOST},
                                    **replaced})


def test_replaced_hooks_are_logged_with_what_is_lost(caplog):
    log = logging.getLogger("test.recovery.hooks")
    with caplog.at_level(logging.INFO, log.name):
        hookcheck.log_replaced_hooks(_cfg(), log, hooks)
    assert caplog.records == []
    with caplog.at_level(logging.INFO, log.name):
        hookcheck.log_replaced_hooks(_cfg(child_exit=_recipe_child_exit,
                                          worker_exit=_chained_child_exit), log, hooks)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert any("child_exit hook" in w and "_recipe_child_exit" in w and "about 2 s" in w
               and "hooks.child_exit" in w for w in warnings), warnings
    # worker_exit calls our child_exit, not our worker_exit: still lost
    assert any("worker_exit hook" in w for w in warnings), warnings
    caplog.clear()
    with caplog.at_level(logging.INFO, log.name):
        hookcheck.log_replaced_hooks(_cfg(child_exit=_chained_child_exit), log, hooks)
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "seems to call it" in caplog.records[0].getMessage()


# -- unit: a dead worker's gauge files --------------------------------------------------------

def test_a_dead_workers_sum_gauge_keeps_its_value_and_live_gauges_go(tmp_path, monkeypatch):
    from apf_gunicorn.master import metrics

    for name in ("gauge_sum_4242.db", "gauge_all_4242.db", "gauge_livesum_4242.db",
                 "gauge_liveall_4242.db", "gauge_sum_4343.db"):
        (tmp_path / name).write_bytes(b"")
    metrics.mark_process_dead(4242, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["gauge_all_4242.db", "gauge_sum_4242.db",
                                            "gauge_sum_4343.db"]


# -- real servers -----------------------------------------------------------------------------

def _level(srv, name):
    return next(lv for lv in srv.ledger_snapshot().levels if lv.name == name)


def _start_long_requests(srv, n):
    def call(i):
        try:
            srv.request(f"/work?ms=60000&i={i}", headers={"X-Remote-User": f"u{i}"}, timeout=90)
        except OSError:
            pass  # its worker is killed
    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.server
def test_prometheus_recipe_config_a_killed_workers_seats_come_back(server_factory, tmp_path):
    """The recipe config: both workers SIGKILLed while they run requests; the master's
    periodic check reclaims each one's seats (logged, naming its pid; the time from the kill
    is printed), the replaced hook was logged at start, and the level serves again."""
    mp = tmp_path / "prom"
    mp.mkdir()
    with server_factory(workers=2, threads=4, conf=RECIPE,
                        env={"PROMETHEUS_MULTIPROC_DIR": str(mp)}) as srv:
        log = srv.log()
        assert "the config's child_exit hook (tests.apps.prometheus_conf.child_exit) replaces" \
            in log, log
        _start_long_requests(srv, 2)
        assert srv.wait_for(lambda: _level(srv, "work").seats_in_use == 2, 20), srv.log()
        victims = srv.workers()
        assert len(victims) == 2
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        back = srv.wait_for(lambda: _level(srv, "work").seats_in_use == 0, 30, step=0.02)
        took = time.monotonic() - killed
        print(f"seats back {took:.2f} s after the kill (the master checks every second)")
        assert back, f"seats never came back:\n{srv.log()}"
        # the master's periodic check reclaimed each victim (the config's child_exit did not)
        log = srv.log()
        for pid in victims:
            assert f"(pid {pid}) is gone and apf_gunicorn's child_exit did not run" in log, log
        assert "the master reclaimed its seats" in log
        assert srv.wait_for(lambda: len(srv.workers()) == 2, 30)

        def serves():
            try:
                return srv.request("/work?ms=1", timeout=5)[0] == 200
            except OSError:
                return False
        assert srv.wait_for(serves, 20), srv.log()


def _app_items(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith("app_items "):
            return float(line.split()[1])
    return None


@pytest.mark.server
@pytest.mark.parametrize("own_child_exit", [False, True], ids=["recipe", "ours"])
def test_a_sum_gauge_keeps_a_killed_workers_value(server_factory, tmp_path, own_child_exit):
    """Each worker sets a ``sum`` gauge to 5: 10 with two workers. After one is SIGKILLed and
    replaced, prometheus_client counts the dead worker's value too (15); deleting every gauge
    file of the dead worker dropped it (10)."""
    mp = tmp_path / "prom"
    mp.mkdir()
    admin = free_port()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(mp), "APF_ADMIN_BIND": f"127.0.0.1:{admin}",
           "APF_TEST_OWN_CHILD_EXIT": "1" if own_child_exit else "0"}
    with server_factory(workers=2, threads=4, conf=RECIPE, env=env) as srv:
        assert srv.wait_for(lambda: _app_items(admin) == 10, 20), _app_items(admin)
        victim = srv.workers()[0]
        os.kill(victim, signal.SIGKILL)
        # the replacement sets its 5, and the master has handled the death (either path)
        assert srv.wait_for(lambda: len(srv.workers()) == 2 and victim not in srv.workers(), 30)
        if not own_child_exit:
            assert srv.wait_for(lambda: "the master reclaimed its seats" in srv.log(), 10), \
                srv.log()
        assert srv.wait_for(lambda: _app_items(admin) == 15, 20), (
            _app_items(admin), sorted(os.listdir(mp)), srv.log())
        assert (mp / f"gauge_sum_{victim}.db").exists()
