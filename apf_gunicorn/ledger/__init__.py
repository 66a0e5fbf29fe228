"""The seat ledger: Kubernetes' fair queuing (queueset) on a fixed layout in any buffer.

    from apf_gunicorn.ledger import Ledger, Capacity, LevelSpec, NullLock, EXECUTE
    led = Ledger.create(bytearray(Ledger.size(Capacity())), Capacity(), lock=NullLock())

See ``ledger.py`` for the ``Ledger`` facade and the module of each concern (the operations in
``requestpath.py``, their fast paths in ``fastpath.py``, Kubernetes' fairness in
``queueset.py``), ``records.py`` for the result types and ``LedgerPort``, ``stats.py`` for the
per-request counters, ``layout.py`` for the binary layout, ``lock.py`` for the cross-process
lock and ``repair.py`` for rebuilding after a crash; docs/ledger.md for the user-facing
description.
"""

from apf_gunicorn.ledger.layout import Capacity, Layout
from apf_gunicorn.ledger.ledger import (
    DEFAULT_SERVICE_ESTIMATE_NS,
    EXECUTE,
    QUEUED,
    REJECTED,
    AdmitResult,
    DemandStats,
    Ledger,
    LedgerPort,
    LevelLoad,
    LevelSnapshot,
    LevelSpec,
    QueueSnapshot,
    RequestSnapshot,
    Snapshot,
)
from apf_gunicorn.ledger.lock import NullLock, ProcessLock
from apf_gunicorn.ledger.repair import rebuild, verify
from apf_gunicorn.ledger.stats import REASONS, Hist, RequestStats

__all__ = [
    "DEFAULT_SERVICE_ESTIMATE_NS",
    "EXECUTE",
    "QUEUED",
    "REJECTED",
    "AdmitResult",
    "Capacity",
    "DemandStats",
    "Hist",
    "Layout",
    "Ledger",
    "LedgerPort",
    "LevelLoad",
    "LevelSnapshot",
    "LevelSpec",
    "NullLock",
    "ProcessLock",
    "QueueSnapshot",
    "REASONS",
    "RequestSnapshot",
    "RequestStats",
    "Snapshot",
    "rebuild",
    "verify",
]
