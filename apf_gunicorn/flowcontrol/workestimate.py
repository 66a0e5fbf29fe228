"""Work estimates: how many seats a request occupies, and for how long after it returns.

Kubernetes' ``WorkEstimate``: ``initial_seats`` while the request executes; afterwards the
request may keep ``final_seats`` for ``additional_latency_ns`` (the ledger reserves
``max(initial, final)`` seats for both phases). ``long_running`` requests (streams, like
Kubernetes' watches) hold their seats only until the app has returned its response iterable.
The default gives every request one seat and no tail, as Kubernetes does for anything that is
not a list or a mutation.

Where a cost comes from (highest first; see docs/work-estimation.md): the ``APF_WORK_ESTIMATOR``
hook (:class:`EstimatorHook`), a Flask or Django view's ``@cost`` (:mod:`apf_gunicorn.flask`,
:mod:`apf_gunicorn.django`), a route
entry of ``APF_ROUTES`` (:mod:`.routes`), the default one seat. Whatever the source, the result
is clamped to the level's max seats (:func:`clamp`, :func:`level_max_seats`).

Usage::

    from apf_gunicorn.flowcontrol.workestimate import WorkEstimate, make_estimate, clamp
    est = make_estimate(seats=4, final_seats=2, additional_latency="50ms")
    est = clamp(est, max_seats=3)            # WorkEstimate(3, 2, 50_000_000, False)
    hook = load_estimator_hook("myapp.apf:estimate")
    est = hook(environ, attrs, classification)   # WorkEstimate, or None: no opinion / failed

A per-shape estimator is any callable ``(RequestAttributes, Classification) -> WorkEstimate``
(``WorkerContext.estimator``); it replaces the default one seat and is cached per request shape.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from apf_gunicorn.flowcontrol.gomath import parse_duration
from apf_gunicorn.flowcontrol.hookspec import import_callable
from apf_gunicorn.flowcontrol.suggest import unknown_keys

log = logging.getLogger("apf_gunicorn.workestimate")

#: Largest tail accepted from a declaration: a final-seat tail longer than this is a mistake.
MAX_ADDITIONAL_LATENCY_NS = 3600 * 10**9
#: Largest seat count accepted from a declaration (the clamp brings it down to the level's).
MAX_DECLARED_SEATS = 1_000_000
_LOGGED_LIMIT = 256


class WorkEstimate(NamedTuple):
    initial_seats: int = 1
    final_seats: int = 0
    additional_latency_ns: int = 0
    long_running: bool = False

    @property
    def max_seats(self) -> int:
        return max(self.initial_seats, self.final_seats)


ONE_SEAT = WorkEstimate(1, 0, 0, False)

Estimator = Callable[[Any, Any], WorkEstimate]


class EstimateError(ValueError):
    """A bad cost declaration; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}")


def default_estimator(attrs: Any, classification: Any) -> WorkEstimate:
    """One seat, no tail (allocation-free: returns a shared constant)."""
    return ONE_SEAT


def _seats(field: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise EstimateError(field, f"must be an integer >= {minimum}, got {value!r}")
    if value < minimum or value > MAX_DECLARED_SEATS:
        raise EstimateError(field, f"must be an integer from {minimum} to {MAX_DECLARED_SEATS}, "
                                   f"got {value}")
    return value


def duration_ns(field: str, value: Any) -> int:
    """A tail length as integer nanoseconds: a Go duration string ("50ms", "1.5s"), a
    ``datetime.timedelta`` or the integer 0."""
    if isinstance(value, str):
        try:
            ns = parse_duration(value.strip())
        except Exception as exc:
            raise EstimateError(field, f"{value!r} is not a Go duration such as '50ms' or "
                                       f"'1.5s': {exc}") from None
    elif isinstance(value, datetime.timedelta):
        ns = (value.days * 86400 + value.seconds) * 10**9 + value.microseconds * 1000
    elif value == 0 and not isinstance(value, bool) and isinstance(value, int):
        ns = 0
    else:
        raise EstimateError(field, f"must be a Go duration string such as '50ms' (or a "
                                   f"timedelta), got {value!r}")
    if ns < 0 or ns > MAX_ADDITIONAL_LATENCY_NS:
        raise EstimateError(field, f"must be from 0 to 1h, got {value!r}")
    return ns


def make_estimate(seats: int = 1, final_seats: int = 0, additional_latency: Any = 0,
                  long_running: bool = False, *, additional_latency_ns: int | None = None,
                  names: Mapping[str, str] | None = None) -> WorkEstimate:
    """A validated estimate; raises :class:`EstimateError` naming the bad field.

    ``additional_latency``: a Go duration string, a timedelta or 0; or give
    ``additional_latency_ns`` (int). ``names`` renames the fields in error messages (the route
    file says ``finalSeats`` where Python says ``final_seats``).
    """
    names = names or {}
    initial = _seats(names.get("seats", "seats"), seats, 1)
    final = _seats(names.get("final_seats", "final_seats"), final_seats, 0)
    if additional_latency_ns is not None:
        field = names.get("additional_latency_ns", "additional_latency_ns")
        if (isinstance(additional_latency_ns, bool) or not isinstance(additional_latency_ns, int)
                or not 0 <= additional_latency_ns <= MAX_ADDITIONAL_LATENCY_NS):
            raise EstimateError(field, f"must be an integer number of nanoseconds from 0 to "
                                       f"{MAX_ADDITIONAL_LATENCY_NS}, got {additional_latency_ns!r}")
        latency = additional_latency_ns
    else:
        latency = duration_ns(names.get("additional_latency", "additional_latency"),
                              additional_latency)
    if not isinstance(long_running, bool):
        raise EstimateError(names.get("long_running", "long_running"),
                            f"must be true or false, got {long_running!r}")
    if final == 0:
        latency = 0  # nothing lingers: a tail without seats is no tail
    return WorkEstimate(initial, final, latency, long_running)


_RESULT_KEYS = {"seats": "seats", "initial_seats": "seats", "final_seats": "final_seats",
                "additional_latency": "additional_latency",
                "additional_latency_ns": "additional_latency_ns", "long_running": "long_running"}


def estimate_from_result(result: Any) -> WorkEstimate | None:
    """What an estimator hook returned, checked: a WorkEstimate, a dict with the keys of
    :func:`make_estimate` (``seats`` or ``initial_seats``, ``final_seats``,
    ``additional_latency`` or ``additional_latency_ns``, ``long_running``), or None (no
    opinion). Raises TypeError/ValueError for anything else."""
    if result is None:
        return None
    if isinstance(result, WorkEstimate):
        return make_estimate(result.initial_seats, result.final_seats,
                             additional_latency_ns=result.additional_latency_ns,
                             long_running=result.long_running)
    if isinstance(result, Mapping):
        unknown = set(result) - set(_RESULT_KEYS)
        if unknown:
            raise ValueError(unknown_keys(unknown, _RESULT_KEYS, "work estimate "))
        kwargs = {_RESULT_KEYS[k]: v for k, v in result.items()}
        if "additional_latency" in kwargs and "additional_latency_ns" in kwargs:
            raise ValueError("give additional_latency or additional_latency_ns, not both")
        return make_estimate(**kwargs)
    raise TypeError(f"expected a WorkEstimate, a dict or None, got {type(result).__name__}")


def declared_estimate(method: str, path: str, view_costs: Any, route_costs: Any
                      ) -> tuple[WorkEstimate | None, str]:
    """The cost declared for a request shape: a view's ``@cost``, else an ``APF_ROUTES``
    cost entry (the middleware and ``apf-gunicorn explain`` both ask this).

    Args:
        method: the upper-cased HTTP method.
        path: the URL path.
        view_costs: the app's view costs (``lookup(method, path)``, from
            :func:`apf_gunicorn.appcosts.view_costs_for_app`) or None.
        route_costs: a :class:`.routes.RouteTable` with cost entries (``cost(method, path)``)
            or None.

    Returns:
        ``(estimate, source)`` with source ``"@cost"`` or ``"APF_ROUTES"``; ``(None, "")``
        when neither declares one.
    """
    if view_costs is not None:
        est = view_costs.lookup(method, path)
        if est is not None:
            return est, "@cost"
    if route_costs is not None:
        est = route_costs.cost(method, path)
        if est is not None:
            return est, "APF_ROUTES"
    return None, ""


def clamp(est: WorkEstimate, max_seats: int) -> WorkEstimate:
    """Clamp the seats to ``[1, max_seats]`` (initial) and ``[0, max_seats]`` (final),
    keeping the tail's area (seats x latency) when the final seats are cut, as Kubernetes'
    mutating estimator does."""
    initial = min(max(1, est.initial_seats), max(1, max_seats))
    final = max(0, est.final_seats)
    latency = max(0, est.additional_latency_ns)
    if final > max_seats >= 1:
        latency = latency * final // max_seats
        final = max_seats
    if final == 0:
        latency = 0
    return WorkEstimate(initial, final, latency, bool(est.long_running))


def level_max_seats(limits: Any, exempt: bool, server_limit: int) -> int:
    """The widest request a level admits, for the clamp.

    Queuing levels: Kubernetes' ``maxSeats`` (``LevelLimits.max_seats``, 15% of the nominal
    limit, at most nominal / handSize, at least 1). Kubernetes stores nothing for the others
    and falls back to its estimators' fixed caps (10 or 100); our costs are the operator's, so
    a ``Reject`` level uses its nominal concurrency limit and an exempt level the server's
    concurrency limit (exempt requests are never limited; the seats only show in the metrics).
    """
    if exempt:
        return max(1, server_limit)
    if limits.max_seats:
        return int(limits.max_seats)
    return max(1, int(limits.nominal))


class HookLoadError(ValueError):
    """``APF_WORK_ESTIMATOR`` names nothing callable (raised at start, never per request)."""


class EstimatorHook:
    """A user function ``(environ, attributes, classification) -> WorkEstimate | dict | None``.

    Calling the object returns a checked (unclamped) WorkEstimate, or None when the function
    has no opinion (returned None) or failed: it raised or returned something unusable. A
    failure is logged once per distinct error (type and message) and counted in
    ``failures``; the caller then uses the next estimate in line.
    """

    def __init__(self, fn: Callable[[dict, Any, Any], Any], name: str = "") -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", repr(fn))
        self.failures = 0  # approximate under threads
        self._logged: set[tuple[str, str]] = set()

    def __call__(self, environ: dict, attrs: Any, classification: Any) -> WorkEstimate | None:
        try:
            return estimate_from_result(self.fn(environ, attrs, classification))
        except Exception as exc:
            self.failures += 1
            key = (type(exc).__name__, str(exc)[:200])
            if key not in self._logged and len(self._logged) < _LOGGED_LIMIT:
                self._logged.add(key)
                log.error("APF_WORK_ESTIMATOR %s failed (%s: %s); using the route/default cost "
                          "(logged once per distinct error)", self.name, key[0], key[1],
                          exc_info=True)
            return None


def load_estimator_hook(spec: str) -> EstimatorHook:
    """Import ``module:callable`` (dotted attributes allowed after the colon).

    Raises :class:`HookLoadError` naming the spec when it cannot be imported or is not callable.
    """
    obj = import_callable(spec, "APF_WORK_ESTIMATOR", HookLoadError)
    return EstimatorHook(obj, name=spec)
