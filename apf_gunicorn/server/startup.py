"""What the server says when it starts: unknown ``APF_*`` variables, one "ready" line, and the
per-route notes of each worker, all through gunicorn's own error log (its format, timestamps
and ``--error-logfile``).

The hooks call, in this order::

    startup.route_logs(server.log)              # on_starting: apf_gunicorn.* loggers -> gunicorn
    startup.warn_unknown_variables(server.log)  # on_starting, once the settings are valid
    startup.log_identity(server.log, settings)  # on_starting: sources that never name anybody
    startup.log_ready(server.log, state.MASTER, server.cfg)   # when_ready, admin bound
    startup.log_route_notes(worker.log, app, routes, max_seats, generation, settings.paths)
                                                # post_worker_init, first worker

A misspelled setting (``APF_CONCURENCY_LIMIT=4``) would otherwise be ignored silently and the
server would run with another limit; it gets a warning naming the closest known variable. The
known names are the variables :func:`~apf_gunicorn.server.settings.load_settings` reads
(recorded while it runs, so the list cannot fall behind it) plus the few read elsewhere
(:data:`READ_ELSEWHERE`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

from apf_gunicorn.flowcontrol.kube_paths import path_parsing
from apf_gunicorn.flowcontrol.limits import MAX_SEATS_ANNOTATION
from apf_gunicorn.flowcontrol.routereach import reachable_levels
from apf_gunicorn.flowcontrol.suggest import closest
from apf_gunicorn.flowcontrol.workestimate import WorkEstimate, clamp
from apf_gunicorn.server.settings import SettingsError, load_settings

#: APF_* variables read outside load_settings: the switch off of the C fast path
#: (ledger/lock.py).
READ_ELSEWHERE = ("APF_NO_ACCELERATOR",)
PREFIX = "APF_"
#: The logger every module of the package logs under (``apf_gunicorn.middleware`` …).
PACKAGE_LOGGER = "apf_gunicorn"


# -- logging through gunicorn -----------------------------------------------------------------

class GunicornHandler(logging.Handler):
    """Hands the package's log records to gunicorn's error logger, whose handlers (set up by
    gunicorn, replaced on HUP) format and write them."""

    def __init__(self, error_log: logging.Logger) -> None:
        super().__init__()
        self.error_log = error_log

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= self.error_log.getEffectiveLevel():
            self.error_log.handle(record)


def route_logs(glog: Any) -> None:
    """Send every ``apf_gunicorn.*`` logger's records to gunicorn's error log, at its level.

    Without this they reach Python's last-resort handler: bare messages on stderr, warnings
    and errors only, no timestamps, and not in ``--error-logfile``. Called in the master
    before the first fork, so every worker inherits it. Idempotent.

    Args:
        glog: gunicorn's logger object (``server.log``); its ``error_log`` is the target.
    """
    error_log = getattr(glog, "error_log", None) or logging.getLogger("gunicorn.error")
    logger = logging.getLogger(PACKAGE_LOGGER)
    for handler in list(logger.handlers):
        if isinstance(handler, GunicornHandler):
            logger.removeHandler(handler)
    logger.addHandler(GunicornHandler(error_log))
    logger.setLevel(error_log.getEffectiveLevel())
    logger.propagate = False  # once is enough, whatever the root logger does


# -- unknown APF_* variables ------------------------------------------------------------------

class _Recording(Mapping):
    """A read-only view of an environment that remembers which keys were asked for."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self.asked: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.asked.add(key)
        return self.env[key]

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.asked.add(key)
        return key in self.env

    def __iter__(self) -> Iterator[str]:
        return iter(self.env)

    def __len__(self) -> int:
        return len(self.env)


def known_variables(env: Mapping[str, str] | None = None) -> set[str]:
    """Every ``APF_*`` variable the server reads.

    Args:
        env: the environment the settings are read from (default ``os.environ``); only which
            variables are read matters, not their values.

    Returns:
        The names :func:`load_settings` reads, plus :data:`READ_ELSEWHERE`.
    """
    recording = _Recording(os.environ if env is None else env)
    try:
        load_settings(recording)
    except SettingsError:
        pass  # the hook has already refused such settings; the names read so far still count
    return {k for k in recording.asked if k.startswith(PREFIX)} | set(READ_ELSEWHERE)


def unknown_variable_warnings(env: Mapping[str, str] | None = None) -> list[str]:
    """A warning per ``APF_*`` variable of ``env`` that nothing reads, with the closest known
    name when there is one (:func:`apf_gunicorn.flowcontrol.suggest.closest`).

    Args:
        env: the environment (default ``os.environ``).

    Returns:
        Messages such as ``"unknown setting APF_CONCURENCY_LIMIT is ignored; did you mean
        APF_CONCURRENCY_LIMIT?"``, sorted by variable name.
    """
    env = os.environ if env is None else env
    known = known_variables(env)
    out = []
    # compared without the common prefix, which would make every pair look alike
    suffixes = {k[len(PREFIX):]: k for k in sorted(known)}
    for name in sorted(k for k in env if k.startswith(PREFIX) and k not in known):
        close = closest(name[len(PREFIX):], suffixes)
        hint = (f"did you mean {suffixes[close]}?" if close
                else "known: " + ", ".join(k for k in sorted(known)
                                           if not k.startswith("APF_TEST_")))
        out.append(f"unknown setting {name} is ignored; {hint}")
    return out


def warn_unknown_variables(glog: Any, env: Mapping[str, str] | None = None) -> None:
    """Log :func:`unknown_variable_warnings` as warnings on gunicorn's log (``server.log``)."""
    for message in unknown_variable_warnings(env):
        glog.warning("apf: %s", message)


# -- identity sources that can never answer --------------------------------------------------

def identity_notes(settings: Any) -> list[tuple[int, str]]:
    """What the settings' identity sources can never do, for the log at start.

    ``proxy`` in ``APF_USER_FROM`` (it is in the default) with ``APF_TRUSTED_PROXIES`` empty
    never names anybody: identity headers are then ignored from every peer, and a proxy that
    sends them for its users makes them one anonymous flow. That is a warning when no other
    listed source can name a verified user (``APF_USER_FROM=proxy``: every request is
    anonymous), and a note at info when one can (the default ``proxy,remote_user``: a WSGI
    layer's ``REMOTE_USER`` still names users, so a server started with the defaults starts
    without a warning). At run time the resolver warns, rate-limited, whenever such headers
    do arrive from an untrusted peer (``RequestInfoResolver._untrusted_headers``). A JWT key
    without an audience accepts tokens issued for any audience: a warning. Sources after
    ``address`` are never asked for a TCP client, which ``address`` always names: a
    warning.

    Args:
        settings: the validated :class:`~apf_gunicorn.server.settings.Settings`.

    Returns:
        ``(logging level, message)`` pairs (none when every source can answer).
    """
    from apf_gunicorn.flowcontrol.identity import (
        ADDRESS,
        DEFAULT_USER_FROM,
        JWT_SUB,
        PROXY,
        REMOTE_USER,
    )

    sources = settings.user_from
    shown = ",".join(sources) + (" (the default)" if sources == DEFAULT_USER_FROM else "")
    out = []
    if PROXY in sources and not settings.trusted_proxies:
        others = [s for s in sources if s != PROXY]
        verified = [s for s in others
                    if s == REMOTE_USER or (s == JWT_SUB and settings.jwt_key is not None)]
        then = (f"requests are identified by {','.join(others)} or are anonymous" if others
                else "every request is system:anonymous, one flow for all clients")
        out.append((logging.INFO if verified else logging.WARNING,
                    f"identity source proxy of APF_USER_FROM={shown} never names anybody: "
                    f"APF_TRUSTED_PROXIES is empty, so {settings.user_header}/"
                    f"{settings.group_header} are ignored from every peer and {then}; set "
                    "APF_TRUSTED_PROXIES to your proxy's addresses (or unix), or leave proxy "
                    "out of APF_USER_FROM"))
    if settings.jwt_key is not None and settings.jwt_audience is None:
        out.append((logging.WARNING,
                    "APF_JWT_KEY without APF_JWT_AUDIENCE: a token the key verifies names its "
                    "sub whatever its aud, one issued for another service (another client of "
                    "the same identity provider) too; set APF_JWT_AUDIENCE to this server's "
                    "client ID (Kubernetes' OIDC authenticator requires one)"))
    after = sources[sources.index(ADDRESS) + 1:] if ADDRESS in sources else ()
    if after:
        out.append((logging.WARNING,
                    f"identity source{'s' if len(after) > 1 else ''} {','.join(after)} of "
                    f"APF_USER_FROM={shown} {'are' if len(after) > 1 else 'is'} asked only for "
                    "peers on a Unix socket: address before them names every TCP client; put "
                    "address last"))
    return out


def log_identity(glog: Any, settings: Any) -> None:
    """Log :func:`identity_notes` on gunicorn's log (``server.log``), each at its level."""
    for level, message in identity_notes(settings):
        glog.log(level, "apf: %s", message)


# -- the ready line ----------------------------------------------------------------------------

def ready_line(settings: Any, generation: Any, admin_address: tuple[str, int] | None,
               admin_state: str, workers: int, threads: int, holds_threads: bool = True,
               env: Mapping[str, str] | None = None) -> str:
    """The one line that says what the server runs with.

    Args:
        settings: the validated :class:`~apf_gunicorn.server.settings.Settings`.
        generation: the loaded configuration (``server.state.Generation``).
        admin_address: the admin endpoint's bound (host, port), or None.
        admin_state: ``"off"``, ``"busy"`` (the port is taken, retried) or ``"on"``.
        workers: gunicorn's ``workers``.
        threads: gunicorn's ``threads`` (an event-loop worker's: ``boot.LOOP_THREADS``).
        holds_threads: whether a request holds a thread (gthread); False: an event loop.
        env: the environment the settings came from (default ``os.environ``): whether
            ``APF_CONCURRENCY_LIMIT`` set the limit.

    Returns:
        e.g. ``"ready: configuration builtin:webapp (default), limit 64 seats (default: 2
        workers x 64 threads / 2), fairness maxmin (default), 4 priority levels: exempt
        (exempt), users 49 (fairness maxmin by annotation), anonymous 12, catch-all 3; admin
        http://127.0.0.1:9180/"``: every queuing level runs the ``fairness`` named
        first unless its ``apf-gunicorn.io/fairness`` annotation is shown.
    """
    from apf_gunicorn.server.generation import fairness_by_level
    from apf_gunicorn.server.settings import default_concurrency_limit

    if settings.config_path is None:
        why = f" when {settings.builtin_reason}" if settings.builtin_reason else ""
        config = f"{settings.config_source} (default{why}; set APF_CONFIG to change)"
    else:
        config = f"{settings.config_path} (APF_CONFIG)"
    limit = settings.concurrency_limit
    env = os.environ if env is None else env
    if env.get("APF_CONCURRENCY_LIMIT", "").strip():
        limit_src = "APF_CONCURRENCY_LIMIT"
    elif limit == default_concurrency_limit(workers, threads):
        limit_src = (f"default: {workers} workers x {threads} threads / 2" if holds_threads
                     else f"default: {workers} workers x {threads // 2} seats")
    else:
        limit_src = "default"
    if limit_src != "APF_CONCURRENCY_LIMIT":
        limit_src += "; follows the app's pools once found"
    elif settings.concurrency_auto is not None:
        limit_src += ("; signals: the app's pools once found, CPU, latency"
                      if settings.pool_signals else "; signals: CPU, latency")
    levels = generation.configuration.priority_levels
    default = generation.fairness
    fairness_src = "APF_FAIRNESS" if env.get("APF_FAIRNESS", "").strip() else "default"
    by_level = fairness_by_level(generation)
    parts = []
    for name, pl in levels.items():
        lim = generation.limits.get(name)
        if pl.is_exempt:
            parts.append(f"{name} (exempt)")
            continue
        part = f"{name} {int(lim.nominal) if lim is not None else '?'}"
        level_fairness, _source = by_level[name]
        if pl.fairness is not None:  # the annotation: name it even when it agrees
            part += f" (fairness {level_fairness} by annotation)"
        parts.append(part)
    if admin_state == "off":
        admin = "admin endpoint off (APF_ADMIN_BIND=off)"
    elif admin_state == "busy" or admin_address is None:
        host, port = settings.admin_bind or ("?", 0)
        admin = f"admin endpoint {host}:{port} is in use, retrying every second"
    else:
        host, port = admin_address
        shown = f"[{host}]" if ":" in host else host
        admin = f"admin http://{shown}:{port}/"
    auto = getattr(settings, "concurrency_auto", None)
    shown = f"{limit} seats" if auto is None else (
        f"auto (now {limit}) seats, within {auto[0]}-{auto[1]}, experimental")
    return (f"ready: configuration {config}, limit {shown} ({limit_src}), "
            f"fairness {default} ({fairness_src}), "
            f"{len(levels)} priority levels (nominal seats): {', '.join(parts)}; {admin}")


def log_ready(glog: Any, master: Any, cfg: Any) -> None:
    """Log :func:`ready_line` for the master state once the admin endpoint is bound
    (``when_ready``).

    Args:
        glog: gunicorn's logger (``server.log``).
        master: ``server.state.MASTER``.
        cfg: gunicorn's config (``server.cfg``), for workers and threads.
    """
    if master is None:
        return
    settings = master.settings
    services = master.services
    admin = getattr(services, "admin", None)
    if settings.admin_bind is None:
        state, address = "off", None
    elif admin is None:
        state, address = "busy", None
    else:
        state, address = "on", (admin.address[0], admin.port)
    segment = getattr(getattr(master, "segment", None), "name", "?")
    glog.info("apf: %s (ledger in shared memory %s)",
              ready_line(settings, master.generation, address, state, cfg.workers,
                         master.threads or cfg.threads, master.holds_threads),
              segment)


# -- per-route notes at worker start -------------------------------------------------------------

def declared_costs(app: Any, routes: Any) -> list[tuple[str, WorkEstimate]]:
    """Every cost declared up front: the views' ``@cost`` (Flask per method and rule, Django
    per view), then the cost entries of ``APF_ROUTES``.

    Args:
        app: the WSGI application (Flask and Django apps are read through their URL maps).
        routes: the ``APF_ROUTES`` table (``flowcontrol.routes.RouteTable``) or None.

    Returns:
        ``[(where, estimate)]``, ``where`` such as ``"@cost on GET /reports/<int:year>"`` or
        ``"APF_ROUTES routes[0] (/reports/<path:rest>)"``.
    """
    from apf_gunicorn.appcosts import declared_view_costs

    out = declared_view_costs(app)
    for i, route in enumerate(getattr(routes, "routes", None) or ()):
        if route.cost is not None:
            out.append((f"APF_ROUTES {routes.source}: routes[{i}] ({route.path})", route.cost))
    return out


def cost_routes(app: Any, routes: Any) -> dict[str, str]:
    """The route (URL path template) of each cost :func:`declared_costs` names."""
    from apf_gunicorn.appcosts import declared_view_routes

    out = declared_view_routes(app)
    for i, route in enumerate(getattr(routes, "routes", None) or ()):
        if route.cost is not None:
            out[f"APF_ROUTES {routes.source}: routes[{i}] ({route.path})"] = route.path
    return out


def cost_levels(app: Any, routes: Any, flow_schemas: Any,
                kubernetes_paths: bool) -> dict[str, set[str]]:
    """The priority levels the requests of each declared cost can land in
    (:func:`apf_gunicorn.flowcontrol.routereach.reachable_levels`); a cost whose route cannot
    be read that way is left out (every level counts for it)."""
    out = {}
    for where, template in cost_routes(app, routes).items():
        levels = reachable_levels(flow_schemas, template, kubernetes_paths)
        if levels is not None:
            out[where] = levels
    return out


def route_notes(costs: list[tuple[str, WorkEstimate]], max_seats: Mapping[str, int],
                exempt: set[str], annotated: set[str] = frozenset(),
                reachable: Mapping[str, set[str]] | None = None) -> list[str]:
    """A note for every declared cost some priority level clamps.

    Kubernetes clamps a request's seats to its level's widest request (``maxSeats``); which
    level a request lands in depends on who sends it, so each note names every level that
    would clamp it, and to what: every level its requests can reach.

    Args:
        costs: :func:`declared_costs`.
        max_seats: level name -> widest request it admits (``generation.level_max_seats``).
        exempt: names of exempt levels (never limited; left out).
        annotated: names of levels whose max seats the ``apf-gunicorn.io/max-seats``
            annotation sets (the note says so; the others follow Kubernetes' 15% rule).
        reachable: ``where`` -> the only levels its requests can land in (:func:`cost_levels`);
            a cost not in it may land in any level.

    Returns:
        Messages such as ``"@cost on GET /reports/<int:year> asks for 4 seat(s): clamped to
        1 on priority levels anonymous, catch-all (their widest request)"``.
    """
    notes = []
    reachable = reachable or {}
    for where, est in costs:
        by_result: dict[tuple[int, int], list[str]] = {}
        for level in sorted(max_seats):
            if level in exempt or (where in reachable and level not in reachable[where]):
                continue
            out = clamp(est, max_seats[level])
            if (out.initial_seats, out.final_seats) != (est.initial_seats, est.final_seats):
                by_result.setdefault((out.initial_seats, out.final_seats), []).append(level)
        if not by_result:
            continue
        asks = f"{est.initial_seats} seat(s)"
        if est.final_seats:
            asks += f" and {est.final_seats} final seat(s)"
        clamps = "; ".join(
            f"clamped to {i}" + (f" (final {f})" if est.final_seats else "")
            + f" on priority level{'s' if len(names) > 1 else ''} {', '.join(names)}"
            for (i, f), names in sorted(by_result.items()))
        levels = {name for names in by_result.values() for name in names}
        if levels <= set(annotated):
            origin = f"set by their {MAX_SEATS_ANNOTATION} annotation"
        else:
            origin = (f"Kubernetes' 15% rule unless an {MAX_SEATS_ANNOTATION} annotation "
                      "sets it")
        notes.append(f"{where} asks for {asks}: {clamps} (a level's widest request, "
                     f"{origin}; see docs/work-estimation.md)")
    return notes


def log_route_notes(glog: Any, app: Any, routes: Any, max_seats: Mapping[str, int],
                    generation: Any, paths: str = "kubernetes") -> None:
    """Log :func:`route_notes` and the view costs that cannot take effect
    (:func:`apf_gunicorn.appcosts.unusable_costs`) as warnings (``post_worker_init``, first
    worker).

    Args:
        glog: the worker's gunicorn logger (``worker.log``).
        app: the application, before the middleware wraps it.
        routes: the ``APF_ROUTES`` table or None.
        max_seats: level name -> widest request.
        generation: the loaded configuration (``server.state.Generation``): which levels are
            exempt, which FlowSchemas lead where.
        paths: ``APF_PATHS`` (whether ``/api/`` paths may be Kubernetes API requests, whose
            levels are not told from the route).
    """
    from apf_gunicorn.appcosts import unusable_costs

    try:
        levels = generation.configuration.priority_levels
        exempt = {name for name, pl in levels.items() if pl.is_exempt}
        annotated = {name for name, pl in levels.items() if pl.max_seats is not None}
        schemas = generation.configuration.flow_schemas
        kubernetes_paths, _ = path_parsing(paths, schemas)
        notes = route_notes(declared_costs(app, routes), max_seats, exempt, annotated,
                            cost_levels(app, routes, schemas, kubernetes_paths))
        notes += unusable_costs(app)
    except Exception:  # a note is never worth a worker that does not boot
        glog.exception("apf: could not read the declared costs")
        return
    for note in notes:
        glog.warning("apf: %s", note)
