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

How it is built: ``Ledger`` is a thin facade over mixins, one per concern, that share its
buffer views (``_w``/``_u``/``_f``/``_mv``) and call each other as methods (no extra object on
the per-request path). This module holds construction, the lock funnel (the one way into a
locked operation: ``_begin_locked`` / ``_end_locked``), the routers to the level's fairness
and the undo log. The rest: ``requestpath.py`` (admit, finish, release, cancel and the general
path), ``fastpath.py`` (their fast paths, mirrored by ``_fastpath.c``), ``queueset.py`` (the
Kubernetes fairness, behind ``fairness.py``), ``vclock.py`` (R and the seat-demand
integrator), ``mintree.py``, ``words.py`` (addresses, slots, FIFOs), ``counters.py``
(per-request stats), ``service.py`` (G), ``configure.py``, ``snapshot.py`` (readers),
``workers.py``, ``records.py`` (result types and ``LedgerPort``) and ``repair.py``. A method
named ``..._locked`` expects the lock held. See docs/ARCHITECTURE.md for the module map.
"""

from __future__ import annotations

import functools

from apf_gunicorn.ledger import layout as L
from apf_gunicorn.ledger.configure import Configuration
from apf_gunicorn.ledger.counters import RequestCounters
from apf_gunicorn.ledger.fastpath import _ACCEL, _MM_C_METHODS, FastPaths
from apf_gunicorn.ledger.layout import (
    H_DIRTY,
    H_FREE_COUNT,
    H_FREE_HEAD,
    H_SERVICE_ADAPT,
    H_SERVICE_NS,
    H_UNDO_N,
    L_SERVICE_NS,
    NIL,
    S_NEXT,
    S_PREV,
    S_QUEUE,
    SLOT_WORDS,
    Capacity,
    Layout,
)
from apf_gunicorn.ledger.lock import NullLock
from apf_gunicorn.ledger.maxmin import MaxMinFairness
from apf_gunicorn.ledger.mintree import MinTree
from apf_gunicorn.ledger.queueset import KubernetesQueueSet
from apf_gunicorn.ledger.records import (
    EXECUTE,
    QUEUED,
    REJECTED,
    AdmitResult,
    DemandStats,
    LedgerPort,
    LevelLoad,
    LevelSnapshot,
    LevelSpec,
    QueueSnapshot,
    RequestSnapshot,
    Snapshot,
)
from apf_gunicorn.ledger.repair import RepairView, repair_locked
from apf_gunicorn.ledger.requestpath import RequestPath
from apf_gunicorn.ledger.service import (
    DEFAULT_SERVICE_ESTIMATE_NS,
    MAX_SERVICE_ESTIMATE_NS,
    SERVICE_WINDOW,
    ServiceEstimate,
    learn_service,
)
from apf_gunicorn.ledger.snapshot import Reading
from apf_gunicorn.ledger.stats import OVERFLOW
from apf_gunicorn.ledger.vclock import VirtualClock
from apf_gunicorn.ledger.words import BufferWords
from apf_gunicorn.ledger.workers import WorkerTable

__all__ = [  # the names importers take from here (defined in the mixin modules)
    "DEFAULT_SERVICE_ESTIMATE_NS", "EXECUTE", "MAX_SERVICE_ESTIMATE_NS", "QUEUED", "REJECTED",
    "SERVICE_WINDOW", "_ACCEL", "AdmitResult", "Capacity", "DemandStats", "Ledger",
    "LedgerPort", "LevelLoad", "LevelSnapshot", "LevelSpec", "QueueSnapshot",
    "RequestSnapshot", "Snapshot", "learn_service",
]


class Ledger(FastPaths, RequestPath, VirtualClock, MinTree, RequestCounters,
             ServiceEstimate, Configuration, Reading, WorkerTable, BufferWords):
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
        self._queueset = KubernetesQueueSet(self)  # the fairnesses (fairness.py)
        self._maxmin = MaxMinFairness(self)
        self._snapshot_copies: list = []  # snapshot.py's private copies, kept for reuse

    # -- construction -------------------------------------------------------------------------

    @staticmethod
    def size(cap: Capacity | None = None) -> int:
        """Bytes a ledger of these capacities needs (``Capacity()`` when None)."""
        return Layout(cap or Capacity()).size

    @classmethod
    def create(cls, buf, cap: Capacity | None = None, lock=None,
               service_estimate_ns: int = DEFAULT_SERVICE_ESTIMATE_NS,
               owner_pid: int = 0, accelerate: bool = True,
               learn_service: bool = False) -> Ledger:
        """Format ``buf`` as an empty ledger (zeroed, free list, header) and initialise the lock's
        shared part.

        Args:
            buf: a writable buffer of at least :meth:`size` bytes (a ``bytearray``, or an mmap of
                POSIX shared memory for ``ProcessLock``).
            cap: the capacities (``Capacity()`` when None).
            lock: ``NullLock`` (one thread; the default) or ``ProcessLock`` (processes).
            service_estimate_ns: G, the service time charged to a request's queue when it is
                dispatched (its completion corrects the charge to the time it really ran).
            owner_pid: the creating process, recorded in the header.
            accelerate: use the C fast paths when they are built (see :attr:`accelerated`).
            learn_service: each level starts at G and learns its own from the requests it
                finishes (:func:`learn_service`); without, G stays fixed, as in Kubernetes.
        Returns:
            The ledger over ``buf``.
        Raises:
            ValueError: ``service_estimate_ns`` outside [0, 60 s], or ``buf`` too small.
        """
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
        led._maxmin.format_locked()
        led._name_stats_entry_locked(cap.stats_entries, OVERFLOW, -1, -1)  # the catch-all
        led._lock.bind(led._mv, w, True)
        if accelerate:
            led._accelerate()
        w[L.H_MAGIC] = L.MAGIC  # last: a reader never sees a half-formatted ledger as valid
        return led

    @classmethod
    def attach(cls, buf, lock=None, accelerate: bool = True) -> Ledger:
        """Wrap a buffer that :meth:`create` formatted (in this or another process).

        Args:
            buf: the buffer (an mmap of the shared memory segment).
            lock: the same kind of lock the creator used (``ProcessLock`` across processes).
            accelerate: use the C fast paths when they are built.
        Returns:
            A ledger over ``buf``, with the capacities recorded in its header.
        Raises:
            ValueError: ``buf`` does not hold a ledger of this layout version.
        """
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

    def never_wait_on(self, thread_ident: int) -> None:
        """Calls on thread ``thread_ident`` raise ``lock.LockBusy`` (before anything is held or
        changed) instead of waiting while another process holds the lock: for an event loop
        (``ProcessLock.never_wait_on``)."""
        self._lock.never_wait_on(thread_ident)

    def close(self) -> None:
        """Release the buffer views (and the C fast paths' hold on them) so the underlying mmap
        can be closed; the ledger is unusable afterwards.
        """
        fp, self._fp = self._fp, None
        if fp is not None:
            self.__dict__.pop("admit", None)
            self.__dict__.pop("finish", None)
            for name, _method in _MM_C_METHODS:
                self._maxmin.__dict__.pop(name, None)
            fp.close()
        unbind = getattr(self._lock, "unbind", None)
        if unbind:
            unbind()
        for view in (self._w, self._u, self._f, self._mv):
            view.release()

    @property
    def capacity(self) -> Capacity:
        """The capacities the ledger was created with."""
        return self._lay.cap

    @property
    def service_estimate_ns(self) -> int:
        """G as configured: every level's starting (or, if not learnt, fixed) estimate."""
        return self._w[H_SERVICE_NS]

    def level_service_estimate_ns(self, level: int) -> int:
        """The G that ``level`` charges now (one word read, no lock).

        Raises:
            ValueError: ``level`` is out of range or not configured.
        """
        return self._w[self._lb(level) + L_SERVICE_NS]

    def repair_view(self) -> RepairView:
        """The buffer views and lock-held steps that ``repair.py`` uses (its rebuild, rollback
        and :func:`~apf_gunicorn.ledger.repair.verify`), so that it needs nothing private.

        Returns:
            A :class:`~apf_gunicorn.ledger.repair.RepairView` over this ledger; its ``..._locked``
            steps need the lock held (a repair runs inside the lock funnel).
        """
        return RepairView(self._w, self._u, self._lay, self._qa, self._count_lost_wait_locked,
                          self._log_locked, self._commit_locked, self._demand_locked,
                          self._repair_level_locked, self._dispatch_all_locked,
                          self._leaf_value_locked,
                          functools.partial(self._maxmin.verify_locked, self))

    # -- the lock funnel -------------------------------------------------------------------------
    # Every operation runs as: take the lock, _begin_locked, the operation's ..._locked body,
    # then _end_locked (or _abort_locked when the body raised). _begin_locked is the one place
    # that repairs after a dead holder or an interrupted operation and sets the dirty mark, as
    # Kubernetes' lockAndSyncTime is the one place that syncs the clock: no operation can skip
    # it. (The C fast paths take the lock themselves and hand any ledger that needs repair to
    # Python before writing anything, see fastpath.py.) A method named ..._locked expects the
    # lock held and the dirty mark set; the public operations are the only callers of the funnel.

    def _begin_locked(self, dead: int | None, now: int | None) -> list:
        """The first step under the lock: repair when the lock reported a dead holder (``dead``,
        its pid) or the dirty mark shows an operation that did not complete, then set the dirty
        mark, which only :meth:`_end_locked` clears. Returns the grants a repair dispatched."""
        w = self._w
        granted = self._recover_locked(dead, now) if dead is not None or w[H_DIRTY] else []
        w[H_DIRTY] = 1
        return granted

    def _end_locked(self) -> None:
        """The operation completed: clear the dirty mark and the undo log, release the lock."""
        w = self._w
        w[H_DIRTY] = 0
        w[H_UNDO_N] = 0
        self._lock.release()

    def _abort_locked(self) -> None:
        """The operation raised: release the lock with the dirty mark still set, so the next
        locker repairs (and rolls back the half-written event)."""
        self._lock.release()

    def _enter(self, now: int | None) -> list:
        """Take the lock and pass the funnel; returns the grants of a repair."""
        return self._begin_locked(self._lock.acquire(), now)

    def _recover_locked(self, dead: int | None, now: int | None) -> list:
        """Repair after a dead holder (``dead`` = its pid) or an interrupted operation."""
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

    def _locked(self, now: int | None, fn, *args):
        """``fn(*args)`` under the lock, for calls that return no grants of their own: grants a
        repair finds on entry go to :attr:`pending_grants`."""
        self.pending_grants.extend(self._enter(now))
        try:
            out = fn(*args)
        except BaseException:
            self._abort_locked()
            raise
        self._end_locked()
        return out

    def _granting(self, now: int, fn, *args) -> tuple[list, object]:
        """``fn(granted, *args)`` under the lock, where ``granted`` starts as what a repair found
        on entry and ``fn`` appends what it dispatches. Returns ``(granted, fn's result)``."""
        granted = self._enter(now)
        try:
            out = fn(granted, *args)
        except BaseException:
            self._abort_locked()
            raise
        self._end_locked()
        return granted, out

    # -- the fairness ----------------------------------------------------------------------------
    # The general path asks the level's fairness (fairness.py) what to do with its queues
    # through these routers only: they are the one place that picks the fairness, by the level's
    # L_FAIRNESS: Kubernetes' queueset (self._queueset) or maxmin (self._maxmin).

    def _fairness_locked(self, lb: int) -> KubernetesQueueSet | MaxMinFairness:
        """The fairness of the level at word address ``lb`` (its ``L_FAIRNESS``)."""
        return self._maxmin if self._w[lb + L.L_FAIRNESS] else self._queueset

    def _enqueue_locked(self, lb: int, level: int, q: int, qa: int, req: tuple, eb: int, ms: int,
                        watch: int, granted: list) -> AdmitResult:
        """A request of a queuing level that does not run at once and waits in queue ``q``
        (``_verdict_locked``): queue it, then dispatch what fits."""
        return self._fairness_locked(lb).enqueue_locked(self, lb, level, q, qa, req, eb, ms,
                                                        watch, granted)

    def _dispatch_all_locked(self, lb: int, now: int, granted: list) -> None:
        """Dispatch what fits in the level (seats were freed or the limit rose)."""
        self._fairness_locked(lb).dispatch_all_locked(self, lb, now, granted)

    def _touch_locked(self, lb: int, q: int) -> None:
        """Queue ``q`` of the level changed: let the fairness re-rank it."""
        self._fairness_locked(lb).touch_locked(self, lb, q)

    def _waiting_removed_locked(self, lb: int, q: int, sa: int) -> None:
        """The waiting request in slot ``sa`` left queue ``q`` without running (its slot is
        still allocated)."""
        self._fairness_locked(lb).waiting_removed_locked(self, lb, q, sa)

    def _advance_epoch_locked(self, lb: int) -> None:
        """R reached ``highR`` (see :func:`vclock.r_after`)."""
        self._fairness_locked(lb).advance_epoch_locked(self, lb)

    def _queues_moved_locked(self, lb: int) -> None:
        """The level's queues were renumbered or re-packed."""
        self._fairness_locked(lb).queues_moved_locked(self, lb)

    def _main_phase_ended_locked(self, lb: int, q: int, qa: int, sa: int, now: int,
                                 learn: bool = True) -> None:
        """The request in slot ``sa`` of queue ``q`` (at ``qa``) ended its main phase
        (``learn``: it finished; False: its worker died)."""
        self._fairness_locked(lb).main_phase_ended_locked(self, lb, q, qa, sa, now, learn)

    def _repair_level_locked(self, lb: int) -> None:
        """A repair rebuilt the level's queues from the slot table."""
        self._fairness_locked(lb).repair_locked(self, lb)

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

    def _log_locked(self, *addrs: int) -> None:
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

    def _commit_locked(self) -> None:
        """The current event is complete: nothing to undo."""
        self._w[H_UNDO_N] = 0
