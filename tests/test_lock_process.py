"""ProcessLock on real POSIX shared memory: exclusion across processes and threads, and repair
after a holder is SIGKILLed while holding the robust mutex."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from apf_gunicorn.ledger import EXECUTE, Ledger, LevelSpec, ProcessLock, verify
from apf_gunicorn.ledger import layout as L
from tests.conftest import SHM_CAP as CAP  # the shm_ledger fixture's capacity


def test_process_lock_refuses_a_bytearray() -> None:
    with pytest.raises(TypeError, match="mmap"):
        Ledger.create(bytearray(Ledger.size(CAP)), CAP, lock=ProcessLock())


def test_sigkilled_holder_is_repaired_by_the_next_locker(shm_ledger) -> None:
    led, mm = shm_ledger
    levels, _ = led.configure([LevelSpec("a", 4, 1, 10, 2)], [], 0)
    a = levels["a"]
    parent_run = led.admit(a, 1, 1, 0, 0, 0, 0)
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: worker 1 takes a seat, queues a request, then dies holding the lock
        try:
            os.close(r)
            child = Ledger.attach(mm, lock=ProcessLock())
            child.register_worker(1, os.getpid(), 0)
            child.admit(a, 2, 1, 0, 0, 1, 1)
            child.admit(a, 3, 1, 0, 0, 1, 2)
            child._lock.acquire()
            child._w[L.H_DIRTY] = 1
            child._w[child._lb(a) + L.L_SEATS_IN_USE] = 77  # a half-done mutation
            os.write(wfd, b"x")
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(wfd)
    try:
        assert os.read(r, 1) == b"x"
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    finally:
        os.close(r)
    waiter = led.admit(a, 4, 1, 0, 0, 0, 3)  # EOWNERDEAD -> repair -> consistent
    assert waiter.outcome == EXECUTE  # the dead worker's seat is free again
    assert led._w[L.H_REPAIRS] == 1
    snap = led.snapshot(4).levels[0]
    assert sorted(r.owner for r in snap.requests) == [0, 0]
    assert snap.seats_in_use == 2 and snap.requests_waiting == 0
    # the dead worker's queued request is counted as cancelled, as a reap counts it: every
    # request admitted is dispatched or rejected, in the level's and the stats entry's counters
    assert (snap.cancelled, snap.rejected, snap.dispatched) == (1, 1, 3)
    entries = led.request_stats()
    assert sum(e.rejected["cancelled"] for e in entries) == 1
    assert sum(e.work.count for e in entries) == sum(e.dispatched + sum(e.rejected.values())
                                                      for e in entries) == 4
    assert verify(led) == []
    led.finish(parent_run.slot, parent_run.gen, 5)
    assert led.admit(a, 5, 1, 0, 0, 0, 6).outcome == EXECUTE  # the mutex works normally again


def test_threads_of_two_processes_exclude_each_other(shm_ledger) -> None:
    led, mm = shm_ledger
    levels, _ = led.configure([LevelSpec("x", -1, 0, 0, 0)], [], 0)
    x = levels["x"]
    per_thread, threads = 300, 3

    def hammer(ledger: Ledger) -> None:
        def loop() -> None:
            for _ in range(per_thread):
                res = ledger.admit(x, 0, 1, 0, 0, 0, time.monotonic_ns())
                ledger.finish(res.slot, res.gen, time.monotonic_ns())
        ts = [threading.Thread(target=loop) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            hammer(Ledger.attach(mm, lock=ProcessLock()))
            code = 0
        finally:
            os._exit(code)
    hammer(led)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    snap = led.snapshot(time.monotonic_ns()).levels[0]
    assert snap.dispatched == 2 * threads * per_thread
    assert snap.seats_in_use == 0 and snap.requests_executing == 0
    assert verify(led) == []


@pytest.fixture(params=["wait_unlocked", "ctypes"])
def wait_mode(request, monkeypatch):
    """The contended wait with the C helper, and the pure-ctypes fallback."""
    from apf_gunicorn.ledger import lock as lock_mod

    if request.param == "wait_unlocked":
        if lock_mod._WAIT_UNLOCKED is None:
            pytest.skip("C accelerator not built or switched off")
    else:
        monkeypatch.setattr(lock_mod, "_WAIT_UNLOCKED", None)
    return request.param


def _hold_in_child(mm) -> tuple[int, int]:
    """Fork a child that takes the ledger lock and holds it until its pipe is written (or it
    is killed); returns once it holds it: (pid, fd to write to make it let go)."""
    held_r, held_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(held_r)
            os.close(go_w)
            lock = Ledger.attach(mm, lock=ProcessLock())._lock
            lock.acquire()
            os.write(held_w, b"x")
            os.read(go_r, 1)
            lock.release()
        finally:
            os._exit(0)
    os.close(held_w)
    os.close(go_r)
    assert os.read(held_r, 1) == b"x"
    os.close(held_r)
    return pid, go_w


def test_a_contended_wait_lets_the_process_run_and_then_takes_the_lock(shm_ledger,
                                                                       wait_mode) -> None:
    led, mm = shm_ledger
    pid, go = _hold_in_child(mm)
    got = threading.Event()
    result: list = []

    def take() -> None:  # the mutex belongs to a thread: this one takes and releases it
        result.append(led._lock.acquire())
        result.append(int(led._w[L.H_HOLDER_PID]))
        led._lock.release()
        result.append(int(led._w[L.H_HOLDER_PID]))
        got.set()

    t = threading.Thread(target=take)
    try:
        t.start()
        # The waiting thread has released the GIL: this thread keeps running Python, and the
        # lock is still the child's.
        spins = 0
        while spins < 200_000:
            spins += 1
        assert not got.is_set()
    finally:
        os.write(go, b"x")
        os.close(go)
        os.waitpid(pid, 0)
    assert got.wait(30)
    t.join()
    assert result == [None, os.getpid(), 0]


def test_a_holder_killed_during_the_wait_hands_over_with_its_pid(shm_ledger, wait_mode) -> None:
    led, mm = shm_ledger
    levels, _ = led.configure([LevelSpec("a", 4, 1, 10, 2)], [], 0)
    pid, go = _hold_in_child(mm)
    result: list = []

    def take() -> None:
        result.append(led._lock.acquire())
        led._lock.consistent()
        led._lock.release()

    t = threading.Thread(target=take)
    t.start()
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    finally:
        os.close(go)
    t.join(30)
    assert result == [pid]  # EOWNERDEAD: held, and the dead holder's pid for the repair
    assert led.admit(levels["a"], 1, 1, 0, 0, 0, 1).outcome == EXECUTE
    assert verify(led) == []


def test_wait_unlocked_leaves_a_free_mutex_free(shm_ledger) -> None:
    from apf_gunicorn.ledger import lock as lock_mod

    if lock_mod._WAIT_UNLOCKED is None:
        pytest.skip("C accelerator not built or switched off")
    led, mm = shm_ledger
    lock = led._lock
    assert lock_mod._WAIT_UNLOCKED(lock._addr) == 0
    assert lock._trylock(lock._ref) == 0  # not held by the wait: trylock takes it
    assert lock._unlock(lock._ref) == 0
