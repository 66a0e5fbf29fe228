"""The request operations: admit, finish, release, cancel, and the general path behind them.

Each operation takes the lock, passes the ledger's funnel (``Ledger._begin_locked``: repair and
the dirty mark), then runs. ``admit`` and ``finish`` first try their fast paths
(``fastpath.py``, mirrored by ``_fastpath.c``); what those decline comes here, to the general
path, which is the reference every fast path is tested against. Which queue a request waits in
and which waits next is the level's fairness (``queueset.py``, reached through the
``Ledger`` routers); this module owns slots, seats, counters, lingering and queue attrition::

    res = led.admit(level, flow_hash, 1, 0, 0, owner=0, now=now)
    granted, linger_until = led.finish(res.slot, res.gen, later)
    if linger_until: granted += led.release(res.slot, res.gen, linger_until)
"""

from __future__ import annotations

from array import array
from bisect import bisect_left

from apf_gunicorn.flowcontrol.shufflesharding import deal
from apf_gunicorn.ledger.layout import (
    EXECUTING,
    FREE,
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
    L_NQ,
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
    Q_HEAD,
    Q_SEATS,
    Q_TAIL,
    Q_WAITING,
    Q_WORK_SUM,
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
    S_QUEUE,
    S_SEQ,
    S_START_NS,
    S_STATE,
    S_STATS,
    SLOT_WORDS,
    WAITING,
)
from apf_gunicorn.ledger.records import (
    EXECUTE,
    QUEUED,
    REJECTED,
    AdmitResult,
)
from apf_gunicorn.ledger.seatseconds import U64, duration_per_seat
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
    R_THREAD_SHARE,
    R_TIME_OUT,
    REASONS,
    WORK_BOUNDS,
)

# _verdict_locked's outcomes other than a rejection (whose verdict is the reason's index, >= 0)
_RUN = -1  # a queueless level with room: the request runs at once
_WAIT = -2  # a queuing level: the request waits in the queue picked


class RequestPath:
    """The request operations of ``Ledger`` (a mixin: it uses the ledger's buffer views)."""

    def admit(self, level: int, flow_hash: int, initial_seats: int, final_seats: int,
              additional_latency_ns: int, owner: int, now: int, fs_index: int = 0,
              detail: bytes = b"", watch: bool = False) -> AdmitResult:
        """``StartRequest``: decide whether a request runs now, waits, or is rejected.

        With the C fast paths bound, the ledger's ``admit`` is their entry ``admit_call``
        instead (see ``FastPaths._accelerate``), which hands what it does not complete to
        :meth:`_admit_resume`; this method is then the reference.

        Args:
            level: the level index (from :meth:`configure`).
            flow_hash: the flow's 64-bit hash (shuffle sharding).
            initial_seats: seats while the request runs; final_seats and
                additional_latency_ns: seats held for that long after it finishes (0, 0: none).
            owner: the caller's worker index (who is woken on a grant, what a reap drops).
            now: the caller's monotonic ns.
            fs_index: the FlowSchema index (the stats entry); watch: the execution histogram's
                type ("watch" vs "regular").
            detail: opaque bytes kept with the slot for ``dump_requests`` (truncated to
                ``Capacity.detail_bytes``).
        Returns:
            :class:`AdmitResult`: ``outcome`` EXECUTE (run now), QUEUED (wait until
            ``(slot, gen)`` shows up in some call's grants) or REJECTED (``reason``
            ``queue-full``, ``concurrency-limit`` or ``no-slot``); ``granted`` lists the other
            requests this call dispatched, as ``(slot, gen, owner)``.
        Raises:
            ValueError: ``level`` is out of range or not configured.
        """
        return self._admit_locked(self._lock.acquire(), level, flow_hash, initial_seats,
                                  final_seats, additional_latency_ns, owner, now, fs_index,
                                  detail, watch)

    def _admit_resume(self, decline, level: int, flow_hash: int, initial_seats: int,
                      final_seats: int, additional_latency_ns: int, owner: int, now: int,
                      fs_index: int = 0, detail: bytes = b"", watch: bool = False) -> AdmitResult:
        """Where the C ``admit_call`` hands over: ``decline`` as ``_fastpath.c`` returns it
        (None: the lock is not held; -1: held; a pid: held, its previous holder died)."""
        dead = (self._lock.acquire() if decline is None
                else (None if decline < 0 else decline))
        return self._admit_locked(dead, level, flow_hash, initial_seats, final_seats,
                                  additional_latency_ns, owner, now, fs_index, detail, watch)

    def _admit_slow_locked(self, level, flow_hash, initial, final, al, owner, now, fs_index,
                           detail, granted, watch) -> AdmitResult:
        """The general path of :meth:`admit`: the request cannot run at once (something waits,
        no free slot, no room, a queueless level), or the level is not configured."""
        w, u = self._w, self._u
        lb = self._lvb + level * LEVEL_WORDS
        if not (0 <= level < self._lay.cap.levels and w[lb + L_USED]):
            lb = self._lb(level)  # raises the precise error
        if now > w[lb + L_LAST_NS]:
            self._sync_locked(lb, now)
        desired = w[lb + L_DESIRED]
        ms = initial if initial >= final else final
        eb = self._stats_entry_locked(lb, level, fs_index)
        bw = eb + E_WORK + bisect_left(WORK_BOUNDS, ms)
        self._log_locked(bw, eb + E_WORK_SUM)  # one event: this arrival and its outcome
        w[bw] += 1
        w[eb + E_WORK_SUM] += ms
        verdict, q, qa = self._verdict_locked(lb, flow_hash, ms)
        if verdict == _WAIT:
            return self._enqueue_locked(lb, level, q, qa, (flow_hash, initial, final, al, owner,
                                                           now, fs_index, detail),
                                        eb, ms, watch, granted)
        if verdict != _RUN:
            if verdict == R_QUEUE_FULL:
                w[lb + L_ENQUEUES] += 1  # Kubernetes' queue choice counts a rejected arrival
            self._count_rejection_locked(lb)
            self._note_rejection_locked(eb, verdict, desired < 0)
            self._commit_locked()
            return AdmitResult(REJECTED, -1, 0, REASONS[verdict], granted)
        # a queueless level with room: exempt (always) or reject-type
        s, sa, gen = self._alloc_locked(level, owner, flow_hash, fs_index, initial, final, al,
                                        now, detail)
        self._log_locked(sa + S_STATE, lb + L_DISPATCHED,
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
        self._commit_locked()
        self._demand_locked(lb, now)
        return AdmitResult(EXECUTE, s, gen, "", granted)

    def _wait_locked(self, lb: int, level: int, q: int, qa: int, req: tuple, eb: int, ms: int,
                     watch: int) -> tuple[int, int, int]:
        """Kubernetes' admission of a request that waits, which both fairnesses use, once
        :meth:`_verdict_locked` said it waits in queue ``q``: a slot waiting at the queue's
        tail (the level's enqueue and waiting counts included; the seat demand is the
        caller's, after its own bookkeeping).

        Args:
            lb: the level's word address; ``level`` its index; ``q``, ``qa``: the queue and its
                word address.
            req: ``(flow_hash, initial, final, al, owner, now, fs_index, detail)``.
            eb: the request's stats entry; ``ms``: max(initial, final) seats; ``watch``: 0/1.
        Returns:
            ``(slot, slot address, gen)``.
        """
        w, u = self._w, self._u
        flow_hash, initial, final, al, owner, now, fs_index, detail = req
        enq = w[lb + L_ENQUEUES]
        w[lb + L_ENQUEUES] = enq + 1
        s, sa, gen = self._alloc_locked(level, owner, flow_hash, fs_index, initial, final, al,
                                        now, detail)
        w[sa + S_STATS] = 2 * eb + watch
        u[sa + S_ARRIVAL_R] = u[lb + L_R]
        w[sa + S_SEQ] = enq
        w[sa + S_QUEUE] = q
        self._log_locked(sa + S_STATE)
        w[sa + S_STATE] = WAITING
        self._commit_locked()
        self._link_tail_locked(lb, qa, s, sa)
        w[lb + L_WAITING] += 1
        w[lb + L_SEATS_WAITING] += ms
        return s, sa, gen

    def _verdict_locked(self, lb: int, flow_hash: int, ms: int) -> tuple[int, int, int]:
        """What :meth:`admit` does with an arrival its fast path did not run, in admit's order,
        reading only (R synced): the one copy of that decision, for ``admit``'s general path
        and :meth:`reject_if_full`. No free slot: reject ``no-slot``. A queuing level: the
        queue shuffle sharding picks; reject ``queue-full`` when every seat is busy and that
        queue holds its length limit, else the request waits there. A queueless level: run it
        when it fits (exempt: always), else reject ``concurrency-limit``.

        Args:
            lb: the level's word address; ``flow_hash``: the flow's hash; ``ms``:
                max(initial, final) seats.
        Returns:
            ``(verdict, queue, queue address)``: ``verdict`` a rejection reason's index
            (``R_NO_SLOT``, ``R_QUEUE_FULL``, ``R_CONCURRENCY_LIMIT``), ``_WAIT`` or ``_RUN``;
            the queue is the one picked on a queuing level (-1, 0 when none was).
        """
        w = self._w
        if w[H_FREE_HEAD] == NIL:
            return R_NO_SLOT, -1, 0
        if w[lb + L_DESIRED] > 0:
            q, qa = self._choose_queue_locked(lb, flow_hash, w[lb + L_ENQUEUES])
            if w[lb + L_SEATS_IN_USE] >= w[lb + L_C] and w[qa + Q_WAITING] >= w[lb + L_QLL]:
                return R_QUEUE_FULL, q, qa
            return _WAIT, q, qa
        if self._can_accommodate_locked(lb, ms):
            return _RUN, -1, 0
        return R_CONCURRENCY_LIMIT, -1, 0

    def _choose_queue_locked(self, lb: int, flow_hash: int, enq: int) -> tuple[int, int]:
        """Kubernetes' queue choice for an arrival: the least waiting work in the flow's hand,
        visiting from the rotating offset ``enq`` (the level's enqueue count before it).

        Returns:
            ``(queue, queue address)``.
        """
        w, u = self._w, self._u
        hs = w[lb + L_HAND]
        hand = deal(flow_hash & U64, w[lb + L_DESIRED], hs)
        off = enq % hs
        qbase = self._qb + w[lb + L_QBASE] * QUEUE_WORDS
        best_q = hand[off]
        best = u[qbase + best_q * QUEUE_WORDS + Q_WORK_SUM]
        for i in range(1, hs):
            q = hand[(off + i) % hs]
            ws = u[qbase + q * QUEUE_WORDS + Q_WORK_SUM]
            if ws < best:
                best, best_q = ws, q
        return best_q, qbase + best_q * QUEUE_WORDS

    def reject_if_full(self, level: int, flow_hash: int, initial_seats: int, final_seats: int,
                       additional_latency_ns: int, owner: int, now: int, fs_index: int = 0,
                       detail: bytes = b"", watch: bool = False) -> str:
        """:meth:`admit` for a caller that acts only on a rejection (a worker's poller, which
        answers 429 without a thread): when ``admit`` would reject the request now, reject it
        exactly as ``admit`` does (the same counts, under the same lock); otherwise write
        nothing, and the caller admits it later as usual. A rejection creates no slot, so
        nothing is held for the caller.

        Args: as :meth:`admit`.
        Returns:
            The rejection reason (``queue-full``, ``concurrency-limit``, ``no-slot``), or ``""``
            when ``admit`` would run or queue the request (nothing was counted).
        Raises:
            ValueError: ``level`` is out of range or not configured.
        """
        return self._locked(now, self._reject_if_full_locked, level, flow_hash, initial_seats,
                            final_seats, additional_latency_ns, owner, now, fs_index, detail,
                            watch)

    def _reject_if_full_locked(self, level, flow_hash, initial, final, al, owner, now,
                               fs_index, detail, watch) -> str:
        w = self._w
        lb = self._lb(level)
        if now > w[lb + L_LAST_NS]:
            self._sync_locked(lb, now)
        ms = initial if initial >= final else final
        verdict, _, _ = self._verdict_locked(lb, flow_hash, ms)
        if verdict < 0:  # admit runs or queues it
            return ""
        if verdict == R_QUEUE_FULL:
            w[lb + L_ENQUEUES] += 1  # as admit's rejection
        self._reject_arrival_locked(lb, self._stats_entry_locked(lb, level, fs_index), ms,
                                    verdict)
        return REASONS[verdict]

    def _start_locked(self, lb: int, qa: int, sa: int, now: int) -> int:
        """A waiting request, already out of its queue's FIFO, starts executing (what both
        fairnesses do once they have chosen it): the final-seat cap (preserving the
        tail's area), the level's and the queue's counts and the wait observed as one event,
        then the seat demand.

        Returns:
            The seats it holds.
        """
        w, u = self._w, self._u
        ms = w[sa + S_MAX_SEATS]
        c = w[lb + L_C]
        initial = w[sa + S_INITIAL]
        held = ms
        if w[sa + S_FINAL] > c:
            w[sa + S_AL] = duration_per_seat(u[sa + S_FINAL_WORK], float(c))
            w[sa + S_FINAL] = c
            held = initial if initial >= c else c
        w[lb + L_WAITING] -= 1
        w[lb + L_SEATS_WAITING] -= ms
        self._log_locked(sa + S_STATE, lb + L_DISPATCHED)  # one event: this dispatch
        w[sa + S_STATE] = EXECUTING
        w[sa + S_START_NS] = now
        w[sa + S_HELD] = held
        w[lb + L_EXECUTING] += 1
        w[lb + L_SEATS_IN_USE] += held
        w[lb + L_DISPATCHED] += 1
        self._observe_wait_locked(w[sa + S_STATS] >> 1, now - w[sa + S_ARRIVAL_NS])
        self._commit_locked()
        ex = w[qa + Q_EXECUTING]
        w[qa + Q_EXECUTING] = ex + 1
        if ex == 0 and w[qa + Q_WAITING] == 0:
            w[lb + L_ACTIVE_QUEUES] += 1
        w[qa + Q_SEATS] += held
        w[lb + L_QSEATS] += held
        self._demand_locked(lb, now)
        return held

    @staticmethod
    def _admitted(s: int, sa_state: int, gen: int, owner: int, granted: list) -> AdmitResult:
        """The outcome of a request that was made to wait and then dispatched what fits:
        EXECUTE (taken out of ``granted``: the caller runs it) when that dispatch picked it,
        else QUEUED."""
        if sa_state == EXECUTING:
            mine = (s, gen, owner)
            granted[:] = [g for g in granted if g != mine]
            return AdmitResult(EXECUTE, s, gen, "", granted)
        return AdmitResult(QUEUED, s, gen, "", granted)

    def _can_accommodate_locked(self, lb: int, seats: int) -> bool:
        """Whether ``seats`` more fit in the level now (exempt: always; wider than the limit:
        only when nothing executes, Kubernetes' too-wide rule)."""
        w = self._w
        if w[lb + L_DESIRED] < 0:
            return True
        c = w[lb + L_C]
        if seats > c:
            return w[lb + L_EXECUTING] == 0  # the too-wide rule
        return w[lb + L_SEATS_IN_USE] + seats <= c

    def finish(self, slot: int, gen: int, now: int) -> tuple[list, int]:
        """The request's main phase is over (``finishRequestAndDispatchAsMuchAsPossible``).

        With the C fast paths bound, the C entry ``finish_call`` replaces it, as for
        :meth:`admit`.

        Args:
            slot, gen: the request, as :meth:`admit` returned it.
            now: the caller's monotonic ns.
        Returns:
            ``(granted, linger_until_ns)``: the requests the freed seats dispatched, as
            ``(slot, gen, owner)``, and when to call :meth:`release` (0: the seats are free
            already). A stale or unknown ``(slot, gen)`` is a no-op: ``([], 0)``.
        """
        return self._finish_locked(self._lock.acquire(), slot, gen, now)

    def _finish_resume(self, decline, slot: int, gen: int, now: int) -> tuple[list, int]:
        """Where the C ``finish_call`` hands over (see :meth:`_admit_resume`)."""
        dead = (self._lock.acquire() if decline is None
                else (None if decline < 0 else decline))
        return self._finish_locked(dead, slot, gen, now)

    def _finish_slow_locked(self, s: int, gen: int, now: int, granted: list) -> int:
        """The general path of :meth:`finish`; returns ``linger_until_ns``."""
        sa = self._slot_if_locked(s, gen, EXECUTING)
        if sa < 0:
            return 0
        w = self._w
        level = w[sa + S_LEVEL]
        lb = self._lvb + level * LEVEL_WORDS
        if now > w[lb + L_LAST_NS]:
            self._sync_locked(lb, now)
        st = w[sa + S_STATS]
        ran = now - w[sa + S_START_NS]
        hist = (st >> 1) + E_EXEC_R + (st & 1) * EXEC_STRIDE
        w[hist + bisect_left(_DUR, ran)] += 1
        if ran > 0:
            self._f[hist + ND] += ran / 1e9
        al = w[sa + S_AL]
        # seats handed straight back to a flow in a burst may be held (docs/fairness.md)
        hold = (self._fairness_locked(lb).hold_locked(lb, sa, now)
                if al <= 0 and w[lb + L_WAITING] else 0)
        self._end_main_phase_locked(lb, sa, now)
        if w[H_SERVICE_ADAPT] and w[sa + S_QUEUE] != NIL:
            self._learn_locked(lb, ran)
        if al <= 0 and not hold:
            self._release_seats_locked(lb, level, s, sa, now)
            linger = 0
        else:
            w[sa + S_STATE] = LINGERING
            linger = now + al if al > 0 else hold
        if w[lb + L_WAITING] and w[lb + L_SEATS_IN_USE] < w[lb + L_C]:
            self._dispatch_all_locked(lb, now, granted)
        if w[lb + L_QUIESCING]:
            self._maybe_drop_locked(lb)
        return linger

    def _end_main_phase_locked(self, lb: int, sa: int, now: int, learn: bool = True) -> None:
        """``finishRequestLocked``'s bookkeeping for a request whose main phase ended (finished,
        or its worker died): one fewer executing, then the fairness corrects its queue's charge
        by the time it really ran."""
        w = self._w
        w[lb + L_EXECUTING] -= 1
        q = w[sa + S_QUEUE]
        if q == NIL:
            return
        qa = self._qa(lb, q)
        ex = w[qa + Q_EXECUTING] - 1
        w[qa + Q_EXECUTING] = ex
        if ex == 0 and w[qa + Q_WAITING] == 0:
            w[lb + L_ACTIVE_QUEUES] -= 1
        self._main_phase_ended_locked(lb, q, qa, sa, now, learn)

    def _release_seats_locked(self, lb: int, level: int, s: int, sa: int, now: int) -> None:
        """``releaseSeatsLocked`` + ``removeQueueIfEmptyLocked``; frees the slot."""
        w = self._w
        held = w[sa + S_HELD]
        w[lb + L_SEATS_IN_USE] -= held
        self._demand_locked(lb, now)
        q = w[sa + S_QUEUE]
        self._free_locked(s, sa)
        if q != NIL:
            qa = self._qa(lb, q)
            w[qa + Q_SEATS] -= held
            w[lb + L_QSEATS] -= held
            if (w[lb + L_NQ] > w[lb + L_DESIRED] and w[qa + Q_WAITING] == 0
                    and w[qa + Q_EXECUTING] == 0):
                self._remove_queue_locked(lb, level, q)

    def _remove_queue_locked(self, lb: int, level: int, q: int) -> None:
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
        levels, states, queues = self._slot_columns_locked(S_LEVEL, S_STATE, S_QUEUE)
        for s in range(len(states)):
            if states[s] != FREE and levels[s] == level and queues[s] >= q:
                # lingering slots of the removed queue keep their seats but lose the queue
                w[sb + s * SLOT_WORDS + S_QUEUE] = NIL if queues[s] == q else queues[s] - 1
        if w[lb + L_ROBIN] >= q:
            w[lb + L_ROBIN] -= 1
        self._queues_moved_locked(lb)

    def release(self, slot: int, gen: int, now: int) -> list:
        """The request's additional latency is over: free its lingering seats (the lingering-release
        callback of Kubernetes) and dispatch what they allow.

        Args:
            slot, gen: the request, as :meth:`admit` returned it.
            now: the caller's monotonic ns (``finish``'s ``linger_until_ns`` or later).
        Returns:
            The requests dispatched, as ``(slot, gen, owner)``; ``[]`` for a stale or unknown
            ``(slot, gen)`` or a slot that is not lingering (a no-op).
        """
        return self._granting(now, self._release_locked, slot, gen, now)[0]

    def _release_locked(self, granted: list, slot: int, gen: int, now: int) -> None:
        sa = self._slot_if_locked(slot, gen, LINGERING)
        if sa >= 0:
            level = self._w[sa + S_LEVEL]
            lb = self._lvb + level * LEVEL_WORDS
            self._sync_locked(lb, now)
            self._release_seats_locked(lb, level, slot, sa, now)
            self._dispatch_all_locked(lb, now, granted)
            self._maybe_drop_locked(lb)

    def dispatched(self, slot: int, gen: int) -> bool:
        """Whether request ``(slot, gen)`` has been dispatched and not yet finished: the truth a
        woken request checks before it runs (a wake-up is only a hint: it may be stale or forged).

        Two words are read without the lock first. While the request's own thread has not
        finished it, only a dispatch changes them (WAITING to EXECUTING), and every grant is
        sent after the dispatching call committed and released the lock, so a read that finds
        it still waiting is the answer. A read that finds it executing is confirmed under the
        lock: a holder that died inside a dispatch leaves words that its repair rolls back.

        Args:
            slot, gen: the request, as :meth:`admit` returned it.
        Returns:
            True when the slot has this generation and is executing.
        """
        if not 0 <= slot < self._lay.cap.slots:
            return False
        w = self._w
        sa = self._sb + slot * SLOT_WORDS
        if w[sa + S_GEN] != gen or w[sa + S_STATE] != EXECUTING:
            return False
        return self._locked(None, self._slot_if_locked, slot, gen, EXECUTING) >= 0

    def cancel(self, slot: int, gen: int, now: int, reason: str = "time-out") -> bool:
        """Remove a waiting request whose wait ended (its context is done, in Kubernetes). No
        dispatch follows, as in Kubernetes.

        Args:
            slot, gen: the request, as :meth:`admit` returned it.
            now: the caller's monotonic ns.
            reason: ``"time-out"`` (counted as rejected, cancelled and timed out),
                ``"thread-share"`` (its worker gave its thread to another flow's request:
                rejected and cancelled) or anything else, counted as ``"cancelled"``.
        Returns:
            True when it was waiting and is now removed; False when it is no longer waiting (it
            was granted: the caller must run it and :meth:`finish` it after all).
        """
        return self._locked(now, self._cancel_locked, slot, gen, now, reason)

    def _cancel_locked(self, s: int, gen: int, now: int, reason: str) -> bool:
        sa = self._slot_if_locked(s, gen, WAITING)
        if sa < 0:
            return False
        w = self._w
        lb = self._lvb + w[sa + S_LEVEL] * LEVEL_WORDS
        self._sync_locked(lb, now)
        self._drop_waiting_locked(lb, s, sa, now)  # one event: the drop and its counts
        self._count_rejection_locked(lb)
        eb = w[sa + S_STATS] >> 1
        r = (R_TIME_OUT if reason == "time-out" else R_THREAD_SHARE if reason == "thread-share"
             else R_CANCELLED)
        self._log_locked(lb + L_CANCELLED, lb + L_TIMEDOUT, eb + E_REJECTED + r)
        w[lb + L_CANCELLED] += 1
        if r == R_TIME_OUT:
            w[lb + L_TIMEDOUT] += 1
        w[eb + E_REJECTED + r] += 1
        self._observe_wait_locked(eb, now - w[sa + S_ARRIVAL_NS])  # Kubernetes observes it too
        self._commit_locked()
        self._maybe_drop_locked(lb)
        return True

    def _drop_waiting_locked(self, lb: int, s: int, sa: int, now: int) -> None:
        """Take a waiting request out (an event that its caller counts and commits)."""
        w = self._w
        q = w[sa + S_QUEUE]
        self._log_locked(sa + S_STATE, sa + S_QUEUE)
        self._unlink_locked(lb, self._qa(lb, q), sa)
        w[lb + L_WAITING] -= 1
        w[lb + L_SEATS_WAITING] -= w[sa + S_MAX_SEATS]
        self._demand_locked(lb, now)
        self._waiting_removed_locked(lb, q, sa)
        self._free_locked(s, sa)
