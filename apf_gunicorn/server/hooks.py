"""The gunicorn server hooks that apf_gunicorn's conf.py installs.

Master: ``on_starting`` validates settings and the configuration, removes stale segments,
creates and configures the shared ledger; ``when_ready`` starts the master services thread
(borrowing, admin endpoint); ``pre_fork`` gives each worker a small index (its owner id in the
ledger and the name of its grant socket); ``child_exit`` reclaims everything a dead worker held;
``on_reload`` (HUP) loads the configuration again and reconfigures the ledger in place, or keeps
the running one and logs every error; ``on_exit`` unlinks the segment.

Worker: ``post_fork`` closes what the child must not hold; ``post_worker_init`` attaches the
ledger, binds the grant socket, starts the dispatcher thread and wraps ``worker.wsgi`` in the
middleware; ``worker_exit`` answers parked requests 503 and releases what the worker holds.

A user config that defines its own hook of the same name should call ours from it::

    from apf_gunicorn.conf import *
    from apf_gunicorn.server import hooks

    def post_fork(server, worker):
        hooks.post_fork(server, worker)
        ...
"""

from __future__ import annotations

import logging
import os
import signal
import time

from apf_gunicorn.server import state
from apf_gunicorn.server.settings import SettingsError, load_settings

log = logging.getLogger("apf_gunicorn")


def _fail(server, lines: list[str]) -> None:
    for line in lines:
        server.log.error("apf: %s", line)
    raise SystemExit(1)


def check_worker_class(worker_class) -> str | None:
    """An error message if ``worker_class`` is not gunicorn's gthread worker (or a subclass)."""
    from gunicorn.workers.gthread import ThreadWorker

    if isinstance(worker_class, type) and issubclass(worker_class, ThreadWorker):
        return None
    name = getattr(worker_class, "__name__", str(worker_class))
    return (f"worker class {name!r} is not supported: apf_gunicorn needs gunicorn's threaded "
            "worker (worker_class = 'gthread' or apf_gunicorn.server.worker.ApfThreadWorker); "
            "requests park a thread while they wait in a queue")


# -- configuration --------------------------------------------------------------------------

def load_generation(settings, number: int = 1, ledger=None):
    """Load APF_CONFIG and derive limits and the classifier. Raises the loader's error list."""
    from apf_gunicorn.flowcontrol.limits import compute_limits
    from apf_gunicorn.flowcontrol.loader import load_configuration
    from apf_gunicorn.flowcontrol.matching import Classifier

    cfg = load_configuration(settings.config_path)
    limits = compute_limits(cfg.priority_levels.values(), settings.concurrency_limit)
    return state.Generation(cfg, limits, Classifier(cfg), {}, {}, number)


def level_specs(gen) -> list:
    from apf_gunicorn.ledger.ledger import LevelSpec

    specs = []
    for name, pl in sorted(gen.configuration.priority_levels.items()):
        q = pl.queuing
        specs.append(LevelSpec(name, pl.desired_queues, q.hand_size if q else 0,
                               q.queue_length_limit if q else 0, int(gen.limits[name].nominal)))
    return specs


def configure_ledger(ledger, gen, now: int):
    fs_names = [fs.name for fs in gen.configuration.flow_schemas]
    levels, schemas = ledger.configure(level_specs(gen), fs_names, now)
    gen.level_index = dict(levels)
    gen.fs_index = dict(schemas)


def config_error_lines(exc: BaseException) -> list[str]:
    errors = exc if isinstance(exc, list) else getattr(exc, "errors", None)
    if errors:
        return [str(e) for e in errors]
    return [str(exc) or type(exc).__name__]


def thread_budget(gen, settings, workers: int, threads: int) -> str | None:
    """A warning when workers x threads cannot hold the executing + queued requests the
    configuration allows (parked requests hold a thread each)."""
    total = workers * threads
    queued = 0
    for pl in gen.configuration.priority_levels.values():
        if pl.queuing is not None and not pl.is_exempt:
            queued += pl.queuing.queues * pl.queuing.queue_length_limit
    limit = settings.concurrency_limit
    if total <= limit:
        return (f"workers x threads = {workers} x {threads} = {total} threads cannot even run "
                f"the concurrency limit of {limit} seats (APF_CONCURRENCY_LIMIT); nothing would "
                f"ever queue in APF. Raise --threads/--workers or lower the limit.")
    if total < limit + queued:
        return (f"workers x threads = {total} threads hold the {limit} executing seats plus only "
                f"{total - limit} waiting requests, while the configuration allows {queued} "
                f"queued (sum of queues x queueLengthLimit); beyond that, requests wait in the "
                f"kernel's listen backlog where APF cannot see or order them, and exempt "
                f"requests may wait behind them.")
    return None


# -- master hooks -----------------------------------------------------------------------------

def on_starting(server) -> None:
    problem = check_worker_class(server.worker_class)
    if problem:
        _fail(server, [problem])
    try:
        settings = load_settings(workers=server.cfg.workers, threads=server.cfg.threads)
    except SettingsError as e:
        _fail(server, [str(e)])
    resolver = _build_resolver(server, settings)
    if settings.work_estimator:
        from apf_gunicorn.flowcontrol.workestimate import load_estimator_hook
        try:
            load_estimator_hook(settings.work_estimator)  # fail at start, not in the workers
        except Exception as e:
            _fail(server, [str(e)])
    try:
        gen = load_generation(settings)
    except Exception as e:  # the loader's ConfigErrors, or any reading problem
        _fail(server, ["invalid configuration (APF_CONFIG="
                       f"{settings.config_path or '<built-in>'}):", *config_error_lines(e)])
    warning = thread_budget(gen, settings, server.cfg.workers, server.cfg.threads)
    if warning:
        server.log.warning("apf: %s", warning)
    for msg in getattr(gen.configuration, "warnings", lambda: [])():
        server.log.warning("apf: %s", msg)

    from apf_gunicorn.ledger.layout import Capacity
    from apf_gunicorn.ledger.ledger import Ledger
    from apf_gunicorn.ledger.lock import ProcessLock
    from apf_gunicorn.server import shm
    from apf_gunicorn.server.channel import GrantSender, grant_token

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
    state.MASTER = state.MasterState(
        settings=settings, token=token, segment=segment, ledger=ledger, capacity=capacity,
        resolver=resolver, generation=gen, sender=GrantSender(token), master_pid=pid)
    server.log.info("apf: ledger %s ready: limit %d seats, %d priority levels",
                    segment.name, settings.concurrency_limit, len(gen.level_index))


def _build_resolver(server, settings):
    from apf_gunicorn.flowcontrol.requestinfo import RequestInfoResolver, load_request_info_hook

    routes = None
    if settings.routes:
        from apf_gunicorn.flowcontrol.routes import load_routes
        try:
            routes = load_routes(settings.routes)
        except Exception as e:
            _fail(server, [f"invalid APF_ROUTES={settings.routes!r}: {e}"])
    builtin = RequestInfoResolver(trusted_proxies=[str(n) for n in settings.trusted_proxies],
                                  user_header=settings.user_header,
                                  group_header=settings.group_header, routes=routes)
    if settings.request_info:
        try:
            return load_request_info_hook(settings.request_info, builtin)
        except Exception as e:
            _fail(server, [str(e)])
    return builtin


def when_ready(server) -> None:
    from apf_gunicorn.server.master import MasterServices

    m = state.MASTER
    if m is None or m.services is not None:
        return
    m.services = MasterServices(m, server.log)
    m.services.start_admin()
    m.services.start_agent(server)  # APF_AGENT_BIND (off by default)
    m.services.start()


def pre_fork(server, worker) -> None:
    m = state.MASTER
    if m is None:
        return
    index = 0
    while index in m.workers:
        index += 1
    if index >= m.capacity.workers:
        # The ledger's worker table is full (TTIN, or a HUP doubling many workers): an index
        # past it would overwrite other tables. This worker serves without APF (logged there).
        worker.apf_index = None
        return
    m.workers[index] = 0
    worker.apf_index = index


def child_exit(server, worker) -> None:
    m = state.MASTER
    index = getattr(worker, "apf_index", None)
    if m is None or index is None or getattr(worker, "apf_reaped", False):
        return
    # Once per worker: the index is this worker's until now (pre_fork gave it, nothing else
    # frees it), so free it whatever pid the master thread learned for it; a second call
    # (gunicorn's worker_exit in the master, then child_exit) must not reap a successor.
    worker.apf_reaped = True
    try:
        granted = m.ledger.reap_worker(index, time.monotonic_ns())
        if granted:
            m.sender.send_grants(granted)
    except Exception:
        server.log.exception("apf: reclaiming the seats of worker %s (pid %s) failed",
                             index, worker.pid)
    finally:
        m.workers.pop(index, None)
    _metrics_process_dead(worker.pid)


def _metrics_process_dead(pid) -> None:
    """The application's multiprocess metric files of a dead worker (if it uses them)."""
    from apf_gunicorn.server.metrics import mark_process_dead

    try:
        mark_process_dead(pid)
    except Exception:
        log.exception("apf: metrics cleanup for pid %s failed", pid)


def on_reload(server) -> None:
    m = state.MASTER
    if m is None:
        return
    settings = m.settings
    config_path = os.environ.get("APF_CONFIG", "").strip() or None
    if config_path != settings.config_path:
        import dataclasses
        settings = dataclasses.replace(settings, config_path=config_path)
    try:
        gen = load_generation(settings, m.generation.number + 1)
        from apf_gunicorn.server.master import SERVICE_LOCK
        with SERVICE_LOCK:
            configure_ledger(m.ledger, gen, time.monotonic_ns())
            m.generation = gen
            m.settings = settings
    except Exception as e:
        m.reload_errors += 1
        lines = config_error_lines(e)
        server.log.error("apf: reload rejected, the running configuration stays in force "
                         "(%d error(s)):", len(lines))
        for line in lines:
            server.log.error("apf:   %s", line)
        return
    server.log.info("apf: configuration generation %d applied: %d priority levels",
                    gen.number, len(gen.level_index))
    warning = thread_budget(gen, settings, server.cfg.workers, server.cfg.threads)
    if warning:
        server.log.warning("apf: %s", warning)


def on_exit(server) -> None:
    m = state.MASTER
    if m is None or os.getpid() != m.master_pid:
        return
    if m.services is not None:
        m.services.stop()
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


def post_worker_init(worker) -> None:
    problem = check_worker_class(type(worker))
    if problem:
        raise SystemExit(problem)  # gunicorn halts the server: the worker "failed to boot"
    m = state.MASTER
    if m is None:
        raise SystemExit("apf: the master did not set up the ledger (on_starting hook missing?)")

    from apf_gunicorn.ledger.ledger import Ledger
    from apf_gunicorn.server.channel import GrantInbox, GrantSender
    from apf_gunicorn.server.dispatcher import Dispatcher, Parking
    from apf_gunicorn.server.middleware import APFMiddleware, WorkerContext

    index = getattr(worker, "apf_index", None)
    if index is None:
        worker.log.error("apf: the ledger's worker table (%d entries) is full; this worker "
                         "(pid %s) serves WITHOUT priority and fairness. Restart the server "
                         "to size the table for the new number of workers.",
                         m.capacity.workers, os.getpid())
        return
    gen = m.generation
    lock = _worker_lock(_die_after(m.settings, worker))
    ledger = Ledger.attach(m.segment.ledger_buffer, lock=lock)
    ledger.register_worker(index, os.getpid(), time.monotonic_ns())
    inbox = GrantInbox(m.token, index)
    os.register_at_fork(after_in_child=_close_grant_socket_in_child)
    sender = GrantSender(m.token)
    parking = Parking()

    def deliver(granted, _grant=parking.grant, _me=index, _send=sender.send_grants):
        others = False
        for slot, gen_, owner in granted:
            if owner == _me:
                _grant(slot, gen_)
            else:
                others = True
        if others:
            _send(granted, _me)

    dispatcher = Dispatcher(parking, inbox, ledger, owner=index, deliver=deliver,
                            alive=lambda: worker.alive)
    ctx = WorkerContext(
        ledger=ledger, resolver=m.resolver, classifier=gen.classifier,
        level_index=gen.level_index, fs_index=gen.fs_index, owner=index, parking=parking,
        deliver=deliver, add_linger=dispatcher.add_linger,
        queue_wait_limit_ns=m.settings.queue_wait_limit_ns, alive=lambda: worker.alive,
        max_seats=level_max_seats(gen, m.settings), routes=route_table(m.resolver),
        work_estimator=_work_estimator(m.settings), load_report=_load_report(m, ledger, gen),
        **_optional_pieces(m, gen))
    middleware = APFMiddleware(worker.wsgi, ctx)
    worker.wsgi = middleware
    state.WORKER = state.WorkerState(index=index, pid=os.getpid(), ledger=ledger,
                                     parking=parking, dispatcher=dispatcher, inbox=inbox,
                                     sender=sender, middleware=middleware, worker=worker)
    dispatcher.start()


def _close_grant_socket_in_child() -> None:
    """A process the application forks (multiprocessing, os.fork) must not keep this worker's
    grant socket: it would hold the abstract name after the worker dies, and the replacement
    worker's bind would fail (EADDRINUSE in post_worker_init halts the whole server)."""
    w = state.WORKER
    if w is not None and w.inbox is not None and os.getpid() != w.pid:
        w.inbox.close()


def level_max_seats(gen, settings) -> dict[str, int]:
    """Per level, the widest request the work estimate is clamped to (docs/work-estimation.md)."""
    from apf_gunicorn.flowcontrol.workestimate import level_max_seats as widest

    levels = gen.configuration.priority_levels
    return {name: widest(lim, levels[name].is_exempt if name in levels else False,
                         settings.concurrency_limit)
            for name, lim in gen.limits.items()}


def route_table(resolver):
    """The APF_ROUTES table behind a resolver (the built-in one, or an APF_REQUEST_INFO hook's
    fallback), for its cost entries; None without one."""
    for candidate in (resolver, getattr(resolver, "fallback", None)):
        table = getattr(candidate, "routes", None)
        if table is not None:
            return table
    return None


def _work_estimator(settings):
    """The APF_WORK_ESTIMATOR hook (already imported by the master, so loading is cheap)."""
    if not settings.work_estimator:
        return None
    from apf_gunicorn.flowcontrol.workestimate import load_estimator_hook

    return load_estimator_hook(settings.work_estimator)


def _load_report(m, ledger, gen):
    """The worker's ORCA reporter when APF_LOAD_REPORT=orca, else None."""
    if getattr(m.settings, "load_report", "off") != "orca":
        return None
    from functools import partial

    from apf_gunicorn.server.loadreport import OrcaReport

    names = {i: name for name, i in gen.level_index.items()}
    return OrcaReport(partial(ledger.load, tuple(sorted(names))), names,
                      int(m.settings.load_report_interval_s * 1e9))


def _die_after(settings, worker) -> int:
    """Test only (APF_TEST_DIE_IN_LOCK=N): the first worker SIGKILLs itself inside its Nth
    critical section, so tests can check recovery from a lock holder that died."""
    if settings.test_die_in_lock and getattr(worker, "age", 0) == 1:
        return settings.test_die_in_lock
    return 0


def _optional_pieces(m, gen) -> dict:
    """Retry-After tracker and request-detail encoder, when those modules exist."""
    out = {}
    try:
        from apf_gunicorn.flowcontrol.retryafter import RetryAfterTracker
        out["retry_after"] = RetryAfterTracker()
    except ImportError:
        pass
    try:
        from apf_gunicorn.server.dumps import encode_detail
        out["encode_detail"] = encode_detail
    except ImportError:
        pass
    return out


def worker_exit(server, worker) -> None:
    w = state.WORKER
    if w is None or os.getpid() != w.pid:
        # gunicorn also calls worker_exit in the master when a worker is already gone.
        if state.MASTER is not None and os.getpid() == state.MASTER.master_pid:
            child_exit(server, worker)
        return
    w.parking.stop_all()
    deadline = time.monotonic() + 1.0
    while len(w.parking) and time.monotonic() < deadline:
        time.sleep(0.01)  # parked threads answer 503 and unpark
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


def _worker_lock(die_after: int):
    from apf_gunicorn.ledger.lock import ProcessLock

    if not die_after:
        return ProcessLock()

    class DyingLock(ProcessLock):
        """Test only: SIGKILLs this process while it holds the ledger lock."""

        count = 0

        def acquire(self):
            dead = super().acquire()
            DyingLock.count += 1
            if DyingLock.count == die_after:
                os.kill(os.getpid(), signal.SIGKILL)
            return dead

    return DyingLock()
