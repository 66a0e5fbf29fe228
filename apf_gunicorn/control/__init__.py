"""The limit controller: pure rules that turn what the server observes into a concurrency limit.

- :mod:`.adaptive`: ``auto``'s controller, fed the latency and throughput of finished requests
  once a tick (:mod:`.adaptive_types` says what it is fed and configured with).
- :mod:`.poollimit`: the rule that makes the default limit, and ``auto`` first, follow the
  app's connection pools.

Pure like :mod:`apf_gunicorn.flowcontrol` (no I/O, injected time); the master runs them
(``master/autolimit.py``, ``master/poollimit.py``) and the simulator replays them.
"""
