"""What the framework modules share: tagging a view with its cost and reading it back.

:mod:`apf_gunicorn.flask`, :mod:`apf_gunicorn.django` and :mod:`apf_gunicorn.starlette` each
export a ``cost(...)`` decorator with the same arguments; each checks them here (:func:`tag`)
and sets its own attribute on the view, so a decorator imported from the wrong module is
recognised and reported instead of silently ignored
(:func:`apf_gunicorn.appcosts.unusable_costs`). Each framework module lists its app's views as
:class:`NamedView` (``app_views``) and builds its lookup through :func:`costs_for_app`;
:func:`declared_costs` reads the costs of all. Lookups that resolve a path against a route
list keep their answers per (method, path) in a bounded cache (:func:`cached_by_path`).
Finding the costs of whatever app gunicorn loaded is :mod:`apf_gunicorn.appcosts`, above them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from apf_gunicorn.flowcontrol.workestimate import WorkEstimate, make_estimate

log = logging.getLogger("apf_gunicorn.viewcost")

F = TypeVar("F")
T = TypeVar("T")

#: The attribute ``apf_gunicorn.flask.cost`` sets on a view function, method or class.
FLASK_ATTRIBUTE = "_apf_cost"
#: The attribute ``apf_gunicorn.django.cost`` sets on a view function, method or class.
DJANGO_ATTRIBUTE = "_apf_django_cost"
#: The attribute ``apf_gunicorn.starlette.cost`` sets on an endpoint function, method or class.
STARLETTE_ATTRIBUTE = "_apf_starlette_cost"
#: (method, path) answers a :func:`cached_by_path` lookup keeps.
CACHE_SIZE = 4096
#: Longest path whose answer is cached (longer ones are resolved every time, so the cache's
#: memory stays bounded).
MAX_CACHED_PATH = 1024
HTTP_METHODS = ("get", "head", "post", "put", "patch", "delete", "options", "trace", "connect")


def tag(attribute: str, seats: int, final_seats: int, additional_latency: Any,
        long_running: bool) -> Callable[[F], F]:
    """A decorator that sets ``attribute`` of a view to the checked cost.

    Args:
        attribute: :data:`FLASK_ATTRIBUTE`, :data:`DJANGO_ATTRIBUTE` or
            :data:`STARLETTE_ATTRIBUTE`.
        seats, final_seats, additional_latency, long_running: as :func:`~apf_gunicorn.
            flowcontrol.workestimate.make_estimate` takes them.

    Returns:
        A decorator returning the view itself (so it survives ``functools.wraps`` and may sit
        above or below the framework's own decorators).

    Raises:
        ValueError: a bad argument (:class:`~apf_gunicorn.flowcontrol.workestimate.
            EstimateError`, naming it), at import of the view's module.
    """
    estimate = make_estimate(seats, final_seats, additional_latency, long_running)

    def decorate(view: F) -> F:
        setattr(view, attribute, estimate)
        return view

    return decorate


def _tagged(obj: Any, attribute: str) -> WorkEstimate | None:
    found = getattr(obj, attribute, None)
    return found if isinstance(found, WorkEstimate) else None


def _view_class(view: Any) -> Any:
    """The class of a class-based view: Flask's ``MethodView.as_view`` and Django's
    ``View.as_view`` leave it in ``view_class``; Starlette routes a class (``HTTPEndpoint``)
    itself."""
    return view if isinstance(view, type) else getattr(view, "view_class", None)


def view_handler(view_class: Any, method: str) -> Any:
    """The method of a class-based view that serves ``method`` (HEAD: ``head``, else
    ``get``, as Flask, Django and Starlette dispatch it), or None."""
    handler = getattr(view_class, method.lower(), None)
    if handler is None and method == "HEAD":
        handler = getattr(view_class, "get", None)
    return handler


def view_cost(view: Any, method: str, attribute: str = FLASK_ATTRIBUTE) -> WorkEstimate | None:
    """The cost a view declares for ``method``: a class-based view's method first, then the
    view function, then the view class."""
    view_class = _view_class(view)
    if view_class is not None:
        found = _tagged(view_handler(view_class, method), attribute)
        if found is not None:
            return found
    found = _tagged(view, attribute)
    if found is not None or view_class is None:
        return found
    return _tagged(view_class, attribute)


def declares_cost(view: Any, attribute: str) -> bool:
    """Whether the view, its class or one of its class's handler methods carries a cost."""
    if _tagged(view, attribute) is not None:
        return True
    view_class = _view_class(view)
    if view_class is None:
        return False
    handlers = [getattr(view_class, m, None) for m in HTTP_METHODS]
    return any(_tagged(v, attribute) is not None for v in [view_class, *handlers])


def view_name(view: Any) -> str:
    """A view's dotted name: the class of a class-based view, else the function
    (``"mysite.views.report"``), the class of an instance (a mounted ASGI app)."""
    target = _view_class(view) or view
    if not hasattr(target, "__qualname__"):
        target = type(target)
    module = getattr(target, "__module__", None) or "?"
    return f"{module}.{getattr(target, '__qualname__', repr(target))}"


def cached_by_path(lookup: Callable[[str, str], T], size: int = CACHE_SIZE,
                   max_path: int = MAX_CACHED_PATH) -> Callable[[str, str], T]:
    """``lookup(method, path)`` with its answers kept in an LRU of ``size`` entries.

    Two paths share nothing, even when they reach the same view, so no guess about "path
    shapes" can give a request another view's cost; paths longer than ``max_path`` are
    resolved every time (a client walking ever longer paths cannot grow the cache).
    Thread-safe (``functools.lru_cache``).
    """
    cached = functools.lru_cache(maxsize=size)(lookup)

    def lookup_cached(method: str, path: str) -> T:
        if len(path) > max_path:
            return lookup(method, path)
        return cached(method, path)

    return lookup_cached


def is_flask_like(app: Any) -> bool:
    """Whether ``app`` looks like a Flask app (a URL map and a view table), without importing
    Flask."""
    return hasattr(app, "url_map") and isinstance(getattr(app, "view_functions", None), dict)


@dataclass(frozen=True)
class NamedView:
    """One view of an app, as the start-up checks and ``apf-gunicorn explain`` name it.

    Attributes:
        name: the view and its route (``"'report' (/reports/<int:year>)"`` for Flask,
            ``"mysite.views.report (reports/<int:year>/)"`` for Django,
            ``"myapp.main.report (/reports/{year})"`` for Starlette).
        view: the view function (a class-based view's ``as_view()`` function).
        costs_at: ``(HTTP method, where)`` per method whose declared cost is read up front,
            ``where`` naming it (``"@cost on GET /reports/<int:year>"``).
        route: the URL path template of its requests (``"/reports/<int:year>"``; Django's
            route text, a regular expression for ``re_path``; Starlette's with its parameters
            in werkzeug's brackets, ``"/reports/<year>"``).
    """

    name: str
    view: Any
    costs_at: tuple[tuple[str, str], ...]
    route: str


def _declared(views: Iterable[NamedView], attribute: str
              ) -> list[tuple[str, WorkEstimate, str]]:
    return [(where, est, v.route) for v in views for method, where in v.costs_at
            if (est := view_cost(v.view, method, attribute)) is not None]


def declared_costs(views: Iterable[NamedView], attribute: str) -> list[tuple[str, WorkEstimate]]:
    """Every cost the views declare through ``attribute``, as ``(where, estimate)``."""
    return [(where, est) for where, est, _route in _declared(views, attribute)]


def declared_routes(views: Iterable[NamedView], attribute: str) -> dict[str, str]:
    """The route of each cost :func:`declared_costs` names: ``{where: route}``."""
    return {where: route for where, _est, route in _declared(views, attribute)}


def costs_for_app(views: Callable[[], Iterable[Any]], build: Callable[[], T | None],
                  attribute: str, require_costs: bool, what: str,
                  logger: logging.Logger) -> T | None:
    """A framework's lookup for an app it recognised, or None.

    Args:
        views: the app's view functions (read only with ``require_costs``).
        build: makes the lookup (None when the app cannot have one, said by ``build``).
        attribute: the framework's cost attribute.
        require_costs: None unless a view declares a cost (the middleware); False for
            ``apf-gunicorn explain``, which names the view of any request.
        what: what is read, for the log line when it fails (``"Django URLconf"``).
        logger: the framework module's logger.
    Returns:
        The lookup; None when no view declares a cost (with ``require_costs``), or when the
        views cannot be read (logged: the requests then cost one seat, as without ``@cost``).
    """
    try:
        if require_costs and not any(declares_cost(v, attribute) for v in views()):
            return None
        return build()
    except Exception:
        logger.exception("apf: cannot read the %s; @cost declarations are ignored", what)
        return None
