"""The WSGI middleware: API Priority and Fairness in front of any WSGI app.

Per request: attributes -> FlowSchema and priority level -> work estimate -> ``ledger.admit``;
then run now, or park the thread until the ledger grants the request, its wait limit runs out
(429, ``time-out``), its client leaves (``cancelled``), the worker stops (503) or another
flow's request takes its thread (429, ``thread-share``: gthread/threadshare.py). The seats
are given back (``ledger.finish``) when the response body has been sent or closed, or when
the app raises; a watch or a long-running request holds them only until the app returns its
iterable (its initial phase). Lingering seats (final seats, additional latency) are released
by the dispatcher.

Work estimate, highest precedence first: the ``APF_WORK_ESTIMATOR`` hook (called per request,
``None`` or a failure falls through), a Flask or Django view's ``@cost`` (found through the
app's ``url_map`` or URLconf), a cost entry of ``APF_ROUTES``, ``WorkerContext.estimator`` (default: one seat);
clamped to the level's max seats. Everything but the hook is computed once per request shape
and kept in the shape cache with the classification, so a request without a cost takes the
same one-seat fast path as before.

Metrics cost nothing here: the ledger records every per-request event (dispatched, rejected,
wait, execution, estimated seats) under the lock ``admit``/``finish``/``cancel`` already hold,
and the master exports them at scrape time. 429s carry the level's server-wide Retry-After:
the worker's tracker is fed the ledger's cumulative rejected count of the level
(``RetryAfterTracker.observe_total``), so every worker answers the same back-off.

With ``APF_LOAD_REPORT=orca`` (``WorkerContext.load_report``) every response APF handled also
carries the worker's cached ORCA ``endpoint-load-metrics`` header, and a 429
``x-envoy-ratelimited`` (``admission/loadreport.py``).

Usage (``post_worker_init`` does this)::

    worker.wsgi = APFMiddleware(worker.wsgi, WorkerContext(...))

The plugin itself never answers 500: if anything in the APF path fails before the app runs,
the request is served without APF and the error is logged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from gunicorn.http.wsgi import HEADER_VALUE_RE as _GUNICORN_VALUE_RE
from gunicorn.http.wsgi import TOKEN_RE as _GUNICORN_NAME_RE
from gunicorn.http.wsgi import Response as _GunicornResponse

from apf_gunicorn.admission.dispatcher import (
    CANCELLED,
    GRANTED,
    STOPPING,
    Parking,
    finish_request,
)
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
from apf_gunicorn.gthread.threadshare import ThreadShare, reserve_full
from apf_gunicorn.ledger.records import EXECUTE, QUEUED, LedgerPort

log = logging.getLogger("apf_gunicorn.middleware")


MAX_WAIT_NS = 60_000_000_000
_CACHE_SIZE = 4096
FS_UID_HEADER = "X-Kubernetes-PF-FlowSchema-UID"
PL_UID_HEADER = "X-Kubernetes-PF-PriorityLevel-UID"
TOO_MANY = b"Too many requests, please try again later.\n"
STOPPING_BODY = b"Server is shutting down, please retry.\n"

# Set by the gthread subclass (gthread/worker.py) on the request thread: when gunicorn queued
# the connection for a thread. Lets the wait limit count the time spent in gthread's queue.
hidden = threading.local()


@dataclass
class WorkerContext:
    """Everything the middleware binds at construction (one per worker process)."""

    ledger: LedgerPort
    resolver: Callable[[dict], Any]
    classifier: Any
    level_index: dict[str, int]
    fs_index: dict[str, int]
    owner: int
    parking: Parking
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
    # The worker's thread reserve (gthread/worker.py): one entry per thread a non-exempt request
    # holds; at most ``nonexempt_threads`` of them, the other threads are for exempt requests.
    # None: no reserve (a worker class other than ApfThreadWorker).
    inflight: list | None = None
    nonexempt_threads: int = 0
    load_report: Any = None  # server.loadreport.OrcaReport (APF_LOAD_REPORT=orca) or None
    # Finishes (slot, gen) on another thread without taking any lock here (the dispatcher's
    # finish_later): what a response body's finalizer calls. None: a finalizer returns nothing.
    finish_later: Callable[[int, int], None] | None = None
    # server.routekinds.RouteTimes with APF_CONCURRENCY_LIMIT=auto (service time per route,
    # this worker's row: ``owner``), else None
    route_times: Any = None




def _gunicorn_accepts(headers: list[tuple[str, str]]) -> bool:
    """Whether gunicorn's own response-header checks pass ``headers`` (then they can go
    straight into its header list: see ``APFMiddleware.__call__``)."""
    return all(_GUNICORN_NAME_RE.fullmatch(n) and _GUNICORN_VALUE_RE.fullmatch(v)
               for n, v in headers)


class Shape(NamedTuple):
    """What the middleware decides once per request shape (cached by the environ values the
    built-in resolver reads)."""

    level: int  # the ledger's level index
    flow_hash: int
    initial: int  # seats while the request runs
    final: int  # seats held after it, for ``al`` ns (Kubernetes' final seats)
    al: int  # additional latency, ns
    fs_index: int  # the ledger's FlowSchema index (stats entry)
    detail: bytes  # encoded request attributes for the dumps
    early: bool  # seats go back when the app returns its iterable (watch, long-running);
    #              also admit's ``watch`` (the execution histogram's type)
    route: _Route
    attrs: Any  # flowcontrol.requestinfo.RequestAttributes
    c: Any  # flowcontrol.matching.Classification
    # with APF_CONCURRENCY_LIMIT=auto: the word offset of the route's counters in this
    # worker's row of server.routekinds.RouteTimes; -1: not counted (exempt, or a fixed limit)
    kind: int = -1


class _Route:
    """What the middleware needs per FlowSchema, computed once."""

    __slots__ = ("level", "fs_index", "headers", "level_name", "fs_name", "max_seats", "exempt",
                 "checked", "inflight")

    def __init__(self, level, fs_index, headers, level_name, fs_name, max_seats, exempt,
                 inflight=None):
        self.level = level
        self.fs_index = fs_index
        self.headers = headers
        self.level_name = level_name
        self.fs_name = fs_name
        self.max_seats = max_seats
        self.exempt = exempt
        # the worker's list of threads non-exempt requests hold (None: exempt, or no reserve)
        self.inflight = None if exempt else inflight
        # the headers passed gunicorn's checks once: no need to have them checked per request
        self.checked = _gunicorn_accepts(headers)


REJECTED_STATUS = "429 Too Many Requests"


def rejection_headers(route: _Route, retry: int) -> list[tuple[str, str]]:
    """The headers of a 429 (body :data:`TOO_MANY`) for a request of ``route``'s FlowSchema:
    what the middleware and the worker's poller both answer (the ORCA headers aside).

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


class APFMiddleware:
    def __init__(self, app: Callable, ctx: WorkerContext):
        self.app = app
        self.ctx = ctx
        self._routes: dict[str, _Route] = {}
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
        self._nonexempt_threads = ctx.nonexempt_threads
        # who holds the parked threads, by flow (only with a thread reserve: route.inflight)
        self._share = ThreadShare() if ctx.inflight is not None else None
        self._rejected_total = ctx.ledger.rejected_total
        self._reject_if_full = getattr(ctx.ledger, "reject_if_full", None)
        self._orca = ctx.load_report
        self._route_times = ctx.route_times
        self._rt = None if ctx.route_times is None else ctx.route_times.words
        self.stats = {"served": 0, "queued": 0, "rejected": 0, "timeout": 0, "cancelled": 0,
                      "stopping": 0, "bypassed": 0, "turned_away": 0, "thread_share": 0}

    # -- the request path ------------------------------------------------------------------

    def __call__(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        try:
            shape = self.shape_of(environ)
            # Shape's fields, unpacked at once (cheaper than eleven attribute reads)
            (level, flow_hash, initial, final, al, fs_index, detail, early, route, attrs, c,
             kind) = shape
            if self._hook is not None:
                dynamic = self._hook(environ, attrs, c)
                if dynamic is not None:
                    est = self._clamped(dynamic, route, "APF_WORK_ESTIMATOR")
                    early = attrs.verb == "watch" or (est is not None and est.long_running)
                    if est is None:
                        initial, final, al = 1, 0, 0
                    else:
                        initial, final, al = (est.initial_seats, est.final_seats,
                                              est.additional_latency_ns)
            now = self._clock()
            inflight = route.inflight
            if inflight is not None:
                # The thread reserve: append first, then check, so racing threads can only
                # both turn away, never both take the last non-exempt thread.
                inflight.append(None)
                if (reserve_full(len(inflight) - 1, self._nonexempt_threads)
                        and not self._take_parked_thread(inflight, level, flow_hash)):
                    inflight.pop()
                    return self._turn_away(start_response, route, fs_index,
                                           initial if initial >= final else final, now)
                hidden.held = True  # the worker pops the entry when the thread is done
            # positional: cheaper than keywords on the per-request path
            outcome, slot, gen, _reason, granted = self._admit(
                level, flow_hash, initial, final, al, self._owner, now, fs_index, detail, early)
        except Exception:
            log.exception("apf: admission failed; serving the request without APF")
            self.stats["bypassed"] += 1
            return self.app(environ, start_response)

        if granted:
            self._deliver(granted)
        if outcome != EXECUTE:
            if outcome != QUEUED:
                return self._reject(start_response, route)
            answer = self._wait(environ, start_response, slot, gen, route, now, flow_hash)
            if answer is not None:
                return answer
            if kind >= 0:
                now = self._clock()  # dispatched: the route's service time starts here
        # Run the app (inline rather than a method: one Python frame less per request).
        headers = route.headers
        if self._orca is not None:  # APF_LOAD_REPORT=orca: the cached ORCA header
            headers = self._orca.extend(headers, now)
        self.stats["served"] += 1
        resp = getattr(start_response, "__self__", None)
        if route.checked and type(resp) is _GunicornResponse:
            # gunicorn checks every header of every response with two regular expressions
            # (~3.5k instructions each for these two); ours are constant and passed those
            # checks once (_Route.checked), so they join its list after the app's are checked.
            def sr(status, response_headers, exc_info=None):
                write = start_response(status, response_headers, exc_info)
                resp.headers.extend(headers)
                return write
        else:
            def sr(status, response_headers, exc_info=None):
                return start_response(status, [*response_headers, *headers], exc_info)

        try:
            result = self.app(environ, sr)
        except BaseException:
            self._finish(slot, gen)
            raise
        if early:
            # Kubernetes: a watch holds its seats only for its initialization; so does any
            # request declared long-running.
            self._finish(slot, gen)
            return result
        if type(result) is not list:  # (a list is never a file wrapper: skip the lookup)
            file_wrapper = environ.get("wsgi.file_wrapper")
            if file_wrapper is not None and isinstance(result, file_wrapper):
                hooked = self._finish_on_close(result, slot, gen)
                if hooked is not None:
                    return hooked
        body = _new_body(_Body)
        body._result = result
        body._mw = self
        body._slot = slot
        body._gen = gen
        body._kind = kind
        body._t0 = now
        return body

    def shape_of(self, environ: dict) -> Shape:
        """What the request's shape decides (:class:`Shape`): from the per-shape cache when the
        built-in resolver classifies (its inputs are known), else classified now.

        Args:
            environ: the request's WSGI environ (the keys the resolver reads suffice: see
                ``gthread/pollreject.py``).
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

    # -- rejecting from the worker's poller (gthread/pollreject.py) -------------------------

    @property
    def poller_classifies(self) -> bool:
        """Whether a request can be classified and rejected from its head alone: the built-in
        resolver (a custom ``APF_REQUEST_INFO`` hook may read anything in the environ), no
        ``APF_WORK_ESTIMATOR`` hook (it is called with the full environ), no ORCA load report
        (its header is per response), and a ledger that can reject without admitting."""
        return (self._cache is not None and self._hook is None and self._orca is None
                and self._reject_if_full is not None)

    def thread_share_rejects(self, route: _Route, level: int, flow_hash: int) -> bool:
        """Whether the worker's thread reserve turns this request away now (reason
        ``thread-reserve``): no thread for a non-exempt request is free, and no other flow
        holds parked threads this request could take (:func:`threadshare.choose_victim`). The
        one place the poller asks; what the middleware decides on a thread (``__call__``)
        agrees, but for a victim dispatched meanwhile (then the thread path turns it away).

        Args:
            route: the request's FlowSchema route; level, flow_hash: its flow.
        Returns:
            True when the request would be answered 429 for want of a thread.
        """
        inflight = route.inflight
        if inflight is None or not reserve_full(len(inflight), self._nonexempt_threads):
            return False
        return self._share is None or not self._share.has_victim_for((level, flow_hash))

    def reject_early(self, environ: dict, now: int) -> tuple[_Route, int, int, str] | None:
        """Reject the request now if the middleware would certainly reject it on a thread: the
        thread reserve applies (:meth:`thread_share_rejects`), or the ledger's ``admit`` would
        reject it (queue full, a Reject-type level full, no slot: ``reject_if_full``, exact
        under the ledger's lock). Counted exactly as the middleware counts a rejection.

        Args:
            environ: what the resolver reads of the request (``pollreject.HeadReader``).
            now: monotonic ns.
        Returns:
            ``(route, retry_after_s, flow_hash, reason)`` when rejected (answer
            :func:`rejection_headers`; ``reason`` is the one it was counted with), None when
            the request must go to a thread as usual (nothing was counted).
        Raises:
            Exception: whatever classification or the ledger raise (the caller then hands
            the request to a thread, which decides as usual).
        """
        level, flow_hash, initial, final, al, fs_index, detail, early, route, _, _, _ = (
            self.shape_of(environ))
        if route.exempt:
            return None
        if self.thread_share_rejects(route, level, flow_hash):
            self.stats["turned_away"] += 1
            reason = "thread-reserve"
            self.ctx.ledger.turn_away(level, fs_index, initial if initial >= final else final,
                                      reason, now)
        else:
            reason = self._reject_if_full(level, flow_hash, initial, final, al, self._owner,
                                          now, fs_index, detail, early)
            if not reason:
                return None
        self.stats["rejected"] += 1
        return route, self._retry_after(route), flow_hash, reason

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

    def _clamped(self, est: WorkEstimate, route: _Route, source: str) -> WorkEstimate | None:
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

    def _route(self, c) -> _Route:
        fs, pl = c.flow_schema, c.priority_level
        headers = [(FS_UID_HEADER, fs.uid or ""), (PL_UID_HEADER, pl.uid or "")]
        route = _Route(self.ctx.level_index[pl.name], self.ctx.fs_index.get(fs.name, 0),
                       headers, pl.name, fs.name, self.ctx.max_seats.get(pl.name, 1 << 30),
                       pl.is_exempt, self.ctx.inflight)
        self._routes[fs.name] = route
        self._max_origin[pl.name] = max_seats_origin(pl)
        return route

    def _wait(self, environ, start_response, slot, gen, route, admitted_ns, flow_hash):
        """Park until granted (returns None: run the request) or answer 429/503."""
        ctx = self.ctx
        self.stats["queued"] += 1
        limit = ctx.queue_wait_limit_ns
        qs = environ.get("QUERY_STRING", "")
        if "timeout=" in qs:
            limit = _timeout_wait_limit(qs, limit)
        arrival = getattr(hidden, "enqueued_ns", 0) or admitted_ns
        if arrival > admitted_ns:
            arrival = admitted_ns
        deadline = arrival + limit
        fd = -1
        if environ.get("HTTP_VERSION") != "2":
            sock = environ.get("gunicorn.socket")
            if sock is not None:
                try:
                    fd = sock.fileno()
                except OSError:
                    fd = -1
        parking = ctx.parking
        w = parking.park(slot, gen, fd)
        # (only a request holding a thread of the reserve's count can give it up)
        parked = (self._share.park((route.level, flow_hash), slot, gen, w)
                  if route.inflight is not None else None)
        if not ctx.alive():
            parking._wake(w, STOPPING)
        # runs only once the ledger says it was dispatched, whatever woke it
        outcome = parking.wait(w, deadline, self._clock, ctx.ledger.dispatched)
        if parked is not None and self._share.leave(parked):
            # Another flow's request took this thread: the ledger removed and counted this
            # one (thread-share), and its entry in the thread reserve went to that request.
            hidden.held = False
            self.stats["thread_share"] += 1
            return self._reject(start_response, route)
        if outcome == GRANTED:
            return None
        reason = "cancelled" if outcome in (CANCELLED, STOPPING) else "time-out"
        try:
            removed = ctx.ledger.cancel(slot, gen, self._clock(), reason)
        except Exception:
            log.exception("apf: cancel failed")
            removed = True
        if not removed:
            # Dispatched meanwhile: it holds seats and must run and finish after all, unless
            # its client is gone.
            if outcome == CANCELLED:
                self._finish(slot, gen)
                self.stats["cancelled"] += 1
                return self._reject(start_response, route)
            return None
        if outcome == STOPPING:
            self.stats["stopping"] += 1
            start_response("503 Service Unavailable", [
                ("Content-Type", "text/plain; charset=utf-8"), ("Retry-After", "1"),
                ("Content-Length", str(len(STOPPING_BODY))),
                ("Connection", "close"), *route.headers, *self._load_headers(False)])
            return [STOPPING_BODY]
        if outcome == CANCELLED:
            # The client is gone; answer anyway so the server's bookkeeping stays normal.
            self.stats["cancelled"] += 1
            return self._reject(start_response, route)
        self.stats["timeout"] += 1
        return self._reject(start_response, route)

    def _take_parked_thread(self, inflight: list, level: int, flow_hash: int) -> bool:
        """For a request that found no non-exempt thread: take the thread of the newest
        parked request of the flow holding the most parked threads, if that flow holds more
        than the request's own (gthread/threadshare.py). That request is removed from the
        ledger (``thread-share``) and woken to answer 429; its entry in ``inflight`` is given
        up here, the arrival's stays.

        Returns:
            True when a thread was taken; False: turn the arrival away.
        """
        ledger, clock = self.ctx.ledger, self._clock
        try:
            victim = self._share.evict((level, flow_hash),
                                 lambda slot, gen: ledger.cancel(slot, gen, clock(),
                                                                 "thread-share"))
        except Exception:
            log.exception("apf: taking a parked thread failed")
            return False
        if victim is None:
            return False
        inflight.pop()  # the victim's: its thread answers 429 and no longer counts
        self.ctx.parking.evict(victim.waiter)
        return True

    def _turn_away(self, start_response, route, fs_index: int, seats: int, now: int):
        """429 (``thread-reserve``) for a non-exempt request that would take one of the threads
        kept for exempt requests; counted in the ledger like a rejection at admit."""
        self.stats["turned_away"] += 1
        try:
            self.ctx.ledger.turn_away(route.level, fs_index, seats, "thread-reserve", now)
        except Exception:
            log.exception("apf: counting a thread-reserve rejection failed")
        return self._reject(start_response, route)

    def _reject(self, start_response, route):
        """429 with the level's server-wide Retry-After."""
        self.stats["rejected"] += 1
        start_response(REJECTED_STATUS, [
            *rejection_headers(route, self._retry_after(route)), *self._load_headers(True)])
        return [TOO_MANY]

    def _retry_after(self, route: _Route) -> int:
        """The level's server-wide Retry-After, in seconds, for a rejection just counted."""
        tracker = self.ctx.retry_after
        if tracker is None:
            return 1
        try:
            return tracker.observe_total(route.level_name, self._rejected_total(route.level))
        except Exception:
            log.exception("apf: retry-after tracker failed")
            return 1

    def _load_headers(self, rejected: bool) -> list:
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

    def _finish_on_close(self, result, slot: int, gen: int):
        """A ``wsgi.file_wrapper`` response keeps sendfile: hook its close instead of wrapping
        it. None when it cannot be hooked (then it is wrapped like any iterable)."""
        orig_close = getattr(result, "close", None)

        def close():
            try:
                if orig_close is not None:
                    orig_close()
            finally:
                self._finish(slot, gen)

        try:
            result.close = close
        except AttributeError:
            return None
        return result

    def _finish(self, slot: int, gen: int) -> None:
        finish_request(self._finish_ledger, self._deliver, self.ctx.add_linger, slot, gen,
                       self._clock())


class _Body:
    """Wraps the app's response iterable; gives the seats back on close (exactly once).

    Built without ``__init__`` (``_new_body`` plus attribute stores: one Python call less
    per request); ``_mw`` is set to None once the seats are given back."""

    __slots__ = ("_result", "_mw", "_slot", "_gen", "_kind", "_t0")

    def __iter__(self):
        return iter(self._result)

    def close(self):
        try:
            close = getattr(self._result, "close", None)
            if close is not None:
                close()
        finally:
            mw = self._mw
            if mw is not None:
                self._mw = None
                # APFMiddleware._finish inline: this runs once per request
                slot, gen = self._slot, self._gen
                end = mw._clock()
                kind = self._kind
                if kind >= 0:  # APF_CONCURRENCY_LIMIT=auto: the route's service time
                    words = mw._rt
                    words[kind] += 1
                    words[kind + 1] += end - self._t0
                try:
                    granted, linger_until = mw._finish_ledger(slot, gen, end)
                except Exception:
                    log.exception("apf: finish failed for slot %d", slot)
                else:
                    if granted:
                        mw._deliver(granted)
                    if linger_until:
                        mw.ctx.add_linger(linger_until, slot, gen)

    def __del__(self):
        # A server that never calls close() must not leak seats. A finalizer may run on any
        # thread, one inside a ledger call included (the lock is not reentrant): hand the
        # finish to the dispatcher thread, never take the ledger lock here.
        mw = self._mw
        if mw is not None:
            self._mw = None
            finish_later = mw.ctx.finish_later
            if finish_later is not None:
                finish_later(self._slot, self._gen)


_new_body = object.__new__


def _timeout_wait_limit(query: str, default_ns: int) -> int:
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
