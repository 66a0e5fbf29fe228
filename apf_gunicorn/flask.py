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
Django apps have their own decorator, :func:`apf_gunicorn.django.cost`, and FastAPI and
Starlette apps theirs, :func:`apf_gunicorn.starlette.cost`; each module's decorator on another
framework's view is reported at start (:func:`apf_gunicorn.appcosts.unusable_costs`).

:class:`ViewCosts` is what the middleware uses: ``ViewCosts.for_app(app)`` (None when the app
is not Flask-like or tags no view), then ``lookup(method, path) -> WorkEstimate | None``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from werkzeug.exceptions import HTTPException
from werkzeug.routing.exceptions import RoutingException

from apf_gunicorn.flowcontrol.workestimate import WorkEstimate
from apf_gunicorn.viewcost import (
    FLASK_ATTRIBUTE,
    NamedView,
    costs_for_app,
    is_flask_like,
    tag,
)
from apf_gunicorn.viewcost import view_cost as _view_cost

log = logging.getLogger("apf_gunicorn.flask")

#: The attribute ``@cost`` sets on a view function, method or class.
COST_ATTRIBUTE = FLASK_ATTRIBUTE

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
    return tag(COST_ATTRIBUTE, seats, final_seats, additional_latency, long_running)


def view_cost(view: Any, method: str) -> WorkEstimate | None:
    """The cost a view declares for ``method``: a class-based view's method first, then the
    view function, then the view class."""
    return _view_cost(view, method, COST_ATTRIBUTE)


class ViewCosts:
    """Finds the declared cost of a request from a Flask app's URL map (bound once).

    Matching ignores the host: apps with ``host_matching`` get no view costs (logged once),
    and rules of a subdomain other than the default do not match.
    """

    def __init__(self, url_map: Any, view_functions: dict) -> None:
        self.view_functions = view_functions
        self._adapter = url_map.bind("localhost")

    @classmethod
    def for_app(cls, app: Any, require_costs: bool = True) -> ViewCosts | None:
        """None unless ``app`` looks like a Flask app whose views declare at least one cost
        (any Flask app with ``require_costs=False``)."""
        if not is_flask_like(app):
            return None

        def build() -> ViewCosts | None:
            if getattr(app.url_map, "host_matching", False):
                log.warning("apf: the Flask app matches URLs by host; @cost declarations are "
                            "ignored (use APF_ROUTES or APF_WORK_ESTIMATOR)")
                return None
            return cls(app.url_map, app.view_functions)

        return costs_for_app(lambda: list(app.view_functions.values()), build, COST_ATTRIBUTE,
                             require_costs, "Flask URL map", log)

    def _view(self, method: str, path: str) -> tuple[Any, Any] | None:
        """(rule, view function) of the view that serves the request, or None."""
        try:
            rule, _ = self._adapter.match(path, method=method, return_rule=True)
        except (HTTPException, RoutingException):  # 404, 405, redirects: no view runs
            return None
        except Exception:  # a converter choking on hostile input
            return None
        if method == "OPTIONS" and getattr(rule, "provide_automatic_options", False):
            return None  # Flask answers it without calling the view
        view = self.view_functions.get(rule.endpoint)
        return None if view is None else (rule, view)

    def lookup(self, method: str, path: str) -> WorkEstimate | None:
        """The cost the request's view declares, or None (no view, or no cost)."""
        found = self._view(method, path)
        return None if found is None else view_cost(found[1], method)

    def name(self, method: str, path: str) -> str | None:
        """The endpoint and rule that serve the request (``"report (/reports/<int:year>)"``),
        or None when no view runs."""
        found = self._view(method, path)
        return None if found is None else f"{found[0].endpoint} ({found[0].rule})"


def app_views(app: Any) -> list[NamedView]:
    """Every rule of a Flask app with its view (``"'report' (/reports/<int:year>)"``), its
    costs read per method (HEAD and OPTIONS left out); empty for any other app."""
    if not is_flask_like(app):
        return []
    try:
        rules = list(app.url_map.iter_rules())
    except Exception:
        return []
    return [NamedView(f"{rule.endpoint!r} ({rule.rule})", app.view_functions[rule.endpoint],
                      tuple((m, f"@cost on {m} {rule.rule}") for m in sorted(rule.methods or ())
                            if m not in ("HEAD", "OPTIONS")), rule.rule)
            for rule in rules if rule.endpoint in app.view_functions]
