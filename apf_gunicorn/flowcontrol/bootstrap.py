"""The mandatory APF objects (``exempt`` and ``catch-all``), exactly as Kubernetes defines them.

Kubernetes' bootstrap ensurer creates these when a cluster lacks them, and its validation refuses
changes to them (except the ``spec.exempt`` field of the ``exempt`` priority level). This module
holds them in two forms:

* ``MANDATORY_*_SPECS``: the defaulted v1 ``spec`` as a plain dict, shaped like the normalized
  specs :mod:`apf_gunicorn.flowcontrol.spec_decoding` produces, for the equality checks;
* ``MANDATORY_FLOW_SCHEMAS`` / ``MANDATORY_PRIORITY_LEVELS``: the typed objects
  (``source="<built-in>"``, a derived uid) that :mod:`apf_gunicorn.flowcontrol.configuration` adds
  when a configuration lacks them, as the ensurer does.

    >>> MANDATORY_PRIORITY_LEVELS["catch-all"].nominal_concurrency_shares
    5
"""

from __future__ import annotations

import copy
from typing import Any

from apf_gunicorn.flowcontrol.objects import (
    CATCH_ALL,
    DISTINGUISH_BY_USER,
    EXEMPT,
    RESPONSE_REJECT,
    SUBJECT_GROUP,
    TYPE_EXEMPT,
    TYPE_LIMITED,
    FlowSchema,
    NonResourceRule,
    PolicyRule,
    PriorityLevel,
    ResourceRule,
    Subject,
)

BUILTIN_SOURCE = "<built-in>"
AUTOUPDATE_ANNOTATION = "apf.kubernetes.io/autoupdate-spec"

GROUP_MASTERS = "system:masters"
GROUP_AUTHENTICATED = "system:authenticated"
GROUP_UNAUTHENTICATED = "system:unauthenticated"


def _group(name: str) -> dict[str, Any]:
    return {"kind": SUBJECT_GROUP, "user": None, "group": {"name": name}, "serviceAccount": None}


_ALL_RESOURCES = {
    "verbs": ["*"],
    "apiGroups": ["*"],
    "resources": ["*"],
    "clusterScope": True,
    "namespaces": ["*"],
}
_ALL_NON_RESOURCES = {"verbs": ["*"], "nonResourceURLs": ["*"]}

MANDATORY_FLOW_SCHEMA_SPECS: dict[str, dict[str, Any]] = {
    EXEMPT: {
        "priorityLevelConfiguration": {"name": EXEMPT},
        "matchingPrecedence": 1,
        "distinguisherMethod": None,
        "rules": [
            {
                "subjects": [_group(GROUP_MASTERS)],
                "resourceRules": [dict(_ALL_RESOURCES)],
                "nonResourceRules": [dict(_ALL_NON_RESOURCES)],
            }
        ],
    },
    CATCH_ALL: {
        "priorityLevelConfiguration": {"name": CATCH_ALL},
        "matchingPrecedence": 10000,
        "distinguisherMethod": {"type": DISTINGUISH_BY_USER},
        "rules": [
            {
                "subjects": [_group(GROUP_UNAUTHENTICATED), _group(GROUP_AUTHENTICATED)],
                "resourceRules": [dict(_ALL_RESOURCES)],
                "nonResourceRules": [dict(_ALL_NON_RESOURCES)],
            }
        ],
    },
}

MANDATORY_PRIORITY_LEVEL_SPECS: dict[str, dict[str, Any]] = {
    EXEMPT: {
        "type": TYPE_EXEMPT,
        "limited": None,
        "exempt": {"nominalConcurrencyShares": 0, "lendablePercent": 0},
    },
    CATCH_ALL: {
        "type": TYPE_LIMITED,
        "limited": {
            "nominalConcurrencyShares": 5,
            "limitResponse": {"type": RESPONSE_REJECT, "queuing": None},
            "lendablePercent": 0,
            "borrowingLimitPercent": None,
        },
        "exempt": None,
    },
}

_ALL_RESOURCE_RULE = ResourceRule(
    verbs=("*",), api_groups=("*",), resources=("*",), cluster_scope=True, namespaces=("*",)
)
_ALL_NON_RESOURCE_RULE = NonResourceRule(verbs=("*",), non_resource_urls=("*",))

MANDATORY_FLOW_SCHEMAS: dict[str, FlowSchema] = {
    EXEMPT: FlowSchema(
        name=EXEMPT,
        priority_level=EXEMPT,
        matching_precedence=1,
        distinguisher=None,
        rules=(
            PolicyRule(
                subjects=(Subject(SUBJECT_GROUP, GROUP_MASTERS),),
                resource_rules=(_ALL_RESOURCE_RULE,),
                non_resource_rules=(_ALL_NON_RESOURCE_RULE,),
            ),
        ),
        uid="",
        source=BUILTIN_SOURCE,
    ),
    CATCH_ALL: FlowSchema(
        name=CATCH_ALL,
        priority_level=CATCH_ALL,
        matching_precedence=10000,
        distinguisher=DISTINGUISH_BY_USER,
        rules=(
            PolicyRule(
                subjects=(
                    Subject(SUBJECT_GROUP, GROUP_UNAUTHENTICATED),
                    Subject(SUBJECT_GROUP, GROUP_AUTHENTICATED),
                ),
                resource_rules=(_ALL_RESOURCE_RULE,),
                non_resource_rules=(_ALL_NON_RESOURCE_RULE,),
            ),
        ),
        uid="",
        source=BUILTIN_SOURCE,
    ),
}

MANDATORY_PRIORITY_LEVELS: dict[str, PriorityLevel] = {
    EXEMPT: PriorityLevel(
        name=EXEMPT,
        type=TYPE_EXEMPT,
        nominal_concurrency_shares=0,
        lendable_percent=0,
        borrowing_limit_percent=None,
        limit_response=None,
        queuing=None,
        uid="",
        source=BUILTIN_SOURCE,
    ),
    CATCH_ALL: PriorityLevel(
        name=CATCH_ALL,
        type=TYPE_LIMITED,
        nominal_concurrency_shares=5,
        lendable_percent=0,
        borrowing_limit_percent=None,
        limit_response=RESPONSE_REJECT,
        queuing=None,
        uid="",
        source=BUILTIN_SOURCE,
    ),
}


def mandatory_manifests() -> list[dict[str, Any]]:
    """The four mandatory objects as v1 manifests (what ``builtin:mandatory`` ships)."""
    out: list[dict[str, Any]] = []
    for name in (EXEMPT, CATCH_ALL):
        out.append(_manifest("PriorityLevelConfiguration", name, MANDATORY_PRIORITY_LEVEL_SPECS))
    for name in (EXEMPT, CATCH_ALL):
        out.append(_manifest("FlowSchema", name, MANDATORY_FLOW_SCHEMA_SPECS))
    return out


def _manifest(kind: str, name: str, specs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
        "kind": kind,
        "metadata": {"name": name, "annotations": {AUTOUPDATE_ANNOTATION: "true"}},
        "spec": _drop_nulls(copy.deepcopy(specs[name])),
    }


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value
