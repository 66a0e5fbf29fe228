"""Service time per route, for ``APF_CONCURRENCY_LIMIT=auto``: kinds of request finer than a
FlowSchema.

The adaptive controller compares each kind of request with its own no-load latency
(``control/adaptive.py``). A FlowSchema can hold routes of very different cost (a 2 ms
``GET /`` and a 200 ms ``/slow``): its mean service time then swings with the mix of the
requests that finished in a tick, and the controller would read a mix for overload. So with
``auto`` every worker also counts, per route, how many requests finished and their summed
service time (dispatch to the end of the response), and the master's tick reads those as the
kinds.

A route is the request's path with every segment that holds a digit replaced by ``*``
(``/items/42`` and ``/items/43`` are one route), within its priority level and FlowSchema. The
table lives in an anonymous shared mapping the master creates before it forks the workers:
one row per worker index (a worker writes only its own row), ``SLOTS`` slots per row, a route
hashed to a slot (two routes in one slot are one kind: the table stays small and bounded
whatever the paths). The two words of a slot are written without a lock: threads of one
worker may, rarely, lose an increment to each other; the signal is a ratio over a second of
requests, which such a loss does not move. Exempt requests are not counted (the limit does
not bind them). Each slot also keeps the name of the first route hashed to it (level,
FlowSchema, route: the labels of ``apf_adaptive_baseline_seconds``).

    table = RouteTimes.create(rows=64)                 # master, before forking
    offset = table.offset(row, level, fs, path)        # worker, once per request shape
    table.words[offset] += 1; table.words[offset + 1] += service_ns   # per request
    totals = table.totals()                            # master: {slot: (count, ns)}
    level, flow_schema, route = table.label(slot)
"""

from __future__ import annotations

import mmap

SLOTS = 256  # route slots per worker row
NAME_BYTES = 160  # per slot: "level\0flow schema\0route", UTF-8, truncated
_WORD = 8


def route_shape(path: str) -> str:
    """The route of ``path``: every segment holding a digit becomes ``*``."""
    if not any(ch.isdigit() for ch in path):
        return path
    return "/".join("*" if any(ch.isdigit() for ch in seg) else seg for seg in path.split("/"))


class RouteTimes:
    """The per-worker, per-route counters: ``words`` is an int64 view of rows x SLOTS x
    (count, service ns)."""

    def __init__(self, mm: mmap.mmap, rows: int) -> None:
        self._mmap = mm
        self.rows = rows
        counters = rows * SLOTS * 2 * _WORD
        self.words = memoryview(mm)[:counters].cast("q")
        self._names = memoryview(mm)[counters:]

    @classmethod
    def create(cls, rows: int) -> RouteTimes:
        """A zeroed table in an anonymous shared mapping (inherited by forked workers).

        Args:
            rows: worker indexes to provide for (the ledger's worker table size).
        """
        size = rows * SLOTS * 2 * _WORD + SLOTS * NAME_BYTES
        mm = mmap.mmap(-1, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return cls(mm, rows)

    def offset(self, row: int, level: str, flow_schema: str, path: str) -> int:
        """The word offset of the count of ``path``'s route in worker ``row``'s row (the
        service time is the next word); -1 when ``row`` is past the table."""
        if not 0 <= row < self.rows:
            return -1
        route = route_shape(path)
        slot = hash((level, flow_schema, route)) % SLOTS
        at = slot * NAME_BYTES
        if not self._names[at]:  # the first route of the slot names it
            name = "\0".join((level, flow_schema, route)).encode("utf-8", "replace")
            name = name[:NAME_BYTES - 1]
            self._names[at + 1: at + 1 + len(name)] = name
            self._names[at] = len(name)  # written last: a reader sees a whole name or none
        return (row * SLOTS + slot) * 2

    def label(self, slot: int) -> tuple[str, str, str]:
        """``(level, flow schema, route)`` of the first route counted in ``slot``."""
        at = slot * NAME_BYTES
        n = self._names[at]
        parts = bytes(self._names[at + 1: at + 1 + n]).decode("utf-8", "replace").split("\0")
        parts += [""] * (3 - len(parts))
        return parts[0], parts[1], parts[2]

    def totals(self) -> dict[int, tuple[int, int]]:
        """Per slot used so far, summed over the workers: ``(finished, service ns)``, both
        cumulative."""
        words = self.words.tolist()
        counts = [0] * SLOTS
        sums = [0] * SLOTS
        for row in range(self.rows):
            base = row * SLOTS * 2
            part = words[base: base + SLOTS * 2]
            if not any(part):
                continue
            for slot in range(SLOTS):
                n = part[2 * slot]
                if n:
                    counts[slot] += n
                    sums[slot] += part[2 * slot + 1]
        return {slot: (counts[slot], sums[slot]) for slot in range(SLOTS) if counts[slot]}
