"""The fast paths of admit and finish, in Python: the mirror of ``_fastpath.c``.

Most requests on a healthy server run at once and finish with nothing waiting. For those two
cases ``admit`` and ``finish`` read the level record (and the slot) with one ``struct`` call,
compute in locals with the one virtual clock and integrator (``vclock.py``), and write back in
one go: ~15 buffer accesses instead of ~60. Everything else goes to the general path
(``requestpath.py``) before a word is written; ``tests/test_ledger_fastpath.py`` checks the two
against each other byte for byte.

The C extension ``_fastpath.c`` computes the same words in the same order (same float
operations; its layout check is ``_load_accelerator``); when it is built, ``_accelerate`` makes
the ledger's ``admit``/``finish`` the C entries, which hand what they decline to
``_admit_resume``/``_finish_resume`` and so to :meth:`FastPaths._admit_locked` /
:meth:`FastPaths._finish_locked` here (``tests/test_ledger_accelerator.py`` compares C and
Python). These two entries are also where every admit and finish passes the lock funnel.

The extension also has the ``maxmin`` general path's heap operations and flow get
(``mm_heap_insert``/``mm_heap_remove``/``mm_heap_decrease``/``mm_get``): ``_accelerate`` binds
them over the fairness object's methods (``_MM_C_METHODS``), which remain the pure-Python path.
"""

from __future__ import annotations

import os
import struct
import weakref
from bisect import bisect_left

from apf_gunicorn.flowcontrol.shufflesharding import deal
from apf_gunicorn.ledger import layout as L
from apf_gunicorn.ledger.layout import (
    EXECUTING,
    FREE,
    H_DIRTY,
    H_FREE_COUNT,
    H_FREE_HEAD,
    H_SERVICE_ADAPT,
    H_UNDO_N,
    L_ACTIVE_QUEUES,
    L_C,
    L_DESIRED,
    L_DISPATCHED,
    L_ENQUEUES,
    L_EXECUTING,
    L_HAND,
    L_I_CUR,
    L_I_LAST,
    L_I_MAX,
    L_I_MIN,
    L_I_T,
    L_I_X,
    L_I_XX,
    L_LAST_NS,
    L_NQ,
    L_QBASE,
    L_QSEATS,
    L_QUIESCING,
    L_R,
    L_ROBIN,
    L_SEATS_IN_USE,
    L_SEATS_WAITING,
    L_SERVICE_N,
    L_SERVICE_NS,
    L_WAITING,
    LEVEL_WORDS,
    NIL,
    Q_EXECUTING,
    Q_NDR,
    Q_SEATS,
    QUEUE_WORDS,
    S_AL,
    S_ARRIVAL_NS,
    S_ARRIVAL_R,
    S_DETAIL_LEN,
    S_FINAL,
    S_FINAL_WORK,
    S_FS,
    S_GEN,
    S_HASH,
    S_HELD,
    S_INIT_WORK,
    S_INITIAL,
    S_LEVEL,
    S_MAX_SEATS,
    S_NEXT,
    S_OWNER,
    S_PREV,
    S_QUEUE,
    S_SEQ,
    S_SERVICE_NS,
    S_START_NS,
    S_STATE,
    S_STATS,
    S_TOTAL_WORK,
    SLOT_WORDS,
)
from apf_gunicorn.ledger.lock import NullLock, ProcessLock, fastpath_module
from apf_gunicorn.ledger.records import (
    EXECUTE,
    AdmitResult,
)
from apf_gunicorn.ledger.seatseconds import (
    EXACT_BOUND,
    HIGH_R,
    U64,
    duration_per_seat,
    seats_ns_times,
)
from apf_gunicorn.ledger.stats import DURATION_BOUNDS_NS as _DUR
from apf_gunicorn.ledger.stats import (
    E_EXEC_R,
    E_WAIT_X,
    E_WORK,
    E_WORK_SUM,
    EXEC_STRIDE,
    ND,
    WORK_BOUNDS,
)
from apf_gunicorn.ledger.vclock import integrate, r_after

# Whole-record reads and writes for the fast paths: one struct call instead of a dozen word
# accesses. Field types follow layout.py (uint64 R, SeatSeconds and hash; float64 integrator).
_LEVEL = struct.Struct("<15qQ5q6d4q")  # L_USED .. L_DISPATCHED, what admit reads
_LEVEL_FIN = struct.Struct("<15qQ5q6dq")  # L_USED .. L_I_LAST, what finish reads
_HOT = struct.Struct("<Q5q6dq")  # L_R .. L_I_LAST, what finish writes back
_HOT_ADMIT = struct.Struct("<Q5q6d4q")  # L_R .. L_DISPATCHED, what admit writes back
_SLOT = struct.Struct("<12q4Q2qQ5q")  # S_STATE .. S_SERVICE_NS
_SLOT_FREE = struct.Struct("<7q")  # S_STATE .. S_NEXT
_FREE_LIST = struct.Struct("<2q")  # H_FREE_HEAD, H_FREE_COUNT
_UNDO5 = struct.Struct("<10q")  # five undo log pairs: what the fast admit logs
_new_tuple = tuple.__new__  # builds a NamedTuple without its Python-level __new__
# the work histogram's bucket word for 0..100 seats
_WORK_AT = tuple(E_WORK + bisect_left(WORK_BOUNDS, n) for n in range(101))
_WORK_INF = E_WORK + len(WORK_BOUNDS)

if not ((L.L_SERIAL, L_WAITING, L_SEATS_WAITING, L_R, L_LAST_NS, L_EXECUTING, L_SEATS_IN_USE,
         L_ACTIVE_QUEUES, L_QSEATS, L_I_T, L_I_X, L_I_XX, L_I_MIN, L_I_MAX, L_I_CUR, L_I_LAST,
         L_ROBIN, L_ENQUEUES, L_DISPATCHED) == tuple(range(12, 31))
        and _LEVEL.size == (L_DISPATCHED + 1) * 8 and _LEVEL_FIN.size == (L_I_LAST + 1) * 8
        and _HOT.size == (L_I_LAST - L_R + 1) * 8
        and _HOT_ADMIT.size == (L_DISPATCHED - L_R + 1) * 8
        and _SLOT.size == SLOT_WORDS * 8 and (S_STATE, S_NEXT) == (0, 6)
        and H_FREE_COUNT == H_FREE_HEAD + 1):
    raise ImportError("ledger fast-path record formats do not match layout.py")

def _load_accelerator():
    """The C fast paths (``_fastpath.c``), or None: not built (no compiler at install time),
    switched off with ``APF_NO_ACCELERATOR=1``, or compiled for another layout: its constants
    come from ``_layout.h``, generated from layout.py, whose digest it exports (an extension
    built before a layout change, or before the header was regenerated, is not used); the
    ``LAYOUT`` tuple is the values it reads, as compiled."""
    _fastpath = fastpath_module()
    if _fastpath is None:
        return None
    expected = (H_FREE_HEAD, H_FREE_COUNT, L.H_HOLDER_PID, H_DIRTY, L.H_MUTEX, LEVEL_WORDS,
                QUEUE_WORDS, SLOT_WORDS,
                (L.L_USED, L_QUIESCING, L_DESIRED, L_HAND, L_C, L_QBASE, L_NQ, L.L_SERIAL,
                 L_WAITING, L_SEATS_WAITING, L_R, L_LAST_NS, L_EXECUTING, L_SEATS_IN_USE,
                 L_ACTIVE_QUEUES, L_QSEATS, L_I_T, L_I_X, L_I_XX, L_I_MIN, L_I_MAX, L_I_CUR,
                 L_I_LAST, L_ROBIN, L_ENQUEUES, L_DISPATCHED),
                (Q_NDR, Q_EXECUTING, Q_SEATS),
                (S_STATE, S_GEN, S_OWNER, S_LEVEL, S_QUEUE, S_PREV, S_NEXT, S_INITIAL, S_FINAL,
                 S_AL, S_MAX_SEATS, S_HELD, S_INIT_WORK, S_FINAL_WORK, S_TOTAL_WORK, S_ARRIVAL_R,
                 S_ARRIVAL_NS, S_START_NS, S_HASH, S_FS, S_SEQ, S_DETAIL_LEN, S_STATS),
                FREE, EXECUTING, NIL, (H_SERVICE_ADAPT, L_SERVICE_NS, L_SERVICE_N, S_SERVICE_NS),
                H_UNDO_N)
    if _fastpath.LAYOUT != expected or getattr(_fastpath, "LAYOUT_DIGEST", None) != L.digest():
        return None
    return _fastpath


_ACCEL = _load_accelerator()
# the maxmin words the C fast paths read, as compiled: an extension whose LAYOUT_MAXMIN differs
# (or lacks it) is not used at all, since it would read L_FAIRNESS from the wrong word
_MAXMIN_LAYOUT = (L.L_FAIRNESS, L.MM_WORDS, L.M_V, L.M_SEQ, L.M_NFLOWS,
                  (L.FH_FREE, L.FH_IDLE_HEAD, L.FH_IDLE_TAIL, L.FH_EVICTIONS),
                  (L.FLOW_WORDS, L.F_LEVEL, L.F_HASH, L.F_TAG, L.F_SEQ, L.F_WAITING, L.F_EXEC,
                   L.F_SEATS, L.F_HEAD, L.F_TAIL, L.F_EST, L.F_N, L.F_WHERE, L.F_CHILD,
                   L.F_NEXT, L.F_PREV),
                  (L.FW_NOWHERE, L.FW_IDLE), (L.XSLOT_WORDS, L.X_FLOW),
                  (L.M_ROOT, L.FW_HEAP))  # (the last two: the mm_heap_* methods)
if _ACCEL is not None and getattr(_ACCEL, "LAYOUT_MAXMIN", None) != _MAXMIN_LAYOUT:
    _ACCEL = None


# MaxMinFairness's methods that ``_accelerate`` shadows with the C ones (instance attributes on
# the fairness object; the methods remain the pure-Python path and the reference).
_MM_C_METHODS = (("_heap_insert", "mm_heap_insert"), ("_heap_remove", "mm_heap_remove"),
                 ("_heap_decrease", "mm_heap_decrease"), ("_get", "mm_get"))


class FastPaths:
    """The admit and finish entries under the lock, with their fast paths (a mixin)."""

    def _accelerate(self) -> None:
        """Bind the C fast paths to this buffer and lock, when they are built and the lock is
        one they can take themselves: a ``NullLock``, or a ``ProcessLock`` whose acquire and
        release are not overridden (a subclass that hooks them, like the tests' dying lock,
        keeps the Python paths). Rebound in a forked child, where the lock has a new pid.

        ``admit`` and ``finish`` then become the C entries that do the hand-over themselves
        (instance attributes shadowing the methods, which remain the reference): they call
        :meth:`_admit_resume`/:meth:`_finish_resume` on a decline, one Python frame fewer per
        request than the methods."""
        lock = self._lock
        if _ACCEL is None or type(lock) not in (NullLock, ProcessLock):
            return
        mode, pid = (1, lock._pid) if type(lock) is ProcessLock else (0, 0)
        old = self._fp
        self._fp = _ACCEL.FastPath(
            self._mv, mode, pid, self._stats_at, AdmitResult, EXECUTE,
            (self._lvb, self._qb, self._sb, self._nlevels, self._nslots,
             self._details, self._detail_stride, self._detail_bytes, E_WORK_SUM, E_WAIT_X,
             E_EXEC_R, EXEC_STRIDE, ND, self._ub),
            (*_WORK_AT, _WORK_INF), tuple(_DUR))
        self._fp.set_resume(self._admit_resume, self._finish_resume)
        lay = self._lay  # the maxmin areas (until set, C declines maxmin levels)
        self._fp.set_maxmin(lay.maxmin_base, lay.flow_header, lay.flow_base, lay.flow_index,
                            lay.flow_index_words - 1, lay.xslot_base)
        self.admit = self._fp.admit_call
        self.finish = self._fp.finish_call
        # the maxmin general path's hottest structure operations, in C (the same words)
        mx = self._maxmin
        for name, method in _MM_C_METHODS:
            setattr(mx, name, getattr(self._fp, method))
        if old is not None:
            old.close()
        elif mode == 1:
            ref = weakref.ref(self)

            def _after_fork() -> None:  # runs after the lock's own hook (registered earlier)
                me = ref()
                if me is not None and me._fp is not None:
                    me._accelerate()

            os.register_at_fork(after_in_child=_after_fork)

    @property
    def accelerated(self) -> bool:
        """Whether admit and finish run their fast paths in C (``_fastpath.c``)."""
        return self._fp is not None

    @property
    def c_fastpath(self):
        """The bound C fast paths (``_fastpath.FastPath``), or None: what the admission
        core's request gate (``_fastpath.Gate``) admits and finishes through."""
        return self._fp

    def _admit_locked(self, dead, level, flow_hash, initial, final, al, owner, now, fs_index,
                      detail, watch) -> AdmitResult:
        """:meth:`admit` once the lock is taken (``dead``: what the lock reported): through the
        funnel, then at once or by the general path (:meth:`_admit_slow_locked`).

        At once (``fp_admit`` in ``_fastpath.c`` computes the same words): a queuing level with
        nothing waiting, a free slot and room for the request. The only copy of that case:
        computed in locals from one read of the level record and written back in one go,
        leaving exactly the state Kubernetes' enqueue-then-dispatch leaves (nothing waits in
        the level, so every queue's waiting work is 0 and the first card visited wins; the
        queue's nextDispatchR is floored at R and charged the request's work; the robin index
        points at the queue; the tree is not touched). When R reaches the epoch advance, the
        general sync advances it and the case is tried again. Every other case goes to the
        general path before anything is written."""
        granted = self._begin_locked(dead, now)
        w = self._w
        try:
            res = None
            lb = self._lvb + level * LEVEL_WORDS
            # (something waiting: the general path, without paying for the record read first)
            while 0 <= level < self._nlevels and not w[lb + L_WAITING]:
                ms = initial if initial >= final else final
                mv = self._mv
                (used, _qui, _nl, desired, hs, _qll, c, qbase, _qcap, _nq, _tb, _tp, serial,
                 waiting, sw, r, last, executing, in_use, active, qseats, it, ix, ixx, imn, imx,
                 cur, ilast, _robin, enq, dispatched) = _LEVEL.unpack_from(mv, lb * 8)
                head, nfree = _FREE_LIST.unpack_from(mv, H_FREE_HEAD * 8)
                if not (used and desired > 0 and not waiting and head != NIL and in_use < c
                        and (in_use + ms <= c or (ms > c and executing == 0))):
                    break
                if now > last:  # syncTimeLocked
                    if active:
                        nr = r_after(r, last, now, active, qseats, c)
                        if nr >= HIGH_R and nr >= r:
                            self._sync_locked(lb, now)  # with the epoch advance; then again
                            continue
                        r = nr
                    last = now
                u = self._u
                eb = self._stats_at.get((serial << 32) | (fs_index & 0xFFFFFFFF))
                if eb is None:
                    eb = self._stats_entry_locked(lb, level, fs_index)
                bw = eb + (_WORK_AT[ms] if ms < 101 else _WORK_INF)
                sa = self._sb + head * SLOT_WORDS
                # the undo log (_log_locked inline): the words of this event that are not derived
                _UNDO5.pack_into(mv, self._ub * 8, bw, w[bw], eb + E_WORK_SUM,
                                 w[eb + E_WORK_SUM], eb + E_WAIT_X, w[eb + E_WAIT_X],
                                 sa + S_STATE, w[sa + S_STATE], lb + L_DISPATCHED, dispatched)
                w[H_UNDO_N] = 5
                w[bw] += 1
                w[eb + E_WORK_SUM] += ms
                w[eb + E_WAIT_X] += 1  # dispatched at arrival: a 0 s wait
                h = flow_hash & U64
                q = deal(h, desired, hs)[enq % hs]
                qa = self._qb + (qbase + q) * QUEUE_WORDS
                gen = w[sa + S_GEN] + 1
                _FREE_LIST.pack_into(mv, H_FREE_HEAD * 8, w[sa + S_NEXT], nfree - 1)
                g = w[lb + L_SERVICE_NS]
                x = initial * g  # seats_ns_times inline
                iw = (x + 5) // 10 if x < EXACT_BOUND else seats_ns_times(initial, g)
                fw = seats_ns_times(final, al) if final and al else 0
                tw = (iw + fw) & U64
                ex = w[qa + Q_EXECUTING]
                ndr = r if ex == 0 else u[qa + Q_NDR]
                if ndr < r:  # the anti-windup floor with this request as head
                    ndr = r
                # seat demand Set() after the enqueue
                it, ix, ixx, imn, imx, cur, ilast = integrate(it, ix, ixx, imn, imx, cur, ilast,
                                                              now, float(in_use + sw + ms))
                held = ms
                if final > c:  # the final-seat cap
                    al = duration_per_seat(fw, float(c))
                    final = c
                    held = initial if initial >= c else c
                    if held != ms:  # Set() again after the dispatch, no time passing
                        it, ix, ixx, imn, imx, cur, ilast = integrate(
                            it, ix, ixx, imn, imx, cur, ilast, now, float(in_use + held + sw))
                if ex == 0:
                    active += 1
                w[qa + Q_EXECUTING] = ex + 1
                w[qa + Q_SEATS] += held
                if w[lb + L.L_FAIRNESS]:  # maxmin: the flow's words instead of the queue's
                    g = self._maxmin.at_once_locked(lb, level, h, head, held, al)
                    q_robin = _robin
                else:
                    u[qa + Q_NDR] = (ndr + tw) & U64
                    q_robin = q
                if detail:
                    d = detail[: self._detail_bytes]
                    off = self._details + head * self._detail_stride
                    mv[off:off + len(d)] = d
                    dlen = len(d)
                else:
                    dlen = 0
                _SLOT.pack_into(mv, sa * 8, EXECUTING, gen, owner, level, q, NIL, NIL,
                                initial, final, al, ms, held, iw, fw, tw, r, now, now, h,
                                fs_index, enq, dlen, 2 * eb + (1 if watch else 0), g)
                _HOT_ADMIT.pack_into(mv, (lb + L_R) * 8, r, last, executing + 1,
                                     in_use + held, active, qseats + held, it, ix, ixx, imn,
                                     imx, cur, ilast, q_robin, enq + 1, dispatched + 1)
                res = _new_tuple(AdmitResult, (EXECUTE, head, gen, "", granted))
                break
            if res is None:
                res = self._admit_slow_locked(level, flow_hash, initial, final, al, owner, now,
                                              fs_index, detail, granted, 1 if watch else 0)
        except BaseException:
            self._abort_locked()
            raise
        self._end_locked()
        return res

    def _finish_locked(self, dead, slot: int, gen: int, now: int) -> tuple[list, int]:
        """:meth:`finish` once the lock is taken (``dead``: what the lock reported): through the
        funnel, then the fast path inline or :meth:`_finish_slow_locked`.

        The fast path (``fp_finish`` in ``_fastpath.c`` computes the same words): no lingering,
        nothing waiting in the level, no queue to remove, not quiescing, no epoch advance. It
        reads the slot and the level record once, computes in locals and writes both back in
        one go; anything else goes to the general path before it has written a word."""
        granted = self._begin_locked(dead, now)
        w = self._w
        try:
            linger = -1
            if 0 <= slot < self._nslots:
                mv = self._mv
                sa = self._sb + slot * SLOT_WORDS
                (state, sgen, owner, level, q, _prev, _next, initial, _final, al, _ms, held,
                 _iw, _fw, _tw, _ar, _an, start, _hash, _fs, _seq, _dl,
                 st, g) = _SLOT.unpack_from(mv, sa * 8)
                if sgen != gen or state != EXECUTING:
                    linger = 0  # stale: a no-op
                elif al <= 0 and not w[self._lvb + level * LEVEL_WORDS + L_WAITING]:
                    lb = self._lvb + level * LEVEL_WORDS
                    (_used, quiescing, _nl, desired, _hs, _qll, c, qbase, _qcap, nq, _tb, _tp,
                     _serial, waiting, sw, r, last, executing, in_use, active, qseats, it, ix,
                     ixx, imn, imx, cur, ilast) = _LEVEL_FIN.unpack_from(mv, lb * 8)
                    fast = not (waiting or quiescing or (q != NIL and nq > desired))
                    if fast and now > last:  # syncTimeLocked
                        if active:
                            nr = r_after(r, last, now, active, qseats, c)
                            fast = not (nr >= HIGH_R and nr >= r)  # epoch advance: slow path
                            r = nr
                        last = now
                    if fast:
                        ran = now - start
                        hist = (st >> 1) + E_EXEC_R + (st & 1) * EXEC_STRIDE
                        w[hist + bisect_left(_DUR, ran)] += 1
                        if ran > 0:
                            self._f[hist + ND] += ran / 1e9
                        if q != NIL:
                            u = self._u
                            qa = self._qb + (qbase + q) * QUEUE_WORDS
                            ex = w[qa + Q_EXECUTING] - 1
                            w[qa + Q_EXECUTING] = ex
                            if ex == 0:  # (its waiting count is 0: nothing waits in the level)
                                active -= 1
                            if w[lb + L.L_FAIRNESS]:  # maxmin: correct and learn the flow's
                                self._maxmin.main_phase_ended_locked(self, lb, q, qa, sa, now)
                            else:
                                # nextDispatchR -= initial*(G - S): usually negative, so the
                                # uint64 wraparound adds
                                u[qa + Q_NDR] = (u[qa + Q_NDR]
                                                 - seats_ns_times(initial, g - ran)) & U64
                            if w[H_SERVICE_ADAPT]:
                                self._learn_locked(lb, ran)
                            w[qa + Q_SEATS] -= held
                            qseats -= held
                        in_use -= held
                        # seat demand Set() after the release
                        it, ix, ixx, imn, imx, cur, ilast = integrate(
                            it, ix, ixx, imn, imx, cur, ilast, now, float(in_use + sw))
                        head, nfree = _FREE_LIST.unpack_from(mv, H_FREE_HEAD * 8)
                        _SLOT_FREE.pack_into(mv, sa * 8, FREE, gen, owner, level, NIL, NIL, head)
                        _FREE_LIST.pack_into(mv, H_FREE_HEAD * 8, slot, nfree + 1)
                        _HOT.pack_into(mv, (lb + L_R) * 8, r, last, executing - 1, in_use,
                                       active, qseats, it, ix, ixx, imn, imx, cur, ilast)
                        linger = 0
            if linger < 0:
                linger = self._finish_slow_locked(slot, gen, now, granted)
        except BaseException:
            self._abort_locked()
            raise
        self._end_locked()
        return granted, linger
