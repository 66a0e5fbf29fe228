"""Repair and verification of ``maxmin``'s state, rebuilt from the slot table.

After a dead holder or an interrupted operation the ledger rebuilds the FIFOs and aggregates
from the slot table (``repair.py``), then calls :meth:`MaxMinRepair.repair_locked` per maxmin
level (and when a level switches to maxmin): the entries' counts, the flow FIFOs, the heap and
the index are rebuilt from the slots; tags, V, learnt estimates and backlog sequence numbers
are kept as found (the undo log has already put back what an interrupted event wrote); nothing
is parked or reserved afterwards. :meth:`MaxMinRepair.verify_locked` lists every violated invariant.
``MaxMinRepair`` is a mixin of :class:`~apf_gunicorn.ledger.maxmin.MaxMinFairness`.
"""

from __future__ import annotations

from apf_gunicorn.ledger.layout import (
    EXECUTING,
    F_CHILD,
    F_EXEC,
    F_HEAD,
    F_LEVEL,
    F_NEXT,
    F_PREV,
    F_SEATS,
    F_TAIL,
    F_WAITING,
    F_WHERE,
    FW_IDLE,
    FW_NOWHERE,
    LEVEL_WORDS,
    M_NFLOWS,
    M_PARK_HEAD,
    M_PARK_TAIL,
    M_RESERVE,
    M_ROOT,
    NIL,
    S_HASH,
    S_HELD,
    S_LEVEL,
    S_QUEUE,
    S_SEQ,
    S_STATE,
    SLOT_WORDS,
    WAITING,
    X_FLOW,
    X_FNEXT,
    X_FPREV,
)


class MaxMinRepair:
    """Rebuild and verify a maxmin level's state from the slot table (mixin)."""

    # -- repair and fairness switches ---------------------------------------------------------
    def repair_locked(self, led, lb: int) -> None:
        """Rebuild the level's flow state from the slot table (after a repair rebuilt the
        queues, or when the level switches to maxmin). Tags, estimates and backlog sequence
        numbers of entries that survive are kept; nothing is parked or reserved afterwards;
        waiting requests rejoin their flow's FIFO in arrival order (``S_SEQ``)."""
        w, u = self._w, self._u
        level = (lb - self._lvb) // LEVEL_WORDS
        mm = self._mm(lb)
        # every entry of the level: unlinked, counts zero (still indexed)
        for f in range(self._nslots):
            fa = self._fa(f)
            if w[fa + F_LEVEL] != level:
                continue
            if w[fa + F_WHERE] == FW_IDLE:
                self._idle_remove(f, fa)
            for field in (F_WAITING, F_EXEC, F_SEATS):
                w[fa + field] = 0
            for field in (F_HEAD, F_TAIL, F_CHILD, F_NEXT, F_PREV):
                w[fa + field] = NIL
            w[fa + F_WHERE] = FW_NOWHERE
        self._rebuild_index()
        w[mm + M_ROOT] = NIL
        w[mm + M_PARK_HEAD] = NIL
        w[mm + M_PARK_TAIL] = NIL
        w[mm + M_RESERVE] = NIL
        w[mm + M_NFLOWS] = 0
        states, levels, seqs, queues = led._slot_columns_locked(S_STATE, S_LEVEL, S_SEQ,
                                                                S_QUEUE)
        # requests admitted into a queue (not those of an exempt or reject-type configuration)
        mine = sorted((seqs[s], s) for s in range(self._nslots)
                      if states[s] in (WAITING, EXECUTING) and levels[s] == level
                      and queues[s] != NIL)
        flows = []
        for _seq, s in mine:
            sa = self._sb + s * SLOT_WORDS
            h = u[sa + S_HASH]
            f = self._find(level, h)
            if f == NIL:
                f = self._get(mm, level, h)
            elif not (w[self._fa(f) + F_WAITING] or w[self._fa(f) + F_EXEC]):
                w[mm + M_NFLOWS] += 1
            fa = self._fa(f)
            if f not in flows:
                flows.append(f)
            xa = self._xa(s)
            w[xa + X_FLOW] = f
            w[xa + X_FPREV] = NIL
            w[xa + X_FNEXT] = NIL
            if states[s] == WAITING:
                tail = w[fa + F_TAIL]
                w[xa + X_FPREV] = tail
                if tail == NIL:
                    w[fa + F_HEAD] = s
                else:
                    w[self._xa(tail) + X_FNEXT] = s
                w[fa + F_TAIL] = s
                w[fa + F_WAITING] += 1
            else:
                w[fa + F_EXEC] += 1
                w[fa + F_SEATS] += w[sa + S_HELD]
        for f in flows:
            if w[self._fa(f) + F_WAITING]:
                self._heap_insert(mm, f)
        for s in range(self._nslots):  # lingering, free and queueless slots: no flow
            if levels[s] == level and (states[s] not in (WAITING, EXECUTING)
                                       or queues[s] == NIL):
                w[self._xa(s) + X_FLOW] = NIL
        for f in range(self._nslots):
            fa = self._fa(f)
            if (w[fa + F_LEVEL] == level and w[fa + F_WHERE] == FW_NOWHERE
                    and not w[fa + F_WAITING] and not w[fa + F_EXEC]):
                self._idle(mm, f, fa)
                w[mm + M_NFLOWS] += 1  # _idle counts an active flow leaving; this one was not

    def verify_locked(self, led, lb: int) -> list[str]:
        """Every violated invariant of the level's flow state, as text (``repair.verify``)."""
        w, u = self._w, self._u
        level = (lb - self._lvb) // LEVEL_WORDS
        mm = self._mm(lb)
        out: list[str] = []
        states, levels, seqs, helds, queues = led._slot_columns_locked(
            S_STATE, S_LEVEL, S_SEQ, S_HELD, S_QUEUE)
        want: dict[int, list] = {}
        for s in sorted(range(self._nslots), key=lambda s: seqs[s]):
            if levels[s] != level or states[s] not in (WAITING, EXECUTING) or queues[s] == NIL:
                continue  # (a queueless request: exempt or reject-type, no flow)
            f = w[self._xa(s) + X_FLOW]
            if f == NIL or w[self._fa(f) + F_LEVEL] != level:
                out.append(f"level {level} slot {s}: no flow entry")
                continue
            if self._find(level, u[self._sb + s * SLOT_WORDS + S_HASH]) != f:
                out.append(f"level {level} slot {s}: its flow is not found by its key")
            fifo, ex, seats = want.setdefault(f, [[], 0, 0])
            if states[s] == WAITING:
                fifo.append(s)
            else:
                want[f][1] += 1
                want[f][2] += helds[s]
        heap = set(self.heap_flows_locked(lb))
        parked = set(self.parked_flows_locked(lb))
        for f, (fifo, ex, seats) in want.items():
            fa = self._fa(f)
            got, s = [], w[fa + F_HEAD]
            while s != NIL and len(got) <= self._nslots:
                got.append(s)
                s = w[self._xa(s) + X_FNEXT]
            if got != fifo:
                out.append(f"level {level} flow {f}: FIFO {got} != arrival order {fifo}")
            if (w[fa + F_WAITING], w[fa + F_EXEC], w[fa + F_SEATS]) != (len(fifo), ex, seats):
                out.append(f"level {level} flow {f}: counts "
                           f"{(w[fa + F_WAITING], w[fa + F_EXEC], w[fa + F_SEATS])} != "
                           f"{(len(fifo), ex, seats)}")
            if fifo and f not in heap and f not in parked:
                out.append(f"level {level} flow {f}: waits but is neither in the heap nor parked")
        for f in heap | parked:
            if f not in want or not want[f][0]:
                out.append(f"level {level} flow {f}: listed with nothing waiting")
        for f in heap:
            c = w[self._fa(f) + F_CHILD]
            while c != NIL:
                if self._less(c, f):
                    out.append(f"level {level}: heap order broken below flow {f}")
                c = w[self._fa(c) + F_NEXT]
        if w[mm + M_NFLOWS] != len(want):
            out.append(f"level {level}: {w[mm + M_NFLOWS]} active flows counted, {len(want)} found")
        r = w[mm + M_RESERVE]
        if r != NIL and r not in heap and r not in parked:
            out.append(f"level {level}: the reserved flow {r} does not wait")
        return out
