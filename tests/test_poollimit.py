"""The limit from the app's pools (control/poollimit.py, master/poollimit.py): the rule
driven tick by tick with an injected clock, and the master's runner against a fake master."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from apf_gunicorn.control.poollimit import PoolLimit, PoolLimitSettings, describe_pools
from apf_gunicorn.ledger.records import LevelLoad
from apf_gunicorn.master.poollimit import FIRST_SIGHT_WAIT_NS, ServerPoolLimit
from apf_gunicorn.signals.table import PoolTotals

S = 1_000_000_000


def pool(capacity=8, in_use=0, waiting=0, wait_s=0.0, name="db", kind="sqlalchemy", workers=2):
    return PoolTotals(name, kind, capacity, in_use, waiting, int(wait_s * S), 0, workers)


class Driver:
    """Feeds the rule one tick a second; ``wait_s`` accumulates the pool's waiting."""

    def __init__(self, ceiling=20, share=0.8):
        self.rule = PoolLimit(ceiling)
        self.share = share
        self.now = 0
        self.waited = 0.0

    def tick(self, *, waiting=0.0, in_use=8, binding=True, capacity=8):
        self.now += S
        self.waited += waiting  # mean number waiting over a 1 s tick
        return self.rule.update(self.now, [pool(capacity, in_use, round(waiting), self.waited)],
                                self.share, binding)


def test_no_bounded_pool_leaves_the_limit_alone():
    rule = PoolLimit(20)
    assert rule.update(S, [], 0.8, True) is None
    assert rule.update(2 * S, [pool(capacity=-1), pool(capacity=0, name="gone")], 0.8,
                       True) is None
    assert rule.limit is None


def test_first_sight_sets_the_level_seats_to_the_pool_capacity_over_the_share():
    d = Driver(share=0.8)
    first = d.tick(waiting=0, in_use=0)
    # the users level (share 0.8) gets 8 seats: ceil(10 x 0.8) = 8, and ceil(9 x 0.8) = 8 too
    assert first.changed and first.seats == 8 and first.limit == 9
    assert first.reason.startswith("limit from pools: 2 SQLAlchemy pools, 8 connections "
                                   "server-wide")
    # never above the ceiling (the default limit)
    low = PoolLimit(6).update(S, [pool()], 0.5, False)
    assert low.limit == 6


def test_waiting_steps_down_by_what_waited_and_never_below_the_capacity():
    d = Driver(share=1.0)
    d.tick(in_use=0)
    for _ in range(4):  # unsaturated, nobody waiting, the limit binding: seats come back
        up = d.tick(in_use=6)
    assert up.seats == 12 and up.limit == 12 and "none waiting, 6 of 8 in use" in up.reason
    down = d.tick(waiting=3.0, in_use=8)
    assert down.changed and down.limit == 9
    assert down.reason == "pool db: 3.0 waiting, 8 of 8 in use: 9 seats"
    floor = d.tick(waiting=5.0, in_use=8)
    assert floor.limit == 8  # the pool serves 8: fewer seats would leave connections idle


def test_a_step_up_needs_the_limit_binding_two_ticks_running():
    d = Driver(share=1.0)
    d.tick(in_use=0, binding=False)
    # the flood has just begun: binding now, but the pool's reading is from before it
    assert not d.tick(in_use=0, binding=True).changed
    assert d.tick(in_use=0, binding=True).limit == 9


def test_saturated_without_waiting_holds_and_idle_holds():
    d = Driver(share=1.0)
    d.tick(in_use=0)
    held = d.tick(waiting=0.0, in_use=8)  # at its knee: every connection busy, none waited for
    assert not held.changed and held.limit == 8
    idle = d.tick(waiting=0.0, in_use=0, binding=False)  # more seats would not be used
    assert not idle.changed and idle.limit == 8
    small = d.tick(waiting=0.3, in_use=7)  # a little waiting: between the thresholds, hold
    assert not small.changed


def test_the_knee_above_the_pool_is_found_and_kept():
    """A pool of 8 whose requests hold a connection 80% of their time: level seats s keep
    0.8 s connections busy; beyond 10 seats requests wait for the pool."""
    d = Driver(share=1.0)
    d.tick(in_use=0)
    limits = []
    for _ in range(30):
        seats = d.rule.seats
        busy = 0.8 * seats
        waiting = max(0.0, busy - 8) / 0.8
        limits.append(d.tick(waiting=waiting, in_use=min(8, int(busy))).limit)
    assert limits[-10:] and all(9 <= x <= 11 for x in limits[-10:]), limits


def test_seats_follow_the_capacity_as_workers_come_and_go():
    d = Driver(share=1.0)
    assert d.tick(in_use=0, capacity=4).limit == 4  # one worker published first
    grown = d.tick(in_use=0, capacity=8)
    assert grown.changed and grown.limit == 8
    assert grown.reason == "pool db: capacity 4 -> 8 server-wide: 8 seats"
    d.tick(in_use=5)  # the knee found one seat above
    assert d.tick(in_use=0, capacity=4).limit == 5  # a worker gone: the same offset


def test_the_ceiling_stops_the_climb_and_bad_input_is_refused():
    d = Driver(ceiling=10, share=1.0)
    d.tick(in_use=0)
    for _ in range(5):
        last = d.tick(in_use=0)
    assert last.limit == 10 and d.rule.seats == 10
    with pytest.raises(ValueError, match="share"):
        d.rule.update(d.now + S, [pool()], 0.0, True)
    with pytest.raises(ValueError, match="ceiling"):
        PoolLimit(0)
    with pytest.raises(ValueError, match="up_below"):
        PoolLimitSettings(down_at=0.1, up_below=0.5)


def test_describe_pools_counts_per_kind():
    text = describe_pools([pool(workers=2), pool(4, name="pg", kind="psycopg_pool", workers=1),
                           pool(-1, name="free")])
    assert text == "2 SQLAlchemy pools, 1 psycopg_pool pool, 12 connections server-wide"


# -- the master's runner ----------------------------------------------------------------------

class FakeTable:
    def __init__(self):
        self.pools = {}

    def totals(self, now_ns, live=None, max_age_ns=0):
        return self.pools


def fake_master(limit=20):
    from apf_gunicorn.server.generation import load_generation
    from apf_gunicorn.server.settings import load_settings
    from tests.conftest import APPS

    settings = load_settings({"APF_CONFIG": str(APPS / "apf.yaml")}, workers=2, threads=20)
    gen = load_generation(settings, 1)
    gen.level_index = {name: i for i, name in enumerate(gen.configuration.priority_levels)}
    applied = []
    ledger = SimpleNamespace(load=lambda: [
        LevelLoad(idx, False, 0, 0, 0, ledger.waiting.get(name, 0), 0, 0)
        for name, idx in gen.level_index.items() if name != "exempt"],
        waiting={}, set_limits=lambda limits, now: applied.append(limits) or [])
    return SimpleNamespace(settings=settings, generation=gen, ledger=ledger,
                           pool_table=FakeTable(), workers={0: 11, 1: 12},
                           borrowing_states=None, sender=None), applied


def test_the_master_applies_the_pool_limit_through_the_shared_path():
    m, applied = fake_master()
    assert m.settings.concurrency_limit == 20 and not m.settings.concurrency_limit_set
    clock = iter(range(S, 100 * S, S))
    runner = ServerPoolLimit(20, clock=lambda: next(clock))
    assert runner.tick(m) is None and m.settings.concurrency_limit == 20  # no pool yet
    m.pool_table.pools = {"db": pool(capacity=4, workers=1)}  # one worker has published
    assert runner.tick(m) is None and m.settings.concurrency_limit == 20
    m.pool_table.pools = {"db": pool()}
    d = runner.tick(m)
    # tests/apps/apf.yaml: work has 1000 of 2005 shares: 8 seats is 15 (15 x 0.499 -> 8)
    assert d.changed and d.limit == 15 and m.settings.concurrency_limit == 15
    assert m.generation.limits["work"].nominal == 8 and applied
    m.ledger.waiting = {"work": 3}
    m.pool_table.pools = {"db": pool(in_use=5)}
    assert runner.tick(m).limit == 15  # binding one tick: the pool's reading may be older
    d = runner.tick(m)
    assert d.limit == 17 and m.settings.concurrency_limit == 17  # 9 seats: ceil(8.5)


def test_the_first_limit_waits_for_every_worker_only_so_long():
    m, _ = fake_master()
    now = [S]
    runner = ServerPoolLimit(20, clock=lambda: now[0])
    m.pool_table.pools = {"db": pool(capacity=4, workers=1)}  # the other makes none yet
    assert runner.tick(m) is None
    now[0] += FIRST_SIGHT_WAIT_NS
    d = runner.tick(m)
    assert d.changed and d.seats == 4 and m.settings.concurrency_limit == 7  # 7 x 0.499 -> 4


def test_an_explicit_limit_turns_the_pool_rule_off():
    from apf_gunicorn.master.master import MasterServices

    m, _ = fake_master()
    assert MasterServices(m).pools is not None
    m.settings = dataclasses.replace(m.settings, concurrency_limit_set=True)
    assert MasterServices(m).pools is None
