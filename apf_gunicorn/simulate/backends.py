"""The production seat ledger behind the simulator's :class:`~.harness.Backend` protocol.

The simulator drives the very code the server runs: a :class:`apf_gunicorn.ledger.Ledger` over
a ``bytearray`` with a ``NullLock``, fed virtual nanoseconds. Handles are ``(slot, gen)``.

    backend = ledger_backend(queue_set_spec, clients)
    adm = backend.admit(0, flow_hash, 1, 0, 0, now)
"""

from __future__ import annotations

from collections.abc import Sequence

from apf_gunicorn.flowcontrol import fairness
from apf_gunicorn.ledger import EXECUTE, REJECTED, Capacity, Ledger, LevelSpec
from apf_gunicorn.ledger.lock import NullLock

from .harness import Admission, DemandResults
from .scenario import ClientSpec, QueueSetSpec


def concurrent_requests_bound(clients: Sequence[ClientSpec]) -> int:
    """An upper bound on requests alive at once (waiting, executing or lingering): each
    thread has a call in flight at most every ``exec + think``, and a call lives at most as
    long as its wait, its ``exec`` and its lingering tail."""
    total = 0
    for c in clients:
        period = max(c.exec_ns + c.think_ns, 1)
        # Waiting is bounded by the scenario, not per thread; a thread's calls only start one
        # period apart once executing, so count executing/lingering overlap plus one waiting.
        per_thread = -(-(c.exec_ns + c.additional_latency_ns) // period) + 2
        total += c.threads * min(per_thread, max(c.calls, 1))
    return total


class LedgerBackend:
    """Levels of one production ledger; ``admit`` takes the level index ``configure`` gave."""

    name = "ledger"

    def __init__(self, ledger: Ledger, levels: dict[str, int]) -> None:
        self.ledger = ledger
        self.levels = levels

    @classmethod
    def create(cls, specs: Sequence[tuple], slots: int, now: int = 0) -> LedgerBackend:
        """A ledger over a ``bytearray`` configured with ``specs``.

        Args:
            specs: per level ``(name, desired_queues, hand_size, queue_length_limit,
                concurrency_limit[, fairness])``; ``fairness`` is the level's
                fairness (``kubernetes`` when left out, None for an exempt level).
            slots: request slots to provide (:func:`concurrent_requests_bound`).
            now: virtual ns of the configuration.
        """
        queues = max([1, *(s[1] for s in specs)])
        default = Capacity()
        capacity = Capacity(levels=max(len(specs), default.levels),
                            queues=max(queues * len(specs), default.queues),
                            slots=max(slots, default.slots))
        ledger_specs = []
        for name, desired, hand, qll, limit, *rest in specs:
            fairness_name = rest[0] if rest else fairness.SCENARIO_DEFAULT
            ledger_specs.append(LevelSpec(name, desired, hand, qll, limit,
                                          fairness=fairness_name))
        ledger = Ledger.create(bytearray(Ledger.size(capacity)), capacity, lock=NullLock())
        levels, _ = ledger.configure(ledger_specs, ["simulated"], now)
        return cls(ledger, dict(levels))

    def admit(self, level: int, flow_hash: int, initial: int, final: int,
              additional_latency_ns: int, now: int) -> Admission:
        res = self.ledger.admit(level, flow_hash, initial, final, additional_latency_ns, 0, now)
        granted = [(slot, gen) for slot, gen, _owner in res.granted]
        if res.outcome == REJECTED:
            return Admission(None, res.reason, granted)
        handle = (res.slot, res.gen)
        if res.outcome == EXECUTE and handle not in granted:
            granted.append(handle)
        return Admission(handle, "", granted)

    def finish(self, handle: tuple[int, int], now: int) -> tuple[list, int]:
        granted, linger_until = self.ledger.finish(handle[0], handle[1], now)
        return [(s, g) for s, g, _o in granted], linger_until

    def release(self, handle: tuple[int, int], now: int) -> list:
        return [(s, g) for s, g, _o in self.ledger.release(handle[0], handle[1], now)]

    def handles_of(self, grants: list) -> list:
        """Handles of ``(slot, gen, owner)`` grants (what ``set_limits`` returns)."""
        return [(s, g) for s, g, _o in grants]

    def demand_stats(self, level: int, now: int) -> DemandResults | None:
        st = self.ledger.take_demand_stats(level, now)
        return DemandResults(st.duration_s, st.average, st.deviation, st.min, st.max)

    def epoch_advances(self) -> int:
        snap = self.ledger.snapshot(0)
        return sum(getattr(lv, "epoch_advances", 0) for lv in snap.levels)


def ledger_backend(qs: QueueSetSpec, clients: Sequence[ClientSpec]) -> LedgerBackend:
    """One level named ``queueSet`` configured as the scenario's queue set (an exempt set,
    ``queues`` -1, has no fairness)."""
    fairness_name = qs.fairness if qs.queues >= 0 else None
    return LedgerBackend.create(
        [("queueSet", qs.queues, qs.hand_size, qs.queue_length_limit, qs.concurrency_limit,
          fairness_name)],
        slots=concurrent_requests_bound(clients))
