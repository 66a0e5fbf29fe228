"""``APF_CONCURRENCY_LIMIT=auto`` reads the app's pools first (master/autolimit.py): the
master's ticks with an injected clock against a real ledger and a flood (tests/test_autolimit's
``PoolLoad``), the pools' readings made from the flood. The real-server test is
test_poollimit's, run with nothing set and with auto."""

from __future__ import annotations

from types import SimpleNamespace

from apf_gunicorn.control.adaptive_types import CpuSample
from apf_gunicorn.master.master import MasterServices
from apf_gunicorn.master.poollimit import ServerPoolLimit
from apf_gunicorn.signals.table import PoolTotals
from tests.test_autolimit import Clock, Log, PoolLoad, master

S = 1_000_000_000


class Pools:
    """The pool table as the workers would publish a pool of ``capacity`` connections behind
    the flood: a neighbour holding ``held`` of them, the flood's requests waiting for the
    rest (the load's own pool is what is left); ``on=False``: no worker publishes one."""

    def __init__(self, load: PoolLoad, capacity: int = 8) -> None:
        self.load, self.capacity, self.held = load, capacity, 0
        self.wait_ns = 0
        self.on = True
        load.pool = capacity

    def hold(self, held: int) -> None:
        self.held = held
        self.load.pool = self.capacity - held

    def window(self) -> None:
        """A second passed: the waiting over it counts (the mean number waiting)."""
        self.wait_ns += max(0, self.load.executing + self.held - self.capacity) * S

    def totals(self, now_ns, live=None, max_age_ns=0):
        if not self.on:
            return {}
        used = self.load.executing + self.held
        return {"db": PoolTotals("db", "sqlalchemy", self.capacity, min(used, self.capacity),
                                 max(0, used - self.capacity), self.wait_ns, 0, 2)}


def serve(limit: str = "auto:2-24", capacity: int = 8, cpu: list | None = None):
    """A master under ``limit`` whose two workers publish a pool of ``capacity`` behind a
    32-client flood; ``cpu``: a one-item list holding the CpuSample its watch reads."""
    m, clock = master(limit), Clock()
    load = PoolLoad(m, clock)
    pools = Pools(load, capacity)
    m.pool_table, m.workers = pools, {0: 101, 1: 102}
    if cpu is not None:
        m.cpu_watch = SimpleNamespace(read=lambda live: SimpleNamespace(sample=cpu[0]))
    log = Log()
    services = MasterServices(m, log)
    services.auto.clock = clock
    return m, clock, load, pools, services, log


def second(services, load, pools, clock) -> int:
    services.adapt_once()
    load.run_until(clock.now + S)
    pools.window()
    return services.state.settings.concurrency_limit


def test_with_pools_the_pool_rule_decides_as_for_the_default_and_the_controller_stands_by():
    """The same rule as with nothing set (a twin ServerPoolLimit fed the same readings gives
    every tick's limit): 8 seats for users (share 0.8: limit 9) from auto's 24 at once, down
    to the 4 connections a neighbour leaves, back when it gives them back; the latency
    controller never looks below and stands at each limit applied."""
    m, clock, load, pools, services, log = serve()
    assert services.auto.pools is not None and services.pools is None
    twin = ServerPoolLimit(24)
    limits = []
    for t in range(24):
        if t == 6:
            pools.hold(4)
        if t == 15:
            pools.hold(0)
        expected = twin.decide(m, clock.now)
        limits.append(second(services, load, pools, clock))
        assert expected is not None and limits[-1] == expected.limit, (t, limits, log.lines)
        assert services.auto.source == "pool" and services.auto.controller.limit == limits[-1]
    infos = log.infos()
    assert infos[0] == ("apf: concurrency limit auto: 24 -> 9 seats (limit auto: 2 SQLAlchemy "
                        "pools, 8 connections server-wide; 8 seats for the busiest level "
                        "(share 0.80))"), infos
    assert min(limits[6:15]) <= 6 and limits[-1] >= 9, limits  # 5 seats: limit 6
    assert any("held outside requests" in line for line in infos), infos
    assert not any("(down:" in line or "(up:" in line for line in infos), infos
    assert len(infos) == sum(a != b for a, b in zip([24, *limits[:-1]], limits, strict=True)), infos


def test_when_the_pools_go_the_latency_controller_goes_on_from_their_limit():
    """The pools stop being published while the flood's pool shrinks to 4: the controller
    takes the pool rule's 9 seats and moves from there (no jump back to its start, no look
    below), by latency."""
    m, clock, load, pools, services, log = serve()
    for _ in range(6):
        second(services, load, pools, clock)
    assert m.settings.concurrency_limit == 9
    pools.on = False
    pools.hold(4)
    limits = [second(services, load, pools, clock) for _ in range(16)]
    infos = log.infos()
    assert ("apf: concurrency limit auto: no pool published now: the latency rule goes on "
            "from 9 seats") in infos, infos
    assert services.auto.source == "latency" and services.auto.pools.rule.seats is None
    assert abs(limits[0] - 9) <= 1, limits  # from the pools' limit: no jump, no look below
    assert limits[-1] < 9, limits  # latency inflated on 4 connections: down
    assert any("seats (down: " in line for line in infos), infos
    # the pools found again start the rule afresh: their capacity
    pools.on = True
    pools.hold(0)
    assert second(services, load, pools, clock) == 9 and services.auto.source == "pool"


def test_when_the_pools_go_from_the_same_backend_the_limit_stays_near_theirs():
    """Nothing changed but the pools' publishing: the controller does not go back to its start
    (24) nor halve the limit to look below (4); it explores around the pool's knee (its
    probes) and holds there."""
    m, clock, load, pools, services, log = serve()
    for _ in range(6):
        second(services, load, pools, clock)
    pools.on = False
    limits = [second(services, load, pools, clock) for _ in range(16)]
    assert services.auto.source == "latency"
    assert abs(limits[0] - 9) <= 1 and min(limits) > 4, (limits, log.infos())
    assert 8 <= limits[-1] <= 11 and services.auto.controller.last.reason.startswith(
        "hold: at the knee"), (limits, log.infos())


def test_the_bounds_clamp_the_pool_rule():
    """auto:12-24: a pool of 8 would give 9, MIN holds 12; a pool of 40 stops at MAX 24."""
    m, clock, load, pools, services, _ = serve("auto:12-24")
    for _ in range(3):
        assert second(services, load, pools, clock) == 12
    assert services.auto.pools.rule.seats == 10  # the rule goes on from the seats applied
    m, clock, load, pools, services, _ = serve("auto:2-24", capacity=40)
    assert second(services, load, pools, clock) == 24


def test_the_cpu_stops_the_pool_rules_rises():
    """A neighbour's 4 connections take the seats down; when it gives them back the rule
    would rise, but the workers are at 0.97 of their GILs: the limit holds (said once), and
    rises once the CPU is not the bound."""
    cpu = [CpuSample(2, 0.6)]
    m, clock, load, pools, services, log = serve(cpu=cpu)
    second(services, load, pools, clock)
    assert m.settings.concurrency_limit == 9
    assert "8 connections server-wide; CPU; 8 seats" in log.infos()[0], log.infos()
    pools.hold(4)
    for _ in range(8):
        low = second(services, load, pools, clock)
    assert low <= 6
    cpu[0] = CpuSample(2, 1.94)
    pools.hold(0)
    for _ in range(6):
        assert second(services, load, pools, clock) == low
    held = [line for line in log.infos() if " stays " in line]
    assert held == [f"apf: concurrency limit auto: stays {low} seats (cpu: workers at 0.97 of "
                    f"their GIL, holding {low} seats (more add nothing; the pools would give "
                    f"{held[0].rsplit(' ', 1)[-1][:-2]}))"], log.infos()
    cpu[0] = CpuSample(2, 0.6)
    for _ in range(4):
        second(services, load, pools, clock)
    assert m.settings.concurrency_limit >= 9, log.infos()
