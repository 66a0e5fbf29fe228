"""Reading the ledger: consistent snapshots, seat-demand statistics and the lock-free load.

:meth:`Reading.snapshot` copies the words every level, queue and request is read from under
the lock, then builds plain records from that copy with the lock released (the debug dumps and
the metrics); :meth:`Reading.take_demand_stats` and
:meth:`Reading.demand_stats` are the seat-demand integrator's ``Reset()`` and ``GetResults()``
(the borrowing loop); :meth:`Reading.load` reads each level's seats and counters without the
lock (load reports), never waiting for a request::

    snap = led.snapshot(now)               # Snapshot(now, levels, flow_schema_names, ...)
    stats = led.take_demand_stats(level, now)
"""

from __future__ import annotations

import mmap
import struct

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
    WORD,
)
from apf_gunicorn.ledger.records import (
    DemandStats,
    LevelLoad,
    LevelSnapshot,
    QueueSnapshot,
    RequestSnapshot,
    Snapshot,
)

_IN_USE = bytes([0] + [1] * 255)  # bytes.translate table: a state that is not FREE -> 1




def _free_flow_entry() -> bytes:
    """A flow entry that no level's dump lists (``F_LEVEL`` NIL, idle)."""
    entry = bytearray(L.FLOW_WORDS * WORD)
    struct.pack_into("<q", entry, L.F_LEVEL * WORD, NIL)
    struct.pack_into("<q", entry, L.F_WHERE * WORD, L.FW_IDLE)
    return bytes(entry)


_FREE_FLOW = _free_flow_entry()


class _SnapshotCopy:
    """A private buffer of a ledger's size that :meth:`Reading.snapshot` copies words into,
    and a ledger over it (no lock) that builds the records. Between uses every slot in it is
    FREE and every flow entry free, so only what a copy wrote needs clearing afterwards
    (:meth:`clear`); everything else a snapshot reads is overwritten by each copy. Anonymous
    memory: pages that are never written stay unallocated."""

    def __init__(self, ledger_type: type, lay) -> None:
        self.buf = mmap.mmap(-1, lay.size)
        self._lay = lay
        at = lay.flow_base * WORD
        self.buf[at: at + lay.cap.slots * L.FLOW_WORDS * WORD] = _FREE_FLOW * lay.cap.slots
        self.view = ledger_type(self.buf, None, lay)

    def clear(self, runs: list[tuple[int, int]], flows: set[int]) -> None:
        """Make the slots of ``runs`` FREE (with their words and details) and the entries of
        ``flows`` free again: what :meth:`Reading._copy_for_snapshot_locked` wrote."""
        lay, buf = self._lay, self.buf
        sw, xw, stride = SLOT_WORDS * WORD, L.XSLOT_WORDS * WORD, lay.detail_stride
        sb, xb, db = lay.slot_base * WORD, lay.xslot_base * WORD, lay.details
        for a, b in runs:
            buf[sb + a * sw: sb + b * sw] = bytes((b - a) * sw)
            buf[xb + a * xw: xb + b * xw] = bytes((b - a) * xw)
            buf[db + a * stride: db + b * stride] = bytes((b - a) * stride)
        for f in flows:
            at = (lay.flow_base + f * L.FLOW_WORDS) * WORD
            buf[at: at + len(_FREE_FLOW)] = _FREE_FLOW


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
        """A consistent view of every level, queue and request (the debug dumps and the
        metrics read it; Kubernetes' ``Dump``).

        Under the lock it only copies the words the view is read from into a private copy of
        the buffer (:meth:`_copy_for_snapshot_locked`): a few memory copies plus one per run
        of slots in use. The records are built from that copy after the lock is released, so
        a dump or a scrape holds every worker's requests up for the copy only, however many
        requests are in flight. Copies are kept for the next call (:class:`_SnapshotCopy`);
        concurrent callers each take their own.

        Args:
            now: the caller's monotonic ns (recorded in the snapshot; nothing is synced).
        Returns:
            :class:`Snapshot` of plain records, safe to keep after the lock is released.
        """
        pool = self._snapshot_copies
        try:
            copy = pool.pop()  # atomic: another thread's concurrent call takes another copy
        except IndexError:
            copy = _SnapshotCopy(type(self), self._lay)
        try:
            runs, flows = self._locked(now, self._copy_for_snapshot_locked, copy.buf)
            snap = copy.view._snapshot_locked(now)  # the copy is this caller's alone
            copy.clear(runs, flows)
        except BaseException:
            copy = None  # a copy in an unknown state is not reused
            raise
        finally:
            if copy is not None:
                pool.append(copy)
        return snap

    def _copy_for_snapshot_locked(self, dst) -> tuple[list[tuple[int, int]], set[int]]:
        """Copy into ``dst`` (a :class:`_SnapshotCopy` buffer: every slot FREE, every flow
        free) every word and byte :meth:`_snapshot_locked` reads: the header, undo log,
        counters and level table; each used level's queues, name and maxmin words; the
        FlowSchema names; each slot that is not FREE with its maxmin per-slot words and
        detail bytes; and the flow entries those slots (and the levels' reservations) name.

        Slots in use are found by the low byte of their state word (the ledger is
        little-endian, as its struct formats are): FREE is 0, every other state 1..3.

        Returns:
            The runs of slots copied (``[(first, end)]``) and the flow entries copied, for
            :meth:`_SnapshotCopy.clear`.
        """
        lay, mv, w = self._lay, self._mv, self._w
        end = (self._lvb + self._nlevels * LEVEL_WORDS) * WORD
        dst[:end] = mv[:end]
        qw = L.QUEUE_WORDS * WORD
        flows = set()
        used = w[self._lvb + L_USED: self._lvb + self._nlevels * LEVEL_WORDS: LEVEL_WORDS]
        for i, on in enumerate(used.tolist()):
            if not on:
                continue
            lb = self._lvb + i * LEVEL_WORDS
            at = (self._qb + w[lb + L.L_QBASE] * L.QUEUE_WORDS) * WORD
            dst[at: at + w[lb + L_NQ] * qw] = mv[at: at + w[lb + L_NQ] * qw]
            at = lay.level_names + i * L.NAME_BYTES
            dst[at: at + L.NAME_BYTES] = mv[at: at + L.NAME_BYTES]
            if w[lb + L.L_FAIRNESS]:
                mm = lay.maxmin_base + i * L.MM_WORDS
                dst[mm * WORD: (mm + L.MM_WORDS) * WORD] = mv[mm * WORD: (mm + L.MM_WORDS) * WORD]
                flows.add(w[mm + L.M_RESERVE])
        at = lay.fs_names
        n = w[L.H_FS_COUNT] * L.NAME_BYTES
        dst[at: at + n] = mv[at: at + n]
        sw, xw, stride = SLOT_WORDS * WORD, L.XSLOT_WORDS * WORD, lay.detail_stride
        sb, xb, db = self._sb * WORD, lay.xslot_base * WORD, lay.details
        x = lay.xslot_base + L.X_FLOW
        runs = []
        states = mv[sb + S_STATE * WORD: sb + self._nslots * sw: sw].tobytes().translate(_IN_USE)
        b = 0
        while (a := states.find(1, b)) >= 0:  # one copy per table per run of slots in use
            b = states.find(0, a)
            b = len(states) if b < 0 else b
            runs.append((a, b))
            dst[sb + a * sw: sb + b * sw] = mv[sb + a * sw: sb + b * sw]
            dst[xb + a * xw: xb + b * xw] = mv[xb + a * xw: xb + b * xw]
            dst[db + a * stride: db + b * stride] = mv[db + a * stride: db + b * stride]
            flows.update(w[x + a * L.XSLOT_WORDS: x + b * L.XSLOT_WORDS: L.XSLOT_WORDS].tolist())
        flows.discard(NIL)
        fw = L.FLOW_WORDS * WORD
        for f in flows:
            at = (lay.flow_base + f * L.FLOW_WORDS) * WORD
            dst[at: at + fw] = mv[at: at + fw]
        return runs, flows

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
