"""The master's adaptive-limit tick (master/autolimit.py) against a bytearray ledger, in
virtual time: what it reads from the ledger's statistics, and how a new limit is applied
(levels follow, settings and the generation's limits replaced, queues untouched)."""

from __future__ import annotations

import heapq
import re
from types import SimpleNamespace

from apf_gunicorn.ledger import EXECUTE, QUEUED, Capacity, Ledger
from apf_gunicorn.ledger.lock import NullLock
from apf_gunicorn.master.autolimit import ServerAutoLimit
from apf_gunicorn.master.serverlimit import large_move
from apf_gunicorn.server.generation import configure_ledger, load_generation
from apf_gunicorn.server.settings import load_settings

MS = 1_000_000
S = 1_000_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 10 * S

    def __call__(self) -> int:
        return self.now


def master(limit: str = "auto:2-24"):
    # 2 x 80 threads: auto starts at the default 80 bounded by 24, far above the pool's knee
    # and below the 32 clients (the first binding tick halves it to look below)
    settings = load_settings({"APF_CONCURRENCY_LIMIT": limit}, workers=2, threads=80)
    gen = load_generation(settings)
    cap = Capacity()
    ledger = Ledger.create(bytearray(Ledger.size(cap)), cap, lock=NullLock())
    configure_ledger(ledger, gen, 1)
    return SimpleNamespace(ledger=ledger, generation=gen, settings=settings,
                           borrowing_states=None, sender=None)


class PoolLoad:
    """``threads`` closed-loop clients of the "users" level against a pool of ``pool``
    connections, 50 ms a query: a query started with ``n`` executing takes
    ``50 ms x max(1, n / pool)`` (the connection wait inside the app); a rejected client
    tries again 20 ms later."""

    def __init__(self, m, clock: Clock, threads: int = 32, pool: int = 4) -> None:
        self.m, self.clock, self.pool = m, clock, pool
        self.level = m.generation.level_index["users"]
        self.fs = m.generation.fs_index["users"]
        self.events: list = []  # (end ns, slot, gen), or (retry ns, -1, client)
        self.executing = 0
        self.granted = 0  # requests the master's limit changes dispatched
        m.sender = self  # the master sends the grants of a limit change to their workers
        for i in range(threads):
            self._admit(i)

    def send_grants(self, granted: list) -> None:
        self.granted += len(granted)
        for slot, gen, _owner in granted:
            self._start(slot, gen)

    def _start(self, slot: int, gen: int) -> None:
        self.executing += 1
        took = 50 * MS * max(1.0, self.executing / self.pool)
        heapq.heappush(self.events, (self.clock.now + int(took), slot, gen))

    def _admit(self, i: int) -> None:
        r = self.m.ledger.admit(self.level, 0x9E3779B97F4A7C15 * (i + 1) & (2**64 - 1), 1, 0, 0,
                                0, self.clock.now, self.fs)
        if r.outcome == EXECUTE:
            self._start(r.slot, r.gen)
        elif r.outcome != QUEUED:
            heapq.heappush(self.events, (self.clock.now + 20 * MS, -1, i))
        for slot, gen, _owner in r.granted:
            self._start(slot, gen)

    def run_until(self, t: int) -> None:
        while self.events and self.events[0][0] <= t:
            end, slot, gen = heapq.heappop(self.events)
            self.clock.now = end
            if slot < 0:
                self._admit(gen)
                continue
            self.executing -= 1
            granted, _linger = self.m.ledger.finish(slot, gen, end)
            for s, g, _owner in granted:
                self._start(s, g)
            self._admit(slot)  # the client sends its next query at once
        self.clock.now = t


def test_the_first_tick_only_records_and_an_idle_server_holds() -> None:
    m, clock = master(), Clock()
    auto = ServerAutoLimit(m.settings.concurrency_auto, m.settings.concurrency_limit, clock)
    assert auto.tick(m) is None and auto.last_tick is None
    clock.now += S
    assert auto.tick(m) is None
    assert auto.last_tick.kinds == {} and auto.last_tick.concurrency == 0.0
    assert not auto.last_tick.waiting
    assert m.settings.concurrency_limit == 24


def test_a_pool_of_4_brings_the_limit_down_and_levels_follow() -> None:
    m, clock = master(), Clock()
    before = dict(m.generation.limits)
    auto = ServerAutoLimit(m.settings.concurrency_auto, m.settings.concurrency_limit, clock)
    load = PoolLoad(m, clock)
    auto.tick(m)
    moves = []
    for _ in range(30):
        load.run_until(clock.now + S)
        change = auto.tick(m)
        if change is not None:
            moves.append(change)
    tick = auto.last_tick
    assert set(tick.kinds) == {("users", "users")}  # the level and FlowSchema that ran
    assert tick.waiting  # 32 clients against fewer seats
    assert moves and moves[0] == (24, 12)  # looking below the start
    assert load.granted > 0  # a move up dispatched waiting requests at once
    assert m.settings.concurrency_limit == auto.limit <= 8, moves
    # every level's nominal seats follow the new server limit; the exempt level stays 0
    assert m.generation.limits["users"].nominal < before["users"].nominal
    assert m.generation.limits["exempt"].nominal == 0
    users = m.ledger.load(levels=(load.level,))[0]
    assert users.concurrency_limit == m.borrowing_states["users"].current_limit
    # (borrowing hands out the levels' nominal sum, which the ceilings of shares can
    # put a seat or two above a small server limit)
    assert users.concurrency_limit <= sum(lim.nominal for lim in m.generation.limits.values())
    # queues untouched: the flood still waits, and the baseline is the uncontended 50 ms
    assert users.requests_waiting > 0
    assert 45 * MS <= auto.controller.baselines[("users", "users")] <= 80 * MS


def test_a_large_move_is_more_than_a_quarter() -> None:
    assert large_move(20, 14) and large_move(8, 11)
    assert not large_move(20, 15) and not large_move(8, 10)


class Log:
    """A logger that keeps what the master logs, as (level, line)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str]] = []

    def info(self, msg, *args) -> None:
        self.lines.append(("info", msg % args))

    def debug(self, msg, *args) -> None:
        self.lines.append(("debug", msg % args))

    def exception(self, msg, *args) -> None:
        self.lines.append(("exception", msg % args))

    def infos(self) -> list[str]:
        return [line for level, line in self.lines if level == "info"]


def test_the_master_logs_a_move_by_more_than_a_quarter() -> None:
    from apf_gunicorn.master.master import MasterServices

    m, clock = master(), Clock()
    log = Log()
    services = MasterServices(m, log)
    services.auto.clock = clock
    assert m.auto_limit is services.auto
    load = PoolLoad(m, clock)
    infos = []
    for _ in range(30):
        services.adapt_once()
        load.run_until(clock.now + S)
        infos = [line for level, line in log.lines if level == "info"]
        if infos:
            break
    # the flood against a pool of 4 from 20 seats: a first large move down
    assert infos and re.match(r"apf: concurrency limit auto: \d+ -> \d+ seats \(down: ", infos[0]), \
        log.lines
    assert [level for level, _ in log.lines].count("debug") >= 2  # every tick at debug
    assert not [line for level, line in log.lines if level == "exception"]


def test_routes_of_one_flow_schema_are_kinds_of_their_own() -> None:
    """Issue 26: a 2 ms route and a 200 ms one under one FlowSchema. Per FlowSchema the mean
    swings with the mix of a tick (x7 here) and reads as overload; per route each kind keeps
    its own baseline and the inflation stays 1."""
    from apf_gunicorn.admission.routekinds import RouteTimes, route_shape

    assert route_shape("/items/42/edit") == "/items/*/edit"
    assert route_shape("/slow") == "/slow"
    m, clock = master("auto:2-20"), Clock()
    table = RouteTimes.create(rows=4)
    auto = ServerAutoLimit(m.settings.concurrency_auto, m.settings.concurrency_limit, clock,
                           route_times=table)
    exempt = {"exempt"}
    fast = table.offset(0, "users", "users", "/")
    slow = table.offset(1, "users", "users", "/slow")  # another worker's row
    assert fast >= 0 and slow >= 0 and table.offset(99, "users", "users", "/") == -1
    assert auto.observe(m.ledger, exempt, clock.now) is None  # records where counters stand
    ratios = []
    for n_fast, n_slow in [(90, 10), (10, 30)] * 4:
        table.words[fast] += n_fast
        table.words[fast + 1] += n_fast * 2 * MS
        table.words[slow] += n_slow
        table.words[slow + 1] += n_slow * 200 * MS
        clock.now += S
        tick = auto.observe(m.ledger, exempt, clock.now)
        assert set(tick.kinds) == {("users", "users", "/"), ("users", "users", "/slow")}
        assert tick.kinds[("users", "users", "/slow")].count == n_slow
        auto.controller.update(tick)
        ratios.append(auto.controller.last.inflation)
    assert all(r is None or abs(r - 1) < 0.01 for r in ratios), ratios
    assert table.label(slow // 2 % 256) == ("users", "users", "/slow")
