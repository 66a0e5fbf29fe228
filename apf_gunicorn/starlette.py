"""Per-route request costs for FastAPI and Starlette apps served by apf_gunicorn.

Tag an endpoint with what one request to it costs; the ASGI middleware finds the endpoint of
each request through the app's own route objects and admits the request with that many
seats::

    from apf_gunicorn.starlette import cost

    @app.get("/reports/{year}")              # FastAPI; @cost may sit above or below it
    @cost(seats=4, final_seats=2, additional_latency="50ms")
    async def report(year: int): ...

    @cost(long_running=True)                 # seats held only until the response starts
    async def events(request): return StreamingResponse(stream())
    routes = [Route("/events", events)]      # Starlette

    class Items(HTTPEndpoint):
        @cost(seats=3)                       # per HTTP method of an HTTPEndpoint (or on it)
        async def post(self, request): ...

The arguments are those of :func:`apf_gunicorn.flask.cost` (checked at import: a bad cost
fails at start). The decorator only sets an attribute and returns the endpoint itself, and
``@app.get(...)`` registers and returns the function it decorates, so ``@cost`` works above
or below FastAPI's decorators and under decorators that use ``functools.wraps``. Flask's and
Django's decorators on a Starlette endpoint are not read; they are reported at start and by
``apf-gunicorn explain`` (:func:`apf_gunicorn.appcosts.unusable_costs`), as this module's
decorator on a Flask or Django view is.

Matching is Starlette's own: each route's ``matches`` on a request scope, routes in order,
the first full match wins, a ``Mount`` is entered (its app's routes: a Starlette or FastAPI
sub-app, a ``Router``, also behind ``.app`` middleware) and a FastAPI ``include_router`` is
walked as FastAPI dispatches it. So HEAD reaches a Starlette GET route and not a FastAPI one,
exactly as the app answers; a method no route takes (405), a trailing-slash redirect and a 404
run no endpoint and get no cost. Not seen: ``Host`` routes (the lookup has no host),
WebSocket routes (a handshake is admitted with one seat). Each (method, path) is matched once
and kept in a bounded LRU (:func:`apf_gunicorn.viewcost.cached_by_path`).

Nothing here imports Starlette: an app is Starlette's only if Starlette is loaded. The app
gunicorn loads must be the Starlette or FastAPI app, or pure-ASGI middleware that keeps it in
``.app`` (Starlette's, Sentry's and OpenTelemetry's do; up to :data:`MAX_WRAPPERS`); costs
behind a wrapper that hides it are reported at start (:func:`unreachable_costs`).
"""

from __future__ import annotations

import logging
import re
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from apf_gunicorn.django import django_handler
from apf_gunicorn.flowcontrol.workestimate import WorkEstimate
from apf_gunicorn.viewcost import (
    CACHE_SIZE,
    HTTP_METHODS,
    STARLETTE_ATTRIBUTE,
    NamedView,
    cached_by_path,
    costs_for_app,
    declares_cost,
    is_flask_like,
    tag,
    view_cost,
    view_handler,
    view_name,
)

log = logging.getLogger("apf_gunicorn.starlette")

#: The attribute ``@cost`` sets on an endpoint function, method or class.
COST_ATTRIBUTE = STARLETTE_ATTRIBUTE
#: How many ASGI wrappers are looked through (``.app``) to find the Starlette app.
MAX_WRAPPERS = 4
#: How deep mounts are followed (a router mounted in itself would otherwise never end).
_MAX_DEPTH = 16
_PARAMETER = re.compile(r"\{([^{}]*)\}")

F = TypeVar("F")

# Every endpoint this module's decorator tagged, to report costs no reachable app can read.
_tagged: weakref.WeakSet = weakref.WeakSet()


def cost(seats: int = 1, final_seats: int = 0, additional_latency: Any = 0,
         long_running: bool = False) -> Callable[[F], F]:
    """Declare what one request to the decorated FastAPI or Starlette endpoint costs.

    Args:
        seats: seats held while the endpoint runs (>= 1).
        final_seats: seats kept after the response for ``additional_latency``.
        additional_latency: a Go duration such as ``"50ms"``, or a timedelta.
        long_running: give the seats back once the response has started, not when its body
            has been sent (a ``StreamingResponse``, server-sent events).

    Returns:
        A decorator for an endpoint function, an ``HTTPEndpoint`` class or one of its
        handler methods, or a mounted ASGI app.

    Raises:
        ValueError: naming the bad argument.
    """
    decorate = tag(COST_ATTRIBUTE, seats, final_seats, additional_latency, long_running)

    def remember(endpoint: F) -> F:
        decorate(endpoint)
        try:
            _tagged.add(endpoint)
        except TypeError:  # not weakly referable: only the hidden-app report misses it
            pass
        return endpoint

    return remember


def _routing() -> Any:
    """``starlette.routing`` if the process loaded it, else None."""
    return sys.modules.get("starlette.routing")


def starlette_app(app: Any) -> Any:
    """The Starlette app (FastAPI's too) or ``Router`` behind ``app``: itself, or kept in
    ``.app`` by up to :data:`MAX_WRAPPERS` ASGI wrappers; else None. Never imports
    Starlette."""
    routing = _routing()
    if routing is None:
        return None
    applications = sys.modules.get("starlette.applications")
    kinds = (routing.Router,) if applications is None else (routing.Router,
                                                             applications.Starlette)
    for _ in range(MAX_WRAPPERS + 1):
        if isinstance(app, kinds):
            return app
        try:
            app = getattr(app, "app", None)
        except Exception:  # a wrapper whose attributes fail to read
            return None
        if app is None:
            return None
    return None


def app_root_path(app: Any) -> str:
    """The root path a FastAPI app behind ``app`` (:func:`starlette_app`) puts in every scope
    over the server's (``FastAPI(root_path="/api")``: its ``__call__`` sets it before routing),
    or ``""``. The ASGI front end strips it as the app's router does
    (:class:`~apf_gunicorn.asgi.scope.ScopeEnviron`), so FlowSchemas, ``APF_ROUTES`` and
    ``@cost`` see the path the app routes on. Never imports FastAPI."""
    applications = sys.modules.get("fastapi.applications")
    found = starlette_app(app)
    if applications is None or not isinstance(found, applications.FastAPI):
        return ""
    root = getattr(found, "root_path", "")
    return root if isinstance(root, str) else ""


def _routes(routes: Iterable[Any]) -> Iterable[Any]:
    """The routes as the router dispatches them: FastAPI (since 0.13x) keeps an included
    router as one route and dispatches into it with the include's prefix; its public
    ``iter_route_contexts`` (what its OpenAPI uses) lists those in order, each with the
    prefixed ``path``, ``matches`` and ``endpoint`` of the route it serves."""
    iter_contexts = getattr(sys.modules.get("fastapi.routing"), "iter_route_contexts", None)
    return routes if iter_contexts is None else iter_contexts(list(routes))


def _mounted(route: Any) -> tuple[list | None, Any]:
    """(routes of the app a ``Mount`` serves, or None; the app it calls)."""
    found = starlette_app(route.app)
    return (None, route.app) if found is None else (list(found.routes), found)


def _is_endpoint_class(endpoint: Any) -> bool:
    endpoints = sys.modules.get("starlette.endpoints")
    return (isinstance(endpoint, type) and endpoints is not None
            and issubclass(endpoint, endpoints.HTTPEndpoint))


def _mount_template(prefix: str) -> str:
    return prefix + "/{path:path}"


class StarletteViewCosts:
    """Finds the declared cost of a request by matching its path against a Starlette or
    FastAPI app's routes, as the app's router does.

    ``lookup`` is cached per (method, path) in a per-instance LRU; the routes are read on each
    new (method, path), so routes added after start are seen.
    """

    def __init__(self, app: Any, cache_size: int = CACHE_SIZE) -> None:
        """``app``: a Starlette or FastAPI app or a ``Router`` (:func:`starlette_app`)."""
        self._app = app
        self._cached = cached_by_path(self._lookup, cache_size)

    @classmethod
    def for_app(cls, app: Any, require_costs: bool = True) -> StarletteViewCosts | None:
        """None unless ``app`` leads to a Starlette app (:func:`starlette_app`) one of whose
        endpoints declares a cost (any Starlette app with ``require_costs=False``). Routes that
        cannot be read are logged and give None: the requests then cost one seat."""
        found = starlette_app(app)
        if found is None:
            return None
        return costs_for_app(lambda: [v.view for v in _walk(found.routes, "", 0)],
                             lambda: cls(found), COST_ATTRIBUTE, require_costs,
                             "Starlette routes", log)

    def _match(self, method: str, path: str) -> tuple[Any, str] | None:
        """(endpoint, route template) that serves the request, or None (no route matches
        fully: a 404, a redirect, a 405, or a route that fails on the path)."""
        routing = _routing()
        scope: dict[str, Any] = {"type": "http", "method": method, "path": path,
                                 "root_path": "", "path_params": {}, "headers": [],
                                 "query_string": b""}
        routes: Iterable[Any] = self._app.routes
        prefix = ""
        try:
            for _ in range(_MAX_DEPTH):
                for route in _routes(routes):
                    match, child_scope = route.matches(scope)
                    if match is routing.Match.FULL:
                        break
                else:
                    return None
                if not isinstance(getattr(route, "original_route", route), routing.Mount):
                    return route.endpoint, prefix + route.path
                routes, mounted = _mounted(route)
                if routes is None:  # a mounted ASGI app: it is the endpoint
                    return mounted, _mount_template(prefix + route.path)
                prefix += route.path
                scope = {**scope, **child_scope}
        except Exception:  # a convertor or a route choking on hostile input
            return None
        return None

    def _lookup(self, method: str, path: str) -> WorkEstimate | None:
        found = self._match(method, path)
        if found is None:
            return None
        endpoint = found[0]
        if _is_endpoint_class(endpoint) and view_handler(endpoint, method) is None:
            return None  # the HTTPEndpoint answers 405 itself
        return view_cost(endpoint, method, COST_ATTRIBUTE)

    def lookup(self, method: str, path: str) -> WorkEstimate | None:
        """The cost the request's endpoint declares, or None (no endpoint, or no cost).

        ``path`` is the path the app routes on: the ASGI scope's ``path`` without the
        scope's ``root_path`` (the server's ``--root-path``)."""
        return self._cached(method, path)

    def name(self, method: str, path: str) -> str | None:
        """The endpoint that serves the request and its route (``"myapp.main.report
        (/reports/{year})"``), or None when no endpoint runs."""
        found = self._match(method, path)
        return None if found is None else f"{view_name(found[0])} ({found[1]})"


def _costs_at(route: Any, template: str) -> tuple[tuple[str, str], ...]:
    """(method, where) for each method whose declared cost is read up front (HEAD and
    OPTIONS left out unless the route takes nothing else)."""
    methods = getattr(route, "methods", None)
    if methods:
        listed = sorted(set(methods) - {"HEAD", "OPTIONS"}) or sorted(methods)
        return tuple((m, f"@cost on {m} {template}") for m in listed)
    endpoint = route.endpoint
    if _is_endpoint_class(endpoint):
        return tuple((m.upper(), f"@cost on {m.upper()} {template}") for m in HTTP_METHODS
                     if m not in ("head", "options") and hasattr(endpoint, m))
    return (("GET", f"@cost on {template}"),)


def _reach_template(template: str) -> str:
    """The route in werkzeug's brackets (``/reports/<year>``): the start-up checks read a
    route's literal start up to its first parameter, and take braces for a regular
    expression."""
    return _PARAMETER.sub(r"<\1>", template)


def _walk(routes: Iterable[Any], prefix: str, depth: int) -> Iterator[NamedView]:
    routing = _routing()
    if depth > _MAX_DEPTH:
        return
    for route in _routes(routes):
        original = getattr(route, "original_route", route)
        template = prefix + route.path
        if isinstance(original, routing.Mount):
            sub, mounted = _mounted(route)
            if sub is not None:
                yield from _walk(sub, template, depth + 1)
                continue
            template = _mount_template(template)
            yield NamedView(f"{view_name(mounted)} ({template})", mounted,
                            (("GET", f"@cost on {template}"),), _reach_template(template))
        elif isinstance(original, routing.Route):  # HTTP routes; WebSocket and Host not read
            yield NamedView(f"{view_name(route.endpoint)} ({template})", route.endpoint,
                            _costs_at(route, template), _reach_template(template))


def app_views(app: Any) -> list[NamedView]:
    """Every HTTP route of a Starlette or FastAPI app with its endpoint
    (``"myapp.main.report (/reports/{year})"``), mounts and included routers followed, its
    costs read per method; empty for any other app or routes that cannot be read (the server
    logs that when it builds :class:`StarletteViewCosts`)."""
    found = starlette_app(app)
    if found is None:
        return []
    try:
        return list(_walk(found.routes, "", 0))
    except Exception:
        return []


def unreachable_costs(app: Any) -> list[str]:
    """A message when endpoints declare this module's ``@cost`` but ``app`` does not lead to
    a Starlette app (an ASGI wrapper that keeps it elsewhere than ``.app``): the costs could
    not be read. Flask and Django apps are left to their own checks."""
    if starlette_app(app) is not None or is_flask_like(app) or django_handler(app) is not None:
        return []
    tagged = sorted(view_name(e) for e in list(_tagged) if declares_cost(e, COST_ATTRIBUTE))
    if not tagged:
        return []
    shown = ", ".join(tagged[:3]) + (f" and {len(tagged) - 3} more" if len(tagged) > 3 else "")
    return [f"FastAPI/Starlette endpoints declare @cost ({shown}), but the app "
            f"({type(app).__module__}.{type(app).__qualname__}) is not a Starlette app and "
            "keeps none in .app: the costs have no effect (give gunicorn the FastAPI or "
            "Starlette app, or declare the costs in APF_ROUTES)"]
