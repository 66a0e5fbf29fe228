"""The limit's signals: what the app's own bottlenecks say, read where they are.

Layer: above ``ledger/``, below ``server/`` (nothing under it imports it). Discovery and
publishing run in the workers, aggregation in the master:

- ``pools.py``: the worker's registry of bounded resources and the reading of each one
  (:class:`~.pools.PoolReading`: capacity, in use, waiting, time waited).
- ``sqlalchemy_pools.py``, ``psycopg_pools.py``, ``asyncpg_pools.py``: the libraries' pools
  found with no code in the app (SQLAlchemy's ``QueuePool``; psycopg_pool's pools, Django
  5.1+'s among them; asyncpg's ``Pool``).
- ``resource.py``: :func:`~.resource.resource`, one line in the app for any other bounded
  resource (``apf_gunicorn.resource("redis", capacity=10)``).
- ``importhook.py``: installs the discovery in a worker before it loads the app (and in the
  master, before a ``preload_app`` master loads it), and in the libraries whenever the app
  imports them.
- ``cpu.py``: the CPU: each worker's share of its GIL and CPU per served request, once a
  window; the host's cores from ``/proc/stat`` in the master.
- ``table.py``: the lock-free shared table each worker publishes its readings (and its CPU)
  into once a window, and the master reads server-wide (summed per pool name).
- ``publisher.py``: the worker's thread that publishes once a window.

What is found, how and at what cost: docs/signals.md.
"""
