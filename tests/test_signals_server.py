"""The app's pools seen from outside on a real server: a Flask app whose requests each hold a
SQLAlchemy connection (tests/apps/pool_app.py: 4 per worker, a SQLite file) under the gthread
worker, 2 workers, nothing about apf_gunicorn in the app. The admin endpoint's /metrics shows
the pool's capacity server-wide (8) before any request, and requests waiting for it under a
flood; ``dump_pools`` shows the same. Under uvicorn-worker, an async app's one-line
``apf_gunicorn.resource`` (tests/apps/resource_asgi_app.py) is seen the same way."""

from __future__ import annotations

import pytest

from apf_gunicorn.signals.table import slot_name
from tests.apps.flood import Flood
from tests.conftest import free_port
from tests.promtool import check_metrics
from tests.test_server_observability import DUMP, admin_get, scrape

pytestmark = pytest.mark.server

pytest.importorskip("sqlalchemy")


def pool_samples(port: int, name: str) -> dict[str, float]:
    """``{sample name: value}`` of the pool's series."""
    return {n: v for (n, labels), v in scrape(port).items()
            if n.startswith("apf_pool_") and ("pool", name) in labels}


def test_pool_capacity_and_waiting_server_wide_in_metrics_and_dump(server_factory, tmp_path):
    admin = free_port()
    db = tmp_path / "pool.sqlite"
    # the flood's level (work) gets 16 of the 32 seats: more than the pool's 8 connections
    env = {"APF_ADMIN_BIND": f"127.0.0.1:{admin}", "POOL_APP_DB_URL": f"sqlite:///{db}",
           "APF_CONCURRENCY_LIMIT": "32"}
    name = slot_name(f"sqlite:///{db}")  # (a long path is cut)
    with server_factory(workers=2, threads=12, env=env,
                        args=("tests.apps.pool_app:app",)) as srv:
        # found when the app made its engine, before its first checkout
        before = srv.wait_for(lambda: pool_samples(admin, name).get("apf_pool_capacity") == 8
                              and pool_samples(admin, name))
        assert before, (scrape(admin), srv.log())
        assert before["apf_pool_in_use"] == 0 and before["apf_pool_waiting"] == 0
        assert f"apf: found pool {name!r} (sqlalchemy): capacity 4 in this worker" in srv.log()
        seen: dict[str, float] = {}

        def waiting() -> bool:
            seen.update(pool_samples(admin, name))
            return seen.get("apf_pool_waiting", 0) > 0

        with Flood(srv.port, "/work?ms=50", user="heavy", connections=24) as flood:
            assert srv.wait_for(waiting, timeout=60), (seen, srv.log())
            assert seen["apf_pool_capacity"] == 8
            assert seen["apf_pool_in_use"] <= 8
            text = admin_get(admin, "/metrics")
            dump = admin_get(admin, DUMP + "dump_pools")
        assert flood.statuses.get(200, 0) > 0 and not flood.errors, flood.statuses
        check_metrics(text)
        row = next(line for line in dump.splitlines() if line.startswith(name))
        cells = [c.strip() for c in row.split(",")]
        assert cells[1:4] == ["sqlalchemy", "2", "8"], dump
        after = srv.wait_for(lambda: (s := pool_samples(admin, name))
                             .get("apf_pool_wait_seconds_total", 0) > 0 and s)
        assert after and after["apf_pool_waits_total"] > 0, after
        # the master has read the pool (and its waits) for seconds: an explicit limit stays
        assert limit_seats(admin) == 32, srv.log()
        assert "limit from pools" not in srv.log()


def limit_seats(port: int) -> float | None:
    return scrape(port).get(("apf_server_concurrency_limit_seats", ()))


def test_with_nothing_set_the_limit_follows_the_pool(server_factory, tmp_path):
    """No APF_CONCURRENCY_LIMIT: the default (20: 2 workers x 20 threads / 2) until the
    workers publish the pool, then the work level's seats are the pool's 8 connections: the
    server limit is 15 (tests/apps/apf.yaml gives work 1000 of its 2005 shares: 15 x 0.499
    rounds up to 8)."""
    admin = free_port()
    env = {"APF_ADMIN_BIND": f"127.0.0.1:{admin}", "APF_CONCURRENCY_LIMIT": "",  # unset
           "POOL_APP_DB_URL": f"sqlite:///{tmp_path / 'pool.sqlite'}"}
    with server_factory(workers=2, threads=20, env=env,
                        args=("tests.apps.pool_app:app",)) as srv:
        assert srv.wait_for(lambda: limit_seats(admin) == 15), (limit_seats(admin), srv.log())
        log = srv.log()
        assert "apf: concurrency limit 20 -> " in log, log
        # the discovery line says what was found (it waits for both workers' pools)
        assert ("apf: concurrency limit 20 -> 15 seats (limit from pools: 2 SQLAlchemy pools, "
                "8 connections server-wide; 8 seats for the busiest level (share 0.50))") in log
        assert srv.request("/work?ms=1")[0] == 200


def test_a_declared_resource_under_the_uvicorn_worker(server_factory):
    pytest.importorskip("uvicorn_worker")
    admin = free_port()
    env = {"APF_ADMIN_BIND": f"127.0.0.1:{admin}", "APF_CONCURRENCY_LIMIT": "32"}
    conf = ("-c", "python:apf_gunicorn.conf", "-k", "apf_gunicorn.asgi.UvicornWorker")
    with server_factory(workers=2, conf=conf, env=env,
                        args=("tests.apps.resource_asgi_app:app",)) as srv:
        before = srv.wait_for(lambda: pool_samples(admin, "backend").get("apf_pool_capacity")
                              == 4 and pool_samples(admin, "backend"))
        assert before, (scrape(admin), srv.log())
        seen: dict[str, float] = {}

        def waiting() -> bool:
            seen.update(pool_samples(admin, "backend"))
            return seen.get("apf_pool_waiting", 0) > 0

        with Flood(srv.port, "/work?ms=50", user="heavy", connections=16) as flood:
            assert srv.wait_for(waiting, timeout=60), (seen, srv.log())
            # the worker with a waiter has both its units out; the other one's window may
            # fall between its requests
            assert 2 <= seen["apf_pool_in_use"] <= 4, seen
        assert flood.statuses.get(200, 0) > 0 and not flood.errors, flood.statuses
        assert ("apf_pool_capacity", (("kind", "resource"), ("pool", "backend"))) in scrape(admin)


def test_with_nothing_set_under_the_uvicorn_worker_the_limit_follows_a_resource(server_factory):
    """The same under ASGI: the default 64 (2 workers x 32) until both workers publish the
    app's one-line resource (2 units each), then 7 (7 x 0.499 rounds up to 4 seats)."""
    admin = free_port()
    env = {"APF_ADMIN_BIND": f"127.0.0.1:{admin}", "APF_CONCURRENCY_LIMIT": ""}
    conf = ("-c", "python:apf_gunicorn.conf", "-k", "apf_gunicorn.asgi.UvicornWorker")
    with server_factory(workers=2, conf=conf, env=env,
                        args=("tests.apps.resource_asgi_app:app",)) as srv:
        assert srv.wait_for(lambda: limit_seats(admin) == 7), (limit_seats(admin), srv.log())
        assert ("apf: concurrency limit 64 -> 7 seats (limit from pools: 2 "
                "apf_gunicorn.resource pools, 4 connections server-wide") in srv.log(), srv.log()


def test_pool_signals_off_leaves_the_libraries_alone(server_factory, tmp_path):
    """APF_POOL_SIGNALS=off: no discovery in the workers (the first worker would log the pool
    when the app makes its engine, before it serves), no pool series, and the default limit
    does not follow a pool. Given with gunicorn's ``-e``, which the master applies only after
    it loaded the worker class (whose setup() installs the discovery in the master): the
    workers still patch nothing."""
    admin = free_port()
    env = {"APF_ADMIN_BIND": f"127.0.0.1:{admin}", "APF_CONCURRENCY_LIMIT": "",  # unset
           "POOL_APP_DB_URL": f"sqlite:///{tmp_path / 'pool.sqlite'}"}
    with server_factory(workers=2, threads=20, env=env, app="tests.apps.pool_app:app",
                        args=("-e", "APF_POOL_SIGNALS=off")) as srv:
        assert srv.request("/work?ms=1")[0] == 200, srv.log()
        answers = {srv.request("/work/patched")[::2] for _ in range(6)}
        assert answers == {(200, b"no")}, (answers, srv.log())
        assert "found pool" not in srv.log(), srv.log()
        assert srv.wait_for(lambda: limit_seats(admin) is not None), srv.log()
        assert not any(n.startswith("apf_pool_") for n, _ in scrape(admin)), scrape(admin)
        assert limit_seats(admin) == 20, srv.log()


def test_an_engine_made_in_a_preloading_master_is_found_before_any_request(server_factory,
                                                                            tmp_path):
    """``--preload``: the app (and its engine) is loaded in the master, before any worker.
    The master installed the discovery before loading it (FrontEnd.setup), so the engine's
    pool is known by its URL in every worker before its first checkout."""
    admin = free_port()
    db = tmp_path / "pool.sqlite"
    env = {"APF_ADMIN_BIND": f"127.0.0.1:{admin}", "POOL_APP_DB_URL": f"sqlite:///{db}",
           "APF_CONCURRENCY_LIMIT": "32"}
    name = slot_name(f"sqlite:///{db}")
    with server_factory(workers=2, threads=4, env=env, args=("--preload",),
                        app="tests.apps.pool_app:app") as srv:
        found = srv.wait_for(lambda: pool_samples(admin, name).get("apf_pool_capacity") == 8
                             and pool_samples(admin, name))
        assert found, (scrape(admin), srv.log())
        assert srv.request("/work?ms=1")[0] == 200
