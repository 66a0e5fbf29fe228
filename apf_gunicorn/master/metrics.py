"""Prometheus metrics: Kubernetes' ``apiserver_flowcontrol_*`` series as ``<prefix>_*``.

Everything is read at scrape time, in the master, from the shared ledger; nothing is written
per request by this module:

* :class:`RequestStatsCollector`: the per-request series (``rejected_requests_total``,
  ``dispatched_requests_total``, ``request_wait_duration_seconds{execute}``,
  ``request_execution_seconds{type}``, ``work_estimated_seats``, and not Kubernetes'
  ``rejections_delayed_total``) from ``ledger.request_stats()``:
  counters and histograms the ledger keeps per (level, flow schema) under the lock each
  admit/finish/cancel already holds. They are server-wide, survive worker deaths and restarts
  (a dead worker's counts are already in shared memory) and never go backwards.
* :class:`LedgerCollector`: instantaneous values (executing and waiting requests and seats,
  limits, demand statistics, ``seat_fair_frac``) from ``ledger.snapshot()`` and the borrowing
  state, plus the snapshot's cumulative ``epoch_advance_total{priority_level, success}``, and
  each queuing level's fairness (``fairness_info{priority_level, fairness}``),
  the virtual time it orders by (``virtual_time_seat_seconds{priority_level, fairness}``) and,
  under ``maxmin``, ``active_flows``, ``reserved_seats`` and ``reservations_total``. The
  per-(level, FlowSchema) gauges (``current_executing_seats``, ``current_executing_requests``,
  ``current_inqueue_requests``, ``current_inqueue_seats``) are exported for every pair that has
  seen a request since start (the ledger's stats table knows them), at 0 when idle.
* :func:`pool_families`: the app's connection pools the workers found (``signals/``), summed
  per pool over the registered workers from the shared pool table: ``pool_capacity``,
  ``pool_in_use``, ``pool_waiting``, ``pool_wait_seconds_total``, ``pool_waits_total``.
* A courtesy for the application's own metrics: when the *user* runs prometheus-client's
  multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set before gunicorn starts), ``/metrics``
  also serves the aggregate of those files, and :func:`mark_process_dead` (``child_exit``)
  folds a dead worker's counter and histogram files into ``*_archive.db`` so they do not pile
  up with ``max_requests`` restarts. apf_gunicorn itself does not need multiprocess mode.

Usage (the admin endpoint does it)::

    registry = build_registry(prefix, state_provider)    # state_provider() -> MasterView
    text = prometheus_client.generate_latest(registry)
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from apf_gunicorn.ledger.records import LedgerPort
from apf_gunicorn.ledger.stats import OVERFLOW
from apf_gunicorn.server.dumps import MAXMIN, level_fairness, reserved_head_seats, virtual_time

log = logging.getLogger("apf_gunicorn.metrics")

ENV = "PROMETHEUS_MULTIPROC_DIR"
DEFAULT_PREFIX = "apf"

# Serialises merging dead workers' files against scrapes (both run in the master), so a
# scrape never sees a dead worker's counts twice or not at all.
_FILES_LOCK = threading.Lock()


def _reinit_files_lock() -> None:
    global _FILES_LOCK
    _FILES_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_reinit_files_lock)


# -- the application's own multiprocess files (courtesy) --------------------------------------

def user_multiprocess_dir() -> str | None:
    """The user's ``PROMETHEUS_MULTIPROC_DIR``, if set and a directory."""
    path = os.environ.get(ENV)
    return path if path and os.path.isdir(path) else None


def mark_process_dead(pid: int, path: str | None = None) -> None:
    """A worker died (``child_exit``): if the application uses multiprocess mode, drop the
    worker's live gauge files (prometheus_client's own ``mark_process_dead``: only the
    ``live*`` modes; a ``sum``, ``all``, ``max``, ``min`` or ``mostrecent`` gauge keeps the dead
    worker's value, as prometheus_client documents) and fold its counter and histogram files
    into ``*_archive.db``, so those files do not pile up with restarts while counters never go
    backwards. A no-op without ``PROMETHEUS_MULTIPROC_DIR``."""
    path = path or user_multiprocess_dir()
    if not path:
        return
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, path)
    with _FILES_LOCK:
        for typ in ("counter", "histogram"):
            dead = os.path.join(path, f"{typ}_{pid}.db")
            if os.path.exists(dead):
                try:
                    _fold_into_archive(path, typ, dead)
                except Exception:
                    log.exception("could not merge %s; leaving it in place", dead)


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


class UserMultiprocessCollector:
    """The application's multiprocess files (live and archived), read under the lock
    :func:`mark_process_dead` takes."""

    def __init__(self, path: str | None = None, source: Any = None) -> None:
        if source is None:
            from prometheus_client.multiprocess import MultiProcessCollector

            source = MultiProcessCollector(None, path=path)
        self.source = source

    def describe(self) -> list:
        return []

    def collect(self) -> Iterable[Any]:
        with _FILES_LOCK:
            return list(self.source.collect())


# -- scrape-time collectors (master) ----------------------------------------------------------

@dataclass
class MasterView:
    """What the master exposes to the admin endpoint and :class:`LedgerCollector`."""

    ledger: LedgerPort | None = None  # None until the ledger is configured
    level_limits: Mapping[str, Any] | None = None  # name -> LevelLimits
    borrowing: Any = None  # flowcontrol.borrowing.BorrowingStates
    workers: int = 0  # registered (booted) workers
    clock: Callable[[], int] = field(default=time.monotonic_ns)
    server_limit: int | None = None
    reload_errors: int = 0  # rejected configuration reloads so far
    workers_reclaimed: int = 0  # workers that exited holding requests (master/reclaim.py)
    # configuration reloads by (result, trigger) (master/reload.py), and the applied one
    reloads: Mapping[tuple[str, str], int] = field(default_factory=dict)
    generation: int | None = None
    digest: str = ""
    auto: Any = None  # server.autolimit.ServerAutoLimit with APF_CONCURRENCY_LIMIT=auto
    # the app's pools server-wide, {name: signals.table.PoolTotals}, read when called
    pools: Callable[[], Mapping[str, Any]] | None = None
    # the workers' and the host's CPU (signals.cpu.CpuState), read when called
    cpu: Callable[[], Any] | None = None

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
        workers_reclaimed=int(getattr(m, "workers_reclaimed", 0) or 0),
        reloads=dict(getattr(m, "reloads", None) or {}),
        generation=getattr(gen, "number", None),
        digest=getattr(gen, "digest", "") or "",
        auto=getattr(m, "auto_limit", None),
        pools=_pools_of(m),
        cpu=_cpu_of(m),
    )


def _cpu_of(m: Any) -> Callable[[], Any] | None:
    """Reads the CPU (the registered workers' rows, the host): master/autolimit.read_cpu."""
    if getattr(m, "cpu_watch", None) is None:
        return None
    from apf_gunicorn.master.autolimit import read_cpu

    return lambda: read_cpu(m)


def _pools_of(m: Any) -> Callable[[], Mapping[str, Any]] | None:
    """Reads the workers' pool table server-wide (live workers' gauges only)."""
    table = getattr(m, "pool_table", None)
    if table is None:
        return None

    def read() -> Mapping[str, Any]:
        # registered workers only: a booting one has published nothing yet, and its row may
        # still hold its dead predecessor's last window
        live = {i for i, pid in (getattr(m, "workers", None) or {}).items() if pid}
        return table.totals(time.monotonic_ns(), live=live)

    return read


class LedgerCollector:
    """Gauges read from ``ledger.snapshot()`` and the borrowing state at scrape time, and the
    epoch-advance and configuration-reload counters."""

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
        # Every pair that has seen a request since start is exported, at 0 when idle (as
        # Kubernetes keeps its gauge children): the stats table has an entry for each pair
        # admitted so far; pairs seen executing by an earlier scrape are kept as well (a pair
        # folded into an overflow stats entry has no entry of its own).
        seen = [(st.level, st.flow_schema) for st in view.ledger.request_stats()
                if st.flow_schema != OVERFLOW and st.level != OVERFLOW]
        with self._lock:
            self._pairs.update(counts)
            self._pairs.update(seen)
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
        service = G(f"{p}_service_estimate_seconds", "service time charged to a request's "
                    "queue at dispatch (G), learnt from finished requests unless fixed",
                    labels=pl)
        for lv in snap.levels:
            current.add_metric([lv.name], lv.concurrency_limit)
            current_r.add_metric([lv.name], lv.current_r / 1e8)
            if lv.desired_queues > 0:  # only queuing levels charge G
                service.add_metric([lv.name], lv.service_estimate_ns / 1e9)
        yield current
        yield current_r
        yield service
        yield from _fairness_families(p, snap)

        from prometheus_client.core import CounterMetricFamily

        # Kubernetes' epoch_advance_total: R wound back by rDecrement to avoid overflow;
        # success="false" when a queue's or request's R would have underflowed. "true" is
        # exported for every level (0 until the first advance, which takes years of busy
        # time), "false" only once it happened.
        epochs = CounterMetricFamily(f"{p}_epoch_advance", "Number of times the queueset's "
                                     "progress meter jumped backward",
                                     labels=["priority_level", "success"])
        for lv in snap.levels:
            epochs.add_metric([lv.name, "true"], float(getattr(lv, "epoch_advances", 0)))
            failures = getattr(lv, "epoch_advance_failures", 0)
            if failures:
                epochs.add_metric([lv.name, "false"], float(failures))
        yield epochs

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

        yield from _server_limit_families(p, view)
        if view.pools is not None:
            yield from pool_families(p, view.pools())
        if view.cpu is not None:
            yield from cpu_families(p, view.cpu())
        reloads = CounterMetricFamily(f"{p}_config_reload_errors", "Configuration reloads "
                                      "rejected because the new configuration was invalid")
        reloads.add_metric([], float(view.reload_errors))
        yield reloads
        reclaimed = CounterMetricFamily(f"{p}_reclaimed_workers", "Workers that exited while "
                                        "they held requests (executing or waiting): killed "
                                        "(SIGKILL, OOM, timeout) or crashed; the master "
                                        "reclaimed their seats")
        reclaimed.add_metric([], float(view.workers_reclaimed))
        yield reclaimed
        yield from config_families(p, view)
        heads = CounterMetricFamily(f"{p}_request_head_timeouts", "Connections answered 408 "
                                    "because their request head did not arrive within "
                                    "APF_HEADER_TIMEOUT")
        heads.add_metric([], float(snap.head_timeouts))
        yield heads
        dropped = CounterMetricFamily(f"{p}_connections_dropped", "Connections a worker closed "
                                      "while they sent their request head: past "
                                      "APF_HEAD_CONNECTIONS (reason head-connections, the oldest "
                                      "idle) or APF_HEAD_BUFFER_LIMIT (head-buffer, the largest "
                                      "head, answered 431)", labels=["reason"])
        for reason, n in sorted((getattr(snap, "connections_dropped", None) or {}).items()):
            dropped.add_metric([reason], float(n))
        yield dropped


def config_families(p: str, view: MasterView) -> list:
    """``config_reloads_total{result, trigger}`` (every pair, 0 included, so rates and alerts
    have a series from the start) and ``config_info{generation, digest} 1`` for the applied
    configuration (digest ``sha256:`` and 16 hex digits)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    from apf_gunicorn.server.generation import short_digest

    total = CounterMetricFamily(f"{p}_config_reloads", "Configuration reloads by result "
                                "(applied, refused as invalid) and trigger (file: APF_CONFIG "
                                "changed, hup: SIGHUP)", labels=["result", "trigger"])
    for result in ("applied", "refused"):
        for trigger in ("file", "hup"):
            total.add_metric([result, trigger], float(view.reloads.get((result, trigger), 0)))
    out = [total]
    if view.generation is not None:
        info = GaugeMetricFamily(f"{p}_config_info", "The configuration applied: its "
                                 "generation (1 at start, +1 per reload applied) and the "
                                 "digest of its files", labels=["generation", "digest"])
        info.add_metric([str(view.generation), short_digest(view.digest)], 1.0)
        out.append(info)
    return out


def _server_limit_families(p: str, view: MasterView) -> list:
    """The server concurrency limit and, with ``APF_CONCURRENCY_LIMIT=auto``, what its
    controller sees (master/autolimit.py)."""
    from prometheus_client.core import GaugeMetricFamily as G

    out = []
    if view.server_limit is not None:
        limit = G(f"{p}_server_concurrency_limit_seats", "The server concurrency limit in "
                  "seats: fixed, or where APF_CONCURRENCY_LIMIT=auto has moved it")
        limit.add_metric([], float(view.server_limit))
        out.append(limit)
    auto = view.auto
    if auto is None:
        return out
    decision = auto.controller.last
    ratio = G(f"{p}_adaptive_latency_ratio", "APF_CONCURRENCY_LIMIT=auto: the last tick's "
              "service-time inflation, summed service over summed baselines of the requests "
              "that finished (1: no contention)")
    ratio.add_metric([], float(decision.inflation if decision.inflation is not None else 1.0))
    conc = G(f"{p}_adaptive_concurrency_seats", "APF_CONCURRENCY_LIMIT=auto: the average "
             "concurrency the controller observed over its last tick")
    conc.add_metric([], float(decision.concurrency))
    base = G(f"{p}_adaptive_baseline_seconds", "APF_CONCURRENCY_LIMIT=auto: the service time "
             "without contention the controller learnt per kind of request (a route within "
             "its priority level and FlowSchema)",
             labels=["priority_level", "flow_schema", "route"])
    for kind, ns in sorted(auto.controller.baselines.items()):
        level, schema, route = (*kind, "")[:3]  # (level, FlowSchema[, route])
        base.add_metric([level, schema, route], ns / 1e9)
    return [*out, ratio, conc, base]


def pool_families(p: str, pools: Mapping[str, Any]) -> list:
    """The app's connection pools and declared resources, summed over the live workers
    (``signals/``): capacity (+Inf when unbounded), in use, waiting, and the cumulative time
    waited and waits (these never go backwards, a dead worker's included)."""
    from prometheus_client.core import CounterMetricFamily as C
    from prometheus_client.core import GaugeMetricFamily as G

    from apf_gunicorn.signals.pools import UNBOUNDED

    labels = ["pool", "kind"]
    capacity = G(f"{p}_pool_capacity", "Connections (or units) the app's pool can hand out "
                 "at once, summed over the workers; +Inf when unbounded", labels=labels)
    in_use = G(f"{p}_pool_in_use", "Connections (or units) of the app's pool handed out, "
               "summed over the workers (as of each worker's last window)", labels=labels)
    waiting = G(f"{p}_pool_waiting", "Requests waiting for a connection (or unit) of the "
                "app's pool, summed over the workers (as of each worker's last window)",
                labels=labels)
    wait = C(f"{p}_pool_wait_seconds", "Time requests spent waiting for a connection (or "
             "unit) of the app's pool, summed over the workers", labels=labels)
    waits = C(f"{p}_pool_waits", "Acquisitions of a connection (or unit) of the app's pool "
              "that had to wait, summed over the workers", labels=labels)
    for name in sorted(pools):
        t = pools[name]
        lv = [name, t.kind]
        if t.workers:
            capacity.add_metric(lv, float("inf") if t.capacity == UNBOUNDED
                                else float(t.capacity))
            in_use.add_metric(lv, float(t.in_use))
            waiting.add_metric(lv, float(t.waiting))
        wait.add_metric(lv, t.wait_ns / 1e9)
        waits.add_metric(lv, float(t.waits))
    return [capacity, in_use, waiting, wait, waits]


def cpu_families(p: str, cpu: Any) -> list:
    """The CPU (``signals.cpu.CpuState``): each live worker's share of its GIL over its last
    window, the workers' CPU per served request, the host's busy share of its cores and the
    share busy with other processes (the host's only where ``/proc/stat`` was read)."""
    from prometheus_client.core import GaugeMetricFamily as G

    share = G(f"{p}_worker_cpu_share", "A worker's process CPU time over wall time in its "
              "last window (about 1 s): the share of its GIL it used (1: at capacity)",
              labels=["worker"])
    wanted = G(f"{p}_worker_cpu_wanted_share", "The share of a worker's last window it ran "
               "or waited for a core (the host's run queue), at most 1: near 1 it always had "
               "Python to run", labels=["worker"])
    for w in sorted(cpu.windows, key=lambda w: w.pid):
        share.add_metric([str(w.pid)], w.share)
        wanted.add_metric([str(w.pid)], w.wanted)
    out = [share, wanted]
    per = cpu.sample.cpu_per_request_ns
    if per is not None:
        g = G(f"{p}_cpu_per_request_seconds", "The workers' CPU time over the requests they "
              "served, in their last windows")
        g.add_metric([], per / 1e9)
        out.append(g)
    if cpu.sample.host_share is not None:
        host = G(f"{p}_host_cpu_share", "The host's busy share of all its cores (/proc/stat) "
                 "since the previous reading (about a second)")
        host.add_metric([], cpu.sample.host_share)
        others = G(f"{p}_host_cpu_others_share", "The share of all the host's cores busy "
                   "with other processes than this server's workers")
        others.add_metric([], cpu.sample.others_share or 0.0)
        out += [host, others]
    return out


def _fairness_families(p: str, snap: Any) -> list:
    """The fairness of each queuing level and the virtual-time state it orders by (not
    Kubernetes series: Kubernetes has one fairness, whose R is ``current_r``)."""
    from prometheus_client.core import CounterMetricFamily as C
    from prometheus_client.core import GaugeMetricFamily as G
    from prometheus_client.core import InfoMetricFamily

    pl = ["priority_level"]
    info = InfoMetricFamily(f"{p}_fairness", "The fairness of each "
                            "queuing priority level: kubernetes or maxmin", labels=pl)
    vtime = G(f"{p}_virtual_time_seat_seconds", "Virtual time the level's fairness "
              "orders by: R under kubernetes (as current_r), V, the start tag in service, "
              "under maxmin", labels=["priority_level", "fairness"])
    flows = G(f"{p}_active_flows", "maxmin: flows with a request waiting or executing",
              labels=pl)
    reserved = G(f"{p}_reserved_seats", "maxmin: seats the level holds free for a reserved "
                 "wide request (0 when none is reserved)", labels=pl)
    reservations = C(f"{p}_reservations", "maxmin: times a level reserved seats for a head "
                     "wider than its free seats", labels=pl)
    for lv in sorted(snap.levels, key=lambda lv: lv.name):
        fairness = level_fairness(lv)
        if not fairness:
            continue
        info.add_metric([lv.name], {"fairness": fairness})
        vt = virtual_time(lv)
        if vt is not None:
            vtime.add_metric([lv.name, fairness], vt / 1e8)
        mm = getattr(lv, "maxmin", None)
        if fairness == MAXMIN and mm is not None:
            flows.add_metric([lv.name], len(mm["flows"]))
            reserved.add_metric([lv.name], reserved_head_seats(lv))
            reservations.add_metric([lv.name], float(mm.get("reservations", 0)))
    return [info, vtime, flows, reserved, reservations]


def _state(st: Any) -> str:
    if isinstance(st, int):
        return {1: "waiting", 2: "executing", 3: "lingering"}.get(st, "free")
    return str(st)


class RequestStatsCollector:
    """The per-request series, from ``ledger.request_stats()`` at scrape time.

    Series appear when their first event happens (as Kubernetes' lazily created children):
    a reason, ``execute`` value or execution ``type`` with no event yet is not exported;
    ``dispatched_requests_total`` and ``work_estimated_seats`` are exported for every
    (level, flow schema) pair the ledger has seen.
    """

    def __init__(self, prefix: str, state_provider: Callable[[], MasterView]) -> None:
        self.prefix = prefix
        self.state_provider = state_provider

    def describe(self) -> list:
        return []

    def collect(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        view = self.state_provider()
        if view is None or view.ledger is None:
            return []
        stats = view.ledger.request_stats()
        p = self.prefix
        pl_fs = ["priority_level", "flow_schema"]
        rejected = CounterMetricFamily(
            f"{p}_rejected_requests", "Number of requests rejected by API Priority and "
            "Fairness subsystem", labels=[*pl_fs, "reason"])
        dispatched = CounterMetricFamily(
            f"{p}_dispatched_requests", "Number of requests executed by API Priority and "
            "Fairness subsystem", labels=pl_fs)
        wait = HistogramMetricFamily(
            f"{p}_request_wait_duration_seconds", "Length of time a request spent waiting in "
            "its queue", labels=[*pl_fs, "execute"])
        execution = HistogramMetricFamily(
            f"{p}_request_execution_seconds", "Duration of initial stage (for a WATCH) or any "
            "(for a non-WATCH) stage of request execution in the API Priority and Fairness "
            "subsystem", labels=[*pl_fs, "type"])
        work = HistogramMetricFamily(
            f"{p}_work_estimated_seats", "Number of estimated seats (maximum of initial and "
            "final seats) associated with requests in API Priority and Fairness",
            labels=pl_fs)
        delayed = CounterMetricFamily(
            f"{p}_rejections_delayed", "Rejections (429s) a worker held (at most 1 s, up to "
            "the Retry-After) before writing them, because the flow kept coming back before "
            "its Retry-After", labels=[*pl_fs, "reason"])
        for st in sorted(stats, key=lambda x: (x.level, x.flow_schema)):
            pair = [st.level, st.flow_schema]
            dispatched.add_metric(pair, float(st.dispatched))
            for reason in sorted(st.rejected):
                n = st.rejected[reason]
                if n:
                    rejected.add_metric([*pair, reason], float(n))
            for reason, n in sorted(st.delayed.items()):
                if n:
                    delayed.add_metric([*pair, reason], float(n))
            _add_hist(work, pair, st.work)
            for value, h in (("true", st.wait_executed), ("false", st.wait_rejected)):
                if h.count:
                    _add_hist(wait, [*pair, value], h)
            for kind, h in (("regular", st.execution_regular), ("watch", st.execution_watch)):
                if h.count:
                    _add_hist(execution, [*pair, kind], h)
        return [rejected, dispatched, wait, execution, work, delayed]


def _add_hist(family: Any, labels: list[str], h: Any) -> None:
    """Add a ledger ``Hist`` (non-cumulative counts, the last one +Inf) as cumulative
    buckets."""
    from prometheus_client.utils import floatToGoString

    buckets = []
    acc = 0
    for bound, n in zip(h.bounds, h.counts, strict=False):
        acc += n
        buckets.append((floatToGoString(bound), float(acc)))
    buckets.append(("+Inf", float(acc + h.counts[len(h.bounds)])))
    family.add_metric(labels, buckets, float(h.sum))


def build_registry(prefix: str, state_provider: Callable[[], MasterView] | None,
                   source: Any = None) -> Any:
    """A fresh registry with the ledger collectors, plus the application's multiprocess
    files when ``PROMETHEUS_MULTIPROC_DIR`` is set (or ``source`` is given): what /metrics
    serves."""
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    if state_provider is not None:
        reg.register(RequestStatsCollector(prefix, state_provider))
        reg.register(LedgerCollector(prefix, state_provider))
    path = user_multiprocess_dir()
    if source is not None or path:
        reg.register(UserMultiprocessCollector(path, source))
    return reg
