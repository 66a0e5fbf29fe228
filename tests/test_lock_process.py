"""ProcessLock on real POSIX shared memory: exclusion across processes and threads, and repair
after a holder is SIGKILLed while holding the robust mutex."""

from __future__ import annotations

import mmap
import os
import signal
import threading
import time
import uuid

import posix_ipc
import pytest

from apf_gunicorn.ledger import EXECUTE, Capacity, Ledger, LevelSpec, ProcessLock, verify
from apf_gunicorn.ledger import layout as L

CAP = Capacity(levels=2, queues=16, slots=64, workers=4, flow_schemas=2, detail_bytes=8)


@pytest.fixture
def shm_ledger():
    name = f"/apf_test_lock_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    size = Ledger.size(CAP)
    seg = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=size)
    mm = mmap.mmap(seg.fd, size)
    seg.close_fd()
    led = Ledger.create(mm, CAP, lock=ProcessLock())
    try:
        yield led, mm
    finally:
        led.close()
        mm.close()
        posix_ipc.unlink_shared_memory(name)
        assert not os.path.exists(f"/dev/shm{name}")


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
