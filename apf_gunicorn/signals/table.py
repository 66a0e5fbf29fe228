"""The shared table the workers publish their pools into, and the master's server-wide view.

An anonymous shared mapping the master creates before it forks the workers: one row per
worker index (a worker's publisher thread is the row's only writer), :data:`SLOTS` pool slots a
row, each slot a name and six int64 words. No lock: each row carries a sequence word (odd while
its writer is in the middle of a window, bumped again at the end) that a reader checks before
and after copying the row, and a stamp (the window's ``monotonic_ns``).

Per row, besides: the worker's CPU over the window (``cpu.py``: its pid, process CPU time,
the window's wall time and the requests it served), so that one mechanism carries every
signal. Per slot: kind, capacity, in use, waiting (as of the row's window) and, cumulative,
time waited (ns) and waits. The cumulative words are the row's, not the worker's: a worker adds what its
pools counted since its last window, so a worker that replaces a dead one on its index goes on
from its predecessor's totals (matched by pool name), and the server-wide sums never go
backwards. A slot is given up only by a name that has no waits to keep (when the row is
full). Gauges (capacity, in use, waiting) count only from rows published within
``max_age_ns``: a dead or stuck worker's pools drop out.

    table = PoolTable.create(rows=64)               # master, before forking
    writer = table.writer(row)                      # worker
    writer.publish(readings, now_ns)                # once a window
    table.totals(now_ns)                            # master: {name: PoolTotals}
    table.cpu_rows(now_ns)                          # master: [CpuWindow] of the fresh rows
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from apf_gunicorn.signals.cpu import CpuWindow
from apf_gunicorn.signals.pools import UNBOUNDED, PoolReading

SLOTS = 16  # pools per worker row
NAME_BYTES = 128  # per slot: length byte + UTF-8 name, truncated
_WORDS = 6  # kind, capacity, in use, waiting, wait ns, waits
_SLOT = NAME_BYTES + _WORDS * 8
_HEADER = 48  # seq, stamp, then the CPU window: pid, cpu ns, wall ns, requests
_CPU_AT = 16
_ROW = _HEADER + SLOTS * _SLOT
KINDS = ("", "sqlalchemy", "psycopg_pool", "django", "resource", "asyncpg")
_WINDOW_NS = 1_000_000_000
#: gauges count from rows published within this (five windows of the publisher)
MAX_AGE_NS = 5 * _WINDOW_NS
_RETRIES = 8


@dataclass
class PoolTotals:
    """One pool name summed over the workers. ``capacity`` is :data:`UNBOUNDED` when any
    worker's pool of that name is."""

    name: str
    kind: str
    capacity: int = 0
    in_use: int = 0
    waiting: int = 0
    wait_ns: int = 0  # cumulative, all rows
    waits: int = 0  # cumulative, all rows
    workers: int = 0  # fresh rows that have it

    @property
    def wait_seconds(self) -> float:
        return self.wait_ns / 1e9


class PoolTable:
    """Rows of pool slots in a shared mapping (see the module docstring)."""

    def __init__(self, buf: mmap.mmap | bytearray, rows: int) -> None:
        self._buf = buf
        self.rows = rows
        self._view = memoryview(buf)

    @classmethod
    def create(cls, rows: int) -> PoolTable:
        """A zeroed table in an anonymous shared mapping (inherited by forked workers).

        Args:
            rows: worker indexes to provide for (the ledger's worker table size).
        """
        if rows < 1:
            raise ValueError(f"a pool table needs at least one row, not {rows}")
        mm = mmap.mmap(-1, rows * _ROW, flags=mmap.MAP_SHARED,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return cls(mm, rows)

    def writer(self, row: int) -> RowWriter:
        """The writer of worker ``row``'s row."""
        if not 0 <= row < self.rows:
            raise ValueError(f"row {row} is outside the pool table's {self.rows} rows")
        return RowWriter(self._view[row * _ROW:(row + 1) * _ROW])

    def _copy(self, row: int, size: int = _ROW) -> bytes | None:
        """A consistent copy of the first ``size`` bytes of a row (None: never published, or
        no consistent copy within a few tries)."""
        view = self._view[row * _ROW:row * _ROW + size]
        for _ in range(_RETRIES):
            seq = struct.unpack_from("<q", view, 0)[0]
            if seq == 0:
                return None
            if seq & 1:
                continue
            data = bytes(view)
            if struct.unpack_from("<q", view, 0)[0] != seq:
                continue
            return data
        return None

    def read_row(self, row: int) -> tuple[int, list[tuple[str, tuple[int, ...]]]] | None:
        """``(stamp_ns, [(name, (kind, capacity, in_use, waiting, wait_ns, waits)), ...])``
        of a row, consistent (or None: never published, or no consistent copy)."""
        data = self._copy(row)
        if data is None:
            return None
        stamp = struct.unpack_from("<q", data, 8)[0]
        slots = []
        for i in range(SLOTS):
            at = _HEADER + i * _SLOT
            n = data[at]
            if not n:
                continue
            name = data[at + 1:at + 1 + n].decode("utf-8", "replace")
            slots.append((name, struct.unpack_from(f"<{_WORDS}q", data, at + NAME_BYTES)))
        return stamp, slots

    def cpu_rows(self, now_ns: int, live: Collection[int] | None = None,
                 max_age_ns: int = MAX_AGE_NS) -> list[CpuWindow]:
        """The last CPU window of every fresh row (published within ``max_age_ns`` of
        ``now_ns`` and, when ``live`` is given, of a worker index in it)."""
        out = []
        for row in range(self.rows):
            if live is not None and row not in live:
                continue
            data = self._copy(row, _HEADER)
            if data is None:
                continue
            stamp, pid, cpu_ns, wall_ns, requests = struct.unpack_from("<5q", data, 8)
            if now_ns - stamp <= max_age_ns and pid and wall_ns > 0:
                out.append(CpuWindow(pid, cpu_ns, wall_ns, requests))
        return out

    def totals(self, now_ns: int, live: Collection[int] | None = None,
               max_age_ns: int = MAX_AGE_NS) -> dict[str, PoolTotals]:
        """Each pool name summed over the rows: gauges from the fresh rows (published within
        ``max_age_ns`` of ``now_ns`` and, when ``live`` is given, of a worker index in it),
        the cumulative waits from every row."""
        out: dict[str, PoolTotals] = {}
        for row in range(self.rows):
            got = self.read_row(row)
            if got is None:
                continue
            stamp, slots = got
            fresh = now_ns - stamp <= max_age_ns and (live is None or row in live)
            for name, (kind, capacity, in_use, waiting, wait_ns, waits) in slots:
                t = out.get(name)
                if t is None:
                    t = out[name] = PoolTotals(name, KINDS[kind] if 0 <= kind < len(KINDS)
                                               else "")
                t.wait_ns += wait_ns
                t.waits += waits
                if fresh and capacity != 0:
                    t.workers += 1
                    if capacity == UNBOUNDED or t.capacity == UNBOUNDED:
                        t.capacity = UNBOUNDED
                    else:
                        t.capacity += capacity
                    t.in_use += in_use
                    t.waiting += waiting
        return out


class RowWriter:
    """A worker's side of its row: publishes a window's readings."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._last: dict[tuple[str, int], tuple[int, int]] = {}  # (name, id) -> cumulatives

    def _slots(self) -> dict[str, int]:
        v = self._view
        out = {}
        for i in range(SLOTS):
            at = _HEADER + i * _SLOT
            n = v[at]
            if n:
                out.setdefault(bytes(v[at + 1:at + 1 + n]).decode("utf-8", "replace"), i)
        return out

    def publish(self, readings: Iterable[PoolReading], now_ns: int,
                cpu: CpuWindow | None = None) -> list[str]:
        """Write one window: each name's gauges (summed over this worker's pools of that
        name), the waits counted since the last window added to the row's totals; a name
        published before and not now keeps its totals with its gauges at 0; the worker's CPU
        over the window.

        Args:
            readings: this window's readings.
            now_ns: the window's stamp (``time.monotonic_ns()``).
            cpu: the worker's CPU window (None: none, the row says pid 0).
        Returns:
            The names that found no free slot (left out).
        """
        gauges: dict[str, list[int]] = {}
        deltas: dict[str, list[int]] = {}
        last: dict[tuple[str, int], tuple[int, int]] = {}
        for r in readings:
            name = slot_name(r.name)
            g = gauges.get(name)
            if g is None:
                g = gauges[name] = [KINDS.index(r.kind) if r.kind in KINDS else 0, 0, 0, 0]
                deltas[name] = [0, 0]
            if r.capacity == UNBOUNDED or g[1] == UNBOUNDED:
                g[1] = UNBOUNDED
            else:
                g[1] += r.capacity
            g[2] += r.in_use
            g[3] += r.waiting
            key = (name, r.source)
            prev_ns, prev_n = self._last.get(key, (0, 0))
            d = deltas[name]
            # a pool's counters that went back (reset by the app) count from zero
            d[0] += r.wait_ns - prev_ns if r.wait_ns >= prev_ns else r.wait_ns
            d[1] += r.waits - prev_n if r.waits >= prev_n else r.waits
            last[key] = (r.wait_ns, r.waits)
        self._last = last

        v = self._view
        seq = struct.unpack_from("<q", v, 0)[0]
        seq += 1 if seq % 2 == 0 else 2  # odd: a window is being written
        struct.pack_into("<q", v, 0, seq)
        slots = self._slots()
        free = [i for i in range(SLOTS) if i not in slots.values()]
        if len(free) < len(gauges):
            # a name this worker no longer has, with no waits to keep, gives its slot up
            for name, i in list(slots.items()):
                at = _HEADER + i * _SLOT + NAME_BYTES
                if name not in gauges and not any(struct.unpack_from("<2q", v, at + 32)):
                    del slots[name]
                    v[_HEADER + i * _SLOT] = 0
                    free.append(i)
        left_out = []
        for name, g in gauges.items():
            i = slots.get(name)
            if i is None:
                if not free:
                    left_out.append(name)
                    continue
                i = free.pop(0)
                at = _HEADER + i * _SLOT
                raw = name.encode("utf-8")
                struct.pack_into(f"<{_WORDS}q", v, at + NAME_BYTES, *([0] * _WORDS))
                v[at + 1:at + 1 + len(raw)] = raw
                v[at] = len(raw)
                slots[name] = i
            at = _HEADER + i * _SLOT + NAME_BYTES
            old = struct.unpack_from(f"<{_WORDS}q", v, at)
            d = deltas[name]
            struct.pack_into(f"<{_WORDS}q", v, at, g[0], g[1], g[2], g[3], old[4] + d[0],
                             old[5] + d[1])
        for name, i in slots.items():
            if name not in gauges:  # gone from this worker: totals stay, gauges go
                at = _HEADER + i * _SLOT + NAME_BYTES
                old = struct.unpack_from(f"<{_WORDS}q", v, at)
                struct.pack_into(f"<{_WORDS}q", v, at, old[0], 0, 0, 0, old[4], old[5])
        struct.pack_into("<q", v, 8, now_ns)
        struct.pack_into("<4q", v, _CPU_AT, *(
            (cpu.pid, cpu.cpu_ns, cpu.wall_ns, cpu.requests) if cpu is not None
            else (0, 0, 0, 0)))
        struct.pack_into("<q", v, 0, seq + 1)  # even: the window is whole
        return left_out


def slot_name(name: str) -> str:
    """``name`` as a slot holds it: its UTF-8 cut to ``NAME_BYTES - 1`` bytes."""
    raw = name.encode("utf-8", "replace")
    if len(raw) < NAME_BYTES:
        return name
    return raw[:NAME_BYTES - 1].decode("utf-8", "ignore")
