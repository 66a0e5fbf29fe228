"""``maxmin``'s order of backlogged flows: a pairing heap per level, and the parked list.

The heap is intrusive (``F_CHILD``, ``F_NEXT``, ``F_PREV`` of each flow entry; the root in the
level's maxmin words), keyed by ``(start tag, seats held, backlog sequence)``, a strict total
order, so its shape never changes which flow comes first: insert O(1), delete-min and delete
O(log n) amortised. Parked flows (new flows at their equal share, docs/fairness.md rule 5) wait
on a FIFO beside it. ``FlowHeap`` is a mixin of
:class:`~apf_gunicorn.ledger.maxmin.MaxMinFairness`; everything runs under the ledger lock. On an
accelerated ledger ``_heap_insert``,
``_heap_remove`` and ``_heap_decrease`` are the C ones (``mm_heap_*`` in ``_fastpath.c``, the
same words; ``FastPaths._accelerate`` binds them), and these methods are the pure-Python path.
"""

from __future__ import annotations

from apf_gunicorn.ledger.layout import (
    F_CHILD,
    F_NEXT,
    F_PREV,
    F_SEATS,
    F_SEQ,
    F_TAG,
    F_WHERE,
    FLOW_WORDS,
    FW_HEAP,
    FW_NOWHERE,
    FW_PARKED,
    M_PARK_HEAD,
    M_PARK_TAIL,
    M_RESERVE,
    M_ROOT,
    NIL,
)
from apf_gunicorn.ledger.seatseconds import U64

# Tags are uint64 seat-ns compared by signed difference: a precedes b when (a - b) mod 2^64 >= HALF.
HALF = 1 << 63


class FlowHeap:
    """The pairing heap of backlogged flows and the parked list (mixin)."""

    # -- the pairing heap ---------------------------------------------------------------------
    def _less(self, a: int, b: int) -> bool:
        """Flow ``a`` before flow ``b``: smaller tag, then fewer seats held, then longer
        backlogged."""
        w, u = self._w, self._u
        fa, fb = self._fa(a), self._fa(b)
        ta, tb = u[fa + F_TAG], u[fb + F_TAG]
        if ta != tb:
            return ((ta - tb) & U64) >= HALF
        sa, sb = w[fa + F_SEATS], w[fb + F_SEATS]
        if sa != sb:
            return sa < sb
        return w[fa + F_SEQ] < w[fb + F_SEQ]

    def _meld(self, a: int, b: int) -> int:
        """The heap of roots ``a`` and ``b``: the loser becomes the winner's first child."""
        if a == NIL:
            return b
        if b == NIL:
            return a
        if self._less(b, a):
            a, b = b, a
        w = self._w
        fb = self._fb
        aa, ba = fb + a * FLOW_WORDS, fb + b * FLOW_WORDS
        c = w[aa + F_CHILD]
        w[ba + F_NEXT] = c
        if c != NIL:
            w[fb + c * FLOW_WORDS + F_PREV] = b
        w[ba + F_PREV] = a
        w[aa + F_CHILD] = b
        return a

    def _merge_pairs(self, first: int) -> int:
        """Two-pass pairing of a sibling list (links through ``F_NEXT``): meld pairs left to
        right, then the results right to left. Returns the new root.

        Links are written only where they survive: each node's ``F_NEXT`` and ``F_PREV`` are
        set by the meld that makes it a child, the result's ``F_PREV`` by the caller. (On an
        accelerated ledger the heap operations that call this are C: ``mm_merge_pairs``.)"""
        w = self._w
        fb = self._fb
        meld = self._meld
        acc = NIL
        x = first
        while x != NIL:
            b = w[fb + x * FLOW_WORDS + F_NEXT]
            if b != NIL:
                nxt = w[fb + b * FLOW_WORDS + F_NEXT]
                a = meld(x, b)
            else:
                a, nxt = x, NIL
            w[fb + a * FLOW_WORDS + F_NEXT] = acc
            acc = a
            x = nxt
        meld = self._meld
        res = NIL
        while acc != NIL:
            aa = fb + acc * FLOW_WORDS
            nxt = w[aa + F_NEXT]
            w[aa + F_NEXT] = NIL
            res = meld(res, acc)
            acc = nxt
        return res

    def _heap_insert(self, mm: int, f: int) -> None:
        w = self._w
        fa = self._fa(f)
        w[fa + F_CHILD] = NIL
        w[fa + F_NEXT] = NIL
        w[fa + F_PREV] = NIL
        w[fa + F_WHERE] = FW_HEAP
        w[mm + M_ROOT] = self._meld(w[mm + M_ROOT], f)

    def _heap_remove(self, mm: int, f: int) -> None:
        w = self._w
        fa = self._fa(f)
        if f == w[mm + M_ROOT]:
            root = self._merge_pairs(w[fa + F_CHILD])
            if root != NIL:
                w[self._fa(root) + F_PREV] = NIL
            w[mm + M_ROOT] = root
        else:
            self._cut(fa)
            sub = self._merge_pairs(w[fa + F_CHILD])
            if sub != NIL:
                w[self._fa(sub) + F_PREV] = NIL
            w[mm + M_ROOT] = self._meld(w[mm + M_ROOT], sub)
        w[fa + F_CHILD] = NIL
        w[fa + F_NEXT] = NIL
        w[fa + F_PREV] = NIL
        w[fa + F_WHERE] = FW_NOWHERE

    def _cut(self, fa: int) -> None:
        """Take the subtree of the entry at ``fa`` (not the root) out of its parent's
        child list; its own ``F_NEXT`` and ``F_PREV`` are left for the caller."""
        w = self._w
        fb = self._fb
        f = (fa - fb) // FLOW_WORDS
        p, n = w[fa + F_PREV], w[fa + F_NEXT]
        pa = fb + p * FLOW_WORDS
        if w[pa + F_CHILD] == f:
            w[pa + F_CHILD] = n
        else:
            w[pa + F_NEXT] = n
        if n != NIL:
            w[fb + n * FLOW_WORDS + F_PREV] = p

    def _heap_decrease(self, mm: int, f: int) -> None:
        """Flow ``f``'s key fell (it stays in the heap): its subtree, still in order below it,
        is cut and melded with the root (the pairing heap's decrease-key)."""
        w = self._w
        root = w[mm + M_ROOT]
        if f == root:
            return
        fa = self._fb + f * FLOW_WORDS
        self._cut(fa)
        w[fa + F_NEXT] = NIL
        w[fa + F_PREV] = NIL
        w[mm + M_ROOT] = self._meld(root, f)

    def heap_flows_locked(self, lb: int) -> list[int]:
        """The level's backlogged flows in the heap (a walk; the blocked case and dumps)."""
        w = self._w
        root = w[self._mm(lb) + M_ROOT]
        out, stack = [], [root] if root != NIL else []
        while stack:
            x = stack.pop()
            out.append(x)
            c = w[self._fa(x) + F_CHILD]
            while c != NIL:
                stack.append(c)
                c = w[self._fa(c) + F_NEXT]
        return out

    def parked_flows_locked(self, lb: int) -> list[int]:
        w = self._w
        out, p = [], w[self._mm(lb) + M_PARK_HEAD]
        while p != NIL:
            out.append(p)
            p = w[self._fa(p) + F_NEXT]
        return out

    # -- parked flows -------------------------------------------------------------------------
    def _park(self, mm: int, f: int) -> None:
        w = self._w
        fa = self._fa(f)
        tail = w[mm + M_PARK_TAIL]
        w[fa + F_WHERE] = FW_PARKED
        w[fa + F_NEXT] = NIL
        w[fa + F_PREV] = tail
        if tail == NIL:
            w[mm + M_PARK_HEAD] = f
        else:
            w[self._fa(tail) + F_NEXT] = f
        w[mm + M_PARK_TAIL] = f

    def _unpark(self, mm: int, f: int) -> None:
        w = self._w
        fa = self._fa(f)
        p, n = w[fa + F_PREV], w[fa + F_NEXT]
        if p == NIL:
            w[mm + M_PARK_HEAD] = n
        else:
            w[self._fa(p) + F_NEXT] = n
        if n == NIL:
            w[mm + M_PARK_TAIL] = p
        else:
            w[self._fa(n) + F_PREV] = p
        w[fa + F_NEXT] = NIL
        w[fa + F_PREV] = NIL
        w[fa + F_WHERE] = FW_NOWHERE

    def _unlist(self, mm: int, f: int) -> None:
        """The flow has nothing waiting any more: out of the heap or the parked list."""
        where = self._w[self._fa(f) + F_WHERE]
        if where == FW_HEAP:
            self._heap_remove(mm, f)
        elif where == FW_PARKED:
            self._unpark(mm, f)
        if self._w[mm + M_RESERVE] == f:
            self._w[mm + M_RESERVE] = NIL
