"""The gunicorn server hooks that apf_gunicorn's conf.py installs.

Master: ``on_starting`` validates settings and the configuration, removes stale segments,
creates and configures the shared ledger; ``when_ready`` starts the master services thread
(borrowing, admin endpoint); ``pre_fork`` gives each worker a small index (its owner id in the
ledger and the name of its grant socket); ``child_exit`` reclaims everything a dead worker held
(``reclaim.py``; the master's 1 s check does it too when a config replaced this hook);
``on_reload`` (HUP) loads the configuration again and reconfigures the ledger in place, or keeps
the running one and logs every error (``reload.py``, which also follows ``APF_CONFIG``'s files
from ``when_ready`` on: ``APF_CONFIG_WATCH``); ``on_exit`` unlinks the segment.

Worker: ``post_fork`` closes what the child must not hold; ``post_worker_init`` attaches the
ledger, binds the grant socket, starts the dispatcher thread and wraps the worker's app in its front
end's middleware; ``worker_exit`` answers parked requests 503 and releases what the worker holds.

A user config that defines its own hook of the same name should call ours from it (at start,
``on_starting`` logs each of ours that was replaced and what that loses: ``hookcheck.py``)::

    from apf_gunicorn.conf import *
    from apf_gunicorn.master import hooks

    def post_fork(server, worker):
        hooks.post_fork(server, worker)
        ...
"""

from __future__ import annotations

import logging
import os
import sys
import time

from gunicorn.util import load_class

from apf_gunicorn.admission import boot
from apf_gunicorn.admission.boot import FrontEnd
from apf_gunicorn.admission.channel import GrantSender, grant_token
from apf_gunicorn.admission.routekinds import RouteTimes
from apf_gunicorn.flowcontrol.workestimate import load_estimator_hook
from apf_gunicorn.ledger.layout import Capacity
from apf_gunicorn.ledger.ledger import Ledger
from apf_gunicorn.ledger.lock import ProcessLock
from apf_gunicorn.master.hookcheck import log_replaced_hooks
from apf_gunicorn.master.master import MasterServices
from apf_gunicorn.master.reclaim import reclaim_worker
from apf_gunicorn.master.reload import ConfigWatcher, budget_warning, on_hup
from apf_gunicorn.server import shm, startup, state, tlscontext
from apf_gunicorn.server.configwatch import watchable
from apf_gunicorn.server.generation import config_error_lines, configure_ledger, load_generation
from apf_gunicorn.server.resolver import ResolverError, build_resolver, path_parsing_note
from apf_gunicorn.server.settings import SettingsError, load_settings
from apf_gunicorn.signals.cpu import CpuWatch
from apf_gunicorn.signals.table import PoolTable

log = logging.getLogger("apf_gunicorn")


def _fail(server, lines: list[str]) -> None:
    for line in lines:
        server.log.error("apf: %s", line)
    raise SystemExit(1)


def check_worker_class(worker_class, cfg=None) -> str | None:
    """An error message if ``worker_class`` is not one of our workers (a ``FrontEnd``:
    ``ApfThreadWorker``, the ASGI workers, or a subclass).

    Args:
        worker_class: the class gunicorn runs (``server.worker_class``: after its own switch
            from ``sync`` to its stock gthread worker when ``--threads`` > 1).
        cfg: gunicorn's config, to name the class the user asked for in the message.
    Returns:
        None, or the message to refuse the server with.
    """
    if isinstance(worker_class, type) and issubclass(worker_class, FrontEnd):
        return None
    name = getattr(worker_class, "__name__", str(worker_class))
    asked = cfg.settings["worker_class"].get() if cfg is not None else worker_class
    if isinstance(asked, str) and asked != worker_class:
        try:
            name = getattr(load_class(asked), "__name__", asked)
        except Exception:
            name = asked
    return (f"worker class {name!r} is not supported: apf_gunicorn needs one of its workers: "
            "for WSGI apps its gthread (worker_class = "
            "'apf_gunicorn.gthread.worker.ApfThreadWorker', as apf_gunicorn.conf sets; "
            "gunicorn's stock gthread, which it also runs for sync with --threads > 1, lacks "
            "its protections), for ASGI apps -k apf_gunicorn.asgi.UvicornWorker or "
            "-k apf_gunicorn.asgi.ASGIWorker")


def _holds_threads(server) -> bool:
    return getattr(server.worker_class, "apf_holds_threads", True)


def _tls_from_master(server) -> bool:
    """The worker class serves TLS with the master's context (``server/tlscontext.py``)."""
    return getattr(server.worker_class, "apf_tls_from_master", False)


def _threads(server) -> int:
    """Threads per worker for the default limit: gunicorn's ``threads`` when a request holds
    one (gthread), else what an event-loop worker counts as (``boot.LOOP_THREADS``)."""
    return server.cfg.threads if _holds_threads(server) else boot.LOOP_THREADS


# -- master hooks -----------------------------------------------------------------------------

def on_starting(server) -> None:
    startup.route_logs(server.log)
    log_replaced_hooks(server.cfg, server.log, sys.modules[__name__])
    problem = check_worker_class(server.worker_class, server.cfg)
    if problem:
        _fail(server, [problem])
    if _tls_from_master(server):
        try:
            tlscontext.make_at_start(server.cfg)
        except tlscontext.TlsContextError as e:
            _fail(server, [str(e)])
    try:
        settings = load_settings(workers=server.cfg.workers, threads=_threads(server))
    except SettingsError as e:
        _fail(server, [str(e)])
    startup.warn_unknown_variables(server.log)
    startup.log_identity(server.log, settings)
    if settings.work_estimator:
        try:
            load_estimator_hook(settings.work_estimator)  # fail at start, not in the workers
        except Exception as e:
            _fail(server, [str(e)])
    try:
        gen = load_generation(settings)
    except Exception as e:  # the loader's ConfigErrors, or any reading problem
        _fail(server, ["invalid configuration (APF_CONFIG="
                       f"{settings.config_source}):", *config_error_lines(e)])
    resolver = _build_resolver(server, settings, gen.configuration)
    warning = budget_warning(server, gen, settings, _holds_threads(server))
    if warning:
        server.log.warning("apf: %s", warning)
    for msg in getattr(gen.configuration, "warnings", lambda: [])():
        server.log.warning("apf: %s", msg)


    removed = shm.clean_stale_segments()
    if removed:
        server.log.info("apf: removed stale shared memory of dead servers: %s", ", ".join(removed))
    # Room for every worker index: during a HUP old and new workers live side by side.
    capacity = Capacity(workers=max(Capacity().workers, 4 * server.cfg.workers + 16))
    pid = os.getpid()
    segment = shm.Segment.create(settings.instance, Ledger.size(capacity), pid)
    token = grant_token(settings.instance, pid)
    try:
        ledger = Ledger.create(segment.ledger_buffer, capacity, lock=ProcessLock(),
                               owner_pid=pid, service_estimate_ns=settings.service_estimate_ns,
                               learn_service=settings.learn_service)
        configure_ledger(ledger, gen, time.monotonic_ns())
    except Exception as e:  # e.g. more levels than the ledger holds: no traceback, no leak
        segment.unlink()
        _fail(server, [f"the configuration does not fit the ledger: {e}"])
    # the workers' signals (signals/): their CPU, and their pools unless APF_POOL_SIGNALS=off
    # (then nothing is looked for)
    signals = PoolTable.create(capacity.workers)
    state.MASTER = state.MasterState(
        settings=settings, token=token, segment=segment, ledger=ledger, capacity=capacity,
        resolver=resolver, generation=gen, sender=GrantSender(token, ledger.grant_name), master_pid=pid,
        threads=_threads(server), holds_threads=_holds_threads(server),
        pool_table=signals, cpu_watch=CpuWatch(signals),
        # auto: service time per route, counted by the workers (forked after this)
        route_times=(RouteTimes.create(capacity.workers)
                     if getattr(settings, "concurrency_auto", None) is not None else None))


def _build_resolver(server, settings, configuration):
    try:
        resolver = build_resolver(settings, configuration)
    except ResolverError as e:
        _fail(server, [str(e)])
    server.log.info("apf: /api/ and /apis/ paths are %s",
                    path_parsing_note(settings, configuration))
    return resolver


def when_ready(server) -> None:
    m = state.MASTER
    if m is None or m.services is not None:
        return
    m.services = MasterServices(m, server.log, arbiter=server)
    m.services.start_admin()
    m.services.start_agent(server)  # APF_AGENT_BIND (off by default)
    m.services.start()
    if m.settings.config_watch and watchable(m.settings.config_path):
        m.watcher = ConfigWatcher(m, server)  # APF_CONFIG_WATCH: follow the file
        m.watcher.start()
        server.log.info("apf: following APF_CONFIG=%s: a change is applied within 2 s "
                        "(APF_CONFIG_WATCH=off: only on HUP)", m.settings.config_path)
    elif watchable(m.settings.config_path):
        server.log.info("apf: APF_CONFIG_WATCH=off: APF_CONFIG is applied again only on HUP")
    startup.log_ready(server.log, m, server.cfg)


def pre_fork(server, worker) -> None:
    m = state.MASTER
    if m is None:
        return
    if _tls_from_master(server):
        tlscontext.refresh(server.cfg, server.log)  # after a HUP: made again, or kept
    index = 0
    while index in m.workers:
        index += 1
    if index >= m.capacity.workers:
        # The ledger's worker table is full (TTIN, or a HUP doubling many workers): an index
        # past it would overwrite other tables. This worker serves without APF (logged there).
        worker.apf_index = None
        return
    m.workers[index] = 0
    m.forked[index] = worker  # reclaim.py: how the master tells that this worker is gone
    worker.apf_index = index
    # A booting worker counts as having room, so the running ones do not answer 429 for
    # threads it is about to bring (gthread/worker.py: the accept gate); reaped if it fails.
    m.ledger.set_worker_room(index, True)
    m.booting[index] = time.monotonic()


def child_exit(server, worker) -> None:
    m = state.MASTER
    if m is None:
        return
    # Once per worker (reclaim.py): gunicorn's worker_exit in the master then child_exit, or
    # the master's 1 s check, must not reap the index again once a successor holds it.
    reclaim_worker(m, worker, server.log)


def on_reload(server) -> None:
    m = state.MASTER
    if m is None:
        return
    on_hup(server, m, os.environ.get("APF_CONFIG", "").strip() or None)


def on_exit(server) -> None:
    m = state.MASTER
    if m is None or os.getpid() != m.master_pid:
        return
    if m.services is not None:
        m.services.stop()
    if m.watcher is not None:
        m.watcher.stop()
    m.segment.unlink()


# -- worker hooks -----------------------------------------------------------------------------

def post_fork(server, worker) -> None:
    m = state.MASTER
    if m is None:
        return
    # The master's sockets are not ours: the grant sender (we make our own) and the admin
    # listener.
    if m.sender is not None:
        m.sender.close()
    if m.services is not None:
        m.services.close_in_child()
    boot.set_worker_oom_score_adj(m.settings.worker_oom_score_adj_step, m.master_pid,
                                  server.log)


def post_worker_init(worker) -> None:
    problem = check_worker_class(type(worker))
    if problem:
        raise SystemExit(problem)  # gunicorn halts the server: the worker "failed to boot"
    m = state.MASTER
    if m is None:
        raise SystemExit("apf: the master did not set up the ledger (on_starting hook missing?)")
    if getattr(worker, "apf_index", None) is None:
        worker.log.error("apf: the ledger's worker table (%d entries) is full; this worker "
                         "(pid %s) serves WITHOUT priority and fairness. Restart the server "
                         "to size the table for the new number of workers.",
                         m.capacity.workers, os.getpid())
        return
    state.WORKER = boot.attach(worker, m)


def worker_exit(server, worker) -> None:
    w = state.WORKER
    if w is None or os.getpid() != w.pid:
        # gunicorn also calls worker_exit in the master when a worker is already gone.
        if state.MASTER is not None and os.getpid() == state.MASTER.master_pid:
            child_exit(server, worker)
        return
    w.parking.stop_all()
    w.parking.drain(1.0)
    w.dispatcher.release_all_lingers()
    w.dispatcher.stop()
    try:
        granted = w.ledger.reap_worker(w.index, time.monotonic_ns())
        if granted:
            w.sender.send_grants(granted, w.index)
    except Exception:
        server.log.exception("apf: releasing this worker's seats at exit failed")


def worker_abort(worker) -> None:
    """The master's timeout kill (SIGABRT): release what we can before going."""
    w = state.WORKER
    if w is not None and os.getpid() == w.pid:
        w.parking.stop_all()


