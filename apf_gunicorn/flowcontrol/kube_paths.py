"""Kubernetes API paths: how ``/api/`` and ``/apis/`` requests read, and whether to read them so.

:func:`parse_kubernetes_path` is Kubernetes' ``RequestInfoFactory.NewRequestInfo``: the verb,
API group and version, namespace, resource, subresource and name of a resource request (the
``watch`` and ``fieldSelector`` query parameters included), or None for a non-resource path.
:func:`path_parsing` decides from ``APF_PATHS`` and the configuration whether the resolver
(:class:`~apf_gunicorn.flowcontrol.requestinfo.RequestInfoResolver`) parses such paths at all::

    kubernetes, reason = path_parsing("auto", cfg.flow_schemas)
    fields = parse_kubernetes_path("GET", "/api/v1/namespaces/ns/pods", "watch=1")
    # {"verb": "watch", "api_group": "", "api_version": "v1", "namespace": "ns", ...}

Neither raises on hostile input; the query string is read up to :data:`MAX_QUERY_LENGTH`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl

from apf_gunicorn.flowcontrol.matching import resource_rules_schema

#: Longest query string parsed (only ``watch`` and ``fieldSelector`` are read from it).
MAX_QUERY_LENGTH = 8192

_SPECIAL_VERBS = frozenset(("proxy", "watch"))
_SPECIAL_VERBS_NO_SUBRESOURCES = frozenset(("proxy",))
_NAMESPACE_SUBRESOURCES = frozenset(("status", "finalize"))
_METHOD_VERBS = {
    "POST": "create",
    "GET": "get",
    "HEAD": "get",
    "PUT": "update",
    "PATCH": "patch",
    "DELETE": "delete",
}


def _watch_requested(values: list[str]) -> bool:
    # Kubernetes decodes ?watch= with Convert_Slice_string_To_bool: the first value counts and
    # anything but "0" or "false" (any case) is true, even an empty value.
    return bool(values) and values[0].lower() not in ("0", "false")


def _exact_name_from_field_selector(selector: str) -> str:
    """The name a ``fieldSelector`` pins with ``metadata.name=X`` (Kubernetes
    ``RequiresExactMatch``), or "" when it pins none or does not parse."""
    found = ""
    for term in selector.split(","):
        if "!=" in term:
            field, value = term.split("!=", 1)
        elif "==" in term:
            field, value = term.split("==", 1)
            if field.strip() == "metadata.name":
                found = value.strip()
            continue
        elif "=" in term:
            field, value = term.split("=", 1)
            if field.strip() == "metadata.name":
                found = value.strip()
            continue
        else:
            return ""  # an invalid selector: Kubernetes keeps no name
    if found in (".", "..") or "/" in found or "%" in found:
        return ""  # not a valid path segment name
    return found


def parse_kubernetes_path(method: str, path: str, query: str) -> dict[str, Any] | None:
    """Kubernetes ``RequestInfoFactory.NewRequestInfo`` for ``/api`` and ``/apis`` paths.

    Returns the resource fields (``verb``, ``api_group``, ``api_version``, ``namespace``,
    ``resource``, ``subresource``, ``name``) or None for a non-resource request.
    """
    parts = path.strip("/").split("/") if path.strip("/") else []
    if len(parts) < 3 or parts[0] not in ("api", "apis"):
        return None
    prefix = parts[0]
    parts = parts[1:]
    api_group = ""
    if prefix == "apis":
        if len(parts) < 3:
            return None
        api_group = parts[0]
        parts = parts[1:]
    api_version = parts[0]
    parts = parts[1:]

    if parts[0] in _SPECIAL_VERBS:
        if len(parts) < 2:
            # Kubernetes returns an error with what it has so far (a resource request whose verb
            # is still the lower-cased method); we classify by that instead of failing.
            return {
                "verb": method.lower(),
                "api_group": api_group,
                "api_version": api_version,
                "namespace": "",
                "resource": "",
                "subresource": "",
                "name": "",
            }
        verb = parts[0]
        parts = parts[1:]
    else:
        verb = _METHOD_VERBS.get(method, "")

    namespace = ""
    if parts[0] == "namespaces":
        if len(parts) > 1:
            namespace = parts[1]
            if len(parts) > 2 and parts[2] not in _NAMESPACE_SUBRESOURCES:
                parts = parts[2:]

    resource = name = subresource = ""
    if len(parts) >= 3 and verb not in _SPECIAL_VERBS_NO_SUBRESOURCES:
        subresource = parts[2]
    if len(parts) >= 2:
        name = parts[1]
    if len(parts) >= 1:
        resource = parts[0]

    if not name and verb == "get":
        params: dict[str, list[str]] = {}
        if query:
            for key, value in parse_qsl(query[:MAX_QUERY_LENGTH], keep_blank_values=True,
                                        errors="replace"):
                params.setdefault(key, []).append(value)
        verb = "watch" if _watch_requested(params.get("watch", [])) else "list"
        selectors = params.get("fieldSelector")
        if selectors:
            name = _exact_name_from_field_selector(selectors[0])
    if not name and verb == "delete":
        verb = "deletecollection"
    return {
        "verb": verb,
        "api_group": api_group,
        "api_version": api_version,
        "namespace": namespace,
        "resource": resource,
        "subresource": subresource,
        "name": name,
    }


#: ``APF_PATHS`` values: how ``/api/`` and ``/apis/`` paths are read.
PATHS_AUTO = "auto"
PATHS_KUBERNETES = "kubernetes"
PATHS_PLAIN = "plain"
PATH_MODES = (PATHS_AUTO, PATHS_KUBERNETES, PATHS_PLAIN)


def path_parsing(mode: str, flow_schemas: Iterable[Any]) -> tuple[bool, str]:
    """Whether ``/api/`` and ``/apis/`` paths are parsed as Kubernetes API requests, and why.

    Args:
        mode: ``APF_PATHS``: ``kubernetes`` (always), ``plain`` (never) or ``auto``: when some
            FlowSchema has resource rules that can change a request's FlowSchema
            (:func:`.matching.resource_rules_schema`; the mandatory schemas' match-everything
            rules do not count).
        flow_schemas: the configuration's FlowSchemas (read for ``auto`` only).

    Returns:
        ``(kubernetes, reason)``, e.g. ``(True, "APF_PATHS=auto: FlowSchema 'system-nodes' has
        resource rules")``.

    Raises:
        ValueError: ``mode`` is not one of :data:`PATH_MODES`.
    """
    if mode == PATHS_KUBERNETES:
        return True, "APF_PATHS=kubernetes"
    if mode == PATHS_PLAIN:
        return False, "APF_PATHS=plain"
    if mode != PATHS_AUTO:
        raise ValueError(f"APF_PATHS must be one of {', '.join(PATH_MODES)}, got {mode!r}")
    fs = resource_rules_schema(flow_schemas)
    if fs is not None:
        return True, f"APF_PATHS=auto: FlowSchema {fs.name!r} has resource rules"
    return False, "APF_PATHS=auto: no FlowSchema has resource rules"
