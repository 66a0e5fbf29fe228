"""``maxmin``'s flow table: one entry per active (or recently idle) flow.

Entries are keyed by (level, flow hash) through an open-addressing index (twice the entries,
linear probing, backward-shift deletion; ``flow_mix`` spreads a level's flows over it). The
table has as many entries as the slot table, since every active flow holds a slot; an entry
whose flow goes idle keeps its tag and learnt estimate on a least-recently-idle list until the
table needs it. ``FlowTable`` is a mixin of
:class:`~apf_gunicorn.ledger.maxmin.MaxMinFairness` (it uses the buffer views that class sets
up); everything runs under the ledger lock. On an accelerated ledger ``_get`` is the C one
(``mm_get`` in ``_fastpath.c``, the same words).
"""

from __future__ import annotations

from functools import lru_cache

from apf_gunicorn.ledger.layout import (
    F_CHILD,
    F_EST,
    F_EXEC,
    F_HASH,
    F_HEAD,
    F_LEVEL,
    F_N,
    F_NEXT,
    F_PACE,
    F_PREV,
    F_SEATS,
    F_SEQ,
    F_TAG,
    F_TAIL,
    F_WAITING,
    F_WHERE,
    FH_EVICTIONS,
    FH_FREE,
    FH_IDLE_HEAD,
    FH_IDLE_TAIL,
    FLOW_WORDS,
    FW_IDLE,
    FW_NOWHERE,
    LEVEL_WORDS,
    M_NFLOWS,
    M_PARK_HEAD,
    M_PARK_TAIL,
    M_RESERVE,
    M_ROOT,
    M_V,
    MM_WORDS,
    NIL,
    X_FLOW,
    X_FNEXT,
    X_FPREV,
    XSLOT_WORDS,
)
from apf_gunicorn.ledger.seatseconds import U64


@lru_cache(maxsize=65536)
def flow_mix(level: int, flow_hash: int) -> int:
    """Where a flow's search starts in the index: a 64-bit mix of (level, hash) (the
    splitmix64 finaliser), so that flows of one level spread over the whole index. Cached:
    flows repeat, and the mix is pure (``mm_mix`` in ``_fastpath.c`` computes the same)."""
    x = (flow_hash ^ (level * 0x9E3779B97F4A7C15)) & U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & U64
    return x ^ (x >> 31)


class FlowTable:
    """The flow table's addressing, formatting, lookup, index and idle list (mixin)."""

    # -- addressing ---------------------------------------------------------------------------
    def _mm(self, lb: int) -> int:
        """The level's maxmin words, from its record's address."""
        return self._mb + (lb - self._lvb) // LEVEL_WORDS * MM_WORDS

    def _fa(self, f: int) -> int:
        return self._fb + f * FLOW_WORDS

    def _xa(self, s: int) -> int:
        return self._xb + s * XSLOT_WORDS

    # -- formatting ---------------------------------------------------------------------------
    def format_locked(self) -> None:
        """A new ledger: every flow entry free, every level's lists empty."""
        w = self._w
        n = self._nslots
        for f in range(n):
            fa = self._fa(f)
            w[fa + F_LEVEL] = NIL
            w[fa + F_NEXT] = f + 1 if f + 1 < n else NIL
            w[fa + F_PREV] = NIL
            w[fa + F_CHILD] = NIL
            w[fa + F_HEAD] = NIL
            w[fa + F_TAIL] = NIL
        w[self._fh + FH_FREE] = 0
        w[self._fh + FH_IDLE_HEAD] = NIL
        w[self._fh + FH_IDLE_TAIL] = NIL
        for s in range(n):
            xa = self._xa(s)
            w[xa + X_FLOW] = NIL
            w[xa + X_FPREV] = NIL
            w[xa + X_FNEXT] = NIL
        for level in range(self._nlevels):
            self.reset_level_locked(self._lvb + level * LEVEL_WORDS)

    def reset_level_locked(self, lb: int) -> None:
        """The level's maxmin words empty (V = 0, no heap, nothing parked or reserved)."""
        w = self._w
        mm = self._mm(lb)
        for i in range(MM_WORDS):
            w[mm + i] = 0
        w[mm + M_ROOT] = NIL
        w[mm + M_PARK_HEAD] = NIL
        w[mm + M_PARK_TAIL] = NIL
        w[mm + M_RESERVE] = NIL

    def purge_level_locked(self, level: int) -> None:
        """Level index ``level`` is (re)created or switched to maxmin: free every flow entry
        still keyed by it (left by an earlier level or fairness), and empty its words."""
        w = self._w
        for f in range(self._nslots):
            fa = self._fa(f)
            if w[fa + F_LEVEL] != level:
                continue
            if w[fa + F_WHERE] == FW_IDLE:
                self._idle_remove(f, fa)
            self._index_delete(f, fa)
            w[fa + F_LEVEL] = NIL
            w[fa + F_NEXT] = w[self._fh + FH_FREE]
            w[self._fh + FH_FREE] = f
        self.reset_level_locked(self._lvb + level * LEVEL_WORDS)

    # -- the flow table -----------------------------------------------------------------------
    def _find(self, level: int, h: int) -> int:
        w, u = self._w, self._u
        ib, mask = self._ib, self._mask
        i = flow_mix(level, h) & mask
        while True:
            e = w[ib + i]
            if e == 0:
                return NIL
            fa = self._fb + (e - 1) * FLOW_WORDS
            if u[fa + F_HASH] == h and w[fa + F_LEVEL] == level:
                return e - 1
            i = (i + 1) & mask

    def _get(self, mm: int, level: int, h: int) -> int:
        """The flow's entry, made active (found; else a free entry; else the least recently
        idle one, evicted: there is one, since active flows hold slots and one was just
        taken for this request)."""
        w, u = self._w, self._u
        f = self._find(level, h)
        if f != NIL:
            fa = self._fb + f * FLOW_WORDS
            if w[fa + F_WHERE] == FW_IDLE:
                self._idle_remove(f, fa)
                w[mm + M_NFLOWS] += 1
            return f
        fh = self._fh
        f = w[fh + FH_FREE]
        if f != NIL:
            fa = self._fa(f)
            w[fh + FH_FREE] = w[fa + F_NEXT]
        else:
            f = w[fh + FH_IDLE_HEAD]
            if f == NIL:
                raise AssertionError("maxmin: no flow entry to reuse")  # cannot happen
            fa = self._fa(f)
            self._idle_remove(f, fa)
            self._index_delete(f, fa)
            w[fh + FH_EVICTIONS] += 1
        w[fa + F_LEVEL] = level
        u[fa + F_HASH] = h
        u[fa + F_TAG] = u[mm + M_V]
        for field in (F_SEQ, F_WAITING, F_EXEC, F_SEATS, F_EST, F_N, F_PACE):
            w[fa + field] = 0
        for field in (F_HEAD, F_TAIL, F_CHILD, F_NEXT, F_PREV):
            w[fa + field] = NIL
        w[fa + F_WHERE] = FW_NOWHERE
        ib, mask = self._ib, self._mask
        i = flow_mix(level, h) & mask
        while w[ib + i]:
            i = (i + 1) & mask
        w[ib + i] = f + 1
        w[mm + M_NFLOWS] += 1
        return f

    def _index_delete(self, f: int, fa: int) -> None:
        """Take entry ``f`` out of the index (backward-shift deletion: no tombstones)."""
        w, u = self._w, self._u
        ib, mask = self._ib, self._mask
        i = flow_mix(w[fa + F_LEVEL], u[fa + F_HASH]) & mask
        while w[ib + i] != f + 1:
            i = (i + 1) & mask
        j = i
        while True:
            j = (j + 1) & mask
            e = w[ib + j]
            if e == 0:
                break
            ea = self._fb + (e - 1) * FLOW_WORDS
            home = flow_mix(w[ea + F_LEVEL], u[ea + F_HASH]) & mask
            if (j - home) & mask >= (j - i) & mask:  # its home is not in (i, j]: move it back
                w[ib + i] = e
                i = j
        w[ib + i] = 0

    def _idle(self, mm: int, f: int, fa: int) -> None:
        """Nothing waits or executes any more: onto the idle list, tag and estimate kept."""
        w = self._w
        fh = self._fh
        tail = w[fh + FH_IDLE_TAIL]
        w[fa + F_WHERE] = FW_IDLE
        w[fa + F_NEXT] = NIL
        w[fa + F_PREV] = tail
        if tail == NIL:
            w[fh + FH_IDLE_HEAD] = f
        else:
            w[self._fa(tail) + F_NEXT] = f
        w[fh + FH_IDLE_TAIL] = f
        w[mm + M_NFLOWS] -= 1

    def _idle_remove(self, f: int, fa: int) -> None:
        w = self._w
        fh = self._fh
        p, n = w[fa + F_PREV], w[fa + F_NEXT]
        if p == NIL:
            w[fh + FH_IDLE_HEAD] = n
        else:
            w[self._fa(p) + F_NEXT] = n
        if n == NIL:
            w[fh + FH_IDLE_TAIL] = p
        else:
            w[self._fa(n) + F_PREV] = p
        w[fa + F_NEXT] = NIL
        w[fa + F_PREV] = NIL
        w[fa + F_WHERE] = FW_NOWHERE

    def _rebuild_index(self) -> None:
        """The index from the entries (after a repair: an interrupted insert or delete)."""
        w, u = self._w, self._u
        ib, mask = self._ib, self._mask
        for i in range(mask + 1):
            w[ib + i] = 0
        for f in range(self._nslots):
            fa = self._fa(f)
            level = w[fa + F_LEVEL]
            if level == NIL:
                continue
            i = flow_mix(level, u[fa + F_HASH]) & mask
            while w[ib + i]:
                i = (i + 1) & mask
            w[ib + i] = f + 1
