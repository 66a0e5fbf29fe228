"""The worker's publisher: once a window, every pool's reading and the worker's CPU
(``cpu.py``) into the worker's row of the shared :class:`~.table.PoolTable`.

A daemon thread that wakes once a window (``WINDOW_S``): the only per-pool work a worker does
besides what the discovery measures at a wait, and none of it on a request's path; the CPU
costs two clock reads a window.

    publisher = Publisher(table.writer(index))
    publisher.start()          # admission/boot.py, once the app is loaded
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from apf_gunicorn.signals import pools
from apf_gunicorn.signals.cpu import CpuMeter
from apf_gunicorn.signals.pools import UNBOUNDED, PoolReading, log
from apf_gunicorn.signals.table import RowWriter

WINDOW_S = 1.0


class Publisher:
    """Publishes ``read()`` into ``writer`` every ``window_s`` seconds, on its own thread."""

    def __init__(self, writer: RowWriter, read: Callable[[], list[PoolReading]] | None = None,
                 window_s: float = WINDOW_S,
                 clock: Callable[[], int] = time.monotonic_ns, tell_found: bool = False,
                 cpu: CpuMeter | None = None) -> None:
        """``tell_found``: log each pool name the first time it is published (one worker
        does, so that the log says once what was found). ``cpu``: the worker's CPU meter,
        read once a window (None: no CPU published)."""
        self._cpu = cpu
        self._writer = writer
        self._tell_found = tell_found
        self._found: set[str] = set()
        self._read = read or pools.readings
        self.window_s = window_s
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._told: set[str] = set()

    def publish_once(self) -> list[PoolReading]:
        """Read every pool and publish the window now; returns the readings."""
        readings = self._read()
        cpu = self._cpu.window() if self._cpu is not None else None
        left_out = self._writer.publish(readings, self._clock(), cpu)
        if self._tell_found:
            for r in readings:
                if r.name not in self._found:
                    self._found.add(r.name)
                    log.info("apf: found pool %r (%s): capacity %s in this worker; published "
                             "server-wide as apf_pool_* and in dump_pools", r.name, r.kind,
                             "unbounded" if r.capacity == UNBOUNDED else r.capacity)
        for name in left_out:
            if name not in self._told:
                self._told.add(name)
                log.warning("apf: pool %r is not published: this worker already publishes "
                            "the table's maximum of pools", name)
        return readings

    def start(self) -> None:
        self.publish_once()
        self._thread = threading.Thread(target=self._run, name="apf-signals", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.window_s):
            try:
                self.publish_once()
            except Exception:  # keep publishing: one bad window is no reason to stop
                log.exception("apf: publishing the pools' window failed")
