"""The limit's signals (apf_gunicorn/signals/): the shared pool table, SQLAlchemy's pools found
on SQLite, apf_gunicorn.resource, the import hook, and what /metrics and dump_pools show."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest

from apf_gunicorn.master.metrics import pool_families
from apf_gunicorn.server.dumps import dump_pools
from apf_gunicorn.signals import pools, sqlalchemy_pools
from apf_gunicorn.signals.pools import UNBOUNDED, PoolReading, Registry
from apf_gunicorn.signals.resource import Resource, resource
from apf_gunicorn.signals.table import NAME_BYTES, PoolTable
from tests.conftest import ROOT

S = 1_000_000_000


def wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.01)
    return predicate()


def reading(name="db", kind="sqlalchemy", capacity=4, in_use=0, waiting=0, wait_ns=0, waits=0,
            source=1):
    return PoolReading(name, kind, capacity, in_use, waiting, wait_ns, waits, source)


# -- the table ----------------------------------------------------------------------------

def test_table_sums_pools_by_name_over_workers():
    table = PoolTable.create(rows=4)
    table.writer(0).publish([reading(in_use=3, waiting=2, wait_ns=5 * S, waits=7)], 10 * S)
    table.writer(2).publish([reading(in_use=4, waiting=1, wait_ns=S, waits=1),
                             reading("redis", "resource", capacity=10, in_use=1)], 10 * S)
    got = table.totals(11 * S)
    assert set(got) == {"db", "redis"}
    db = got["db"]
    assert (db.kind, db.capacity, db.in_use, db.waiting, db.workers) == ("sqlalchemy", 8, 7, 3, 2)
    assert (db.wait_ns, db.waits) == (6 * S, 8)
    assert (got["redis"].capacity, got["redis"].kind) == (10, "resource")


def test_table_counts_only_fresh_live_rows_gauges_but_every_rows_waits():
    table = PoolTable.create(rows=3)
    table.writer(0).publish([reading(in_use=2, wait_ns=S, waits=1)], 1 * S)
    table.writer(1).publish([reading(in_use=1, wait_ns=2 * S, waits=2)], 9 * S)
    stale = table.totals(10 * S, max_age_ns=5 * S)["db"]
    assert (stale.capacity, stale.in_use, stale.workers) == (4, 1, 1)
    assert (stale.wait_ns, stale.waits) == (3 * S, 3)
    dead = table.totals(10 * S, live={0})["db"]  # row 1's worker is gone
    assert (dead.capacity, dead.workers) == (0, 0)
    assert dead.wait_ns == 3 * S


def test_table_waits_never_go_backwards_when_a_worker_replaces_another():
    table = PoolTable.create(rows=1)
    first = table.writer(0)
    first.publish([reading(wait_ns=4 * S, waits=4, source=1)], S)
    first.publish([reading(wait_ns=6 * S, waits=5, source=1)], 2 * S)
    # a new worker on the same index: its pool starts from zero
    successor = table.writer(0)
    successor.publish([reading(wait_ns=1 * S, waits=1, source=9)], 3 * S)
    t = table.totals(3 * S)["db"]
    assert (t.wait_ns, t.waits) == (7 * S, 6)
    # a pool gone from the worker: its waits stay, its gauges go
    successor.publish([], 4 * S)
    t = table.totals(4 * S)["db"]
    assert (t.wait_ns, t.waits, t.capacity, t.workers) == (7 * S, 6, 0, 0)


def test_table_two_pools_of_one_name_in_a_worker_and_unbounded():
    table = PoolTable.create(rows=1)
    w = table.writer(0)
    w.publish([reading(wait_ns=S, source=1), reading(wait_ns=2 * S, source=2)], S)
    w.publish([reading(wait_ns=S, source=1), reading(wait_ns=3 * S, source=2)], 2 * S)
    t = table.totals(2 * S)["db"]
    assert (t.capacity, t.wait_ns) == (8, 4 * S)
    w.publish([reading(capacity=UNBOUNDED, source=1), reading(source=2)], 3 * S)
    assert table.totals(3 * S)["db"].capacity == UNBOUNDED


def test_table_long_names_keep_their_slot_and_a_full_row_says_which_were_left_out():
    table = PoolTable.create(rows=1)
    w = table.writer(0)
    long = "postgresql+psycopg://" + "h" * 200
    for window in range(1, 4):
        w.publish([reading(long, in_use=1)], window * S)
    got = table.totals(3 * S)
    assert len(got) == 1
    (name,) = got
    assert long.startswith(name) and len(name.encode()) == NAME_BYTES - 1
    left = w.publish([reading(f"p{i}", source=i) for i in range(20)], 4 * S)
    assert left == [f"p{i}" for i in range(16, 20)]  # the long name had no waits: slot given up
    w.publish([reading(f"p{i}", source=i, waits=1) for i in range(16)], 5 * S)
    left = w.publish([reading(f"q{i}", source=i) for i in range(3)], 6 * S)
    assert left == ["q0", "q1", "q2"]  # every slot keeps waits: none is given up
    assert table.totals(6 * S)["p3"].waits == 1


def test_table_reader_skips_a_row_in_the_middle_of_a_window():
    table = PoolTable.create(rows=1)
    table.writer(0).publish([reading()], S)
    table._view[0] = table._view[0] | 1  # the writer is mid-window
    assert table.read_row(0) is None
    assert table.totals(S) == {}


def test_table_bad_rows():
    with pytest.raises(ValueError, match="at least one row"):
        PoolTable.create(rows=0)
    with pytest.raises(ValueError, match="outside"):
        PoolTable.create(rows=2).writer(2)


# -- SQLAlchemy on SQLite -----------------------------------------------------------------

@pytest.fixture
def engine(tmp_path):
    sa = pytest.importorskip("sqlalchemy")
    assert sqlalchemy_pools.install()
    eng = sa.create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}", pool_size=2, max_overflow=1,
                           pool_timeout=30)
    yield eng
    eng.dispose()


def of(name: str) -> list[PoolReading]:
    return [r for r in pools.readings() if r.name == name]


def test_sqlalchemy_pool_found_at_engine_creation_and_its_waits_measured(engine, tmp_path):
    import sqlalchemy as sa

    name = f"sqlite:////{str(tmp_path / 'db.sqlite').lstrip('/')}"
    assert sqlalchemy_pools.engine_name(engine.url) == name
    (r,) = of(name)  # before any checkout
    assert (r.kind, r.capacity, r.in_use, r.waiting, r.waits) == ("sqlalchemy", 3, 0, 0, 0)
    held = [engine.connect() for _ in range(3)]
    (r,) = of(name)
    assert (r.in_use, r.waiting) == (3, 0)
    done = threading.Event()

    def fourth():
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        done.set()

    t = threading.Thread(target=fourth)
    t.start()
    try:
        assert wait_for(lambda: of(name)[0].waiting == 1), of(name)
        time.sleep(0.05)  # a wait of at least this long: not synchronisation
    finally:
        held[0].close()
    t.join(30)
    assert done.is_set()
    (r,) = of(name)
    assert (r.waiting, r.waits, r.in_use) == (0, 1, 2)
    assert r.wait_ns >= 40_000_000
    for conn in held[1:]:
        conn.close()


def test_sqlalchemy_checkout_that_does_not_wait_is_not_counted(engine, tmp_path):
    name = sqlalchemy_pools.engine_name(engine.url)
    for _ in range(5):
        with engine.connect():
            pass
    (r,) = of(name)
    assert (r.waits, r.wait_ns, r.in_use) == (0, 0, 0)


def test_sqlalchemy_disposed_pool_is_replaced_by_the_new_one(engine):
    name = sqlalchemy_pools.engine_name(engine.url)
    old = engine.pool
    conn = engine.connect()
    engine.dispose()
    assert engine.pool is not old
    readings = of(name)
    assert [(r.capacity, r.in_use) for r in readings] == [(3, 0)], readings
    assert of(name)[0].source == id(engine.pool)
    conn.close()


def test_sqlalchemy_pool_logging_name_and_unbounded(tmp_path):
    sa = pytest.importorskip("sqlalchemy")
    assert sqlalchemy_pools.install()
    eng = sa.create_engine(f"sqlite:///{tmp_path / 'x.sqlite'}", pool_logging_name="orders",
                           pool_size=3, max_overflow=-1)
    try:
        (r,) = of("orders")
        assert r.capacity == UNBOUNDED
    finally:
        eng.dispose()


def test_sqlalchemy_found_through_the_import_hook_in_a_fresh_process(tmp_path):
    """The discovery is installed before the app imports SQLAlchemy (as a worker does before
    loading the app): the pool is found with no call after the import."""
    code = f"""
from apf_gunicorn.signals import importhook, pools
assert importhook.install() == []
import sys
assert "sqlalchemy" not in sys.modules
import sqlalchemy as sa
engine = sa.create_engine("sqlite:///{tmp_path / 'h.sqlite'}", pool_size=4, max_overflow=0)
(r,) = pools.readings()
print(r.kind, r.capacity)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["sqlalchemy", "4"]


@pytest.mark.parametrize("signals", ["on", "off"])
def test_the_master_installs_the_discovery_when_gunicorn_loads_the_worker_class(signals):
    """gunicorn calls the worker class's ``setup()`` in the master before a ``preload_app``
    master loads the app: the discovery is in place there (unless APF_POOL_SIGNALS=off),
    so an engine the app makes in the master is found by its URL, before any checkout."""
    code = """
import sys
from gunicorn.config import Config
from apf_gunicorn.signals import importhook, pools
cfg = Config()
cfg.set("worker_class", "apf_gunicorn.gthread.worker.ApfThreadWorker")
cfg.worker_class   # what gunicorn's Arbiter.setup does before it preloads the app
import sqlalchemy as sa
engine = sa.create_engine("sqlite://", poolclass=sa.pool.QueuePool, pool_size=3)
print(importhook._HOOK in sys.meta_path, [(r.name, r.capacity) for r in pools.readings()])
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "APF_POOL_SIGNALS": signals})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("True [('sqlite:///', 13)]" if signals == "on"
                                  else "False []"), out.stdout


# -- resource() ---------------------------------------------------------------------------

def test_resource_threads_wait_in_order_and_are_measured():
    res = resource("redis-test", capacity=2)
    res.acquire()
    res.acquire()
    order = []

    def take(i):
        with res:
            order.append(i)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(2)]
    threads[0].start()
    assert wait_for(lambda: res.reading().waiting == 1)
    threads[1].start()
    assert wait_for(lambda: res.reading().waiting == 2)
    r = res.reading()
    assert (r.capacity, r.in_use, r.kind) == (2, 2, "resource")
    assert res in pools.REGISTRY and of("redis-test")
    res.release()  # to the first waiter, which hands it to the second as it leaves
    for t in threads:
        t.join(10)
    assert order == [0, 1]  # first come, first served
    assert res.reading().in_use == 1
    res.release()
    r = res.reading()
    assert (r.in_use, r.waiting, r.waits) == (0, 0, 2) and r.wait_ns > 0
    with pytest.raises(RuntimeError, match="released more"):
        res.release()


def test_resource_timeout_and_decorator():
    res = Resource("one", 1)

    @res
    def inside():
        return res.reading().in_use

    assert inside() == 1
    assert res.acquire(timeout=0)
    assert res.acquire(timeout=0.01) is False
    assert res.reading().waiting == 0
    res.release()
    assert res.reading().in_use == 0


def test_resource_async_and_cancel():
    res = Resource("async", 1)

    async def main():
        @res
        async def work(n):
            await asyncio.sleep(0)
            return n

        assert await asyncio.gather(work(1), work(2)) == [1, 2]
        await res.acquire_async()
        waiter = asyncio.ensure_future(res.acquire_async())
        await asyncio.sleep(0)
        assert res.reading().waiting == 1
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert res.reading().waiting == 0
        res.release()
        async with res:
            assert res.reading().in_use == 1
        return res.reading()

    r = asyncio.run(main())
    assert (r.in_use, r.waiting) == (0, 0) and r.waits >= 2


@pytest.mark.parametrize("name, capacity, match", [
    ("", 1, "non-empty"), ("r", 0, ">= 1"), ("r", 1.5, ">= 1"), ("r", True, ">= 1")])
def test_resource_bad_input(name, capacity, match):
    with pytest.raises(ValueError, match=match):
        resource(name, capacity)


def test_registry_forgets_dropped_pools_and_skips_failing_readers(caplog):
    reg = Registry()

    class Pool:
        pass

    p = Pool()
    reg.add(p, lambda _: reading())
    reg.add(p, lambda _: reading(capacity=99))  # a second add keeps the first reader
    assert [r.capacity for r in reg.readings()] == [4]
    del p
    assert reg.readings() == []
    broken = Pool()
    reg.add(broken, lambda _: 1 / 0)
    assert reg.readings() == []
    assert "left out of the signals" in caplog.text


# -- seen from outside --------------------------------------------------------------------

def test_dump_pools_and_metrics_families():
    table = PoolTable.create(rows=2)
    table.writer(0).publish([reading(in_use=3, waiting=2, wait_ns=S // 2, waits=3)], S)
    table.writer(1).publish([reading("old", capacity=UNBOUNDED)], S)
    totals = table.totals(S, live={0, 1})
    text = dump_pools(totals)
    lines = text.splitlines()
    assert lines[0].split(",")[0] == "PoolName"
    assert [c.strip() for c in lines[1].split(",")] == ["db", "sqlalchemy", "1", "4", "3", "2",
                                                       "0.500", "3"]
    assert [c.strip() for c in lines[2].split(",")][:4] == ["old", "sqlalchemy", "1",
                                                            "unbounded"]
    fams = {f.name: f for f in pool_families("apf", totals)}
    cap = {s.labels["pool"]: s.value for s in fams["apf_pool_capacity"].samples}
    assert cap == {"db": 4.0, "old": float("inf")}
    wait = [s for s in fams["apf_pool_wait_seconds"].samples if s.name.endswith("_total")]
    assert {s.labels["pool"]: s.value for s in wait}["db"] == 0.5
    gone = table.totals(S, live={0})
    assert [c.strip() for c in dump_pools(gone).splitlines()[2].split(",")][2:5] == ["0", "-",
                                                                                     "-"]


def test_master_view_counts_registered_workers_only():
    """A booting worker (pid 0) has published nothing; its row may hold its dead
    predecessor's last window, which must not count."""
    from types import SimpleNamespace

    from apf_gunicorn.master.metrics import view_of_master_state

    table = PoolTable.create(rows=2)
    now = time.monotonic_ns()
    table.writer(0).publish([reading(in_use=1)], now)
    table.writer(1).publish([reading(in_use=2)], now)
    m = SimpleNamespace(pool_table=table, workers={0: 1234, 1: 0})
    t = view_of_master_state(m).pools()["db"]
    assert (t.capacity, t.in_use, t.workers) == (4, 1, 1)
    assert view_of_master_state(SimpleNamespace()).pools is None


def test_pool_signals_setting_is_on_by_default_and_refuses_anything_but_on_or_off():
    from apf_gunicorn.server.settings import SettingsError, load_settings

    assert load_settings({}).pool_signals is True
    assert load_settings({"APF_POOL_SIGNALS": "OFF"}).pool_signals is False
    with pytest.raises(SettingsError, match="APF_POOL_SIGNALS"):
        load_settings({"APF_POOL_SIGNALS": "maybe"})
