"""Lock-free reads of the ledger from another process never see a torn value.

The fast paths rewrite a level's hot fields with ``struct.pack_into``, which zero-fills the
target before writing; a reader in another process (the Retry-After tracker reads each level's
rejection total without the lock) must never observe that window.
"""

from __future__ import annotations

import mmap
import os
import time
import uuid

import posix_ipc

from apf_gunicorn.ledger import Capacity, Ledger, LevelSpec, ProcessLock

CAP = Capacity(levels=2, queues=16, slots=64, workers=4, flow_schemas=2, detail_bytes=8)


def test_rejected_total_never_goes_backwards_while_another_process_runs_the_fast_path():
    name = f"/apf_test_lockfree_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    size = Ledger.size(CAP)
    seg = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=size)
    mm = mmap.mmap(seg.fd, size)
    seg.close_fd()
    led = None
    try:
        led = Ledger.create(mm, CAP, lock=ProcessLock())
        levels, _ = led.configure([LevelSpec("r", 0, 0, 0, 1)], ["fs"], 0)
        lvl = levels["r"]
        first = led.admit(lvl, 1, 1, 0, 0, 0, 1)  # holds the only seat
        for t in range(5):
            led.admit(lvl, 1, 1, 0, 0, 0, 2 + t)  # concurrency-limit rejections
        assert led.rejected_total(lvl) == 5
        led.finish(first.slot, first.gen, 10)

        pid = os.fork()
        if pid == 0:  # writer: fast-path cycles that rewrite the level's hot record
            code = 1
            try:
                child = Ledger.attach(mm, lock=ProcessLock())
                deadline = time.monotonic() + 1.5
                now = 100
                while time.monotonic() < deadline:
                    now += 1000
                    res = child.admit(lvl, 1, 1, 0, 0, 1, now)
                    child.finish(res.slot, res.gen, now + 10)
                code = 0
            finally:
                os._exit(code)
        seen_low = 0
        reads = 0
        try:
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                for _ in range(1000):
                    if led.rejected_total(lvl) != 5:
                        seen_low += 1
                reads += 1000
        finally:
            _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert reads > 10_000
        assert seen_low == 0, f"{seen_low} of {reads} lock-free reads saw a torn total"
    finally:
        posix_ipc.unlink_shared_memory(name)  # first: closing the mmap fails while views live
        if led is not None:
            led.close()
        mm.close()
