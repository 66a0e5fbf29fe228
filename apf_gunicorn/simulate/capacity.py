"""Backends whose service time depends on concurrency: what executing requests share in the app.

The ledger decides when a request starts executing; inside the app it then needs the real
bottleneck, modelled here in the simulator's virtual time (``scenario.backend``):

* :class:`ConnectionPool`: N connections; a request holds one for its work and waits for one
  (first come, first served) when all are taken, so its service time is wait + work;
* :class:`SharedCores`: K cores shared by the running requests (processor sharing: each
  progresses at ``min(1, K / running)`` of its CPU demand); with W workers, each request runs
  in one worker process (chosen at random, seeded), and a process runs Python one request at a
  time (the GIL), the busy processes sharing the K cores.

Both take their capacity from :meth:`set_capacity` at any time (a scripted drop of the pool)::

    pool = ConnectionPool(loop, 8)
    pool.begin(50_000_000, on_done)    # on_done() once the request has had its connection
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable

from .engine import EventLoop
from .scenario import BackendSpec

Done = Callable[[], None]


class ConnectionPool:
    """``size`` connections handed out first come, first served."""

    def __init__(self, loop: EventLoop, size: int) -> None:
        self.loop = loop
        self.size = size
        self.in_use = 0
        self._waiting: deque[tuple[int, Done]] = deque()

    def begin(self, work_ns: int, done: Done) -> None:
        """Run ``work_ns`` of work holding a connection; ``done()`` when it is released."""
        if self.in_use < self.size and not self._waiting:
            self._hold(work_ns, done)
        else:
            self._waiting.append((work_ns, done))

    def _hold(self, work_ns: int, done: Done) -> None:
        self.in_use += 1
        self.loop.after(work_ns, lambda: self._release(done))

    def _release(self, done: Done) -> None:
        self.in_use -= 1
        self._grant()  # the next waiter first: a request finishing may bring a new one
        done()

    def _grant(self) -> None:
        while self._waiting and self.in_use < self.size:
            self._hold(*self._waiting.popleft())

    def set_capacity(self, size: int) -> None:
        """Resize the pool; connections above a smaller size are returned as they free."""
        self.size = size
        self._grant()


class SharedCores:
    """``cores`` cores shared by the running requests, optionally behind ``workers`` GILs."""

    def __init__(self, loop: EventLoop, cores: int, workers: int = 0, seed: int = 1) -> None:
        self.loop = loop
        self.cores = cores
        self.workers = workers
        self._rng = random.Random(seed)
        self._running: dict[int, list] = {}  # id -> [remaining ns (float), worker, done]
        self._next_id = 0
        self._last = loop.now
        self._token = 0

    def begin(self, work_ns: int, done: Done) -> None:
        """Run ``work_ns`` of CPU demand; ``done()`` when it is complete."""
        self._advance()
        worker = self._rng.randrange(self.workers) if self.workers else 0
        self._next_id += 1
        self._running[self._next_id] = [float(work_ns), worker, done]
        self._schedule()

    def set_capacity(self, cores: int) -> None:
        """Change the number of cores from now on."""
        self._advance()
        self.cores = cores
        self._schedule()

    def _rates(self) -> dict[int, float]:
        """Each running request's progress per ns of time."""
        running = self._running
        if not running:
            return {}
        if not self.workers:
            rate = min(1.0, self.cores / len(running))
            return dict.fromkeys(running, rate)
        per_worker: dict[int, int] = {}
        for _rem, worker, _done in running.values():
            per_worker[worker] = per_worker.get(worker, 0) + 1
        share = min(1.0, self.cores / len(per_worker))  # one GIL each, the cores shared
        return {rid: share / per_worker[entry[1]] for rid, entry in running.items()}

    def _advance(self) -> None:
        now = self.loop.now
        dt = now - self._last
        self._last = now
        if dt <= 0:
            return
        for rid, rate in self._rates().items():
            self._running[rid][0] -= rate * dt

    def _schedule(self) -> None:
        self._token += 1
        rates = self._rates()
        if not rates:
            return
        wait = min(max(self._running[rid][0], 0.0) / rate for rid, rate in rates.items())
        token = self._token
        self.loop.at(self.loop.now + math.ceil(wait), lambda: self._complete(token))

    def _complete(self, token: int) -> None:
        if token != self._token:
            return  # superseded by a later arrival or change
        self._advance()
        finished = [rid for rid, entry in self._running.items() if entry[0] <= 0.5]
        dones = [self._running.pop(rid)[2] for rid in finished]
        self._schedule()
        for done in dones:
            done()


def build(loop: EventLoop, spec: BackendSpec) -> ConnectionPool | SharedCores:
    """The model of ``spec``, with its capacity changes scheduled on ``loop``."""
    model: ConnectionPool | SharedCores
    if spec.kind == "pool":
        model = ConnectionPool(loop, spec.capacity)
    else:
        model = SharedCores(loop, spec.capacity, spec.workers, spec.seed)
    for at, capacity in spec.changes:
        loop.at(at, lambda c=capacity: model.set_capacity(c))
    return model
