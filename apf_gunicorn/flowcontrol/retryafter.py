"""The per-priority-level Retry-After tracker (Kubernetes ``droppedRequestsTracker``).

Each rejected request is recorded against its level at the current wall-clock Unix second;
the value to send in ``Retry-After`` starts at 1 s, doubles (up to 32 s) while a level keeps
rejecting at least ``3 x retryAfter`` requests per ``retryAfter`` seconds, and decays by 1 s per
rejection-second once fewer than ``retryAfter`` were rejected in the last window.

Server-wide, not per worker: Kubernetes has one tracker per API server; we have one per worker
process. Rather than record only its own rejections, each worker feeds its tracker the
**server-wide cumulative rejected count** of the level (the ledger's per-level ``rejected``
counter, which every process can read) with :meth:`RetryAfterTracker.observe_total`: the tracker
records the increase since the last observation as that many drops in the current second. So
every worker converges on the value a single tracker would compute, and a worker that rejects
rarely still answers with the back-off its siblings have built up.

    >>> t = RetryAfterTracker()
    >>> t.record("workload-low", 1_700_000_000, count=5)
    >>> t.record("workload-low", 1_700_000_001)
    >>> t.retry_after("workload-low"), t.retry_after("never-dropped")
    (2, 1)
"""

from __future__ import annotations

import os
import threading
import time

MAX_RETRY_AFTER = 32


class LevelTracker:
    """One level's state; not thread-safe on its own (the registry locks)."""

    __slots__ = ("history", "current_second", "current_count", "retry_after", "last_increase")

    def __init__(self) -> None:
        self.history: list[tuple[int, int]] = []  # completed seconds: (second, drops)
        self.current_second = 0
        self.current_count = 0
        self.retry_after = 1
        self.last_increase = 0

    def record(self, second: int, count: int = 1) -> None:
        """``count`` drops at ``second``, as ``count`` successive single records."""
        if count <= 0:
            return
        if second == self.current_second:
            self.current_count += count
            return
        # First drop in a new second: close the current one and re-evaluate.
        self.history.append((self.current_second, self.current_count))
        keep = min(2 * self.retry_after, MAX_RETRY_AFTER)
        old = self.current_second
        drop = 0
        while drop < len(self.history) and old - self.history[drop][0] > keep:
            drop += 1
        if drop:
            del self.history[:drop]
        self.current_second = second
        self.current_count = count
        dropped = 0
        for s, n in reversed(self.history):
            if second - s > self.retry_after:
                break
            if s < second:
                dropped += n
        if second - self.last_increase >= self.retry_after and dropped >= 3 * self.retry_after:
            self.retry_after = min(2 * self.retry_after, MAX_RETRY_AFTER)
            self.last_increase = second
        elif dropped < self.retry_after and self.retry_after > 1:
            self.retry_after -= 1


class RetryAfterTracker:
    """Thread-safe map of level name -> :class:`LevelTracker`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._levels: dict[str, LevelTracker] = {}
        self._totals: dict[str, int] = {}
        # a tracker built in the master and inherited by a forked worker must not carry a
        # lock some master thread held at fork time
        os.register_at_fork(after_in_child=self._reinit_lock)

    def _reinit_lock(self) -> None:
        self._lock = threading.Lock()

    def record(self, level: str, second: int | None = None, count: int = 1) -> None:
        """Record ``count`` drops of ``level`` at Unix ``second`` (default: now)."""
        if second is None:
            second = int(time.time())
        with self._lock:
            tr = self._levels.get(level)
            if tr is None:
                tr = self._levels[level] = LevelTracker()
            tr.record(second, count)

    def observe_total(self, level: str, total_rejected: int, second: int | None = None) -> int:
        """Feed the level's server-wide cumulative rejected count; records the increase since
        the previous observation and returns the resulting Retry-After. A smaller total than
        before (the level was dropped and re-created) restarts the baseline."""
        if second is None:
            second = int(time.time())
        with self._lock:
            prev = self._totals.get(level)
            self._totals[level] = total_rejected
            if prev is None:
                # first sight in this process: count this rejection only, not the history
                delta = 1 if total_rejected > 0 else 0
            elif total_rejected >= prev:
                delta = total_rejected - prev
            else:
                delta = total_rejected
            tr = self._levels.get(level)
            if tr is None:
                tr = self._levels[level] = LevelTracker()
            tr.record(second, delta)
            return tr.retry_after

    def retry_after(self, level: str) -> int:
        """Seconds for the ``Retry-After`` header: 1 for a level that never dropped."""
        tr = self._levels.get(level)
        return tr.retry_after if tr is not None else 1

    def forget(self, level: str) -> None:
        """Drop a level that no longer exists."""
        with self._lock:
            self._levels.pop(level, None)
            self._totals.pop(level, None)
