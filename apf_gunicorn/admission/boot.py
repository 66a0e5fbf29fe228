"""Bringing APF up inside a freshly forked worker (``post_fork`` and ``post_worker_init``).

    set_worker_oom_score_adj(settings.worker_oom_score_adj_step, master_pid, log)  # post_fork
    state.WORKER = attach(worker, state.MASTER)                                   # post_worker_init

``attach`` maps the master's ledger with this process's lock, registers the worker, binds its
grant socket (accepting datagrams only from the master and the workers in the ledger's worker
table: ``channel.PeerCheck``), builds the worker's :class:`~.core.WorkerContext`, hands it to
the worker's front end (:class:`FrontEnd`: it wraps its app in its middleware) and starts the
dispatcher thread and the publisher of the app's pools (``signals/``: the front end's
``init_process`` installed their discovery before the app was loaded).

Override points: :data:`make_lock` builds the worker's ledger lock (tests replace it with one
that dies inside its Nth critical section: ``tests/apps/dying_conf.py``); a worker class is a
front end by subclassing :class:`FrontEnd` (``gthread/worker.py``, ``asgi/workers.py``).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from apf_gunicorn.admission.channel import GrantInbox, GrantSender, PeerCheck
from apf_gunicorn.admission.core import Admission, WorkerContext
from apf_gunicorn.admission.dispatcher import Dispatcher
from apf_gunicorn.admission.loadreport import OrcaReport
from apf_gunicorn.flowcontrol.retryafter import RetryAfterTracker
from apf_gunicorn.flowcontrol.workestimate import load_estimator_hook
from apf_gunicorn.ledger.ledger import Ledger
from apf_gunicorn.ledger.lock import ProcessLock
from apf_gunicorn.server import startup, state
from apf_gunicorn.server.dumps import encode_detail
from apf_gunicorn.server.generation import level_max_seats, route_table
from apf_gunicorn.server.settings import load_settings
from apf_gunicorn.signals import importhook
from apf_gunicorn.signals.cpu import CpuMeter
from apf_gunicorn.signals.publisher import Publisher

if TYPE_CHECKING:
    from apf_gunicorn.server.settings import Settings

log = logging.getLogger("apf_gunicorn.worker")

#: Builds this worker's ledger lock; replaced only by tests.
make_lock: Callable[[], ProcessLock] = ProcessLock


#: what an event-loop worker counts as for the default limit (workers x LOOP_THREADS / 2: 32
#: seats a worker, as gthread's 64 threads give)
LOOP_THREADS = 64


class FrontEnd:
    """What a worker class provides so that :func:`attach` can run APF in it: a mixin of
    small override points, each with the gthread worker's answer as the example."""

    #: this worker's owner index in the ledger, given by ``pre_fork`` (None: no room)
    apf_index: int | None = None
    #: whether a request holds one of gunicorn's ``threads`` while it runs or waits (gthread):
    #: then the default limit and the thread-budget warning follow ``threads``. An event
    #: loop's worker (False) counts as :data:`LOOP_THREADS` instead.
    apf_holds_threads: bool = True

    @classmethod
    def setup(cls) -> None:
        """gunicorn calls this in the master when it loads the worker class, before a
        ``preload_app`` master loads the app: the pool discovery is installed there too, so
        the pools the app makes in the master are registered when made, and each worker
        inherits them with the registry (``signals/importhook.py``). APF_POOL_SIGNALS is read
        from the environment here (gunicorn applies its ``-e``/``raw_env`` only after this);
        a bad value installs nothing (``on_starting`` then refuses it)."""
        try:
            wanted = load_settings().pool_signals
        except Exception:  # noqa: BLE001 - reported, with its variable, by on_starting
            wanted = False
        if wanted:
            importhook.install()
        parent = getattr(super(), "setup", None)
        if parent is not None:
            parent()

    def init_process(self) -> None:
        # Before gunicorn loads the app in this worker: the pool discovery is then in place
        # in the libraries the app imports (signals/importhook.py).
        if state.MASTER is not None and _pool_signals(state.MASTER):
            importhook.install()
        else:  # off (maybe by gunicorn's -e, which the master's setup() could not see yet)
            importhook.uninstall()
        super().init_process()

    def apf_parking(self) -> Any:
        """Where queued requests wait: ``dispatcher.Parking()`` for threads,
        ``asyncparking.AsyncParking()`` for an event loop."""
        raise NotImplementedError

    def apf_alive(self) -> bool:
        """False once the worker is stopping (queued requests are then answered 503)."""
        return self.alive

    def apf_context(self) -> dict:
        """Extra :class:`~.core.WorkerContext` fields (gthread: its thread reserve)."""
        return {}

    def apf_app(self) -> Any:
        """The application the middleware will wrap (for the start-up notes)."""
        raise NotImplementedError

    def apf_attach(self, ctx: WorkerContext, ledger: Ledger) -> Admission:
        """Wrap the worker's app in this front end's middleware built on ``ctx``, connect
        whatever else of the worker needs the ledger, and return the middleware."""
        raise NotImplementedError


def attach(worker: FrontEnd, m: state.MasterState) -> state.WorkerState:
    """Bring APF up in ``worker`` (its ``apf_index`` given by ``pre_fork``) and return the
    worker's state; the worker's app is wrapped in its front end's middleware."""
    index = worker.apf_index
    gen = m.generation
    ledger = Ledger.attach(m.segment.ledger_buffer, lock=make_lock())
    peers = PeerCheck(m.master_pid or os.getppid(), _worker_pids(ledger))
    inbox = GrantInbox(m.token, index, trusted=peers)
    ledger.register_worker(index, os.getpid(), time.monotonic_ns(), inbox.name)
    os.register_at_fork(after_in_child=_close_grant_socket_in_child)
    sender = GrantSender(m.token, ledger.grant_name)
    parking = worker.apf_parking()
    deliver = _deliverer(parking, sender, index)
    alive = worker.apf_alive
    dispatcher = Dispatcher(parking, inbox, ledger, owner=index, deliver=deliver, alive=alive)
    ctx = WorkerContext(
        ledger=ledger, resolver=m.resolver, classifier=gen.classifier,
        level_index=gen.level_index, fs_index=gen.fs_index, owner=index, parking=parking,
        deliver=deliver, add_linger=dispatcher.add_linger,
        queue_wait_limit_ns=m.settings.queue_wait_limit_ns, alive=alive,
        max_seats=level_max_seats(gen, m.settings), routes=route_table(m.resolver),
        work_estimator=_work_estimator(m.settings), retry_after=RetryAfterTracker(),
        encode_detail=encode_detail, load_report=_load_report(m, ledger, gen),
        finish_later=dispatcher.finish_later, route_times=getattr(m, "route_times", None),
        pf_headers=m.settings.pf_headers,
        **worker.apf_context())
    if index == 0:
        startup.log_route_notes(worker.log, worker.apf_app(), ctx.routes, ctx.max_seats, gen,
                                m.settings.paths)
    middleware = worker.apf_attach(ctx, ledger)
    dispatcher.start()
    return state.WorkerState(index=index, pid=os.getpid(), ledger=ledger, parking=parking,
                             dispatcher=dispatcher, inbox=inbox, sender=sender,
                             middleware=middleware, worker=worker,
                             publisher=_publisher(m, index, middleware))


def _pool_signals(m: state.MasterState) -> bool:
    """Whether the workers look for the app's pools (``APF_POOL_SIGNALS``, and a table)."""
    return (getattr(m, "pool_table", None) is not None
            and getattr(m.settings, "pool_signals", True))


def _publisher(m: state.MasterState, index: int, middleware: Any) -> Publisher | None:
    """This worker's pools (``APF_POOL_SIGNALS=on``) and CPU published into its row of the
    master's table, once a window (None when the master made no table or it has no row for
    this index). The CPU's requests are those the middleware served."""
    table = getattr(m, "pool_table", None)
    if table is None or not 0 <= index < table.rows:
        return None
    stats = getattr(middleware, "stats", None)
    served = (lambda: stats.get("served", 0)) if isinstance(stats, dict) else (lambda: 0)
    read = None if _pool_signals(m) else list  # off: no pools, the CPU still
    publisher = Publisher(table.writer(index), read=read, tell_found=index == 0,
                          cpu=CpuMeter(served))
    publisher.start()
    return publisher


def _worker_pids(ledger: Ledger) -> Callable[[], list[int]]:
    """The workers whose grant datagrams this worker accepts: every process in the ledger's
    worker table (a reaped worker's record keeps its pid until the index is reused: its exit
    hook sends the grants its reap dispatched)."""
    def pids() -> list[int]:
        return [pid for _, pid, _, _ in ledger.workers()]

    return pids


def _deliverer(parking: Any, sender: GrantSender, me: int) -> Callable[[list], None]:
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
    grant socket: it would hold the socket and its abstract name after the worker dies (the
    replacement worker draws a name of its own, so it would still boot)."""
    w = state.WORKER
    if w is not None and w.inbox is not None and os.getpid() != w.pid:
        w.inbox.close()


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
