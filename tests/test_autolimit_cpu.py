"""The CPU as ``auto``'s second signal (issue 33 item 3): what the workers and the master
measure (signals/cpu.py, the signals table's CPU words), what the controller does with it
(control/adaptive.py: CPU-bound ticks settle from the CPU, a host busy with other processes is
not a slow backend), and how it is seen (the tick, the log, metrics, dump_cpu, a real
server)."""

from __future__ import annotations

import http.client
import re
import threading

import pytest

from apf_gunicorn.control.adaptive import AdaptiveLimit
from apf_gunicorn.control.adaptive_types import AdaptiveSettings, CpuSample, KindSample, Tick
from apf_gunicorn.signals.cpu import (
    CpuMeter,
    CpuWatch,
    CpuWindow,
    HostCpu,
    HostReading,
    cpu_state,
    parse_proc_stat,
    run_delay_ns,
)
from apf_gunicorn.signals.pools import PoolReading
from apf_gunicorn.signals.table import PoolTable
from tests.apps.loadgen import Client
from tests.conftest import free_port

MS = 1_000_000
S = 1_000_000_000
KIND = ("users", "users", "/cpu")


# -- what is measured ---------------------------------------------------------------------------

def test_a_workers_window_is_its_cpu_over_wall_time_and_per_served_request() -> None:
    t = {"wall": 0, "cpu": 0, "served": 0}
    meter = CpuMeter(lambda: t["served"], cpu_clock=lambda: t["cpu"], clock=lambda: t["wall"])
    t.update(wall=S, cpu=300 * MS, served=50)
    w = meter.window()
    assert (w.cpu_ns, w.wall_ns, w.requests) == (300 * MS, S, 50)
    assert w.share == pytest.approx(0.3) and w.cpu_per_request_ns == pytest.approx(6 * MS)
    t.update(wall=2 * S, cpu=400 * MS)  # the next window: from the last one, nothing served
    w = meter.window()
    assert w.share == pytest.approx(0.1) and w.cpu_per_request_ns is None
    # ran 0.3 of a window and waited for a core 0.65: wanted its GIL 0.95 of the time
    assert CpuWindow(1, 300 * MS, S, 50, 650 * MS).wanted == pytest.approx(0.95)
    assert CpuWindow(1, 300 * MS, S, 50, 2 * S).wanted == 1.0


def test_the_run_queue_delay_is_summed_over_the_threads(tmp_path) -> None:
    for tid, line in (("11", "500 2000 3\n"), ("12", "7 30 1\n"), ("13", "garbage\n")):
        (tmp_path / tid).mkdir()
        (tmp_path / tid / "schedstat").write_text(line)
    assert run_delay_ns(str(tmp_path)) == 2030
    assert run_delay_ns(str(tmp_path / "none")) == 0


STAT = """cpu  {u} 0 {s} {i} 0 0 0 0 0 0
cpu0 1 0 1 1 0 0 0 0 0 0
cpu1 1 0 1 1 0 0 0 0 0 0
intr 1 2 3
procs_running 3
"""


def test_the_host_share_is_busy_jiffies_over_all_of_them_from_proc_stat() -> None:
    assert parse_proc_stat(STAT.format(u=30, s=10, i=60)) == (40, 100, 2)
    texts = iter([STAT.format(u=30, s=10, i=60), STAT.format(u=180, s=40, i=80),
                  "garbage"])
    host = HostCpu(lambda: next(texts))
    assert host.read() is None  # the first reading only records
    # 180 busy jiffies of 200 since: 0.9 of both cores
    assert host.read() == HostReading(pytest.approx(0.9), 2)
    assert host.read() is None  # unreadable: not known, no error
    with pytest.raises(ValueError, match="no aggregate cpu line"):
        parse_proc_stat("intr 1\n")


def test_the_signals_table_carries_each_workers_cpu_window_beside_its_pools() -> None:
    table = PoolTable.create(3)
    pool = PoolReading("db", "sqlalchemy", 4, 4, 1, 5 * MS, 1)
    table.writer(0).publish([pool], 10 * S, cpu=CpuWindow(101, 950 * MS, S, 190))
    table.writer(1).publish([], 10 * S, cpu=CpuWindow(102, 500 * MS, S, 100))
    table.writer(2).publish([], 2 * S, cpu=CpuWindow(103, S, S, 1))  # stale: 8 s old
    rows = table.cpu_rows(10 * S)
    assert [(w.pid, w.cpu_ns, w.requests) for w in rows] == [(101, 950 * MS, 190),
                                                             (102, 500 * MS, 100)]
    assert [w.pid for w in table.cpu_rows(10 * S, live={1})] == [102]
    assert table.totals(10 * S)["db"].waiting == 1  # the pools read as before
    table.writer(0).publish([pool], 11 * S)  # no CPU meter: the row says none
    assert [w.pid for w in table.cpu_rows(11 * S)] == [102]

    state = cpu_state(rows, HostReading(0.98, 2))
    assert state.sample.workers == 2 and state.sample.busy == pytest.approx(1.45)
    assert state.sample.cpu_per_request_ns == pytest.approx(1450 * MS / 290)
    assert state.sample.others_share == pytest.approx(0.98 - 1.45 / 2)
    assert state.shares == {101: pytest.approx(0.95), 102: pytest.approx(0.5)}


def test_the_watch_reads_the_host_and_the_run_queue_at_most_every_half_second() -> None:
    """The master reads the host and each worker's threads' run-queue delay itself (the
    workers do nothing for it), at most every 0.5 s; a worker's waiting share is the growth
    of its delay over the master's interval."""
    now = [0]
    reads = []
    delay = {101: 0}

    class Host:
        def read(self):
            reads.append(now[0])
            return HostReading(0.5, 2)

    table = PoolTable.create(1)
    watch = CpuWatch(table, Host(), clock=lambda: now[0], run_delay=lambda pid: delay[pid])
    table.writer(0).publish([], 0, cpu=CpuWindow(101, 300 * MS, S, 10))
    assert watch.read().sample.wanted == pytest.approx(0.3)  # no interval yet: not waiting
    now[0], delay[101] = 400 * MS, 10 * S
    assert watch.read().sample.host_share == 0.5  # (the last reading, not a new one)
    now[0], delay[101] = 600 * MS, 390 * MS  # 0.39 s of delay over 0.6 s
    state = watch.read()
    assert reads == [0, 600 * MS]
    assert state.windows[0].wait_ns == pytest.approx(650 * MS, abs=1)
    assert state.sample.wanted == pytest.approx(0.95)


# -- what the controller does with it -------------------------------------------------------------

def cpu_app_tick(now: int, limit: int, noise: float = 1.0, gil: float = 0.97,
                 host: float | None = None, cores: int = 2) -> Tick:
    """A second of a CPU-bound app on 2 workers, 5 ms of Python a request: ``limit`` requests
    executing take turns at two GILs, so each takes ``5 ms x limit / 2`` (x ``noise``)."""
    service = 5 * MS * max(1.0, limit / 2) * noise
    count = max(1, round(limit * S / service))
    return Tick(now, {KIND: KindSample(count, int(count * service))}, float(limit), True,
                CpuSample(2, 2 * gil, 5.2 * MS, host, cores if host is not None else 0))


def light_tick(now: int) -> Tick:
    """The light users alone: a request at a time, 5 ms each, nothing waits."""
    return Tick(now, {KIND: KindSample(40, 40 * 5 * MS)}, 0.2, False,
                CpuSample(2, 0.2, 5.2 * MS))


def test_cpu_bound_the_limit_settles_from_the_cpu_not_the_look_below() -> None:
    """From 16 seats, workers at 0.97 of their GILs: down a quarter a tick at most to the seats
    that keep both GILs busy (2 x 1 x 2 = 4), never up, never below, whatever the latency's
    noise (which made the latency law halve the limit and cut it on jumps)."""
    ctl = AdaptiveLimit(AdaptiveSettings(minimum=1, maximum=16), start=16)
    now = 0
    ctl.update(light_tick(now))  # the baseline: 5 ms, no contention
    limits = []
    for i in range(30):
        now += S
        limits.append(ctl.update(cpu_app_tick(now, ctl.limit, noise=(1.3, 0.8, 1.0)[i % 3])))
    assert limits[:4] == [12, 9, 6, 4], limits
    assert set(limits[4:]) == {4}, limits
    assert ctl.last.reason == "cpu: workers at 0.97 of their GIL, holding 4 seats (more add " \
                              "nothing)"
    assert ctl.cpu_seats({KIND: KindSample(1, 5 * MS)}, CpuSample(2, 1.9, 5 * MS)) == 4


def test_a_look_below_made_before_the_cpu_was_known_is_undone_by_it() -> None:
    """The first binding tick halves the limit (the CPU not known yet: no interval); the next
    one is CPU-bound: back to the start, which the CPU's seats (contended baselines) do not
    bound, and held there."""
    ctl = AdaptiveLimit(AdaptiveSettings(minimum=1, maximum=16), start=8)
    t = cpu_app_tick(0, 8)
    assert ctl.update(Tick(t.now, t.kinds, t.concurrency, t.waiting)) == 4
    assert ctl.last.reason == "down: looking below the start"
    limits = [ctl.update(cpu_app_tick(i * S, 8)) for i in range(1, 6)]
    assert limits == [8] * 5, limits
    assert ctl.last.reason.endswith("holding 8 seats (more add nothing)"), ctl.last.reason


def test_cpu_bound_more_seats_add_nothing_so_the_limit_never_rises() -> None:
    """At 2 seats with calm latency the latency law grows (slow start, probes); with both GILs
    at capacity it holds."""
    ctl = AdaptiveLimit(AdaptiveSettings(minimum=1, maximum=16), start=2)
    ctl.update(light_tick(0))
    limits = [ctl.update(cpu_app_tick(i * S, ctl.limit)) for i in range(1, 12)]
    assert set(limits) == {2}, limits
    # the same ticks without the CPU: the latency law moves it
    blind = AdaptiveLimit(AdaptiveSettings(minimum=1, maximum=16), start=2)
    blind.update(light_tick(0))
    moved = [blind.update(Tick(t.now, t.kinds, t.concurrency, t.waiting))
             for t in (cpu_app_tick(i * S, 2) for i in range(1, 12))]
    assert set(moved) != {2}, moved


def test_workers_that_always_have_python_to_run_are_cpu_bound_on_a_busy_host() -> None:
    """Other processes take the cores: the workers run 0.30 of the time and wait for a core
    the rest. More seats add nothing there either; latency's inflation is the host's."""
    ctl = AdaptiveLimit(AdaptiveSettings(minimum=1, maximum=16), start=8)
    ctl.update(light_tick(0))
    t = cpu_app_tick(S, 8, gil=0.3, host=1.0)
    ctl.update(Tick(t.now, t.kinds, t.concurrency, t.waiting,
                    CpuSample(2, 0.6, 5.2 * MS, 1.0, 2, wanted=1.94)))
    assert ctl.last.reason == ("cpu: workers want their GIL 0.97 of the time (0.30 running, "
                               "the rest waiting for a core), 6 seats")
    # requests that are 1 % CPU (50 ms of waiting for a backend, 0.5 ms of Python): their
    # threads wait for a core when they wake on a busy host, but the cores are not what
    # holds them: the latency law decides
    pool = AdaptiveLimit(AdaptiveSettings(minimum=1, maximum=16), start=8)
    kinds = {KIND: KindSample(160, 160 * 50 * MS)}
    pool.update(Tick(0, kinds, 0.5, False, CpuSample(2, 0.05, 0.5 * MS)))
    pool.update(Tick(S, kinds, 8.0, True, CpuSample(2, 0.2, 0.5 * MS, 1.0, 2, wanted=1.94)))
    assert not pool.last.reason.startswith("cpu:"), pool.last.reason


def test_the_host_at_its_cores_with_our_workers_on_them_is_cpu_bound() -> None:
    ctl = AdaptiveLimit(AdaptiveSettings(minimum=1, maximum=16), start=8)
    ctl.update(light_tick(0))
    # the workers at 0.65 of their GILs (1.3 cores of 2), the host at 0.97: mostly ours
    ctl.update(cpu_app_tick(S, 8, gil=0.65, host=0.97))
    assert ctl.last.reason == "cpu: host at 0.97 of its 2 cores, 1.3 of them ours, 6 seats"
    # the host as busy, mostly with others: not CPU-bound (the latency law decides)
    ctl.update(cpu_app_tick(2 * S, 6, gil=0.2, host=0.97))
    assert not ctl.last.reason.startswith("cpu:")


def pool_ticks(ctl: AdaptiveLimit, cpu_per_request_ns: float, host: float | None,
               gil: float = 0.2) -> list[str]:
    """16 seats binding on a backend of 50 ms a request, then latency doubles; the reasons."""
    reasons = []
    for i in range(8):
        service = 50 * MS * (2.0 if i >= 5 else 1.0)
        count = round(16 * S / service)
        ctl.update(Tick(i * S, {KIND: KindSample(count, int(count * service))}, 16.0, True,
                        CpuSample(2, 2 * gil, cpu_per_request_ns, host, 2)))
        reasons.append(ctl.last.reason)
    return reasons


def test_a_host_busy_with_other_processes_is_not_a_slow_backend() -> None:
    """Latency doubles while other processes keep the host at 0.98 of its cores (0.78 not
    ours). Requests that are all CPU: the busy host explains it (their CPU part runs at
    2 cores over the 0.5 a worker is never left without), the limit holds and says why. Requests that are 1 % CPU: it does not;
    the cut is a slow backend's, and says so."""
    settings = AdaptiveSettings(minimum=1, maximum=16, look_below=False)
    cpu_app = AdaptiveLimit(settings, start=16)
    reasons = pool_ticks(cpu_app, 50 * MS, host=0.98)
    assert cpu_app.limit == 16, reasons
    assert "hold: host busy with other processes (0.78 of 2 cores not ours), latency x2.00 " \
           "within what it explains (x4.00, x4.50 with the tolerance)" in reasons, reasons
    backend = AdaptiveLimit(settings, start=16)
    reasons = pool_ticks(backend, 0.5 * MS, host=0.98)
    assert backend.limit < 16, reasons
    assert any("(a slow backend: latency x2.00 beyond the busy host's x1.03" in r
               for r in reasons), reasons
    # a quiet host: the latency law as before, no word of the host
    quiet = AdaptiveLimit(settings, start=16)
    reasons = pool_ticks(quiet, 50 * MS, host=0.3)
    assert quiet.limit == backend.limit and not any("host" in r for r in reasons), reasons


def test_without_the_cpu_the_latency_law_decides_as_before() -> None:
    a = AdaptiveLimit(AdaptiveSettings(minimum=1, maximum=16), start=16)
    b = AdaptiveLimit(AdaptiveSettings(minimum=1, maximum=16), start=16)
    for i in range(12):
        t = cpu_app_tick(i * S, a.limit, noise=(1.2, 0.9)[i % 2], gil=0.5)
        assert a.update(t) == b.update(Tick(t.now, t.kinds, t.concurrency, t.waiting))


# -- the master -------------------------------------------------------------------------------

def run_master(served_per_window: int, ticks: int):
    """The master's ticks against the pool flood of test_autolimit (50 ms a request, no queue
    inside the app), both workers publishing 0.97 of their GILs and ``served_per_window``
    requests a window; returns the master, its services and their info lines."""
    from apf_gunicorn.master.master import MasterServices
    from tests.test_autolimit import Clock, Log, PoolLoad, master

    m, clock = master(), Clock()
    table = PoolTable.create(2)
    host = HostCpu(lambda: STAT.format(u=clock.now // MS, s=0, i=clock.now // (50 * MS)))
    m.pool_table, m.workers = table, {0: 101, 1: 102}
    m.cpu_watch = CpuWatch(table, host, clock=clock, run_delay=lambda pid: 0)
    log = Log()
    services = MasterServices(m, log)
    services.auto.clock = clock
    load = PoolLoad(m, clock, pool=64)
    for _ in range(ticks):
        for row, pid in m.workers.items():
            table.writer(row).publish([], clock.now,
                                      cpu=CpuWindow(pid, 970 * MS, S, served_per_window))
        services.adapt_once()
        load.run_until(clock.now + S)
    return m, services, [line for level, line in log.lines if level == "info"]


def test_the_masters_tick_feeds_the_cpu_and_logs_each_cpu_move_with_its_cause() -> None:
    """50 ms of CPU a request (19 a window at 0.97 of a GIL): down to 2 x 1 x 2 = 4 seats,
    each move logged with its cause (the hold that follows is what the moves said)."""
    m, services, infos = run_master(19, 12)
    tick = services.auto.last_tick
    assert tick.cpu.workers == 2 and tick.cpu.busy == pytest.approx(1.94)
    assert tick.cpu.host_share is not None and tick.cpu.cores == 2
    assert services.auto.last_cpu.shares == {101: pytest.approx(0.97), 102: pytest.approx(0.97)}
    assert infos[0] == ("apf: concurrency limit auto: 24 -> 18 seats (cpu: workers at 0.97 of "
                        "their GIL, 18 seats)"), infos
    assert infos[-1].endswith("-> 4 seats (cpu: workers at 0.97 of their GIL, 4 seats)"), infos
    assert m.settings.concurrency_limit == services.auto.limit == 4
    assert not [line for line in infos if " stays " in line], infos


def test_a_cpu_hold_is_logged_once() -> None:
    """5 ms of CPU a request of 50 ms (190 a window): both GILs busy needs 2 x 10 x 2 = 40
    seats, more than the 24 it has: it holds there, and says so once."""
    m, services, infos = run_master(190, 8)
    assert m.settings.concurrency_limit == 24
    assert infos == ["apf: concurrency limit auto: stays 24 seats (cpu: workers at 0.97 of "
                     "their GIL, holding 24 seats (more add nothing))"], infos


def test_metrics_and_the_dump_show_the_cpu() -> None:
    from prometheus_client.core import CollectorRegistry

    from apf_gunicorn.master.metrics import cpu_families
    from apf_gunicorn.server.dumps import dump_cpu

    state = cpu_state([CpuWindow(101, 970 * MS, S, 190), CpuWindow(102, 500 * MS, S, 100,
                                                                   300 * MS)],
                      HostReading(0.95, 2))

    class One:
        def collect(self):
            return cpu_families("apf", state)

    reg = CollectorRegistry()
    reg.register(One())
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for fam in reg.collect() for s in fam.samples}
    assert got[("apf_worker_cpu_share", (("worker", "101"),))] == pytest.approx(0.97)
    assert got[("apf_worker_cpu_share", (("worker", "102"),))] == pytest.approx(0.5)
    assert got[("apf_worker_cpu_wanted_share", (("worker", "102"),))] == pytest.approx(0.8)
    assert got[("apf_host_cpu_share", ())] == pytest.approx(0.95)
    assert got[("apf_host_cpu_others_share", ())] == pytest.approx(0.95 - 1.47 / 2)
    assert got[("apf_cpu_per_request_seconds", ())] == pytest.approx(1.47 / 290)
    text = dump_cpu(state)
    lines = [re.split(r",\s*", line.strip()) for line in text.strip().splitlines()]
    assert lines[0] == ["Worker", "CpuShare", "WantedShare", "CpuPerRequestMs", "Requests"]
    assert lines[1] == ["101", "0.970", "0.970", "5.105", "190"]
    assert lines[2] == ["102", "0.500", "0.800", "5.000", "100"]
    assert lines[3] == ["workers", "1.470", "1.770", "5.069", "290"]
    assert lines[4] == ["host (2 cores)", "0.950", "-", "-", "-"]
    assert lines[5] == ["host: not ours", "0.215", "-", "-", "-"]


# -- a real server -------------------------------------------------------------------------------

def _get(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def test_a_real_server_publishes_each_workers_cpu_and_the_hosts(server_factory) -> None:
    """Requests of 5 ms of Python: every worker's share and the CPU per request (at least the
    5 ms, whatever the host's load: CPU time, not wall time) in /metrics, the host's share,
    and dump_cpu."""
    admin = free_port()
    env = {"APF_CONCURRENCY_LIMIT": "auto:1-8", "APF_ADAPTIVE_TICK": "0.25",
           "APF_ADMIN_BIND": f"127.0.0.1:{admin}"}
    stop = threading.Event()
    clients = []
    with server_factory(workers=2, threads=4, env=env) as srv:
        clients = [Client(srv.port, "/spin?ms=5", user=f"u{i}", stop=stop) for i in range(4)]
        try:
            for c in clients:
                c.start()

            def seen() -> bool:
                text = _get(admin, "/metrics")
                workers = re.findall(r'^apf_worker_cpu_share\{worker="(\d+)"\} (\S+)$', text,
                                     re.M)
                per = re.search(r"^apf_cpu_per_request_seconds (\S+)$", text, re.M)
                wanted = re.findall(r'^apf_worker_cpu_wanted_share\{worker="(\d+)"\} \S+$',
                                    text, re.M)
                return (len(workers) == 2 and all(float(v) > 0 for _, v in workers)
                        and sorted(wanted) == sorted(pid for pid, _ in workers)
                        and per is not None and float(per.group(1)) >= 0.004
                        and re.search(r"^apf_host_cpu_share \S+$", text, re.M) is not None
                        and re.search(r"^apf_host_cpu_others_share \S+$", text, re.M)
                        is not None)

            assert srv.wait_for(seen, timeout=60), (_get(admin, "/metrics"), srv.log())
            dump = _get(admin, "/debug/api_priority_and_fairness/dump_cpu")
            rows = [line.split(",")[0].strip() for line in dump.strip().splitlines()]
            assert rows[0] == "Worker" and len([r for r in rows if r.isdigit()]) == 2, dump
            assert rows[-2].startswith("host (") and rows[-1] == "host: not ours", dump
        finally:
            stop.set()
            for c in clients:
                c.join(10)
    assert not [c.errors for c in clients if c.errors]
