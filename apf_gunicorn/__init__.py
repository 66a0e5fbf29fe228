"""apf_gunicorn: Kubernetes API Priority and Fairness for gunicorn's threaded workers.

Layers (arrows point down only):

- ``apf_gunicorn.flowcontrol``: pure Kubernetes semantics (config objects, validation,
  classification, shuffle sharding, limits, borrowing). No I/O beyond reading config files.
- ``apf_gunicorn.ledger``: the seat ledger, a fixed-layout store on any writable buffer with the
  fair-queuing operations; the simulator drives it with a virtual clock.
- ``apf_gunicorn.signals``: the limit's signals: the app's connection pools found in the
  workers and published into a shared table the master reads; :func:`resource` declares any
  other bounded resource in one line.
- ``apf_gunicorn.server``: gunicorn integration (middleware, dispatcher thread, master services).
- ``apf_gunicorn.conf``: the gunicorn config file (``gunicorn -c python:apf_gunicorn.conf app:app``).
- ``apf_gunicorn.cli``: ``python -m apf_gunicorn check|explain|simulate|dump``.
"""

from apf_gunicorn.signals.resource import resource

__all__ = ["resource"]
__version__ = "0.1.0"
