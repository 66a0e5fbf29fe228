"""``Ledger.snapshot``: the lock is held only to copy words, and the view built from the copy
is the one built under the lock (records and dump text alike)."""

from __future__ import annotations

import sys

import pytest

from apf_gunicorn.ledger import Capacity, Ledger, LevelSpec, NullLock
from apf_gunicorn.server.dumps import dump_flows, dump_priority_levels, dump_queues, dump_requests
from tests.ledger_streams import WIDE, drive

CAP = Capacity(levels=4, queues=256, slots=96, workers=4, flow_schemas=4, detail_bytes=24,
               stats_entries=16)


class RecordingLock(NullLock):
    """Counts the Python function calls made while it is held (``sys.setprofile``)."""

    def __init__(self) -> None:
        self.held = False
        self.calls_held: list[str] = []

    def acquire(self):
        self.held = True
        return None

    def release(self) -> None:
        self.held = False

    def watch(self, fn):
        def profile(frame, event, _arg):
            if event == "call" and self.held:
                self.calls_held.append(frame.f_code.co_name)
        sys.setprofile(profile)
        try:
            return fn()
        finally:
            sys.setprofile(None)


def _busy_ledger(requests: int) -> tuple[Ledger, RecordingLock]:
    cap = Capacity(levels=4, queues=64, slots=512, workers=4, flow_schemas=4, detail_bytes=32,
                   stats_entries=16)
    lock = RecordingLock()
    led = Ledger.create(bytearray(Ledger.size(cap)), cap, lock=lock, accelerate=False)
    levels, _ = led.configure([LevelSpec("k", 16, 4, 100, 8, "kubernetes"),
                               LevelSpec("m", 16, 4, 100, 8, "maxmin")], ["fs"], 0)
    for i in range(requests):
        led.admit(levels["k" if i % 2 else "m"], i % 37, 1, 0, 0, 0, 1000 + i,
                  detail=b"user-%d" % i)
    return led, lock


@pytest.mark.parametrize("requests", [10, 200])
def test_the_lock_is_held_to_copy_words_not_to_build_records(requests: int) -> None:
    """Under the lock: the lock funnel and one copy, the same few calls however many requests
    are in flight; every record is built after the lock is released."""
    led, lock = _busy_ledger(requests)
    snap = lock.watch(lambda: led.snapshot(5000))
    assert sum(len(lv.requests) for lv in snap.levels) == requests
    assert not {"__new__", "_snapshot_locked", "flow_state_locked"} & set(lock.calls_held), \
        lock.calls_held
    assert len(lock.calls_held) <= 8, lock.calls_held


def _dumps(snap) -> list[str]:
    return [dump_priority_levels(snap, include_fairness=True),
            dump_queues(snap, include_fairness=True),
            dump_requests(snap, include_details=True), dump_flows(snap)]


@pytest.mark.parametrize("fairness", ["kubernetes", "maxmin", "mixed"])
@pytest.mark.parametrize("seed", range(4))
def test_the_copy_gives_the_snapshot_and_dumps_taken_under_the_lock(seed: int,
                                                                  fairness: str) -> None:
    """After every operation of a random stream (queuing, lingering, reconfiguration, maxmin
    flows parked and reserved), the snapshot from the copy equals the one built on the live
    buffer under the lock, and so do the four dumps."""
    led = Ledger.create(bytearray(Ledger.size(CAP)), CAP)
    twin = Ledger.create(bytearray(Ledger.size(CAP)), CAP)
    seen = {"checked": 0, "requests": 0, "details": 0, "flows": 0}

    def same(a: Ledger, _b: Ledger, what: str) -> None:
        copied = a.snapshot(123)
        live = a._locked(123, a._snapshot_locked, 123)
        assert copied == live, what
        assert _dumps(copied) == _dumps(live), what
        seen["checked"] += 1
        for lv in copied.levels:
            seen["requests"] += len(lv.requests)
            seen["details"] += sum(1 for r in lv.requests if r.detail)
            seen["flows"] += len(lv.maxmin["flows"]) if lv.maxmin else 0

    drive(seed, (led, twin), same, WIDE, steps=250, fairness=fairness)
    assert seen["checked"] > 200 and seen["requests"] > 200 and seen["details"] > 0, seen
    assert (seen["flows"] > 0) == (fairness != "kubernetes"), seen
