"""A discrete-event loop over a virtual clock in integer nanoseconds.

Kubernetes' fake event clock runs every event due at the same instant concurrently, in no fixed
order; we pick one deterministic order (scheduling order) so runs are reproducible::

    >>> loop = EventLoop()
    >>> seen = []
    >>> loop.at(5, lambda: seen.append(loop.now))
    >>> loop.run_until(10); seen, loop.now
    ([5], 10)

Callbacks may schedule more events; an event scheduled in the past runs at the current time
(like Go's ``EventAfterDuration`` with a negative duration).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable


class EventLoop:
    __slots__ = ("now", "_heap", "_seq", "events_run")

    def __init__(self, start_ns: int = 0) -> None:
        self.now = start_ns
        self._heap: list[tuple[int, int, Callable[[], object]]] = []
        self._seq = 0
        self.events_run = 0

    def at(self, when_ns: int, fn: Callable[[], object]) -> None:
        """Run ``fn()`` at virtual time ``when_ns`` (or now, if that is in the past)."""
        self._seq += 1
        heapq.heappush(self._heap, (max(when_ns, self.now), self._seq, fn))

    def after(self, delay_ns: int, fn: Callable[[], object]) -> None:
        self.at(self.now + delay_ns, fn)

    def run_until(self, limit_ns: int) -> None:
        """Run every event due at or before ``limit_ns``, then set the clock to ``limit_ns``."""
        heap = self._heap
        while heap and heap[0][0] <= limit_ns:
            when, _, fn = heapq.heappop(heap)
            self.now = when
            self.events_run += 1
            fn()
        self.now = max(self.now, limit_ns)

    def run(self) -> None:
        """Run until no event is left."""
        heap = self._heap
        while heap:
            when, _, fn = heapq.heappop(heap)
            self.now = when
            self.events_run += 1
            fn()

    def __len__(self) -> int:
        return len(self._heap)
