"""Per-view request costs for Flask apps served by apf_gunicorn.

Tag a view with what one request to it costs; the middleware finds the view of each request
shape through the app's ``url_map`` and admits the request with that many seats::

    from apf_gunicorn.flask import cost

    @app.route("/reports/<int:year>")
    @cost(seats=4, final_seats=2, additional_latency="50ms")
    def report(year): ...

    @app.route("/events")
    @cost(long_running=True)          # seats held only until the view returns its iterable
    def events(): return Response(stream(), mimetype="text/event-stream")

    class Items(MethodView):
        @cost(seats=3)                # per HTTP method of a class-based view
        def post(self): ...

The decorator only sets an attribute and returns the function itself, so it may sit above or
below ``@app.route`` and under decorators that use ``functools.wraps``. Arguments are checked
when the module is imported (a bad cost fails at start, not per request). Nothing here imports
Flask: the middleware recognises a Flask app by its ``url_map`` and ``view_functions``.

:class:`ViewCosts` is what the middleware uses: ``ViewCosts.for_app(app)`` (None when the app
is not Flask-like or tags no view), then ``lookup(method, path) -> WorkEstimate | None``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from werkzeug.exceptions import HTTPException
from werkzeug.routing.exceptions import RoutingException

from apf_gunicorn.flowcontrol.workestimate import WorkEstimate, make_estimate

log = logging.getLogger("apf_gunicorn.flask")

#: The attribute ``@cost`` sets on a view function, method or class.
COST_ATTRIBUTE = "_apf_cost"

F = TypeVar("F")


def cost(seats: int = 1, final_seats: int = 0, additional_latency: Any = 0,
         long_running: bool = False) -> Callable[[F], F]:
    """Declare what one request to the decorated view costs.

    ``seats``: seats held while the view runs (>= 1). ``final_seats``: seats kept after the
    response for ``additional_latency`` (a Go duration such as ``"50ms"`` or a timedelta), as
    Kubernetes does for the watch notifications a write causes. ``long_running``: the seats
    are given back once the view has returned its response iterable, not when the body has
    been sent (streams). Raises ValueError naming the bad argument.
    """
    estimate = make_estimate(seats, final_seats, additional_latency, long_running)

    def decorate(view: F) -> F:
        setattr(view, COST_ATTRIBUTE, estimate)
        return view

    return decorate


def view_cost(view: Any, method: str) -> WorkEstimate | None:
    """The cost a view declares for ``method``: a class-based view's method first, then the
    view function, then the view class."""
    view_class = getattr(view, "view_class", None)
    if view_class is not None:
        handler = getattr(view_class, method.lower(), None)
        if handler is None and method == "HEAD":
            handler = getattr(view_class, "get", None)
        found = getattr(handler, COST_ATTRIBUTE, None)
        if isinstance(found, WorkEstimate):
            return found
    found = getattr(view, COST_ATTRIBUTE, None)
    if isinstance(found, WorkEstimate):
        return found
    found = getattr(view_class, COST_ATTRIBUTE, None)
    return found if isinstance(found, WorkEstimate) else None


def is_flask_like(app: Any) -> bool:
    return hasattr(app, "url_map") and isinstance(getattr(app, "view_functions", None), dict)


class ViewCosts:
    """Finds the declared cost of a request from a Flask app's URL map (bound once).

    Matching ignores the host: apps with ``host_matching`` get no view costs (logged once),
    and rules of a subdomain other than the default do not match.
    """

    def __init__(self, url_map: Any, view_functions: dict) -> None:
        self.view_functions = view_functions
        self._adapter = url_map.bind("localhost")

    @classmethod
    def for_app(cls, app: Any) -> ViewCosts | None:
        """None unless ``app`` looks like a Flask app whose views declare at least one cost."""
        if not is_flask_like(app):
            return None
        views = app.view_functions
        if not any(_declares_cost(v) for v in list(views.values())):
            return None
        url_map = app.url_map
        if getattr(url_map, "host_matching", False):
            log.warning("apf: the Flask app matches URLs by host; @cost declarations are "
                        "ignored (use APF_ROUTES or APF_WORK_ESTIMATOR)")
            return None
        try:
            return cls(url_map, views)
        except Exception:
            log.exception("apf: cannot read the Flask URL map; @cost declarations are ignored")
            return None

    def lookup(self, method: str, path: str) -> WorkEstimate | None:
        try:
            rule, _ = self._adapter.match(path, method=method, return_rule=True)
        except (HTTPException, RoutingException):  # 404, 405, redirects: no view runs
            return None
        except Exception:  # a converter choking on hostile input
            return None
        if method == "OPTIONS" and getattr(rule, "provide_automatic_options", False):
            return None  # Flask answers it without calling the view
        view = self.view_functions.get(rule.endpoint)
        if view is None:
            return None
        return view_cost(view, method)


def _declares_cost(view: Any) -> bool:
    if isinstance(getattr(view, COST_ATTRIBUTE, None), WorkEstimate):
        return True
    view_class = getattr(view, "view_class", None)
    if view_class is None:
        return False
    handlers = [getattr(view_class, m, None) for m in _HTTP_METHODS]
    return any(isinstance(getattr(v, COST_ATTRIBUTE, None), WorkEstimate)
               for v in [view_class, *handlers])


_HTTP_METHODS = ("get", "head", "post", "put", "patch", "delete", "options", "trace", "connect")
