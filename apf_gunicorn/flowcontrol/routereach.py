"""Which priority levels the requests to a route can land in, from the route's path template.

The start-up notes on clamped costs (:func:`apf_gunicorn.server.startup.route_notes`) name
every level that would clamp a declared cost; a level no request to that route can reach
(its FlowSchemas cannot match the route's paths, or a schema before them matches every
request to it from everyone) is left out, so a configuration that routes ``/reports/*`` to
a wide level gets no warning about the narrow ``catch-all``::

    reachable_levels(cfg.flow_schemas, "/reports/<int:year>", kubernetes_paths=False)
    # -> {"reports"}: the "reports" schema matches every such request from everyone

The answer over-approximates (a level is left out only when no request to the route can
reach it) and is None when the route cannot be read that way: a regular expression (Django's
``re_path``), or paths that may be parsed as Kubernetes API requests (``/api/``, ``/apis/``
with Kubernetes path parsing on), whose resource rules depend on more than the path.
"""

from __future__ import annotations

from collections.abc import Iterable

from apf_gunicorn.flowcontrol.identity import AUTHENTICATED_GROUP, UNAUTHENTICATED_GROUP
from apf_gunicorn.flowcontrol.objects import (
    SUBJECT_GROUP,
    SUBJECT_USER,
    WILDCARD,
    FlowSchema,
    NonResourceRule,
    PolicyRule,
)

NONE, SOME, ALL = 0, 1, 2  # how many of a route's requests a rule matches
_REGEX = set("^$()[]{}\\*+?|")
_API_PREFIXES = ("/api/", "/apis/")


def route_prefix(template: str) -> tuple[str, bool] | None:
    """The literal start of a route's paths, and whether it is the whole path.

    Args:
        template: a Flask/werkzeug rule (``/reports/<int:year>``), a Django route (``reports/
            <int:year>/``, leading slash optional) or an ``APF_ROUTES`` path.
    Returns:
        ``("/reports/", False)``, ``("/healthz", True)``; None for a regular expression.
    """
    if _REGEX & set(template):
        return None
    path = template if template.startswith("/") else "/" + template
    cut = path.find("<")
    return (path, True) if cut < 0 else (path[:cut], False)


def _url_reach(url: str, prefix: str, exact: bool) -> int:
    """How many paths of the route a nonResourceURL matches (as matching.url_matches does:
    ``*``, the path itself, or a path under ``url`` without its ``*``)."""
    if url == WILDCARD:
        return ALL
    under = url[:-1] if url.endswith(WILDCARD) else url
    if not under.endswith("/"):
        under += "/"
    if exact:
        return ALL if prefix == url or prefix.startswith(under) else NONE
    if prefix.startswith(under):
        return ALL
    return SOME if under.startswith(prefix) or url.startswith(prefix) else NONE


def _everyone(rule: PolicyRule) -> bool:
    """Whether the rule's subjects take every request (every request's user has one of the
    two groups: identity.identity_groups)."""
    groups = {s.name for s in rule.subjects if s.kind == SUBJECT_GROUP}
    return (WILDCARD in groups or {AUTHENTICATED_GROUP, UNAUTHENTICATED_GROUP} <= groups
            or any(s.kind == SUBJECT_USER and s.name == WILDCARD for s in rule.subjects))


def _non_resource_reach(rule: NonResourceRule, prefix: str, exact: bool) -> int:
    urls = max((_url_reach(u, prefix, exact) for u in rule.non_resource_urls), default=NONE)
    return urls if rule.verbs == (WILDCARD,) else min(urls, SOME)


def _schema_reach(fs: FlowSchema, prefix: str, exact: bool) -> int:
    best = NONE
    for rule in fs.rules:
        paths = max((_non_resource_reach(r, prefix, exact) for r in rule.non_resource_rules),
                    default=NONE)
        best = max(best, paths if _everyone(rule) else min(paths, SOME))
    return best


def reachable_levels(flow_schemas: Iterable[FlowSchema], template: str,
                     kubernetes_paths: bool) -> set[str] | None:
    """The priority levels a request to the route can be classified into.

    Args:
        flow_schemas: the configuration's usable FlowSchemas, in matching order.
        template: the route's path template (see :func:`route_prefix`).
        kubernetes_paths: whether ``/api/`` and ``/apis/`` paths are parsed as Kubernetes
            API requests (``APF_PATHS``).
    Returns:
        The levels of the schemas that can match some request to the route, up to the first
        that matches every one of them from everyone; None when that cannot be told.
    """
    found = route_prefix(template)
    if found is None:
        return None
    prefix, exact = found
    if kubernetes_paths and any(prefix.startswith(p) or p.startswith(prefix)
                                for p in _API_PREFIXES):
        return None
    levels = set()
    for fs in flow_schemas:
        reach = _schema_reach(fs, prefix, exact)
        if reach != NONE:
            levels.add(fs.priority_level)
        if reach == ALL:
            return levels
    return levels
