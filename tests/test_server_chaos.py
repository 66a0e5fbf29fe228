"""Faults at scale, short form (the long form: ``benchmarks/soak.py``): worker SIGKILLs under
mixed load, a master SIGKILL and a restart on the same instance, a soak with abandoned
connections, hostile requests, and a HUP storm alternating valid and invalid configurations.
After each: nothing executing or waiting, the ledger's invariants intact, no registered worker
dead, the app never over its 8 seats, no 500, and the counters equal to what the clients saw
(``tests/apps/chaos.py``: ``after_the_storm``).

The kills, the soak and the HUP storm run on both ASGI workers too (``asgi_chaos_server``:
tests/apps/asgi_app.py, whose tracked requests read their body and listen for a disconnect as
Django's handler does), shorter than on gthread: each of those tests takes a few seconds.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.apps.chaos import (
    HUP_ONLY,
    scenario_hostile,
    scenario_hups,
    scenario_kills,
    scenario_master_kill,
    scenario_soak,
)
from tests.conftest import APPS

pytestmark = [pytest.mark.server, pytest.mark.slow]

ASGI_WORKERS = {"uvicorn": "apf_gunicorn.asgi.UvicornWorker",
                "gunicorn-asgi": "apf_gunicorn.asgi.ASGIWorker"}


@pytest.fixture
def chaos_server(server_factory, tmp_path):
    """2 workers x 8 threads with tests/apps/apf.yaml ("work": 8 seats); the app's start/end
    records go to a file. Yields (server, track path)."""
    track = str(tmp_path / "track.log")

    def start(**kw):
        env = {"APP_TRACK": track, **kw.pop("env", {})}
        return server_factory(workers=2, threads=8, env=env, **kw), track

    return start


@pytest.fixture(params=sorted(ASGI_WORKERS))
def asgi_chaos_server(request, server_factory, tmp_path):
    """``chaos_server`` on an ASGI worker class (2 workers, tests/apps/asgi_app.py)."""
    if request.param == "uvicorn" and not importlib.util.find_spec("uvicorn_worker"):
        pytest.skip("uvicorn-worker is not installed")
    track = str(tmp_path / "track.log")

    def start(**kw):
        env = {"APP_TRACK": track, **kw.pop("env", {})}
        return server_factory(workers=2, worker=ASGI_WORKERS[request.param], env=env,
                              boot_timeout=60.0, **kw), track

    return start


def test_worker_kills_under_mixed_load(chaos_server):
    ctx, track = chaos_server()
    with ctx as srv:
        report, problems = scenario_kills(srv, track, kills=10)
        print(report)
        assert report["clients"].get(("slow", 200), 0) > 0
        assert problems == []


def test_master_sigkill_then_restart_on_the_same_instance(server_factory):
    report, problems = scenario_master_kill(server_factory)
    assert problems == []


def test_uvicorn_master_sigkill_orphans_exit_and_free_the_port(server_factory):
    """uvicorn-worker's workers never look at their parent: orphaned, they kept serving on
    the port. (gunicorn's ASGI worker checks its parent as gthread does: benchmarks/soak.py.)"""
    if not importlib.util.find_spec("uvicorn_worker"):
        pytest.skip("uvicorn-worker is not installed")
    report, problems = scenario_master_kill(
        lambda **kw: server_factory(worker=ASGI_WORKERS["uvicorn"], boot_timeout=60.0, **kw))
    assert problems == []


def test_soak_with_abandoned_connections_keeps_rss_flat(chaos_server):
    ctx, track = chaos_server()
    with ctx as srv:
        report, problems = scenario_soak(srv, track, requests=3200)
        print(report)
        assert problems == []


def test_hostile_requests_never_5xx_nor_restart_a_worker(chaos_server):
    ctx, _ = chaos_server()
    with ctx as srv:
        report, problems = scenario_hostile(srv, 300)
        print(report)
        assert problems == []


def test_hup_storm_alternating_valid_and_invalid_configs(chaos_server, tmp_path):
    config = tmp_path / "apf.yaml"
    valid = (APPS / "apf.yaml").read_text()
    invalid = valid.replace("handSize: 4", "handSize: 40")  # hand larger than its queues
    config.write_text(valid)
    # one reload per HUP is counted: the file watcher would add its own (HUP_ONLY)
    ctx, track = chaos_server(env={"APF_CONFIG": str(config), **HUP_ONLY},
                              args=("--graceful-timeout", "2"))
    with ctx as srv:
        report, problems = scenario_hups(srv, track, config, valid, invalid, hups=8)
        print(report)
        assert problems == []


def test_asgi_worker_kills_under_mixed_load(asgi_chaos_server):
    ctx, track = asgi_chaos_server()
    with ctx as srv:
        report, problems = scenario_kills(srv, track, kills=4)
        print(report)
        assert report["clients"].get(("slow", 200), 0) > 0
        assert problems == []


def test_asgi_soak_with_abandoned_connections_keeps_rss_flat(asgi_chaos_server):
    ctx, track = asgi_chaos_server()
    with ctx as srv:
        report, problems = scenario_soak(srv, track, requests=3200)
        print(report)
        assert problems == []


def test_asgi_hup_storm_alternating_valid_and_invalid_configs(asgi_chaos_server, tmp_path):
    config = tmp_path / "apf.yaml"
    valid = (APPS / "apf.yaml").read_text()
    config.write_text(valid)
    ctx, track = asgi_chaos_server(env={"APF_CONFIG": str(config), **HUP_ONLY},
                                   args=("--graceful-timeout", "2"))
    with ctx as srv:
        report, problems = scenario_hups(srv, track, config, valid,
                                         valid.replace("handSize: 4", "handSize: 40"), hups=4)
        print(report)
        assert problems == []
