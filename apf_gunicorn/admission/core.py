"""The admission path both front ends share: classify -> admit -> wait -> finish.

A front end (``gthread/wsgi.py`` for WSGI apps on threads, ``asgi/middleware.py`` for ASGI
apps on an event loop) subclasses :class:`Admission` and writes only how a request waits (a
parked thread, an awaited future) and how it is answered (``start_response``, ASGI ``send``).
Every rule about admission is here, once:

* what a request shape decides (:meth:`Admission.shape_of`: FlowSchema, priority level, flow,
  seats from ``@cost`` / ``APF_ROUTES`` / the estimator, clamped to the level's max seats; cached
  per shape when the built-in resolver classifies);
* the ``APF_WORK_ESTIMATOR`` hook per request (:meth:`Admission.hook_estimate`);
* the wait limit, ``?timeout=`` included (:meth:`Admission.wait_deadline`);
* what a finished wait means, the race with a grant included (:meth:`Admission.after_wait`);
* the 429 and 503 answers and the server-wide Retry-After (:meth:`Admission.reject_headers`,
  :meth:`Admission.stopping_headers`, :func:`rejection_headers`);
* giving the seats back, with auto's service time per route (:meth:`Admission.finish_timed`).

The per-request sequence, as a front end runs it (positional arguments: the hot path)::

    level, flow_hash, initial, final, al, fs_index, detail, early, route, attrs, c, kind = (
        self.shape_of(environ))
    outcome, slot, gen, _reason, granted = self._admit(
        level, flow_hash, initial, final, al, self._owner, now, fs_index, detail, early)
    if granted: self._deliver(granted)
    # EXECUTE: run; QUEUED: wait (the front end's parking), then self.after_wait(...);
    # anything else: 429 with self.reject_headers(route)
    ...
    self.finish_timed(slot, gen, kind, t0)     # exactly once, when the response is done

``environ`` is a WSGI environ, or for ASGI the few WSGI keys the resolver reads, built from the
scope (``asgi/scope.py``). The plugin never answers 500: a front end serves a request without
APF (logged, counted as ``bypassed``) when anything here fails before the app runs.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gunicorn.http.wsgi import HEADER_VALUE_RE as _GUNICORN_VALUE_RE
from gunicorn.http.wsgi import TOKEN_RE as _GUNICORN_NAME_RE

from apf_gunicorn.admission.dispatcher import CANCELLED, GRANTED, STOPPING, finish_request
from apf_gunicorn.flowcontrol.gomath import parse_duration
from apf_gunicorn.flowcontrol.limits import max_seats_origin
from apf_gunicorn.flowcontrol.requestinfo import MAX_METHOD_LENGTH, MAX_PATH_LENGTH, wsgi_str
from apf_gunicorn.flowcontrol.workestimate import (
    ONE_SEAT,
    EstimatorHook,
    WorkEstimate,
    clamp,
    declared_estimate,
    default_estimator,
)
from apf_gunicorn.ledger.lock import LockBusy
from apf_gunicorn.ledger.records import LedgerPort

log = logging.getLogger("apf_gunicorn.middleware")

MAX_WAIT_NS = 60_000_000_000
_CACHE_SIZE = 4096
FS_UID_HEADER = "X-Kubernetes-PF-FlowSchema-UID"
PL_UID_HEADER = "X-Kubernetes-PF-PriorityLevel-UID"
TOO_MANY = b"Too many requests, please try again later.\n"
STOPPING_BODY = b"Server is shutting down, please retry.\n"
REJECTED_STATUS = "429 Too Many Requests"
STOPPING_STATUS = "503 Service Unavailable"

# What a finished wait means (Admission.after_wait)
RUN = 0  # dispatched: run the request (and finish it later)
REJECT = 1  # answer 429 (wait limit, client gone, or its thread taken); nothing to finish
STOPPED = 2  # answer 503 (the worker is stopping); nothing to finish


@dataclass
class WorkerContext:
    """Everything the admission path binds at construction (one per worker process)."""

    ledger: LedgerPort
    resolver: Callable[[dict], Any]
    classifier: Any
    level_index: dict[str, int]
    fs_index: dict[str, int]
    owner: int
    parking: Any  # dispatcher.Parking (threads) or asyncparking.AsyncParking (an event loop)
    deliver: Callable[[list], None]
    add_linger: Callable[[int, int, int], None]
    queue_wait_limit_ns: int
    alive: Callable[[], bool]
    retry_after: Any = None  # flowcontrol.retryafter.RetryAfterTracker or None
    encode_detail: Callable[..., bytes] | None = None
    estimator: Callable[[Any, Any], Any] = default_estimator  # per shape: (attrs, c)
    max_seats: dict[str, int] = field(default_factory=dict)  # level -> widest request (clamp)
    routes: Any = None  # flowcontrol.routes.RouteTable (its cost entries) or None
    work_estimator: Any = None  # EstimatorHook (or a plain callable) for APF_WORK_ESTIMATOR
    clock: Callable[[], int] = time.monotonic_ns
    # The gthread worker's thread reserve (gthread/worker.py): one entry per thread a
    # non-exempt request holds; at most ``nonexempt_threads`` of them, the other threads are
    # for exempt requests. None: no reserve (an event loop has no threads to keep).
    inflight: list | None = None
    nonexempt_threads: int = 0
    load_report: Any = None  # admission.loadreport.OrcaReport (APF_LOAD_REPORT=orca) or None
    # Finishes (slot, gen) on another thread without taking any lock here (the dispatcher's
    # finish_later): what a response body's finalizer calls. None: a finalizer returns nothing.
    finish_later: Callable[[int, int], None] | None = None
    # admission.routekinds.RouteTimes with APF_CONCURRENCY_LIMIT=auto (service time per route,
    # this worker's row: ``owner``), else None
    route_times: Any = None
    # APF_PF_HEADERS: False leaves the X-Kubernetes-PF-* headers out of every answer (Route)
    pf_headers: bool = True


def _gunicorn_accepts(headers: list[tuple[str, str]]) -> bool:
    """Whether gunicorn's own response-header checks pass ``headers`` (then the WSGI front end
    can put them straight into its header list)."""
    return all(_GUNICORN_NAME_RE.fullmatch(n) and _GUNICORN_VALUE_RE.fullmatch(v)
               for n, v in headers)


def raw_headers(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """``headers`` as ASGI wants them: lower-case names, both as latin-1 bytes."""
    return [(n.lower().encode("latin-1"), v.encode("latin-1")) for n, v in headers]


class Route:
    """What admission needs per FlowSchema, computed once."""

    __slots__ = ("level", "fs_index", "headers", "level_name", "fs_name", "max_seats", "exempt",
                 "checked", "inflight", "raw_headers")

    def __init__(self, level, fs_index, headers, level_name, fs_name, max_seats, exempt,
                 inflight=None):
        self.level = level
        self.fs_index = fs_index
        # the PF headers (empty with APF_PF_HEADERS=off), built once per FlowSchema of the
        # worker's configuration generation (a reload starts new workers)
        self.headers = headers
        # the same, as ASGI wants them (lower-case names, bytes)
        self.raw_headers = raw_headers(headers)
        self.level_name = level_name
        self.fs_name = fs_name
        self.max_seats = max_seats
        self.exempt = exempt
        # the worker's list of threads non-exempt requests hold (None: exempt, or no reserve)
        self.inflight = None if exempt else inflight
        # the headers passed gunicorn's checks once: no need to have them checked per request
        self.checked = _gunicorn_accepts(headers)


class Shape(NamedTuple):
    """What admission decides once per request shape (cached by the environ values the
    built-in resolver reads)."""

    level: int  # the ledger's level index
    flow_hash: int
    initial: int  # seats while the request runs
    final: int  # seats held after it, for ``al`` ns (Kubernetes' final seats)
    al: int  # additional latency, ns
    fs_index: int  # the ledger's FlowSchema index (stats entry)
    detail: bytes  # encoded request attributes for the dumps
    early: bool  # seats go back once the response has started (watch, long-running);
    #              also admit's ``watch`` (the execution histogram's type)
    route: Route
    attrs: Any  # flowcontrol.requestinfo.RequestAttributes
    c: Any  # flowcontrol.matching.Classification
    # with APF_CONCURRENCY_LIMIT=auto: the word offset of the route's counters in this
    # worker's row of admission.routekinds.RouteTimes; -1: not counted (exempt, or a fixed limit)
    kind: int = -1


def rejection_headers(route: Route, retry: int) -> list[tuple[str, str]]:
    """The headers of a 429 (body :data:`TOO_MANY`) for a request of ``route``'s FlowSchema:
    what every front end answers (the ORCA headers aside).

    Args:
        route: the request's FlowSchema route (its PF headers).
        retry: the Retry-After, seconds.
    Returns:
        The headers, in order.
    """
    return [("Content-Type", "text/plain; charset=utf-8"),
            ("X-Content-Type-Options", "nosniff"),
            ("Retry-After", str(retry)),
            ("Content-Length", str(len(TOO_MANY))),
            *route.headers]


def timeout_wait_limit(query: str, default_ns: int) -> int:
    """Wait limit for ``?timeout=<Go duration>``: a quarter of it, capped at 60 s."""
    for part in query.split("&"):
        if part.startswith("timeout="):
            try:
                ns = parse_duration(part[8:])
            except Exception:
                return default_ns
            if ns > 0:
                return min(ns // 4, MAX_WAIT_NS)
            return default_ns
    return default_ns


class Admission:
    """The shared admission core of one worker process; a front end subclasses it.

    Args:
        app: the application (WSGI or ASGI), for its declared view costs.
        ctx: the worker's context (:class:`WorkerContext`).
    """

    def __init__(self, app: Any, ctx: WorkerContext):
        self.app = app
        self.ctx = ctx
        self._routes: dict[str, Route] = {}
        from apf_gunicorn.flowcontrol.requestinfo import RequestInfoResolver

        # Only the built-in resolver's inputs are known; a custom APF_REQUEST_INFO hook may
        # read anything, so its requests are classified every time.
        builtin = type(ctx.resolver) is RequestInfoResolver
        self._cache: dict[tuple, tuple] | None = {} if builtin else None
        # The values of every environ key the built-in resolver reads (APF_USER_FROM's too)
        self._shape_key = ctx.resolver.shape_key if builtin else None
        # classifies by the identity the shape key holds (a token is verified once a request)
        self._resolve_shape = ctx.resolver.resolve_shape if builtin else None
        self._admit = ctx.ledger.admit
        self._deliver = ctx.deliver
        self._finish_ledger = ctx.ledger.finish
        self._add_linger = ctx.add_linger
        self._finish_later = ctx.finish_later
        self._clock = ctx.clock
        self._owner = ctx.owner
        self._resolve = ctx.resolver
        self._classify = ctx.classifier.classify
        self._estimate = ctx.estimator
        # The default estimator always says one seat, no tail: skip the call and the clamp.
        self._one_seat = ctx.estimator is default_estimator
        from apf_gunicorn.appcosts import view_costs_for_app

        self._view_costs = view_costs_for_app(app)
        routes = ctx.routes
        self._route_costs = routes if getattr(routes, "has_costs", False) else None
        # Whether any per-shape source can say something other than one seat.
        self._shape_costs = (self._view_costs is not None or self._route_costs is not None
                             or not self._one_seat)
        hook = ctx.work_estimator
        if hook is not None and not isinstance(hook, EstimatorHook):
            hook = EstimatorHook(hook)
        self._hook = hook
        self._clamp_logged: set[tuple] = set()
        self._max_origin: dict[str, str] = {}  # level -> where its max seats come from
        self._rejected_total = ctx.ledger.rejected_total
        self._orca = ctx.load_report
        self._route_times = ctx.route_times
        self._rt = None if ctx.route_times is None else ctx.route_times.words
        self.stats = {"served": 0, "queued": 0, "rejected": 0, "timeout": 0, "cancelled": 0,
                      "stopping": 0, "bypassed": 0, "turned_away": 0, "thread_share": 0}

    # -- the one-call path in C --------------------------------------------------------------

    def _gate(self, sources: tuple | None = None, headers: dict | None = None,
              held: Any = None, busy_declines: bool = False) -> Any:
        """The C request gate for this front end (``Gate`` in ``ledger/_fastpath.c``), or None
        when the Python path must run every request: no C extension bound to the ledger, a
        custom resolver (its inputs are unknown), or an ``APF_WORK_ESTIMATOR`` hook (called
        per request with the whole environ).

        The gate admits a request whose shape is cached and which runs at once in one call
        (``admit_environ``/``admit_scope``: the shape key, the cache lookup, the thread
        reserve, ``ledger.admit``), and gives it back in one (``finish_timed``, bound over
        this method here); anything else it declines having changed nothing, and the front
        end runs :meth:`shape_of` and ``_admit`` as without it.

        Args:
            sources: for a scope, where each shape key entry comes from
                (``asgi/scope.py``'s ``ScopeEnviron.key_sources``); None: a WSGI environ.
            headers: for a scope, header name (bytes) -> its entry's index.
            held: what gets ``held = True`` when a request takes a thread reserve entry.
            busy_declines: decline when the ledger lock is busy (an event loop never waits).
        """
        fp = getattr(self.ctx.ledger, "c_fastpath", None)
        if (fp is None or self._cache is None or self._hook is not None
                or self._admit != fp.admit_call or self._finish_ledger != fp.finish_call):
            return None
        from apf_gunicorn.ledger.fastpath import _ACCEL

        gate_type = getattr(_ACCEL, "Gate", None)  # (an extension built before it: none)
        if gate_type is None:
            return None
        resolver = self.ctx.resolver
        keys = tuple(resolver.environ_keys)
        transforms = tuple(resolver.key_transforms.get(k) for k in keys)
        gate = gate_type(fp, self._cache, keys, transforms, sources, headers, self._owner,
                           self._clock, self.ctx.inflight, self.ctx.nonexempt_threads, held,
                           Admission.finish_timed.__get__(self), self._finish_handed,
                           self._finish_later, busy_declines)
        self.finish_timed = gate.finish_timed
        return gate

    # -- what a request's shape decides ----------------------------------------------------

    def shape_of(self, environ: Any) -> Shape:
        """What the request's shape decides (:class:`Shape`): from the per-shape cache when the
        built-in resolver classifies (its inputs are known), else classified now.

        Args:
            environ: the request's WSGI environ, or a mapping of the keys the resolver reads
                (``gthread/pollreject.py``, ``asgi/scope.py``).
        Returns:
            The shape.
        """
        cache = self._cache
        if cache is None:
            return self._classify_request(environ)
        # Everything the built-in resolver reads: the classification is a pure function of it,
        # and most requests repeat a few shapes.
        key = self._shape_key(environ.get)
        shape = cache.get(key)
        if shape is None:
            shape = self._classify_request(environ, key)
            if len(cache) >= _CACHE_SIZE:
                cache.clear()
            cache[key] = shape
        return shape

    def hook_estimate(self, environ: Any, attrs: Any, c: Any, route: Route
                      ) -> tuple[int, int, int, bool] | None:
        """The ``APF_WORK_ESTIMATOR`` hook's cost of this request (it sees the whole environ).

        Returns:
            ``(initial, final, additional_latency_ns, early)``, or None when there is no hook
            or it says nothing (then the shape's cost stands).
        """
        dynamic = self._hook(environ, attrs, c)
        if dynamic is None:
            return None
        est = self._clamped(dynamic, route, "APF_WORK_ESTIMATOR")
        early = attrs.verb == "watch" or (est is not None and est.long_running)
        if est is None:
            return 1, 0, 0, early
        return est.initial_seats, est.final_seats, est.additional_latency_ns, early

    def _classify_request(self, environ, key: tuple | None = None) -> Shape:
        """Everything a request shape decides (:class:`Shape`); ``key``: its shape key, whose
        identity the built-in resolver uses (None: a hook's resolver, which reads anything)."""
        attrs = self._resolve(environ) if key is None else self._resolve_shape(environ, key)
        c = self._classify(attrs)
        route = self._routes.get(c.flow_schema.name)
        if route is None:
            route = self._route(c)
        detail = b""
        if self.ctx.encode_detail is not None:
            try:
                detail = self.ctx.encode_detail(attrs, c)
            except Exception:
                detail = b""
        est = self._shape_estimate(environ, attrs, c, route) if self._shape_costs else None
        early = attrs.verb == "watch" or (est is not None and est.long_running)
        kind = -1
        if self._route_times is not None and not route.exempt and not early:
            path = wsgi_str(environ.get("PATH_INFO"), MAX_PATH_LENGTH) or "/"
            kind = self._route_times.offset(self._owner, route.level_name, route.fs_name, path)
        if est is None:  # one seat, no tail: the common case
            return Shape(route.level, c.flow_hash, 1, 0, 0, route.fs_index, detail, early,
                         route, attrs, c, kind)
        return Shape(route.level, c.flow_hash, est.initial_seats, est.final_seats,
                     est.additional_latency_ns, route.fs_index, detail, early, route, attrs, c,
                     kind)

    def _shape_estimate(self, environ, attrs, c, route) -> WorkEstimate | None:
        """The per-shape cost: a view's ``@cost`` > route file > ctx.estimator; None: one seat."""
        get = environ.get
        method = wsgi_str(get("REQUEST_METHOD"), MAX_METHOD_LENGTH).upper() or "GET"
        path = wsgi_str(get("PATH_INFO"), MAX_PATH_LENGTH) or "/"
        est, source = declared_estimate(method, path, self._view_costs, self._route_costs)
        if est is None:
            if self._one_seat:
                return None
            est, source = self._estimate(attrs, c), "estimator"
        return self._clamped(est, route, f"{source} for {method} {path}")

    def _clamped(self, est: WorkEstimate, route: Route, source: str) -> WorkEstimate | None:
        """``est`` within the level's max seats; None when that is plain one seat."""
        if est == ONE_SEAT:
            return None
        out = clamp(est, route.max_seats)
        if out.initial_seats != est.initial_seats or out.final_seats != est.final_seats:
            key = (route.level_name, est.initial_seats, est.final_seats)
            if key not in self._clamp_logged and len(self._clamp_logged) < 1024:
                self._clamp_logged.add(key)
                log.warning("apf: %s asks for %d seat(s) (final %d) but priority level %r admits "
                            "at most %d seat(s) per request; clamped to %d (final %d); that "
                            "maximum is %s",
                            source, est.initial_seats, est.final_seats, route.level_name,
                            route.max_seats, out.initial_seats, out.final_seats,
                            self._max_origin.get(route.level_name, "the level's"))
        return None if out == ONE_SEAT else out

    def _route(self, c) -> Route:
        fs, pl = c.flow_schema, c.priority_level
        headers = ([(FS_UID_HEADER, fs.uid or ""), (PL_UID_HEADER, pl.uid or "")]
                   if self.ctx.pf_headers else [])
        route = Route(self.ctx.level_index[pl.name], self.ctx.fs_index.get(fs.name, 0),
                      headers, pl.name, fs.name, self.ctx.max_seats.get(pl.name, 1 << 30),
                      pl.is_exempt, self.ctx.inflight)
        self._routes[fs.name] = route
        self._max_origin[pl.name] = max_seats_origin(pl)
        return route

    # -- waiting ---------------------------------------------------------------------------

    def wait_deadline(self, query: str, arrival_ns: int) -> int:
        """When a queued request's wait ends: arrival + the wait limit (``APF_QUEUE_WAIT_LIMIT``,
        or a quarter of the request's ``?timeout=``, at most 60 s).

        Args:
            query: the request's query string; arrival_ns: when it arrived (monotonic ns).
        Returns:
            The deadline, monotonic ns.
        """
        limit = self.ctx.queue_wait_limit_ns
        if "timeout=" in query:
            limit = timeout_wait_limit(query, limit)
        return arrival_ns + limit

    def after_wait(self, outcome: int, slot: int, gen: int) -> int:
        """What a queued request's finished wait means, counted in :attr:`stats`.

        A request whose wait ended without a grant (deadline, client gone, worker stopping) is
        taken out of the ledger; if it was dispatched meanwhile it holds seats, and runs after
        all unless its client is gone (then its seats are given back here).

        Args:
            outcome: the parking's: GRANTED, CANCELLED, STOPPING, or 0 (the deadline passed).
            slot, gen: the request in the ledger.
        Returns:
            :data:`RUN` (run it; finish it later), :data:`REJECT` (answer 429 with
            :meth:`reject_headers`) or :data:`STOPPED` (answer 503 with
            :meth:`stopping_headers`).
        """
        if outcome == GRANTED:
            return RUN
        reason = "cancelled" if outcome in (CANCELLED, STOPPING) else "time-out"
        try:
            removed = self.ctx.ledger.cancel(slot, gen, self._clock(), reason)
        except LockBusy:
            raise  # nothing done: the event-loop front end runs this again off the loop
        except Exception:
            log.exception("apf: cancel failed")
            removed = True
        if not removed:
            # Dispatched meanwhile: it holds seats and must run and finish after all, unless
            # its client is gone.
            if outcome == CANCELLED:
                self.finish(slot, gen)
                self.stats["cancelled"] += 1
                return REJECT
            return RUN
        if outcome == STOPPING:
            self.stats["stopping"] += 1
            return STOPPED
        # The client is gone (CANCELLED): answer anyway so the server's bookkeeping stays
        # normal.
        self.stats["cancelled" if outcome == CANCELLED else "timeout"] += 1
        return REJECT

    # -- answers ---------------------------------------------------------------------------

    def reject_headers(self, route: Route) -> list[tuple[str, str]]:
        """Count a 429 and return its headers (with the level's server-wide Retry-After and,
        with ``APF_LOAD_REPORT=orca``, the load report); the body is :data:`TOO_MANY`."""
        return [*rejection_headers(route, self.count_rejection(route)), *self.load_headers(True)]

    def count_rejection(self, route: Route) -> int:
        """Count a 429 of ``route``'s level; its server-wide Retry-After, in seconds."""
        self.stats["rejected"] += 1
        return self.retry_after(route)

    def stopping_headers(self, route: Route) -> list[tuple[str, str]]:
        """The headers of a 503 (body :data:`STOPPING_BODY`) for a queued request of a
        stopping worker."""
        return [("Content-Type", "text/plain; charset=utf-8"), ("Retry-After", "1"),
                ("Content-Length", str(len(STOPPING_BODY))),
                ("Connection", "close"), *route.headers, *self.load_headers(False)]

    def retry_after(self, route: Route) -> int:
        """The level's server-wide Retry-After, in seconds, for a rejection just counted."""
        tracker = self.ctx.retry_after
        if tracker is None:
            return 1
        try:
            return tracker.observe_total(route.level_name, self._rejected_total(route.level))
        except Exception:
            log.exception("apf: retry-after tracker failed")
            return 1

    def load_headers(self, rejected: bool) -> list:
        """The ORCA header (and ``x-envoy-ratelimited`` on a 429) when APF_LOAD_REPORT=orca."""
        orca = self._orca
        if orca is None:
            return []
        try:
            now = self._clock()
            return orca.reject_headers(now) if rejected else orca.extend([], now)
        except Exception:
            log.exception("apf: load report failed")
            return []

    # -- finishing -------------------------------------------------------------------------

    def finish(self, slot: int, gen: int) -> None:
        """Give a request's seats back now (never raises; on an event loop whose ledger lock
        is busy, the dispatcher thread gives them back)."""
        try:
            finish_request(self._finish_ledger, self._deliver, self._add_linger, slot, gen,
                           self._clock())
        except LockBusy:
            self._finish_later(slot, gen)

    def finish_timed(self, slot: int, gen: int, kind: int, t0: int) -> None:
        """Give a served request's seats back (never raises); with ``APF_CONCURRENCY_LIMIT=auto``
        its route's service time (from ``t0``, when it was dispatched) is counted first.

        Args:
            slot, gen: the request; kind: its Shape's ``kind`` (-1: not counted); t0: ns.
        """
        end = self._clock()
        if kind >= 0:
            words = self._rt
            words[kind] += 1
            words[kind + 1] += end - t0
        self._finish_at(self._finish_ledger, slot, gen, end)

    def _finish_handed(self, decline: int, slot: int, gen: int, end: int) -> None:
        """Where the C gate's ``finish_timed`` hands over with the ledger lock held
        (``decline``: -1, or the pid of a dead holder): the ledger continues from its
        acquire."""
        self._finish_at(functools.partial(self.ctx.ledger._finish_resume, decline), slot, gen,
                        end)

    def _finish_at(self, finish: Callable, slot: int, gen: int, end: int) -> None:
        """``finish(slot, gen, end)`` (the ledger's finish), and what its result asks for."""
        try:
            granted, linger_until = finish(slot, gen, end)
        except LockBusy:  # an event loop does not wait for the lock: the dispatcher does
            self._finish_later(slot, gen)
            return
        except Exception:
            log.exception("apf: finish failed for slot %d", slot)
            return
        if granted:
            self._deliver(granted)
        if linger_until:
            self._add_linger(linger_until, slot, gen)
