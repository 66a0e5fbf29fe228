"""The ``maxmin`` dispatch policy: max-min fair between flows, work-conserving, bounded backfill.

``docs/fairness.md`` explains the policy and its bounds; ``tests/maxmin_model.py`` is its
reference model, and this module computes the same words (``tests/test_ledger_maxmin.py``).
In short, per level:

* admission is Kubernetes' (``queueset.py``'s shuffle sharding, queue-length limit and
  ``queue-full``), so the queues only decide who may wait;
* each active flow (a request waiting or executing) has an entry in the flow table with a
  start tag in seat-ns; a flow that starts waiting gets ``max(tag, V)``; the backlogged flow
  with the smallest ``(tag, seats held, backlog sequence)`` (a pairing heap per level) sends
  its oldest waiting request; its tag grows by ``held × (estimate + additional latency)`` and
  is corrected at the end of the main phase by ``held × (ran − estimate)``;
* a flow that has finished nothing yet holds at most its equal share while others wait
  (parked until its first completion);
* a head that does not fit is reserved; others run meanwhile only if, by the estimates, they
  end before it could start or use seats it will not need.

Everything runs under the ledger lock (``…_locked``); the ledger reaches this class through
``Ledger._policy_locked`` for levels whose ``L_FAIRNESS`` is ``FAIRNESS_MAXMIN``. The fast paths
(``fastpath.py``, and ``mm_at_once`` / ``mm_finish`` in ``_fastpath.c``) do the at-once admit
and the plain finish of such levels with :meth:`MaxMinPolicy.at_once_locked` and
:meth:`MaxMinPolicy.main_phase_ended_locked`. Tags are uint64 words compared by signed
difference (wrapping is harmless while live tags lie within 2^63 seat-ns of each other).
"""

from __future__ import annotations

import struct
from functools import lru_cache

from apf_gunicorn.flowcontrol.shufflesharding import deal
from apf_gunicorn.ledger.layout import (
    EXECUTING,
    F_CHILD,
    F_EST,
    F_EXEC,
    F_HASH,
    F_HEAD,
    F_LEVEL,
    F_N,
    F_NEXT,
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
    FW_HEAP,
    FW_IDLE,
    FW_NOWHERE,
    FW_PARKED,
    L_ACTIVE_QUEUES,
    L_C,
    L_DESIRED,
    L_DISPATCHED,
    L_ENQUEUES,
    L_EXECUTING,
    L_HAND,
    L_QBASE,
    L_QLL,
    L_QSEATS,
    L_R,
    L_SEATS_IN_USE,
    L_SEATS_WAITING,
    L_SERVICE_NS,
    L_WAITING,
    LEVEL_WORDS,
    LINGERING,
    M_NFLOWS,
    M_PARK_HEAD,
    M_PARK_TAIL,
    M_RESERVE,
    M_RESERVES,
    M_ROOT,
    M_SEQ,
    M_V,
    MM_WORDS,
    NIL,
    Q_EXECUTING,
    Q_SEATS,
    Q_WAITING,
    Q_WORK_SUM,
    QUEUE_WORDS,
    S_AL,
    S_ARRIVAL_NS,
    S_ARRIVAL_R,
    S_FINAL,
    S_FINAL_WORK,
    S_GEN,
    S_HASH,
    S_HELD,
    S_INITIAL,
    S_LEVEL,
    S_MAX_SEATS,
    S_OWNER,
    S_QUEUE,
    S_SEQ,
    S_SERVICE_NS,
    S_START_NS,
    S_STATE,
    S_STATS,
    SLOT_WORDS,
    WAITING,
    X_END,
    X_FLOW,
    X_FNEXT,
    X_FPREV,
    XSLOT_WORDS,
)
from apf_gunicorn.ledger.records import EXECUTE, QUEUED, REJECTED, AdmitResult
from apf_gunicorn.ledger.seatseconds import U64, duration_per_seat
from apf_gunicorn.ledger.service import SERVICE_WINDOW, learn_service
from apf_gunicorn.ledger.stats import R_QUEUE_FULL

HALF = 1 << 63
# A flow entry's counting words in one struct call (the per-request paths read and write them
# together): F_TAG .. F_WHERE, and F_TAG .. F_N written back. F_TAG is a uint64.
_COUNTS = struct.Struct("<Q9q")  # tag, seq, waiting, exec, seats, head, tail, est, n, where
_CHARGE = struct.Struct("<Q4q")  # tag, seq, waiting, exec, seats
_LEARNT = struct.Struct("<Q8q")  # tag, seq, waiting, exec, seats, head, tail, est, n
if not ((F_TAG, F_SEQ, F_WAITING, F_EXEC, F_SEATS, F_HEAD, F_TAIL, F_EST, F_N, F_WHERE)
        == tuple(range(F_TAG, F_TAG + 10))):
    raise ImportError("maxmin: the flow entry's struct formats do not match layout.py")


@lru_cache(maxsize=65536)
def flow_mix(level: int, flow_hash: int) -> int:
    """Where a flow's search starts in the index: a 64-bit mix of (level, hash) (the
    splitmix64 finaliser), so that flows of one level spread over the whole index. Cached:
    flows repeat, and the mix is pure (``mm_mix`` in ``_fastpath.c`` computes the same)."""
    x = (flow_hash ^ (level * 0x9E3779B97F4A7C15)) & U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & U64
    return x ^ (x >> 31)


class MaxMinPolicy:
    """The ``maxmin`` rules over one ledger's buffer (the same interface as
    :class:`~apf_gunicorn.ledger.queueset.KubernetesQueueSet`)."""

    name = "maxmin"

    def __init__(self, led) -> None:
        lay = led._lay
        self._nlevels = lay.cap.levels
        self._w = led._w
        self._u = led._u
        self._qb = led._qb
        self._sb = led._sb
        self._lvb = led._lvb
        self._mb = lay.maxmin_base
        self._fh = lay.flow_header
        self._fb = lay.flow_base
        self._ib = lay.flow_index
        self._mask = lay.flow_index_words - 1
        self._xb = lay.xslot_base
        self._nslots = lay.cap.slots
        self._mv = led._mv

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
        still keyed by it (left by an earlier level or policy), and empty its words."""
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
        for field in (F_SEQ, F_WAITING, F_EXEC, F_SEATS, F_EST, F_N):
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
        """The heap of roots ``a`` and ``b``: the loser becomes the winner's first child.
        (:meth:`_less` inline: this is the heap's inner loop.)"""
        if a == NIL:
            return b
        if b == NIL:
            return a
        w = self._w
        fb = self._fb
        aa, ba = fb + a * FLOW_WORDS, fb + b * FLOW_WORDS
        u = self._u
        ta, tb = u[aa + F_TAG], u[ba + F_TAG]
        if ta != tb:
            b_first = ((tb - ta) & U64) >= HALF
        else:
            sa, sb = w[aa + F_SEATS], w[ba + F_SEATS]
            b_first = sb < sa if sa != sb else w[ba + F_SEQ] < w[aa + F_SEQ]
        if b_first:
            a, b, aa, ba = b, a, ba, aa
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

        The first pass is :meth:`_meld` inline (the heap's inner loop: one Python call fewer
        per pair). Links are written only where they survive: each node's ``F_NEXT`` and
        ``F_PREV`` are set by the meld that makes it a child, the result's ``F_PREV`` by the
        caller."""
        w, u = self._w, self._u
        fb = self._fb
        acc = NIL
        x = first
        while x != NIL:
            a = x
            aa = fb + a * FLOW_WORDS
            b = w[aa + F_NEXT]
            if b != NIL:
                ba = fb + b * FLOW_WORDS
                nxt = w[ba + F_NEXT]
                ta, tb = u[aa + F_TAG], u[ba + F_TAG]
                if ta != tb:
                    b_first = ((tb - ta) & U64) >= HALF
                else:
                    sa, sb = w[aa + F_SEATS], w[ba + F_SEATS]
                    b_first = sb < sa if sa != sb else w[ba + F_SEQ] < w[aa + F_SEQ]
                if b_first:
                    a, b, aa, ba = b, a, ba, aa
                c = w[aa + F_CHILD]
                w[ba + F_NEXT] = c
                if c != NIL:
                    w[fb + c * FLOW_WORDS + F_PREV] = b
                w[ba + F_PREV] = a
                w[aa + F_CHILD] = b
            else:
                nxt = NIL
            w[aa + F_NEXT] = acc
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

    # -- arrival ------------------------------------------------------------------------------
    def enqueue_locked(self, led, lb: int, level: int, req: tuple, eb: int, ms: int, watch: int,
                       granted: list) -> AdmitResult:
        """``StartRequest`` of a maxmin level that the fast admit did not take: choose the queue
        as Kubernetes does, reject ``queue-full`` as Kubernetes does, else wait in the queue and
        in the flow's FIFO and dispatch what fits (this request too, when nothing else waits).

        Args and Returns: as :meth:`KubernetesQueueSet.enqueue_locked`.
        """
        w, u = self._w, self._u
        flow_hash, initial, final, al, owner, now, fs_index, detail = req
        desired = w[lb + L_DESIRED]
        hs = w[lb + L_HAND]
        h = flow_hash & U64
        hand = deal(h, desired, hs)
        enq = w[lb + L_ENQUEUES]
        w[lb + L_ENQUEUES] = enq + 1
        off = enq % hs
        qbase = self._qb + w[lb + L_QBASE] * QUEUE_WORDS
        best_q = hand[off]
        best = u[qbase + best_q * QUEUE_WORDS + Q_WORK_SUM]
        for i in range(1, hs):
            q = hand[(off + i) % hs]
            ws = u[qbase + q * QUEUE_WORDS + Q_WORK_SUM]
            if ws < best:
                best, best_q = ws, q
        q = best_q
        qa = qbase + q * QUEUE_WORDS
        if w[lb + L_SEATS_IN_USE] >= w[lb + L_C] and w[qa + Q_WAITING] >= w[lb + L_QLL]:
            led._count_rejection_locked(lb)
            led._note_rejection_locked(eb, R_QUEUE_FULL, False)
            led._commit_locked()
            return AdmitResult(REJECTED, -1, 0, "queue-full", granted)
        s, sa, gen = led._alloc_locked(level, owner, flow_hash, fs_index, initial, final, al, now,
                                       detail)
        w[sa + S_STATS] = 2 * eb + watch
        u[sa + S_ARRIVAL_R] = u[lb + L_R]
        w[sa + S_SEQ] = enq
        w[sa + S_QUEUE] = q
        led._log_locked(sa + S_STATE)
        w[sa + S_STATE] = WAITING
        led._commit_locked()
        led._link_tail_locked(lb, qa, s, sa)
        w[lb + L_WAITING] += 1
        w[lb + L_SEATS_WAITING] += ms
        mm = self._mb + level * MM_WORDS
        f = self._get(mm, level, h)
        fa = self._fb + f * FLOW_WORDS
        xb = self._xb
        xa = xb + s * XSLOT_WORDS
        w[xa + X_FLOW] = f
        tail = w[fa + F_TAIL]
        w[xa + X_FPREV] = tail
        w[xa + X_FNEXT] = NIL
        if tail == NIL:
            w[fa + F_HEAD] = s
        else:
            w[xb + tail * XSLOT_WORDS + X_FNEXT] = s
        w[fa + F_TAIL] = s
        n = w[fa + F_WAITING] + 1
        w[fa + F_WAITING] = n
        if n == 1:  # the flow starts waiting: no credit from before, next in the sequence
            v = u[mm + M_V]
            if ((u[fa + F_TAG] - v) & U64) >= HALF:
                u[fa + F_TAG] = v
            seq = w[mm + M_SEQ] + 1
            w[mm + M_SEQ] = seq
            w[fa + F_SEQ] = seq
            self._heap_insert(mm, f)
        led._demand_locked(lb, now)
        self.dispatch_all_locked(led, lb, now, granted)
        if w[sa + S_STATE] == EXECUTING:
            mine = (s, gen, owner)
            granted[:] = [g for g in granted if g != mine]
            return AdmitResult(EXECUTE, s, gen, "", granted)
        return AdmitResult(QUEUED, s, gen, "", granted)

    def at_once_locked(self, lb: int, level: int, h: int, s: int, held: int, al: int) -> int:
        """The fast admit's flow words (``fastpath.py``; ``fp_admit`` in ``_fastpath.c``): a
        request of flow ``h`` runs at once in slot ``s`` holding ``held`` seats for its main
        phase and ``al`` ns after (both after the final-seat cap). Nothing waits in the level,
        so this is what :meth:`enqueue_locked` and :meth:`_dispatch` leave: the flow's entry
        found or made active, its tag lifted to V and its backlog sequence taken, V raised to
        it (no other flow waits), the tag charged. Returns the estimate charged (the slot's
        ``S_SERVICE_NS``)."""
        mm = self._mb + level * MM_WORDS
        f = self._get(mm, level, h)
        fa = self._fb + f * FLOW_WORDS
        mv, w, u = self._mv, self._w, self._u
        tag, _seq, waiting, ex, seats, _h, _t, est, n, _where = _COUNTS.unpack_from(
            mv, (fa + F_TAG) * 8)
        v = u[mm + M_V]
        if ((tag - v) & U64) >= HALF:
            tag = v
        seq = w[mm + M_SEQ] + 1
        w[mm + M_SEQ] = seq
        if ((v - tag) & U64) >= HALF:
            u[mm + M_V] = tag
        if not n:
            est = w[lb + L_SERVICE_NS]
        _CHARGE.pack_into(mv, (fa + F_TAG) * 8, (tag + held * (est + al)) & U64, seq, waiting,
                          ex + 1, seats + held)
        w[self._xb + s * XSLOT_WORDS + X_FLOW] = f
        return est

    # -- dispatch -----------------------------------------------------------------------------
    def _fits(self, lb: int, ms: int) -> bool:
        w = self._w
        c = w[lb + L_C]
        if ms > c:
            return w[lb + L_EXECUTING] == 0  # Kubernetes' too-wide rule
        return w[lb + L_SEATS_IN_USE] + ms <= c

    def _estimate(self, lb: int, fa: int) -> int:
        w = self._w
        return w[fa + F_EST] if w[fa + F_N] else w[lb + L_SERVICE_NS]

    def _capped(self, lb: int, mm: int, f: int) -> bool:
        """A flow that has finished nothing yet holds at most its equal share."""
        w = self._w
        fa = self._fa(f)
        seats = w[fa + F_SEATS]
        if w[fa + F_N] or seats == 0:
            return False
        ms = w[self._sb + w[fa + F_HEAD] * SLOT_WORDS + S_MAX_SEATS]
        return (seats + ms) * w[mm + M_NFLOWS] > w[lb + L_C]

    def dispatch_all_locked(self, led, lb: int, now: int, granted: list) -> None:
        """Dispatch while something waits and seats are free, in the policy's order;
        appends ``(slot, gen, owner)`` to ``granted``."""
        w = self._w
        while (w[lb + L_WAITING] != 0 and w[lb + L_SEATS_IN_USE] < w[lb + L_C]
               and self._dispatch_one(led, lb, now, granted)):
            pass

    def _head_ms(self, f: int) -> int:
        return self._w[self._sb + self._w[self._fa(f) + F_HEAD] * SLOT_WORDS + S_MAX_SEATS]

    def _dispatch_one(self, led, lb: int, now: int, granted: list) -> bool:
        w = self._w
        mm = self._mb + (lb - self._lvb) // LEVEL_WORDS * MM_WORDS  # (_mm)
        f = w[mm + M_RESERVE]
        if f != NIL:
            if self._fits(lb, self._head_ms(f)):
                w[mm + M_RESERVE] = NIL
                self._dispatch(led, lb, mm, f, now, granted)
                return True
            return self._backfill(led, lb, mm, f, now, granted)
        f = w[mm + M_ROOT]
        while f != NIL and self._capped(lb, mm, f):
            self._heap_remove(mm, f)
            self._park(mm, f)
            f = w[mm + M_ROOT]
        if f == NIL:  # only parked flows wait: nobody else to protect
            p = w[mm + M_PARK_HEAD]
            while p != NIL:
                if self._fits(lb, self._head_ms(p)):
                    self._dispatch(led, lb, mm, p, now, granted)
                    return True
                p = w[self._fa(p) + F_NEXT]
            return False
        if self._fits(lb, self._head_ms(f)):
            self._dispatch(led, lb, mm, f, now, granted)
            return True
        w[mm + M_RESERVE] = f
        w[mm + M_RESERVES] += 1
        return self._backfill(led, lb, mm, f, now, granted)

    def _dispatch(self, led, lb: int, mm: int, f: int, now: int, granted: list) -> None:
        """Flow ``f``'s oldest waiting request starts executing. (The flow's counting words
        are read in one struct call and written back in one.)"""
        w, u, mv = self._w, self._u, self._mv
        fa = self._fb + f * FLOW_WORDS
        tag, seq, waiting, ex, seats, s, tail, learnt, n, where = _COUNTS.unpack_from(
            mv, (fa + F_TAG) * 8)
        sa = self._sb + s * SLOT_WORDS
        xb = self._xb
        xa = xb + s * XSLOT_WORDS
        q = w[sa + S_QUEUE]
        qa = self._qb + (w[lb + L_QBASE] + q) * QUEUE_WORDS
        led._unlink_locked(lb, qa, sa)
        head = w[xa + X_FNEXT]  # out of the flow's FIFO
        if head == NIL:
            tail = NIL
        else:
            w[xb + head * XSLOT_WORDS + X_FPREV] = NIL
        w[xa + X_FPREV] = NIL
        w[xa + X_FNEXT] = NIL
        waiting -= 1
        if where == FW_HEAP:
            self._heap_remove(mm, f)  # its key changes (or it leaves)
        ms = w[sa + S_MAX_SEATS]
        c = w[lb + L_C]
        initial = w[sa + S_INITIAL]
        held = ms
        if w[sa + S_FINAL] > c:  # final-seat cap, preserving the tail's area
            w[sa + S_AL] = duration_per_seat(u[sa + S_FINAL_WORK], float(c))
            w[sa + S_FINAL] = c
            held = initial if initial >= c else c
        w[lb + L_WAITING] -= 1
        w[lb + L_SEATS_WAITING] -= ms
        led._log_locked(sa + S_STATE, lb + L_DISPATCHED)  # one event: this dispatch
        w[sa + S_STATE] = EXECUTING
        w[sa + S_START_NS] = now
        w[sa + S_HELD] = held
        w[lb + L_EXECUTING] += 1
        w[lb + L_SEATS_IN_USE] += held
        w[lb + L_DISPATCHED] += 1
        led._observe_wait_locked(w[sa + S_STATS] >> 1, now - w[sa + S_ARRIVAL_NS])
        led._commit_locked()
        qex = w[qa + Q_EXECUTING]
        w[qa + Q_EXECUTING] = qex + 1
        if qex == 0 and w[qa + Q_WAITING] == 0:
            w[lb + L_ACTIVE_QUEUES] += 1
        w[qa + Q_SEATS] += held
        w[lb + L_QSEATS] += held
        led._demand_locked(lb, now)
        # V: the start tag in service, never past a flow still waiting
        low = tag
        root = w[mm + M_ROOT]
        if root != NIL:
            rt = u[self._fb + root * FLOW_WORDS + F_TAG]
            if ((rt - low) & U64) >= HALF:
                low = rt
        if ((u[mm + M_V] - low) & U64) >= HALF:
            u[mm + M_V] = low
        est = learnt if n else w[lb + L_SERVICE_NS]  # (_estimate)
        w[sa + S_SERVICE_NS] = est
        _LEARNT.pack_into(mv, (fa + F_TAG) * 8, (tag + held * (est + w[sa + S_AL])) & U64, seq,
                          waiting, ex + 1, seats + held, head, tail, learnt, n)
        if waiting == 0:
            self._unlist(mm, f)
        elif where == FW_HEAP:
            self._heap_insert(mm, f)
        granted.append((s, w[sa + S_GEN], w[sa + S_OWNER]))

    def _backfill(self, led, lb: int, mm: int, r: int, now: int, granted: list) -> bool:
        """The reserved flow ``r``'s head does not fit: dispatch one other head that fits now
        and, by the estimates, leaves the reserved head's start where it is. The one case that
        scans: the level's executing and lingering slots (when seats free), and its waiting
        flows."""
        w = self._w
        c = w[lb + L_C]
        free = c - w[lb + L_SEATS_IN_USE]
        if free <= 0:
            return False
        need = self._head_ms(r)
        level = (lb - self._lvb) // LEVEL_WORDS
        states, levels, starts, ests, als, helds = led._slot_columns_locked(
            S_STATE, S_LEVEL, S_START_NS, S_SERVICE_NS, S_AL, S_HELD)
        xb = self._xb
        ends = []
        for s in range(self._nslots):
            st = states[s]
            if (st == EXECUTING or st == LINGERING) and levels[s] == level:
                if st == LINGERING:
                    end = w[xb + s * XSLOT_WORDS + X_END]
                else:
                    end = starts[s] + ests[s]
                    if end < now:
                        end = now  # overdue: assume it is about to end (the head's side)
                    end += als[s]
                ends.append((end, helds[s], st == EXECUTING))
        ends.sort()
        if need > c:  # too wide: waits for every executing request to end
            t = now
            for end, _held, executing in ends:
                if executing and end > t:
                    t = end
            spare = 0
        else:
            acc, t = free, now
            for end, held, _x in ends:
                if acc >= need:
                    break
                acc += held
                t = end
            spare = acc - need
        best = NIL
        for f in self.heap_flows_locked(lb) + self.parked_flows_locked(lb):
            if f == r:
                continue
            fa = self._fa(f)
            sa = self._sb + w[fa + F_HEAD] * SLOT_WORDS
            ms = w[sa + S_MAX_SEATS]
            if ms > free:
                continue
            if w[fa + F_WHERE] == FW_PARKED and self._capped(lb, mm, f):
                continue
            if now + self._estimate(lb, fa) + w[sa + S_AL] > t and ms > spare:
                continue
            if best == NIL or self._less(f, best):
                best = f
        if best == NIL:
            return False
        self._dispatch(led, lb, mm, best, now, granted)
        return True

    # -- completion and removal ---------------------------------------------------------------
    def main_phase_ended_locked(self, led, lb: int, q: int, qa: int, sa: int, now: int,
                                learn: bool = True) -> None:
        """The request in slot ``sa`` ended its main phase (``learn``: it finished; False: its
        worker died): correct its flow's tag by the time it held its seats, learn the flow's
        service time, and let a parked flow compete again."""
        w = self._w
        xa = self._xb + (sa - self._sb) // SLOT_WORDS * XSLOT_WORDS
        f = w[xa + X_FLOW]
        al = w[sa + S_AL]
        if al > 0:
            w[xa + X_END] = now + al
        if f == NIL:
            return
        w[xa + X_FLOW] = NIL
        mm = self._mb + (lb - self._lvb) // LEVEL_WORDS * MM_WORDS
        fa = self._fb + f * FLOW_WORDS
        held = w[sa + S_HELD]
        ran = now - w[sa + S_START_NS]
        mv = self._mv
        tag, seq, waiting, ex, seats, head, tail, est, n, where = _COUNTS.unpack_from(
            mv, (fa + F_TAG) * 8)
        charged = tag
        tag = (tag + held * (ran - w[sa + S_SERVICE_NS])) & U64
        # in the heap, its key (tag, seats, seq) falls unless the tag grows (seats fall): then
        # a decrease-key, else out and back in
        fell = where == FW_HEAP and ((charged - tag) & U64) < HALF
        if where == FW_HEAP and not fell:
            self._heap_remove(mm, f)
        if learn:
            if n < SERVICE_WINDOW:
                n += 1
            est = learn_service(est if n > 1 else 0, n, ran)
        _LEARNT.pack_into(mv, (fa + F_TAG) * 8, tag, seq, waiting, ex - 1, seats - held, head,
                          tail, est, n)
        if fell:
            self._heap_decrease(mm, f)
        elif where == FW_HEAP:
            self._heap_insert(mm, f)
        elif where == FW_PARKED and n:  # learnt now: compete normally
            self._unpark(mm, f)
            self._heap_insert(mm, f)
        if waiting == 0 and ex == 1:
            self._idle(mm, f, fa)

    def waiting_removed_locked(self, led, lb: int, q: int, sa: int) -> None:
        """A waiting request left (time-out, cancel, dead worker) before its slot is freed:
        out of its flow's FIFO."""
        w = self._w
        s = (sa - self._sb) // SLOT_WORDS
        xa = self._xa(s)
        f = w[xa + X_FLOW]
        if f == NIL:
            return
        fa = self._fa(f)
        p, n = w[xa + X_FPREV], w[xa + X_FNEXT]
        if p == NIL:
            w[fa + F_HEAD] = n
        else:
            w[self._xa(p) + X_FNEXT] = n
        if n == NIL:
            w[fa + F_TAIL] = p
        else:
            w[self._xa(n) + X_FPREV] = p
        w[xa + X_FPREV] = NIL
        w[xa + X_FNEXT] = NIL
        w[xa + X_FLOW] = NIL
        waiting = w[fa + F_WAITING] - 1
        w[fa + F_WAITING] = waiting
        if waiting == 0:
            mm = self._mm(lb)
            self._unlist(mm, f)
            if w[fa + F_EXEC] == 0:
                self._idle(mm, f, fa)

    def touch_locked(self, led, lb: int, q: int) -> None:
        """Queues do not rank anything under maxmin."""

    def queues_moved_locked(self, led, lb: int) -> None:
        """Nothing here is indexed by queue number."""

    def advance_epoch_locked(self, led, lb: int) -> None:
        """R (Kubernetes' virtual time, still kept for the seat-demand rate) reached highR:
        wind it back as Kubernetes does; the maxmin tags wrap by themselves."""
        led._queueset.advance_epoch_locked(led, lb)

    # -- repair and policy switches -----------------------------------------------------------
    def repair_locked(self, led, lb: int) -> None:
        """Rebuild the level's flow state from the slot table (after a repair rebuilt the
        queues, or when the level switches to maxmin). Tags, estimates and backlog sequence
        numbers of entries that survive are kept; nothing is parked or reserved afterwards;
        waiting requests rejoin their flow's FIFO in arrival order (``S_SEQ``)."""
        w, u = self._w, self._u
        level = (lb - self._lvb) // LEVEL_WORDS
        mm = self._mm(lb)
        # every entry of the level: unlinked, counts zero (still indexed)
        for f in range(self._nslots):
            fa = self._fa(f)
            if w[fa + F_LEVEL] != level:
                continue
            if w[fa + F_WHERE] == FW_IDLE:
                self._idle_remove(f, fa)
            for field in (F_WAITING, F_EXEC, F_SEATS):
                w[fa + field] = 0
            for field in (F_HEAD, F_TAIL, F_CHILD, F_NEXT, F_PREV):
                w[fa + field] = NIL
            w[fa + F_WHERE] = FW_NOWHERE
        self._rebuild_index()
        w[mm + M_ROOT] = NIL
        w[mm + M_PARK_HEAD] = NIL
        w[mm + M_PARK_TAIL] = NIL
        w[mm + M_RESERVE] = NIL
        w[mm + M_NFLOWS] = 0
        states, levels, seqs, queues = led._slot_columns_locked(S_STATE, S_LEVEL, S_SEQ,
                                                                S_QUEUE)
        # requests admitted into a queue (not those of an exempt or reject-type configuration)
        mine = sorted((seqs[s], s) for s in range(self._nslots)
                      if states[s] in (WAITING, EXECUTING) and levels[s] == level
                      and queues[s] != NIL)
        flows = []
        for _seq, s in mine:
            sa = self._sb + s * SLOT_WORDS
            h = u[sa + S_HASH]
            f = self._find(level, h)
            if f == NIL:
                f = self._get(mm, level, h)
            elif not (w[self._fa(f) + F_WAITING] or w[self._fa(f) + F_EXEC]):
                w[mm + M_NFLOWS] += 1
            fa = self._fa(f)
            if f not in flows:
                flows.append(f)
            xa = self._xa(s)
            w[xa + X_FLOW] = f
            w[xa + X_FPREV] = NIL
            w[xa + X_FNEXT] = NIL
            if states[s] == WAITING:
                tail = w[fa + F_TAIL]
                w[xa + X_FPREV] = tail
                if tail == NIL:
                    w[fa + F_HEAD] = s
                else:
                    w[self._xa(tail) + X_FNEXT] = s
                w[fa + F_TAIL] = s
                w[fa + F_WAITING] += 1
            else:
                w[fa + F_EXEC] += 1
                w[fa + F_SEATS] += w[sa + S_HELD]
        for f in flows:
            if w[self._fa(f) + F_WAITING]:
                self._heap_insert(mm, f)
        for s in range(self._nslots):  # lingering, free and queueless slots: no flow
            if levels[s] == level and (states[s] not in (WAITING, EXECUTING)
                                       or queues[s] == NIL):
                w[self._xa(s) + X_FLOW] = NIL
        for f in range(self._nslots):
            fa = self._fa(f)
            if (w[fa + F_LEVEL] == level and w[fa + F_WHERE] == FW_NOWHERE
                    and not w[fa + F_WAITING] and not w[fa + F_EXEC]):
                self._idle(mm, f, fa)
                w[mm + M_NFLOWS] += 1  # _idle counts an active flow leaving; this one was not

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

    def verify_locked(self, led, lb: int) -> list[str]:
        """Every violated invariant of the level's flow state, as text (``repair.verify``)."""
        w, u = self._w, self._u
        level = (lb - self._lvb) // LEVEL_WORDS
        mm = self._mm(lb)
        out: list[str] = []
        states, levels, seqs, helds, queues = led._slot_columns_locked(
            S_STATE, S_LEVEL, S_SEQ, S_HELD, S_QUEUE)
        want: dict[int, list] = {}
        for s in sorted(range(self._nslots), key=lambda s: seqs[s]):
            if levels[s] != level or states[s] not in (WAITING, EXECUTING) or queues[s] == NIL:
                continue  # (a queueless request: exempt or reject-type, no flow)
            f = w[self._xa(s) + X_FLOW]
            if f == NIL or w[self._fa(f) + F_LEVEL] != level:
                out.append(f"level {level} slot {s}: no flow entry")
                continue
            if self._find(level, u[self._sb + s * SLOT_WORDS + S_HASH]) != f:
                out.append(f"level {level} slot {s}: its flow is not found by its key")
            fifo, ex, seats = want.setdefault(f, [[], 0, 0])
            if states[s] == WAITING:
                fifo.append(s)
            else:
                want[f][1] += 1
                want[f][2] += helds[s]
        heap = set(self.heap_flows_locked(lb))
        parked = set(self.parked_flows_locked(lb))
        for f, (fifo, ex, seats) in want.items():
            fa = self._fa(f)
            got, s = [], w[fa + F_HEAD]
            while s != NIL and len(got) <= self._nslots:
                got.append(s)
                s = w[self._xa(s) + X_FNEXT]
            if got != fifo:
                out.append(f"level {level} flow {f}: FIFO {got} != arrival order {fifo}")
            if (w[fa + F_WAITING], w[fa + F_EXEC], w[fa + F_SEATS]) != (len(fifo), ex, seats):
                out.append(f"level {level} flow {f}: counts "
                           f"{(w[fa + F_WAITING], w[fa + F_EXEC], w[fa + F_SEATS])} != "
                           f"{(len(fifo), ex, seats)}")
            if fifo and f not in heap and f not in parked:
                out.append(f"level {level} flow {f}: waits but is neither in the heap nor parked")
        for f in heap | parked:
            if f not in want or not want[f][0]:
                out.append(f"level {level} flow {f}: listed with nothing waiting")
        for f in heap:
            c = w[self._fa(f) + F_CHILD]
            while c != NIL:
                if self._less(c, f):
                    out.append(f"level {level}: heap order broken below flow {f}")
                c = w[self._fa(c) + F_NEXT]
        if w[mm + M_NFLOWS] != len(want):
            out.append(f"level {level}: {w[mm + M_NFLOWS]} active flows counted, {len(want)} found")
        r = w[mm + M_RESERVE]
        if r != NIL and r not in heap and r not in parked:
            out.append(f"level {level}: the reserved flow {r} does not wait")
        return out

    # -- reading ------------------------------------------------------------------------------
    def flow_state_locked(self, lb: int) -> dict:
        """The level's virtual-time state for dumps: V, the reserved flow's hash, and per
        active flow (hash -> tag, waiting, executing, seats, learnt estimate in ns or None)."""
        w, u = self._w, self._u
        mm = self._mm(lb)
        level = (lb - self._lvb) // LEVEL_WORDS
        flows = {}
        end = self._fb + self._nslots * FLOW_WORDS
        levels = w[self._fb + F_LEVEL: end: FLOW_WORDS].tolist()  # strided: one pass in C
        wheres = w[self._fb + F_WHERE: end: FLOW_WORDS].tolist()
        for f in range(self._nslots):
            if levels[f] != level or wheres[f] == FW_IDLE:
                continue
            fa = self._fa(f)
            flows[u[fa + F_HASH]] = {
                "tag": u[fa + F_TAG], "waiting": w[fa + F_WAITING], "executing": w[fa + F_EXEC],
                "seats": w[fa + F_SEATS], "estimate_ns": w[fa + F_EST] if w[fa + F_N] else None,
                "parked": w[fa + F_WHERE] == FW_PARKED}
        r = w[mm + M_RESERVE]
        return {"v": u[mm + M_V], "reserved": u[self._fa(r) + F_HASH] if r != NIL else None,
                "reservations": w[mm + M_RESERVES], "flows": flows}


__all__ = ["MaxMinPolicy", "flow_mix"]
