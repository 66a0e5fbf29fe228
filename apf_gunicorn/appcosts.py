"""The view costs of whatever WSGI app gunicorn loaded: a Flask app's or a Django project's.

The middleware, the start-up checks and ``apf-gunicorn explain`` ask here, and this module asks
:mod:`apf_gunicorn.flask` and :mod:`apf_gunicorn.django` (each reads its own framework's
``@cost``, tagged through :mod:`apf_gunicorn.viewcost`):

    costs = view_costs_for_app(app)        # Flask or Django view costs, or None
    est = costs.lookup("GET", "/reports/2024/") if costs else None
    for message in unusable_costs(app): log.warning("apf: %s", message)
"""

from __future__ import annotations

from typing import Any

from apf_gunicorn import django, flask
from apf_gunicorn.flowcontrol.workestimate import WorkEstimate
from apf_gunicorn.viewcost import (
    DJANGO_ATTRIBUTE,
    FLASK_ATTRIBUTE,
    declared_costs,
    declared_routes,
    declares_cost,
)


def view_costs_for_app(app: Any) -> Any:
    """The view costs of a Flask or Django app whose views declare some, else None.

    Returns:
        An object with ``lookup(method, path) -> WorkEstimate | None``
        (:class:`apf_gunicorn.flask.ViewCosts` or :class:`apf_gunicorn.django.DjangoViewCosts`).
    """
    return flask.ViewCosts.for_app(app) or django.DjangoViewCosts.for_app(app)


def view_names_for_app(app: Any) -> Any:
    """Like :func:`view_costs_for_app`, but also for apps whose views declare no cost: for
    ``apf-gunicorn explain``, which names the view of a request (``name(method, path)``)."""
    return (flask.ViewCosts.for_app(app, require_costs=False)
            or django.DjangoViewCosts.for_app(app, require_costs=False))


def declared_view_costs(app: Any) -> list[tuple[str, WorkEstimate]]:
    """Every view cost the app declares up front, as ``(where, estimate)`` (where: ``"@cost
    on GET /reports/<int:year>"`` for Flask, ``"@cost on view mysite.views.report
    (reports/<int:year>/)"`` for Django)."""
    return (declared_costs(flask.app_views(app), FLASK_ATTRIBUTE)
            + declared_costs(django.app_views(app), DJANGO_ATTRIBUTE))


def declared_view_routes(app: Any) -> dict[str, str]:
    """The route (URL path template) of each cost :func:`declared_view_costs` names:
    ``{"@cost on GET /reports/<int:year>": "/reports/<int:year>"}``."""
    return (declared_routes(flask.app_views(app), FLASK_ATTRIBUTE)
            | declared_routes(django.app_views(app), DJANGO_ATTRIBUTE))


def unusable_costs(app: Any) -> list[str]:
    """A message for each declared cost that cannot take effect on this app: Flask's
    ``@cost`` on a Django view, Django's on a Flask view, Django costs behind a WSGI wrapper
    that hides the Django handler."""
    out = django.unreachable_costs(app)
    for framework, views, wrong, right in (
            ("Flask", flask.app_views(app), "django", "flask"),
            ("Django", django.app_views(app), "flask", "django")):
        attribute = DJANGO_ATTRIBUTE if wrong == "django" else FLASK_ATTRIBUTE
        out += [f"@cost from apf_gunicorn.{wrong} on the {framework} view {v.name} has no "
                f"effect: use apf_gunicorn.{right}.cost"
                for v in views if declares_cost(v.view, attribute)]
    return out
