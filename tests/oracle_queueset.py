"""A reference queue set: a straight, object-based port of Kubernetes' ``queueset.go``.

Test-only. Production code never imports this; it exists so that

* the simulator's harness can be validated against Kubernetes' expectations independently of
  the production ledger, and
* the production ledger can be checked decision by decision against a readable port
  (``tests/test_ledger_vs_oracle.py``).

It follows ``reference/k8s-queueset.md`` sections 1-4 literally: uint64 SeatSeconds with
per-sync rounding, waiting-work shuffle sharding with the rotating offset, round-robin minimum
virtual finish dispatch with head-of-line blocking, the too-wide rule, the final-seat cap, the
anti-windup floor, lingering seats, and epoch advances. Queue removal by attrition and
reconfiguration are not ported (no scenario needs them). ``OracleBackend`` adapts it to the
simulator's backend protocol (:class:`apf_gunicorn.simulate.harness.Backend`).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from apf_gunicorn.flowcontrol.gomath import duration_seconds, go_round
from apf_gunicorn.flowcontrol.shufflesharding import deal

U64 = (1 << 64) - 1
MAX_SEAT_SECONDS = U64
R_DECREMENT = MAX_SEAT_SECONDS // 2
HIGH_R = R_DECREMENT + R_DECREMENT // 2
G_NS = 3_000_000  # estimatedServiceDuration


def seats_times_duration(seats: float, ns: int) -> int:
    """``SeatsTimesDuration``: round(seats*ns/10) as int64, then wrapped to uint64."""
    return go_round(seats * float(ns) / 10) & U64


def duration_per_seat(ss: int, seats: float) -> int:
    return int(float(ss) / seats * 10)


class FloatIntegrator:
    """Kubernetes' ``fairqueuing.Integrator`` with float moments; min/max start at 0."""

    def __init__(self, now: int) -> None:
        self.last = now
        self.x = 0.0
        self.elapsed = self.ix = self.ixx = 0.0
        self.min = self.max = 0.0

    def _update(self, now: int) -> None:
        dt = duration_seconds(now - self.last)
        self.last = now
        self.elapsed += dt
        self.ix += dt * self.x
        self.ixx += dt * self.x * self.x

    def set(self, x: float, now: int) -> None:
        self._update(now)
        self.x = x
        self.min = min(self.min, x)
        self.max = max(self.max, x)

    def reset(self, now: int) -> tuple[float, float, float, float, float]:
        """(duration, average, deviation, min, max), then restart the moments."""
        self._update(now)
        if self.elapsed <= 0:
            avg = dev = math.nan
        else:
            avg = self.ix / self.elapsed
            var = self.ixx / self.elapsed - avg * avg
            dev = math.sqrt(var) if var >= 0 else math.nan
        out = (self.elapsed, avg, dev, self.min, self.max)
        self.elapsed = self.ix = self.ixx = 0.0
        self.min = self.max = self.x
        return out


@dataclass(eq=False)
class Request:
    flow_hash: int
    initial_seats: int
    final_seats: int
    additional_latency_ns: int
    initial_work: int
    final_work: int
    arrival_r: int
    queue: Queue | None = None
    start_ns: int = 0
    executing: bool = False
    tag: object = None

    @property
    def max_seats(self) -> int:
        return max(self.initial_seats, self.final_seats)

    @property
    def total_work(self) -> int:
        return (self.initial_work + self.final_work) & U64


@dataclass(eq=False)
class Queue:
    index: int
    waiting: deque = field(default_factory=deque)
    executing: set = field(default_factory=set)
    next_dispatch_r: int = 0
    seats_in_use: int = 0
    # FIFO sums (fifo_list.go)
    max_seats_sum: int = 0
    total_work_sum: int = 0

    def enqueue(self, r: Request) -> None:
        self.waiting.append(r)
        self.max_seats_sum += r.max_seats
        self.total_work_sum = (self.total_work_sum + r.total_work) & U64

    def dequeue(self) -> Request:
        r = self.waiting.popleft()
        self.max_seats_sum -= r.max_seats
        self.total_work_sum = (self.total_work_sum - r.total_work) & U64
        return r


class OracleQueueSet:
    """One Kubernetes queueSet. Every public method takes ``now`` (int ns) and syncs R first;
    each returns the requests it dispatched (``granted``)."""

    def __init__(self, queues: int, hand_size: int, queue_length_limit: int,
                 concurrency_limit: int, now: int, robin_index: int = 0) -> None:
        self.desired_queues = queues
        self.hand_size = hand_size
        self.queue_length_limit = queue_length_limit
        self.concurrency_limit = concurrency_limit
        self.queues = [Queue(i) for i in range(max(queues, 0))]
        self.current_r = 0
        self.last_real_time = now
        self.robin_index = robin_index
        self.enqueues = 0
        self.tot_requests_waiting = 0
        self.tot_requests_executing = 0
        self.tot_seats_in_use = 0
        self.tot_seats_waiting = 0
        self.epoch_advances = 0
        self.epoch_advance_failures = 0
        self.seat_demand = FloatIntegrator(now)
        self._granted: list[Request] = []

    # -- time ---------------------------------------------------------------------------
    def _sync(self, now: int) -> None:
        dt = now - self.last_real_time
        self.last_real_time = now
        prev = self.current_r
        incr = seats_times_duration(self._virtual_time_ratio(), dt)
        self.current_r = (prev + incr) & U64
        if prev > self.current_r:
            raise AssertionError("currentR overflow")
        if self.current_r >= HIGH_R:
            self._advance_epoch()

    def _virtual_time_ratio(self) -> float:
        active = 0
        requested = 0
        for q in self.queues:
            requested += q.seats_in_use + q.max_seats_sum
            if q.waiting or q.executing:
                active += 1
        if active == 0:
            return 0.0
        return min(float(requested), float(self.concurrency_limit)) / float(active)

    def _advance_epoch(self) -> None:
        self.current_r -= R_DECREMENT
        success = True
        for q in self.queues:
            if not q.waiting and not q.executing:
                q.next_dispatch_r = 0
                continue
            old = q.next_dispatch_r
            q.next_dispatch_r = (q.next_dispatch_r - R_DECREMENT) & U64
            success &= q.next_dispatch_r <= old
            for r in q.waiting:
                old_arrival = r.arrival_r
                r.arrival_r = (r.arrival_r - R_DECREMENT) & U64
                success &= r.arrival_r <= old_arrival
        if success:
            self.epoch_advances += 1
        else:
            self.epoch_advance_failures += 1

    def _note_demand(self, now: int) -> None:
        self.seat_demand.set(float(self.tot_seats_in_use + self.tot_seats_waiting), now)

    def _take_granted(self) -> list[Request]:
        out, self._granted = self._granted, []
        return out

    # -- arrival ------------------------------------------------------------------------
    def start_request(self, flow_hash: int, initial: int, final: int, additional_latency_ns: int,
                      now: int) -> tuple[Request | None, str, list[Request]]:
        """(request or None if rejected, reject reason, requests dispatched by this call)."""
        self._sync(now)
        r = Request(flow_hash, initial, final, additional_latency_ns,
                    seats_times_duration(float(initial), G_NS),
                    seats_times_duration(float(final), additional_latency_ns), self.current_r)
        if self.desired_queues < 1:
            if not self._can_accommodate(r.max_seats):
                return None, "concurrency-limit", []
            r.executing = True
            r.start_ns = now
            self.tot_requests_executing += 1
            self.tot_seats_in_use += r.max_seats
            self._note_demand(now)
            return r, "", [r]
        q = self.queues[self._shuffle_shard(flow_hash)]
        r.queue = q
        if self.tot_seats_in_use >= self.concurrency_limit and len(q.waiting) >= self.queue_length_limit:
            self._bound_next_dispatch(q)
            return None, "queue-full", []
        if not q.waiting and not q.executing:
            q.next_dispatch_r = self.current_r
        q.enqueue(r)
        self.tot_requests_waiting += 1
        self.tot_seats_waiting += r.max_seats
        self._note_demand(now)
        self._bound_next_dispatch(q)
        self._dispatch_as_much_as_possible(now)
        return r, "", self._take_granted()

    def _shuffle_shard(self, flow_hash: int) -> int:
        hand = deal(flow_hash, self.desired_queues, self.hand_size)
        offset = self.enqueues % len(hand)
        self.enqueues += 1
        best, best_work = -1, MAX_SEAT_SECONDS
        for i in range(len(hand)):
            idx = hand[(offset + i) % len(hand)]
            work = self.queues[idx].total_work_sum
            if work < best_work:
                best, best_work = idx, work
        return best

    # -- dispatch -----------------------------------------------------------------------
    def _can_accommodate(self, seats: int) -> bool:
        if self.desired_queues < 0:
            return True
        if seats > self.concurrency_limit:
            return self.tot_requests_executing == 0
        return self.tot_seats_in_use + seats <= self.concurrency_limit

    def _bound_next_dispatch(self, q: Queue) -> None:
        if q.waiting and q.next_dispatch_r < q.waiting[0].arrival_r:
            q.next_dispatch_r = q.waiting[0].arrival_r

    def _dispatch_as_much_as_possible(self, now: int) -> None:
        while (self.tot_requests_waiting and self.tot_seats_in_use < self.concurrency_limit
               and self._dispatch_one(now)):
            pass

    def _dispatch_one(self, now: int) -> bool:
        n = len(self.queues)
        min_q, min_idx, min_finish = None, 0, MAX_SEAT_SECONDS
        for _ in range(n):
            self.robin_index = (self.robin_index + 1) % n
            q = self.queues[self.robin_index]
            if q.waiting:
                finish = (q.next_dispatch_r + q.waiting[0].total_work) & U64
                if finish < min_finish:
                    min_q, min_idx, min_finish = q, self.robin_index, finish
        if min_q is None or not self._can_accommodate(min_q.waiting[0].max_seats):
            return False
        r = min_q.dequeue()
        if r.final_seats > self.concurrency_limit:
            r.additional_latency_ns = duration_per_seat(r.final_work, float(self.concurrency_limit))
            r.final_seats = self.concurrency_limit
        self.robin_index = min_idx
        self.tot_requests_waiting -= 1
        self.tot_seats_waiting -= r.max_seats
        r.executing = True
        r.start_ns = now
        self.tot_requests_executing += 1
        self.tot_seats_in_use += r.max_seats
        min_q.executing.add(r)
        min_q.seats_in_use += r.max_seats
        self._note_demand(now)
        min_q.next_dispatch_r = (min_q.next_dispatch_r + r.total_work) & U64
        self._bound_next_dispatch(min_q)
        self._granted.append(r)
        return True

    # -- completion ---------------------------------------------------------------------
    def finish(self, r: Request, now: int) -> tuple[list[Request], int]:
        """The main phase is over: (granted, linger-until ns or 0)."""
        self._sync(now)
        self.tot_requests_executing -= 1
        q = r.queue
        if q is not None:
            q.executing.discard(r)
            s = now - r.start_ns
            q.next_dispatch_r = (q.next_dispatch_r
                                 - seats_times_duration(float(r.initial_seats), G_NS - s)) & U64
            self._bound_next_dispatch(q)
        linger = 0
        if r.additional_latency_ns <= 0:
            self._release_seats(r, now)
        else:
            linger = now + r.additional_latency_ns
        self._dispatch_as_much_as_possible(now)
        return self._take_granted(), linger

    def release(self, r: Request, now: int) -> list[Request]:
        """The lingering seats of ``r`` are free."""
        self._sync(now)
        self._release_seats(r, now)
        self._dispatch_as_much_as_possible(now)
        return self._take_granted()

    def _release_seats(self, r: Request, now: int) -> None:
        self.tot_seats_in_use -= r.max_seats
        if r.queue is not None:
            r.queue.seats_in_use -= r.max_seats
        self._note_demand(now)


class OracleBackend:
    """The oracle behind the simulator's backend protocol (one level, index 0)."""

    name = "oracle"

    def __init__(self, queues: int, hand_size: int, queue_length_limit: int,
                 concurrency_limit: int, now: int = 0) -> None:
        self.qs = OracleQueueSet(queues, hand_size, queue_length_limit, concurrency_limit, now)

    def admit(self, level: int, flow_hash: int, initial: int, final: int,
              additional_latency_ns: int, now: int):
        from apf_gunicorn.simulate.harness import Admission

        r, reason, granted = self.qs.start_request(flow_hash, initial, final,
                                                   additional_latency_ns, now)
        if r is None:
            return Admission(None, reason, [])
        return Admission(r, "", granted)

    def finish(self, handle: Request, now: int):
        return self.qs.finish(handle, now)

    def release(self, handle: Request, now: int):
        return self.qs.release(handle, now)

    def demand_stats(self, level: int, now: int):
        from apf_gunicorn.simulate.harness import DemandResults

        duration, avg, dev, lo, hi = self.qs.seat_demand.reset(now)
        return DemandResults(duration, avg, dev, lo, hi)

    def epoch_advances(self) -> int:
        return self.qs.epoch_advances

    def handles_of(self, grants: list) -> list:
        return list(grants)


class OracleLevels:
    """Several oracle queue sets behind one backend, with the slice of the ledger API that
    borrowing uses (``take_demand_stats``, ``set_limits``): the configuration form on the
    reference port. ``specs``: (name, desired_queues, hand_size, queue_length_limit, limit
    [, fairness]); the reference port is Kubernetes' fairness only."""

    name = "oracle"

    def __init__(self, specs, clients=None, now: int = 0) -> None:
        self.levels = {spec[0]: i for i, spec in enumerate(specs)}
        for spec in specs:
            if spec[5:] and spec[5] not in (None, "kubernetes"):
                raise ValueError(f"the reference port runs kubernetes only, not {spec[5]}")
        self.sets = [OracleQueueSet(q, h, qll, c, now) for _, q, h, qll, c, *_ in specs]
        self.ledger = self

    def admit(self, level, flow_hash, initial, final, additional_latency_ns, now):
        from apf_gunicorn.simulate.harness import Admission

        r, reason, granted = self.sets[level].start_request(flow_hash, initial, final,
                                                            additional_latency_ns, now)
        if r is None:
            return Admission(None, reason, [])
        r.tag = level
        return Admission(r, "", granted)

    def finish(self, handle, now):
        return self.sets[handle.tag].finish(handle, now)

    def release(self, handle, now):
        return self.sets[handle.tag].release(handle, now)

    def take_demand_stats(self, level: int, now: int):
        from apf_gunicorn.flowcontrol.borrowing import DemandObservation

        duration, avg, dev, _lo, hi = self.sets[level].seat_demand.reset(now)
        return DemandObservation(duration, avg, dev, hi)

    def set_limits(self, limits: dict, now: int) -> list:
        granted = []
        for level, limit in limits.items():
            qs = self.sets[level]
            qs._sync(now)
            qs.concurrency_limit = limit
            qs._dispatch_as_much_as_possible(now)
            granted.extend((r, 0, 0) for r in qs._take_granted())
        return granted

    def handles_of(self, grants: list) -> list:
        return [r for r, _gen, _owner in grants]

    def demand_stats(self, level, now):
        return None

    def epoch_advances(self) -> int:
        return sum(qs.epoch_advances for qs in self.sets)
