"""The view costs of whatever app gunicorn loaded: a Flask app's, a Django project's, or a
FastAPI or Starlette app's.

The middleware, the start-up checks and ``apf-gunicorn explain`` ask here, and this module asks
:mod:`apf_gunicorn.flask`, :mod:`apf_gunicorn.django` and :mod:`apf_gunicorn.starlette` (each
reads its own framework's ``@cost``, tagged through :mod:`apf_gunicorn.viewcost`):

    costs = view_costs_for_app(app)        # Flask, Django or Starlette view costs, or None
    est = costs.lookup("GET", "/reports/2024/") if costs else None
    for message in unusable_costs(app): log.warning("apf: %s", message)

Flask is asked first, then Django, then Starlette: each recognises its app by cheap checks
(Flask's by two attributes; Django's and Starlette's only if the process loaded them), so a
Flask or Django app never pays for the frameworks after it.
"""

from __future__ import annotations

from typing import Any

from apf_gunicorn import django, flask, starlette
from apf_gunicorn.flowcontrol.workestimate import WorkEstimate
from apf_gunicorn.viewcost import (
    DJANGO_ATTRIBUTE,
    FLASK_ATTRIBUTE,
    STARLETTE_ATTRIBUTE,
    declared_costs,
    declared_routes,
    declares_cost,
)

# (what the messages call the framework, its views, its module, its decorator's attribute)
_FRAMEWORKS = (
    ("Flask", flask.app_views, "flask", FLASK_ATTRIBUTE),
    ("Django", django.app_views, "django", DJANGO_ATTRIBUTE),
    ("FastAPI/Starlette", starlette.app_views, "starlette", STARLETTE_ATTRIBUTE),
)


def view_costs_for_app(app: Any) -> Any:
    """The view costs of a Flask, Django or Starlette (FastAPI) app whose views declare some,
    else None.

    Returns:
        An object with ``lookup(method, path) -> WorkEstimate | None``
        (:class:`apf_gunicorn.flask.ViewCosts`, :class:`apf_gunicorn.django.DjangoViewCosts`
        or :class:`apf_gunicorn.starlette.StarletteViewCosts`).
    """
    return (flask.ViewCosts.for_app(app) or django.DjangoViewCosts.for_app(app)
            or starlette.StarletteViewCosts.for_app(app))


def view_names_for_app(app: Any) -> Any:
    """Like :func:`view_costs_for_app`, but also for apps whose views declare no cost: for
    ``apf-gunicorn explain``, which names the view of a request (``name(method, path)``)."""
    return (flask.ViewCosts.for_app(app, require_costs=False)
            or django.DjangoViewCosts.for_app(app, require_costs=False)
            or starlette.StarletteViewCosts.for_app(app, require_costs=False))


def declared_view_costs(app: Any) -> list[tuple[str, WorkEstimate]]:
    """Every view cost the app declares up front, as ``(where, estimate)`` (where: ``"@cost
    on GET /reports/<int:year>"`` for Flask, ``"@cost on view mysite.views.report
    (reports/<int:year>/)"`` for Django, ``"@cost on GET /reports/{year}"`` for Starlette)."""
    return [found for _, views, _, attribute in _FRAMEWORKS
            for found in declared_costs(views(app), attribute)]


def declared_view_routes(app: Any) -> dict[str, str]:
    """The route (URL path template) of each cost :func:`declared_view_costs` names:
    ``{"@cost on GET /reports/<int:year>": "/reports/<int:year>"}``."""
    out: dict[str, str] = {}
    for _, views, _, attribute in _FRAMEWORKS:
        out |= declared_routes(views(app), attribute)
    return out


def unusable_costs(app: Any) -> list[str]:
    """A message for each declared cost that cannot take effect on this app: one framework's
    ``@cost`` on another framework's view (Flask's on a Django view, Starlette's on a Flask
    view...), Django or Starlette costs behind a wrapper that hides the app."""
    # A Starlette app reads its own @cost, as a Flask app does: Django views configured in the
    # same process are not suspected.
    out = [] if starlette.starlette_app(app) is not None else django.unreachable_costs(app)
    out += starlette.unreachable_costs(app)
    for framework, views_of, right, _ in _FRAMEWORKS:
        views = views_of(app)
        for _, _, wrong, attribute in _FRAMEWORKS:
            if wrong != right:
                out += [f"@cost from apf_gunicorn.{wrong} on the {framework} view {v.name} has "
                        f"no effect: use apf_gunicorn.{right}.cost"
                        for v in views if declares_cost(v.view, attribute)]
    return out
