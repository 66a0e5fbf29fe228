"""The general request path."""

from __future__ import annotations

from bisect import bisect_left

from apf_gunicorn.flowcontrol.shufflesharding import deal
from apf_gunicorn.ledger.layout import (
    EXECUTING,
    H_FREE_HEAD,
    H_SERVICE_ADAPT,
    L_ACTIVE_QUEUES,
    L_C,
    L_CANCELLED,
    L_DESIRED,
    L_DISPATCHED,
    L_ENQUEUES,
    L_EXECUTING,
    L_HAND,
    L_LAST_NS,
    L_QBASE,
    L_QLL,
    L_QSEATS,
    L_QUIESCING,
    L_R,
    L_ROBIN,
    L_SEATS_IN_USE,
    L_SEATS_WAITING,
    L_TIMEDOUT,
    L_USED,
    L_WAITING,
    LEVEL_WORDS,
    LINGERING,
    NIL,
    Q_EXECUTING,
    Q_NDR,
    Q_SEATS,
    Q_WAITING,
    Q_WORK_SUM,
    QUEUE_WORDS,
    S_AL,
    S_ARRIVAL_NS,
    S_ARRIVAL_R,
    S_FINAL,
    S_FINAL_WORK,
    S_HELD,
    S_LEVEL,
    S_MAX_SEATS,
    S_QUEUE,
    S_SEQ,
    S_START_NS,
    S_STATE,
    S_STATS,
    S_TOTAL_WORK,
    WAITING,
)
from apf_gunicorn.ledger.records import (
    EXECUTE,
    QUEUED,
    REJECTED,
    AdmitResult,
)
from apf_gunicorn.ledger.seatseconds import (
    U64,
    duration_per_seat,
)
from apf_gunicorn.ledger.stats import DURATION_BOUNDS_NS as _DUR
from apf_gunicorn.ledger.stats import (
    E_DISPATCHED,
    E_EXEC_R,
    E_REJECTED,
    E_WAIT_X,
    E_WORK,
    E_WORK_SUM,
    EXEC_STRIDE,
    ND,
    R_CANCELLED,
    R_CONCURRENCY_LIMIT,
    R_NO_SLOT,
    R_QUEUE_FULL,
    R_TIME_OUT,
    WORK_BOUNDS,
)


class RequestPath:
    """The general request path."""

    def _admit_slow(self, level, flow_hash, initial, final, al, owner, now, fs_index, detail,
                    granted, watch) -> AdmitResult:
        w, u = self._w, self._u
        lb = self._lvb + level * LEVEL_WORDS
        if not (0 <= level < self._lay.cap.levels and w[lb + L_USED]):
            lb = self._lb(level)  # raises the precise error
        if now > w[lb + L_LAST_NS]:
            self._sync(lb, now)
        ms = initial if initial >= final else final
        eb = self._stats_entry(lb, level, fs_index)
        bw = eb + E_WORK + bisect_left(WORK_BOUNDS, ms)
        self._log(bw, eb + E_WORK_SUM)  # one event: this arrival and its outcome
        w[bw] += 1
        w[eb + E_WORK_SUM] += ms
        desired = w[lb + L_DESIRED]
        if w[H_FREE_HEAD] == NIL:
            self._count_rejection(lb)
            self._note_rejection(eb, R_NO_SLOT, desired < 0)
            self._commit()
            return AdmitResult(REJECTED, -1, 0, "no-slot", granted)
        if desired < 1:
            # queueless: exempt (always) or reject-type (concurrency-limit)
            if not self._can_accommodate(lb, ms):
                self._count_rejection(lb)
                self._note_rejection(eb, R_CONCURRENCY_LIMIT, False)
                self._commit()
                return AdmitResult(REJECTED, -1, 0, "concurrency-limit", granted)
            s, sa, gen = self._alloc(level, owner, flow_hash, fs_index, initial, final, al,
                                     now, detail)
            self._log(sa + S_STATE, lb + L_DISPATCHED,
                      eb + (E_WAIT_X if desired == 0 else E_DISPATCHED))
            w[sa + S_STATS] = 2 * eb + watch
            u[sa + S_ARRIVAL_R] = u[lb + L_R]
            w[sa + S_SEQ] = w[lb + L_ENQUEUES]
            w[sa + S_STATE] = EXECUTING
            w[sa + S_START_NS] = now
            w[lb + L_EXECUTING] += 1
            w[lb + L_SEATS_IN_USE] += ms
            w[lb + L_DISPATCHED] += 1
            if desired == 0:  # reject-type levels are not exempt: a 0 s wait
                w[eb + E_WAIT_X] += 1
            else:
                w[eb + E_DISPATCHED] += 1
            self._commit()
            self._demand(lb, now)
            return AdmitResult(EXECUTE, s, gen, "", granted)

        hs = w[lb + L_HAND]
        hand = deal(flow_hash & U64, desired, hs)
        enq = w[lb + L_ENQUEUES]
        w[lb + L_ENQUEUES] = enq + 1
        off = enq % hs
        c = w[lb + L_C]
        in_use = w[lb + L_SEATS_IN_USE]
        qbase = self._qb + w[lb + L_QBASE] * QUEUE_WORDS
        r = u[lb + L_R]

        if (w[lb + L_WAITING] == 0 and in_use < c
                and (in_use + ms <= c or (ms > c and w[lb + L_EXECUTING] == 0))):
            # Fast path: nothing waits anywhere in the level, so every queue's waiting work is
            # 0 and the first card visited wins; the enqueue+dispatch below leaves exactly the
            # state Kubernetes' enqueue-then-dispatch leaves, without touching the tree.
            q = hand[off]
            qa = qbase + q * QUEUE_WORDS
            s, sa, gen = self._alloc(level, owner, flow_hash, fs_index, initial, final, al,
                                     now, detail)
            self._log(sa + S_STATE, lb + L_DISPATCHED, eb + E_WAIT_X)
            w[sa + S_STATS] = 2 * eb + watch
            w[eb + E_WAIT_X] += 1  # dispatched at arrival: a 0 s wait
            u[sa + S_ARRIVAL_R] = r
            w[sa + S_SEQ] = enq
            w[sa + S_QUEUE] = q
            ex = w[qa + Q_EXECUTING]
            ndr = r if ex == 0 else u[qa + Q_NDR]
            if ndr < r:  # the anti-windup floor with this request as head
                ndr = r
            sw = w[lb + L_SEATS_WAITING]
            self._demand_x(lb, now, float(in_use + sw + ms))  # Set() after the enqueue
            held = ms
            if final > c:
                w[sa + S_AL] = duration_per_seat(u[sa + S_FINAL_WORK], float(c))
                w[sa + S_FINAL] = c
                held = initial if initial >= c else c
            w[sa + S_HELD] = held
            w[sa + S_STATE] = EXECUTING
            w[sa + S_START_NS] = now
            w[lb + L_ROBIN] = q
            w[lb + L_EXECUTING] += 1
            w[lb + L_SEATS_IN_USE] = in_use + held
            w[lb + L_DISPATCHED] += 1
            self._commit()
            w[qa + Q_EXECUTING] = ex + 1
            if ex == 0:
                w[lb + L_ACTIVE_QUEUES] += 1
            w[qa + Q_SEATS] += held
            w[lb + L_QSEATS] += held
            if held != ms:
                self._demand_x(lb, now, float(in_use + held + sw))
            u[qa + Q_NDR] = (ndr + u[sa + S_TOTAL_WORK]) & U64
            return AdmitResult(EXECUTE, s, gen, "", granted)

        # shuffle sharding: least waiting work in the hand, visiting from the rotating offset
        best_q = hand[off]
        best = u[qbase + best_q * QUEUE_WORDS + Q_WORK_SUM]
        for i in range(1, hs):
            q = hand[(off + i) % hs]
            ws = u[qbase + q * QUEUE_WORDS + Q_WORK_SUM]
            if ws < best:
                best, best_q = ws, q
        q = best_q
        qa = qbase + q * QUEUE_WORDS
        if in_use >= c and w[qa + Q_WAITING] >= w[lb + L_QLL]:
            self._count_rejection(lb)
            self._note_rejection(eb, R_QUEUE_FULL, False)
            self._commit()
            return AdmitResult(REJECTED, -1, 0, "queue-full", granted)
        s, sa, gen = self._alloc(level, owner, flow_hash, fs_index, initial, final, al, now,
                                 detail)
        w[sa + S_STATS] = 2 * eb + watch
        u[sa + S_ARRIVAL_R] = r
        w[sa + S_SEQ] = enq
        w[sa + S_QUEUE] = q
        self._log(sa + S_STATE)
        w[sa + S_STATE] = WAITING
        self._commit()
        if w[qa + Q_WAITING] == 0 and w[qa + Q_EXECUTING] == 0:
            u[qa + Q_NDR] = r
        self._link_tail(lb, qa, s, sa)
        w[lb + L_WAITING] += 1
        w[lb + L_SEATS_WAITING] += ms
        self._demand(lb, now)
        self._touch(lb, q)
        self._dispatch_all(lb, now, granted)
        if w[sa + S_STATE] == EXECUTING:
            mine = (s, gen, owner)
            granted[:] = [g for g in granted if g != mine]
            return AdmitResult(EXECUTE, s, gen, "", granted)
        return AdmitResult(QUEUED, s, gen, "", granted)

    def _finish_slow(self, s: int, gen: int, now: int, granted: list) -> int:
        sa = self._slot_if(s, gen, EXECUTING)
        if sa < 0:
            return 0
        w = self._w
        level = w[sa + S_LEVEL]
        lb = self._lvb + level * LEVEL_WORDS
        if now > w[lb + L_LAST_NS]:
            self._sync(lb, now)
        st = w[sa + S_STATS]
        ran = now - w[sa + S_START_NS]
        hist = (st >> 1) + E_EXEC_R + (st & 1) * EXEC_STRIDE
        w[hist + bisect_left(_DUR, ran)] += 1
        if ran > 0:
            self._f[hist + ND] += ran / 1e9
        self._end_main_phase(lb, sa, now)
        if w[H_SERVICE_ADAPT] and w[sa + S_QUEUE] != NIL:
            self._learn(lb, ran)
        al = w[sa + S_AL]
        if al <= 0:
            self._release_seats(lb, level, s, sa, now)
            linger = 0
        else:
            w[sa + S_STATE] = LINGERING
            linger = now + al
        if w[lb + L_WAITING] and w[lb + L_SEATS_IN_USE] < w[lb + L_C]:
            self._dispatch_all(lb, now, granted)
        if w[lb + L_QUIESCING]:
            self._maybe_drop(lb)
        return linger

    def release(self, slot: int, gen: int, now: int) -> list:
        """The additional latency is over: free the lingering seats and dispatch."""
        return self._granting(now, self._release, slot, gen, now)

    def _release(self, granted: list, slot: int, gen: int, now: int) -> None:
        sa = self._slot_if(slot, gen, LINGERING)
        if sa >= 0:
            level = self._w[sa + S_LEVEL]
            lb = self._lvb + level * LEVEL_WORDS
            self._sync(lb, now)
            self._release_seats(lb, level, slot, sa, now)
            self._dispatch_all(lb, now, granted)
            self._maybe_drop(lb)

    def cancel(self, slot: int, gen: int, now: int, reason: str = "time-out") -> bool:
        """Remove a waiting request (``time-out`` or ``cancelled``). No dispatch follows, as
        in Kubernetes. False: it is no longer waiting (already granted: run and finish it)."""
        return self._locked(now, self._cancel, slot, gen, now, reason)

    def _cancel(self, s: int, gen: int, now: int, reason: str) -> bool:
        sa = self._slot_if(s, gen, WAITING)
        if sa < 0:
            return False
        w = self._w
        lb = self._lvb + w[sa + S_LEVEL] * LEVEL_WORDS
        self._sync(lb, now)
        self._drop_waiting(lb, s, sa, now)  # one event: the drop and its counts
        self._count_rejection(lb)
        eb = w[sa + S_STATS] >> 1
        r = R_TIME_OUT if reason == "time-out" else R_CANCELLED
        self._log(lb + L_CANCELLED, lb + L_TIMEDOUT, eb + E_REJECTED + r)
        w[lb + L_CANCELLED] += 1
        if r == R_TIME_OUT:
            w[lb + L_TIMEDOUT] += 1
        w[eb + E_REJECTED + r] += 1
        self._observe_wait(eb, now - w[sa + S_ARRIVAL_NS])  # Kubernetes observes it too
        self._commit()
        self._maybe_drop(lb)
        return True

    def _drop_waiting(self, lb: int, s: int, sa: int, now: int) -> None:
        """Take a waiting request out (an event that its caller counts and commits)."""
        w = self._w
        q = w[sa + S_QUEUE]
        self._log(sa + S_STATE, sa + S_QUEUE)
        self._unlink(lb, self._qa(lb, q), sa)
        w[lb + L_WAITING] -= 1
        w[lb + L_SEATS_WAITING] -= w[sa + S_MAX_SEATS]
        self._demand(lb, now)
        self._touch(lb, q)
        self._free(s, sa)
