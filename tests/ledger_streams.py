"""Random operation streams for differential tests of two ledgers that must stay identical.

``test_ledger_accelerator.py`` (C against Python) and ``test_ledger_fastpath.py`` (the Python
fast paths against the general path) drive a pair of ledgers with the same stream and compare
every result and, through ``same``, the buffers after every operation::

    levels, admits, finishes = drive(seed, (a, b), same)

A stream (from ``seed``) covers every way out of the fast paths: queuing, final seats,
lingering, several active queues, long and huge time steps, an R near the epoch advance
(``seed % 3 == 0``), reconfiguration with queues removed by attrition, limit changes, stale and
cancelled slots; ``seed % 2`` selects a light load, where most requests run at once.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from apf_gunicorn.ledger import EXECUTE, QUEUED, Ledger, LevelSpec, verify
from apf_gunicorn.ledger import layout as L
from apf_gunicorn.ledger.seatseconds import HIGH_R

NARROW = ([1, 1, 1, 1, 2, 3, 20], [0, 0, 0, 0, 1, 2, 40])  # initial, final seat choices
WIDE = ([1, 1, 1, 1, 2, 3, 20, 70], [0, 0, 0, 0, 1, 2, 40, 120])  # wider than every limit too


class Counted:
    """Counts the calls of two of a ledger's methods (wrapped as instance attributes, so the
    ledger's own calls through ``self`` see the wrappers)::

        counted = Counted(led, "_admit_locked", "_finish_locked")   # the C hand-overs
        counted.admits, counted.finishes
    """

    def __init__(self, led: Ledger, admit: str, finish: str) -> None:
        self.admits = self.finishes = 0
        admit_fn, finish_fn = getattr(led, admit), getattr(led, finish)

        def a(*args):
            self.admits += 1
            return admit_fn(*args)

        def f(*args):
            self.finishes += 1
            return finish_fn(*args)

        setattr(led, admit, a)
        setattr(led, finish, f)


def drive(seed: int, pair: tuple[Ledger, Ledger], same: Callable[[Ledger, Ledger, str], None],
          seats: tuple[list[int], list[int]] = NARROW, steps: int = 700,
          fairness: str = "kubernetes") -> tuple[list[int], int, int]:
    """Run the stream of ``seed`` on both ledgers of ``pair`` (freshly created, same capacity),
    asserting equal results after every operation and calling ``same(a, b, what)``; then
    :func:`verify` both. ``fairness``: the queuing levels' fairness, or ``"mixed"``:
    level a ``kubernetes``, level b switching between the two at reconfigurations. Returns
    (the level indices, admits, finishes)."""
    rnd = random.Random(seed)
    a, b = pair
    light = seed % 2
    c = rnd.randint(30, 60) if light else rnd.randint(2, 12)
    fa = "kubernetes" if fairness == "mixed" else fairness
    fb = "maxmin" if fairness == "mixed" else fairness
    specs = [LevelSpec("a", rnd.choice([1, 4, 16]), 1, 6, c, fa),
             LevelSpec("b", 8, rnd.randint(1, 4), 4, c // 2 + 1, fb),
             LevelSpec("x", -1, 0, 0, 0),
             LevelSpec("r", 0, 0, 0, 3)]
    now = rnd.randint(0, 10**12)
    ids = [led.configure(specs, ["fs0", "fs1", "fs2"], now) for led in pair]
    assert ids[0] == ids[1]
    levels = list(ids[0][0].values())
    if seed % 3 == 0:  # R just below the epoch advance: the fast paths must hand it over
        r = HIGH_R - rnd.randint(0, 5_000_000_000)
        for led in pair:
            led._u[led._lb(levels[0]) + L.L_R] = r
    live: list = []  # (slot, gen)
    hashes = [rnd.getrandbits(64) for _ in range(rnd.randint(1, 9))]
    admits = finishes = 0
    for step in range(steps):
        now += rnd.choice([0, 1, 999, 3_000_000, 250_000_000, 999_999_999, 1_000_000_001,
                           3 * 10**9, 10**15])
        op = rnd.random()
        if light:
            op *= 0.9  # admits and finishes only
        if op < 0.5 or not live:
            initial = rnd.choice(seats[0])
            final = rnd.choice(seats[1])
            al = rnd.choice([0, 0, 0, 5_000_000]) if final else 0
            args = (rnd.choice(levels), rnd.choice(hashes), initial, final, al,
                    rnd.randint(0, 3), now, rnd.randint(0, 3), rnd.randbytes(rnd.randint(0, 40)),
                    rnd.random() < 0.1)
            got = [led.admit(*args) for led in pair]
            admits += 1
            assert got[0] == got[1]
            assert type(got[0]) is type(got[1])
            if got[0].outcome in (EXECUTE, QUEUED):
                live.append((got[0].slot, got[0].gen))
            for s, g, _owner in got[0].granted:
                assert (s, g) in live
        elif op < 0.85:
            slot, gen = live.pop(rnd.randrange(len(live)))
            got = [led.finish(slot, gen, now) for led in pair]
            finishes += 1
            assert got[0] == got[1]
            if got[0][1]:
                got = [led.release(slot, gen, got[0][1]) for led in pair]
                assert got[0] == got[1]
            # a finish of a still-waiting slot is a stale no-op on both; cancel it instead
            got = [led.cancel(slot, gen, now, "time-out") for led in pair]
            assert got[0] == got[1]
        elif op < 0.9:
            slot, gen = rnd.choice(live)
            got = [led.finish(slot, gen + 1, now) for led in pair]  # stale gen
            assert got[0] == got[1]
        elif op < 0.95 and step % 7 == 0:  # reconfigure: queue counts change by attrition
            specs[1] = specs[1]._replace(desired_queues=rnd.choice([4, 8, 16]),
                                         concurrency_limit=rnd.randint(1, 8))
            if fairness == "mixed":
                specs[1] = specs[1]._replace(fairness=rnd.choice(["kubernetes", "maxmin"]))
            got = [led.configure(specs, ["fs0", "fs1", "fs2"], now) for led in pair]
            assert got[0] == got[1]
        else:
            lim = rnd.randint(1, 12)
            got = [led.set_limits({levels[0]: lim}, now) for led in pair]
            assert got[0] == got[1]
        same(a, b, f"step {step}")
    for led in pair:
        assert verify(led) == []
    return levels, admits, finishes
