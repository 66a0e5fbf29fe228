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

``path`` uses werkzeug's routing syntax (converters such as ``<int:...>`` and ``<path:...>``
work). The URL variables ``namespace`` and ``name`` become the request's namespace and name.
Entries are tried in werkzeug's order (most specific rule first). Default verbs are Kubernetes':
GET/HEAD with a name -> get, without -> list; POST -> create; PUT -> update; PATCH -> patch;
DELETE with a name -> delete, without -> deletecollection; any other method -> its lower-cased
name.

    table = load_routes("routes.yaml")          # raises RouteError naming the file and entry
    table.match("GET", "/tenants/acme/orders")  # -> {"verb": "list", "namespace": "acme", ...}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml
from werkzeug.exceptions import HTTPException
from werkzeug.routing import Map, Rule
from werkzeug.routing.exceptions import RoutingException

#: Verbs a FlowSchema rule can name (validation refuses any other).
KUBERNETES_VERBS = frozenset(
    ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection", "proxy")
)
_KEYS = frozenset(("path", "resource", "apiGroup", "apiVersion", "subresource", "verbs", "methods"))


class RouteError(ValueError):
    """A bad routes file; the message names the file and the entry."""


class Route:
    """One entry, after checking."""

    __slots__ = ("path", "resource", "api_group", "api_version", "subresource", "verbs", "methods")

    def __init__(self, path: str, resource: str, api_group: str = "", api_version: str = "",
                 subresource: str = "", verbs: Mapping[str, str] | None = None,
                 methods: tuple[str, ...] | None = None) -> None:
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
        self._map = Map(strict_slashes=False, merge_slashes=False, redirect_defaults=False)
        for index, route in enumerate(routes):
            try:
                self._map.add(Rule(route.path, endpoint=index, methods=route.methods))
            except (ValueError, LookupError, TypeError) as exc:
                raise RouteError(f"{source}: routes[{index}] ({route.path}): bad path: {exc}") from None
        try:
            self._adapter = self._map.bind("localhost")
            self._map.update()
        except (ValueError, LookupError, TypeError) as exc:
            raise RouteError(f"{source}: bad route paths: {exc}") from None

    def match(self, method: str, path: str) -> dict[str, Any] | None:
        """The resource fields of a request on a mapped route, or None."""
        try:
            index, values = self._adapter.match(path, method=method)
        except (HTTPException, RoutingException):
            return None
        except Exception:  # a converter choking on hostile input: treat as no match
            return None
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
            raise _entry_error(source, index, entry, f"unknown key(s) {sorted(map(str, unknown))}; "
                               f"allowed: {sorted(_KEYS)}")
        path = entry.get("path")
        if not isinstance(path, str) or not path.startswith("/"):
            raise _entry_error(source, index, entry, "path is required and must start with '/'")
        resource = entry.get("resource")
        if not isinstance(resource, str) or not resource:
            raise _entry_error(source, index, entry, "resource is required (a non-empty string)")
        verbs_in = entry.get("verbs") or {}
        if not isinstance(verbs_in, Mapping):
            raise _entry_error(source, index, entry, "verbs must map HTTP methods to verbs")
        verbs = {}
        for method, verb in verbs_in.items():
            if not isinstance(method, str) or not isinstance(verb, str):
                raise _entry_error(source, index, entry, "verbs must map HTTP methods to verbs")
            if verb not in KUBERNETES_VERBS:
                raise _entry_error(source, index, entry, f"verb {verb!r} for {method} is not one of "
                                   f"{sorted(KUBERNETES_VERBS)}")
            verbs[method.upper()] = verb
        methods = entry.get("methods")
        if methods is not None:
            if (not isinstance(methods, list) or not methods
                    or not all(isinstance(m, str) and m for m in methods)):
                raise _entry_error(source, index, entry, "methods must be a non-empty list of "
                                   "HTTP methods")
            methods = tuple(m.upper() for m in methods)
        routes.append(Route(
            path=path,
            resource=resource,
            api_group=_optional_str(source, index, entry, "apiGroup"),
            api_version=_optional_str(source, index, entry, "apiVersion"),
            subresource=_optional_str(source, index, entry, "subresource"),
            verbs=verbs,
            methods=methods,
        ))
    return RouteTable(routes, source)


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
