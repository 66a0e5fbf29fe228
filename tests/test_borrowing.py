"""The 10 s borrowing adjustment with Kubernetes' own numbers (k8s-apf-config.md 3.3, 5.5)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from apf_gunicorn.flowcontrol.borrowing import (
    BorrowingState,
    BorrowingStates,
    DemandObservation,
    LevelInput,
    adjust,
    run_borrowing,
)

NS = 1_000_000_000


class Integrator:
    """Kubernetes' seat-demand integrator (fairqueuing/integrator.go), for driving adjust() the
    way TestUpdateBorrowing drives it: Set(x) at times, Reset() at each update."""

    def __init__(self, now: int) -> None:
        self.x = 0.0
        self.last = self.start = now
        self.ix = self.ixx = 0.0
        self.max = 0.0

    def _advance(self, now: int) -> None:
        dt = (now - self.last) / NS
        self.ix += self.x * dt
        self.ixx += self.x * self.x * dt
        self.last = now

    def set(self, x: float, now: int) -> None:
        self._advance(now)
        self.x = x
        self.max = max(self.max, x)

    def reset(self, now: int) -> DemandObservation:
        self._advance(now)
        duration = (now - self.start) / NS
        if duration > 0:
            avg = self.ix / duration
            var = self.ixx / duration - avg * avg
            dev = math.sqrt(var) if var >= 0 else math.nan
        else:
            avg, dev = 0.0, math.nan
        obs = DemandObservation(duration, avg, dev, self.max)
        self.start = now
        self.ix = self.ixx = 0.0
        self.max = self.x  # the next period's high watermark starts at the current value
        return obs


@dataclass
class PL:
    name: str
    exempt: bool
    nominal: int
    lower: int
    upper: int


def test_exempt_borrowing_sequence() -> None:
    """TestUpdateBorrowing: ServerCL 870; workload-high (40, 50%), exempt, workload-low
    (100, 90%), catch-all (5, 0%)."""
    pls = [
        PL("workload-high", False, 240, 120, 1110),
        PL("exempt", True, 0, 0, 870),
        PL("workload-low", False, 600, 60, 1470),
        PL("catch-all", False, 30, 30, 900),
    ]
    nominal_sum = sum(p.nominal for p in pls)
    assert nominal_sum == 870
    t0 = 1_000 * NS
    integ = {p.name: Integrator(t0) for p in pls}
    states = {p.name: BorrowingState() for p in pls}

    def update(t: int) -> dict[str, int]:
        inputs = [
            LevelInput(p.name, p.exempt, p.nominal, p.lower, p.upper, integ[p.name].reset(t),
                       states[p.name])
            for p in pls
        ]
        return {o.name: o.current_limit for o in adjust(inputs, nominal_sum, 870).levels}

    for i in integ.values():
        i.set(970, t0)
    got = update(t0 + 10 * NS)
    assert got == {"exempt": 970, "workload-high": 120, "workload-low": 60, "catch-all": 30}

    integ["exempt"].set(330, t0 + 10 * NS)
    update(t0 + 20 * NS)
    got = update(t0 + 30 * NS)
    assert got == {"exempt": 330, "workload-high": 180, "workload-low": 330, "catch-all": 30}

    integ["exempt"].set(540, t0 + 30 * NS)
    integ["workload-low"].set(1, t0 + 30 * NS)
    got = update(t0 + 40 * NS)  # intermediate: workload-low's watermark is still 970
    assert got == {"exempt": 540, "workload-high": 142, "workload-low": 158, "catch-all": 30}
    got = update(t0 + 50 * NS)
    assert got == {"exempt": 540, "workload-high": 240, "workload-low": 60, "catch-all": 30}


DEFAULT_600 = [  # k8s-apf-config.md 3.3: (name, exempt, nominal, lower, upper)
    ("exempt", True, 0, 0, 600),
    ("catch-all", False, 13, 13, 613),
    ("system", False, 74, 50, 674),
    ("node-high", False, 98, 73, 698),
    ("leader-election", False, 25, 25, 625),
    ("workload-high", False, 98, 49, 698),
    ("workload-low", False, 245, 24, 845),
    ("global-default", False, 49, 24, 649),
]


def test_idle_allocation_of_the_default_600_server() -> None:
    idle = DemandObservation(10.0, 0.0, 0.0, 0.0)
    inputs = [LevelInput(n, e, nom, lo, up, idle) for n, e, nom, lo, up in DEFAULT_600]
    result = adjust(inputs, sum(x[2] for x in DEFAULT_600), 600)
    assert {o.name: o.current_limit for o in result.levels} == {
        "exempt": 0, "catch-all": 30, "system": 117, "node-high": 170, "leader-election": 58,
        "workload-high": 114, "workload-low": 56, "global-default": 56,
    }
    assert result.fair_frac == pytest.approx(602 / 258)
    exempt = result.levels[0]
    assert exempt.concurrency_denominator == 60  # limit 0 -> round(ServerCL / 10)
    assert exempt.target == 13  # upstream quirk: the first non-exempt item's target
    assert result.levels[2].concurrency_denominator == 117


@pytest.mark.parametrize(
    ("pl0", "pl1"),
    [((12, 6, 20), (12, 8, 18)), ((12, 6, 16), (12, 4, 18))],
    ids=["lendable-limited", "borrowing-limited"],
)
def test_borrowing_test_vectors(pl0: tuple, pl1: tuple) -> None:
    """TestBorrowing's steady state: flow 0 has 24 busy threads, flow 1 six -> 1, 16, 8."""
    inputs = [
        LevelInput("exempt", True, 0, 0, 24, DemandObservation(10, 0, 0, 0)),
        LevelInput("catch-all", False, 1, 1, 25, DemandObservation(10, 0, 0, 0)),
        LevelInput("test-pl0", False, *pl0, DemandObservation(10, 24, 0, 24)),
        LevelInput("test-pl1", False, *pl1, DemandObservation(10, 6, 0, 6)),
    ]
    result = adjust(inputs, 25, 24)
    assert [o.current_limit for o in result.levels] == [0, 1, 16, 8]


def test_smoothing_and_nan_deviation() -> None:
    st = BorrowingState()
    st.update(DemandObservation(10, 100.0, 10.0, 130.4))
    assert (st.high_watermark, st.avg, st.stddev, st.smoothed) == (130, 100.0, 10.0, 110.0)
    st.update(DemandObservation(10, 0.0, math.nan, 0.5))  # NaN deviation counts as 0
    assert st.high_watermark == 1  # round half away from zero
    assert st.stddev == 0.0
    assert st.smoothed == pytest.approx(0.977 * 110.0)
    st.update(DemandObservation(0, 50.0, 0.0, 2))  # no time passed: only the watermark moves
    assert st.high_watermark == 2 and st.avg == 0.0


def test_exempt_eats_everything_gives_min_limits_and_zero_fair_frac() -> None:
    inputs = [
        LevelInput("exempt", True, 0, 0, 100, DemandObservation(10, 500, 0, 500)),
        LevelInput("a", False, 50, 10, 150, DemandObservation(10, 50, 0, 50)),
        LevelInput("b", False, 50, 20, 150, DemandObservation(10, 50, 0, 50)),
    ]
    result = adjust(inputs, 100, 100)
    assert [o.current_limit for o in result.levels] == [500, 10, 20]
    assert result.fair_frac == 0.0


class FakeLedger:
    """Only the two calls run_borrowing makes, recording what it was told."""

    def __init__(self, stats: dict[int, DemandObservation]) -> None:
        self.stats = stats
        self.limits: dict[int, int] | None = None
        self.taken: list[tuple[int, int]] = []

    def take_demand_stats(self, level: int, now: int) -> DemandObservation:
        self.taken.append((level, now))
        return self.stats[level]

    def set_limits(self, limits: dict[int, int], now: int) -> list:
        self.limits = dict(limits)
        return [(7, 1, 0)]


@dataclass
class Limits:
    nominal: int
    lendable: int
    borrowing: int
    lower: int
    upper: int
    max_seats: int = 1


def test_run_borrowing_writes_limits_by_ledger_index() -> None:
    limits = {
        "exempt": Limits(0, 0, 24, 0, 24),
        "catch-all": Limits(1, 0, 24, 1, 25),
        "test-pl0": Limits(12, 6, 8, 6, 20),
        "test-pl1": Limits(12, 4, 6, 8, 18),
    }
    led = FakeLedger({
        0: DemandObservation(10, 0, 0, 0), 1: DemandObservation(10, 0, 0, 0),
        2: DemandObservation(10, 24, 0, 24), 3: DemandObservation(10, 6, 0, 6),
        4: DemandObservation(10, 3, 0, 3),
    })
    states = BorrowingStates()
    levels = [("exempt", 0, True), ("catch-all", 1, False), ("test-pl0", 2, False),
              ("test-pl1", 3, False), ("draining", 4, False)]
    granted = run_borrowing(led, limits, states, 5 * NS, server_limit=24, levels=levels)
    assert granted == [(7, 1, 0)]
    assert led.limits == {0: 0, 1: 1, 2: 16, 3: 8}  # the draining level keeps its limit
    assert sorted(i for i, _ in led.taken) == [0, 1, 2, 3]
    assert states["test-pl0"].current_limit == 16 and states["test-pl0"].smoothed == 24
    assert states.fair_frac == pytest.approx(2 / 3)
