"""The C fast paths (``apf_gunicorn/ledger/_fastpath.c``) change nothing but speed.

Two ledgers, one with the C paths and one pure Python, are driven by the same random streams;
after every operation the results and the whole buffers must be byte-identical. Streams cover
every way out of the fast path (queuing, final seats, lingering, several active queues, long
and huge time steps, an R near the epoch advance, quiescing levels, cancels) so both the C
paths and their hand-over to Python are exercised; counters show the C paths really ran.
"""

from __future__ import annotations

import mmap
import os
import random
import threading
import time

import pytest

from apf_gunicorn.ledger import EXECUTE, QUEUED, Capacity, Ledger, LevelSpec, verify
from apf_gunicorn.ledger import layout as L
from apf_gunicorn.ledger import ledger as ledger_module
from apf_gunicorn.ledger.lock import ProcessLock
from apf_gunicorn.ledger.seatseconds import HIGH_R

CAP = Capacity(levels=4, queues=256, slots=96, workers=4, flow_schemas=4, detail_bytes=24,
               stats_entries=16)


def test_the_accelerator_is_built_and_used() -> None:
    if os.environ.get("APF_NO_ACCELERATOR", "") not in ("", "0"):
        pytest.skip("APF_NO_ACCELERATOR is set")
    assert ledger_module._ACCEL is not None, (
        "apf_gunicorn/ledger/_fastpath.c was not built: install with a C compiler "
        "(pip install -e .) or set APF_NO_ACCELERATOR=1 to test the pure-Python paths only")
    led = Ledger.create(bytearray(Ledger.size(CAP)), CAP)
    assert led.accelerated
    assert not Ledger.create(bytearray(Ledger.size(CAP)), CAP, accelerate=False).accelerated


class _Counted:
    """Counts the operations the C paths handed to Python (wraps the ``_*_locked`` methods)."""

    def __init__(self, led: Ledger) -> None:
        self.admits = self.finishes = 0
        admit, finish = led._admit_locked, led._finish_locked

        def a(*args):
            self.admits += 1
            return admit(*args)

        def f(*args):
            self.finishes += 1
            return finish(*args)

        led._admit_locked = a
        led._finish_locked = f


def _pair(learn_service: bool = False):
    leds = [Ledger.create(bytearray(Ledger.size(CAP)), CAP, accelerate=acc,
                          learn_service=learn_service)
            for acc in (True, False)]
    if not leds[0].accelerated:
        pytest.skip("the C fast paths are not built")
    return leds


def _same(a: Ledger, b: Ledger, what: str) -> None:
    if bytes(a._mv) != bytes(b._mv):
        wa, wb = a._w, b._w
        diff = [i for i in range(len(wa)) if wa[i] != wb[i]][:8]
        raise AssertionError(f"buffers differ after {what}: words {diff} "
                             f"{[(wa[i], wb[i]) for i in diff]}")


@pytest.mark.parametrize("fairness", ["kubernetes", "maxmin", "mixed"])
@pytest.mark.parametrize("seed", range(12))
def test_c_and_python_paths_leave_identical_ledgers(seed: int, fairness: str) -> None:
    """``fairness``: the queuing levels' dispatch policy; ``mixed``: level a kubernetes, b
    switching between the two at reconfigurations."""
    rnd = random.Random(seed)
    learn = seed % 4 >= 2  # levels learn their service estimate (G) from finished requests
    fast, slow = _pair(learn)
    counted = _Counted(fast)
    light = seed % 2  # light load: most requests run at once (the C paths' own cases)
    c = rnd.randint(30, 60) if light else rnd.randint(2, 12)
    fa = "kubernetes" if fairness == "mixed" else fairness
    fb = "maxmin" if fairness == "mixed" else fairness
    specs = [LevelSpec("a", rnd.choice([1, 4, 16]), 1, 6, c, fa),
             LevelSpec("b", 8, rnd.randint(1, 4), 4, c // 2 + 1, fb),
             LevelSpec("x", -1, 0, 0, 0),
             LevelSpec("r", 0, 0, 0, 3)]
    now = rnd.randint(0, 10**12)
    ids = [led.configure(specs, ["fs0", "fs1", "fs2"], now) for led in (fast, slow)]
    assert ids[0] == ids[1]
    levels = list(ids[0][0].values())
    if seed % 3 == 0:  # R just below the epoch advance: the C paths must hand it over
        r = HIGH_R - rnd.randint(0, 5_000_000_000)
        for led in (fast, slow):
            led._u[led._lb(levels[0]) + L.L_R] = r
    live: list = []  # (slot, gen)
    hashes = [rnd.getrandbits(64) for _ in range(rnd.randint(1, 9))]
    admits = finishes = 0
    for step in range(700):
        now += rnd.choice([0, 1, 999, 3_000_000, 250_000_000, 999_999_999, 1_000_000_001,
                           3 * 10**9, 10**15])
        op = rnd.random()
        if light:
            op *= 0.9  # admits and finishes only
        if op < 0.5 or not live:
            initial = rnd.choice([1, 1, 1, 1, 2, 3, 20])
            final = rnd.choice([0, 0, 0, 0, 1, 2, 40])
            al = rnd.choice([0, 0, 0, 5_000_000]) if final else 0
            args = (rnd.choice(levels), rnd.choice(hashes), initial, final, al,
                    rnd.randint(0, 3), now, rnd.randint(0, 3), rnd.randbytes(rnd.randint(0, 40)),
                    rnd.random() < 0.1)
            got = [led.admit(*args) for led in (fast, slow)]
            admits += 1
            assert got[0] == got[1]
            assert type(got[0]) is type(got[1])
            if got[0].outcome in (EXECUTE, QUEUED):
                live.append((got[0].slot, got[0].gen))
            for s, g, _owner in got[0].granted:
                assert (s, g) in live
        elif op < 0.85:
            slot, gen = live.pop(rnd.randrange(len(live)))
            got = [led.finish(slot, gen, now) for led in (fast, slow)]
            finishes += 1
            assert got[0] == got[1]
            if got[0][1]:
                got = [led.release(slot, gen, got[0][1]) for led in (fast, slow)]
                assert got[0] == got[1]
            # a finish of a still-waiting slot is a stale no-op on both; cancel it instead
            got = [led.cancel(slot, gen, now, "time-out") for led in (fast, slow)]
            assert got[0] == got[1]
        elif op < 0.9:
            slot, gen = rnd.choice(live)
            got = [led.finish(slot, gen + 1, now) for led in (fast, slow)]  # stale gen
            assert got[0] == got[1]
        elif op < 0.95 and step % 7 == 0:  # reconfigure: queue counts change by attrition
            specs[1] = specs[1]._replace(desired_queues=rnd.choice([4, 8, 16]),
                                         concurrency_limit=rnd.randint(1, 8))
            if fairness == "mixed":
                specs[1] = specs[1]._replace(fairness=rnd.choice(["kubernetes", "maxmin"]))
            got = [led.configure(specs, ["fs0", "fs1", "fs2"], now) for led in (fast, slow)]
            assert got[0] == got[1]
        else:
            lim = rnd.randint(1, 12)
            got = [led.set_limits({levels[0]: lim}, now) for led in (fast, slow)]
            assert got[0] == got[1]
        _same(fast, slow, f"step {step}")
    for led in (fast, slow):
        assert verify(led) == []
    learnt = {fast.level_service_estimate_ns(lv) for lv in levels[:2]}
    assert (learnt != {fast.service_estimate_ns}) == learn, learnt
    # both sides of the hand-over ran: the C paths completed a share of the operations
    # (stale finishes included) and handed the rest to Python
    print(f"C completed {admits - counted.admits}/{admits} admits, "
          f"{finishes - counted.finishes}/{finishes} finishes")
    assert 0 < counted.admits < admits and 0 < counted.finishes < finishes


@pytest.mark.parametrize("fairness", ["kubernetes", "maxmin"])
def test_the_fast_cases_never_reach_python(fairness: str) -> None:
    fast, slow = _pair()
    counted = _Counted(fast)
    for led in (fast, slow):
        levels, _ = led.configure([LevelSpec("a", 8, 2, 5, 4, fairness)], ["fs"], 0)
    a = levels["a"]
    # the first admit creates the stats entry (Python); after that every admit and finish
    # of a request that runs at once stays in C
    for led in (fast, slow):
        res = led.admit(a, 7, 1, 0, 0, 0, 1, 0, b"d", False)
        led.finish(res.slot, res.gen, 2)
    before = (counted.admits, counted.finishes)
    now = 10
    for i in range(200):
        now += 1_000_000 * (i % 5)
        got = [led.admit(a, i * 7919, 1 + i % 3, 0, 0, 1, now, 0, b"x" * (i % 30), i % 2 == 0)
               for led in (fast, slow)]
        assert got[0] == got[1] and got[0].outcome == EXECUTE
        now += 3
        got = [led.finish(got[0].slot, got[0].gen, now) for led in (fast, slow)]
        assert got[0] == got[1] == ([], 0)
        _same(fast, slow, f"request {i}")
    assert (counted.admits, counted.finishes) == before


def _shm_ledger():
    mm = mmap.mmap(-1, Ledger.size(CAP))
    led = Ledger.create(mm, CAP, lock=ProcessLock())
    if not led.accelerated:
        led.close()
        mm.close()
        pytest.skip("the C fast paths are not built")
    return led, mm


def test_process_lock_mode_takes_and_releases_the_mutex() -> None:
    led, mm = _shm_ledger()
    try:
        assert led.accelerated
        lock = led._lock
        levels, _ = led.configure([LevelSpec("a", 4, 1, 10, 2)], ["fs"], 0)
        res = led.admit(levels["a"], 1, 1, 0, 0, 0, 1)
        res = led.admit(levels["a"], 1, 1, 0, 0, 0, 2)  # the C path (stats entry exists)
        assert res.outcome == EXECUTE
        assert led._w[L.H_HOLDER_PID] == 0
        assert led.finish(res.slot, res.gen, 3) == ([], 0)
        assert led._w[L.H_HOLDER_PID] == 0
        assert lock._trylock(lock._ref) == 0 and lock._unlock(lock._ref) == 0  # left free
        # another thread of this process holds the mutex: the C path hands over at once (the
        # holder needs the GIL) and the Python path waits for it without the GIL
        held, go = threading.Event(), threading.Event()

        def hold() -> None:
            lock.acquire()
            held.set()
            go.wait(5)
            lock.release()

        holder = threading.Thread(target=hold)
        holder.start()
        assert held.wait(5)
        done = []
        t = threading.Thread(target=lambda: done.append(led.admit(levels["a"], 1, 1, 0, 0, 0,
                                                                  4)))
        t.start()
        time.sleep(0.05)
        assert not done
        go.set()
        t.join(5)
        holder.join(5)
        assert done and done[0].outcome == EXECUTE
    finally:
        led.close()
        mm.close()


def test_the_c_entries_hand_over_and_take_keywords() -> None:
    """``admit``/``finish`` are the C entries; a call with keywords and a decline both reach
    the Python paths with the same results as a pure-Python ledger."""
    fast, slow = _pair()
    assert type(fast.admit) is not type(slow.admit)  # the C entry vs the bound method
    counted = _Counted(fast)
    for led in (fast, slow):
        levels, _ = led.configure([LevelSpec("a", 8, 2, 5, 1)], ["fs"], 0)
    a = levels["a"]
    got = [led.admit(a, 5, 1, 0, 0, 0, 1, fs_index=0, detail=b"k", watch=False)
           for led in (fast, slow)]
    assert got[0] == got[1] and got[0].outcome == EXECUTE and counted.admits == 1
    queued = [led.admit(a, 6, 1, 0, 0, 0, 2) for led in (fast, slow)]  # limit 1: queues
    assert queued[0] == queued[1] and queued[0].outcome == QUEUED and counted.admits == 2
    fin = [led.finish(slot=got[0].slot, gen=got[0].gen, now=3) for led in (fast, slow)]
    assert fin[0] == fin[1] and fin[0][0] and counted.finishes == 1
    _same(fast, slow, "keyword calls and declines")
    with pytest.raises(TypeError):
        fast.admit(a, 5)
    assert fast._w[L.H_HOLDER_PID] == 0 and not fast._w[L.H_DIRTY]


def test_an_unclosed_accelerated_ledger_is_collected() -> None:
    import gc
    import weakref

    led = Ledger.create(bytearray(Ledger.size(CAP)), CAP)
    if not led.accelerated:
        pytest.skip("the C fast paths are not built")
    ref = weakref.ref(led)
    del led
    gc.collect()
    assert ref() is None
    # and close() drops the C entries: the methods answer again
    led = Ledger.create(bytearray(Ledger.size(CAP)), CAP)
    led.close()
    assert "admit" not in vars(led) and "finish" not in vars(led)


def test_forked_child_rebinds_the_c_paths() -> None:
    led, mm = _shm_ledger()
    try:
        levels, _ = led.configure([LevelSpec("a", 4, 1, 10, 64)], ["fs"], 0)
        a = levels["a"]
        res = led.admit(a, 1, 1, 0, 0, 0, 1)
        led.finish(res.slot, res.gen, 2)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                # the child's copy of the ledger: new threading lock and pid in the C paths
                assert led.accelerated
                assert led._fp is not None
                for i in range(50):
                    r = led.admit(a, i, 1, 0, 0, 1, 10 + i)
                    assert r.outcome == EXECUTE
                    assert led._w[L.H_HOLDER_PID] == 0
                    led.finish(r.slot, r.gen, 11 + i)
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        snap = led.snapshot(100).levels[0]
        assert snap.dispatched == 51 and snap.seats_in_use == 0
        assert verify(led) == []
    finally:
        led.close()
        mm.close()
