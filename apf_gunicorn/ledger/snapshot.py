"""Reading the ledger: consistent snapshots, seat-demand statistics and the lock-free load.

:meth:`Reading.snapshot` copies every level, queue and request into plain records under the
lock (the debug dumps and the metrics); :meth:`Reading.take_demand_stats` and
:meth:`Reading.demand_stats` are the seat-demand integrator's ``Reset()`` and ``GetResults()``
(the borrowing loop); :meth:`Reading.load` reads each level's seats and counters without the
lock (load reports), never waiting for a request::

    snap = led.snapshot(now)               # Snapshot(now, levels, flow_schema_names, ...)
    stats = led.take_demand_stats(level, now)
"""

from __future__ import annotations

from apf_gunicorn.ledger import layout as L
from apf_gunicorn.ledger.layout import (
    FREE,
    L_C,
    L_CANCELLED,
    L_DESIRED,
    L_DISPATCHED,
    L_EXECUTING,
    L_HAND,
    L_NQ,
    L_QLL,
    L_QUIESCING,
    L_R,
    L_REJECTED,
    L_SEATS_IN_USE,
    L_SEATS_WAITING,
    L_SERVICE_NS,
    L_TIMEDOUT,
    L_USED,
    L_WAITING,
    LEVEL_WORDS,
    NIL,
    Q_EXECUTING,
    Q_HEAD,
    Q_INIT_SUM,
    Q_MAX_SUM,
    Q_NDR,
    Q_SEATS,
    Q_WAITING,
    Q_WORK_SUM,
    S_AL,
    S_ARRIVAL_NS,
    S_DETAIL_LEN,
    S_FINAL,
    S_FS,
    S_GEN,
    S_HASH,
    S_INITIAL,
    S_LEVEL,
    S_NEXT,
    S_OWNER,
    S_QUEUE,
    S_START_NS,
    S_STATE,
    SLOT_WORDS,
)
from apf_gunicorn.ledger.records import (
    DemandStats,
    LevelLoad,
    LevelSnapshot,
    QueueSnapshot,
    RequestSnapshot,
    Snapshot,
)


class Reading:
    """The readers of ``Ledger`` (a mixin)."""

    def take_demand_stats(self, level: int, now: int) -> DemandStats:
        """The seat-demand integrator's results since the last take, then restart it (Kubernetes'
        ``Integrator.Reset()``: min and max restart at the current value). Does not sync R.

        Args:
            level: the level index; now: the caller's monotonic ns.
        Returns:
            :class:`DemandStats` (duration, average, deviation, min, max).
        Raises:
            ValueError: ``level`` is out of range or not configured.
        """
        return self._locked(now, self._demand_results_locked, level, now, True)

    def demand_stats(self, level: int, now: int) -> DemandStats:
        """The seat-demand integrator's results since the last take, without restarting it
        (``Integrator.GetResults()``).

        Args:
            level: the level index; now: the caller's monotonic ns.
        Returns:
            :class:`DemandStats`, as :meth:`take_demand_stats`.
        Raises:
            ValueError: ``level`` is out of range or not configured.
        """
        return self._locked(now, self._demand_results_locked, level, now, False)

    def snapshot(self, now: int) -> Snapshot:
        """A consistent view of every level, queue and request, copied under the lock (the debug
        dumps and the metrics read it; Kubernetes' ``Dump``).

        Args:
            now: the caller's monotonic ns (recorded in the snapshot; nothing is synced).
        Returns:
            :class:`Snapshot` of plain records, safe to keep after the lock is released.
        """
        return self._locked(now, self._snapshot_locked, now)

    def _snapshot_locked(self, now: int) -> Snapshot:
        w, u = self._w, self._u
        levels = []
        per_level: dict[int, list] = {}
        states, slot_levels = self._slot_columns_locked(S_STATE, S_LEVEL)
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
                w[lb + L_SERVICE_NS], L.FAIRNESS_NAMES[w[lb + L.L_FAIRNESS]],
                self._maxmin.flow_state_locked(lb) if w[lb + L.L_FAIRNESS] else None))
        return Snapshot(now, levels, self._fs_names_locked(),
                        w[self._lay.counters_base + L.C_HEAD_TIMEOUTS],
                        self.connections_dropped)

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
