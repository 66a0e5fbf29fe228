"""The CPU signal: how much of its GIL each worker uses, and how busy the host's cores are.

A Python worker runs Python one thread at a time (the GIL): its process CPU time over wall
time, once a window, is the share of its GIL it uses; near 1.0 the worker is at its GIL's
capacity and more seats only make its requests take turns. The host's cores, read from
``/proc/stat`` by the master, say whether the machine itself is at capacity, and (its busy
time less our workers' CPU) whether other processes are what keeps it busy.

Nothing is measured per request: a worker's publisher thread reads ``time.process_time_ns``
and the worker's count of served requests once a window (:class:`CpuMeter`), and publishes
the window in the worker's row of the signals table (``table.py``); the master reads
``/proc/stat`` once a tick (:class:`HostCpu`) and the workers' threads' run-queue delays, and
folds them into a :class:`CpuState` (:class:`CpuWatch`)::

    meter = CpuMeter(served=lambda: middleware.stats["served"])   # worker
    writer.publish(pools, now_ns, cpu=meter.window())                # once a window
    watch = CpuWatch(table)                                          # master
    state = watch.read(live)          # once a tick, a scrape, a dump: CpuState
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from apf_gunicorn.control.adaptive_types import CpuSample

PROC_STAT = "/proc/stat"


@dataclass(frozen=True, slots=True)
class CpuWindow:
    """One worker's window: its ``pid``, the process CPU time and the wall time the window
    lasted (ns), the requests it served in it, and the time its threads waited for a core
    (runnable, not running: the host's run queue; ns, summed over its threads, measured by
    the master over its own interval and scaled to the window)."""

    pid: int
    cpu_ns: int
    wall_ns: int
    requests: int
    wait_ns: int = 0

    @property
    def share(self) -> float:
        """The share of its GIL (of one core) the worker used: CPU over wall time."""
        return self.cpu_ns / self.wall_ns if self.wall_ns > 0 else 0.0

    @property
    def wanted(self) -> float:
        """The share of the window the worker ran or waited for a core, at most 1: near 1, it
        always had Python to run, and only the host's cores kept it from using its GIL."""
        return min(1.0, (self.cpu_ns + self.wait_ns) / self.wall_ns) if self.wall_ns > 0 \
            else 0.0

    @property
    def cpu_per_request_ns(self) -> float | None:
        """The window's CPU time per served request (None: none served)."""
        return self.cpu_ns / self.requests if self.requests > 0 else None


def run_delay_ns(task_dir: str) -> int:
    """A process's threads' time spent runnable but not running (the host's run queue),
    summed, cumulative (``/proc/PID/task/*/schedstat``'s second field); 0 where it cannot be
    read (not Linux, no schedstats, the process gone). A thread that ends takes its share
    with it, so the sum can go back: an interval counts only what grew."""
    total = 0
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"{task_dir}/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return total


class CpuMeter:
    """A worker's CPU, window by window: two clock reads and a counter read per window.

    Args:
        served: the worker's cumulative count of requests served (its middleware's).
        cpu_clock: process CPU time in ns; clock: monotonic ns (injected by tests).
    """

    def __init__(self, served: Callable[[], int],
                 cpu_clock: Callable[[], int] = time.process_time_ns,
                 clock: Callable[[], int] = time.monotonic_ns) -> None:
        self._served = served
        self._cpu_clock = cpu_clock
        self._clock = clock
        self._last = (clock(), cpu_clock(), served())

    def window(self) -> CpuWindow:
        """The window since the last call (the first: since the meter was made)."""
        now, cpu, served = self._clock(), self._cpu_clock(), self._served()
        then, cpu_then, served_then = self._last
        self._last = (now, cpu, served)
        return CpuWindow(os.getpid(), max(0, cpu - cpu_then), max(0, now - then),
                         max(0, served - served_then))


@dataclass(frozen=True, slots=True)
class HostReading:
    """The host's CPU over an interval: the busy share of all its cores (0-1) and how many
    cores it has."""

    share: float
    cores: int


def parse_proc_stat(text: str) -> tuple[int, int, int]:
    """``(busy, total, cores)`` from ``/proc/stat``'s text: the aggregate ``cpu`` line's
    jiffies (busy: all but idle and iowait; guest time is already in user) and the number of
    ``cpuN`` lines.

    Raises:
        ValueError: no aggregate ``cpu`` line with at least four numbers.
    """
    busy = total = cores = 0
    found = False
    for line in text.splitlines():
        if line.startswith("cpu "):
            fields = [int(x) for x in line.split()[1:9]]
            if len(fields) < 4:
                raise ValueError(f"{PROC_STAT}: a cpu line with too few fields: {line!r}")
            idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
            total = sum(fields)
            busy = total - idle
            found = True
        elif line.startswith("cpu") and line[3:4].isdigit():
            cores += 1
    if not found:
        raise ValueError(f"{PROC_STAT}: no aggregate cpu line")
    return busy, total, max(1, cores)


class HostCpu:
    """The host's busy share since the last :meth:`read` (the master's, once a tick).

    Args:
        read_text: returns ``/proc/stat``'s text (injected by tests).
    """

    def __init__(self, read_text: Callable[[], str] | None = None) -> None:
        self._read_text = read_text or _read_proc_stat
        self._last: tuple[int, int] | None = None

    def read(self) -> HostReading | None:
        """The busy share of all cores since the last call; None on the first call, when the
        interval saw no jiffies, or where ``/proc/stat`` cannot be read (not Linux)."""
        try:
            busy, total, cores = parse_proc_stat(self._read_text())
        except (OSError, ValueError):
            return None
        last, self._last = self._last, (busy, total)
        if last is None or total <= last[1]:
            return None
        return HostReading(min(1.0, max(0.0, (busy - last[0]) / (total - last[1]))), cores)


def _read_proc_stat() -> str:
    with open(PROC_STAT, encoding="ascii") as f:
        return f.read()


@dataclass(frozen=True, slots=True)
class CpuState:
    """The server's CPU as one tick sees it: what the controller is fed (``sample``: the
    workers' CPU in cores, their CPU per request, the host's busy share and cores) and each
    worker's share of its GIL by pid (``shares``, for the metrics and the dump)."""

    sample: CpuSample
    windows: tuple[CpuWindow, ...]

    @property
    def shares(self) -> dict[int, float]:
        """Each worker's share of its GIL, by pid."""
        return {w.pid: w.share for w in self.windows}


def cpu_state(windows: Iterable[CpuWindow], host: HostReading | None) -> CpuState:
    """Fold the workers' last windows and the host's reading into a :class:`CpuState`."""
    counted = tuple(w for w in windows if w.wall_ns > 0)
    cpu = sum(w.cpu_ns for w in counted)
    requests = sum(w.requests for w in counted)
    sample = CpuSample(len(counted), sum(w.share for w in counted),
                       cpu / requests if requests else None,
                       None if host is None else host.share, 0 if host is None else host.cores,
                       wanted=sum(w.wanted for w in counted))
    return CpuState(sample, counted)


class CpuWatch:
    """The master's view of the CPU, shared by the controller, the metrics and the dump: the
    workers' last windows from the signals table; what the master reads itself, at most
    every ``min_interval_ns`` (so that a scrape between two ticks leaves the tick an interval
    to measure): the host's busy share since its previous ``/proc/stat`` reading, and each
    worker's threads' run-queue delay since the previous reading (``/proc/PID/task``: read by
    the master, so that the workers do nothing for it).

    Args:
        table: the signals table (``table.PoolTable``: ``cpu_rows``).
        host: the host's reader; clock: monotonic ns; run_delay: a pid's threads' cumulative
            run-queue delay in ns (injected by tests).
    """

    def __init__(self, table: Any, host: HostCpu | None = None,
                 clock: Callable[[], int] = time.monotonic_ns,
                 min_interval_ns: int = 500_000_000,
                 run_delay: Callable[[int], int] | None = None) -> None:
        self.table = table
        self.host = host or HostCpu()
        self.clock = clock
        self.min_interval_ns = min_interval_ns
        self._run_delay = run_delay or (lambda pid: run_delay_ns(f"/proc/{pid}/task"))
        self._host: HostReading | None = None
        self._at: int | None = None
        self._delays: dict[int, int] = {}  # pid -> cumulative run-queue delay at _at
        self._waiting: dict[int, float] = {}  # pid -> its share of the interval waiting
        self._lock = threading.Lock()

    def read(self, live: Collection[int] | None = None) -> CpuState:
        """The CPU now: the live workers' (by index) last windows, each with its run-queue
        share of the master's last interval, and the host's share."""
        now = self.clock()
        windows = self.table.cpu_rows(now, live=live)
        with self._lock:
            if self._at is None or now - self._at >= self.min_interval_ns:
                reading = self.host.read()
                if reading is not None or self._host is None:
                    self._host = reading
                elapsed = now - self._at if self._at is not None else 0
                delays = {w.pid: self._run_delay(w.pid) for w in windows}
                self._waiting = {
                    pid: max(0, d - self._delays[pid]) / elapsed for pid, d in delays.items()
                    if elapsed > 0 and pid in self._delays}
                self._delays, self._at = delays, now
            host, waiting = self._host, self._waiting
        return cpu_state([dataclasses.replace(w, wait_ns=int(waiting[w.pid] * w.wall_ns))
                          if w.pid in waiting else w for w in windows], host)
