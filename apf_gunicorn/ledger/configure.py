"""Configuration: the levels and FlowSchema names a ledger serves, and their limits.

:meth:`Configuration.configure` applies a whole set of levels at once (Kubernetes'
``BeginConfigChange`` + ``Complete``): new levels get an index and a queue region, changed ones
take their new queues at once and lose queues by attrition, levels left out quiesce and are
dropped when idle; FlowSchema names are interned in an append-only table.
:meth:`Configuration.set_limits` is the borrowing loop's ``Complete(dCfg)``. Both dispatch what
a higher limit allows::

    levels, schemas = led.configure([LevelSpec("a", 64, 6, 50, 20)], ["fs"], now)
    granted = led.set_limits({levels["a"]: 30}, now)
"""

from __future__ import annotations

from array import array

from apf_gunicorn.flowcontrol.shufflesharding import DealerError, check_dealer
from apf_gunicorn.ledger import layout as L
from apf_gunicorn.ledger.layout import (
    H_SERVICE_NS,
    L_C,
    L_DESIRED,
    L_EXECUTING,
    L_HAND,
    L_I_LAST,
    L_LAST_NS,
    L_NQ,
    L_QBASE,
    L_QLL,
    L_QUIESCING,
    L_SEATS_IN_USE,
    L_SERVICE_NS,
    L_TBASE,
    L_TP,
    L_USED,
    L_WAITING,
    LEVEL_WORDS,
    NIL,
    Q_HEAD,
    Q_TAIL,
    QUEUE_WORDS,
)
from apf_gunicorn.ledger.mintree import next_pow2
from apf_gunicorn.ledger.records import LevelSpec
from apf_gunicorn.ledger.seatseconds import U64


class Configuration:
    """Level configuration and limits (a mixin of ``Ledger``)."""

    def configure(self, specs, flow_schema_names, now: int,
                  granted: list | None = None) -> tuple[dict[str, int], dict[str, int]]:
        """Apply the whole set of levels and intern the FlowSchema names (``BeginConfigChange`` +
        ``Complete``). Levels not named start quiescing and disappear once idle; a level's queues
        are added at once and removed by attrition.

        Args:
            specs: every level, as :class:`LevelSpec` (names unique, 1..253 bytes of UTF-8).
            flow_schema_names: names to intern (append-only: an index stays valid across reloads).
            now: the caller's monotonic ns.
            granted: when given, the requests a limit increase dispatched (and any a repair on
                entry found) are appended to it; otherwise they go to :attr:`pending_grants`.
        Returns:
            ``({level name: index}, {FlowSchema name: index})`` for the names given.
        Raises:
            ValueError: a bad name, a level named twice, an invalid shuffle-sharding
                configuration, a negative limit, or more levels, queues or FlowSchema names than
                the :class:`Capacity`; checked before anything is changed.
        """
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
        # repair grants and dispatches both go where the caller asked
        got, result = self._granting(now, self._configure_locked, specs, fs_list, now)
        if granted is not None:
            granted.extend(got)
        else:
            self.pending_grants.extend(got)
        return result

    def _configure_locked(self, granted, specs, fs_list, now):
        w = self._w
        cap = self._lay.cap
        for sp in specs:
            if sp.fairness is not None and sp.fairness not in L.FAIRNESS_CODES:
                raise ValueError(f"level {sp.name!r}: fairness must be one of "
                                 f"{', '.join(sorted(L.FAIRNESS_CODES))}, not {sp.fairness!r}")
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
            self._init_level_locked(i, sp, now)
        relayout = any(needs[i] > w[self._lvb + i * LEVEL_WORDS + L.L_QCAP] for i in needs)
        if relayout:
            self._relayout_locked(needs)
        for sp in specs:
            i = index_of[sp.name]
            lb = self._lvb + i * LEVEL_WORDS
            self._sync_locked(lb, now)
            self._set_configuration_locked(lb, sp)
            w[lb + L_QUIESCING] = 0
            self._dispatch_all_locked(lb, now, granted)
        named = set(index_of[sp.name] for sp in specs)
        for i in existing.values():
            if i not in named:
                lb = self._lvb + i * LEVEL_WORDS
                w[lb + L_QUIESCING] = 1
                self._maybe_drop_locked(lb)
        w[L.H_GENERATION] += 1
        return ({sp.name: index_of[sp.name] for sp in specs},
                {name: fs_index[name] for name in fs_list})

    def _init_level_locked(self, i: int, sp: LevelSpec, now: int) -> None:
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
        self._maxmin.purge_level_locked(i)  # flow entries an earlier level left at this index
        w[lb + L_USED] = 1
        # float zeros are all-zero bits already; region assigned by _relayout
        w[lb + L.L_QCAP] = 0
        w[lb + L_TP] = 0

    def _set_configuration_locked(self, lb: int, sp: LevelSpec) -> None:
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
        fairness = L.FAIRNESS_CODES[sp.fairness or "kubernetes"]  # None: an exempt level
        if fairness != w[lb + L.L_FAIRNESS]:
            # a switch: the new fairness rebuilds its state from the slot table (the queues,
            # their FIFOs and counts are the same under both); what it leaves is dropped
            level = (lb - self._lvb) // LEVEL_WORDS
            self._maxmin.purge_level_locked(level)
            w[lb + L.L_FAIRNESS] = fairness
            self._fairness_locked(lb).repair_locked(self, lb)

    def _relayout_locked(self, needs: dict[int, int]) -> None:
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
            p = next_pow2(max(qcap, 1))
            w[lb + L_TBASE] = tpos
            w[lb + L_TP] = p
            tpos += 2 * p
            if i in saved:
                a = self._qb + pos * QUEUE_WORDS
                w[a: a + len(saved[i])] = array("q", saved[i])
            pos += qcap
        for i in sorted(needs):
            self._queues_moved_locked(self._lvb + i * LEVEL_WORDS)

    def set_limits(self, limits: dict[int, int], now: int) -> list:
        """Change concurrency limits (the borrowing loop's ``Complete(dCfg)``) and dispatch what a
        higher limit allows.

        Args:
            limits: {level index: new concurrency limit C}.
            now: the caller's monotonic ns.
        Returns:
            The requests dispatched, as ``(slot, gen, owner)``.
        Raises:
            ValueError: a level index out of range or not configured (limits before it in
                ``limits`` are applied; the next locker repairs the interrupted call).
        """
        return self._granting(now, self._set_limits_locked, limits, now)[0]

    def _set_limits_locked(self, granted: list, limits: dict[int, int], now: int) -> None:
        w = self._w
        for level, c in limits.items():
            lb = self._lb(level)
            self._sync_locked(lb, now)
            w[lb + L_C] = int(c)
            self._dispatch_all_locked(lb, now, granted)

    def _maybe_drop_locked(self, lb: int) -> None:
        """A quiescing level goes away once nothing waits, executes or lingers in it."""
        w = self._w
        if (w[lb + L_QUIESCING] and w[lb + L_WAITING] == 0 and w[lb + L_EXECUTING] == 0
                and w[lb + L_SEATS_IN_USE] == 0):
            w[lb: lb + LEVEL_WORDS] = array("q", [0] * LEVEL_WORDS)
            w[L.H_GENERATION] += 1

    def flow_schema_names(self) -> list[str]:
        """The interned FlowSchema names (under the lock).

        Returns:
            Every name in index order: a slot's ``fs_index`` indexes this list.
        """
        return self._locked(None, self._fs_names_locked)

    def level_indices(self) -> dict[str, int]:
        """The configured levels by name (cached per configuration generation).

        Returns:
            A new ``{level name: index}`` dict, quiescing levels included.
        """
        if self._w[L.H_GENERATION] != self._names_gen:
            self._names, self._names_gen = self._locked(
                None, lambda: (self._level_names_locked(), self._w[L.H_GENERATION]))
        return dict(self._names)
