"""Kubernetes' uniform-scenario client harness, over any fair-queuing backend.

This reproduces ``uniformScenario`` from Kubernetes' ``queueset_test.go``
(``reference/k8s-queueset.md`` section 8.0):

* thread ``j`` of client ``i`` starts at ``90*j + 20*i`` ns; with ``split`` the second half of
  the threads start at the first evaluation, with half the calls;
* each call is admitted; a rejected call stops its thread; when a call starts executing, the
  thread's next call is scheduled at ``exec start + exec + think`` (think may be negative) and
  the main phase ends after ``exec``; lingering seats are released by the backend's
  ``linger_until``;
* per client the time-weighted initial seats executing are integrated exactly (integer ns), and
  reset at each evaluation, giving each window's ``averageExecutingSeats``;
* the harness keeps its own seat-demand integrator (``+maxSeats`` at each call, ``-maxSeats`` on
  rejection or ``additionalLatency`` after the main phase) and, per window, compares it with
  the backend's (Kubernetes' seat-demand check).

The backend (:class:`Backend`) is the production ledger in ``simulate`` (see
:mod:`apf_gunicorn.simulate.backends`); tests also plug in a reference port.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol

from apf_gunicorn.flowcontrol.gomath import duration_seconds

from . import capacity as capacity_models
from .engine import EventLoop
from .scenario import BackendSpec, ClientSpec

REJECT_REASONS = ("queue-full", "concurrency-limit", "time-out")


@dataclass(slots=True)
class Admission:
    """What a backend's ``admit`` answers: ``handle`` is None when rejected (with ``reason``);
    ``granted`` lists every handle (this one included) that started executing in the call."""

    handle: Any
    reason: str
    granted: list


@dataclass(frozen=True, slots=True)
class DemandResults:
    """Integrator results as Kubernetes' ``IntegratorResults``."""

    duration: float
    average: float
    deviation: float
    min: float
    max: float


class Backend(Protocol):
    """The fair-queuing code the harness drives. ``now`` is virtual integer ns."""

    name: str

    def admit(self, level: int, flow_hash: int, initial: int, final: int,
              additional_latency_ns: int, now: int) -> Admission: ...

    def finish(self, handle: Any, now: int) -> tuple[list, int]:
        """Main phase over: (granted handles, linger-until ns or 0)."""

    def release(self, handle: Any, now: int) -> list:
        """Lingering seats free: granted handles."""

    def demand_stats(self, level: int, now: int) -> DemandResults | None:
        """Seat-demand integrator results since the last call (None: not available)."""

    def epoch_advances(self) -> int: ...


class ExactIntegrator:
    """A piecewise-constant integer signal integrated exactly over integer ns.

    ``results`` matches Kubernetes' integrator (min/max start at 0, ``reset`` restarts them at
    the current value) but without float accumulation error.
    """

    __slots__ = ("x", "last", "t", "ix", "ixx", "min", "max")

    def __init__(self, now: int = 0) -> None:
        self.x = 0
        self.last = now
        self.t = self.ix = self.ixx = 0
        self.min = self.max = 0

    def add(self, dx: int, now: int) -> None:
        dt = now - self.last
        if dt:
            x = self.x
            self.t += dt
            self.ix += x * dt
            self.ixx += x * x * dt
            self.last = now
        self.x += dx
        if self.x < self.min:
            self.min = self.x
        elif self.x > self.max:
            self.max = self.x

    def reset(self, now: int) -> DemandResults:
        self.add(0, now)
        if self.t <= 0:
            avg = dev = math.nan
        else:
            mean = Fraction(self.ix, self.t)
            var = Fraction(self.ixx, self.t) - mean * mean
            avg, dev = float(mean), math.sqrt(var)
        out = DemandResults(duration_seconds(self.t), avg, dev, float(self.min), float(self.max))
        self.t = self.ix = self.ixx = 0
        self.min = self.max = self.x
        return out


def fair_alloc(demands: Sequence[float], capacity: float) -> list[float]:
    """Kubernetes' test helper ``fairAlloc``: the max-min fair allocation of ``capacity``."""
    count = len(demands)
    order = sorted(range(count), key=lambda i: demands[i])
    alloc = [0.0] * count
    nxt, prev = 0, 0.0
    while nxt < count:
        demand = demands[order[nxt]]
        if demand > 0:
            bite = (count - nxt) * (demand - prev)
            if bite > capacity:
                break
            prev = demand
            alloc[order[nxt]] = demand
            capacity -= bite
        nxt += 1
    for j in range(nxt, count):
        alloc[order[j]] = prev + capacity / (count - nxt)
    return alloc


def client_demand(client: ClientSpec, threads: int) -> float:
    """``threads * seats * exec / (exec + think)``, the seats a client would keep busy."""
    period = client.exec_ns + client.think_ns
    if period <= 0:
        return float(threads * client.seats)
    return threads * client.seats * client.exec_ns / period


class SeatsTimeline:
    """Each client's executing initial seats over time, as a step function with bounded memory.

    ``[0, end_ns)`` is cut into at most ``points`` equal steps; each step holds the exact
    time integral of the client's executing seats over it (integer seat-ns), so
    :meth:`series` gives the time-weighted average per step: a change inside a step is
    averaged, never lost. Memory is ``clients x points`` integers whatever the number of
    events; time past ``end_ns`` (the run draining after the last window) is not recorded.

        tl = SeatsTimeline(["a", "b"], end_ns=40 * 10**9, points=400)   # 100 ms steps
        tl.add(0, +1, now)            # client 0 starts executing one seat at ``now``
        tl.close(40 * 10**9); tl.series(0)   # -> [average seats of each step]
    """

    __slots__ = ("names", "end_ns", "width_ns", "points", "_area", "_x", "_last")

    def __init__(self, names: Sequence[str], end_ns: int, points: int) -> None:
        """
        Args:
            names: the clients, in the order ``add`` numbers them.
            end_ns: the end of the recorded span (the last evaluation).
            points: the most steps to keep per client (fewer when ``end_ns`` divides so).

        Raises:
            ValueError: ``points`` < 1 or ``end_ns`` <= 0.
        """
        if points < 1 or end_ns <= 0:
            raise ValueError(f"a timeline needs points >= 1 and end > 0, got {points}, {end_ns}")
        self.names = list(names)
        self.end_ns = end_ns
        self.width_ns = -(-end_ns // points)
        self.points = -(-end_ns // self.width_ns)
        self._area = [[0] * self.points for _ in self.names]
        self._x = [0] * len(self.names)
        self._last = [0] * len(self.names)

    def add(self, client: int, dx: int, now: int) -> None:
        """Client ``client``'s executing seats change by ``dx`` at ``now`` (non-decreasing)."""
        x = self._x[client]
        if x:
            self._fill(self._area[client], x, self._last[client], min(now, self.end_ns))
        self._x[client] = x + dx
        self._last[client] = now

    def _fill(self, area: list[int], x: int, start: int, stop: int) -> None:
        width = self.width_ns
        k = start // width
        while start < stop:
            edge = min((k + 1) * width, stop)
            area[k] += x * (edge - start)
            start = edge
            k += 1

    def close(self, now: int) -> None:
        """Account every client's seats up to ``now`` (call once the run has passed it)."""
        for i in range(len(self.names)):
            self.add(i, 0, now)

    def times(self) -> list[float]:
        """The start of each step, in seconds."""
        return [duration_seconds(k * self.width_ns) for k in range(self.points)]

    def series(self, client: int) -> list[float]:
        """Client ``client``'s average executing seats in each step (the last step may be
        shorter than the others)."""
        out = []
        for k, area in enumerate(self._area[client]):
            width = min(self.width_ns, self.end_ns - k * self.width_ns)
            out.append(area / width)
        return out


@dataclass(slots=True)
class ClientTotals:
    dispatched: int = 0
    completed: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECT_REASONS, 0))


@dataclass(slots=True)
class ClientWindow:
    average_executing_seats: float
    demand: float
    fair_share: float


@dataclass(slots=True)
class Window:
    start_ns: int
    end_ns: int
    clients: dict[str, ClientWindow]
    seat_demand: dict[str, dict] = field(default_factory=dict)
    priority_levels: dict[str, dict] = field(default_factory=dict)
    # with a backend: per client completed, throughput, latency percentiles (latency_summary)
    latency: dict[str, dict] = field(default_factory=dict)
    # with an auto limit: the server limit over the window (limit_summary)
    limit: dict[str, Any] | None = None


@dataclass(slots=True)
class RunResult:
    windows: list[Window]
    clients: dict[str, ClientTotals]
    epoch_advances: int
    end_ns: int
    events: int
    requests: int
    # per level, the fairness it ran (None: exempt); filled in by simulate()
    fairness: dict[str, str | None] = field(default_factory=dict)
    timeline: SeatsTimeline | None = None  # when asked for (UniformHarness(timeline=N))
    # with an auto limit: (virtual ns, server limit) at the start and after every tick
    limits: list[tuple[int, int]] | None = None
    limit_bounds: tuple[int, int] | None = None


class _Thread:
    __slots__ = ("client", "index", "calls")

    def __init__(self, client: _Client, index: int, calls: int) -> None:
        self.client = client
        self.index = index
        self.calls = calls


class _Client:
    __slots__ = ("spec", "index", "level", "hash", "totals", "exec_seats", "latencies", "kind")

    def __init__(self, spec: ClientSpec, index: int, level: int, flow_hash: int) -> None:
        self.spec = spec
        self.index = index
        self.level = level
        self.hash = flow_hash
        self.totals = ClientTotals()
        self.exec_seats = ExactIntegrator()
        self.latencies: list[int] = []  # with a backend: arrival to end, ns, this window
        self.kind = (level, spec.kind)  # what the adaptive controller learns a baseline of


def latency_summary(latencies: list[int], seconds: float) -> dict[str, Any]:
    """``completed``, ``throughput`` (per second) and the p50/p99/max latency in seconds
    (nearest rank; None without requests) of one client's requests that ended in a window."""
    ordered = sorted(latencies)

    def rank(q: float) -> float | None:
        if not ordered:
            return None
        return duration_seconds(ordered[max(0, math.ceil(q * len(ordered)) - 1)])

    return {"completed": len(ordered),
            "throughput": len(ordered) / seconds if seconds > 0 else 0.0,
            "p50": rank(0.50), "p99": rank(0.99), "max": rank(1.0)}


def limit_summary(series: Sequence[tuple[int, int]], start: int, end: int) -> dict[str, Any]:
    """The server limit over ``[start, end)`` from its step function ``series``: the value at
    the start and at the end, the least and the most, and the time-weighted mean."""
    value = series[0][1]
    for t, v in series:
        if t > start:
            break
        value = v
    first, low, high, area, t0 = value, value, value, 0, start
    for t, v in series:
        if start < t < end:
            area += value * (t - t0)
            value, t0 = v, t
            low, high = min(low, v), max(high, v)
    area += value * (end - t0)
    return {"start": first, "end": value, "min": low, "max": high,
            "mean": area / (end - start)}


class AutoTicker(Protocol):
    """The adaptive limit as the harness drives it (``apf_gunicorn.simulate.autolimit``)."""

    tick_ns: int
    series: list[tuple[int, int]]
    bounds: tuple[int, int]

    def tick(self, now: int, kinds: dict, concurrency: float, waiting: bool) -> list:
        """One controller tick: the handles the new limit dispatched."""


class UniformHarness:
    """Runs uniform clients against one backend.

    ``routes`` gives each client's (level index, flow hash); ``levels`` names the levels whose
    seat demand is checked; ``capacity`` is the limit used for the informational fair share;
    ``on_window(window, now)`` may add per-level data to each window (``level_averages`` gives
    each level's average executing initial seats over the window); ``periodic`` is an optional
    ``(period_ns, fn(now) -> granted handles)`` run every period of virtual time (borrowing);
    ``timeline`` (a number of steps) also records each client's executing seats over time up
    to the last evaluation (:class:`SeatsTimeline`, in ``RunResult.timeline``).

    With ``model`` (a :class:`~.scenario.BackendSpec`) an executing request runs its ``exec``
    in that backend (:mod:`.capacity`), then its ``overhead``, and its thread's next call
    follows its end by ``think`` (a real client waits for its answer; none is made after the
    last evaluation); each window then
    reports each client's latency (:func:`latency_summary`). With ``auto``
    (:class:`AutoTicker`) the adaptive controller runs every ``auto.tick_ns``, fed each kind
    of request's service times (dispatch to end), the average seats executing and whether
    anything waited.
    """

    def __init__(self, clients: Sequence[ClientSpec], evaluate: Sequence[int], backend: Backend,
                 routes: Sequence[tuple[int, int]], capacity: float,
                 check_levels: dict[str, int] | None = None,
                 on_window: Callable[[Window, int], None] | None = None,
                 periodic: tuple[int, Callable[[int], list]] | None = None,
                 timeline: int | None = None, model: BackendSpec | None = None,
                 auto: AutoTicker | None = None) -> None:
        self.loop = EventLoop()
        self.backend = backend
        self.evaluate = tuple(evaluate)
        self.capacity = capacity
        self.clients = [_Client(spec, i, *routes[i]) for i, spec in enumerate(clients)]
        self.check_levels = check_levels or {}
        self.demand_check = {name: ExactIntegrator() for name in self.check_levels}
        self._check_of_level = {lvl: self.demand_check[n] for n, lvl in self.check_levels.items()}
        self.on_window = on_window
        self.periodic = periodic
        self._running: dict[Any, tuple[_Thread, int]] = {}
        self.requests = 0
        self.level_exec = {c.level: ExactIntegrator() for c in self.clients}
        self.level_averages: dict[int, float] = {}
        self.timeline = (None if timeline is None else
                         SeatsTimeline([c.name for c in clients], self.evaluate[-1], timeline))
        self.model_spec = model
        self.model = None if model is None else capacity_models.build(self.loop, model)
        self._jitter = random.Random(model.seed) if model is not None and model.jitter else None
        self.auto = auto
        self._times: dict[Any, list[int]] = {}  # handle -> [arrival ns, start ns]
        self._queued: set = set()  # handles admitted to wait in a queue, not yet started
        self._waited = False  # something waited since the last controller tick
        self._executing = ExactIntegrator()  # every level's executing seats
        self._tick_kinds: dict[Any, list[int]] = {}  # kind -> [finished, service ns]
        self._tickers = 0  # periodic functions still running (_every)

    def _overhead(self, ns: int) -> int:
        """A request's time in the app outside the backend, stretched on a busy host by the
        factor of the current period (``BackendSpec.busy_slowdown``)."""
        spec = self.model_spec
        if spec is None or not spec.busy_slowdown:
            return ns
        period = self.loop.now // spec.busy_period_ns
        factor = random.Random(spec.seed * 1_000_003 + period).uniform(1, 1 + spec.busy_slowdown)
        return round(ns * factor)

    # -- client behaviour ---------------------------------------------------------------
    def _call(self, thread: _Thread, k: int) -> None:
        client = thread.client
        spec = client.spec
        now = self.loop.now
        self.requests += 1
        check = self._check_of_level.get(client.level)
        if check is not None:
            check.add(spec.max_seats, now)
        adm = self.backend.admit(client.level, client.hash, spec.seats, spec.final_seats,
                                 spec.additional_latency_ns, now)
        if adm.handle is None:
            client.totals.rejected[adm.reason] = client.totals.rejected.get(adm.reason, 0) + 1
            if check is not None:
                check.add(-spec.max_seats, now)
            return  # a rejected thread stops
        self._running[adm.handle] = (thread, k)
        if self.model is not None or self.auto is not None:
            self._times[adm.handle] = [now, now]
            if adm.handle not in adm.granted:
                self._queued.add(adm.handle)
                self._waited = True
        self._start_all(adm.granted)

    def _start_all(self, granted: list) -> None:
        for handle in granted:
            entry = self._running.get(handle)
            if entry is not None:
                self._start(handle, *entry)

    def _start(self, handle: Any, thread: _Thread, k: int) -> None:
        loop = self.loop
        now = loop.now
        client = thread.client
        spec = client.spec
        client.totals.dispatched += 1
        client.exec_seats.add(spec.seats, now)
        self.level_exec[client.level].add(spec.seats, now)
        if self.timeline is not None:
            self.timeline.add(client.index, spec.seats, now)
        times = self._times.get(handle)
        if times is not None:
            times[1] = now
            self._queued.discard(handle)
            self._executing.add(spec.seats, now)
        if self.model is not None:
            work = spec.exec_ns
            if self._jitter is not None:
                jitter = self.model_spec.jitter
                work = round(work * self._jitter.uniform(1 - jitter, 1 + jitter))

            def after_backend() -> None:
                if spec.overhead_ns:
                    loop.after(self._overhead(spec.overhead_ns), lambda: self._end(handle, client))
                else:
                    self._end(handle, client)

            self.model.begin(work, after_backend)
            return
        if k + 1 < thread.calls:
            loop.at(now + spec.exec_ns + spec.think_ns, lambda: self._call(thread, k + 1))
        loop.at(now + spec.exec_ns, lambda: self._end(handle, client))

    def _end(self, handle: Any, client: _Client) -> None:
        now = self.loop.now
        spec = client.spec
        thread, k = self._running.pop(handle)
        times = self._times.pop(handle, None)
        if times is not None:
            self._executing.add(-spec.seats, now)
            acc = self._tick_kinds.setdefault(client.kind, [0, 0])
            acc[0] += 1
            acc[1] += now - times[1]
        if self.model is not None:
            client.latencies.append(now - times[0])
            # closed loop: no new call once the last window has ended (no long drain)
            if k + 1 < thread.calls and now + spec.think_ns < self.evaluate[-1]:
                self.loop.at(now + spec.think_ns, lambda: self._call(thread, k + 1))
        client.exec_seats.add(-spec.seats, now)
        self.level_exec[client.level].add(-spec.seats, now)
        if self.timeline is not None:
            self.timeline.add(client.index, -spec.seats, now)
        client.totals.completed += 1
        granted, linger_until = self.backend.finish(handle, now)
        check = self._check_of_level.get(client.level)
        if check is not None:
            self.loop.at(now + spec.additional_latency_ns,
                         lambda: check.add(-spec.max_seats, self.loop.now))
        if linger_until:
            self.loop.at(linger_until, lambda: self._start_all(self.backend.release(handle, self.loop.now)))
        self._start_all(granted)

    # -- the run ------------------------------------------------------------------------
    def run(self) -> RunResult:
        loop = self.loop
        half = self.evaluate[0]
        for client in self.clients:
            spec = client.spec
            for j in range(spec.threads):
                start, calls = spec.start_ns + 90 * j + 20 * client.index, spec.calls
                if spec.split and j >= spec.threads // 2:
                    start, calls = start + half, calls // 2
                if calls > 0:
                    thread = _Thread(client, j, calls)
                    loop.at(start, lambda t=thread: self._call(t, 0))
        if self.periodic is not None:
            self._every(*self.periodic)
        if self.auto is not None:
            self._every(self.auto.tick_ns, self._auto_tick)
        windows = []
        start = 0
        for index, end in enumerate(self.evaluate):
            loop.run_until(end)
            windows.append(self._window(start, end, index))
            start = end
        if self.timeline is not None:
            self.timeline.close(self.evaluate[-1])
        loop.run()
        result = RunResult(windows, {c.spec.name: c.totals for c in self.clients},
                           self.backend.epoch_advances(), loop.now, loop.events_run,
                           self.requests, timeline=self.timeline)
        if self.auto is not None:
            result.limits = list(self.auto.series)
            result.limit_bounds = self.auto.bounds
            for w in windows:
                w.limit = limit_summary(result.limits, w.start_ns, w.end_ns)
        return result

    def _every(self, period: int, fn: Callable[[int], list]) -> None:
        """Run ``fn(now)`` every ``period`` ns while anything is left to run, starting the
        requests it dispatched."""
        loop = self.loop
        self._tickers += 1

        def tick() -> None:
            self._start_all(fn(loop.now))
            # the other tickers' next events do not count as something left to run
            if len(loop) > self._tickers - 1 or loop.now < self.evaluate[-1]:
                loop.after(period, tick)
            else:
                self._tickers -= 1

        loop.at(period, tick)

    def _auto_tick(self, now: int) -> list:
        average = self._executing.reset(now).average
        kinds, self._tick_kinds = self._tick_kinds, {}
        waiting, self._waited = self._waited, bool(self._queued)
        return self.auto.tick(now, kinds, 0.0 if math.isnan(average) else average, waiting)

    def _window(self, start: int, end: int, index: int) -> Window:
        demands = []
        for client in self.clients:
            spec = client.spec
            threads = spec.threads
            if spec.split and index == 0:
                threads = spec.threads // 2
            demands.append(client_demand(spec, threads))
        fair = fair_alloc(demands, self.capacity)
        out: dict[str, ClientWindow] = {}
        window = Window(start, end, out)
        for client, demand, share in zip(self.clients, demands, fair, strict=True):
            avg = client.exec_seats.reset(end).average
            out[client.spec.name] = ClientWindow(avg, demand, share)
            if self.model is not None:
                window.latency[client.spec.name] = latency_summary(
                    client.latencies, duration_seconds(end - start))
                client.latencies = []
        self.level_averages = {lvl: i.reset(end).average for lvl, i in self.level_exec.items()}
        for name, level in self.check_levels.items():
            mine = self.demand_check[name].reset(end)
            theirs = self.backend.demand_stats(level, end)
            window.seat_demand[name] = _compare_demand(mine, theirs)
        if self.on_window is not None:
            self.on_window(window, end)
        return window


def _close(a: float, b: float) -> bool:
    """Kubernetes' ``float64close``: NaN counts as 0; absolute or relative error below 1e-10."""
    a = 0.0 if math.isnan(a) else a
    b = 0.0 if math.isnan(b) else b
    diff = abs(a - b)
    if diff < 1e-10:
        return True
    den = max(abs(a), abs(b))
    return den > 0 and diff / den < 1e-10


def _compare_demand(expected: DemandResults, got: DemandResults | None) -> dict:
    entry: dict[str, Any] = {
        "duration": expected.duration, "average": expected.average,
        "deviation": expected.deviation, "max": expected.max,
    }
    if got is None:
        entry["checked"] = False
        return entry
    entry["checked"] = True
    entry["backend"] = {"duration": got.duration, "average": got.average,
                        "deviation": got.deviation, "max": got.max}
    entry["match"] = (_close(expected.duration, got.duration)
                      and _close(expected.average, got.average)
                      and _close(expected.deviation, got.deviation))
    return entry
