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
from tests.apps.flood import Flood

S = 1_000_000_000


def pool(capacity=8, in_use=0, waiting=0, wait_s=0.0, name="db", kind="sqlalchemy", workers=2):
    return PoolTotals(name, kind, capacity, in_use, waiting, int(wait_s * S), 0, workers)


class Driver:
    """Feeds the rule one tick a second; ``wait_s`` accumulates the pool's waiting; the
    requests in flight are the level's seats (a flood) unless ``executing`` says."""

    def __init__(self, ceiling=20, share=0.8):
        self.rule = PoolLimit(ceiling)
        self.share = share
        self.now = 0
        self.waited = 0.0

    def tick(self, *, waiting=0.0, in_use=8, binding=True, capacity=8, executing=None):
        self.now += S
        self.waited += waiting  # mean number waiting over a 1 s tick
        if executing is None:
            executing = self.rule.seats or 0
        return self.rule.update(self.now, [pool(capacity, in_use, round(waiting), self.waited)],
                                self.share, binding, executing)


def test_no_bounded_pool_leaves_the_limit_alone():
    rule = PoolLimit(20)
    assert rule.update(S, [], 0.8, True, 0) is None
    assert rule.update(2 * S, [pool(capacity=-1), pool(capacity=0, name="gone")], 0.8,
                       True, 0) is None
    assert rule.limit is None


def test_first_sight_sets_the_level_seats_to_the_pool_capacity_over_the_share():
    d = Driver(share=0.8)
    first = d.tick(waiting=0, in_use=0)
    # the users level (share 0.8) gets 8 seats: ceil(10 x 0.8) = 8, and ceil(9 x 0.8) = 8 too
    assert first.changed and first.seats == 8 and first.limit == 9
    assert first.reason.startswith("limit from pools: 2 SQLAlchemy pools, 8 connections "
                                   "server-wide")
    # never above the ceiling (the default limit)
    low = PoolLimit(6).update(S, [pool()], 0.5, False, 0)
    assert low.limit == 6


def test_waiting_steps_down_by_what_waited_to_the_connections_the_requests_can_have():
    d = Driver(share=1.0)
    d.tick(in_use=0)
    for _ in range(4):  # unsaturated, nobody waiting, the limit binding: seats come back
        up = d.tick(in_use=6)
    assert up.seats == 12 and up.limit == 12 and "none waiting, 6 of 8 in use" in up.reason
    down = d.tick(waiting=3.0, in_use=8)
    assert down.changed and down.limit == 9
    assert down.reason == "pool db: 3.0 waiting, 8 of 8 in use: 9 seats"
    d.tick(in_use=8)
    # at the pool's size, requests spread unevenly over the workers' pools wait a little:
    # no more pool users than requests in flight, so no connection is held by another
    for waiting, in_use in ((1.0, 7), (2.4, 6), (5.0, 3)):
        assert d.tick(waiting=waiting, in_use=in_use).limit == 8
        assert d.tick(in_use=8).limit == 8
    # another tenant holds 4 of the 8 connections: 8 requests in flight, 4 served, 4 waiting;
    # seen in one tick it could be samples of different instants, in two it is not
    first = d.tick(waiting=4.0, in_use=8)
    assert first.limit == 8 and first.reason == "pool db: 4.0 waiting, 8 of 8 in use: 8 seats"
    below = d.tick(waiting=4.0, in_use=8)
    assert below.limit == 4
    assert below.reason == ("pool db: 4.0 waiting, 8 of 8 in use, 4 held outside requests: "
                            "4 seats")
    # others known to hold some: a tick whose requests still wait counts what it shows; never
    # below one seat
    d.tick(in_use=8)
    assert d.tick(waiting=2.0, in_use=8, executing=4).limit == 2  # 8 + 2 - 4 = 6 held
    d.tick(in_use=8)
    assert d.tick(waiting=20.0, in_use=8, executing=4).limit == 1
    # the requests in flight a tick ago count too: the samples were taken since then
    d2 = Driver(share=1.0)
    d2.tick(in_use=0)
    d2.tick(in_use=8, executing=8)
    assert d2.tick(waiting=1.0, in_use=7, executing=2).limit == 8


def test_connections_held_outside_requests_count_from_two_of_them_two_ticks_running():
    """The workers' samples are of different instants: a tick's count of connections held
    outside requests is off by one or two. One held, or one tick of two, moves nothing; two
    ticks of two do; the seats come back when two ticks show fewer held."""
    d = Driver(share=1.0)
    d.tick(in_use=0)
    for _ in range(3):
        assert d.tick(waiting=1.0, in_use=8).limit == 8  # 8 in use + 1 waiting, 8 in flight
    assert d.tick(waiting=2.0, in_use=8).limit == 8  # two: one tick of it
    two = d.tick(waiting=2.0, in_use=8)
    assert two.limit == 6 and "2 held outside requests: 6 seats" in two.reason
    # (the limit not binding: idle connections alone bring back nothing)
    d.tick(waiting=0.0, in_use=8, binding=False)  # (8 in flight a tick ago)
    d.tick(waiting=0.0, in_use=8, binding=False)  # 8 - 6 in flight: still two
    assert d.tick(waiting=0.0, in_use=7, binding=False).limit == 6  # one tick of fewer
    back = d.tick(waiting=0.0, in_use=7, binding=False)  # two: they gave one back
    assert back.limit == 7 and back.reason == "pool db: fewer held outside requests (1): 7 seats"


def test_the_tick_after_a_step_down_counts_only_the_waiting_beyond_what_it_gave_back():
    """The pools' readings lag the tick by up to a window: the tick after a move down may
    still count the waiting that move ended."""
    d = Driver(share=1.0)
    d.tick(in_use=0)
    for _ in range(4):
        d.tick(in_use=6)
    assert d.tick(waiting=2.0).limit == 10 and d.rule.seats == 10
    held = d.tick(waiting=2.3)  # much the same waiting, seen again: 2 seats already given back
    assert not held.changed and held.limit == 10
    assert "2.3 waiting (2 seats given back a tick ago)" in held.reason
    assert d.tick(waiting=1.2).limit == 9  # a tick after a tick without a move: all of it
    more = d.tick(waiting=2.0)  # more than the move gave back: the rest
    assert more.limit == 8 and more.reason.startswith("pool db: 2.0 waiting (1 seats given")


def test_idle_connections_bring_back_the_seats_once_served_at_once_then_one_a_tick():
    d = Driver(share=1.0)
    d.tick(in_use=0)
    assert d.tick(in_use=7).seats == 9  # the knee above the pool: one seat a tick
    d.tick(waiting=5.0, in_use=8)  # a tenant took half the connections
    assert d.tick(waiting=5.0, in_use=8).seats == 4
    d.tick(in_use=8)
    back = d.tick(in_use=4)  # ... and gave them back: 4 idle, the 9 seats served before
    assert back.seats == 8 and back.reason == ("pool db: none waiting, 4 of 8 in use, limit "
                                               "binding: 8 seats")
    assert d.tick(in_use=2).seats == 9  # (idle, but no more than the seats once served)
    assert d.tick(in_use=2).seats == 10  # above them one at a time
    assert d.tick(in_use=8).seats == 10  # saturated, none waiting: the knee


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


class PoolModel:
    """A pool of ``capacity`` connections server-wide in front of a flood (the level's seats
    all busy), each request holding a connection ``hold`` of its time, another tenant holding
    ``taken(t)`` of them. With s seats, ``A`` connections left to the requests: s x hold are
    held while they last, and the requests beyond ``A / hold`` wait. The workers publish their
    window once a second, ``phase`` s after the master's tick: at a tick the rule reads the
    window published up to a second before (in use as of then, the time waited up to then)."""

    STEP = 0.05

    def __init__(self, taken, capacity=8, hold=0.9, phase=0.5):
        self.taken, self.capacity, self.hold, self.phase = taken, capacity, hold, phase
        self.t, self.waited = 0.0, 0.0
        self.published = pool(capacity, 0, 0, 0.0)

    def run(self, rule, ticks, share=1.0):
        """Ticks the rule once a second; returns ``[(t, seats)]`` after each tick."""
        seats, out = rule.update(0, [self.published], share, True, 0).seats, []
        for k in range(1, ticks + 1):
            while self.t < k - 1e-9:
                left = self.capacity - self.taken(self.t)
                self.waited += max(0.0, seats - left / self.hold) * self.STEP
                self.t = round(self.t + self.STEP, 6)
                if abs(self.t % 1 - self.phase) < self.STEP / 2:  # a window: publish
                    in_use = round(min(left, seats * self.hold)) + self.taken(self.t)
                    waiting = round(max(0.0, seats - left / self.hold))
                    self.published = pool(self.capacity, in_use, waiting, self.waited)
            seats = rule.update(k * S, [self.published], share, True, seats).seats
            out.append((k, seats))
        return out


@pytest.mark.parametrize("phase", [0.05, 0.5, 0.95])
@pytest.mark.parametrize("take_at", [14.02, 14.5, 14.98])
def test_a_tenant_taking_half_the_connections_is_followed_within_5_s_and_left_behind(
        phase, take_at):
    """Issue 33's capacity that moves: another tenant holds 4 of the pool's 8 connections for
    12 s. Before, the level sits at the knee above the pool (9 seats: 8 / 0.9 = 8.9); within
    5 s of the take it is down by the 4 connections taken, and it never goes below the knee
    of what is left (4: 4 / 0.9 = 4.4); within 5 s of the return it is back at 9."""
    give_at = take_at + 12
    model = PoolModel(lambda t: 4 if take_at <= t < give_at else 0, phase=phase)
    seats = dict(model.run(PoolLimit(20), 40))
    assert seats[14] == 9, seats
    down = next(k for k, s in seats.items() if k > take_at and s <= 5)
    assert down - take_at <= 5, seats
    assert all(4 <= s <= 5 for k, s in seats.items() if down <= k < give_at), seats
    back = next(k for k, s in seats.items() if k > give_at and s >= 9)
    assert back - give_at <= 5, seats
    assert all(9 <= s <= 10 for k, s in seats.items() if k >= back), seats


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
        d.rule.update(d.now + S, [pool()], 0.0, True, 0)
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
        LevelLoad(idx, False, 0, ledger.seats.get(name, 0), 0, ledger.waiting.get(name, 0), 0,
                  0)
        for name, idx in gen.level_index.items() if name != "exempt"],
        waiting={}, seats={}, set_limits=lambda limits, now: applied.append(limits) or [])
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


def test_the_master_counts_the_seats_in_flight_against_the_pool():
    """The rule tells connections held outside requests by the seats the ledger says are
    held: 8 in use and 4 waiting beside 8 seats in flight in work are 4 held outside; beside
    12 (4 more in another level) none."""
    for other, limit in ((0, 7), (4, 15)):
        m, _ = fake_master()
        runner = ServerPoolLimit(20, clock=iter(range(S, 100 * S, S)).__next__)
        m.pool_table.pools = {"db": pool()}
        assert runner.tick(m).limit == 15
        m.ledger.seats = {"work": 8, "other": other}
        for k in range(1, 4):
            m.pool_table.pools = {"db": pool(in_use=8, waiting=4, wait_s=4.0 * k)}
            d = runner.tick(m)
        assert d.limit == limit and m.settings.concurrency_limit == limit, d


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


# -- on a real server ---------------------------------------------------------------------------

@pytest.mark.server
@pytest.mark.parametrize("setting", ["", "auto"], ids=["nothing set", "auto"])
def test_on_a_real_server_the_limit_follows_a_tenant_holding_half_the_pool_and_comes_back(
        server_factory, tmp_path, setting):
    """Nothing set, or ``auto`` (which reads the pools first, the same rule), 2 workers x 20
    threads, a flood on ``/work`` (each request holds a unit of the app's
    ``apf_gunicorn.resource``, 4 per worker, 50 ms; tests/apps/neighbour_app.py). The work level
    (1000 of tests/apps/apf.yaml's 2005 shares) starts at the pool's 8 seats (limit 15, from
    the default's 20 or auto's); a neighbour in each worker then holds 2 of its 4 units: the
    seats go down to at most 5 (limit <= 10), the log naming the units held outside requests;
    when it gives them back, they come back to 8 or more. The pieces between are real (the
    workers' table, the ledger's seats in flight, the master's tick and log); how fast is the
    rule's test above."""
    from tests.apps import neighbour
    from tests.conftest import free_port
    from tests.test_server_observability import scrape

    admin = free_port()
    ctl = str(tmp_path / "neighbour")
    neighbour.tell(ctl, 0)
    env = {"APF_ADMIN_BIND": f"127.0.0.1:{admin}", "APF_CONCURRENCY_LIMIT": setting,  # "": unset
           "NEIGHBOUR_FILE": ctl}

    def limit() -> float | None:
        return scrape(admin).get(("apf_server_concurrency_limit_seats", ()))

    with server_factory(workers=2, threads=20, env=env,
                        app="tests.apps.neighbour_app:app") as srv:
        assert srv.wait_for(lambda: limit() == 15, timeout=60), (limit(), srv.log())
        if setting == "auto":
            assert "(limit auto: 2 apf_gunicorn.resource pools, 8 connections server-wide; " \
                "CPU; 8 seats for the busiest level" in srv.log(), srv.log()
        with Flood(srv.port, "/work?ms=50", user="heavy", connections=24) as flood:
            neighbour.tell(ctl, 2)
            down = srv.wait_for(lambda: (v := limit()) is not None and v <= 10 and v,
                                timeout=60)
            assert down, (limit(), srv.log())
            assert "held outside requests" in srv.log(), srv.log()
            assert [held for _, _, held in neighbour.moves(ctl)] == [2, 2], neighbour.moves(ctl)
            neighbour.tell(ctl, 0)
            back = srv.wait_for(lambda: (v := limit()) is not None and v >= 15 and v,
                                timeout=60)
            assert back, (limit(), srv.log())
        assert flood.statuses.get(200, 0) > 0 and not flood.errors, flood.statuses
        assert not any(s >= 500 for s in flood.statuses), flood.statuses
        log = srv.log()
        after = log.split("held outside requests: ")[-1]
        assert "none waiting" in after or "fewer held outside requests" in after, log
