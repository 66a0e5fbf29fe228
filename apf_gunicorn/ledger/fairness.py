"""What a level's fairness provides to the ledger: the seam between mechanism and fairness.

The ledger (``requestpath.py``) owns the mechanism: slots, seats, the lock, the counters,
lingering seats, queue attrition, and R with the seat-demand integrator (``vclock.py``). A
level's *fairness* owns the order: which queue an arriving request waits in, which waiting
request runs next, and how a queue is charged for what it ran. Kubernetes' queueset
(``queueset.KubernetesQueueSet``) is one; ``maxmin.MaxMinFairness`` (docs/fairness.md) is the
other, selected per level by its ``L_FAIRNESS`` word (``LevelSpec.fairness``).

How the ledger reaches a fairness: only through the routers in ``ledger.py``
(``Ledger._enqueue_locked``, ``_dispatch_all_locked``, ``_touch_locked``,
``_waiting_removed_locked``, ``_main_phase_ended_locked``, ``_advance_epoch_locked``,
``_queues_moved_locked``, ``_repair_level_locked``), which pick ``Ledger._queueset`` or
``Ledger._maxmin`` by the level's ``L_FAIRNESS`` (``Ledger._fairness_locked``), nowhere else. A
fairness object is built once per ``Ledger`` (``KubernetesQueueSet(led)``,
``MaxMinFairness(led)``) and may keep the ledger's buffer views, but not the ledger: each call
is handed the ledger as ``led`` (so there is no reference cycle, and a dropped ledger frees its
buffer at once), and may use its ``..._locked`` helpers (alloc, link/unlink, log/commit,
counters, the min-tree). Both fairnesses admit as Kubernetes does and start a chosen request
alike, through the ledger's ``_verdict_locked`` (queue choice, ``queue-full``), ``_wait_locked``
(the waiting slot), ``_start_locked`` (the final-seat cap and the counts of a dispatch) and
``_admitted`` (the outcome); what differs is the order.

Two things a new fairness must also settle, outside this interface:

* the fast paths: ``fastpath.py``'s admit-at-once and fast finish (and ``fp_admit`` /
  ``fp_finish`` in ``_fastpath.c``) embody Kubernetes' at-once case (first card of the hand,
  ``nextDispatchR`` floored at R and charged the request's work). On levels of another
  fairness they must decline (or do its at-once case, identically in C and Python); on
  maxmin levels they do maxmin's (``MaxMinFairness.at_once_locked`` and ``mm_at_once``, and at
  the finish ``main_phase_ended_locked`` and ``mm_finish``);
* repair (``repair.py``) rebuilds the FIFOs and aggregates from the slot table, then calls
  :meth:`Fairness.repair_locked`; any per-fairness state that is not derivable from the
  slot table must be kept whole by the undo log or be recomputable there.

Every method runs with the ledger lock held and the dirty mark set (hence ``_locked``);
``lb`` is the level's word address, ``q`` a queue index, ``qa`` / ``sa`` word addresses of a
queue / slot record, ``now`` the caller's ns, ``granted`` the operation's list of
``(slot, gen, owner)`` grants, appended to.
"""

from __future__ import annotations

from typing import Protocol

from apf_gunicorn.ledger.records import AdmitResult


class Fairness(Protocol):
    """The methods the ledger calls on a level's fairness (see the module docstring)."""

    name: str  # as selected in configuration, e.g. "kubernetes"

    def enqueue_locked(self, led, lb: int, level: int, q: int, qa: int, req: tuple, eb: int,
                       ms: int, watch: int, granted: list) -> AdmitResult:
        """A request of a queuing level that cannot run at once and is not rejected (the
        arrival is counted, a slot is free, R is synced; ``Ledger._verdict_locked`` picked
        queue ``q`` at word address ``qa``): make it wait, then dispatch what fits. ``req``
        is ``(flow_hash, initial, final, al, owner, now, fs_index, detail)``, ``eb`` its stats
        entry, ``ms`` max(initial, final), ``watch`` 0/1. Returns the outcome for this request
        (EXECUTE if the dispatch picked it)."""
        ...

    def dispatch_all_locked(self, led, lb: int, now: int, granted: list) -> None:
        """Seats were freed or the limit rose: dispatch waiting requests while they fit."""
        ...

    def touch_locked(self, led, lb: int, q: int) -> None:
        """Queue ``q`` changed outside a dispatch (a waiting request left it: cancel, time-out,
        a dead worker's wait): update what ranks the queues."""
        ...

    def waiting_removed_locked(self, led, lb: int, q: int, sa: int) -> None:
        """The waiting request in slot ``sa`` left queue ``q`` without running (cancel,
        time-out, a dead worker's wait); it is unlinked from the queue but its slot is not
        freed yet (Kubernetes: :meth:`touch_locked`)."""
        ...

    def main_phase_ended_locked(self, led, lb: int, q: int, qa: int, sa: int, now: int,
                                learn: bool = True) -> None:
        """The request in slot ``sa`` of queue ``q`` finished its main phase (``learn``), or
        its worker died (not ``learn``: its time teaches nothing); the executing counts are
        already updated: correct its charge by the time it really ran (``now -
        S_START_NS``)."""
        ...

    def hold_locked(self, lb: int, sa: int, now: int) -> int:
        """The request in slot ``sa`` is about to end its main phase, with no lingering seats
        of its own and requests waiting in the level: 0 to free its seats now, or a time until
        which they are held (the slot lingers until then; ``maxmin`` breaks a lockstep this
        way, docs/fairness.md)."""
        ...

    def advance_epoch_locked(self, led, lb: int) -> None:
        """R reached ``HIGH_R`` (``vclock.r_after``): move the level's R and every virtual
        time the fairness keeps down by ``R_DECREMENT``."""
        ...

    def queues_moved_locked(self, led, lb: int) -> None:
        """The level's queues were renumbered (attrition removed one) or re-packed (a
        configuration needed more queues): rebuild whatever is indexed by queue."""
        ...

    def repair_locked(self, led, lb: int) -> None:
        """A repair rebuilt the level's FIFOs and aggregates from the slot table: restore the
        fairness's invariants (Kubernetes: the anti-windup floor and the tree)."""
        ...
