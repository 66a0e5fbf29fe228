"""Repair: a ledger interrupted mid-operation or scribbled on is rebuilt from its slot table."""

from __future__ import annotations

import random

import pytest

from apf_gunicorn.ledger import EXECUTE, QUEUED, Capacity, Ledger, LevelSpec, NullLock, verify
from apf_gunicorn.ledger import layout as L

MS = 1_000_000
S = 1_000_000_000
CAP = Capacity(levels=3, queues=32, slots=40, workers=4, flow_schemas=2, detail_bytes=8)


def busy_ledger(seed: int = 1, lock=None):
    """A ledger with requests waiting, executing and lingering in two levels, two owners."""
    led = Ledger.create(bytearray(Ledger.size(CAP)), CAP, lock=lock)
    levels, _ = led.configure([LevelSpec("a", 9, 2, 10, 3), LevelSpec("b", 4, 1, 10, 2)],
                              ["fs"], 0)
    rnd = random.Random(seed)
    now = 0
    running = []
    for _ in range(30):
        now += rnd.choice([1, 2 * MS, 100 * MS])
        lv = rnd.choice(list(levels.values()))
        res = led.admit(lv, rnd.getrandbits(64), rnd.randint(1, 2), rnd.randint(0, 2),
                        rnd.choice([0, 50 * MS]), rnd.randint(0, 1), now)
        if res.outcome == EXECUTE:
            running.append((res.slot, res.gen))
        running += [(s, g) for s, g, _ in res.granted]
        if running and rnd.random() < 0.3:
            s, g = running.pop(0)
            granted, _ = led.finish(s, g, now)
            running += [(s2, g2) for s2, g2, _ in granted]
    assert verify(led) == []
    return led, levels, now


def drain(led: Ledger, now: int) -> None:
    w = led._w
    for _ in range(200):
        busy = False
        now += S
        for s in range(CAP.slots):
            sa = led._sa(s)
            state, gen = w[sa + L.S_STATE], w[sa + L.S_GEN]
            if state == L.EXECUTING:
                busy = True
                _, until = led.finish(s, gen, now)
                if until:
                    led.release(s, gen, until)
            elif state == L.LINGERING:
                busy = True
                led.release(s, gen, now)
            elif state == L.WAITING:
                busy = True
        if not busy:
            break
    assert w[L.H_FREE_COUNT] == CAP.slots
    assert verify(led) == []


STEPS = ["_link_tail", "_unlink", "_touch", "_demand", "_free", "_release_seats", "_set_leaf",
         "_dispatch_one"]


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("nth", [1, 2, 4])
def test_interrupted_operation_is_repaired_by_the_next_locker(monkeypatch, step, nth) -> None:
    led, levels, now = busy_ledger()
    original = getattr(Ledger, step)
    calls = {"n": 0}

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == nth:
            raise RuntimeError("interrupted")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Ledger, step, failing)
    rnd = random.Random(5)
    interrupted = False
    running = [(r.slot, r.gen) for lv in led.snapshot(now).levels for r in lv.requests
               if r.state == "executing"]
    for _ in range(40):
        now += 30 * MS
        try:
            res = led.admit(rnd.choice(list(levels.values())), rnd.getrandbits(64), 1, 1, 0, 0,
                            now)
            got = res.granted + ([(res.slot, res.gen, 0)] if res.outcome == EXECUTE else [])
            running += [(s, g) for s, g, _ in got]
            if running:
                s, g = running.pop(0)
                granted, _ = led.finish(s, g, now + MS)
                running += [(s2, g2) for s2, g2, _ in granted]
            lingering = [(s, led._w[led._sa(s) + L.S_GEN]) for s in range(CAP.slots)
                         if led._w[led._sa(s) + L.S_STATE] == L.LINGERING]
            if lingering:
                granted = led.release(*lingering[0], now + 2 * MS)
                running += [(s2, g2) for s2, g2, _ in granted]
        except RuntimeError:
            interrupted = True
            break
    monkeypatch.setattr(Ledger, step, original)
    if not interrupted:
        pytest.skip(f"{step} was not called {nth} times")
    assert led._w[L.H_DIRTY] == 1  # the interrupted operation left its mark
    led.snapshot(now)  # any operation repairs first
    assert led._w[L.H_DIRTY] == 0
    assert led._w[L.H_REPAIRS] == 1
    assert verify(led) == []
    drain(led, now)


def test_scribbled_aggregates_links_and_trees_are_rebuilt() -> None:
    led, levels, now = busy_ledger(seed=3)
    w, u = led._w, led._u
    rnd = random.Random(9)
    for level in levels.values():
        lb = led._lb(level)
        for field in (L.L_WAITING, L.L_EXECUTING, L.L_SEATS_IN_USE, L.L_SEATS_WAITING,
                      L.L_ACTIVE_QUEUES, L.L_QSEATS):
            w[lb + field] = rnd.randint(-5, 50)
        for q in range(w[lb + L.L_NQ]):
            qa = led._qa(lb, q)
            for field in (L.Q_HEAD, L.Q_TAIL, L.Q_WAITING, L.Q_INIT_SUM, L.Q_MAX_SUM,
                          L.Q_EXECUTING, L.Q_SEATS):
                w[qa + field] = rnd.randint(-1, 7)
            u[qa + L.Q_WORK_SUM] = rnd.getrandbits(64)
        tb, p = w[lb + L.L_TBASE], w[lb + L.L_TP]
        for i in range(1, 2 * p):
            u[tb + i] = rnd.getrandbits(64)
    for s in range(CAP.slots):
        w[led._sa(s) + L.S_NEXT] = rnd.randint(-1, CAP.slots - 1)
    w[L.H_FREE_HEAD] = 3
    w[L.H_FREE_COUNT] = 999
    assert verify(led) != []
    w[L.H_DIRTY] = 1  # as a crashed holder would have left it
    led.snapshot(now)
    assert verify(led) == []
    drain(led, now)


def test_reap_worker_drops_waits_executions_and_lingering_seats() -> None:
    led = Ledger.create(bytearray(Ledger.size(CAP)), CAP)
    levels, _ = led.configure([LevelSpec("a", 4, 1, 10, 2)], [], 0)
    a = levels["a"]
    mine_run = led.admit(a, 1, 1, 1, 50 * MS, 1, 0)
    other_run = led.admit(a, 2, 1, 0, 0, 2, 0)
    mine_wait = led.admit(a, 3, 1, 0, 0, 1, 0)
    other_wait = led.admit(a, 4, 1, 0, 0, 2, 0)
    assert [r.outcome for r in (mine_run, other_run, mine_wait, other_wait)] == [
        EXECUTE, EXECUTE, QUEUED, QUEUED]
    granted = led.reap_worker(1, S)
    assert granted == [(other_wait.slot, other_wait.gen, 2)]
    snap = led.snapshot(S).levels[0]
    assert (snap.requests_executing, snap.requests_waiting, snap.seats_in_use) == (2, 0, 2)
    assert all(r.owner == 2 for r in snap.requests)
    assert led.reap_worker(1, S) == []  # idempotent
    assert verify(led) == []


class DeadHolderLock(NullLock):
    """Reports, once, that the previous holder (pid 4242) died holding the lock."""

    def __init__(self) -> None:
        self.dead = None
        self.consistent_calls = 0

    def acquire(self):
        dead, self.dead = self.dead, None
        return dead

    def consistent(self) -> None:
        self.consistent_calls += 1


def test_owner_dead_drops_the_dead_workers_slots() -> None:
    lock = DeadHolderLock()
    led = Ledger.create(bytearray(Ledger.size(CAP)), CAP, lock=lock)
    levels, _ = led.configure([LevelSpec("a", 4, 1, 10, 1)], [], 0)
    led.register_worker(1, 4242, 0)
    led.register_worker(2, 4343, 0)
    dead_run = led.admit(levels["a"], 1, 1, 0, 0, 1, 0)
    waiting = led.admit(levels["a"], 2, 1, 0, 0, 2, 0)
    assert (dead_run.outcome, waiting.outcome) == (EXECUTE, QUEUED)
    lock.dead = 4242
    snap_grants = led.snapshot(S)
    assert lock.consistent_calls == 1
    assert led.pending_grants == [(waiting.slot, waiting.gen, 2)]
    assert [r.owner for r in snap_grants.levels[0].requests] == [2]
    assert [wk[:3] for wk in led.workers()] == [(1, 4242, L.WORKER_GONE), (2, 4343, L.WORKER_ALIVE)]
    assert verify(led) == []


def test_a_failing_repair_keeps_the_lock_usable_and_is_retried(monkeypatch) -> None:
    from apf_gunicorn.ledger import repair

    lock = DeadHolderLock()
    led = Ledger.create(bytearray(Ledger.size(CAP)), CAP, lock=lock)
    levels, _ = led.configure([LevelSpec("a", 4, 1, 10, 1)], [], 0)
    original = repair.rebuild

    def broken(*args, **kwargs):
        raise RuntimeError("repair bug")

    monkeypatch.setattr(repair, "rebuild", broken)
    lock.dead = 4242
    with pytest.raises(RuntimeError):
        led.admit(levels["a"], 1, 1, 0, 0, 0, 1)
    assert lock.consistent_calls == 1  # never left unrecoverable
    assert led._w[L.H_DIRTY] == 1
    monkeypatch.setattr(repair, "rebuild", original)
    assert led.admit(levels["a"], 1, 1, 0, 0, 0, 2).outcome == EXECUTE  # repaired, then admitted
    assert led._w[L.H_REPAIRS] == 1
    assert verify(led) == []
