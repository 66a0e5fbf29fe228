"""``APF_CONCURRENCY_LIMIT=auto``: the master runs the adaptive controller against the live ledger.

Once a tick (``APF_ADAPTIVE_TICK``, 1 s) the master's services thread calls
:meth:`ServerAutoLimit.tick`. It feeds :class:`apf_gunicorn.control.adaptive.AdaptiveLimit`
what the simulator feeds it (``simulate/autolimit.py``), read from the ledger's per-request
statistics (``ledger.request_stats()``, one short read under the ledger lock):

* per kind of request, a route (``admission/routekinds.py``: the path's shape within its level
  and FlowSchema, counted by the workers): how many finished and their summed service time
  (dispatch to the end of the response, queue wait excluded). Without that table (tests), a
  ``(priority level, FlowSchema)`` pair of a non-exempt level: the deltas of its
  ``request_execution_seconds{type="regular"}`` histogram's count and sum. Routes matter: a
  FlowSchema holding a 2 ms and a 200 ms route has a mean that swings with the mix;
* the average concurrency over the tick, by Little's law: the service time that finished in
  the tick over the tick's length (a request counts as one seat: the execution histogram does
  not weigh by seats);
* whether anything waited: a non-zero wait observed at dispatch, a queue-full, time-out or
  concurrency-limit rejection in the tick, or requests waiting now (``ledger.load()``);
* the CPU (``signals/cpu.py``, the master's ``cpu_watch``): the live workers' last windows
  (each one's share of its GIL, their CPU per served request) and the host's busy share of its
  cores from ``/proc/stat``. Nothing of it is measured per request.

A new limit is applied by :func:`apf_gunicorn.flowcontrol.relimit.follow_server_limit` (every
level's nominal seats recomputed from its shares, borrowing re-run on the demand it last
measured; queues and executing requests untouched; the exempt level never limited), under the
master's service lock; the generation's level limits and the settings' ``concurrency_limit``
are replaced, so the next borrowing round, a HUP and the metrics use the new limit::

The signals, in order (``pools``: the master's :class:`ServerPoolLimit`, unless
``APF_POOL_SIGNALS=off``):

1. **The app's pools.** Once every live worker has published a bounded pool (or 5 s after the
   first did), the pool rule of the default (``master/poollimit.py``, the same object and rule)
   decides the limit, its ceiling ``MAX``, clamped up to ``MIN``; the latency controller is not
   run (no look below, no probe) and only stands at the limit applied
   (:meth:`AdaptiveLimit.follow`).
2. **The CPU.** A rise the pool rule wants is refused while the workers or the host are at
   their CPU capacity (:meth:`AdaptiveLimit.cpu_bound`): the rule goes on from the seats kept.
   Without pools, the controller's own CPU rule (``control/adaptive.py``).
3. **Latency**, the fallback: where no pool is published, the controller as before. Pools that
   appear late replace its limit by the rule's start (their capacity over the share), as the
   default's first limit replaces the default; pools that disappear (no live worker publishes
   one) leave the controller to go on from the rule's last limit, with no jump, and the rule
   is reset: pools found again start it afresh.

    auto = ServerAutoLimit((2, 64), start=20, pools=ServerPoolLimit(64))
    change = auto.tick(master_state, lock)     # None, or (old limit, new limit)
    auto.source, auto.reason                    # "pool" / "cpu" / "latency", and why
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

from apf_gunicorn.control.adaptive import AdaptiveLimit, AdaptiveSettings, KindSample, Tick
from apf_gunicorn.master.serverlimit import apply_server_limit

if TYPE_CHECKING:  # master/poollimit.py applies its limits through this module
    from apf_gunicorn.control.poollimit import PoolDecision
    from apf_gunicorn.master.poollimit import ServerPoolLimit

# rejections that mean the limit was binding in the tick
_BINDING_REJECTIONS = ("queue-full", "time-out", "concurrency-limit")


class ServerAutoLimit:
    """The adaptive server limit as the master runs it.

    Args:
        bounds: ``(MIN, MAX)`` from the setting.
        start: the limit before the first tick.
        clock: monotonic ns (injected by tests).
        settings: the controller's constants (its defaults, bounded by ``bounds``).
        pools: the pool rule's runner, read first each tick (None: latency and CPU only).
    Attributes:
        controller: the :class:`AdaptiveLimit` (its ``baselines`` and ``last`` decision are
            what the metrics show).
        last_tick: the last :class:`Tick` fed, or None before the second call.
        source: what decided the last tick: ``"pool"``, ``"cpu"`` or ``"latency"``.
        reason: why (for the log); ``pool_decision``: the pool rule's, when it decided.
        handed_over: the last tick left the limit to the controller (the pools are gone).
    """

    def __init__(self, bounds: tuple[int, int], start: int,
                 clock: Callable[[], int] = time.monotonic_ns,
                 settings: AdaptiveSettings | None = None, route_times: Any = None,
                 pools: ServerPoolLimit | None = None) -> None:
        base = settings or AdaptiveSettings()
        self.controller = AdaptiveLimit(
            dataclasses.replace(base, minimum=bounds[0], maximum=bounds[1]), start)
        self.bounds = bounds
        self.clock = clock
        self.last_tick: Tick | None = None
        self.last_cpu: Any = None  # signals.cpu.CpuState of the last tick
        self._seen: dict[tuple[str, str], tuple[int, float, int, tuple[int, ...]]] | None = None
        self._seen_ns = 0
        # server.routekinds.RouteTimes: the kinds are routes (None: (level, FlowSchema) pairs)
        self.route_times = route_times
        self._routes_seen: dict[int, tuple[int, int]] = {}
        self.pools = pools
        self.source = "latency"
        self.reason = ""
        self.pool_decision: PoolDecision | None = None
        self.handed_over = False

    @property
    def limit(self) -> int:
        return self.controller.limit

    def observe(self, ledger: Any, exempt: set[str], now: int) -> Tick | None:
        """What finished requests said since the last call (None on the first call, which
        only records where the counters stand).

        Args:
            ledger: the ledger (``request_stats``, ``load``).
            exempt: the names of exempt levels (left out: the limit does not bind them).
            now: monotonic ns.
        Returns:
            The :class:`Tick` to feed, or None.
        """
        stats = ledger.request_stats()
        routes = self.route_times.totals() if self.route_times is not None else None
        current: dict[tuple[str, str], tuple[int, float, int, tuple[int, ...]]] = {}
        for st in stats:
            if st.level in exempt:
                continue
            ex = st.execution_regular
            current[(st.level, st.flow_schema)] = (
                ex.count, ex.sum, sum(st.rejected[r] for r in _BINDING_REJECTIONS),
                st.wait_executed.counts)
        previous, since = self._seen, self._seen_ns
        self._seen, self._seen_ns = current, now
        routes_before = self._routes_seen
        if routes is not None:
            self._routes_seen = routes
        if previous is None or now <= since:
            return None
        kinds: dict[tuple[str, str], KindSample] = {}
        busy_s = 0.0
        waited = False
        for key, (count, total_s, rejected, waits) in current.items():
            old = previous.get(key, (0, 0.0, 0, (0,) * len(waits)))
            n, service_s = count - old[0], total_s - old[1]
            if n > 0 and service_s >= 0:
                kinds[key] = KindSample(n, int(service_s * 1e9))
                busy_s += service_s
            # bucket 0 is a wait of 0 ns: dispatched at once
            if rejected > old[2] or sum(waits[1:]) > sum(old[3][1:]):
                waited = True
        if not waited:
            waited = any(lv.requests_waiting > 0 for lv in ledger.load() if not lv.exempt)
        if routes is not None:
            by_route: dict[Any, KindSample] = {}
            for slot, (count, total_ns) in routes.items():
                old_n, old_ns = routes_before.get(slot, (0, 0))
                if count > old_n and total_ns >= old_ns:
                    by_route[self.route_times.label(slot)] = KindSample(count - old_n,
                                                                         total_ns - old_ns)
            if by_route:  # (requests the table does not count: watches, file responses)
                kinds = by_route  # type: ignore[assignment]
        return Tick(now, kinds, busy_s / ((now - since) / 1e9), waited)

    def tick(self, master: Any, lock: AbstractContextManager | None = None
             ) -> tuple[int, int] | None:
        """One controller tick against ``master`` (``server.state.MasterState``).

        Args:
            master: the master's state: its ``ledger``, ``generation``, ``settings`` and
                ``borrowing_states`` are read, and replaced or updated on a change.
            lock: held around every ledger operation (the master's ``SERVICE_LOCK``).
        Returns:
            ``(old, new)`` when the server limit changed, else None.
        """
        lock = lock if lock is not None else nullcontext()
        now = self.clock()
        # The generation is read under the lock each time: on_reload replaces it (and
        # reconfigures the ledger) under the same lock, so a HUP between two reads must not
        # leave the old levels' shares written into the new ledger.
        with lock:
            levels = master.generation.configuration.priority_levels
            exempt = {name for name, pl in levels.items() if pl.is_exempt}
            tick = self.observe(master.ledger, exempt, now)
        # read every tick, the first too: the watch then has an interval (the host, the
        # run queue) by the first tick the controller is fed
        cpu = read_cpu(master)
        if tick is not None:
            if cpu is not None:
                self.last_cpu = cpu
                tick = dataclasses.replace(tick, cpu=cpu.sample)
            self.last_tick = tick
        old = master.settings.concurrency_limit
        was_pools, self.pool_decision = self.pool_decision is not None, None
        decision = self.pools.decide(master, now, lock) if self.pools is not None else None
        self.handed_over = was_pools and decision is None
        if decision is not None:
            new = self._from_pools(decision, tick, old, cpu is not None)
        else:
            if self.handed_over:  # the pools are gone: the next ones start the rule afresh
                self.pools.reset()  # type: ignore[union-attr]
            if tick is not None:
                self.controller.update(tick)
            new = self.controller.limit
            self.reason = self.controller.last.reason
            self.source = "cpu" if self.reason.startswith("cpu:") else "latency"
        if new == old:
            return None
        apply_server_limit(master, new, now, lock)
        return old, new

    def _from_pools(self, decision: PoolDecision, tick: Tick | None, old: int,
                    cpu_known: bool) -> int:
        """The limit when the pool rule decided: its limit (its ceiling is ``MAX``) raised to
        ``MIN``, or ``old`` when that is a rise and the CPU is at its capacity; the rule and
        the controller are told where the limit stands."""
        assert self.pools is not None
        self.pool_decision = decision
        self.source, self.reason = "pool", decision.reason
        new = max(self.bounds[0], decision.limit)
        # (every tick: the controller keeps learning its baselines, at the pool's knee, for
        # when the pools are gone)
        why = self.controller.cpu_bound(tick) if tick is not None else None
        if why is not None and new > old:
            self.source = "cpu"
            self.reason = (f"cpu: {why}, holding {old} seats (more add nothing; the pools "
                           f"would give {new})")
            new = old
        if decision.found:  # the first limit from the pools: what auto found
            self.reason = (f"limit auto: {decision.found}{'; CPU' if cpu_known else ''}; "
                           + (self.reason if self.source == "cpu" else
                              f"{decision.seats} seats for the busiest level (share "
                              f"{self.pools.share or 1.0:.2f})"))
        if new != decision.limit and self.pools.share is not None:
            self.pools.rule.keep(new, self.pools.share)
        self.controller.follow(new, self.reason, tick.concurrency if tick else 0.0)
        return new


def read_cpu(master: Any) -> Any:
    """The server's CPU now (``signals.cpu.CpuState``) from the master's ``cpu_watch``, the
    registered workers' rows only (a booting one's may hold its dead predecessor's window);
    None without a watch."""
    watch = getattr(master, "cpu_watch", None)
    if watch is None:
        return None
    live = {i for i, pid in (getattr(master, "workers", None) or {}).items() if pid}
    return watch.read(live)
