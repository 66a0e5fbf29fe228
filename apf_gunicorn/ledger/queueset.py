"""Kubernetes' queueset fairness: which queue a request waits in and which waits next.

The ledger's general request path (``requestpath.py``) owns slots, seats, counters and the
lock; a level's *fairness* decides the queuing: this module is Kubernetes' (``queueset.go``):
shuffle sharding into the queue with the least waiting work, dispatch by the minimum virtual
finish (a min-segment tree per level, ``mintree.py``) with round-robin ties from
``robinIndex + 1``, head-of-line blocking, the anti-windup floor after every queue change, and the
finish correction ``-initial*(G - S)`` of the queue's ``nextDispatchR``. What a fairness provides
is :class:`~apf_gunicorn.ledger.fairness.Fairness`; each ``Ledger`` builds one
(``Ledger._queueset``) and calls it through its routers only (``ledger.py``)::

    led._enqueue_locked(lb, level, q, qa, req, eb, ms, watch, granted)  # -> .enqueue_locked
    led._dispatch_all_locked(lb, now, granted)                 # -> .dispatch_all_locked

Everything here runs with the ledger lock held (hence ``_locked``). The admit-at-once fast path
(``fastpath.py`` and ``_fastpath.c``) implements this fairness's at-once case inline.
"""

from __future__ import annotations

from apf_gunicorn.ledger import layout as L
from apf_gunicorn.ledger.layout import (
    L_C,
    L_NQ,
    L_QBASE,
    L_R,
    L_ROBIN,
    L_SEATS_IN_USE,
    L_TBASE,
    L_TP,
    L_WAITING,
    NIL,
    Q_EXECUTING,
    Q_HEAD,
    Q_NDR,
    Q_WAITING,
    QUEUE_WORDS,
    S_ARRIVAL_R,
    S_GEN,
    S_INITIAL,
    S_MAX_SEATS,
    S_NEXT,
    S_OWNER,
    S_SERVICE_NS,
    S_START_NS,
    S_STATE,
    S_TOTAL_WORK,
    SLOT_WORDS,
)
from apf_gunicorn.ledger.records import (
    AdmitResult,
)
from apf_gunicorn.ledger.seatseconds import (
    R_DECREMENT,
    U64,
    seats_ns_times,
)


class KubernetesQueueSet:
    """Kubernetes' queueset rules over one ledger's buffer (a :class:`Fairness`)."""

    name = "kubernetes"

    def __init__(self, led) -> None:
        # the ledger's views only: each hook is handed the ledger itself (no reference cycle,
        # so a dropped ledger and its buffer are freed at once)
        self._w = led._w
        self._u = led._u
        self._qb = led._qb
        self._sb = led._sb

    def enqueue_locked(self, led, lb: int, level: int, q: int, qa: int, req: tuple, eb: int,
                       ms: int, watch: int, granted: list) -> AdmitResult:
        """``StartRequest`` of a queuing level for a request that does not run at once (the
        fast path declined and ``Ledger._verdict_locked`` said it waits): the arrival is
        counted, a slot is free, R is synced.

        Args:
            lb: the level's word address; ``level`` its index.
            q, qa: the queue shuffle sharding picked, and its word address.
            req: ``(flow_hash, initial, final, al, owner, now, fs_index, detail)``.
            eb: the request's stats entry; ``ms``: max(initial, final) seats; ``watch``: 0/1.
            granted: the operation's grants, appended to.
        Returns:
            QUEUED, or EXECUTE when the dispatch that follows the enqueue picked this request.
        """
        w, u = self._w, self._u
        s, sa, gen = led._wait_locked(lb, level, q, qa, req, eb, ms, watch)
        if w[qa + Q_WAITING] == 1 and w[qa + Q_EXECUTING] == 0:  # the queue was empty
            u[qa + Q_NDR] = u[lb + L_R]
        now = req[5]
        led._demand_locked(lb, now)
        self.touch_locked(led, lb, q)
        self.dispatch_all_locked(led, lb, now, granted)
        return led._admitted(s, w[sa + S_STATE], gen, req[4], granted)

    def dispatch_all_locked(self, led, lb: int, now: int, granted: list) -> None:
        """Dispatch while something waits, seats are free and the chosen head fits
        (``dispatchAsMuchAsPossibleLocked``); appends ``(slot, gen, owner)`` to ``granted``."""
        w = self._w
        while (w[lb + L_WAITING] != 0 and w[lb + L_SEATS_IN_USE] < w[lb + L_C]
               and self.dispatch_one_locked(led, lb, now, granted)):
            pass

    def dispatch_one_locked(self, led, lb: int, now: int, granted: list) -> bool:
        """``findDispatchQueueToBoundLocked`` + ``dispatchLocked``: False when nothing was
        dispatched (no waiting head, or the chosen head does not fit: head-of-line blocking)."""
        w, u = self._w, self._u
        nq = w[lb + L_NQ]
        if nq == 0:
            return False
        tb = w[lb + L_TBASE]
        robin = w[lb + L_ROBIN]
        best = u[tb + 1]
        if best == U64:  # no waiting head (or all at MaxSeatSeconds): a fruitless full scan
            w[lb + L_ROBIN] = robin % nq
            return False
        p = w[lb + L_TP]
        q = led._first_le_locked(tb, p, (robin + 1) % nq, best)
        if q < 0:
            q = led._first_le_locked(tb, p, 0, best)
        qa = self._qb + (w[lb + L_QBASE] + q) * QUEUE_WORDS
        s = w[qa + Q_HEAD]
        sa = self._sb + s * SLOT_WORDS
        ms = w[sa + S_MAX_SEATS]
        if not led._can_accommodate_locked(lb, ms):
            w[lb + L_ROBIN] = robin % nq  # head-of-line blocking: nothing else is tried
            return False
        led._unlink_locked(lb, qa, sa)
        w[lb + L_ROBIN] = q
        led._start_locked(lb, qa, sa, now)
        u[qa + Q_NDR] = (u[qa + Q_NDR] + u[sa + S_TOTAL_WORK]) & U64
        self.touch_locked(led, lb, q)
        granted.append((s, w[sa + S_GEN], w[sa + S_OWNER]))
        return True

    def touch_locked(self, led, lb: int, q: int) -> None:
        """Queue ``q`` changed (a request joined or left it, or its ``nextDispatchR`` moved):
        ``boundNextDispatchLocked`` (the anti-windup floor) plus the queue's tree leaf."""
        w, u = self._w, self._u
        qa = led._qa(lb, q)
        if w[qa + Q_WAITING]:
            sa = self._sb + w[qa + Q_HEAD] * SLOT_WORDS
            ndr = u[qa + Q_NDR]
            ar = u[sa + S_ARRIVAL_R]
            if ndr < ar:
                u[qa + Q_NDR] = ndr = ar
            led._set_leaf_locked(lb, q, (ndr + u[sa + S_TOTAL_WORK]) & U64)
        else:
            led._set_leaf_locked(lb, q, U64)

    def waiting_removed_locked(self, led, lb: int, q: int, sa: int) -> None:
        """A waiting request left queue ``q`` without running: re-rank the queue."""
        self.touch_locked(led, lb, q)

    def main_phase_ended_locked(self, led, lb: int, q: int, qa: int, sa: int, now: int,
                                learn: bool = True) -> None:
        """The request in slot ``sa`` of queue ``q`` ended its main phase (finished, or its
        worker died) and the counts are updated: correct the queue's ``nextDispatchR`` by the
        time it really ran (``finishRequestLocked``: ``-= initial*(G - S)``)."""
        w, u = self._w, self._u
        # nextDispatchR -= initial*(G - S): usually negative, so uint64 wraparound adds
        corr = seats_ns_times(w[sa + S_INITIAL], w[sa + S_SERVICE_NS] - (now - w[sa + S_START_NS]))
        u[qa + Q_NDR] = (u[qa + Q_NDR] - corr) & U64
        if w[qa + Q_WAITING]:  # else the floor is moot and the leaf stays empty
            self.touch_locked(led, lb, q)

    def hold_locked(self, lb: int, sa: int, now: int) -> int:
        """Kubernetes frees a finished request's seats at once."""
        return 0

    def queues_moved_locked(self, led, lb: int) -> None:
        """The level's queues were renumbered or re-packed (a queue removed, a relayout):
        rebuild what is indexed by queue (the tree)."""
        led._rebuild_tree_locked(lb)

    def repair_locked(self, led, lb: int) -> None:
        """After a repair rebuilt the level's FIFOs from the slot table: the anti-windup floor
        on every queue with a head, then the tree."""
        w, u = self._w, self._u
        for q in range(w[lb + L_NQ]):
            qa = led._qa(lb, q)
            if w[qa + Q_WAITING]:  # anti-windup floor, as after any queue change
                head_r = u[self._sb + w[qa + Q_HEAD] * SLOT_WORDS + S_ARRIVAL_R]
                if u[qa + Q_NDR] < head_r:
                    u[qa + Q_NDR] = head_r
        led._rebuild_tree_locked(lb)

    def advance_epoch_locked(self, led, lb: int) -> None:
        """``advanceEpoch`` once R reached ``highR``: R, every busy queue's ``nextDispatchR``
        and its waiting requests' arrival R go down by ``rDecrement``; idle queues restart at 0.
        Counts the advance in ``L_EPOCH_OK`` (or ``L_EPOCH_FAIL`` if anything wrapped)."""
        w, u = self._w, self._u
        u[lb + L_R] = (u[lb + L_R] - R_DECREMENT) & U64
        ok = True
        for q in range(w[lb + L_NQ]):
            qa = led._qa(lb, q)
            if w[qa + Q_WAITING] == 0 and w[qa + Q_EXECUTING] == 0:
                u[qa + Q_NDR] = 0  # the next arrival overwrites it with R
                continue
            old = u[qa + Q_NDR]
            new = (old - R_DECREMENT) & U64
            ok = ok and new <= old
            u[qa + Q_NDR] = new
            s = w[qa + Q_HEAD]
            while s != NIL:
                sa = self._sb + s * SLOT_WORDS
                old = u[sa + S_ARRIVAL_R]
                new = (old - R_DECREMENT) & U64
                ok = ok and new <= old
                u[sa + S_ARRIVAL_R] = new
                s = w[sa + S_NEXT]
        w[lb + (L.L_EPOCH_OK if ok else L.L_EPOCH_FAIL)] += 1
        led._rebuild_tree_locked(lb)
