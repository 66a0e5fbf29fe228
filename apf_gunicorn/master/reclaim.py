"""Reclaiming a dead worker's seats, whoever notices its death first.

gunicorn tells the master that a worker is gone through one hook, ``child_exit``. A user config
that defines its own ``child_exit`` replaces ours: prometheus_client documents exactly that
recipe for multiprocess mode (``from apf_gunicorn.conf import *`` then a ``child_exit`` that
calls ``multiprocess.mark_process_dead``). A worker killed while it ran a request would then
keep its seat for ever. So two paths reclaim, and whichever runs first does the work once:

* :func:`reclaim_worker` from our ``child_exit`` (``hooks.child_exit``), about 3 ms after the
  death;
* :func:`find_gone` from the master services thread every second (``MasterServices.run``):
  a worker index that ``pre_fork`` handed out whose gunicorn ``Worker`` is no longer in the
  arbiter's worker table (``arbiter.WORKERS``) at two checks at least :data:`CONFIRM_S` apart
  is reclaimed, and the miss is logged (the config's ``child_exit`` does not call ours). So a
  dead worker's seats come back within about 2 s whatever the config does with ``child_exit``.

Why the arbiter's table and not something else: a pid leaves ``WORKERS`` exactly when gunicorn
has reaped it (``waitpid`` in ``Arbiter.reap_workers``, or ``kill`` finding it gone), which is
gunicorn's own truth about its workers. Calling ``waitpid`` ourselves would steal the exit from
gunicorn (it would never replace the worker); ``os.kill(pid, 0)`` answers yes for a zombie and
for an unrelated process that reused the pid. Wrapping gunicorn's reap path or its
``cfg.child_exit`` would not survive a HUP (the config, and with it ``cfg``, is loaded again)
and depends on more of gunicorn's internals. The two checks cover the instant between the fork
and gunicorn recording the new pid (``worker.pid`` is set just before ``WORKERS[pid]``), when a
live worker is not in the table yet.

Both paths decide and reap under one lock, and recognise a worker by its ``Worker`` object,
never by its index alone: a reused index belongs to the new worker.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from apf_gunicorn.master.metrics import mark_process_dead

log = logging.getLogger("apf_gunicorn")

# How long a worker must be missing from gunicorn's table before it counts as gone: more than
# the instant between the fork and gunicorn recording the new pid, whatever the load.
CONFIRM_S = 0.5

# Makes "reclaimed yet?" and the reaping one step between the two paths. Never held across a
# fork: the main thread forks (not from child_exit), and the services thread calls in holding
# master.SERVICE_LOCK, which the fork takes first.
_LOCK = threading.Lock()

# The slot states of requests a worker was serving or holding in a queue: a worker that exits
# holding one died mid-request (``apf_reclaimed_workers_total``). Lingering seats (a finished
# request's additional latency) are not in flight: a graceful exit may leave them.
IN_FLIGHT = frozenset(("waiting", "executing"))


def reclaim_worker(m: Any, worker: Any, glog: Any = None) -> bool:
    """Reclaim everything worker ``worker`` held in the ledger (its waiting requests, seats and
    lingering seats), send the grants that frees, free its index, and drop its live metrics
    files; count it in ``m.workers_reclaimed`` when it held a request in flight. Once per
    worker: a later call for the same worker does nothing, and a call for a worker whose index
    was since handed to another does not touch the other.

    Args:
        m: the ``state.MasterState``.
        worker: gunicorn's ``Worker`` (``apf_index`` set by ``hooks.pre_fork``; ``pid``).
        glog: the logger for failures (gunicorn's error log); the module's by default.
    Returns:
        Whether this call reclaimed it (False: already reclaimed, or it had no index).
    """
    glog = glog or log
    index = getattr(worker, "apf_index", None)
    if index is None:
        return False
    with _LOCK:
        if getattr(worker, "apf_reaped", False):
            return False
        # The index is this worker's until now (pre_fork gave it, nothing else frees it), so
        # free it whatever pid the master thread learned for it.
        worker.apf_reaped = True
        try:
            # A worker that exits on its own (HUP, max_requests, shutdown) has finished or
            # cancelled its requests first; one that still holds some was killed or crashed.
            if any(state in IN_FLIGHT for _slot, _gen, state in m.ledger.owned_slots(index)):
                m.workers_reclaimed = getattr(m, "workers_reclaimed", 0) + 1
        except Exception:
            glog.exception("apf: reading the slots of worker %s (pid %s) failed", index,
                           worker.pid)
        try:
            granted = m.ledger.reap_worker(index, time.monotonic_ns())
            if granted:
                m.sender.send_grants(granted)
        except Exception:
            glog.exception("apf: reclaiming the seats of worker %s (pid %s) failed",
                           index, worker.pid)
        finally:
            m.workers.pop(index, None)
            m.booting.pop(index, None)
            if m.forked.get(index) is worker:
                del m.forked[index]
    try:
        mark_process_dead(worker.pid)  # outside the lock: file work, with its own lock
    except Exception:
        glog.exception("apf: metrics cleanup for pid %s failed", worker.pid)
    return True


def find_gone(m: Any, arbiter: Any, suspects: dict[int, tuple[Any, float]],
              now: float) -> tuple[list[Any], dict[int, tuple[Any, float]]]:
    """The workers to reclaim now: those ``pre_fork`` recorded (``m.forked``) whose ``Worker``
    is missing from ``arbiter.WORKERS`` now and was already missing at a check at least
    :data:`CONFIRM_S` ago.

    Args:
        m: the ``state.MasterState``.
        arbiter: gunicorn's Arbiter (its ``WORKERS``: pid -> Worker).
        suspects: what the previous call returned second.
        now: ``time.monotonic()``.
    Returns:
        ``(gone, suspects)``: the Workers to reclaim, and those missing but not for long enough
        yet (index -> (Worker, first seen missing); pass it to the next call).
    """
    live = {id(w) for w in list(arbiter.WORKERS.values())}
    gone, missing = [], {}
    for index, worker in list(m.forked.items()):
        if id(worker) in live or getattr(worker, "apf_reaped", False):
            continue
        seen = suspects.get(index)
        since = seen[1] if seen is not None and seen[0] is worker else now
        if now - since >= CONFIRM_S:
            gone.append(worker)
        else:
            missing[index] = (worker, since)
    return gone, missing
