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
import threading
import time

import pytest

from apf_gunicorn.ledger import EXECUTE, QUEUED, Capacity, Ledger, LevelSpec, verify
from apf_gunicorn.ledger import fastpath as fastpath_module
from apf_gunicorn.ledger import layout as L
from apf_gunicorn.ledger import ledger as ledger_module
from apf_gunicorn.ledger.lock import ProcessLock
from tests.ledger_streams import Counted, drive

CAP = Capacity(levels=4, queues=256, slots=96, workers=4, flow_schemas=4, detail_bytes=24,
               stats_entries=16)


def test_the_accelerator_is_built_and_used() -> None:
    if os.environ.get("APF_NO_ACCELERATOR", "") not in ("", "0"):
        pytest.skip("APF_NO_ACCELERATOR is set")
    assert ledger_module._ACCEL is not None, (
        "apf_gunicorn/ledger/_fastpath.c was not built, or was built for another layout: "
        "install with a C compiler (pip install -e .; after a layout.py change, run "
        "scripts/layout_header.py first) or set APF_NO_ACCELERATOR=1 to test the pure-Python "
        "paths only")
    led = Ledger.create(bytearray(Ledger.size(CAP)), CAP)
    assert led.accelerated
    assert not Ledger.create(bytearray(Ledger.size(CAP)), CAP, accelerate=False).accelerated


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
    """``fairness``: the queuing levels' fairness (``mixed``: see ``drive``)."""
    learn = seed % 4 >= 2  # levels learn their service estimate (G) from finished requests
    fast, slow = _pair(learn)
    counted = Counted(fast, "_admit_locked", "_finish_locked")  # the C hand-overs
    levels, admits, finishes = drive(seed, (fast, slow), _same, fairness=fairness)
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
    counted = Counted(fast, "_admit_locked", "_finish_locked")  # the C hand-overs
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
    counted = Counted(fast, "_admit_locked", "_finish_locked")  # the C hand-overs
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
                # the maxmin structure methods are the new binding's, not the parent's closed one
                assert led._maxmin._heap_insert.__self__ is led._fp
                assert led._maxmin._get.__self__ is led._fp
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


@pytest.mark.parametrize("seed", range(6))
def test_c_and_python_flow_structures_leave_identical_buffers(seed: int) -> None:
    """The maxmin general path's structure operations that ``_accelerate`` binds to C
    (``mm_get``, ``mm_heap_insert``, ``mm_heap_remove``, ``mm_heap_decrease``) against the
    Python methods, on random streams straight at the structures: deep heaps, tied keys (equal
    tags and seats), decrease-keys, entries going idle, being reused and evicted, and the
    table running out; the buffers must be byte-identical after every operation."""
    import random

    fast, slow = _pair()
    assert {n for n, _ in fastpath_module._MM_C_METHODS} <= set(fast._maxmin.__dict__)
    assert not set(slow._maxmin.__dict__) & {n for n, _ in fastpath_module._MM_C_METHODS}
    for led in (fast, slow):
        levels, _ = led.configure([LevelSpec("a", 8, 2, 5, 4, "maxmin"),
                                   LevelSpec("b", 8, 2, 5, 4, "maxmin")], ["fs"], 0)
    rng = random.Random(seed)
    pols = (fast._maxmin, slow._maxmin)
    p0 = pols[0]
    hashes = [rng.getrandbits(64) for _ in range(150)]  # more flows than entries
    ops = 0
    for step in range(3000):
        level = rng.choice((levels["a"], levels["b"]))
        mm = p0._mb + level * L.MM_WORDS
        where = [p0._w[p0._fa(f) + L.F_WHERE] for f in range(CAP.slots)]
        mine = [f for f in range(CAP.slots) if p0._w[p0._fa(f) + L.F_LEVEL] == level]
        in_heap = [f for f in mine if where[f] == L.FW_HEAP]
        loose = [f for f in mine if where[f] == L.FW_NOWHERE]
        op = rng.random()
        if op < 0.3:
            h = rng.choice(hashes)
            got = []
            for p in pols:
                try:
                    got.append(p._get(mm, level, h))
                except AssertionError as e:
                    got.append(str(e))
            assert got[0] == got[1]
        elif op < 0.55 and loose:
            f = rng.choice(loose)
            # tags within 2^62 of each other (their order is a total order), wrapping past 0
            tag = (2**64 - 2**41 + rng.choice((0, 5, rng.randrange(2**42)))) % 2**64
            seats, seq = rng.randrange(3), rng.randrange(4)
            for p in pols:
                fa = p._fa(f)
                p._u[fa + L.F_TAG], p._w[fa + L.F_SEATS], p._w[fa + L.F_SEQ] = tag, seats, seq
                p._heap_insert(mm, f)
        elif op < 0.75 and in_heap:
            f = rng.choice(in_heap + [p0._w[mm + L.M_ROOT]])
            for p in pols:
                p._heap_remove(mm, f)
        elif op < 0.9 and in_heap:
            f = rng.choice(in_heap)
            fall = rng.choice((1, 1000, 2**40))
            for p in pols:
                fa = p._fa(f)
                p._u[fa + L.F_TAG] = (p._u[fa + L.F_TAG] - fall) % 2**64
                p._heap_decrease(mm, f)
        elif loose:
            f = rng.choice(loose)
            for p in pols:
                p._idle(mm, f, p._fa(f))
        else:
            continue
        ops += 1
        _same(fast, slow, f"operation {step} (seed {seed})")
        if step % 100 == 0:  # (and the heap is a heap: every entry it lists, in order)
            lb = fast._lvb + level * L.LEVEL_WORDS
            walked = p0.heap_flows_locked(lb)
            assert sorted(walked) == [f for f in range(CAP.slots)
                                      if p0._w[p0._fa(f) + L.F_LEVEL] == level
                                      and p0._w[p0._fa(f) + L.F_WHERE] == L.FW_HEAP]
            for f in walked:
                c = p0._w[p0._fa(f) + L.F_CHILD]
                while c != L.NIL:
                    assert not p0._less(c, f)
                    c = p0._w[p0._fa(c) + L.F_NEXT]
    assert ops > 1500


def test_the_bound_flow_structure_methods_check_their_arguments() -> None:
    fast, _slow = _pair()
    p = fast._maxmin
    before = bytes(fast._mv)
    with pytest.raises(IndexError):
        p._heap_insert(p._mb + 1, 0)  # not a level's maxmin words
    with pytest.raises(IndexError):
        p._heap_remove(p._mb, CAP.slots)  # no such entry
    with pytest.raises(IndexError):
        p._get(p._mb, CAP.levels, 1)
    with pytest.raises(TypeError):
        p._heap_decrease(p._mb)
    with pytest.raises(OverflowError):
        p._get(p._mb, 0, -1)
    assert bytes(fast._mv) == before
    fast.close()
    assert not set(p.__dict__) & {n for n, _ in fastpath_module._MM_C_METHODS}
