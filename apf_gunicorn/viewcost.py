"""What the framework modules share: tagging a view with its cost, reading it back, and finding
the view costs of whatever WSGI app gunicorn loaded.

:mod:`apf_gunicorn.flask` and :mod:`apf_gunicorn.django` each export a ``cost(...)``
decorator with the same arguments; both check them here (:func:`tag`) and set their own
attribute on the view, so a decorator imported from the wrong module is recognised and
reported instead of silently ignored (:func:`unusable_costs`).

    costs = view_costs_for_app(app)        # Flask or Django view costs, or None
    est = costs.lookup("GET", "/reports/2024/") if costs else None
    for message in unusable_costs(app): log.warning("apf: %s", message)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from apf_gunicorn.flowcontrol.workestimate import WorkEstimate, make_estimate

log = logging.getLogger("apf_gunicorn.viewcost")

F = TypeVar("F")

#: The attribute ``apf_gunicorn.flask.cost`` sets on a view function, method or class.
FLASK_ATTRIBUTE = "_apf_cost"
#: The attribute ``apf_gunicorn.django.cost`` sets on a view function, method or class.
DJANGO_ATTRIBUTE = "_apf_django_cost"
HTTP_METHODS = ("get", "head", "post", "put", "patch", "delete", "options", "trace", "connect")


def tag(attribute: str, seats: int, final_seats: int, additional_latency: Any,
        long_running: bool) -> Callable[[F], F]:
    """A decorator that sets ``attribute`` of a view to the checked cost.

    Args:
        attribute: :data:`FLASK_ATTRIBUTE` or :data:`DJANGO_ATTRIBUTE`.
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


def view_cost(view: Any, method: str, attribute: str = FLASK_ATTRIBUTE) -> WorkEstimate | None:
    """The cost a view declares for ``method``: a class-based view's method first, then the
    view function, then the view class (Flask's ``MethodView.as_view`` and Django's
    ``View.as_view`` both leave the class in ``view_class``)."""
    view_class = getattr(view, "view_class", None)
    if view_class is not None:
        handler = getattr(view_class, method.lower(), None)
        if handler is None and method == "HEAD":
            handler = getattr(view_class, "get", None)
        found = _tagged(handler, attribute)
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
    view_class = getattr(view, "view_class", None)
    if view_class is None:
        return False
    handlers = [getattr(view_class, m, None) for m in HTTP_METHODS]
    return any(_tagged(v, attribute) is not None for v in [view_class, *handlers])


def view_costs_for_app(app: Any) -> Any:
    """The view costs of a Flask or Django app whose views declare some, else None.

    Returns:
        An object with ``lookup(method, path) -> WorkEstimate | None``
        (:class:`apf_gunicorn.flask.ViewCosts` or :class:`apf_gunicorn.django.DjangoViewCosts`).
    """
    from apf_gunicorn import django, flask

    return flask.ViewCosts.for_app(app) or django.DjangoViewCosts.for_app(app)


def view_names_for_app(app: Any) -> Any:
    """Like :func:`view_costs_for_app`, but also for apps whose views declare no cost: for
    ``apf-gunicorn explain``, which names the view of a request (``name(method, path)``)."""
    from apf_gunicorn import django, flask

    return (flask.ViewCosts.for_app(app, require_costs=False)
            or django.DjangoViewCosts.for_app(app, require_costs=False))


def declared_view_costs(app: Any) -> list[tuple[str, WorkEstimate]]:
    """Every view cost the app declares up front, as ``(where, estimate)`` (where: ``"@cost
    on GET /reports/<int:year>"`` for Flask, ``"@cost on view mysite.views.report
    (reports/<int:year>/)"`` for Django)."""
    from apf_gunicorn import django, flask

    return flask.declared_costs(app) + django.declared_costs(app)


def unusable_costs(app: Any) -> list[str]:
    """A message for each declared cost that cannot take effect on this app: Flask's
    ``@cost`` on a Django view, Django's on a Flask view, Django costs behind a WSGI wrapper
    that hides the Django handler."""
    from apf_gunicorn import django, flask

    out = django.unreachable_costs(app)
    for framework, views, wrong, right in (
            ("Flask", flask.named_views(app), "django", "flask"),
            ("Django", django.named_views(app), "flask", "django")):
        attribute = DJANGO_ATTRIBUTE if wrong == "django" else FLASK_ATTRIBUTE
        out += [f"@cost from apf_gunicorn.{wrong} on the {framework} view {name} has no "
                f"effect: use apf_gunicorn.{right}.cost"
                for name, view in views if declares_cost(view, attribute)]
    return out
