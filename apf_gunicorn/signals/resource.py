"""Any other bounded resource the app acquires, in one line: a measured, fair semaphore.

For a resource the server cannot find by itself (a Redis pool, an HTTP client's connection
limit, a semaphore of the app's own), bound it with a :class:`Resource` of its capacity and
acquire that around each use; the signals then see its capacity, units in use, requests
waiting and time waited, like a connection pool's::

    import apf_gunicorn

    redis_slots = apf_gunicorn.resource("redis", capacity=10)   # module level, once

    with redis_slots:              # threads (WSGI)
        r.get("key")

    async with redis_slots:        # an event loop (ASGI)
        await r.get("key")

    @redis_slots                   # a function or a coroutine function
    def lookup(key): ...

Acquiring blocks (or awaits) while ``capacity`` units are out, first come first served across
threads and event loops; give the resource a capacity no larger than the underlying one's, so
the waiting happens here where it is seen. An uncontended acquire and release cost a lock
taken twice; a wait adds two clock reads. Outside an apf_gunicorn worker it works the same and
nothing is published.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from apf_gunicorn.signals.pools import REGISTRY, PoolReading

if TYPE_CHECKING:
    import asyncio


class Resource:
    """A bounded, measured semaphore named for the signals (see the module docstring)."""

    def __init__(self, name: str, capacity: int) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"resource name must be a non-empty string, not {name!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"resource {name!r}: capacity must be an integer >= 1, "
                             f"not {capacity!r}")
        self.name = name
        self.capacity = capacity
        self._lock = threading.Lock()
        self._in_use = 0
        # FIFO of waiters: a locked threading.Lock (a thread) or (loop, future) (a task);
        # release hands its unit to the first one directly
        self._waiters: deque = deque()
        self._wait_ns = 0
        self._waits = 0

    # -- threads --------------------------------------------------------------------------

    def acquire(self, timeout: float | None = None) -> bool:
        """Take a unit, waiting up to ``timeout`` seconds (None: as long as it takes).
        Returns False if none came in time."""
        with self._lock:
            if self._in_use < self.capacity and not self._waiters:
                self._in_use += 1
                return True
            waiter = threading.Lock()
            waiter.acquire()
            self._waiters.append(waiter)
        start = time.monotonic_ns()
        got = waiter.acquire(timeout=-1 if timeout is None else max(0.0, timeout))
        with self._lock:
            self._account(start)
            if not got:
                try:
                    self._waiters.remove(waiter)
                except ValueError:  # a release handed us the unit as the time ran out
                    got = True
        return got

    def release(self) -> None:
        """Give a unit back (to the first waiter, if any)."""
        with self._lock:
            if self._waiters:
                waiter = self._waiters.popleft()  # the unit passes on: in use is unchanged
                if isinstance(waiter, tuple):
                    loop, future = waiter
                    loop.call_soon_threadsafe(_resolve, future)
                else:
                    waiter.release()
                return
            if self._in_use <= 0:
                raise RuntimeError(f"resource {self.name!r} released more times than acquired")
            self._in_use -= 1

    def __enter__(self) -> Resource:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # -- event loops ----------------------------------------------------------------------

    async def acquire_async(self) -> None:
        """Take a unit, awaiting one while none is free."""
        import asyncio  # here: importing apf_gunicorn must not cost asyncio's import

        with self._lock:
            if self._in_use < self.capacity and not self._waiters:
                self._in_use += 1
                return
            loop = asyncio.get_running_loop()
            future = loop.create_future()
            entry = (loop, future)
            self._waiters.append(entry)
        start = time.monotonic_ns()
        try:
            await future
        except BaseException:
            with self._lock:
                try:
                    self._waiters.remove(entry)
                    handed = False
                except ValueError:
                    handed = True
            if handed:  # the unit came as we were cancelled: pass it on
                self.release()
            raise
        finally:
            with self._lock:
                self._account(start)

    async def __aenter__(self) -> Resource:
        await self.acquire_async()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.release()

    # -- decorator ------------------------------------------------------------------------

    def __call__(self, fn):
        """Hold a unit for each call of ``fn`` (a function or a coroutine function)."""
        import inspect

        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def run_async(*args, **kwargs):
                async with self:
                    return await fn(*args, **kwargs)
            return run_async

        @functools.wraps(fn)
        def run(*args, **kwargs):
            with self:
                return fn(*args, **kwargs)
        return run

    # -- signals --------------------------------------------------------------------------

    def _account(self, start: int) -> None:
        self._wait_ns += time.monotonic_ns() - start
        self._waits += 1

    def reading(self) -> PoolReading:
        """Capacity, units out, requests waiting and cumulative time waited now."""
        with self._lock:
            return PoolReading(name=self.name, kind="resource", capacity=self.capacity,
                               in_use=self._in_use, waiting=len(self._waiters),
                               wait_ns=self._wait_ns, waits=self._waits)

    def __repr__(self) -> str:
        return f"<Resource {self.name!r} capacity={self.capacity}>"


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def resource(name: str, capacity: int) -> Resource:
    """A :class:`Resource` named ``name`` of ``capacity`` units, published with this worker's
    pools (keep it: the signals hold it weakly).

    Raises:
        ValueError: an empty name, or a capacity that is not an integer >= 1.
    """
    res = Resource(name, capacity)
    REGISTRY.add(res, Resource.reading)
    return res
