"""asyncpg's own pool (``asyncpg.create_pool``, ``asyncpg.Pool``), found with no code in the app.

asyncpg has no statistics API, so, as for SQLAlchemy's pools, the waiting is measured where it
happens, and the rest is read once a window:

- capacity: ``max_size`` (``pool.get_max_size()``);
- in use: connections handed out, ``max_size`` less the holders in the pool's queue (a holder
  leaves the queue when acquired, including one whose connection is being opened, and comes
  back once released and reset);
- waiting and time waited: measured around ``Pool._acquire``, the one method every acquire
  goes through (``pool.acquire()`` awaited or as ``async with``, and ``pool.fetch()``,
  ``execute()``... through it). An acquire counts as a wait when, as it starts, the pool's
  queue of free holders is empty (every connection is out: ``Pool._acquire`` then awaits the
  queue); its time is then measured with two clock reads, up to the connection in hand (so it
  includes opening a connection the pool had closed, if the freed one needs that). An acquire
  that does not wait costs one more coroutine call, an attribute lookup and that test.

Found when the pool is initialised (``await asyncpg.create_pool(...)``, ``await pool``, ``async
with pool``): ``Pool._async__init__`` is wrapped to register it. Not at construction, as
psycopg_pool's are: an asyncpg ``Pool`` cannot be weakly referenced (``__slots__`` without
``__weakref__``), and holding it strongly would keep alive a pool the app dropped. Once
initialised it has its connection holders, which can be weakly referenced and each hold the
pool; the registry holds the first one weakly, so the pool is forgotten with it. A pool not
initialised yet, closing or closed is not counted. A pool initialised before the discovery was
installed is found at its first wait.

Naming: ``asyncpg://host:port/database`` of its DSN and keyword arguments (no user, no
password), or ``asyncpg`` when it connects through a ``connect=`` function of the app's.

Internals used (checked at install: an asyncpg without them leaves its pools out, logged once):
``Pool._acquire``, ``Pool._async__init__``, ``Pool._queue``, ``Pool._holders``.
"""

from __future__ import annotations

import time
import weakref
from typing import Any
from urllib.parse import urlsplit

from apf_gunicorn.signals.pools import REGISTRY, PoolReading, Probe, log

# a pool's first connection holder (its anchor: weakly referenced, holds the pool) -> its probe
_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_INTERNALS = ("_acquire", "_async__init__", "_queue", "_holders")
_warned = False


def pool_name(pool: Any) -> str:
    """``asyncpg://host:port/database`` of the pool's connection arguments, without user or
    password; ``asyncpg`` if they name neither host nor database."""
    args = getattr(pool, "_connect_args", ()) or ()
    kwargs = getattr(pool, "_connect_kwargs", None) or {}
    dsn = args[0] if args else kwargs.get("dsn")
    host = port = database = None
    if isinstance(dsn, str) and "://" in dsn:
        parts = urlsplit(dsn)
        try:
            host, port = parts.hostname, parts.port
        except ValueError:  # several hosts, or a port that is not a number: as given
            host = parts.netloc.rpartition("@")[2]
        database = parts.path.lstrip("/") or None
    host = kwargs.get("host", host)
    port = kwargs.get("port", port)
    database = kwargs.get("database", database)
    if isinstance(host, (list, tuple)):
        host = ",".join(map(str, host))
    if isinstance(port, (list, tuple)):
        port = ",".join(map(str, port))
    if not host and not database:
        return "asyncpg"
    where = f"{host or ''}:{port}" if port else f"{host or ''}"
    return f"asyncpg://{where}/{database or ''}"


def adopt(pool: Any) -> Probe | None:
    """Register an initialised ``pool`` (once) and return its probe; None before it has its
    connection holders."""
    holders = pool._holders
    if not holders:
        return None
    anchor = holders[0]
    probe = _PROBES.get(anchor)
    if probe is None:
        probe = _PROBES.setdefault(anchor, Probe(pool_name(pool)))
        REGISTRY.add(anchor, read_anchor)
    return probe


def read_anchor(anchor: Any) -> PoolReading | None:
    """The reading of the pool ``anchor`` (its first connection holder) belongs to; None
    while it is not initialised, or once it is closing or closed."""
    pool = anchor._pool
    queue = pool._queue
    if queue is None or pool.is_closing():
        return None
    probe = _PROBES.get(anchor)
    if probe is None:
        return None
    capacity = int(pool.get_max_size())
    waiting, wait_ns, waits = probe.snapshot()
    return PoolReading(name=probe.name, kind="asyncpg", capacity=capacity,
                       in_use=max(0, capacity - queue.qsize()), waiting=waiting,
                       wait_ns=wait_ns, waits=waits)


def install() -> bool:
    """Wrap ``asyncpg.pool.Pool``'s ``_async__init__`` and ``_acquire`` (once per process;
    asyncpg must be imported). Returns whether its pools are watched."""
    global _warned
    try:
        from asyncpg.pool import Pool
    except ImportError:
        return False
    if getattr(Pool._acquire, "_apf_wrapped", False):
        return True
    missing = [n for n in _INTERNALS if not hasattr(Pool, n)]
    if missing:
        if not _warned:
            _warned = True
            log.warning("apf: this asyncpg's Pool has no %s: its pools are not read",
                        ", ".join(missing))
        return False
    Pool._async__init__ = _wrap_init(Pool._async__init__)
    Pool._acquire = _wrap_acquire(Pool._acquire)
    return True


def _wrap_init(orig):
    async def _async__init__(self, _orig=orig):
        result = await _orig(self)
        try:
            adopt(self)
        except Exception:  # never fail the app's create_pool
            log.debug("apf: could not register an asyncpg pool", exc_info=True)
        return result

    _async__init__.__wrapped__ = orig
    return _async__init__


def _wrap_acquire(orig):
    async def _acquire(self, timeout, _orig=orig, _now=time.monotonic_ns, _adopt=adopt):
        queue = self._queue
        if queue is None or not queue.empty():
            return await _orig(self, timeout)
        # every connection is out: Pool._acquire awaits the queue for a freed one
        holders = self._holders
        probe = (_PROBES.get(holders[0]) if holders else None) or _adopt(self)
        if probe is None:
            return await _orig(self, timeout)
        probe.begin()
        start = _now()
        try:
            return await _orig(self, timeout)
        finally:
            probe.end(_now() - start)

    _acquire._apf_wrapped = True
    _acquire.__wrapped__ = orig
    return _acquire
