"""Bringing APF up inside a freshly forked worker (``post_fork`` and ``post_worker_init``).

    set_worker_oom_score_adj(settings.worker_oom_score_adj_step, master_pid, log)  # post_fork
    state.WORKER = attach(worker, state.MASTER)                                   # post_worker_init

``attach`` maps the master's ledger with this process's lock, registers the worker, binds its
grant socket (accepting datagrams only from the master and the workers in the ledger's worker
table: ``channel.PeerCheck``), starts its dispatcher thread, connects the accept-gated worker to the ledger
(room flags, head timeouts) and wraps ``worker.wsgi`` in the middleware.

Override point: :data:`make_lock` builds the worker's ledger lock (tests replace it with one
that dies inside its Nth critical section: ``tests/apps/dying_conf.py``).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from apf_gunicorn.admission.channel import GrantInbox, GrantSender, PeerCheck
from apf_gunicorn.admission.dispatcher import Dispatcher, Parking
from apf_gunicorn.admission.loadreport import OrcaReport
from apf_gunicorn.flowcontrol.retryafter import RetryAfterTracker
from apf_gunicorn.flowcontrol.workestimate import load_estimator_hook
from apf_gunicorn.gthread.pollreject import PollerRejector
from apf_gunicorn.gthread.worker import ApfThreadWorker
from apf_gunicorn.gthread.wsgi import APFMiddleware, WorkerContext
from apf_gunicorn.ledger.ledger import Ledger
from apf_gunicorn.ledger.lock import ProcessLock
from apf_gunicorn.server import startup, state
from apf_gunicorn.server.dumps import encode_detail
from apf_gunicorn.server.generation import level_max_seats, route_table

if TYPE_CHECKING:
    from apf_gunicorn.server.settings import Settings

log = logging.getLogger("apf_gunicorn.worker")

#: Builds this worker's ledger lock; replaced only by tests.
make_lock: Callable[[], ProcessLock] = ProcessLock


def attach(worker: Any, m: state.MasterState) -> state.WorkerState:
    """Bring APF up in ``worker`` (its ``apf_index`` given by ``pre_fork``) and return the
    worker's state; ``worker.wsgi`` is wrapped in the middleware."""
    index = worker.apf_index
    gen = m.generation
    ledger = Ledger.attach(m.segment.ledger_buffer, lock=make_lock())
    ledger.register_worker(index, os.getpid(), time.monotonic_ns())
    peers = PeerCheck(m.master_pid or os.getppid(), _worker_pids(ledger))
    inbox = GrantInbox(m.token, index, trusted=peers)
    os.register_at_fork(after_in_child=_close_grant_socket_in_child)
    sender = GrantSender(m.token)
    parking = Parking()
    deliver = _deliverer(parking, sender, index)
    dispatcher = Dispatcher(parking, inbox, ledger, owner=index, deliver=deliver,
                            alive=lambda: worker.alive)
    ctx = WorkerContext(
        ledger=ledger, resolver=m.resolver, classifier=gen.classifier,
        level_index=gen.level_index, fs_index=gen.fs_index, owner=index, parking=parking,
        deliver=deliver, add_linger=dispatcher.add_linger,
        queue_wait_limit_ns=m.settings.queue_wait_limit_ns, alive=lambda: worker.alive,
        max_seats=level_max_seats(gen, m.settings), routes=route_table(m.resolver),
        work_estimator=_work_estimator(m.settings), retry_after=RetryAfterTracker(),
        encode_detail=encode_detail, load_report=_load_report(m, ledger, gen),
        finish_later=dispatcher.finish_later, route_times=getattr(m, "route_times", None),
        **_thread_reserve(worker))
    if isinstance(worker, ApfThreadWorker):
        worker.apf_on_head_timeout = ledger.count_head_timeout
        worker.apf_on_drop = ledger.count_connection_dropped
        worker.apf_publish_room = functools.partial(ledger.set_worker_room, index)
        worker.apf_others_have_room = functools.partial(ledger.other_worker_has_room, index)
    if index == 0:
        startup.log_route_notes(worker.log, worker.wsgi, ctx.routes, ctx.max_seats, gen,
                                m.settings.paths)
    middleware = APFMiddleware(worker.wsgi, ctx)
    worker.wsgi = middleware
    if isinstance(worker, ApfThreadWorker):
        rejector = PollerRejector(middleware, worker.cfg)
        worker.apf_rejector = rejector if rejector.enabled else None
        worker.apf_on_delayed = ledger.count_rejection_delayed
    dispatcher.start()
    return state.WorkerState(index=index, pid=os.getpid(), ledger=ledger, parking=parking,
                             dispatcher=dispatcher, inbox=inbox, sender=sender,
                             middleware=middleware, worker=worker)


def _worker_pids(ledger: Ledger) -> Callable[[], list[int]]:
    """The workers whose grant datagrams this worker accepts: every process in the ledger's
    worker table (a reaped worker's record keeps its pid until the index is reused: its exit
    hook sends the grants its reap dispatched)."""
    def pids() -> list[int]:
        return [pid for _, pid, _, _ in ledger.workers()]

    return pids


def _deliverer(parking: Parking, sender: GrantSender, me: int) -> Callable[[list], None]:
    """Hand grants to their owners: this worker's parked threads directly, the others' over
    their grant sockets. Never raises: it runs after a ledger call took or freed seats, and an
    exception there would leak them (a grant that is not delivered is found by its owner's
    backstop scan, and the ledger decides whether a woken request runs)."""
    def deliver(granted, _grant=parking.grant, _me=me, _send=sender.send_grants):
        others = False
        for slot, gen_, owner in granted:
            if owner == _me:
                _grant(slot, gen_)
            else:
                others = True
        if others:
            try:
                _send(granted, _me)
            except Exception:  # noqa: BLE001 - see the docstring
                log.exception("apf: sending grants to other workers failed; their ledger "
                              "scans pick them up")

    return deliver


def _close_grant_socket_in_child() -> None:
    """A process the application forks (multiprocessing, os.fork) must not keep this worker's
    grant socket: it would hold the abstract name after the worker dies, and the replacement
    worker's bind would fail (EADDRINUSE in post_worker_init halts the whole server)."""
    w = state.WORKER
    if w is not None and w.inbox is not None and os.getpid() != w.pid:
        w.inbox.close()


def _thread_reserve(worker: Any) -> dict:
    """The middleware's view of the worker's thread reserve (ApfThreadWorker only): its
    ``apf_inflight`` and how many threads non-exempt requests may hold (``apf_room_limit``)."""
    if not isinstance(worker, ApfThreadWorker):
        return {}
    return {"inflight": worker.apf_inflight, "nonexempt_threads": worker.apf_room_limit}


def _work_estimator(settings: Settings):
    """The APF_WORK_ESTIMATOR hook (already imported by the master, so loading is cheap)."""
    if not settings.work_estimator:
        return None
    return load_estimator_hook(settings.work_estimator)


def _load_report(m: state.MasterState, ledger: Ledger, gen: state.Generation):
    """The worker's ORCA reporter when APF_LOAD_REPORT=orca, else None."""
    if m.settings.load_report != "orca":
        return None
    names = {i: name for name, i in gen.level_index.items()}
    return OrcaReport(functools.partial(ledger.load, tuple(sorted(names))), names,
                      int(m.settings.load_report_interval_s * 1e9))


def set_worker_oom_score_adj(step: int | None, master_pid: int, log_) -> int | None:
    """Raise this process's ``oom_score_adj`` to the master's + ``step`` (at most 1000), so
    under memory pressure the kernel kills a worker (whose seats the master reclaims) before
    the master (which owns the ledger). Raising needs no privilege.

    Args:
        step: ``APF_WORKER_OOM_SCORE_ADJ`` (None: leave it).
        master_pid: whose score to start from.
        log_: where a failure is logged.
    Returns:
        The value set, or None when off or not possible (logged).
    """
    if step is None:
        return None
    try:
        with open(f"/proc/{master_pid}/oom_score_adj") as f:
            base = int(f.read().strip() or 0)
        value = min(1000, base + step)
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write(str(value))
        return value
    except (OSError, ValueError) as e:
        log_.warning("apf: could not raise this worker's oom_score_adj above the master's "
                     "(APF_WORKER_OOM_SCORE_ADJ): %s", e)
        return None
