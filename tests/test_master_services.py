"""The master services thread's loop (master/master.py) in virtual time: it sleeps between its
tasks and runs each on its own cadence, whether or not the adaptive limit is on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from apf_gunicorn.master.master import Cadence, MasterServices


class VirtualStop:
    """The loop's stop event: each wait advances the virtual clock by its timeout; the loop is
    told to stop after ``rounds`` waits."""

    def __init__(self, rounds: int) -> None:
        self.now = 0.0
        self.rounds = rounds
        self.waits: list[float] = []

    def clock(self) -> float:
        return self.now

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        self.now += timeout
        return len(self.waits) > self.rounds


def run_loop(auto: tuple[int, int] | None, tick: float, rounds: int) -> tuple[VirtualStop, dict]:
    settings = SimpleNamespace(concurrency_auto=auto, borrowing_period_s=10.0,
                               adaptive_tick_s=tick, concurrency_limit=8)
    services = MasterServices(SimpleNamespace(settings=settings))
    stop = VirtualStop(rounds)
    services.clock, services._stop_event = stop.clock, stop
    calls = {"borrow": [], "adapt": [], "housekeeping": 0}

    def housekeeping() -> None:
        calls["housekeeping"] += 1

    services.refresh_workers = services.reclaim_gone = housekeeping
    services.borrow_once = lambda: calls["borrow"].append(stop.now)
    services.adapt_once = lambda: calls["adapt"].append(stop.now)
    services.run()
    return stop, calls


def test_with_a_fixed_limit_the_loop_sleeps_a_second_between_rounds():
    stop, calls = run_loop(None, 1.0, rounds=100)
    # before: once the first borrowing round was due, the adaptive tick (never run) was always
    # overdue, and the loop spun without sleeping: a core of the master's CPU
    assert min(stop.waits) > 0.99 and stop.now == pytest.approx(101.0)
    assert calls["borrow"] == pytest.approx([10.0 * k for k in range(1, 11)])
    assert calls["adapt"] == [] and calls["housekeeping"] == 2 * 100


def test_with_auto_each_task_keeps_its_own_cadence():
    stop, calls = run_loop((1, 64), 0.25, rounds=200)
    assert min(stop.waits) > 0.24 and stop.now == pytest.approx(50.25)
    assert len(calls["adapt"]) == 200 and calls["adapt"][:2] == pytest.approx([0.25, 0.5])
    assert calls["borrow"] == pytest.approx([10.0 * k for k in range(1, 6)])


def test_a_cadence_starts_over_after_a_stall():
    c = Cadence(10.0, now=0.0)
    assert (c.wait_s(4.0), c.due(4.0)) == (6.0, False)
    assert c.due(10.0) and c.wait_s(10.0) == 10.0
    assert c.due(55.0) and not c.due(55.0)  # four missed rounds: one now, the next in 10 s
    assert c.wait_s(55.0) == 10.0
