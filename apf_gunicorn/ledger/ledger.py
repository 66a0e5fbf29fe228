"""The seat ledger: Kubernetes' queueset (fair queuing, shuffle sharding, seats) on a buffer.

One ``Ledger`` wraps one writable buffer (an mmap of POSIX shared memory in production, a
``bytearray`` in tests and the simulator). Every public operation takes the lock, syncs the
virtual clock of the level it touches exactly as ``queueset.go`` does, mutates, and returns
what the caller must do (run now, wait on a slot, wake the owners of granted slots)::

    buf = bytearray(Ledger.size(Capacity()))
    led = Ledger.create(buf, Capacity(), lock=NullLock())
    levels, schemas = led.configure([LevelSpec("global-default", 128, 6, 50, 20)], ["fs"], now)
    res = led.admit(levels["global-default"], flow_hash, 1, 0, 0, owner=0, now=now)
    if res.outcome == EXECUTE: ...run...; granted, linger_until = led.finish(res.slot, res.gen, t)
    # granted: [(slot, gen, owner)] dispatched by the call: wake those owners

Time is always the caller's integer nanoseconds. Differences from Kubernetes (all documented in
docs/ledger.md): the ``totSeatsWaiting`` drift is not kept, time never runs backwards for a
level (a stale ``now`` from another process counts as no time passing), a quiescing level is
dropped only once its lingering seats are released too, and per-request cost does not grow with
the number of queues (incremental rate inputs and a min-segment tree of head virtual finishes).
"""

from __future__ import annotations

import math
import os
import struct
import weakref
from array import array
from bisect import bisect_left
from typing import NamedTuple

from apf_gunicorn.flowcontrol.shufflesharding import DealerError, check_dealer, deal
from apf_gunicorn.ledger import layout as L
from apf_gunicorn.ledger.layout import (
    EXECUTING,
    FREE,
    H_DIRTY,
    H_FREE_COUNT,
    H_FREE_HEAD,
    H_SERVICE_ADAPT,
    H_SERVICE_NS,
    H_UNDO_N,
    L_ACTIVE_QUEUES,
    L_C,
    L_CANCELLED,
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
    L_QLL,
    L_QSEATS,
    L_QUIESCING,
    L_R,
    L_REJECTED,
    L_ROBIN,
    L_SEATS_IN_USE,
    L_SEATS_WAITING,
    L_SERVICE_N,
    L_SERVICE_NS,
    L_TBASE,
    L_TIMEDOUT,
    L_TP,
    L_USED,
    L_WAITING,
    LEVEL_WORDS,
    LINGERING,
    NIL,
    Q_EXECUTING,
    Q_HEAD,
    Q_INIT_SUM,
    Q_MAX_SUM,
    Q_NDR,
    Q_SEATS,
    Q_TAIL,
    Q_WAITING,
    Q_WORK_SUM,
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
    WAITING,
    Capacity,
    Layout,
)
from apf_gunicorn.ledger.lock import NullLock, ProcessLock, fastpath_module
from apf_gunicorn.ledger.seatseconds import (
    EXACT_BOUND,
    HIGH_R,
    R_DECREMENT,
    U64,
    duration_per_seat,
    seats_ns_times,
)
from apf_gunicorn.ledger.seatseconds import seats_times_duration as _std
from apf_gunicorn.ledger.stats import DURATION_BOUNDS_NS as _DUR
from apf_gunicorn.ledger.stats import (
    E_DISPATCHED,
    E_EXEC_R,
    E_FS,
    E_LEVEL,
    E_NAME_LEN,
    E_REJECTED,
    E_SERIAL,
    E_WAIT_R,
    E_WAIT_X,
    E_WORK,
    E_WORK_SUM,
    ENTRY_WORDS,
    EXEC_STRIDE,
    ND,
    OVERFLOW,
    R_CANCELLED,
    R_CONCURRENCY_LIMIT,
    R_NO_SLOT,
    R_QUEUE_FULL,
    R_TIME_OUT,
    REASON_INDEX,
    WORK_BOUNDS,
    RequestStats,
    read_entry,
)

EXECUTE, QUEUED, REJECTED = "execute", "queued", "rejected"

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


def _seconds(ns: int) -> float:
    """Go's ``Duration.Seconds()``: whole seconds plus the nanosecond rest, each as a float.
    Below one second that is ``ns / 1e9`` exactly (0.0 + x == x), which the fast paths use."""
    sec, nsec = divmod(ns, 1_000_000_000)
    return float(sec) + float(nsec) / 1e9
if not ((L.L_SERIAL, L_WAITING, L_SEATS_WAITING, L_R, L_LAST_NS, L_EXECUTING, L_SEATS_IN_USE,
         L_ACTIVE_QUEUES, L_QSEATS, L_I_T, L_I_X, L_I_XX, L_I_MIN, L_I_MAX, L_I_CUR, L_I_LAST,
         L_ROBIN, L_ENQUEUES, L_DISPATCHED) == tuple(range(12, 31))
        and _LEVEL.size == (L_DISPATCHED + 1) * 8 and _LEVEL_FIN.size == (L_I_LAST + 1) * 8
        and _HOT.size == (L_I_LAST - L_R + 1) * 8
        and _HOT_ADMIT.size == (L_DISPATCHED - L_R + 1) * 8
        and _SLOT.size == SLOT_WORDS * 8 and (S_STATE, S_NEXT) == (0, 6)
        and H_FREE_COUNT == H_FREE_HEAD + 1):
    raise ImportError("ledger fast-path record formats do not match layout.py")
DEFAULT_SERVICE_ESTIMATE_NS = 3_000_000  # Kubernetes' G (estimatedServiceDuration)
MAX_SERVICE_ESTIMATE_NS = 60_000_000_000  # a learnt G never exceeds Kubernetes' 60 s time-out
SERVICE_WINDOW = 16  # a learnt G averages about the last 16 finished requests


def learn_service(g: int, n: int, ran: int) -> int:
    """A level's next G after its ``n``-th finished request (counting from 1, at most
    :data:`SERVICE_WINDOW`) ran ``ran`` ns: the mean of the first 16, then an exponentially
    weighted average with weight 1/16, so the configured G is forgotten at the first finish.
    Integers only, so that the C fast path (``_fastpath.c``) computes the same word; ``ran``
    is clamped to [0, 60 s]."""
    ran = 0 if ran < 0 else (MAX_SERVICE_ESTIMATE_NS if ran > MAX_SERVICE_ESTIMATE_NS else ran)
    return g + (ran - g) // n if ran >= g else g - (g - ran) // n


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


class LevelSpec(NamedTuple):
    """One priority level's queue set configuration. ``desired_queues``: > 0 queuing, 0 reject
    (no queues, ``concurrency-limit``), < 0 exempt."""

    name: str
    desired_queues: int
    hand_size: int
    queue_length_limit: int
    concurrency_limit: int


class AdmitResult(NamedTuple):
    outcome: str  # EXECUTE | QUEUED | REJECTED
    slot: int  # -1 when rejected
    gen: int
    reason: str  # "queue-full" | "concurrency-limit" | "no-slot" | ""
    granted: list  # [(slot, gen, owner)] other requests dispatched by this call


class DemandStats(NamedTuple):
    """Kubernetes ``IntegratorResults`` of the seat-demand integrator since the last take."""

    duration_s: float
    average: float
    deviation: float
    min: float
    max: float

    @property
    def high_watermark(self) -> float:
        return self.max


class QueueSnapshot(NamedTuple):
    index: int
    waiting: int
    executing: int
    seats_in_use: int
    next_dispatch_r: int
    initial_seats_sum: int
    max_seats_sum: int
    total_work_sum: int


class RequestSnapshot(NamedTuple):
    slot: int
    queue: int
    index_in_queue: int
    flow_hash: int
    fs_index: int
    owner: int
    arrive_ns: int
    start_ns: int
    initial_seats: int
    final_seats: int
    additional_latency_ns: int
    state: str
    detail: bytes
    gen: int = 0  # the slot generation, for matching grants


class LevelSnapshot(NamedTuple):
    index: int
    name: str
    desired_queues: int
    concurrency_limit: int
    quiescing: bool
    seats_in_use: int
    seats_waiting: int
    requests_waiting: int
    requests_executing: int
    current_r: int
    dispatched: int
    rejected: int
    timedout: int
    cancelled: int
    queues: list
    requests: list
    hand_size: int = 0
    queue_length_limit: int = 0
    epoch_advances: int = 0
    epoch_advance_failures: int = 0
    service_estimate_ns: int = 0  # G, the service time charged at dispatch


class Snapshot(NamedTuple):
    now: int
    levels: list
    flow_schema_names: list
    head_timeouts: int = 0  # connections answered 408 for a late request head (server-wide)


class LevelLoad(NamedTuple):
    """One level's load, read without the lock (:meth:`Ledger.load`)."""

    index: int
    exempt: bool
    concurrency_limit: int  # current C (after borrowing)
    seats_in_use: int
    seats_waiting: int
    requests_waiting: int
    dispatched: int  # cumulative; restarts at 0 if the index is reused by a new level
    rejected: int  # cumulative, every reason


def _next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


class Ledger:
    """Fair-queuing seat ledger over a buffer. Create with :meth:`create` or :meth:`attach`."""

    def __init__(self, buf, lock, lay: Layout) -> None:
        self._lay = lay
        mv = memoryview(buf).cast("B")[: lay.size]
        self._mv = mv
        self._w = mv.cast("q")
        self._u = mv.cast("Q")
        self._f = mv.cast("d")
        self._lock = lock if lock is not None else NullLock()
        self._qb = lay.queue_base
        self._sb = lay.slot_base
        self._lvb = lay.level_base
        self._ub = lay.undo_base
        self._names: dict[str, int] = {}
        self._names_gen = -1
        self.pending_grants: list = []  # grants found by a repair inside snapshot/stats calls
        self._nlevels = lay.cap.levels
        self._nslots = lay.cap.slots
        self._detail_bytes = lay.cap.detail_bytes
        self._details = lay.details
        self._detail_stride = lay.detail_stride
        # (level serial << 32) + fs index -> word address of its stats entry (entries never move)
        self._stats_at: dict[int, int] = {}
        self._fp = None  # the C fast paths, once bound (_accelerate)

    # -- construction -------------------------------------------------------------------------

    @staticmethod
    def size(cap: Capacity | None = None) -> int:
        """Bytes needed for a ledger of these capacities."""
        return Layout(cap or Capacity()).size

    @classmethod
    def create(cls, buf, cap: Capacity | None = None, lock=None,
               service_estimate_ns: int = DEFAULT_SERVICE_ESTIMATE_NS,
               owner_pid: int = 0, accelerate: bool = True,
               learn_service: bool = False) -> Ledger:
        """Format ``buf`` (zeroed, free list, header) and initialise the lock's shared part.

        ``service_estimate_ns`` is G, the service time charged to a request's queue when it is
        dispatched (its completion corrects the charge to the time it really ran). With
        ``learn_service`` each level starts at that G and learns its own from the requests it
        finishes (:func:`learn_service`); without, G stays fixed, as in Kubernetes.
        ``accelerate``: use the C fast paths when they are built (see :attr:`accelerated`)."""
        if not 0 <= service_estimate_ns <= MAX_SERVICE_ESTIMATE_NS:
            raise ValueError(f"service_estimate_ns must be within [0, "
                             f"{MAX_SERVICE_ESTIMATE_NS}], not {service_estimate_ns}")
        cap = cap or Capacity()
        lay = Layout(cap)
        if len(memoryview(buf).cast("B")) < lay.size:
            raise ValueError(f"buffer of {len(buf)} bytes is smaller than the {lay.size} bytes "
                             f"this capacity needs")
        raw = memoryview(buf).cast("B")
        raw[: lay.size] = bytes(lay.size)
        led = cls(buf, lock, lay)
        w = led._w
        w[L.H_VERSION] = L.VERSION
        for field, value in ((L.H_CAP_LEVELS, cap.levels), (L.H_CAP_QUEUES, cap.queues),
                             (L.H_CAP_SLOTS, cap.slots), (L.H_CAP_WORKERS, cap.workers),
                             (L.H_CAP_FS, cap.flow_schemas), (L.H_CAP_DETAIL, cap.detail_bytes),
                             (L.H_CAP_STATS, cap.stats_entries),
                             (L.H_SIZE, lay.size), (L.H_OWNER_PID, owner_pid),
                             (H_SERVICE_NS, service_estimate_ns),
                             (H_SERVICE_ADAPT, 1 if learn_service else 0)):
            w[field] = value
        sb = lay.slot_base
        for s in range(cap.slots):
            w[sb + s * SLOT_WORDS + S_NEXT] = s + 1 if s + 1 < cap.slots else NIL
            w[sb + s * SLOT_WORDS + S_PREV] = NIL
            w[sb + s * SLOT_WORDS + S_QUEUE] = NIL
        w[H_FREE_HEAD] = 0
        w[H_FREE_COUNT] = cap.slots
        led._name_stats_entry(cap.stats_entries, OVERFLOW, -1, -1)  # the catch-all
        led._lock.bind(led._mv, w, True)
        if accelerate:
            led._accelerate()
        w[L.H_MAGIC] = L.MAGIC  # last: a reader never sees a half-formatted ledger as valid
        return led

    @classmethod
    def attach(cls, buf, lock=None, accelerate: bool = True) -> Ledger:
        """Wrap a buffer some other process (or object) formatted with :meth:`create`."""
        head = memoryview(buf).cast("B")[: L.HEADER_WORDS * L.WORD].cast("q")
        if head[L.H_MAGIC] != L.MAGIC or head[L.H_VERSION] != L.VERSION:
            raise ValueError("buffer does not hold an apf_gunicorn ledger of this version")
        cap = Capacity(levels=head[L.H_CAP_LEVELS], queues=head[L.H_CAP_QUEUES],
                       slots=head[L.H_CAP_SLOTS], workers=head[L.H_CAP_WORKERS],
                       flow_schemas=head[L.H_CAP_FS], detail_bytes=head[L.H_CAP_DETAIL],
                       stats_entries=head[L.H_CAP_STATS])
        head.release()
        led = cls(buf, lock, Layout(cap))
        led._lock.bind(led._mv, led._w, False)
        if accelerate:
            led._accelerate()
        return led

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
        self.admit = self._fp.admit_call
        self.finish = self._fp.finish_call
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

    def close(self) -> None:
        """Release the views so the underlying mmap can be closed."""
        fp, self._fp = self._fp, None
        if fp is not None:
            self.__dict__.pop("admit", None)
            self.__dict__.pop("finish", None)
            fp.close()
        unbind = getattr(self._lock, "unbind", None)
        if unbind:
            unbind()
        for view in (self._w, self._u, self._f, self._mv):
            view.release()

    @property
    def capacity(self) -> Capacity:
        return self._lay.cap

    @property
    def service_estimate_ns(self) -> int:
        """G as configured: every level's starting (or, if not learnt, fixed) estimate."""
        return self._w[H_SERVICE_NS]

    def level_service_estimate_ns(self, level: int) -> int:
        """The G that ``level`` charges now (lock-free read of one word)."""
        return self._w[self._lb(level) + L_SERVICE_NS]

    # -- lock protocol ------------------------------------------------------------------------

    def _enter(self, now: int | None) -> list:
        dead = self._lock.acquire()
        w = self._w
        granted = self._recover(dead, now) if dead is not None or w[H_DIRTY] else []
        w[H_DIRTY] = 1  # cleared only when the operation completes
        return granted

    def _recover(self, dead: int | None, now: int | None) -> list:
        """Repair after a dead holder (``dead`` = its pid) or an interrupted operation."""
        from apf_gunicorn.ledger.repair import repair_locked

        try:
            granted = repair_locked(self, now, dead_pid=dead or 0)
        except BaseException:
            # keep the robust mutex usable (unlocking it without consistent() would make it
            # unrecoverable); the dirty mark makes the next locker repair again
            self._w[H_DIRTY] = 1
            if dead is not None:
                self._lock.consistent()
            self._lock.release()
            raise
        if dead is not None:
            self._lock.consistent()
        return granted

    def _leave_ok(self) -> None:
        w = self._w
        w[H_DIRTY] = 0
        w[H_UNDO_N] = 0
        self._lock.release()

    # -- the undo log -----------------------------------------------------------------------------
    # A worker can die (SIGKILL, the OOM killer) anywhere inside an operation, while it holds
    # the lock. Repair rebuilds everything derived from the slot table, but the per-request
    # counters and the slot states it rebuilds from are not derivable: an event half written
    # (a request's estimate counted but not its dispatch or rejection, a level's counter but not
    # its stats entry's, a slot freed but its cancel not counted) would stay wrong for good. So
    # each event notes the value of every counter and slot state word before it writes it
    # (``_log``), and clears the log once the event is whole (``_commit``); repair puts back what
    # a half-done event wrote (``repair.rollback``) before anything else. An event is one
    # request's arrival with its outcome (run, queued, rejected), one dispatch, one cancel or
    # time-out, one lost wait (a dead worker's queued request); an operation that dies between
    # events keeps the events it completed. Execution histograms (finish) and derived state are
    # not logged.

    def _log(self, *addrs: int) -> None:
        """Note each word's value before the current event writes it."""
        w = self._w
        n = w[H_UNDO_N]
        if n + len(addrs) > L.UNDO_PAIRS:
            raise RuntimeError("the ledger's undo log is full (an event logs too many words)")
        at = self._ub + 2 * n
        for a in addrs:
            w[at] = a
            w[at + 1] = w[a]
            at += 2
        w[H_UNDO_N] = n + len(addrs)  # the pairs count only from here

    def _commit(self) -> None:
        """The current event is complete: nothing to undo."""
        self._w[H_UNDO_N] = 0

    # -- addressing ---------------------------------------------------------------------------

    def _lb(self, level: int) -> int:
        if not 0 <= level < self._lay.cap.levels:
            raise ValueError(f"level index {level} out of range")
        lb = self._lvb + level * LEVEL_WORDS
        if not self._w[lb + L_USED]:
            raise ValueError(f"level index {level} is not configured")
        return lb

    def _qa(self, lb: int, q: int) -> int:
        return self._qb + (self._w[lb + L_QBASE] + q) * QUEUE_WORDS

    def _sa(self, s: int) -> int:
        return self._sb + s * SLOT_WORDS

    # -- per-request stats ----------------------------------------------------------------------

    def _stats_entry(self, lb: int, level: int, fs: int) -> int:
        """Word address of the stats entry of (level, fs), created on first use (lock held)."""
        serial = self._w[lb + L.L_SERIAL]
        key = (serial << 32) | (fs & 0xFFFFFFFF)
        eb = self._stats_at.get(key)
        if eb is None:
            eb = self._stats_at[key] = self._find_or_create_entry(lb, level, serial, fs)
        return eb

    def _find_or_create_entry(self, lb: int, level: int, serial: int, fs: int) -> int:
        w = self._w
        lay = self._lay
        cap = lay.cap.stats_entries
        n = w[L.H_STATS_COUNT]
        base = lay.stats_base
        end = base + n * ENTRY_WORDS
        serials = w[base + E_SERIAL: end: ENTRY_WORDS].tolist()
        fss = w[base + E_FS: end: ENTRY_WORDS].tolist()
        for i in range(n):
            if serials[i] == serial and fss[i] == fs:
                return base + i * ENTRY_WORDS
        # regular entries leave room for the levels' overflow entries
        limit = cap - min(lay.cap.levels, cap // 2) if fs >= 0 else cap
        if n >= limit:
            if fs >= 0:
                return self._find_or_create_entry(lb, level, serial, -1)
            return base + cap * ENTRY_WORDS  # the catch-all
        name = self._read_name(lay.level_names, level, w[lb + L.L_NAME_LEN])
        self._name_stats_entry(n, name, level, fs, serial)
        w[L.H_STATS_COUNT] = n + 1
        return base + n * ENTRY_WORDS

    def _name_stats_entry(self, i: int, name: str, level: int, fs: int, serial: int = 0) -> None:
        w = self._w
        eb = self._lay.stats_entry(i)
        w[eb + E_SERIAL] = serial
        w[eb + E_LEVEL] = level
        w[eb + E_FS] = fs
        raw = name.encode("utf-8")
        off = self._lay.stats_names + i * L.NAME_BYTES
        self._mv[off: off + len(raw)] = raw
        w[eb + E_NAME_LEN] = len(raw)

    def _observe_wait(self, eb: int, ns: int) -> None:
        """The wait histogram with execute="true" (at dispatch, time-out or cancel)."""
        b = eb + E_WAIT_X + bisect_left(_DUR, ns)
        self._log(b, eb + E_WAIT_X + ND)
        self._w[b] += 1
        if ns:
            self._f[eb + E_WAIT_X + ND] += ns / 1e9

    def _note_arrival(self, eb: int, ms: int) -> None:
        w = self._w
        w[eb + E_WORK + bisect_left(WORK_BOUNDS, ms)] += 1
        w[eb + E_WORK_SUM] += ms

    def _note_rejection(self, eb: int, reason: int, exempt: bool) -> None:
        w = self._w
        self._log(eb + E_REJECTED + reason, eb + E_WAIT_R)
        w[eb + E_REJECTED + reason] += 1
        if not exempt:
            w[eb + E_WAIT_R] += 1  # a 0 s wait: bucket 0, the sum does not move

    def _count_lost_wait(self, lb: int, sa: int, now: int) -> None:
        """A waiting request whose worker is gone: counted as a cancel (reap, repair)."""
        w = self._w
        self._count_rejection(lb)
        self._log(lb + L_CANCELLED)
        w[lb + L_CANCELLED] += 1
        eb = w[sa + S_STATS] >> 1
        lay = self._lay
        # (after a holder died mid-admit the slot may be half written: check the address)
        if (lay.stats_base <= eb < lay.stats_entry(lay.cap.stats_entries + 1)
                and (eb - lay.stats_base) % ENTRY_WORDS == 0):
            self._log(eb + E_REJECTED + R_CANCELLED)
            w[eb + E_REJECTED + R_CANCELLED] += 1
            self._observe_wait(eb, max(0, now - w[sa + S_ARRIVAL_NS]))

    def _count_rejection(self, lb: int) -> None:
        w = self._w
        self._log(lb + L_REJECTED, lb + L.L_REJECTED_SHADOW)
        total = w[lb + L_REJECTED] + 1
        w[lb + L_REJECTED] = total
        w[lb + L.L_REJECTED_SHADOW] = total

    def turn_away(self, level: int, fs_index: int, seats: int, reason: str, now: int) -> None:
        """Count a request that a worker answered 429 before :meth:`admit` (its thread
        reserve: ``thread-reserve``) as an admit that rejected it: arrival work, rejection
        reason, 0 s wait, and the level's rejected total that Retry-After follows.

        Args:
            level: the request's level index.
            fs_index: its FlowSchema index (the stats entry).
            seats: max(initial, final) seats it asked for.
            reason: one of ``stats.REASONS``.
            now: monotonic ns (for a repair on entry).
        Raises:
            ValueError: an unknown level index or reason.
        """
        r = REASON_INDEX.get(reason)
        if r is None:
            raise ValueError(f"unknown rejection reason {reason!r}")
        self._locked(now, self._turn_away_locked, level, fs_index, seats, r)

    def _turn_away_locked(self, level: int, fs_index: int, seats: int, r: int) -> None:
        lb = self._lb(level)
        eb = self._stats_entry(lb, level, fs_index)
        self._note_arrival(eb, seats)
        self._count_rejection(lb)
        self._note_rejection(eb, r, self._w[lb + L_DESIRED] < 0)

    def count_head_timeout(self) -> None:
        """One more connection answered 408 because its request head was late."""
        self._locked(None, self._count_head_timeout_locked)

    def _count_head_timeout_locked(self) -> None:
        self._w[self._lay.counters_base + L.C_HEAD_TIMEOUTS] += 1

    @property
    def head_timeouts(self) -> int:
        """Connections answered 408 for a late request head, server-wide (one word read)."""
        return self._w[self._lay.counters_base + L.C_HEAD_TIMEOUTS]

    def rejected_total(self, level: int) -> int:
        """Cumulative rejections (every reason) of the level now at index ``level``; one word
        read, no lock (from the shadow copy no fast path ever rewrites). Restarts at 0 if the
        index is reused by a new level."""
        return self._w[self._lvb + level * LEVEL_WORDS + L.L_REJECTED_SHADOW]

    def _locked(self, now: int | None, fn, *args):
        """``fn(*args)`` under the lock, for calls that return no grants of their own: grants a
        repair finds on entry go to :attr:`pending_grants`."""
        self.pending_grants.extend(self._enter(now))
        try:
            out = fn(*args)
        except BaseException:
            self._lock.release()
            raise
        self._leave_ok()
        return out

    def _granting(self, now: int, fn, *args) -> list:
        """``fn(granted, *args)`` under the lock; returns ``granted``: what a repair found on
        entry plus what ``fn`` dispatched."""
        granted = self._enter(now)
        try:
            fn(granted, *args)
        except BaseException:
            self._lock.release()
            raise
        self._leave_ok()
        return granted

    def request_stats(self) -> list[RequestStats]:
        """Every stats entry as plain objects (under the lock), in creation order; the
        catch-all entry is included only once something was counted in it."""
        return self._locked(None, self._request_stats)

    def _request_stats(self) -> list[RequestStats]:
        w, f, lay = self._w, self._f, self._lay
        cap = lay.cap.stats_entries
        fs_names = self._fs_names_locked()
        out = []
        for i in [*range(w[L.H_STATS_COUNT]), cap]:
            eb = lay.stats_entry(i)
            words = w[eb: eb + ENTRY_WORDS].tolist()
            if i == cap and not any(words[E_WORK:]):
                continue
            floats = f[eb: eb + ENTRY_WORDS].tolist()
            off = lay.stats_names + i * L.NAME_BYTES
            level = bytes(self._mv[off: off + words[E_NAME_LEN]]).decode("utf-8")
            fs = words[E_FS]
            flow_schema = fs_names[fs] if 0 <= fs < len(fs_names) else OVERFLOW if fs == -1 else ""
            out.append(read_entry(words, floats, level, flow_schema))
        return out

    # -- virtual time ---------------------------------------------------------------------------

    def _sync(self, lb: int, now: int) -> None:
        """``syncTimeLocked``: advance R by round(ratio * dt) with the rate of the last span."""
        w = self._w
        last = w[lb + L_LAST_NS]
        if now <= last:
            return
        w[lb + L_LAST_NS] = now
        active = w[lb + L_ACTIVE_QUEUES]
        if active == 0:
            return
        c = w[lb + L_C]
        seats = w[lb + L_QSEATS]
        if active == 1:
            incr = seats_ns_times(seats if seats < c else c, now - last)
        else:
            incr = _std((seats if seats < c else c) / active, now - last)
        u = self._u
        prev = u[lb + L_R]
        r = (prev + incr) & U64
        u[lb + L_R] = r
        if r >= HIGH_R and r >= prev:
            self._advance_epoch(lb)

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

    # -- seat-demand integrator ---------------------------------------------------------------

    def _demand(self, lb: int, now: int) -> None:
        """``seatDemandIntegrator.Set(totSeatsInUse + totSeatsWaiting)``."""
        w = self._w
        self._demand_x(lb, now, float(w[lb + L_SEATS_IN_USE] + w[lb + L_SEATS_WAITING]))

    def _demand_x(self, lb: int, now: int, x: float) -> None:
        f, w = self._f, self._w
        last = w[lb + L_I_LAST]
        if now > last:
            sec, nsec = divmod(now - last, 1_000_000_000)
            dt = float(sec) + float(nsec) / 1e9  # Go's Duration.Seconds()
            cur = f[lb + L_I_CUR]
            f[lb + L_I_T] += dt
            f[lb + L_I_X] += cur * dt
            f[lb + L_I_XX] += cur * cur * dt
            w[lb + L_I_LAST] = now
        f[lb + L_I_CUR] = x
        if x < f[lb + L_I_MIN]:
            f[lb + L_I_MIN] = x
        if x > f[lb + L_I_MAX]:
            f[lb + L_I_MAX] = x

    # -- min-segment tree of head virtual finishes ----------------------------------------------

    def _set_leaf(self, lb: int, q: int, value: int) -> None:
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

    def _first_le(self, tb: int, p: int, lo: int, target: int) -> int:
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

    def _leaf_value(self, lb: int, q: int) -> int:
        w = self._w
        qa = self._qa(lb, q)
        if w[qa + Q_WAITING] == 0:
            return U64
        head = w[qa + Q_HEAD]
        return (self._u[qa + Q_NDR] + self._u[self._sa(head) + S_TOTAL_WORK]) & U64

    def _rebuild_tree(self, lb: int) -> None:
        w, u = self._w, self._u
        tb = w[lb + L_TBASE]
        p = w[lb + L_TP]
        if p == 0:  # a level that never had queues has no tree
            return
        nq = w[lb + L_NQ]
        for i in range(p):
            u[tb + p + i] = self._leaf_value(lb, i) if i < nq else U64
        for i in range(p - 1, 0, -1):
            a = u[tb + 2 * i]
            b = u[tb + 2 * i + 1]
            u[tb + i] = a if a <= b else b
        u[tb] = U64

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

    # -- FIFO -----------------------------------------------------------------------------------

    def _link_tail(self, lb: int, qa: int, s: int, sa: int) -> None:
        w, u = self._w, self._u
        tail = w[qa + Q_TAIL]
        w[sa + S_PREV] = tail
        w[sa + S_NEXT] = NIL
        if tail == NIL:
            w[qa + Q_HEAD] = s
        else:
            w[self._sb + tail * SLOT_WORDS + S_NEXT] = s
        w[qa + Q_TAIL] = s
        n = w[qa + Q_WAITING]
        w[qa + Q_WAITING] = n + 1
        if n == 0 and w[qa + Q_EXECUTING] == 0:
            w[lb + L_ACTIVE_QUEUES] += 1
        ms = w[sa + S_MAX_SEATS]
        w[qa + Q_INIT_SUM] += w[sa + S_INITIAL]
        w[qa + Q_MAX_SUM] += ms
        u[qa + Q_WORK_SUM] = (u[qa + Q_WORK_SUM] + u[sa + S_TOTAL_WORK]) & U64
        w[lb + L_QSEATS] += ms

    def _unlink(self, lb: int, qa: int, sa: int) -> None:
        w, u = self._w, self._u
        prev = w[sa + S_PREV]
        nxt = w[sa + S_NEXT]
        if prev == NIL:
            w[qa + Q_HEAD] = nxt
        else:
            w[self._sb + prev * SLOT_WORDS + S_NEXT] = nxt
        if nxt == NIL:
            w[qa + Q_TAIL] = prev
        else:
            w[self._sb + nxt * SLOT_WORDS + S_PREV] = prev
        w[sa + S_PREV] = NIL
        w[sa + S_NEXT] = NIL
        n = w[qa + Q_WAITING] - 1
        w[qa + Q_WAITING] = n
        if n == 0 and w[qa + Q_EXECUTING] == 0:
            w[lb + L_ACTIVE_QUEUES] -= 1
        ms = w[sa + S_MAX_SEATS]
        w[qa + Q_INIT_SUM] -= w[sa + S_INITIAL]
        w[qa + Q_MAX_SUM] -= ms
        u[qa + Q_WORK_SUM] = (u[qa + Q_WORK_SUM] - u[sa + S_TOTAL_WORK]) & U64
        w[lb + L_QSEATS] -= ms

    # -- slots ----------------------------------------------------------------------------------

    def _alloc(self, level: int, owner: int, flow_hash: int, fs_index: int, initial: int,
               final: int, al: int, now: int, detail: bytes) -> tuple[int, int, int]:
        w, u = self._w, self._u
        s = w[H_FREE_HEAD]
        sa = self._sb + s * SLOT_WORDS
        w[H_FREE_HEAD] = w[sa + S_NEXT]
        w[H_FREE_COUNT] -= 1
        gen = w[sa + S_GEN] + 1
        w[sa + S_GEN] = gen
        w[sa + S_OWNER] = owner
        w[sa + S_LEVEL] = level
        w[sa + S_QUEUE] = NIL
        w[sa + S_NEXT] = NIL  # was the free-list link
        w[sa + S_INITIAL] = initial
        w[sa + S_FINAL] = final
        w[sa + S_AL] = al
        ms = initial if initial >= final else final
        w[sa + S_MAX_SEATS] = ms
        w[sa + S_HELD] = ms
        g = w[self._lvb + level * LEVEL_WORDS + L_SERVICE_NS]
        w[sa + S_SERVICE_NS] = g
        iw = seats_ns_times(initial, g)
        fw = seats_ns_times(final, al) if final and al else 0
        u[sa + S_INIT_WORK] = iw
        u[sa + S_FINAL_WORK] = fw
        u[sa + S_TOTAL_WORK] = (iw + fw) & U64
        w[sa + S_ARRIVAL_NS] = now
        w[sa + S_START_NS] = 0
        u[sa + S_HASH] = flow_hash & U64
        w[sa + S_FS] = fs_index
        if detail:
            cap = self._lay.cap.detail_bytes
            d = detail[:cap]
            off = self._lay.details + s * self._lay.detail_stride
            self._mv[off:off + len(d)] = d
            w[sa + S_DETAIL_LEN] = len(d)
        else:
            w[sa + S_DETAIL_LEN] = 0
        return s, sa, gen

    def _slot_columns(self, *fields: int) -> list[list[int]]:
        """One list per field over the whole slot table (fast strided reads)."""
        w = self._w
        sb = self._sb
        end = sb + self._lay.cap.slots * SLOT_WORDS
        return [w[sb + f: end: SLOT_WORDS].tolist() for f in fields]

    def _free(self, s: int, sa: int) -> None:
        w = self._w
        w[sa + S_STATE] = FREE
        w[sa + S_QUEUE] = NIL
        w[sa + S_PREV] = NIL
        w[sa + S_NEXT] = w[H_FREE_HEAD]
        w[H_FREE_HEAD] = s
        w[H_FREE_COUNT] += 1

    def _slot_if(self, s: int, gen: int, state: int) -> int:
        """The slot's address if it still has this generation and state, else -1."""
        if not 0 <= s < self._lay.cap.slots:
            return -1
        sa = self._sb + s * SLOT_WORDS
        w = self._w
        if w[sa + S_GEN] != gen or w[sa + S_STATE] != state:
            return -1
        return sa

    # -- queueset rules -------------------------------------------------------------------------

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

    def _maybe_drop(self, lb: int) -> None:
        """A quiescing level goes away once nothing waits, executes or lingers in it."""
        w = self._w
        if (w[lb + L_QUIESCING] and w[lb + L_WAITING] == 0 and w[lb + L_EXECUTING] == 0
                and w[lb + L_SEATS_IN_USE] == 0):
            w[lb: lb + LEVEL_WORDS] = array("q", [0] * LEVEL_WORDS)
            w[L.H_GENERATION] += 1

    # -- request path ---------------------------------------------------------------------------

    def admit(self, level: int, flow_hash: int, initial_seats: int, final_seats: int,
              additional_latency_ns: int, owner: int, now: int, fs_index: int = 0,
              detail: bytes = b"", watch: bool = False) -> AdmitResult:
        """``StartRequest``: run now (EXECUTE), wait on ``slot`` (QUEUED) or REJECTED.
        ``fs_index`` and ``watch`` select the request's stats entry and execution histogram.

        The fast path (a queuing level with nothing waiting, a free slot and room for this
        request) is inline: computed in locals from one read of the level record and written
        back in one go. Every other case, and the rare epoch advance, goes to
        :meth:`_admit_slow` before the fast path has written anything; both leave exactly the
        same state. With the C fast paths bound, the ledger's ``admit`` is their entry
        ``admit_call`` instead (see :meth:`_accelerate`), which hands what it does not
        complete to :meth:`_admit_resume`; this method is then the reference."""
        return self._admit_locked(self._lock.acquire(), level, flow_hash, initial_seats,
                                  final_seats, additional_latency_ns, owner, now, fs_index,
                                  detail, watch)

    def _admit_resume(self, decline, level: int, flow_hash: int, initial_seats: int,
                      final_seats: int, additional_latency_ns: int, owner: int, now: int,
                      fs_index: int = 0, detail: bytes = b"", watch: bool = False) -> AdmitResult:
        """Where the C ``admit_call`` hands over: ``decline`` as ``_fastpath.c`` returns it."""
        dead = (self._lock.acquire() if decline is None
                else (None if decline < 0 else decline))
        return self._admit_locked(dead, level, flow_hash, initial_seats, final_seats,
                                  additional_latency_ns, owner, now, fs_index, detail, watch)

    def _admit_locked(self, dead, level, flow_hash, initial_seats, final_seats,
                      additional_latency_ns, owner, now, fs_index, detail, watch) -> AdmitResult:
        lock = self._lock
        w = self._w
        granted = self._recover(dead, now) if dead is not None or w[H_DIRTY] else []
        w[H_DIRTY] = 1  # cleared only when the operation completes
        try:
            res = None
            initial, final, al = initial_seats, final_seats, additional_latency_ns
            ms = initial if initial >= final else final
            lb = self._lvb + level * LEVEL_WORDS
            # (something waiting: the slow path, without paying for the record read first)
            if 0 <= level < self._nlevels and not w[lb + L_WAITING]:
                mv = self._mv
                (used, _qui, _nl, desired, hs, _qll, c, qbase, _qcap, _nq, _tb, _tp, serial,
                 waiting, sw, r, last, executing, in_use, active, qseats, it, ix, ixx, imn, imx,
                 cur, ilast, _robin, enq, dispatched) = _LEVEL.unpack_from(mv, lb * 8)
                head, nfree = _FREE_LIST.unpack_from(mv, H_FREE_HEAD * 8)
                fast = (used and desired > 0 and not waiting and head != NIL and in_use < c
                        and (in_use + ms <= c or (ms > c and executing == 0)))
                if fast and now > last:  # syncTimeLocked
                    if active:
                        seats = qseats if qseats < c else c
                        if active == 1:  # seats_ns_times inline: (x + 5) // 10 when exact
                            x = seats * (now - last)
                            nr = ((x + 5) // 10 if 0 <= x < EXACT_BOUND
                                  else seats_ns_times(seats, now - last))
                        else:
                            nr = _std(seats / active, now - last)
                        nr = (r + nr) & U64
                        fast = not (nr >= HIGH_R and nr >= r)  # the epoch advance: slow path
                        r = nr
                    last = now
                if fast:
                    u = self._u
                    eb = self._stats_at.get((serial << 32) | (fs_index & 0xFFFFFFFF))
                    if eb is None:
                        eb = self._stats_entry(lb, level, fs_index)
                    bw = eb + (_WORK_AT[ms] if ms < 101 else _WORK_INF)
                    sa = self._sb + head * SLOT_WORDS
                    # the undo log (_log inline): the words of this event that are not derived
                    _UNDO5.pack_into(mv, self._ub * 8, bw, w[bw], eb + E_WORK_SUM,
                                     w[eb + E_WORK_SUM], eb + E_WAIT_X, w[eb + E_WAIT_X],
                                     sa + S_STATE, w[sa + S_STATE], lb + L_DISPATCHED, dispatched)
                    w[H_UNDO_N] = 5
                    w[bw] += 1
                    w[eb + E_WORK_SUM] += ms
                    w[eb + E_WAIT_X] += 1  # dispatched at arrival: a 0 s wait
                    # nothing waits anywhere in the level, so every queue's waiting work is 0
                    # and the first card visited wins
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
                    if now > ilast:  # seat demand Set() after the enqueue
                        dt = now - ilast
                        dt = dt / 1e9 if dt < 1_000_000_000 else _seconds(dt)
                        it += dt
                        ix += cur * dt
                        ixx += cur * cur * dt
                        ilast = now
                    cur = float(in_use + sw + ms)
                    if cur < imn:
                        imn = cur
                    if cur > imx:
                        imx = cur
                    held = ms
                    if final > c:  # the final-seat cap
                        al = duration_per_seat(fw, float(c))
                        final = c
                        held = initial if initial >= c else c
                        if held != ms:  # Set() again after the dispatch, no time passing
                            cur = float(in_use + held + sw)
                            if cur < imn:
                                imn = cur
                            if cur > imx:
                                imx = cur
                    if ex == 0:
                        active += 1
                    w[qa + Q_EXECUTING] = ex + 1
                    w[qa + Q_SEATS] += held
                    u[qa + Q_NDR] = (ndr + tw) & U64
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
                                         imx, cur, ilast, q, enq + 1, dispatched + 1)
                    res = _new_tuple(AdmitResult, (EXECUTE, head, gen, "", granted))
            if res is None:
                res = self._admit_slow(level, flow_hash, initial_seats, final_seats,
                                       additional_latency_ns, owner, now, fs_index, detail,
                                       granted, 1 if watch else 0)
        except BaseException:
            lock.release()
            raise
        w[H_DIRTY] = 0
        w[H_UNDO_N] = 0
        lock.release()
        return res

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

    def finish(self, slot: int, gen: int, now: int) -> tuple[list, int]:
        """The main phase is over. Returns (granted, linger_until_ns); call :meth:`release`
        at ``linger_until_ns`` when it is not 0. A stale or unknown slot is a no-op.

        The fast path (no lingering, nothing waiting in the level, no queue to remove, not
        quiescing) is inline, computed in locals and written back in one go like
        :meth:`admit`'s; everything else goes to :meth:`_finish_slow`. With the C fast paths
        bound, the C entry ``finish_call`` replaces it, as for :meth:`admit`."""
        return self._finish_locked(self._lock.acquire(), slot, gen, now)

    def _finish_resume(self, decline, slot: int, gen: int, now: int) -> tuple[list, int]:
        """Where the C ``finish_call`` hands over (see :meth:`_admit_resume`)."""
        dead = (self._lock.acquire() if decline is None
                else (None if decline < 0 else decline))
        return self._finish_locked(dead, slot, gen, now)

    def _finish_locked(self, dead, slot: int, gen: int, now: int) -> tuple[list, int]:
        lock = self._lock
        w = self._w
        granted = self._recover(dead, now) if dead is not None or w[H_DIRTY] else []
        w[H_DIRTY] = 1
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
                            seats = qseats if qseats < c else c
                            if active == 1:  # seats_ns_times inline, as in admit
                                x = seats * (now - last)
                                nr = ((x + 5) // 10 if 0 <= x < EXACT_BOUND
                                      else seats_ns_times(seats, now - last))
                            else:
                                nr = _std(seats / active, now - last)
                            nr = (r + nr) & U64
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
                            # nextDispatchR -= initial*(G - S): usually negative, so the
                            # uint64 wraparound adds
                            x = initial * (g - ran)  # seats_ns_times inline
                            if 0 <= x < EXACT_BOUND:
                                corr = (x + 5) // 10
                            elif -EXACT_BOUND < x < 0:
                                corr = -((5 - x) // 10) & U64
                            else:
                                corr = seats_ns_times(initial, g - ran)
                            u[qa + Q_NDR] = (u[qa + Q_NDR] - corr) & U64
                            if w[H_SERVICE_ADAPT]:
                                self._learn(lb, ran)
                            w[qa + Q_SEATS] -= held
                            qseats -= held
                        in_use -= held
                        if now > ilast:  # seat demand Set() after the release
                            dt = now - ilast
                            dt = dt / 1e9 if dt < 1_000_000_000 else _seconds(dt)
                            it += dt
                            ix += cur * dt
                            ixx += cur * cur * dt
                            ilast = now
                        cur = float(in_use + sw)
                        if cur < imn:
                            imn = cur
                        if cur > imx:
                            imx = cur
                        head, nfree = _FREE_LIST.unpack_from(mv, H_FREE_HEAD * 8)
                        _SLOT_FREE.pack_into(mv, sa * 8, FREE, gen, owner, level, NIL, NIL, head)
                        _FREE_LIST.pack_into(mv, H_FREE_HEAD * 8, slot, nfree + 1)
                        _HOT.pack_into(mv, (lb + L_R) * 8, r, last, executing - 1, in_use,
                                       active, qseats, it, ix, ixx, imn, imx, cur, ilast)
                        linger = 0
            if linger < 0:
                linger = self._finish_slow(slot, gen, now, granted)
        except BaseException:
            lock.release()
            raise
        w[H_DIRTY] = 0
        w[H_UNDO_N] = 0
        lock.release()
        return granted, linger

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

    def _learn(self, lb: int, ran: int) -> None:
        w = self._w
        n = w[lb + L_SERVICE_N]
        if n < SERVICE_WINDOW:
            n += 1
            w[lb + L_SERVICE_N] = n
        w[lb + L_SERVICE_NS] = learn_service(w[lb + L_SERVICE_NS], n, ran)

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

    # -- workers --------------------------------------------------------------------------------

    def register_worker(self, owner: int, pid: int, now: int) -> None:
        """Record that worker index ``owner`` is process ``pid`` (used to repair after a
        holder dies)."""
        wa = self._lay.worker(owner)
        w = self._w
        w[wa + L.W_PID] = pid
        w[wa + L.W_STATE] = L.WORKER_ALIVE
        w[wa + L.W_HEARTBEAT] = now

    def set_worker_room(self, owner: int, room: bool) -> None:
        """Publish whether worker ``owner`` has a thread free for a non-exempt request (one
        word store, no lock)."""
        self._w[self._lay.worker(owner) + L.W_ROOM] = 1 if room else 0

    def other_worker_has_room(self, owner: int) -> bool:
        """Whether a live worker other than ``owner`` has published room (lock-free read of
        one word per worker record; a reaped worker's word is 0)."""
        lay = self._lay
        base = lay.worker_base + L.W_ROOM
        rooms = self._w[base: base + lay.cap.workers * L.WORKER_WORDS: L.WORKER_WORDS]
        n = rooms.tolist().count(1)
        return n > (1 if self._w[lay.worker(owner) + L.W_ROOM] else 0)

    def heartbeat(self, owner: int, now: int) -> None:
        self._w[self._lay.worker(owner) + L.W_HEARTBEAT] = now

    def workers(self) -> list[tuple[int, int, int, int]]:
        """[(owner, pid, state, heartbeat)] of registered workers."""
        w = self._w
        out = []
        for i in range(self._lay.cap.workers):
            wa = self._lay.worker(i)
            if w[wa + L.W_STATE] != L.WORKER_FREE:
                out.append((i, w[wa + L.W_PID], w[wa + L.W_STATE], w[wa + L.W_HEARTBEAT]))
        return out

    def owned_slots(self, owner: int) -> list[tuple[int, int, str]]:
        """[(slot, gen, state)] held by ``owner`` (the dispatcher's 100 ms backstop scan)."""
        return self._locked(None, self._owned_slots, owner)

    def _owned_slots(self, owner: int) -> list[tuple[int, int, str]]:
        states, owners, gens = self._slot_columns(S_STATE, S_OWNER, S_GEN)
        return [(s, gens[s], L.STATE_NAMES[st]) for s, st in enumerate(states)
                if st != FREE and owners[s] == owner]

    def reap_worker(self, owner: int, now: int) -> list:
        """Drop everything worker ``owner`` had (waits, executions, lingering seats) and
        dispatch what that frees. Idempotent."""
        return self._granting(now, self._reap_worker, owner, now)

    def _reap_worker(self, granted: list, owner: int, now: int) -> None:
        self._reap(owner, now)
        self._dispatch_every_level(now, granted)
        wa = self._lay.worker(owner)
        if self._w[wa + L.W_STATE] != L.WORKER_FREE:
            self._w[wa + L.W_STATE] = L.WORKER_GONE
        self._w[wa + L.W_ROOM] = 0

    def _reap(self, owner: int, now: int) -> None:
        w = self._w
        synced = set()
        states, owners = self._slot_columns(S_STATE, S_OWNER)
        for s in range(len(states)):
            if states[s] == FREE or owners[s] != owner:
                continue
            sa = self._sb + s * SLOT_WORDS
            state = w[sa + S_STATE]
            level = w[sa + S_LEVEL]
            lb = self._lvb + level * LEVEL_WORDS
            if level not in synced:
                self._sync(lb, now)
                synced.add(level)
            if state == WAITING:
                self._drop_waiting(lb, s, sa, now)
                self._count_lost_wait(lb, sa, now)
                self._commit()
                continue
            if state == EXECUTING:
                self._end_main_phase(lb, sa, now)
            self._release_seats(lb, level, s, sa, now)

    def _dispatch_every_level(self, now: int, granted: list) -> None:
        w = self._w
        for level in range(self._lay.cap.levels):
            lb = self._lvb + level * LEVEL_WORDS
            if w[lb + L_USED]:
                if w[lb + L_WAITING]:
                    self._sync(lb, now)
                    self._dispatch_all(lb, now, granted)
                self._maybe_drop(lb)

    # -- configuration --------------------------------------------------------------------------

    def configure(self, specs, flow_schema_names, now: int,
                  granted: list | None = None) -> tuple[dict[str, int], dict[str, int]]:
        """Apply the whole set of levels (levels not named start quiescing) and intern the
        FlowSchema names. Returns ({level name: index}, {flow schema name: index}); requests
        a limit increase dispatches are appended to ``granted`` when given."""
        specs = list(specs)
        seen = set()
        for spec in specs:
            raw = spec.name.encode("utf-8")
            if not raw or len(raw) > L.NAME_BYTES - 3:
                raise ValueError(f"level name {spec.name!r} must be 1..253 bytes of UTF-8")
            if spec.name in seen:
                raise ValueError(f"level {spec.name!r} is configured twice")
            seen.add(spec.name)
            if spec.desired_queues > 0:
                try:
                    check_dealer(spec.desired_queues, spec.hand_size)
                except DealerError as e:
                    raise ValueError(
                        "the QueueSetConfig implies an invalid shuffle sharding config "
                        f"(DesiredNumQueues is deckSize): {e}") from e
            if spec.concurrency_limit < 0:
                raise ValueError(f"level {spec.name!r}: negative concurrency limit")
        fs_list = list(flow_schema_names)
        for name in fs_list:
            if len(name.encode("utf-8")) > L.NAME_BYTES - 3:
                raise ValueError(f"flow schema name {name!r} is longer than 253 bytes")
        got = self._enter(now)  # repair grants and dispatches both go where the caller asked
        try:
            result = self._configure(specs, fs_list, now, got)
        except BaseException:
            self._lock.release()
            raise
        self._leave_ok()
        if granted is not None:
            granted.extend(got)
        else:
            self.pending_grants.extend(got)
        return result

    def _level_names_locked(self) -> dict[str, int]:
        w = self._w
        out = {}
        for i in range(self._lay.cap.levels):
            lb = self._lvb + i * LEVEL_WORDS
            if w[lb + L_USED]:
                out[self._read_name(self._lay.level_names, i, w[lb + L.L_NAME_LEN])] = i
        return out

    def _read_name(self, area: int, i: int, n: int) -> str:
        off = area + i * L.NAME_BYTES
        return bytes(self._mv[off: off + n]).decode("utf-8")

    def _configure(self, specs, fs_list, now, granted):
        w = self._w
        cap = self._lay.cap
        existing = self._level_names_locked()
        new_specs = [sp for sp in specs if sp.name not in existing]
        free_levels = [i for i in range(cap.levels)
                       if not w[self._lvb + i * LEVEL_WORDS + L_USED]]
        if len(new_specs) > len(free_levels):
            raise ValueError(f"more than {cap.levels} priority levels (Capacity.levels)")
        # FlowSchema names: append-only intern table
        fs_known = self._fs_names_locked()
        fs_index = {name: i for i, name in enumerate(fs_known)}
        fresh = [n for n in dict.fromkeys(fs_list) if n not in fs_index]
        if len(fs_known) + len(fresh) > cap.flow_schemas:
            raise ValueError(f"more than {cap.flow_schemas} FlowSchema names "
                             f"(Capacity.flow_schemas)")
        # queue regions: every level needs room for max(current queues, desired queues)
        index_of = dict(existing)
        for sp, i in zip(new_specs, free_levels, strict=False):
            index_of[sp.name] = i
        by_index = {index_of[sp.name]: sp for sp in specs}
        needs = {}
        for name, i in index_of.items():
            lb = self._lvb + i * LEVEL_WORDS
            nq = w[lb + L_NQ] if name in existing else 0
            sp = by_index.get(i)
            want = sp.desired_queues if sp is not None and sp.desired_queues > 0 else 0
            needs[i] = max(nq, want)
        if sum(needs.values()) > cap.queues:
            raise ValueError(f"the levels need {sum(needs.values())} queues, more than "
                             f"Capacity.queues = {cap.queues}")
        # ---- no more failures past this point ----
        for name in fresh:
            i = len(fs_known)
            raw = name.encode("utf-8")
            off = self._lay.fs_names + i * L.NAME_BYTES
            self._mv[off] = len(raw)
            self._mv[off + 1: off + 1 + len(raw)] = raw
            fs_known.append(name)
            fs_index[name] = i
        w[L.H_FS_COUNT] = len(fs_known)
        for sp, i in zip(new_specs, free_levels, strict=False):
            self._init_level(i, sp, now)
        relayout = any(needs[i] > w[self._lvb + i * LEVEL_WORDS + L.L_QCAP] for i in needs)
        if relayout:
            self._relayout(needs)
        for sp in specs:
            i = index_of[sp.name]
            lb = self._lvb + i * LEVEL_WORDS
            self._sync(lb, now)
            self._set_configuration(lb, sp)
            w[lb + L_QUIESCING] = 0
            self._dispatch_all(lb, now, granted)
        named = set(index_of[sp.name] for sp in specs)
        for i in existing.values():
            if i not in named:
                lb = self._lvb + i * LEVEL_WORDS
                w[lb + L_QUIESCING] = 1
                self._maybe_drop(lb)
        w[L.H_GENERATION] += 1
        return ({sp.name: index_of[sp.name] for sp in specs},
                {name: fs_index[name] for name in fs_list})

    def _init_level(self, i: int, sp: LevelSpec, now: int) -> None:
        w = self._w
        lb = self._lvb + i * LEVEL_WORDS
        w[lb: lb + LEVEL_WORDS] = array("q", [0] * LEVEL_WORDS)
        raw = sp.name.encode("utf-8")
        off = self._lay.level_names + i * L.NAME_BYTES
        self._mv[off: off + len(raw)] = raw
        w[lb + L.L_NAME_LEN] = len(raw)
        w[lb + L_LAST_NS] = now
        w[lb + L_I_LAST] = now
        w[lb + L_DESIRED] = 0
        w[lb + L_SERVICE_NS] = w[H_SERVICE_NS]
        w[L.H_LEVEL_SERIAL] += 1
        w[lb + L.L_SERIAL] = w[L.H_LEVEL_SERIAL]
        w[lb + L_USED] = 1
        # float zeros are all-zero bits already; region assigned by _relayout
        w[lb + L.L_QCAP] = 0
        w[lb + L_TP] = 0

    def _set_configuration(self, lb: int, sp: LevelSpec) -> None:
        """``setConfiguration``: add queues at once, shrink by attrition; desired <= 0 keeps
        the old queue length limit and hand size so remaining queues drain as before."""
        w = self._w
        desired = sp.desired_queues
        if desired > 0:
            nq = w[lb + L_NQ]
            if desired > nq:
                for q in range(nq, desired):
                    qa = self._qa(lb, q)
                    w[qa: qa + QUEUE_WORDS] = array("q", [0] * QUEUE_WORDS)
                    w[qa + Q_HEAD] = NIL
                    w[qa + Q_TAIL] = NIL
                w[lb + L_NQ] = desired
                # new leaves are empty (MaxSeatSeconds), as are the tree's unused leaves
            w[lb + L_QLL] = sp.queue_length_limit
            w[lb + L_HAND] = sp.hand_size
        w[lb + L_DESIRED] = desired
        w[lb + L_C] = sp.concurrency_limit

    def _relayout(self, needs: dict[int, int]) -> None:
        """Re-pack every level's queue region (capacity ``needs[level]``) and tree."""
        w = self._w
        lay = self._lay
        saved = {}
        for i in needs:
            lb = self._lvb + i * LEVEL_WORDS
            nq = w[lb + L_NQ]
            if nq:
                a = self._qa(lb, 0)
                saved[i] = w[a: a + nq * QUEUE_WORDS].tolist()
        qend = self._qb + lay.cap.queues * QUEUE_WORDS
        w[self._qb: qend] = array("q", [0] * (lay.cap.queues * QUEUE_WORDS))
        u = self._u
        u[lay.tree_base: lay.tree_base + lay.tree_words] = array(
            "Q", [U64] * lay.tree_words)
        pos = 0
        tpos = lay.tree_base
        for i in sorted(needs):
            lb = self._lvb + i * LEVEL_WORDS
            qcap = needs[i]
            w[lb + L_QBASE] = pos
            w[lb + L.L_QCAP] = qcap
            p = _next_pow2(max(qcap, 1))
            w[lb + L_TBASE] = tpos
            w[lb + L_TP] = p
            tpos += 2 * p
            if i in saved:
                a = self._qb + pos * QUEUE_WORDS
                w[a: a + len(saved[i])] = array("q", saved[i])
            pos += qcap
        for i in sorted(needs):
            self._rebuild_tree(self._lvb + i * LEVEL_WORDS)

    def set_limits(self, limits: dict[int, int], now: int) -> list:
        """Change concurrency limits (borrowing); dispatches what a higher limit allows."""
        return self._granting(now, self._set_limits, limits, now)

    def _set_limits(self, granted: list, limits: dict[int, int], now: int) -> None:
        w = self._w
        for level, c in limits.items():
            lb = self._lb(level)
            self._sync(lb, now)
            w[lb + L_C] = int(c)
            self._dispatch_all(lb, now, granted)

    # -- reading --------------------------------------------------------------------------------

    def _fs_names_locked(self) -> list[str]:
        n = self._w[L.H_FS_COUNT]
        out = []
        for i in range(n):
            off = self._lay.fs_names + i * L.NAME_BYTES
            ln = self._mv[off]
            out.append(bytes(self._mv[off + 1: off + 1 + ln]).decode("utf-8"))
        return out

    def flow_schema_names(self) -> list[str]:
        """Interned FlowSchema names; a slot's ``fs_index`` indexes this list."""
        return self._locked(None, self._fs_names_locked)

    def level_indices(self) -> dict[str, int]:
        """{level name: index} of the levels in the ledger (cached per config generation)."""
        if self._w[L.H_GENERATION] != self._names_gen:
            self._names, self._names_gen = self._locked(
                None, lambda: (self._level_names_locked(), self._w[L.H_GENERATION]))
        return dict(self._names)

    def take_demand_stats(self, level: int, now: int) -> DemandStats:
        """Kubernetes ``Integrator.Reset()``: results since the last take, then restart
        (min and max restart at the current value). Does not sync R."""
        return self._locked(now, self._demand_results, level, now, True)

    def demand_stats(self, level: int, now: int) -> DemandStats:
        """Kubernetes ``Integrator.GetResults()``: cumulative since the last take, no reset."""
        return self._locked(now, self._demand_results, level, now, False)

    def _demand_results(self, level: int, now: int, reset: bool) -> DemandStats:
        lb = self._lb(level)
        f = self._f
        self._demand_x(lb, now, f[lb + L_I_CUR])
        stats = _results(f[lb + L_I_T], f[lb + L_I_X], f[lb + L_I_XX], f[lb + L_I_MIN],
                         f[lb + L_I_MAX])
        if reset:
            f[lb + L_I_T] = 0.0
            f[lb + L_I_X] = 0.0
            f[lb + L_I_XX] = 0.0
            f[lb + L_I_MIN] = f[lb + L_I_CUR]
            f[lb + L_I_MAX] = f[lb + L_I_CUR]
        return stats

    def snapshot(self, now: int) -> Snapshot:
        """A consistent view of every level, queue and request (for dumps and metrics)."""
        return self._locked(now, self._snapshot, now)

    def _snapshot(self, now: int) -> Snapshot:
        w, u = self._w, self._u
        levels = []
        per_level: dict[int, list] = {}
        states, slot_levels = self._slot_columns(S_STATE, S_LEVEL)
        for s, st in enumerate(states):
            if st != FREE:
                per_level.setdefault(slot_levels[s], []).append(s)
        for i in range(self._lay.cap.levels):
            lb = self._lvb + i * LEVEL_WORDS
            if not w[lb + L_USED]:
                continue
            queues = []
            position = {}
            for q in range(w[lb + L_NQ]):
                qa = self._qa(lb, q)
                queues.append(QueueSnapshot(
                    q, w[qa + Q_WAITING], w[qa + Q_EXECUTING], w[qa + Q_SEATS],
                    u[qa + Q_NDR], w[qa + Q_INIT_SUM], w[qa + Q_MAX_SUM], u[qa + Q_WORK_SUM]))
                s = w[qa + Q_HEAD]
                k = 0
                while s != NIL:
                    position[s] = k
                    k += 1
                    s = w[self._sb + s * SLOT_WORDS + S_NEXT]
            requests = []
            for s in per_level.get(i, ()):
                sa = self._sb + s * SLOT_WORDS
                off = self._lay.details + s * self._lay.detail_stride
                requests.append(RequestSnapshot(
                    s, w[sa + S_QUEUE], position.get(s, -1), u[sa + S_HASH], w[sa + S_FS],
                    w[sa + S_OWNER], w[sa + S_ARRIVAL_NS], w[sa + S_START_NS],
                    w[sa + S_INITIAL], w[sa + S_FINAL], w[sa + S_AL],
                    L.STATE_NAMES[w[sa + S_STATE]],
                    bytes(self._mv[off: off + w[sa + S_DETAIL_LEN]]), w[sa + S_GEN]))
            levels.append(LevelSnapshot(
                i, self._read_name(self._lay.level_names, i, w[lb + L.L_NAME_LEN]),
                w[lb + L_DESIRED], w[lb + L_C], bool(w[lb + L_QUIESCING]),
                w[lb + L_SEATS_IN_USE], w[lb + L_SEATS_WAITING], w[lb + L_WAITING],
                w[lb + L_EXECUTING], u[lb + L_R], w[lb + L_DISPATCHED], w[lb + L_REJECTED],
                w[lb + L_TIMEDOUT], w[lb + L_CANCELLED], queues, requests,
                w[lb + L_HAND], w[lb + L_QLL], w[lb + L.L_EPOCH_OK], w[lb + L.L_EPOCH_FAIL],
                w[lb + L_SERVICE_NS]))
        return Snapshot(now, levels, self._fs_names_locked(),
                        w[self._lay.counters_base + L.C_HEAD_TIMEOUTS])


    def load(self, levels: tuple[int, ...] | None = None) -> list[LevelLoad]:
        """Every configured level's seats and counters, read without the lock.

        For load reports (the HAProxy agent, ORCA headers): it never waits for a request.
        Returns a :class:`LevelLoad` per configured level in index order, or only for the
        configured ones among ``levels`` (indices, in that order; cheaper than scanning the
        whole level table).

        Each word is read whole (memoryview stores are single 8-byte writes), but the levels
        are not read at one instant and may be mid-operation. The pure-Python fast paths
        rewrite ``L_SEATS_IN_USE`` and ``L_DISPATCHED`` with ``struct.pack_into``, which
        zero-fills before writing (gunicorn-ipc.md 3.5), so a read can see them as 0 for an
        instant: both are read twice and the larger value kept (a torn read only ever makes
        them smaller; the C fast paths store plain words).

        Raises:
            ValueError: the buffer no longer holds a valid ledger (bad magic or version),
                or its views were released (:meth:`close`).
        """
        w = self._w
        if w[L.H_MAGIC] != L.MAGIC or w[L.H_VERSION] != L.VERSION:
            raise ValueError("the buffer does not hold a valid apf_gunicorn ledger")
        out = []
        base = self._lvb
        for i in range(self._nlevels) if levels is None else levels:
            if not 0 <= i < self._nlevels:
                continue
            lb = base + i * LEVEL_WORDS
            if not w[lb + L_USED]:
                continue
            out.append(LevelLoad(
                i, w[lb + L_DESIRED] < 0, w[lb + L_C],
                max(w[lb + L_SEATS_IN_USE], w[lb + L_SEATS_IN_USE]),
                w[lb + L_SEATS_WAITING], w[lb + L_WAITING],
                max(w[lb + L_DISPATCHED], w[lb + L_DISPATCHED]),
                w[lb + L.L_REJECTED_SHADOW]))
        return out


def _results(t: float, x: float, xx: float, mn: float, mx: float) -> DemandStats:
    """``Moments.ToResults`` plus min and max."""
    nan = float("nan")
    if t <= 0:
        return DemandStats(t, nan, nan, mn, mx)
    avg = x / t
    var = xx / t - avg * avg
    return DemandStats(t, avg, math.sqrt(var) if var >= 0 else nan, mn, mx)
