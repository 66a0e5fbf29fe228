"""What the ledger hands out: result and snapshot records, and the ``LedgerPort`` protocol.

Plain immutable values (``NamedTuple``), built under the lock and safe to keep after it: the
outcome of :meth:`Ledger.admit` (:class:`AdmitResult`), a level's configuration
(:class:`LevelSpec`), the seat-demand integrator's results (:class:`DemandStats`), the
consistent view for dumps and metrics (:class:`Snapshot` of :class:`LevelSnapshot`,
:class:`QueueSnapshot`, :class:`RequestSnapshot`) and the lock-free load rows
(:class:`LevelLoad`). :class:`LedgerPort` is the part of ``Ledger`` the server layer uses, so
that ``server/`` is typed against an interface rather than the class (tests pass fakes)::

    from apf_gunicorn.ledger.records import EXECUTE, LedgerPort
    def serve(ledger: LedgerPort) -> None:
        res = ledger.admit(level, flow_hash, 1, 0, 0, owner, now)
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

EXECUTE, QUEUED, REJECTED = "execute", "queued", "rejected"


class LevelSpec(NamedTuple):
    """One priority level's queue set configuration. ``desired_queues``: > 0 queuing, 0 reject
    (no queues, ``concurrency-limit``), < 0 exempt. ``fairness``: the fairness of a
    queuing level, ``"kubernetes"`` (Kubernetes' queue set, exactly) or ``"maxmin"``
    (docs/fairness.md); None (what a level without one, such as an exempt level, may pass)
    is ``"kubernetes"``."""

    name: str
    desired_queues: int
    hand_size: int
    queue_length_limit: int
    concurrency_limit: int
    fairness: str | None = "kubernetes"


class AdmitResult(NamedTuple):
    """What :meth:`Ledger.admit` decided: run now, wait on ``(slot, gen)``, or rejected."""

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
    """One queue in a :class:`LevelSnapshot` (R and work in 1e-8 seat-seconds)."""

    index: int
    waiting: int
    executing: int
    seats_in_use: int
    next_dispatch_r: int
    initial_seats_sum: int
    max_seats_sum: int
    total_work_sum: int


class RequestSnapshot(NamedTuple):
    """One slot in use (waiting, executing or lingering) in a :class:`LevelSnapshot`."""

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
    """One priority level in a :class:`Snapshot`; counters cumulative, as Kubernetes' dump."""

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
    fairness: str = "kubernetes"  # the level's fairness (LevelSpec.fairness)
    maxmin: dict | None = None  # under maxmin: V, the reserved flow, every active flow's
    #   tag, counts and learnt estimate (MaxMinFairness.flow_state_locked)


class Snapshot(NamedTuple):
    """A consistent view of every level, queue and request (:meth:`Ledger.snapshot`)."""

    now: int
    levels: list
    flow_schema_names: list
    head_timeouts: int = 0  # connections answered 408 for a late request head (server-wide)
    # connections the workers' pollers dropped, by reason (Ledger.count_connection_dropped)
    connections_dropped: dict | None = None


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


class LedgerPort(Protocol):
    """The ledger operations the server layer calls (``Ledger`` implements all of them; see
    each method there for Args/Returns/Raises)."""

    pending_grants: list  # grants a repair found inside a call that could not return them

    def admit(self, level: int, flow_hash: int, initial_seats: int, final_seats: int,
              additional_latency_ns: int, owner: int, now: int, fs_index: int = 0,
              detail: bytes = b"", watch: bool = False) -> AdmitResult: ...

    def finish(self, slot: int, gen: int, now: int) -> tuple[list, int]: ...

    def release(self, slot: int, gen: int, now: int) -> list: ...

    def cancel(self, slot: int, gen: int, now: int, reason: str = "time-out") -> bool: ...

    def dispatched(self, slot: int, gen: int) -> bool: ...

    def never_wait_on(self, thread_ident: int) -> None: ...

    def turn_away(self, level: int, fs_index: int, seats: int, reason: str,
                  now: int) -> None: ...

    def rejected_total(self, level: int) -> int: ...

    def count_head_timeout(self) -> None: ...

    def count_connection_dropped(self, reason: str) -> None: ...

    def count_rejection_delayed(self, level: int, fs_index: int, reason: str) -> None: ...

    def configure(self, specs, flow_schema_names, now: int,
                  granted: list | None = None) -> tuple[dict[str, int], dict[str, int]]: ...

    def set_limits(self, limits: dict[int, int], now: int) -> list: ...

    def take_demand_stats(self, level: int, now: int) -> DemandStats: ...

    def snapshot(self, now: int) -> Snapshot: ...

    def request_stats(self) -> list: ...

    def load(self, levels: tuple[int, ...] | None = None) -> list[LevelLoad]: ...

    def register_worker(self, owner: int, pid: int, now: int) -> None: ...

    def set_worker_room(self, owner: int, room: bool) -> None: ...

    def other_worker_has_room(self, owner: int) -> bool: ...

    def workers(self) -> list[tuple[int, int, int, int]]: ...

    def owned_slots(self, owner: int) -> list[tuple[int, int, str]]: ...

    def reap_worker(self, owner: int, now: int) -> list: ...
