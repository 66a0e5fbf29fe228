"""The ``maxmin`` fairness: max-min fair between flows, work-conserving, bounded backfill.

``docs/fairness.md`` explains the fairness and its bounds; ``tests/maxmin_model.py`` is its
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
  end before it could start or use seats it will not need;
* seats that would go straight back to the only waiting flow free at its pace, one every
  ``0.9 x estimate x seats / C``, so that a flood of equal requests does not free its seats in
  one burst per service time (the lockstep hold, :meth:`MaxMinFairness.hold_locked`); a flow
  that starts waiting ends the holds.

Everything runs under the ledger lock (``…_locked``); the ledger reaches this class
through ``Ledger._fairness_locked`` for levels whose ``L_FAIRNESS`` is ``FAIRNESS_MAXMIN``. The
fast paths (``fastpath.py``, and ``mm_at_once`` / ``mm_finish`` in ``_fastpath.c``) do the
at-once admit and the plain finish of such levels with :meth:`MaxMinFairness.at_once_locked` and
:meth:`MaxMinFairness.main_phase_ended_locked`. Tags are uint64 words compared by signed
difference (wrapping is harmless while live tags lie within 2^63 seat-ns of each other).

This module holds the rules (arrival, dispatch, reservation and backfill, completion); its
mixins hold the structures: ``flowtable.py`` (entries, index, idle list), ``flowheap.py`` (the
pairing heap of backlogged flows, the parked list) and ``maxmin_repair.py`` (rebuild, verify).
"""

from __future__ import annotations

import struct

from apf_gunicorn.ledger.flowheap import HALF, FlowHeap
from apf_gunicorn.ledger.flowtable import FlowTable
from apf_gunicorn.ledger.layout import (
    EXECUTING,
    F_EST,
    F_EXEC,
    F_HASH,
    F_HEAD,
    F_LEVEL,
    F_N,
    F_NEXT,
    F_PACE,
    F_SEATS,
    F_SEQ,
    F_TAG,
    F_TAIL,
    F_WAITING,
    F_WHERE,
    FLOW_WORDS,
    FW_HEAP,
    FW_IDLE,
    FW_PARKED,
    L_C,
    L_EXECUTING,
    L_QBASE,
    L_SEATS_IN_USE,
    L_SERVICE_NS,
    L_WAITING,
    LEVEL_WORDS,
    LINGERING,
    M_NFLOWS,
    M_PARK_HEAD,
    M_RESERVE,
    M_RESERVES,
    M_ROOT,
    M_SEQ,
    M_V,
    MM_WORDS,
    NIL,
    QUEUE_WORDS,
    S_AL,
    S_GEN,
    S_HELD,
    S_LEVEL,
    S_MAX_SEATS,
    S_OWNER,
    S_QUEUE,
    S_SERVICE_NS,
    S_START_NS,
    S_STATE,
    SLOT_WORDS,
    WAITING,
    X_END,
    X_FLOW,
    X_FNEXT,
    X_FPREV,
    XSLOT_WORDS,
)
from apf_gunicorn.ledger.maxmin_repair import MaxMinRepair
from apf_gunicorn.ledger.records import AdmitResult
from apf_gunicorn.ledger.seatseconds import U64
from apf_gunicorn.ledger.service import SERVICE_WINDOW, learn_service

# A flow entry's counting words in one struct call (the per-request paths read and write them
# together): F_TAG .. F_WHERE, and F_TAG .. F_N written back. F_TAG is a uint64.
_COUNTS = struct.Struct("<Q9q")  # tag, seq, waiting, exec, seats, head, tail, est, n, where
_CHARGE = struct.Struct("<Q4q")  # tag, seq, waiting, exec, seats
_LEARNT = struct.Struct("<Q8q")  # tag, seq, waiting, exec, seats, head, tail, est, n
# The lockstep hold ("hold_locked"): a flow's seats handed straight back to it free at least
# PACE_NUM / PACE_DEN x (its estimate x seats / the level's limit) apart, with one such spacing of
# burst tolerance; a hold lasts at most 1 / HOLD_DEN of its estimate.
PACE_NUM, PACE_DEN = 9, 10
HOLD_DEN = 2
if not ((F_TAG, F_SEQ, F_WAITING, F_EXEC, F_SEATS, F_HEAD, F_TAIL, F_EST, F_N, F_WHERE)
        == tuple(range(F_TAG, F_TAG + 10))):
    raise ImportError("maxmin: the flow entry's struct formats do not match layout.py")


class MaxMinFairness(FlowTable, FlowHeap, MaxMinRepair):
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

    # -- arrival ------------------------------------------------------------------------------
    def enqueue_locked(self, led, lb: int, level: int, q: int, qa: int, req: tuple, eb: int,
                       ms: int, watch: int, granted: list) -> AdmitResult:
        """``StartRequest`` of a maxmin level that the fast admit did not take and that waits
        (the queue chosen and ``queue-full`` decided as Kubernetes does, by
        ``Ledger._verdict_locked``): wait in the queue and in the flow's FIFO and dispatch what
        fits (this request too, when nothing else waits).

        Args and Returns: as :meth:`KubernetesQueueSet.enqueue_locked`.
        """
        w, u = self._w, self._u
        s, sa, gen = led._wait_locked(lb, level, q, qa, req, eb, ms, watch)
        h = req[0] & U64
        now = req[5]
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
        if n == 1 and w[sa + S_STATE] == WAITING and w[lb + L_EXECUTING] < w[lb + L_SEATS_IN_USE]:
            self._end_holds_locked(led, lb, level, sa, now, granted)
        return led._admitted(s, w[sa + S_STATE], gen, req[4], granted)

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
        """Dispatch while something waits and seats are free, in the fairness's order;
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
        held = led._start_locked(lb, qa, sa, now)
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
    def hold_locked(self, lb: int, sa: int, now: int) -> int:
        """Break a lockstep (docs/fairness.md, "Lockstep"): the request in slot ``sa`` is about
        to end its main phase with no lingering seats, and its seats would go straight back to
        its own flow. Decide whether they free now or are held (the slot lingers) until a
        later time, so that the flow's seats free spread over its service time.

        Only when the flow is the only one waiting in the level (any other waiting flow gets
        the seats now, as the fairness orders it) and has a learnt estimate ``est``: with
        ``gap = 0.9 * est * held / C``, the flow's pace (``F_PACE``) is the earliest time its
        next seat may free unheld; a seat freeing more than one gap before the pace is held
        until the pace (at most ``est / 2``), and the pace moves on by one gap per freed seat.
        Seats that free at the pace or later are never held, nor those of a request that ran
        more than half a gap off ``est``: a flow whose requests vary is not in step (its
        jitter spreads its ends by itself), and holding its seats would only idle them.

        Returns:
            The time until which the seats are held (the slot lingers, ``X_END`` set), or 0.
        """
        w = self._w
        xa = self._xb + (sa - self._sb) // SLOT_WORDS * XSLOT_WORDS
        f = w[xa + X_FLOW]
        if f == NIL:
            return 0
        fa = self._fb + f * FLOW_WORDS
        waiting = w[fa + F_WAITING]
        if waiting == 0 or waiting != w[lb + L_WAITING] or not w[fa + F_N]:
            return 0
        c = w[lb + L_C]
        if c <= 0:  # a level lending all its seats: nothing to spread over
            return 0
        est = w[fa + F_EST]
        gap = est * w[sa + S_HELD] * PACE_NUM // (PACE_DEN * c)
        pace = w[fa + F_PACE]
        ran = now - w[sa + S_START_NS]
        if pace - now <= gap or not -gap <= 2 * (ran - est) <= gap:
            # at its pace, or a request that did not run the flow's usual time: the flow's
            # ends are not in step (jitter spreads them by itself), so nothing is held
            w[fa + F_PACE] = (pace if pace > now else now) + gap
            return 0
        until = min(pace, now + est // HOLD_DEN)
        w[fa + F_PACE] = until + gap
        w[xa + X_END] = until
        return until

    def _end_holds_locked(self, led, lb: int, level: int, sa: int, now: int,
                          granted: list) -> None:
        """A flow started waiting (its request in slot ``sa``) and no seat is free: a hold
        lasts only while one flow waits, so free held seats (the soonest to end first) and
        dispatch, until that request runs or nothing is held. Held slots are the level's
        lingering ones without additional latency; found by a scan of the slot table, done
        only when the level has fewer executing requests than seats in use (something
        lingers, or a request holds several seats)."""
        w = self._w
        xb, sb = self._xb, self._sb
        while w[sa + S_STATE] == WAITING:
            (states,) = led._slot_columns_locked(S_STATE)
            best, best_end, t = NIL, 0, -1
            while True:  # lingering slots are few: list.index finds each at C speed
                try:
                    t = states.index(LINGERING, t + 1)
                except ValueError:
                    break
                ta = sb + t * SLOT_WORDS
                if w[ta + S_LEVEL] == level and w[ta + S_AL] <= 0:
                    end = w[xb + t * XSLOT_WORDS + X_END]
                    if best == NIL or end < best_end:
                        best, best_end = t, end
            if best == NIL:
                return
            led._release_seats_locked(lb, level, best, sb + best * SLOT_WORDS, now)
            self.dispatch_all_locked(led, lb, now, granted)

    def main_phase_ended_locked(self, led, lb: int, q: int, qa: int, sa: int, now: int,
                                learn: bool = True) -> None:
        """The request in slot ``sa`` ended its main phase (``learn``: it finished; False: its
        worker died): correct its flow's tag by the time it held its seats, learn the flow's
        service time, and let a parked flow compete again (learnt now, or, after its worker died,
        holding less than its share)."""
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
        elif where == FW_PARKED and not self._capped(lb, mm, f):
            # learnt now, or (its worker died: nothing learnt) it holds less than its share
            # now: compete normally, or it would wait until no other flow does
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

