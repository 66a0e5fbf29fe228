"""The per-level min-segment tree of queue head virtual finishes (Kubernetes' dispatch index).

Kubernetes scans every queue for the minimum virtual finish at each dispatch; the ledger keeps,
per level, a segment tree over queue indices whose leaves hold each queue head's virtual
finish (``nextDispatchR`` + the head's work; ``U64`` for an empty queue) and whose nodes hold
the minimum, so a dispatch is O(log queues). ``_first_le_locked`` finds the first leaf at or
after an index holding a value at or below a target, which gives Kubernetes' round-robin tie
break from ``robinIndex + 1``. The fairness (``queueset.py``) keeps the leaves current;
``_rebuild_tree_locked`` recomputes a level's tree from its queues (relayout, repair)::

    led._set_leaf_locked(lb, q, head_finish)
    q = led._first_le_locked(tb, p, (robin + 1) % nq, best)
"""

from __future__ import annotations

from apf_gunicorn.ledger.layout import (
    L_NQ,
    L_TBASE,
    L_TP,
    Q_HEAD,
    Q_NDR,
    Q_WAITING,
    S_TOTAL_WORK,
)
from apf_gunicorn.ledger.seatseconds import U64


def next_pow2(n: int) -> int:
    """The tree's leaf count for ``n`` queues: the least power of two at or above ``n``."""
    p = 1
    while p < n:
        p <<= 1
    return p


class MinTree:
    """Leaves: each queue head's virtual finish (U64 when empty); nodes: the minimum."""

    def _set_leaf_locked(self, lb: int, q: int, value: int) -> None:
        u = self._u
        w = self._w
        tb = w[lb + L_TBASE]
        i = w[lb + L_TP] + q
        if u[tb + i] == value:
            return
        u[tb + i] = value
        i >>= 1
        while i:
            a = u[tb + 2 * i]
            b = u[tb + 2 * i + 1]
            m = a if a <= b else b
            if u[tb + i] == m:
                break
            u[tb + i] = m
            i >>= 1

    def _first_le_locked(self, tb: int, p: int, lo: int, target: int) -> int:
        """First leaf index >= lo whose value is <= target, or -1."""
        u = self._u
        i = lo + p
        while u[tb + i] > target:
            while i & 1:
                i >>= 1
            if i == 0:
                return -1
            i += 1
        while i < p:
            i <<= 1
            if u[tb + i] > target:
                i += 1
        return i - p

    def _leaf_value_locked(self, lb: int, q: int) -> int:
        w = self._w
        qa = self._qa(lb, q)
        if w[qa + Q_WAITING] == 0:
            return U64
        head = w[qa + Q_HEAD]
        return (self._u[qa + Q_NDR] + self._u[self._sa(head) + S_TOTAL_WORK]) & U64

    def _rebuild_tree_locked(self, lb: int) -> None:
        w, u = self._w, self._u
        tb = w[lb + L_TBASE]
        p = w[lb + L_TP]
        if p == 0:  # a level that never had queues has no tree
            return
        nq = w[lb + L_NQ]
        for i in range(p):
            u[tb + p + i] = self._leaf_value_locked(lb, i) if i < nq else U64
        for i in range(p - 1, 0, -1):
            a = u[tb + 2 * i]
            b = u[tb + 2 * i + 1]
            u[tb + i] = a if a <= b else b
        u[tb] = U64
