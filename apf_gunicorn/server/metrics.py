"""Prometheus metrics: Kubernetes' ``apiserver_flowcontrol_*`` series as ``<prefix>_*``.

Two sources, each doing what it is good at:

* **Per-request events** (rejected, dispatched, wait and execution histograms, estimated seats)
  are written by every worker with prometheus-client's *multiprocess mode* through
  :class:`RequestMetrics`, which binds label sets once and makes at most **3 metric operations
  per request**: ``work_estimated_seats`` + the wait histogram (or, for exempt requests, the
  dispatched counter) + the execution histogram; a rejection is seats + wait + rejected.
  ``dispatched_requests_total`` of non-exempt levels is derived at scrape time from the wait
  histogram (every dispatched non-exempt request is observed there with ``execute="true"``,
  as is each queued request that timed out or was cancelled, Kubernetes' quirk), so it costs
  no extra operation.
* **Instantaneous values** (executing and waiting requests and seats, limits, demand
  statistics, ``seat_fair_frac``) are read from the ledger and the borrowing state by
  :class:`LedgerCollector`, which only the master registers, at scrape time: exact server-wide
  values that never include dead workers.

Setup, in the master before anything imports prometheus_client (conf.py's first lines)::

    from apf_gunicorn.server.metrics import setup_multiprocess_dir
    setup_multiprocess_dir(instance_token)        # sets PROMETHEUS_MULTIPROC_DIR, wipes it
    ...
    # child_exit: metrics.mark_process_dead(worker.pid)

In each worker: ``RequestMetrics(prefix).observe_...`` from the middleware. In the master:
``build_registry(prefix, state_provider)`` (the admin endpoint does it).
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("apf_gunicorn.metrics")

ENV = "PROMETHEUS_MULTIPROC_DIR"
DEFAULT_PREFIX = "apf"

WAIT_BUCKETS = (0, 0.005, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30)
EXECUTION_BUCKETS = WAIT_BUCKETS
WORK_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 100)
# Rejections of requests that had been queued: observed in the wait histogram with
# execute="true", so they are subtracted when dispatched_requests_total is derived.
QUEUED_REJECT_REASONS = ("time-out", "cancelled")

# Serialises merging dead workers' files against scrapes (both run in the master), so a
# scrape never sees a dead worker's counts twice or not at all.
_FILES_LOCK = threading.Lock()


def _reinit_files_lock() -> None:
    global _FILES_LOCK
    _FILES_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_reinit_files_lock)


# -- multiprocess directory -------------------------------------------------------------------

def setup_multiprocess_dir(instance: str, base: str | None = None) -> str:
    """Create (or empty) the per-instance multiprocess directory, export it as
    ``PROMETHEUS_MULTIPROC_DIR`` and return it. A directory already given in the environment
    is used as is (and emptied). If prometheus_client was imported before, its value class is
    switched to multiprocess mode for the metrics created from now on."""
    path = os.environ.get(ENV)
    if not path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in instance)
        path = os.path.join(base or tempfile.gettempdir(), f"apf-gunicorn-metrics-{safe}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    for f in glob.glob(os.path.join(path, "*.db")):
        try:
            os.remove(f)
        except FileNotFoundError:
            pass
    os.environ[ENV] = path
    import sys

    values = sys.modules.get("prometheus_client.values")
    if values is not None and not getattr(values.ValueClass, "_multiprocess", False):
        log.warning("prometheus_client was imported before %s was set; switching it to "
                    "multiprocess mode now (metrics created earlier stay per-process)", ENV)
        values.ValueClass = values.MultiProcessValue()
    return path


def remove_multiprocess_dir(path: str | None = None) -> None:
    """Delete the directory at server exit (``on_exit``)."""
    path = path or os.environ.get(ENV)
    if path and os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)


def mark_process_dead(pid: int, path: str | None = None) -> None:
    """A worker died (``child_exit``): drop its live gauge files and fold its counter and
    histogram files into ``*_archive.db`` so files do not pile up with restarts while
    counters never go backwards."""
    from prometheus_client import multiprocess

    path = path or os.environ.get(ENV)
    if not path:
        return
    multiprocess.mark_process_dead(pid, path)
    with _FILES_LOCK:
        for typ in ("counter", "histogram"):
            dead = os.path.join(path, f"{typ}_{pid}.db")
            if os.path.exists(dead):
                try:
                    _fold_into_archive(path, typ, dead)
                except Exception:
                    log.exception("could not merge %s; leaving it in place", dead)
        for f in glob.glob(os.path.join(path, f"gauge_*_{pid}.db")):
            os.remove(f)  # we keep no gauges in files, but a user's app may


def _fold_into_archive(path: str, typ: str, dead: str) -> None:
    from prometheus_client.mmap_dict import MmapedDict, mmap_key
    from prometheus_client.multiprocess import MultiProcessCollector

    archive = os.path.join(path, f"{typ}_archive.db")
    sources = [f for f in (archive, dead) if os.path.exists(f)]
    merged = MultiProcessCollector.merge(sources, accumulate=False)
    tmp = os.path.join(path, f"{typ}_archive.tmp")
    if os.path.exists(tmp):
        os.remove(tmp)
    out = MmapedDict(tmp)
    try:
        for metric in merged:
            for s in metric.samples:
                key = mmap_key(metric.name, s.name, list(s.labels), list(s.labels.values()),
                               metric.documentation)
                out.write_value(key, s.value, 0.0)
    finally:
        out.close()
    os.replace(tmp, archive)  # scrapes hold _FILES_LOCK, so they see both changes or none
    os.remove(dead)


# -- per-request metrics (workers) ------------------------------------------------------------

class RequestMetrics:
    """The per-request series of one worker process, label sets bound once and cached.

    Call order per request (each call is one metric operation unless noted):
    ``observe_work`` at estimate time; then ``observe_dispatched`` when it starts executing
    (``wait_s=None`` for exempt levels) or ``observe_rejected`` (two operations); and
    ``observe_execution`` when its main phase ends.
    """

    def __init__(self, prefix: str = DEFAULT_PREFIX, registry: Any = None) -> None:
        from prometheus_client import Counter, Histogram

        self.prefix = prefix
        pl_fs = ("priority_level", "flow_schema")
        self._rejected = Counter(
            f"{prefix}_rejected_requests", "Number of requests rejected by API Priority and "
            "Fairness subsystem", [*pl_fs, "reason"], registry=registry)
        self._dispatched = Counter(
            f"{prefix}_dispatched_requests", "Number of requests executed by API Priority "
            "and Fairness subsystem", list(pl_fs), registry=registry)
        self._wait = Histogram(
            f"{prefix}_request_wait_duration_seconds", "Length of time a request spent "
            "waiting in its queue", [*pl_fs, "execute"], buckets=WAIT_BUCKETS,
            registry=registry)
        self._execution = Histogram(
            f"{prefix}_request_execution_seconds", "Duration of initial stage (for a WATCH) "
            "or any (for a non-WATCH) stage of request execution in the API Priority and "
            "Fairness subsystem", [*pl_fs, "type"], buckets=EXECUTION_BUCKETS,
            registry=registry)
        self._work = Histogram(
            f"{prefix}_work_estimated_seats", "Number of estimated seats (maximum of initial "
            "and final seats) associated with requests in API Priority and Fairness",
            list(pl_fs), buckets=WORK_BUCKETS, registry=registry)
        self._bound: dict[tuple, Any] = {}

    def _child(self, key: tuple, make: Callable[[], Any]) -> Any:
        child = self._bound[key] = make()
        return child

    def observe_work(self, pl: str, fs: str, seats: int) -> None:
        key = ("w", pl, fs)
        child = self._bound.get(key)
        if child is None:
            child = self._child(key, lambda: self._work.labels(pl, fs))
        child.observe(seats)

    def observe_dispatched(self, pl: str, fs: str, wait_s: float | None) -> None:
        """Execution starts; ``wait_s`` is the time since arrival, ``None`` for exempt."""
        if wait_s is None:
            key = ("d", pl, fs)
            child = self._bound.get(key)
            if child is None:
                child = self._child(key, lambda: self._dispatched.labels(pl, fs))
            child.inc()
            return
        key = ("wtrue", pl, fs)
        child = self._bound.get(key)
        if child is None:
            child = self._child(key, lambda: self._wait.labels(pl, fs, "true"))
        child.observe(wait_s)

    def observe_rejected(self, pl: str, fs: str, reason: str, wait_s: float | None) -> None:
        """``reason``: queue-full, concurrency-limit, time-out or cancelled. The rejected counter
        is written before the wait histogram so the derived dispatched count never overshoots."""
        key = ("r", pl, fs, reason)
        child = self._bound.get(key)
        if child is None:
            child = self._child(key, lambda: self._rejected.labels(pl, fs, reason))
        child.inc()
        if wait_s is not None:
            execute = "true" if reason in QUEUED_REJECT_REASONS else "false"
            key = ("w" + execute, pl, fs)
            child = self._bound.get(key)
            if child is None:
                child = self._child(key, lambda: self._wait.labels(pl, fs, execute))
            child.observe(wait_s)

    def observe_execution(self, pl: str, fs: str, seconds: float, watch: bool = False) -> None:
        kind = "watch" if watch else "regular"
        key = ("e", pl, fs, kind)
        child = self._bound.get(key)
        if child is None:
            child = self._child(key, lambda: self._execution.labels(pl, fs, kind))
        child.observe(seconds)


# -- scrape-time collectors (master) ----------------------------------------------------------

@dataclass
class MasterView:
    """What the master exposes to the admin endpoint and :class:`LedgerCollector`."""

    ledger: Any = None  # None until the ledger is configured
    level_limits: Mapping[str, Any] | None = None  # name -> LevelLimits
    borrowing: Any = None  # flowcontrol.borrowing.BorrowingStates
    workers: int = 0  # registered (booted) workers
    clock: Callable[[], int] = field(default=time.monotonic_ns)
    server_limit: int | None = None
    reload_errors: int = 0  # rejected configuration reloads so far

    @property
    def ready(self) -> bool:
        return self.ledger is not None and self.workers > 0


def view_of_master_state(m: Any) -> MasterView:
    """A :class:`MasterView` of ``server.state.MasterState`` (or None before it exists)."""
    if m is None:
        return MasterView()
    gen = getattr(m, "generation", None)
    settings = getattr(m, "settings", None)
    return MasterView(
        ledger=getattr(m, "ledger", None),
        level_limits=getattr(gen, "limits", None),
        borrowing=getattr(m, "borrowing_states", None),
        workers=sum(1 for pid in (getattr(m, "workers", None) or {}).values() if pid),
        server_limit=getattr(settings, "concurrency_limit", None),
        reload_errors=int(getattr(m, "reload_errors", 0) or 0),
    )


class LedgerCollector:
    """Gauges read from ``ledger.snapshot()`` and the borrowing state at scrape time."""

    def __init__(self, prefix: str, state_provider: Callable[[], MasterView]) -> None:
        self.prefix = prefix
        self.state_provider = state_provider
        self._pairs: set[tuple[str, str]] = set()  # (pl, fs) seen: reported as 0 when idle
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._reinit)

    def _reinit(self) -> None:
        self._lock = threading.Lock()

    def describe(self) -> list:
        return []  # dynamic; do not let the registry call collect() at registration

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import GaugeMetricFamily as G

        view = self.state_provider()
        if view is None or view.ledger is None:
            return []
        p = self.prefix
        snap = view.ledger.snapshot(view.clock())
        fs_names = list(snap.flow_schema_names)
        pl_fs = ["priority_level", "flow_schema"]
        fams = {
            "exec_req": G(f"{p}_current_executing_requests", "Number of requests in initial "
                          "(for a WATCH) or any (for a non-WATCH) execution stage", labels=pl_fs),
            "exec_seats": G(f"{p}_current_executing_seats", "Concurrency (number of seats) "
                            "occupied by the currently executing requests", labels=pl_fs),
            "q_req": G(f"{p}_current_inqueue_requests", "Number of requests currently pending "
                       "in queues", labels=pl_fs),
            "q_seats": G(f"{p}_current_inqueue_seats", "Number of seats currently pending in "
                         "queues", labels=pl_fs),
        }
        counts: dict[tuple[str, str], list[int]] = {}
        for lv in snap.levels:
            for r in lv.requests:
                fs = fs_names[r.fs_index] if 0 <= r.fs_index < len(fs_names) else ""
                c = counts.get((lv.name, fs))
                if c is None:
                    c = counts[(lv.name, fs)] = [0, 0, 0, 0]
                seats = max(r.initial_seats, r.final_seats)
                state = _state(r.state)
                if state == "waiting":
                    c[2] += 1
                    c[3] += seats
                elif state == "executing":
                    c[0] += 1
                    c[1] += seats
                elif state == "lingering":
                    c[1] += seats
        with self._lock:
            self._pairs.update(counts)
            pairs = sorted(self._pairs)
        for pair in pairs:
            c = counts.get(pair, (0, 0, 0, 0))
            labels = list(pair)
            fams["exec_req"].add_metric(labels, c[0])
            fams["exec_seats"].add_metric(labels, c[1])
            fams["q_req"].add_metric(labels, c[2])
            fams["q_seats"].add_metric(labels, c[3])
        yield from fams.values()

        pl = ["priority_level"]
        current = G(f"{p}_current_limit_seats", "current derived number of execution seats "
                    "available to each priority level", labels=pl)
        current_r = G(f"{p}_current_r", "R(time of last change)", labels=pl)
        for lv in snap.levels:
            current.add_metric([lv.name], lv.concurrency_limit)
            current_r.add_metric([lv.name], lv.current_r / 1e8)
        yield current
        yield current_r

        if view.level_limits:
            fam = {
                "nominal": G(f"{p}_nominal_limit_seats", "Nominal number of execution seats "
                             "configured for each priority level", labels=pl),
                "lower": G(f"{p}_lower_limit_seats", "Configured lower bound on number of "
                           "execution seats available to each priority level", labels=pl),
                "upper": G(f"{p}_upper_limit_seats", "Configured upper bound on number of "
                           "execution seats available to each priority level", labels=pl),
            }
            for name in sorted(view.level_limits):
                lim = view.level_limits[name]
                for attr, g in fam.items():
                    g.add_metric([name], getattr(lim, attr))
            yield from fam.values()

        states = view.borrowing
        if states is not None:
            fam = {
                "high_watermark": G(f"{p}_demand_seats_high_watermark", "High watermark, over "
                                    "last adjustment period, of demand_seats", labels=pl),
                "avg": G(f"{p}_demand_seats_average", "Time-weighted average, over last "
                         "adjustment period, of demand_seats", labels=pl),
                "stddev": G(f"{p}_demand_seats_stdev", "Time-weighted standard deviation, over "
                            "last adjustment period, of demand_seats", labels=pl),
                "smoothed": G(f"{p}_demand_seats_smoothed", "Smoothed seat demands", labels=pl),
                "target": G(f"{p}_target_seats", "Seat allocation targets", labels=pl),
            }
            for name in sorted(states):
                st = states[name]
                for attr, g in fam.items():
                    g.add_metric([name], float(getattr(st, attr)))
            yield from fam.values()
            frac = G(f"{p}_seat_fair_frac", "Fair fraction of server's concurrency to allocate "
                     "to each priority level that can use it")
            frac.add_metric([], float(getattr(states, "fair_frac", 0.0)))
            yield frac

        from prometheus_client.core import CounterMetricFamily

        reloads = CounterMetricFamily(f"{p}_config_reload_errors", "Configuration reloads "
                                      "rejected because the new configuration was invalid")
        reloads.add_metric([], float(view.reload_errors))
        yield reloads


def _state(st: Any) -> str:
    if isinstance(st, int):
        return {1: "waiting", 2: "executing", 3: "lingering"}.get(st, "free")
    return str(st)


class RequestEventsCollector:
    """The multiprocess files of all workers (live and merged dead ones), with
    ``dispatched_requests_total`` completed for non-exempt levels from the wait histogram.

    A derived counter is clamped per series to never go down between scrapes (a scrape can
    fall between a worker's rejected-counter and wait-histogram writes)."""

    def __init__(self, prefix: str, source: Any = None) -> None:
        self.prefix = prefix
        if source is None:
            from prometheus_client.multiprocess import MultiProcessCollector

            source = MultiProcessCollector(None)
        self.source = source
        self._last: dict[tuple, float] = {}
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._reinit)

    def _reinit(self) -> None:
        self._lock = threading.Lock()

    def describe(self) -> list:
        return []

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily

        with _FILES_LOCK:
            families = list(self.source.collect())
        p = self.prefix
        dispatched: dict[tuple[str, str], float] = {}
        wait_true: dict[tuple[str, str], float] = {}
        queued_rejects: dict[tuple[str, str], float] = {}
        out = []
        for fam in families:
            if fam.name == f"{p}_dispatched_requests":
                for s in fam.samples:
                    if s.name.endswith("_total"):
                        k = (s.labels.get("priority_level", ""), s.labels.get("flow_schema", ""))
                        dispatched[k] = dispatched.get(k, 0.0) + s.value
                continue
            if fam.name == f"{p}_request_wait_duration_seconds":
                for s in fam.samples:
                    if s.name.endswith("_count") and s.labels.get("execute") == "true":
                        k = (s.labels.get("priority_level", ""), s.labels.get("flow_schema", ""))
                        wait_true[k] = wait_true.get(k, 0.0) + s.value
            elif fam.name == f"{p}_rejected_requests":
                for s in fam.samples:
                    if s.name.endswith("_total") and s.labels.get("reason") in QUEUED_REJECT_REASONS:
                        k = (s.labels.get("priority_level", ""), s.labels.get("flow_schema", ""))
                        queued_rejects[k] = queued_rejects.get(k, 0.0) + s.value
            out.append(fam)
        fam = CounterMetricFamily(
            f"{p}_dispatched_requests", "Number of requests executed by API Priority and "
            "Fairness subsystem", labels=["priority_level", "flow_schema"])
        with self._lock:
            for k in sorted(set(dispatched) | set(wait_true)):
                value = dispatched.get(k, 0.0) + max(
                    0.0, wait_true.get(k, 0.0) - queued_rejects.get(k, 0.0))
                value = max(value, self._last.get(k, 0.0))
                self._last[k] = value
                fam.add_metric(list(k), value)
        out.append(fam)
        return out


def build_registry(prefix: str, state_provider: Callable[[], MasterView] | None,
                   source: Any = None) -> Any:
    """A fresh registry with the request-event and ledger collectors (what /metrics serves)."""
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    reg.register(RequestEventsCollector(prefix, source))
    if state_provider is not None:
        reg.register(LedgerCollector(prefix, state_provider))
    return reg
