"""kube-apiserver's validation rules for a FlowSchema, with Kubernetes' texts.

``ValidateFlowSchema`` of ``pkg/apis/flowcontrol/validation``, on a spec that
:mod:`.spec_decoding` normalized and the loader defaulted; every problem goes to the
:class:`~.validation.ErrorList` given::

    validate_flow_schema(name, spec, status, errs)

:func:`non_resource_url_error` is also the rule for one ``nonResourceURLs`` entry on its own.
"""

from __future__ import annotations

from apf_gunicorn.flowcontrol.bootstrap import MANDATORY_FLOW_SCHEMA_SPECS
from apf_gunicorn.flowcontrol.objects import (
    EXEMPT,
    SUBJECT_GROUP,
    SUBJECT_SERVICE_ACCOUNT,
    SUBJECT_USER,
    WILDCARD,
)
from apf_gunicorn.flowcontrol.validation import (
    ErrorList,
    dns1123_label_errors,
    dns1123_subdomain_errors,
    validate_object_name,
    validate_status,
)

MAX_MATCHING_PRECEDENCE = 10000
SUPPORTED_VERBS = (
    "create",
    "delete",
    "deletecollection",
    "get",
    "list",
    "patch",
    "proxy",
    "update",
    "watch",
)
SUPPORTED_DISTINGUISHERS = ("ByNamespace", "ByUser")
SUPPORTED_SUBJECT_KINDS = (SUBJECT_GROUP, SUBJECT_SERVICE_ACCOUNT, SUBJECT_USER)


def validate_flow_schema(name: str, spec: dict, status: dict, errs: ErrorList) -> None:
    """``ValidateFlowSchema`` on a defaulted normalized spec."""
    validate_object_name(name, errs)
    _validate_flow_schema_spec(name, spec, errs)
    mandatory = MANDATORY_FLOW_SCHEMA_SPECS.get(name)
    if mandatory is not None and spec != mandatory:
        errs.invalid("spec", spec, f"spec of '{name}' must equal the fixed value")
    validate_status(status, errs)


def _validate_flow_schema_spec(fs_name: str, spec: dict, errs: ErrorList) -> None:
    prec = spec["matchingPrecedence"]
    if prec <= 0:
        errs.invalid("spec.matchingPrecedence", prec, "must be a positive value")
    if prec > MAX_MATCHING_PRECEDENCE:
        errs.invalid(
            "spec.matchingPrecedence", prec, f"must not be greater than {MAX_MATCHING_PRECEDENCE}"
        )
    if prec == 1 and fs_name != EXEMPT:
        errs.invalid(
            "spec.matchingPrecedence",
            prec,
            "only the schema named 'exempt' may have matchingPrecedence 1",
        )
    dm = spec["distinguisherMethod"]
    if dm is not None and dm["type"] not in SUPPORTED_DISTINGUISHERS:
        errs.not_supported("spec.distinguisherMethod.type", dm["type"], SUPPORTED_DISTINGUISHERS)
    pl_name = spec["priorityLevelConfiguration"]["name"]
    if pl_name:
        for msg in dns1123_subdomain_errors(pl_name):
            errs.invalid("spec.priorityLevelConfiguration.name", pl_name, msg)
    else:
        errs.required("spec.priorityLevelConfiguration.name", "must reference a priority level")
    for i, rule in enumerate(spec["rules"]):
        _validate_policy_rule(rule, f"spec.rules[{i}]", errs)


def _validate_policy_rule(rule: dict, path: str, errs: ErrorList) -> None:
    if rule["subjects"]:
        for i, subject in enumerate(rule["subjects"]):
            _validate_subject(subject, f"{path}.subjects[{i}]", errs)
    else:
        errs.required(f"{path}.subjects", "subjects must contain at least one value")
    if not rule["resourceRules"] and not rule["nonResourceRules"]:
        errs.required(
            path, "at least one of resourceRules and nonResourceRules has to be non-empty"
        )
    for i, rr in enumerate(rule["resourceRules"]):
        _validate_resource_rule(rr, f"{path}.resourceRules[{i}]", errs)
    for i, nr in enumerate(rule["nonResourceRules"]):
        _validate_non_resource_rule(nr, f"{path}.nonResourceRules[{i}]", errs)


_MEMBER_OF_KIND = {
    SUBJECT_USER: "user",
    SUBJECT_GROUP: "group",
    SUBJECT_SERVICE_ACCOUNT: "serviceAccount",
}


def _validate_subject(subject: dict, path: str, errs: ErrorList) -> None:
    kind = subject["kind"]
    member = _MEMBER_OF_KIND.get(kind)
    if member is None:
        errs.not_supported(f"{path}.kind", kind, SUPPORTED_SUBJECT_KINDS)
        return
    value = subject[member]
    if value is None:
        errs.required(f"{path}.{member}", f"{member} is required when subject kind is '{kind}'")
    elif kind == SUBJECT_SERVICE_ACCOUNT:
        _validate_service_account(value, f"{path}.{member}", errs)
    elif not value["name"]:
        errs.required(f"{path}.{member}.name")
    for other_kind, other in _MEMBER_OF_KIND.items():
        if other != member and subject[other] is not None:
            errs.forbidden(
                f"{path}.{other}", f"{other} is forbidden when subject kind is not '{other_kind}'"
            )


def _validate_service_account(sa: dict, path: str, errs: ErrorList) -> None:
    name, namespace = sa["name"], sa["namespace"]
    if not name:
        errs.required(f"{path}.name")
    elif name != WILDCARD:
        for msg in dns1123_subdomain_errors(name):
            errs.invalid(f"{path}.name", name, msg)
    if namespace:
        for msg in dns1123_label_errors(namespace):
            errs.invalid(f"{path}.namespace", namespace, msg)
    else:
        errs.required(f"{path}.namespace", "must specify namespace for service account")


def _validate_verbs(verbs: list[str], path: str, errs: ErrorList) -> None:
    if not verbs:
        errs.required(path, "verbs must contain at least one value")
    elif WILDCARD in verbs:
        if len(verbs) > 1:
            errs.invalid(path, verbs, "if '*' is present, must not specify other verbs")
    elif not set(verbs) <= set(SUPPORTED_VERBS):
        errs.not_supported(path, verbs, SUPPORTED_VERBS)


def _validate_resource_rule(rr: dict, path: str, errs: ErrorList) -> None:
    _validate_verbs(rr["verbs"], f"{path}.verbs", errs)
    groups = rr["apiGroups"]
    if not groups:
        errs.required(f"{path}.apiGroups", "resource rules must supply at least one api group")
    elif len(groups) > 1 and WILDCARD in groups:
        errs.invalid(
            f"{path}.apiGroups", groups, "if '*' is present, must not specify other api groups"
        )
    resources = rr["resources"]
    if not resources:
        errs.required(f"{path}.resources", "resource rules must supply at least one resource")
    elif len(resources) > 1 and WILDCARD in resources:
        errs.invalid(
            f"{path}.resources", resources, "if '*' is present, must not specify other resources"
        )
    namespaces = rr["namespaces"]
    if not namespaces and not rr["clusterScope"]:
        errs.required(
            f"{path}.namespaces",
            "resource rules that are not cluster scoped must supply at least one namespace",
        )
    elif WILDCARD in namespaces:
        if len(namespaces) > 1:
            errs.invalid(
                f"{path}.namespaces",
                namespaces,
                "if '*' is present, must not specify other namespaces",
            )
    else:
        for i, ns in enumerate(namespaces):
            for msg in dns1123_label_errors(ns):
                errs.invalid(
                    f"{path}.namespaces[{i}]",
                    ns,
                    "each member of this list must be '*' or a DNS-1123 label; " + msg,
                )


def _validate_non_resource_rule(nr: dict, path: str, errs: ErrorList) -> None:
    _validate_verbs(nr["verbs"], f"{path}.verbs", errs)
    urls = nr["nonResourceURLs"]
    if not urls:
        errs.required(f"{path}.nonResourceURLs", "nonResourceURLs must contain at least one value")
    elif WILDCARD in urls:
        if len(urls) > 1:
            errs.invalid(
                f"{path}.nonResourceURLs",
                urls,
                "if '*' is present, must not specify other non-resource URLs",
            )
    else:
        for i, url in enumerate(urls):
            detail = non_resource_url_error(url)
            if detail:
                errs.invalid(f"{path}.nonResourceURLs[{i}]", url, detail)


def non_resource_url_error(path: str) -> str | None:
    """``ValidateNonResourceURLPath``: the detail text, or None when the path is fine."""
    if not path:
        return "must not be empty"
    if path == "/":
        return None
    if not path.startswith("/"):
        return "must start with slash"
    if " " in path:
        return "must not contain white-space"
    if "//" in path:
        return "must not contain double slash"
    stars = path.count("*")
    if stars > 1 or (stars == 1 and not path.endswith("/*")):
        return "wildcard can only do suffix matching"
    return None
