"""SQLAlchemy's ``QueuePool`` (and its asyncio and subclass forms), found with no code in the app.

What is read, per pool:

- capacity: ``pool_size + max_overflow`` (unbounded when ``max_overflow=-1`` or
  ``pool_size=0``);
- in use: ``pool.checkedout()``, read once a window (nothing per checkout);
- waiting and time waited: measured around ``QueuePool._do_get``, the one method every
  checkout goes through and where the pool blocks when all its connections are out. A
  checkout counts as a wait when, as it starts, every connection is out and none can be made
  (the test ``_do_get`` itself makes before it blocks); its time is then measured with two
  clock reads. A checkout that does not wait costs one attribute lookup and that test.

SQLAlchemy's pool events are public but have no hook where a checkout *starts*, so they cannot
see waiting; hence ``_do_get`` (checked at install: a SQLAlchemy without it leaves pools out,
logged). Pools are found two ways: at ``Engine`` construction (so a pool is known, and its
capacity published, before its first checkout; named after the engine's URL) and at a pool's
first checkout (a pool made before the discovery was installed). ``engine.dispose()`` makes a
new pool with the old one's creator: the next reading finds it through the engine and names it
after the engine; the pool it replaced is no longer counted.

Naming: ``create_engine(..., pool_logging_name="db")`` names the pool ``db``; otherwise
``driver://host:port/database`` of its engine (no user, no password), or ``sqlalchemy`` for a
pool whose engine is unknown.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from apf_gunicorn.signals.pools import REGISTRY, UNBOUNDED, PoolReading, Probe, log

_PROBE = "_apf_probe"
# the pool's creator (kept across engine.dispose()) -> (name, weakref to its engine)
_BY_CREATOR: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def engine_name(url: Any) -> str:
    """``driver://host:port/database`` of a SQLAlchemy URL, without user or password."""
    host = url.host or ""
    if url.port:
        host = f"{host}:{url.port}"
    return f"{url.drivername}://{host}/{url.database or ''}"


def _name_of(pool: Any) -> str:
    logging_name = getattr(pool, "_orig_logging_name", None)
    if logging_name:
        return str(logging_name)
    owner = _owner(pool)
    return owner[0] if owner is not None else "sqlalchemy"


def _owner(pool: Any) -> tuple[str, weakref.ref] | None:
    try:
        return _BY_CREATOR.get(pool._creator)
    except TypeError:  # a creator that cannot be weakly referenced
        return None


def adopt(pool: Any) -> Probe:
    """Register ``pool`` (once) and return its probe."""
    probe = pool.__dict__.get(_PROBE)
    if probe is None:
        probe = pool.__dict__.setdefault(_PROBE, Probe(_name_of(pool)))
        REGISTRY.add(pool, read_pool)
    return probe


def capacity(pool: Any) -> int:
    """``pool_size + max_overflow``, or :data:`UNBOUNDED`."""
    size = pool.size()
    overflow = pool._max_overflow
    if overflow < 0 or size <= 0:
        return UNBOUNDED
    return size + overflow


def read_pool(pool: Any) -> PoolReading | None:
    """The pool's reading; once its engine has replaced it (``engine.dispose()``), the new
    pool's if not yet found, else None."""
    owner = _owner(pool)
    if owner is not None:
        engine = owner[1]()
        if engine is not None and engine.pool is not pool:
            current = engine.pool
            if current in REGISTRY or not hasattr(current, "_max_overflow"):
                return None
            adopt(current)  # found before its first checkout
            return read_pool(current)
    probe = adopt(pool)
    waiting, wait_ns, waits = probe.snapshot()
    return PoolReading(name=probe.name, kind="sqlalchemy", capacity=capacity(pool),
                       in_use=max(0, pool.checkedout()), waiting=waiting, wait_ns=wait_ns,
                       waits=waits)


def install() -> bool:
    """Wrap ``QueuePool._do_get`` and ``Engine.__init__`` (once per process; SQLAlchemy must
    be imported). Returns whether the pools are watched."""
    try:
        from sqlalchemy.engine.base import Engine
        from sqlalchemy.pool import QueuePool
    except ImportError:
        return False
    if getattr(QueuePool._do_get, "_apf_wrapped", False):
        return True
    if not callable(getattr(QueuePool, "_do_get", None)):
        log.warning("apf: this SQLAlchemy's QueuePool has no _do_get: its pools are not read")
        return False
    QueuePool._do_get = _wrap_do_get(QueuePool._do_get)
    Engine.__init__ = _wrap_engine_init(Engine.__init__)
    return True


def _wrap_do_get(orig):
    def _do_get(self, _orig=orig, _now=time.monotonic_ns, _adopt=adopt):
        probe = self.__dict__.get(_PROBE) or _adopt(self)
        if (self._max_overflow > -1 and self._overflow >= self._max_overflow
                and self._pool.empty()):
            # every connection is out and none can be made: QueuePool blocks for one
            probe.begin()
            start = _now()
            try:
                return _orig(self)
            finally:
                probe.end(_now() - start)
        return _orig(self)

    _do_get._apf_wrapped = True
    _do_get.__wrapped__ = orig
    return _do_get


def _wrap_engine_init(orig):
    def __init__(self, *args, _orig=orig, **kwargs):
        _orig(self, *args, **kwargs)
        try:
            _engine_made(self)
        except Exception:  # never fail the app's create_engine
            log.debug("apf: could not register an engine's pool", exc_info=True)

    __init__.__wrapped__ = orig
    return __init__


def _engine_made(engine: Any) -> None:
    from sqlalchemy.pool import QueuePool

    pool = engine.pool
    if not isinstance(pool, QueuePool):
        return
    try:
        _BY_CREATOR[pool._creator] = (engine_name(engine.url), weakref.ref(engine))
    except TypeError:
        pass
    adopt(pool)
