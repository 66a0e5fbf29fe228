"""Kubernetes' queueset dispatch policy."""

from __future__ import annotations

from array import array

from apf_gunicorn.ledger import layout as L
from apf_gunicorn.ledger.layout import (
    EXECUTING,
    FREE,
    L_ACTIVE_QUEUES,
    L_C,
    L_DESIRED,
    L_DISPATCHED,
    L_EXECUTING,
    L_NQ,
    L_QBASE,
    L_QSEATS,
    L_R,
    L_ROBIN,
    L_SEATS_IN_USE,
    L_SEATS_WAITING,
    L_TBASE,
    L_TP,
    L_WAITING,
    NIL,
    Q_EXECUTING,
    Q_HEAD,
    Q_NDR,
    Q_SEATS,
    Q_TAIL,
    Q_WAITING,
    QUEUE_WORDS,
    S_AL,
    S_ARRIVAL_NS,
    S_ARRIVAL_R,
    S_FINAL,
    S_FINAL_WORK,
    S_GEN,
    S_HELD,
    S_INITIAL,
    S_LEVEL,
    S_MAX_SEATS,
    S_NEXT,
    S_OWNER,
    S_QUEUE,
    S_SERVICE_NS,
    S_START_NS,
    S_STATE,
    S_STATS,
    S_TOTAL_WORK,
    SLOT_WORDS,
)
from apf_gunicorn.ledger.seatseconds import (
    R_DECREMENT,
    U64,
    duration_per_seat,
    seats_ns_times,
)


class KubernetesQueueSet:
    """Kubernetes queueset rules."""

    def _can_accommodate(self, lb: int, seats: int) -> bool:
        w = self._w
        if w[lb + L_DESIRED] < 0:
            return True
        c = w[lb + L_C]
        if seats > c:
            return w[lb + L_EXECUTING] == 0  # the too-wide rule
        return w[lb + L_SEATS_IN_USE] + seats <= c

    def _dispatch_all(self, lb: int, now: int, granted: list) -> None:
        w = self._w
        while (w[lb + L_WAITING] != 0 and w[lb + L_SEATS_IN_USE] < w[lb + L_C]
               and self._dispatch_one(lb, now, granted)):
            pass

    def _dispatch_one(self, lb: int, now: int, granted: list) -> bool:
        """``findDispatchQueueToBoundLocked`` + ``dispatchLocked``."""
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
        q = self._first_le(tb, p, (robin + 1) % nq, best)
        if q < 0:
            q = self._first_le(tb, p, 0, best)
        qa = self._qb + (w[lb + L_QBASE] + q) * QUEUE_WORDS
        s = w[qa + Q_HEAD]
        sa = self._sb + s * SLOT_WORDS
        ms = w[sa + S_MAX_SEATS]
        if not self._can_accommodate(lb, ms):
            w[lb + L_ROBIN] = robin % nq  # head-of-line blocking: nothing else is tried
            return False
        self._unlink(lb, qa, sa)
        c = w[lb + L_C]
        initial = w[sa + S_INITIAL]
        held = ms
        if w[sa + S_FINAL] > c:  # final-seat cap, preserving the tail's area
            w[sa + S_AL] = duration_per_seat(u[sa + S_FINAL_WORK], float(c))
            w[sa + S_FINAL] = c
            held = initial if initial >= c else c
        w[lb + L_ROBIN] = q
        w[lb + L_WAITING] -= 1
        w[lb + L_SEATS_WAITING] -= ms
        self._log(sa + S_STATE, lb + L_DISPATCHED)  # one event: this dispatch
        w[sa + S_STATE] = EXECUTING
        w[sa + S_START_NS] = now
        w[sa + S_HELD] = held
        w[lb + L_EXECUTING] += 1
        w[lb + L_SEATS_IN_USE] += held
        w[lb + L_DISPATCHED] += 1
        self._observe_wait(w[sa + S_STATS] >> 1, now - w[sa + S_ARRIVAL_NS])
        self._commit()
        ex = w[qa + Q_EXECUTING]
        w[qa + Q_EXECUTING] = ex + 1
        if ex == 0 and w[qa + Q_WAITING] == 0:
            w[lb + L_ACTIVE_QUEUES] += 1
        w[qa + Q_SEATS] += held
        w[lb + L_QSEATS] += held
        self._demand(lb, now)
        u[qa + Q_NDR] = (u[qa + Q_NDR] + u[sa + S_TOTAL_WORK]) & U64
        self._touch(lb, q)
        granted.append((s, w[sa + S_GEN], w[sa + S_OWNER]))
        return True

    def _touch(self, lb: int, q: int) -> None:
        """``boundNextDispatchLocked`` (anti-windup floor) plus the queue's tree leaf."""
        w, u = self._w, self._u
        qa = self._qa(lb, q)
        if w[qa + Q_WAITING]:
            sa = self._sb + w[qa + Q_HEAD] * SLOT_WORDS
            ndr = u[qa + Q_NDR]
            ar = u[sa + S_ARRIVAL_R]
            if ndr < ar:
                u[qa + Q_NDR] = ndr = ar
            self._set_leaf(lb, q, (ndr + u[sa + S_TOTAL_WORK]) & U64)
        else:
            self._set_leaf(lb, q, U64)

    def _release_seats(self, lb: int, level: int, s: int, sa: int, now: int) -> None:
        """``releaseSeatsLocked`` + ``removeQueueIfEmptyLocked``; frees the slot."""
        w = self._w
        held = w[sa + S_HELD]
        w[lb + L_SEATS_IN_USE] -= held
        self._demand(lb, now)
        q = w[sa + S_QUEUE]
        self._free(s, sa)
        if q != NIL:
            qa = self._qa(lb, q)
            w[qa + Q_SEATS] -= held
            w[lb + L_QSEATS] -= held
            if (w[lb + L_NQ] > w[lb + L_DESIRED] and w[qa + Q_WAITING] == 0
                    and w[qa + Q_EXECUTING] == 0):
                self._remove_queue(lb, level, q)

    def _remove_queue(self, lb: int, level: int, q: int) -> None:
        """Attrition: drop queue ``q``, shift later queues down, renumber their slots."""
        w = self._w
        nq = w[lb + L_NQ]
        base = self._qa(lb, 0)
        w[lb + L_QSEATS] -= w[base + q * QUEUE_WORDS + Q_SEATS]  # lingering seats leave R's rate
        if q + 1 < nq:
            moved = w[base + (q + 1) * QUEUE_WORDS: base + nq * QUEUE_WORDS].tolist()
            w[base + q * QUEUE_WORDS: base + (nq - 1) * QUEUE_WORDS] = array("q", moved)
        last = base + (nq - 1) * QUEUE_WORDS
        w[last: last + QUEUE_WORDS] = array("q", [0] * QUEUE_WORDS)
        w[last + Q_HEAD] = NIL
        w[last + Q_TAIL] = NIL
        w[lb + L_NQ] = nq - 1
        sb = self._sb
        levels, states, queues = self._slot_columns(S_LEVEL, S_STATE, S_QUEUE)
        for s in range(len(states)):
            if states[s] != FREE and levels[s] == level and queues[s] >= q:
                # lingering slots of the removed queue keep their seats but lose the queue
                w[sb + s * SLOT_WORDS + S_QUEUE] = NIL if queues[s] == q else queues[s] - 1
        if w[lb + L_ROBIN] >= q:
            w[lb + L_ROBIN] -= 1
        self._rebuild_tree(lb)

    def _end_main_phase(self, lb: int, sa: int, now: int) -> None:
        """``finishRequestLocked``'s bookkeeping for a request whose main phase ended (finished,
        or its worker died): one fewer executing, and its queue's nextDispatchR corrected by the
        actual service time."""
        w, u = self._w, self._u
        w[lb + L_EXECUTING] -= 1
        q = w[sa + S_QUEUE]
        if q == NIL:
            return
        qa = self._qa(lb, q)
        ex = w[qa + Q_EXECUTING] - 1
        w[qa + Q_EXECUTING] = ex
        if ex == 0 and w[qa + Q_WAITING] == 0:
            w[lb + L_ACTIVE_QUEUES] -= 1
        # nextDispatchR -= initial*(G - S): usually negative, so uint64 wraparound adds
        corr = seats_ns_times(w[sa + S_INITIAL], w[sa + S_SERVICE_NS] - (now - w[sa + S_START_NS]))
        u[qa + Q_NDR] = (u[qa + Q_NDR] - corr) & U64
        if w[qa + Q_WAITING]:  # else the floor is moot and the leaf stays empty
            self._touch(lb, q)

    def _advance_epoch(self, lb: int) -> None:
        w, u = self._w, self._u
        u[lb + L_R] = (u[lb + L_R] - R_DECREMENT) & U64
        ok = True
        for q in range(w[lb + L_NQ]):
            qa = self._qa(lb, q)
            if w[qa + Q_WAITING] == 0 and w[qa + Q_EXECUTING] == 0:
                u[qa + Q_NDR] = 0  # the next arrival overwrites it with R
                continue
            old = u[qa + Q_NDR]
            new = (old - R_DECREMENT) & U64
            ok = ok and new <= old
            u[qa + Q_NDR] = new
            s = w[qa + Q_HEAD]
            while s != NIL:
                sa = self._sa(s)
                old = u[sa + S_ARRIVAL_R]
                new = (old - R_DECREMENT) & U64
                ok = ok and new <= old
                u[sa + S_ARRIVAL_R] = new
                s = w[sa + S_NEXT]
        w[lb + (L.L_EPOCH_OK if ok else L.L_EPOCH_FAIL)] += 1
        self._rebuild_tree(lb)
