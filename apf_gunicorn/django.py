"""Per-view request costs for Django apps served by apf_gunicorn.

Tag a view with what one request to it costs; the middleware finds the view of each request
through the project's URLconf (``django.urls.resolve``) and admits the request with that many
seats::

    from apf_gunicorn.django import cost

    @cost(seats=4, final_seats=2, additional_latency="50ms")
    def report(request, year): ...

    class Items(View):
        @cost(seats=3)                # per HTTP method of a class-based view
        def post(self, request): ...

    @cost(long_running=True)          # a whole class-based view (every method)
    class Events(View): ...

The arguments are those of :func:`apf_gunicorn.flask.cost` (checked at import: a bad cost
fails at start). The decorator only sets an attribute and returns the view itself, so it may
sit above or below Django's decorators (``login_required``, ``require_GET``: they use
``functools.wraps``). Flask's decorator on a Django view is not read; it is reported at start
and by ``apf-gunicorn explain`` (:func:`apf_gunicorn.appcosts.unusable_costs`).

Nothing here imports Django unless the app gunicorn loads is Django's ``WSGIHandler`` or, under
an ASGI worker, its ``ASGIHandler`` (or a wrapper that keeps it in ``.application``, as
WhiteNoise does, or ``.app``); costs behind a wrapper that hides the handler are reported
(:func:`unreachable_costs`). Resolution uses the
project's ``ROOT_URLCONF``, so a urlconf a middleware sets per request (``request.urlconf``)
is not seen; ``i18n_patterns`` resolve in the language the path's prefix names (else
``LANGUAGE_CODE``), never in the language a thread happens to have active. Each (method, path) is resolved
once and kept in a bounded LRU (:data:`CACHE_SIZE` entries; paths longer than
:data:`MAX_CACHED_PATH` are resolved every time, so the cache's memory stays bounded): two
paths share nothing, even when Django resolves them to the same view, so no guess about
"path shapes" can ever give a request another view's cost.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from apf_gunicorn import viewcost
from apf_gunicorn.flowcontrol.workestimate import WorkEstimate
from apf_gunicorn.viewcost import (
    DJANGO_ATTRIBUTE,
    NamedView,
    cached_by_path,
    costs_for_app,
    declares_cost,
    is_flask_like,
    tag,
    view_cost,
    view_name,
)

log = logging.getLogger("apf_gunicorn.django")

#: The attribute ``@cost`` sets on a view function, method or class.
COST_ATTRIBUTE = DJANGO_ATTRIBUTE
#: Resolved (method, path) pairs kept per worker.
CACHE_SIZE = viewcost.CACHE_SIZE
#: Longest path whose resolution is cached (longer ones are resolved per request shape).
MAX_CACHED_PATH = viewcost.MAX_CACHED_PATH
#: How many WSGI wrappers are looked through to find Django's handler, and the attributes
#: they keep the wrapped app in (WhiteNoise: ``application``; Sentry's middleware: ``app``).
_MAX_WRAPPERS = 4
_WRAPPED = ("application", "app")

F = TypeVar("F")


def cost(seats: int = 1, final_seats: int = 0, additional_latency: Any = 0,
         long_running: bool = False) -> Callable[[F], F]:
    """Declare what one request to the decorated Django view costs.

    Args:
        seats: seats held while the view runs (>= 1).
        final_seats: seats kept after the response for ``additional_latency``.
        additional_latency: a Go duration such as ``"50ms"``, or a timedelta.
        long_running: give the seats back once the view has returned its response (a
            ``StreamingHttpResponse``), not when the body has been sent.

    Returns:
        A decorator for a view function, a class-based view or one of its handler methods.

    Raises:
        ValueError: naming the bad argument.
    """
    return tag(COST_ATTRIBUTE, seats, final_seats, additional_latency, long_running)


def django_handler(app: Any) -> Any:
    """Django's ``WSGIHandler`` or ``ASGIHandler`` behind ``app`` (itself, or kept in
    ``.application`` or ``.app`` by WSGI or ASGI wrappers), or None. Never imports Django: an
    app is Django's only if Django is loaded."""
    kinds = tuple(module.WSGIHandler if kind == "wsgi" else module.ASGIHandler
                  for kind in ("wsgi", "asgi")
                  if (module := sys.modules.get(f"django.core.handlers.{kind}")) is not None)
    if not kinds:
        return None
    for _ in range(_MAX_WRAPPERS + 1):
        if isinstance(app, kinds):
            return app
        app = next((w for w in (getattr(app, a, None) for a in _WRAPPED) if w is not None),
                   None)
        if app is None:
            return None
    return None


def iter_views() -> list[tuple[str, Any]]:
    """(route, view) of every URL pattern of the project's ``ROOT_URLCONF``, included ones
    too; the route is the patterns' text joined (``"reports/<int:year>/"``; an
    ``i18n_patterns`` prefix in ``LANGUAGE_CODE``, whatever language the thread has active)."""
    from django.conf import settings
    from django.urls import URLPattern, URLResolver, get_resolver
    from django.utils import translation

    def walk(patterns: Any, prefix: str) -> Iterator[tuple[str, Any]]:
        for p in patterns:
            if isinstance(p, URLResolver):
                yield from walk(p.url_patterns, prefix + str(p.pattern))
            elif isinstance(p, URLPattern):
                yield prefix + str(p.pattern), p.callback

    with translation.override(settings.LANGUAGE_CODE):
        return list(walk(get_resolver().url_patterns, ""))


class DjangoViewCosts:
    """Finds the declared cost of a request by resolving its path in the URLconf.

    ``lookup`` is cached per (method, path) in a per-instance LRU; thread-safe.
    """

    def __init__(self, cache_size: int = CACHE_SIZE) -> None:
        from django.conf import settings

        self._urlconf = settings.ROOT_URLCONF
        self._language = settings.LANGUAGE_CODE
        self._cached = cached_by_path(self._lookup, cache_size, MAX_CACHED_PATH)

    @classmethod
    def for_app(cls, app: Any, require_costs: bool = True) -> DjangoViewCosts | None:
        """None unless ``app`` is a Django app whose URLconf has a view declaring a cost (any
        Django app with ``require_costs=False``). A URLconf that cannot be read is logged and
        gives None: the requests then cost one seat, as before."""
        if django_handler(app) is None:
            return None
        return costs_for_app(lambda: [v for _, v in iter_views()], cls, COST_ATTRIBUTE,
                             require_costs, "Django URLconf", log)

    def _match(self, path: str) -> Any:
        """Django's ResolverMatch for the path, or None (404, or a resolver that fails).

        ``i18n_patterns`` match the language active in the calling thread, which
        LocaleMiddleware leaves set in a request's thread and the dispatcher never has (and
        the result is cached for every thread): the path is resolved in the language its
        prefix names, as LocaleMiddleware would activate it, else in ``LANGUAGE_CODE``.
        """
        from django.urls import Resolver404, resolve
        from django.utils import translation

        try:
            language = translation.get_language_from_path(path) or self._language
            with translation.override(language):
                return resolve(path, self._urlconf)
        except Resolver404:
            return None
        except Exception:  # a converter or a URLconf choking on hostile input
            return None

    def _lookup(self, method: str, path: str) -> WorkEstimate | None:
        match = self._match(path)
        return None if match is None else view_cost(match.func, method, COST_ATTRIBUTE)

    def lookup(self, method: str, path: str) -> WorkEstimate | None:
        """The cost the request's view declares, or None (no view, or no cost)."""
        return self._cached(method, path)

    def name(self, method: str, path: str) -> str | None:
        """The view that serves the request and its route (``"mysite.views.report
        (reports/<int:year>/)"``), or None when the path resolves to no view."""
        match = self._match(path)
        if match is None:
            return None
        return f"{view_name(match.func)} ({match.route})"


def app_views(app: Any) -> list[NamedView]:
    """Every URL pattern of a Django app with its view (``"mysite.views.report
    (reports/<int:year>/)"``), its costs read for GET (a function view) or per handler method
    of a class-based view (HEAD and OPTIONS left out); empty for any other app or an
    unreadable URLconf (the server logs that when it builds :class:`DjangoViewCosts`)."""
    if django_handler(app) is None:
        return []
    try:
        views = iter_views()
    except Exception:
        return []
    out = []
    for route, view in views:
        name = f"{view_name(view)} ({route})"
        view_class = getattr(view, "view_class", None)
        if view_class is None:
            costs_at = (("GET", f"@cost on view {name}"),)
        else:
            costs_at = tuple((m.upper(), f"@cost on view {name} {m.upper()}")
                             for m in getattr(view_class, "http_method_names", ())
                             if m not in ("head", "options") and hasattr(view_class, m))
        out.append(NamedView(name, view, costs_at, route))
    return out


def unreachable_costs(app: Any) -> list[str]:
    """A message when Django views declare a cost but ``app`` does not lead to Django's
    handler (a WSGI wrapper that keeps it elsewhere): the costs could not be read. A Flask
    app in the same process is not suspected (its own ``@cost`` is what it reads)."""
    if django_handler(app) is not None or is_flask_like(app):
        return []
    conf = sys.modules.get("django.conf")
    try:
        if conf is None or not conf.settings.configured:
            return []
        if not any(declares_cost(v, COST_ATTRIBUTE) for _, v in iter_views()):
            return []
    except Exception:
        return []
    return [f"Django views declare @cost, but the app ({type(app).__module__}."
            f"{type(app).__qualname__}) is not Django's WSGIHandler or ASGIHandler and keeps "
            f"none in .{' or .'.join(_WRAPPED)}: the costs have no effect (keep the handler "
            "reachable, or declare the costs in APF_ROUTES)"]
