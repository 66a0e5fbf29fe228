"""The Python fast paths against the general path: same operations, byte-identical ledgers.

``fastpath.py`` computes admit-at-once and the plain finish in locals and writes the records
back in one go; the general path (``requestpath.py`` and the fairness) does the same
as Kubernetes does it: enqueue, then dispatch; finish, release the seats, remove an emptied
queue. Here one pure-Python ledger runs with its fast paths and another with them forced off,
on the same random operation streams, and every result and the whole buffer must agree after
every operation. The one area allowed to differ is the undo log's stale pairs (an event logs
its words in another order on each path; they count only while ``H_UNDO_N`` says so, and that
word is compared). ``test_ledger_accelerator.py`` checks the C paths against these.
"""

from __future__ import annotations

import pytest

from apf_gunicorn.ledger import Capacity, Ledger
from apf_gunicorn.ledger import layout as L
from tests.ledger_streams import WIDE, Counted, drive

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
    """``fairness``: the queuing levels' fairness (``mixed``: see ``drive``)."""
    learn = seed % 4 >= 2  # levels learn their service estimate (G) from finished requests
    fast, general = _pair(learn)
    assert not fast.accelerated and not general.accelerated
    calls = Counted(fast, "_admit_slow_locked", "_finish_slow_locked")  # the general path
    _levels, admits, finishes = drive(seed, (fast, general), _same, WIDE, fairness=fairness)
    # both paths ran in the fast ledger: its fast paths completed a share of the operations
    assert 0 < calls.admits < admits and 0 < calls.finishes < finishes, (
        calls.admits, admits, calls.finishes, finishes)
