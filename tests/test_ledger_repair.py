"""Repair: a ledger interrupted mid-operation or scribbled on is rebuilt from its slot table."""

from __future__ import annotations

import os
import random

import pytest

from apf_gunicorn.ledger import EXECUTE, QUEUED, Capacity, Ledger, LevelSpec, NullLock, verify
from apf_gunicorn.ledger import layout as L
from apf_gunicorn.ledger.queueset import KubernetesQueueSet

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


STEPS = ["_link_tail_locked", "_unlink_locked", "touch_locked", "_demand_locked", "_free_locked",
         "_release_seats_locked", "_set_leaf_locked", "dispatch_one_locked"]


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("nth", [1, 2, 4])
def test_interrupted_operation_is_repaired_by_the_next_locker(monkeypatch, step, nth) -> None:
    led, levels, now = busy_ledger()
    owner = Ledger if step.startswith("_") else KubernetesQueueSet  # the fairness's
    original = getattr(owner, step)
    calls = {"n": 0}

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == nth:
            raise RuntimeError("interrupted")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(owner, step, failing)
    rnd = random.Random(5)
    interrupted = False
    running = [(r.slot, r.gen) for lv in led.snapshot(now).levels for r in lv.requests
               if r.state == "executing"]
    # Admit, finish and release until the step's nth call raises. The seeded sequence is the
    # same on every run and reaches every (step, nth) within its first 4 rounds, on the C fast
    # paths too (their slow cases run these Python steps); a step it stops reaching fails the
    # test instead of skipping it.
    ops = 0
    for _ in range(40):
        ops += 1
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
    monkeypatch.setattr(owner, step, original)
    assert interrupted, f"{step} was called {calls['n']} times in {ops} operations, not {nth}"
    print(f"{step} interrupted at its call {nth}, in operation {ops}")
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


# -- a worker killed inside an operation: whole events only (the undo log) ----------------------

DYING, SURVIVOR = 4242, 4343  # pids of worker 1 (killed) and worker 0


class _Killed(BaseException):
    """Raised by the tracer where the worker is SIGKILLed: nothing after it runs."""


def _request_counters(led: Ledger) -> list[str]:
    """Every broken identity between the per-request counters, level by level: each request
    estimated is dispatched, rejected or still waiting, and the level's counters (the dumps)
    are the sums of its stats entries' (the metrics)."""
    out = []
    snap = led.snapshot(1000 * S)
    stats = led.request_stats()
    for lv in snap.levels:
        es = [e for e in stats if e.level == lv.name]
        work = sum(e.work.count for e in es)
        dispatched = sum(e.dispatched for e in es)
        rejected = sum(sum(e.rejected.values()) for e in es)
        cancelled = sum(e.rejected["cancelled"] + e.rejected["time-out"] for e in es)
        if work != dispatched + rejected + lv.requests_waiting:
            out.append(f"{lv.name}: estimated {work} != dispatched {dispatched} + rejected "
                       f"{rejected} + waiting {lv.requests_waiting}")
        if (lv.dispatched, lv.rejected, lv.cancelled) != (dispatched, rejected, cancelled):
            out.append(f"{lv.name}: level counters {lv.dispatched, lv.rejected, lv.cancelled} "
                       f"!= stats entries {dispatched, rejected, cancelled}")
    return out


def _dying_worker(led: Ledger, lv: dict) -> None:
    """What worker 1 does: every kind of event (the inline fast admit and finish, queuing,
    queue-full, dispatch by a finish, time-out, cancel, a reject-type level, exempt), and it
    leaves one request running and one waiting."""
    q, r, x = lv["q"], lv["r"], lv["x"]
    t = 10 * MS
    run = led.admit(q, 1, 1, 0, 0, 1, t)
    assert run.outcome == EXECUTE  # the inline fast path: a seat free, nothing waiting
    first = led.admit(q, 2, 1, 0, 0, 1, t + 1)
    second = led.admit(q, 3, 1, 0, 0, 1, t + 2)
    assert led.admit(q, 2, 1, 0, 0, 1, t + 3).reason == "queue-full"
    assert (first.outcome, second.outcome) == (QUEUED, QUEUED)
    assert led.cancel(first.slot, first.gen, t + 4, "time-out")
    granted, _ = led.finish(run.slot, run.gen, t + 5)  # dispatches the second one
    assert granted == [(second.slot, second.gen, 1)]
    assert not led.cancel(second.slot, second.gen, t + 6, "cancelled")  # too late: it runs
    led.finish(second.slot, second.gen, t + 7)
    assert led.admit(q, 10, 1, 0, 0, 1, t + 7).outcome == EXECUTE  # still running at the end
    gone = led.admit(q, 4, 1, 0, 0, 1, t + 8)
    assert led.cancel(gone.slot, gone.gen, t + 9, "cancelled")
    assert led.admit(q, 5, 1, 0, 0, 1, t + 10).outcome == QUEUED  # still waiting at the end
    ran = led.admit(r, 6, 1, 0, 0, 1, t + 11)
    assert led.admit(r, 7, 1, 0, 0, 1, t + 12).reason == "concurrency-limit"
    led.finish(ran.slot, ran.gen, t + 13)
    exempt = led.admit(x, 8, 1, 0, 0, 1, t + 14)
    led.finish(exempt.slot, exempt.gen, t + 15)


def _dying_worker_in_a_lockstep(led: Ledger, lv: dict) -> None:
    """What worker 1 does under ``maxmin`` with 4 seats in ``q`` (worker 0 holds one): its flow
    A learns 100 ms, ends 3 requests at once while 3 more wait (two seats go straight back to
    A, the third is held: docs/fairness.md, "Lockstep"), then B starts waiting and ends the
    hold; it leaves A's requests running, held and waiting."""
    q = lv["q"]
    t = 10 * MS
    first = led.admit(q, 1, 1, 0, 0, 1, t)
    led.finish(first.slot, first.gen, t + 100 * MS)
    t += 100 * MS
    running = [led.admit(q, 1, 1, 0, 0, 1, t) for _ in range(3)]
    waiting = [led.admit(q, 1, 1, 0, 0, 1, t) for _ in range(3)]
    assert [r.outcome for r in running + waiting] == [EXECUTE] * 3 + [QUEUED] * 3
    t += 100 * MS
    lingers = [led.finish(r.slot, r.gen, t)[1] for r in running]
    assert lingers[:2] == [0, 0] and lingers[2] > t  # the third is held
    b = led.admit(q, 2, 1, 0, 0, 1, t + MS)
    assert b.outcome == EXECUTE  # the hold ended for B
    led.finish(b.slot, b.gen, t + 2 * MS)


def _kill_at(line: int, fairness: str = "kubernetes", lockstep: bool = False) -> bool:
    """Run the dying worker until its ``line``-th line of ledger code under the lock, then
    repair as the next locker does when the lock reports its dead holder, and reap it as
    child_exit does (level ``q`` running ``fairness``; ``lockstep``: 4 seats under
    ``maxmin`` and :func:`_dying_worker_in_a_lockstep`). Returns whether it died."""
    import sys

    from apf_gunicorn.ledger import ledger as ledger_module
    from apf_gunicorn.ledger import repair

    lock = DeadHolderLock()
    led = Ledger.create(bytearray(Ledger.size(CAP)), CAP, lock=lock)
    q = LevelSpec("q", 8, 2, 10, 4, "maxmin") if lockstep else LevelSpec("q", 2, 1, 1, 2, fairness)
    lv, _ = led.configure([q, LevelSpec("r", 0, 0, 0, 1),
                           LevelSpec("x", -1, 0, 0, 0)], ["fs"], 0)
    led.register_worker(0, SURVIVOR, 0)
    led.register_worker(1, DYING, 0)
    held = led.admit(lv["q"], 9, 1, 0, 0, 0, MS)  # worker 0 holds one of q's two seats
    # every module of the ledger package (the Ledger class is composed from several)
    package = os.path.dirname(ledger_module.__file__)
    files = {os.path.join(package, name) for name in os.listdir(package)
             if name.endswith(".py")}
    assert repair.__file__ in files
    w = led._w
    seen = [0]

    def tracer(frame, event, arg):
        if frame.f_code.co_filename not in files:
            return None

        def local(frame, event, arg):
            if event == "line" and w[L.H_DIRTY]:  # inside an operation, holding the lock
                seen[0] += 1
                if seen[0] == line:
                    raise _Killed
            return local
        return local

    died = False
    sys.settrace(tracer)
    try:
        (_dying_worker_in_a_lockstep if lockstep else _dying_worker)(led, lv)
    except _Killed:
        died = True
    finally:
        sys.settrace(None)
    lock.dead = DYING if died else None  # the next locker learns that the holder died
    problems = _request_counters(led)
    led.reap_worker(1, S)
    led.finish(held.slot, held.gen, S + 1)
    problems += _request_counters(led) + verify(led)
    assert problems == [], f"killed at line {line}"
    snap = led.snapshot(2 * S)
    assert all(level.requests == [] for level in snap.levels)
    assert led._w[L.H_REPAIRS] == (1 if died else 0)
    return died


def test_a_worker_killed_anywhere_in_an_operation_leaves_whole_events() -> None:
    """SIGKILL at every line the ledger runs under the lock (the OOM killer, a test's kill):
    the next locker's repair puts back the words of the half-done event from the undo log, so
    the counters stay whole: estimated = dispatched + rejected, the dumps' level counters =
    the metrics' stats entries. Without the undo log about a quarter of these points broke
    them (test_metrics_match_dumps_and_clients_across_kill_and_hup failed when its kill
    landed on one)."""
    line = 1
    while _kill_at(line):
        line += 1
    assert line > 500  # every line of every event was a death point


def test_a_worker_killed_anywhere_in_a_maxmin_operation_leaves_whole_events() -> None:
    """The same under the maxmin fairness, whose requests all take the general path and whose
    flow table a repair rebuilds from the slot table (verify checks it)."""
    line = 1
    while _kill_at(line, "maxmin"):
        line += 1
    assert line > 500


def test_a_worker_killed_anywhere_in_a_lockstep_hold_leaves_whole_events() -> None:
    """The same through maxmin's lockstep hold and its early end (a finish that holds its
    seats, an arrival that frees them): the counters stay whole, the ledger verifies, and
    the reap frees the dead worker's held seats with the rest."""
    line = 1
    while _kill_at(line, "maxmin", lockstep=True):
        line += 1
    assert line > 300


def test_the_c_fast_admit_logs_every_word_it_counts() -> None:
    """The C admit writes the same undo log as the Python fast path (byte identity is tested in
    test_ledger_accelerator): killed just before it clears the log, its request is undone."""
    led = Ledger.create(bytearray(Ledger.size(CAP)), CAP, lock=NullLock())
    lv, _ = led.configure([LevelSpec("q", 2, 1, 1, 2)], ["fs"], 0)
    led.finish(*led.admit(lv["q"], 1, 1, 0, 0, 0, MS)[1:3], 2 * MS)  # creates the stats entry
    before = (led.snapshot(3 * MS).levels[0].dispatched,
              [(e.work.count, e.dispatched) for e in led.request_stats()])
    run = led.admit(lv["q"], 1, 1, 0, 0, 0, 4 * MS)
    assert run.outcome == EXECUTE and led._w[L.H_UNDO_N] == 0
    led._w[L.H_UNDO_N] = 5  # as if killed after its writes, before the log was cleared
    led._w[L.H_DIRTY] = 1
    after = (led.snapshot(5 * MS).levels[0].dispatched,
             [(e.work.count, e.dispatched) for e in led.request_stats()])
    assert after == before
    assert led.snapshot(6 * MS).levels[0].requests == []  # its slot is free again
    assert verify(led) == []
