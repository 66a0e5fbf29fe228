"""The worker's bounded resources (connection pools, the app's own resources) and how each is
read.

A discovery module registers each pool it finds with a reader; the publisher asks for every
live one's reading once a window. The registry holds the pools weakly: a pool the app drops is
forgotten with it.

    REGISTRY.add(pool, read_queue_pool)       # discovery, once per pool
    for reading in REGISTRY.readings(): ...   # the publisher, once a window
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("apf_gunicorn.signals")

#: a pool's capacity when nothing bounds it (SQLAlchemy's max_overflow=-1)
UNBOUNDED = -1


@dataclass(frozen=True)
class PoolReading:
    """One pool's state at a reading.

    Attributes:
        name: the pool's name, the same in every worker (summed per name server-wide).
        kind: where it comes from: ``sqlalchemy``, ``psycopg_pool``, ``django``, ``resource``.
        capacity: connections (or units) it can hand out at once; :data:`UNBOUNDED` if none.
        in_use: handed out now.
        waiting: requests waiting for one now.
        wait_ns: time spent waiting for one, cumulative since the pool was found.
        waits: acquisitions that had to wait, cumulative.
        source: which pool of the process it is (its id), to tell two pools of one name
            apart between windows.
    """

    name: str
    kind: str
    capacity: int
    in_use: int
    waiting: int
    wait_ns: int
    waits: int
    source: int = 0


Reader = Callable[[Any], "PoolReading | None"]


class Probe:
    """What a discovery measures around one pool's acquire path: requests waiting now and,
    cumulative, their time waited and how many waited. The lock is taken only by a wait
    (``+=`` from several threads would lose counts) and by a reading."""

    __slots__ = ("name", "lock", "waiting", "wait_ns", "waits")

    def __init__(self, name: str) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.waiting = 0
        self.wait_ns = 0
        self.waits = 0

    def begin(self) -> None:
        """A request starts waiting."""
        with self.lock:
            self.waiting += 1

    def end(self, waited_ns: int) -> None:
        """That request's wait ended (got one, timed out or was cancelled)."""
        with self.lock:
            self.waiting -= 1
            self.wait_ns += waited_ns
            self.waits += 1

    def snapshot(self) -> tuple[int, int, int]:
        """``(waiting, wait_ns, waits)`` now."""
        with self.lock:
            return self.waiting, self.wait_ns, self.waits


class Registry:
    """The pools found in this process, each with the function that reads it (None: not to
    count now, e.g. a closed pool)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[int, tuple[weakref.ref, Reader]] = {}

    def reinit_lock(self) -> None:
        """A new lock (in a forked child: its parent's may have been held by another
        thread, which the child does not have)."""
        self._lock = threading.Lock()

    def add(self, obj: Any, reader: Reader) -> None:
        """Register ``obj`` (held weakly) with ``reader``; a second add of it is a no-op."""
        key = id(obj)

        def forget(_ref: weakref.ref, key: int = key) -> None:
            with self._lock:
                item = self._items.get(key)
                if item is not None and item[0] is _ref:
                    del self._items[key]

        with self._lock:
            item = self._items.get(key)
            if item is not None and item[0]() is obj:
                return
            self._items[key] = (weakref.ref(obj, forget), reader)

    def __contains__(self, obj: Any) -> bool:
        item = self._items.get(id(obj))
        return item is not None and item[0]() is obj

    def readings(self, extra: Iterable[tuple[Any, Reader]] = ()) -> list[PoolReading]:
        """Every live pool's reading (and those of ``extra`` pairs not registered), in
        registration order. A reader that fails is logged once and skipped."""
        with self._lock:
            items = [(ref(), reader) for ref, reader in self._items.values()]
        seen = {id(obj) for obj, _ in items}
        items += [(obj, reader) for obj, reader in extra if id(obj) not in seen]
        out = []
        for obj, reader in items:
            if obj is None:
                continue
            try:
                reading = reader(obj)
            except Exception:  # a library's internals changed: say so once, keep serving
                _warn_once(reader, obj)
                continue
            if reading is not None:
                out.append(dataclasses.replace(reading, source=id(obj)))
        return out


_warned: set[str] = set()


def _warn_once(reader: Reader, obj: Any) -> None:
    what = f"{getattr(reader, '__qualname__', reader)} {type(obj).__name__}"
    if what not in _warned:
        _warned.add(what)
        log.warning("apf: reading %s failed; that pool is left out of the signals",
                    what, exc_info=True)


#: this process's registry
REGISTRY = Registry()
# a child the app forks (multiprocessing) while the publisher held the lock would otherwise
# hang at its first pool
os.register_at_fork(after_in_child=REGISTRY.reinit_lock)

#: discovery that yields pools at reading time rather than registering them (Django's pools
#: are listed by Django itself): functions returning ``(pool, reader)`` pairs
EXTRA_SOURCES: list[Callable[[], Iterable[tuple[Any, Reader]]]] = []


def readings() -> list[PoolReading]:
    """Every pool of this process, read now."""
    extra: list[tuple[Any, Reader]] = []
    for source in EXTRA_SOURCES:
        try:
            extra.extend(source())
        except Exception:
            _warn_once(source, None)
    return REGISTRY.readings(extra)
