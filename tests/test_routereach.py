"""Which levels a route's requests can land in (flowcontrol/routereach.py), and the start-up
notes on clamped costs naming only those (server/startup.py, issue 25, item 21)."""

from __future__ import annotations

import pytest
from flask import Flask

from apf_gunicorn.flask import cost
from apf_gunicorn.flowcontrol.loader import load_configuration
from apf_gunicorn.flowcontrol.objects import (
    FlowSchema,
    NonResourceRule,
    PolicyRule,
    Subject,
)
from apf_gunicorn.flowcontrol.routereach import reachable_levels, route_prefix
from apf_gunicorn.server import startup
from tests.conftest import ROOT

EVERYONE = (Subject("Group", "system:authenticated"), Subject("Group", "system:unauthenticated"))


def schema(name: str, urls: tuple[str, ...], verbs: tuple[str, ...] = ("*",),
           subjects: tuple[Subject, ...] = EVERYONE) -> FlowSchema:
    return FlowSchema(name, name, rules=(PolicyRule(subjects, non_resource_rules=(
        NonResourceRule(verbs, urls),)),))


@pytest.mark.parametrize("template, expected", [
    ("/reports/<int:year>", ("/reports/", False)),
    ("reports/<int:year>/", ("/reports/", False)),  # a Django route
    ("/healthz", ("/healthz", True)),
    ("^reports/(?P<year>[0-9]{4})/$", None),  # Django's re_path: not read
])
def test_route_prefix(template, expected) -> None:
    assert route_prefix(template) == expected


SCHEMAS = [schema("probes", ("/healthz",), verbs=("get",)),
           schema("reports", ("/reports/*",)),
           schema("admins", ("*",), subjects=(Subject("Group", "admins"),)),
           schema("web", ("*",)),
           schema("catch-all", ("*",))]


@pytest.mark.parametrize("template, expected", [
    ("/reports/<int:year>", {"reports"}),  # every request to it from everyone: stops there
    ("/<path:rest>", {"probes", "reports", "admins", "web"}),  # some paths land anywhere
    ("/rep<x>", {"reports", "admins", "web"}),  # may or may not be under /reports/
    ("/healthz", {"probes", "admins", "web"}),  # only GETs are probes
    ("/items/", {"admins", "web"}),  # the admins group's requests go elsewhere
])
def test_reachable_levels(template, expected) -> None:
    assert reachable_levels(SCHEMAS, template, kubernetes_paths=False) == expected


def test_kubernetes_api_paths_and_regular_expressions_are_not_told() -> None:
    assert reachable_levels(SCHEMAS, "/api/v1/items/", kubernetes_paths=True) is None
    assert reachable_levels(SCHEMAS, "/<path:rest>", kubernetes_paths=True) is None
    assert reachable_levels(SCHEMAS, "/api/v1/items/", kubernetes_paths=False) == {"admins",
                                                                                   "web"}
    assert reachable_levels(SCHEMAS, "/items/", kubernetes_paths=True) == {"admins", "web"}
    assert reachable_levels(SCHEMAS, "^items/$", kubernetes_paths=False) is None


def test_a_cost_is_noted_only_for_levels_its_requests_can_reach() -> None:
    """The example's configuration sends /reports/* to a level as wide as a report: no note;
    a route the web level takes is clamped there, not on the catch-all it never reaches."""
    cfg = load_configuration(str(ROOT / "examples" / "mysite" / "apf.yaml"))
    app = Flask(__name__)

    @app.get("/reports/<int:year>")
    @cost(seats=4)
    def report(year):
        return ""

    @app.post("/items/")
    @cost(seats=3)
    def items():
        return ""

    costs = startup.declared_costs(app, None)
    reach = startup.cost_levels(app, None, cfg.flow_schemas, kubernetes_paths=False)
    # (exempt: the mandatory schema of group system:masters comes first, for anything)
    assert reach == {"@cost on GET /reports/<int:year>": {"exempt", "reports"},
                     "@cost on POST /items/": {"exempt", "web"}}
    max_seats = {"reports": 4, "web": 2, "catch-all": 1, "exempt": 8}
    notes = startup.route_notes(costs, max_seats, {"exempt"}, {"reports", "web"}, reach)
    assert notes == ["@cost on POST /items/ asks for 3 seat(s): clamped to 2 on priority level "
                     "web (a level's widest request, set by their apf-gunicorn.io/max-seats "
                     "annotation; see docs/work-estimation.md)"]
    # without what the schemas say, every level counts (as before)
    assert len(startup.route_notes(costs, max_seats, {"exempt"}, {"reports", "web"})) == 2
