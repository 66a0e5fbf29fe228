"""psycopg_pool's pools (``ConnectionPool``, ``AsyncConnectionPool``, the null pools), and
Django 5.1+'s pool, which is one of them, found with no code in the app.

A pool is found when it is constructed: ``BasePool.__init__`` (every psycopg_pool pool runs it)
is wrapped to register the new pool, weakly. Everything is then read once a window from the
pool's own ``get_stats()``, so nothing at all runs per connection:

- capacity: ``pool_max`` (``max_size``);
- in use: ``pool_size - pool_available`` (connections open, or being opened, less those idle);
- waiting: ``requests_waiting``; time waited: ``requests_wait_ms``; waits: ``requests_queued``
  (psycopg_pool adds a request's wait when it ends: a wait under way is counted in
  ``waiting``, not yet in the time).

A pool not open (never opened, or closed) is not counted. Django's pools are also listed from
Django itself (``connections[alias].pool`` lives in the postgresql backend's
``DatabaseWrapper._connection_pools``) and named ``django:<alias>``; any other pool by its
``name`` (psycopg_pool numbers unnamed pools ``pool-1``, ``pool-2``... in construction order,
the same in every worker that builds them in the same order). A pool constructed in a
``preload_app`` master is registered there (the master installs the discovery before it loads
the app) and inherited by the workers; one constructed before the discovery was installed at
all is not found.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from apf_gunicorn.signals.pools import EXTRA_SOURCES, REGISTRY, PoolReading, Reader, log

_DJANGO_BACKEND = "django.db.backends.postgresql.base"


def _django_pools() -> dict[int, str]:
    """id(pool) -> alias of the pools Django made (empty when Django's postgresql backend is
    not loaded)."""
    mod = sys.modules.get(_DJANGO_BACKEND)
    pools = getattr(getattr(mod, "DatabaseWrapper", None), "_connection_pools", None)
    if not pools:
        return {}
    return {id(pool): alias for alias, pool in list(pools.items())}


def read_pool(pool: Any, django_alias: str | None = None) -> PoolReading | None:
    """The pool's reading from ``get_stats()``; None while it is not open."""
    if pool.closed:
        return None
    stats = pool.get_stats()
    if django_alias is None:
        django_alias = _django_pools().get(id(pool))
    name = f"django:{django_alias}" if django_alias is not None else str(pool.name)
    return PoolReading(
        name=name, kind="django" if django_alias is not None else "psycopg_pool",
        capacity=int(stats.get("pool_max", 0)),
        in_use=max(0, int(stats.get("pool_size", 0)) - int(stats.get("pool_available", 0))),
        waiting=int(stats.get("requests_waiting", 0)),
        wait_ns=int(stats.get("requests_wait_ms", 0)) * 1_000_000,
        waits=int(stats.get("requests_queued", 0)))


def django_sources() -> Iterable[tuple[Any, Reader]]:
    """Django's pools, for those made before the discovery (or by a Django that built them
    another way)."""
    mod = sys.modules.get(_DJANGO_BACKEND)
    pools = getattr(getattr(mod, "DatabaseWrapper", None), "_connection_pools", None)
    return [(pool, read_pool) for pool in list((pools or {}).values())]


def install() -> bool:
    """Wrap ``psycopg_pool``'s ``BasePool.__init__`` (once per process; psycopg_pool must be
    imported). Returns whether its pools are watched."""
    try:
        from psycopg_pool.base import BasePool
    except ImportError:
        return False
    if getattr(BasePool.__init__, "_apf_wrapped", False):
        return True
    if not callable(getattr(BasePool, "get_stats", None)):
        log.warning("apf: this psycopg_pool has no get_stats(): its pools are not read")
        return False
    orig = BasePool.__init__

    def __init__(self, *args, _orig=orig, **kwargs):
        _orig(self, *args, **kwargs)
        REGISTRY.add(self, read_pool)

    __init__._apf_wrapped = True
    __init__.__wrapped__ = orig
    BasePool.__init__ = __init__
    if django_sources not in EXTRA_SOURCES:
        EXTRA_SOURCES.append(django_sources)
    return True
