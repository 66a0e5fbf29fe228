"""The Python fast paths against the general path: same operations, byte-identical ledgers.

``fastpath.py`` computes admit-at-once and the plain finish in locals and writes the records
back in one go; the general path (``requestpath.py`` and the dispatch policy) does the same
as Kubernetes does it: enqueue, then dispatch; finish, release the seats, remove an emptied
queue. Here one pure-Python ledger runs with its fast paths and another with them forced off,
on the same random operation streams, and every result and the whole buffer must agree after
every operation. The one area allowed to differ is the undo log's stale pairs (an event logs
its words in another order on each path; they count only while ``H_UNDO_N`` says so, and that
word is compared). ``test_ledger_accelerator.py`` checks the C paths against these.
"""

from __future__ import annotations

import random

import pytest

from apf_gunicorn.ledger import EXECUTE, QUEUED, Capacity, Ledger, LevelSpec, verify
from apf_gunicorn.ledger import layout as L
from apf_gunicorn.ledger.seatseconds import HIGH_R

CAP = Capacity(levels=4, queues=256, slots=96, workers=4, flow_schemas=4, detail_bytes=24,
               stats_entries=16)


class GeneralPathLedger(Ledger):
    """Every admit and finish by the general path: the Python fast paths forced off."""

    def _admit_locked(self, dead, level, flow_hash, initial, final, al, owner, now, fs_index,
                      detail, watch):
        granted = self._begin_locked(dead, now)
        try:
            res = self._admit_slow_locked(level, flow_hash, initial, final, al, owner, now,
                                          fs_index, detail, granted, 1 if watch else 0)
        except BaseException:
            self._abort_locked()
            raise
        self._end_locked()
        return res

    def _finish_locked(self, dead, slot, gen, now):
        granted = self._begin_locked(dead, now)
        try:
            linger = self._finish_slow_locked(slot, gen, now, granted)
        except BaseException:
            self._abort_locked()
            raise
        self._end_locked()
        return granted, linger


class _GeneralCalls:
    """Counts the fast ledger's operations that went to the general path."""

    def __init__(self, led: Ledger) -> None:
        self.admits = self.finishes = 0
        admit, finish = led._admit_slow_locked, led._finish_slow_locked

        def a(*args):
            self.admits += 1
            return admit(*args)

        def f(*args):
            self.finishes += 1
            return finish(*args)

        led._admit_slow_locked = a
        led._finish_slow_locked = f


def _pair(learn: bool) -> tuple[Ledger, Ledger]:
    return tuple(cls.create(bytearray(cls.size(CAP)), CAP, accelerate=False, learn_service=learn)
                 for cls in (Ledger, GeneralPathLedger))


def _same(a: Ledger, b: Ledger, what: str) -> None:
    lay = a._lay
    undo = slice(lay.undo_base * 8, (lay.undo_base + 2 * L.UNDO_PAIRS) * 8)
    ma, mb = bytearray(a._mv), bytearray(b._mv)
    ma[undo] = mb[undo] = b""
    if ma != mb:
        wa, wb = a._w, b._w
        diff = [i for i in range(len(wa)) if wa[i] != wb[i]
                and not lay.undo_base <= i < lay.undo_base + 2 * L.UNDO_PAIRS][:8]
        raise AssertionError(f"buffers differ after {what}: words {diff} "
                             f"{[(wa[i], wb[i]) for i in diff]}")
    assert a._w[L.H_UNDO_N] == b._w[L.H_UNDO_N] == 0


@pytest.mark.parametrize("fairness", ["kubernetes", "maxmin", "mixed"])
@pytest.mark.parametrize("seed", range(12))
def test_python_fast_paths_leave_what_the_general_path_leaves(seed: int, fairness: str) -> None:
    """``fairness``: the queuing levels' dispatch policy; ``mixed``: level a kubernetes, b
    switching between the two at reconfigurations."""
    rnd = random.Random(seed)
    learn = seed % 4 >= 2  # levels learn their service estimate (G) from finished requests
    fast, general = _pair(learn)
    assert not fast.accelerated and not general.accelerated
    calls = _GeneralCalls(fast)
    light = seed % 2  # light load: most requests run at once (the fast paths' own cases)
    c = rnd.randint(30, 60) if light else rnd.randint(2, 12)
    fa = "kubernetes" if fairness == "mixed" else fairness
    fb = "maxmin" if fairness == "mixed" else fairness
    specs = [LevelSpec("a", rnd.choice([1, 4, 16]), 1, 6, c, fa),
             LevelSpec("b", 8, rnd.randint(1, 4), 4, c // 2 + 1, fb),
             LevelSpec("x", -1, 0, 0, 0),
             LevelSpec("r", 0, 0, 0, 3)]
    now = rnd.randint(0, 10**12)
    ids = [led.configure(specs, ["fs0", "fs1", "fs2"], now) for led in (fast, general)]
    assert ids[0] == ids[1]
    levels = list(ids[0][0].values())
    if seed % 3 == 0:  # R just below the epoch advance: the fast admit syncs by the general code
        r = HIGH_R - rnd.randint(0, 5_000_000_000)
        for led in (fast, general):
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
            initial = rnd.choice([1, 1, 1, 1, 2, 3, 20, 70])
            final = rnd.choice([0, 0, 0, 0, 1, 2, 40, 120])
            al = rnd.choice([0, 0, 0, 5_000_000]) if final else 0
            args = (rnd.choice(levels), rnd.choice(hashes), initial, final, al,
                    rnd.randint(0, 3), now, rnd.randint(0, 3), rnd.randbytes(rnd.randint(0, 40)),
                    rnd.random() < 0.1)
            got = [led.admit(*args) for led in (fast, general)]
            admits += 1
            assert got[0] == got[1]
            if got[0].outcome in (EXECUTE, QUEUED):
                live.append((got[0].slot, got[0].gen))
        elif op < 0.85:
            slot, gen = live.pop(rnd.randrange(len(live)))
            got = [led.finish(slot, gen, now) for led in (fast, general)]
            finishes += 1
            assert got[0] == got[1]
            if got[0][1]:
                got = [led.release(slot, gen, got[0][1]) for led in (fast, general)]
                assert got[0] == got[1]
            got = [led.cancel(slot, gen, now, "time-out") for led in (fast, general)]
            assert got[0] == got[1]
        elif op < 0.9:
            slot, gen = rnd.choice(live)
            got = [led.finish(slot, gen + 1, now) for led in (fast, general)]  # stale gen
            assert got[0] == got[1]
        elif op < 0.95 and step % 7 == 0:  # reconfigure: queue counts change by attrition
            specs[1] = specs[1]._replace(desired_queues=rnd.choice([4, 8, 16]),
                                         concurrency_limit=rnd.randint(1, 8))
            if fairness == "mixed":
                specs[1] = specs[1]._replace(fairness=rnd.choice(["kubernetes", "maxmin"]))
            got = [led.configure(specs, ["fs0", "fs1", "fs2"], now) for led in (fast, general)]
            assert got[0] == got[1]
        else:
            lim = rnd.randint(1, 12)
            got = [led.set_limits({levels[0]: lim}, now) for led in (fast, general)]
            assert got[0] == got[1]
        _same(fast, general, f"step {step}")
    for led in (fast, general):
        assert verify(led) == []
    # both paths ran in the fast ledger: its fast paths completed a share of the operations
    assert 0 < calls.admits < admits and 0 < calls.finishes < finishes, (
        calls.admits, admits, calls.finishes, finishes)
