"""Declarative route mapping: make a non-Kubernetes app's URLs look like resource requests.

FlowSchemas match resource requests by API group, resource, namespace and verb. An app whose
URLs are not Kubernetes-shaped can say, in YAML, which of its routes are which resource
(the server reads the file named by ``APF_ROUTES``):

.. code-block:: yaml

    routes:                                   # or a bare list of entries
      - path: /tenants/<namespace>/orders/<int:name>
        resource: orders
        apiGroup: shop                        # default "" (the core group)
        apiVersion: v1                        # default ""
        subresource: ""                       # default ""
        methods: [GET, POST, PUT, DELETE]     # default: every method
        verbs: {POST: create}                 # optional; other methods use the defaults
      - path: /reports/<path:rest>            # a cost-only entry: classification unchanged
        methods: [GET]
        seats: 4                              # initial seats (int >= 1, default 1)
        finalSeats: 2                         # seats kept after the response (default 0)
        additionalLatency: 50ms               # ... for this long (Go duration, default 0)
        longRunning: false                    # true: seats held only until the app returns
                                              # its response iterable (streams)

``path`` uses werkzeug's routing syntax (converters such as ``<int:...>`` and ``<path:...>``
work). The URL variables ``namespace`` and ``name`` become the request's namespace and name.
Entries are tried in werkzeug's order (most specific rule first). Default verbs are Kubernetes':
GET/HEAD with a name -> get, without -> list; POST -> create; PUT -> update; PATCH -> patch;
DELETE with a name -> delete, without -> deletecollection; any other method -> its lower-cased
name.

An entry sets the request's resource fields (``resource`` and friends), its cost (``seats``,
``finalSeats``, ``additionalLatency``, ``longRunning``), or both. The two are looked up
independently: the resource fields come from the most specific matching entry that names a
resource, the cost from the most specific matching entry that sets a cost field. An entry
with only cost fields therefore leaves the request's normal classification alone (Kubernetes
path or non-resource request) and only sets what it costs.

    table = load_routes("routes.yaml")          # raises RouteError naming the file and entry
    table.match("GET", "/tenants/acme/orders")  # -> {"verb": "list", "namespace": "acme", ...}
    table.cost("GET", "/reports/2024")          # -> WorkEstimate(4, 2, 50000000, False) or None
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml
from werkzeug.exceptions import HTTPException
from werkzeug.routing import Map, Rule
from werkzeug.routing.exceptions import RoutingException

from apf_gunicorn.flowcontrol.flowschema_validation import SUPPORTED_VERBS
from apf_gunicorn.flowcontrol.suggest import closest, unknown_keys
from apf_gunicorn.flowcontrol.workestimate import EstimateError, WorkEstimate, make_estimate

_RESOURCE_KEYS = ("resource", "apiGroup", "apiVersion", "subresource", "verbs")
#: route file key -> make_estimate argument
COST_KEYS = {"seats": "seats", "finalSeats": "final_seats",
             "additionalLatency": "additional_latency", "longRunning": "long_running"}
_COST_NAMES = {v: k for k, v in COST_KEYS.items()}
_KEYS = frozenset(("path", "methods", *_RESOURCE_KEYS, *COST_KEYS))


class RouteError(ValueError):
    """A bad routes file; the message names the file and the entry."""


class Route:
    """One entry, after checking."""

    __slots__ = ("path", "resource", "api_group", "api_version", "subresource", "verbs", "methods",
                 "cost")

    def __init__(self, path: str, resource: str = "", api_group: str = "", api_version: str = "",
                 subresource: str = "", verbs: Mapping[str, str] | None = None,
                 methods: tuple[str, ...] | None = None, cost: WorkEstimate | None = None) -> None:
        """``resource`` empty: a cost-only entry (``cost`` must be set)."""
        self.cost = cost
        self.path = path
        self.resource = resource
        self.api_group = api_group
        self.api_version = api_version
        self.subresource = subresource
        self.verbs = dict(verbs or {})
        self.methods = methods

    def verb(self, method: str, has_name: bool) -> str:
        explicit = self.verbs.get(method)
        if explicit:
            return explicit
        return default_verb(method, has_name)


def default_verb(method: str, has_name: bool) -> str:
    """Kubernetes' verb for an HTTP method on a collection (no name) or an object."""
    if method in ("GET", "HEAD"):
        return "get" if has_name else "list"
    if method == "DELETE":
        return "delete" if has_name else "deletecollection"
    return {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method, method.lower())


class RouteTable:
    """Matches (method, path) against the routes; thread-safe once built."""

    def __init__(self, routes: list[Route], source: str = "<routes>") -> None:
        self.routes = routes
        self.source = source
        # Resource entries and cost entries are matched separately (a cost-only entry must not
        # hide a resource entry, nor the other way round); None when a table has no entry.
        self._adapter = self._bind([i for i, r in enumerate(routes) if r.resource])
        self._cost_adapter = self._bind([i for i, r in enumerate(routes) if r.cost is not None])
        #: Whether any entry sets a cost (the middleware skips the lookup otherwise).
        self.has_costs = self._cost_adapter is not None

    def _bind(self, indices: list[int]):
        if not indices:
            return None
        source = self.source
        rules = Map(strict_slashes=False, merge_slashes=False, redirect_defaults=False)
        for index in indices:
            route = self.routes[index]
            try:
                rules.add(Rule(route.path, endpoint=index, methods=route.methods))
            except (ValueError, LookupError, TypeError) as exc:
                raise RouteError(f"{source}: routes[{index}] ({route.path}): bad path: {exc}") from None
        try:
            adapter = rules.bind("localhost")
            rules.update()
        except (ValueError, LookupError, TypeError) as exc:
            raise RouteError(f"{source}: bad route paths: {exc}") from None
        return adapter

    @staticmethod
    def _lookup(adapter, method: str, path: str):
        if adapter is None:
            return None
        try:
            return adapter.match(path, method=method)
        except (HTTPException, RoutingException):
            return None
        except Exception:  # a converter choking on hostile input: treat as no match
            return None

    def cost(self, method: str, path: str) -> WorkEstimate | None:
        """The declared cost of a request (most specific matching entry with a cost), or None."""
        found = self._lookup(self._cost_adapter, method, path)
        if found is None:
            return None
        return self.routes[found[0]].cost

    def match(self, method: str, path: str) -> dict[str, Any] | None:
        """The resource fields of a request on a mapped route, or None."""
        found = self._lookup(self._adapter, method, path)
        if found is None:
            return None
        index, values = found
        route = self.routes[index]
        name = values.get("name")
        name = "" if name is None else str(name)
        namespace = values.get("namespace")
        return {
            "verb": route.verb(method, bool(name)),
            "api_group": route.api_group,
            "api_version": route.api_version,
            "namespace": "" if namespace is None else str(namespace),
            "resource": route.resource,
            "subresource": route.subresource,
            "name": name,
        }


def _entry_error(source: str, index: int, entry: Any, message: str) -> RouteError:
    where = f"routes[{index}]"
    if isinstance(entry, Mapping) and isinstance(entry.get("path"), str):
        where += f" ({entry['path']})"
    return RouteError(f"{source}: {where}: {message}")


def _optional_str(source: str, index: int, entry: Mapping, key: str) -> str:
    value = entry.get(key, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _entry_error(source, index, entry, f"{key} must be a string")
    return value


def parse_routes(document: Any, source: str = "<routes>") -> RouteTable:
    """Build a table from already-parsed YAML (a list of entries or ``{routes: [...]}``)."""
    if isinstance(document, Mapping):
        extra = set(document) - {"routes"}
        if extra:
            raise RouteError(f"{source}: unknown top-level key(s) {sorted(map(str, extra))}; "
                             "expected 'routes'")
        document = document.get("routes")
    if document is None:
        document = []
    if not isinstance(document, list):
        raise RouteError(f"{source}: expected a list of routes")
    routes = []
    for index, entry in enumerate(document):
        if not isinstance(entry, Mapping):
            raise _entry_error(source, index, entry, "each route must be a mapping")
        unknown = set(entry) - _KEYS
        if unknown:
            raise _entry_error(source, index, entry, unknown_keys(unknown, _KEYS))
        path = entry.get("path")
        if not isinstance(path, str) or not path.startswith("/"):
            raise _entry_error(source, index, entry, "path is required and must start with '/'")
        cost = None
        if any(k in entry for k in COST_KEYS):
            kwargs = {COST_KEYS[k]: entry[k] for k in COST_KEYS if k in entry}
            if any(v is None for v in kwargs.values()):
                field = next(k for k in COST_KEYS if k in entry and entry[k] is None)
                raise _entry_error(source, index, entry, f"{field}: must not be empty")
            try:
                cost = make_estimate(**kwargs, names=_COST_NAMES)
            except EstimateError as exc:
                raise _entry_error(source, index, entry, str(exc)) from None
        resource = entry.get("resource")
        if cost is not None and resource is None:
            extra = [k for k in _RESOURCE_KEYS if k in entry]
            if extra:
                raise _entry_error(source, index, entry, f"{', '.join(extra)} without resource: "
                                   "a cost-only entry cannot set resource fields")
            routes.append(Route(path=path, methods=_methods(source, index, entry), cost=cost))
            continue
        if not isinstance(resource, str) or not resource:
            raise _entry_error(source, index, entry, "resource is required (a non-empty string) "
                               "unless the entry only sets a cost (seats, finalSeats, "
                               "additionalLatency, longRunning)")
        verbs_in = entry.get("verbs") or {}
        if not isinstance(verbs_in, Mapping):
            raise _entry_error(source, index, entry, "verbs must map HTTP methods to verbs")
        verbs = {}
        for method, verb in verbs_in.items():
            if not isinstance(method, str) or not isinstance(verb, str):
                raise _entry_error(source, index, entry, "verbs must map HTTP methods to verbs")
            if verb not in SUPPORTED_VERBS:  # what a FlowSchema rule can name
                match = closest(verb, SUPPORTED_VERBS)
                hint = f"; did you mean {match}?" if match else ""
                raise _entry_error(source, index, entry, f"verb {verb!r} for {method} is not "
                                   f"one of {sorted(SUPPORTED_VERBS)}{hint}")
            verbs[method.upper()] = verb
        methods = _methods(source, index, entry)
        routes.append(Route(
            path=path,
            resource=resource,
            api_group=_optional_str(source, index, entry, "apiGroup"),
            api_version=_optional_str(source, index, entry, "apiVersion"),
            subresource=_optional_str(source, index, entry, "subresource"),
            verbs=verbs,
            methods=methods,
            cost=cost,
        ))
    return RouteTable(routes, source)


def _methods(source: str, index: int, entry: Mapping) -> tuple[str, ...] | None:
    methods = entry.get("methods")
    if methods is None:
        return None
    if (not isinstance(methods, list) or not methods
            or not all(isinstance(m, str) and m for m in methods)):
        raise _entry_error(source, index, entry, "methods must be a non-empty list of "
                           "HTTP methods")
    return tuple(m.upper() for m in methods)


def load_routes(path: str) -> RouteTable:
    """Read a routes YAML file; every problem raises :class:`RouteError` naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            document = yaml.safe_load(f)
    except OSError as exc:
        raise RouteError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise RouteError(f"{path}: not valid YAML: {exc}") from None
    return parse_routes(document, path)
