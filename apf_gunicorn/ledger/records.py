"""Result and snapshot records."""

from __future__ import annotations

from typing import NamedTuple

EXECUTE, QUEUED, REJECTED = "execute", "queued", "rejected"


class LevelSpec(NamedTuple):
    """One priority level's queue set configuration. ``desired_queues``: > 0 queuing, 0 reject
    (no queues, ``concurrency-limit``), < 0 exempt. ``fairness``: the dispatch policy of a
    queuing level, ``"kubernetes"`` (Kubernetes' queue set, exactly) or ``"maxmin"``
    (docs/fairness.md)."""

    name: str
    desired_queues: int
    hand_size: int
    queue_length_limit: int
    concurrency_limit: int
    fairness: str = "kubernetes"


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
