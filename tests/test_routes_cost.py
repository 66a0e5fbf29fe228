"""Cost fields of APF_ROUTES entries: parsing, cost-only entries that keep the request's normal
classification, independent lookup of resource fields and cost, validation messages naming the
file, the entry and the field."""

from __future__ import annotations

import pytest
import yaml

from apf_gunicorn.flowcontrol.requestinfo import RequestInfoResolver
from apf_gunicorn.flowcontrol.routes import RouteError, load_routes, parse_routes
from apf_gunicorn.flowcontrol.workestimate import WorkEstimate

ROUTES = """
routes:
  - path: /tenants/<namespace>/orders
    resource: orders
    apiGroup: shop
    methods: [GET]
    seats: 3
  - path: /tenants/<namespace>/orders
    resource: orders
    apiGroup: shop
    methods: [POST]
    finalSeats: 2
    additionalLatency: 20ms
  - path: /reports/<path:rest>
    seats: 6
  - path: /reports/<int:year>/status
    resource: reports
    subresource: status
  - path: /api/v1/namespaces/<namespace>/pods
    methods: [GET]
    seats: 5
  - path: /events
    longRunning: true
"""

TABLE = parse_routes(yaml.safe_load(ROUTES), "routes.yaml")
RESOLVER = RequestInfoResolver(routes=TABLE)


def env(method: str, path: str, query: str = "") -> dict:
    return {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": query}


@pytest.mark.parametrize("method, path, expected", [
    ("GET", "/tenants/acme/orders", WorkEstimate(3)),
    ("POST", "/tenants/acme/orders", WorkEstimate(1, 2, 20_000_000)),
    ("GET", "/reports/2024/q1", WorkEstimate(6)),
    # the more specific resource entry sets no cost: the cost entry still applies
    ("GET", "/reports/2024/status", WorkEstimate(6)),
    ("GET", "/api/v1/namespaces/x/pods", WorkEstimate(5)),
    ("POST", "/api/v1/namespaces/x/pods", None),  # methods: [GET]
    ("GET", "/events", WorkEstimate(1, 0, 0, True)),
    ("GET", "/nothing", None),
    ("GET", "/reports", None),
])
def test_costs(method, path, expected) -> None:
    assert TABLE.cost(method, path) == expected


def test_cost_only_entries_keep_the_normal_classification() -> None:
    # a Kubernetes path with a cost-only entry is still parsed as Kubernetes does
    a = RESOLVER(env("GET", "/api/v1/namespaces/x/pods", "watch=1"))
    assert (a.is_resource, a.verb, a.resource, a.namespace) == (True, "watch", "pods", "x")
    # a non-resource path stays non-resource
    a = RESOLVER(env("GET", "/reports/2024/q1"))
    assert (a.is_resource, a.verb, a.path) == (False, "get", "/reports/2024/q1")
    # and a resource entry under a cost-only one still maps its resource
    a = RESOLVER(env("GET", "/reports/2024/status"))
    assert (a.is_resource, a.resource, a.subresource) == (True, "reports", "status")
    assert TABLE.match("GET", "/events") is None


def test_resource_entries_with_costs_classify_as_before() -> None:
    a = RESOLVER(env("POST", "/tenants/acme/orders"))
    assert (a.verb, a.api_group, a.resource, a.namespace) == ("create", "shop", "orders", "acme")


def test_tables_without_costs() -> None:
    table = parse_routes([{"path": "/a", "resource": "r"}])
    assert not table.has_costs and table.cost("GET", "/a") is None
    assert TABLE.has_costs
    only = parse_routes([{"path": "/a", "seats": 2}])
    assert only.cost("GET", "/a") == WorkEstimate(2) and only.match("GET", "/a") is None


@pytest.mark.parametrize("text, message", [
    ("- {path: /a, seats: 0}", "routes[0] (/a): seats: must be an integer from 1 to"),
    ("- {path: /a, seats: two}", "routes[0] (/a): seats: must be an integer >= 1, got 'two'"),
    ("- {path: /a, resource: r}\n- {path: /b, finalSeats: -1}",
     "routes[1] (/b): finalSeats: must be an integer from 0 to"),
    ("- {path: /a, finalSeats: 1, additionalLatency: soon}",
     "routes[0] (/a): additionalLatency: 'soon' is not a Go duration"),
    ("- {path: /a, finalSeats: 1, additionalLatency: 50}",
     "routes[0] (/a): additionalLatency: must be a Go duration string"),
    ("- {path: /a, longRunning: maybe}", "routes[0] (/a): longRunning: must be true or false"),
    ("- {path: /a, seats: }", "routes[0] (/a): seats: must not be empty"),
    ("- {path: /a, seats: 2, apiGroup: g}",
     "routes[0] (/a): apiGroup without resource: a cost-only entry cannot set resource"),
    ("- {path: /a, seats: 2, verbs: {GET: get}}", "routes[0] (/a): verbs without resource"),
    ("- {path: /a, seats: 2, methods: GET}", "routes[0] (/a): methods must be a non-empty list"),
    ("- {path: /a, cost: 2}", "routes[0] (/a): unknown key(s) ['cost']"),
    ("- {path: /a, methods: [GET]}", "routes[0] (/a): resource is required"),
    ("- {path: '/a/<nope:x>', seats: 2}", "routes[0] (/a/<nope:x>): bad path"),
])
def test_bad_cost_entries_name_file_entry_and_field(tmp_path, text, message) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(text)
    with pytest.raises(RouteError) as err:
        load_routes(str(path))
    assert str(err.value).startswith(f"{path}: ")
    assert message in str(err.value)


def test_load_routes_with_costs(tmp_path) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(ROUTES)
    table = load_routes(str(path))
    assert table.cost("POST", "/tenants/t/orders") == WorkEstimate(1, 2, 20_000_000)


@pytest.mark.parametrize(("text", "message"), [
    ("- {path: /a, resource: r, verb: {GET: get}}",
     "unknown key(s) ['verb']; did you mean verbs?; allowed: "),
    ("- {path: /a, seat: 2, finalSeat: 1}",
     "unknown key(s) ['finalSeat', 'seat']; did you mean finalSeats for finalSeat, seats for "
     "seat?"),
    ("- {path: /a, resource: r, verbs: {GET: lsit}}", "'watch']; did you mean list?"),
    ("- {path: /a, zzz: 1, seats: 2}", "unknown key(s) ['zzz']; allowed: "),
])
def test_a_misspelt_routes_key_or_verb_gets_a_did_you_mean(tmp_path, text, message) -> None:
    path = tmp_path / "routes.yaml"
    path.write_text(text)
    with pytest.raises(RouteError) as err:
        load_routes(str(path))
    assert message in str(err.value), str(err.value)


def test_routes_take_the_verbs_a_flowschema_can_name() -> None:
    """routes.py kept its own list of Kubernetes verbs beside the FlowSchema validator's: a
    verb one accepted and the other refused would make a route no FlowSchema can match."""
    from apf_gunicorn.flowcontrol import routes
    from apf_gunicorn.flowcontrol.flowschema_validation import SUPPORTED_VERBS

    assert not hasattr(routes, "KUBERNETES_VERBS")
    for verb in SUPPORTED_VERBS:
        table = parse_routes([{"path": "/a", "resource": "r", "verbs": {"POST": verb}}])
        assert table.match("POST", "/a")["verb"] == verb
