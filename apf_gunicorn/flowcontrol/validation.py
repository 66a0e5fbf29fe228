"""Kubernetes' validation of FlowSchema and PriorityLevelConfiguration objects, with its texts.

Two steps, both collecting every problem instead of stopping at the first:

1. :func:`decode_flow_schema_spec` / :func:`decode_priority_level_spec` check the *types* of a raw
   YAML ``spec`` (a string where an int belongs, a list where a map belongs, unknown fields) and
   return a *normalized* spec: a plain dict with every v1 field present, Go zero values for absent
   plain fields and ``None`` for absent pointer fields, which is what defaulting and validation
   work on.
2. :func:`validate_flow_schema` / :func:`validate_priority_level` apply kube-apiserver's rules
   (``pkg/apis/flowcontrol/validation``) to a defaulted normalized spec.

Every problem is a :class:`ConfigError` that prints like Kubernetes' ``field.Error``, prefixed by
file, kind and name::

    config/x.yaml: FlowSchema "foo": spec.matchingPrecedence: Invalid value: 0: must be a positive value

and :class:`ConfigErrors` carries all of them at once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from apf_gunicorn.flowcontrol.bootstrap import (
    MANDATORY_FLOW_SCHEMA_SPECS,
    MANDATORY_PRIORITY_LEVEL_SPECS,
)
from apf_gunicorn.flowcontrol.fairness import (
    ANNOTATION,
    ANNOTATION_PREFIX,
    KNOWN_ANNOTATIONS,
    NAMES,
)
from apf_gunicorn.flowcontrol.objects import (
    EXEMPT,
    KIND_FLOW_SCHEMA,
    KIND_PRIORITY_LEVEL,
    RESPONSE_QUEUE,
    RESPONSE_REJECT,
    SUBJECT_GROUP,
    SUBJECT_SERVICE_ACCOUNT,
    SUBJECT_USER,
    TYPE_EXEMPT,
    TYPE_LIMITED,
    WILDCARD,
)
from apf_gunicorn.flowcontrol.shufflesharding import MAX_HASH_BITS, required_entropy_bits
from apf_gunicorn.flowcontrol.suggest import unknown_field

MAX_MATCHING_PRECEDENCE = 10000
MAX_QUEUES = 10 * 1000 * 1000
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
SUPPORTED_PL_TYPES = (TYPE_EXEMPT, TYPE_LIMITED)
SUPPORTED_LIMIT_RESPONSES = (RESPONSE_QUEUE, RESPONSE_REJECT)

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


# --------------------------------------------------------------------------------------------
# Errors


@dataclass(frozen=True)
class ConfigError:
    """One problem: where (file, object kind and name, field path) and what (the message)."""

    file: str
    kind: str
    name: str
    field: str
    message: str

    def __str__(self) -> str:
        parts = []
        if self.file:
            parts.append(self.file)
        if self.kind:
            parts.append(f'{self.kind} "{self.name}"' if self.name else self.kind)
        if self.field:
            parts.append(self.field)
        parts.append(self.message)
        return ": ".join(parts)


class ConfigErrors(Exception):
    """Every :class:`ConfigError` of a configuration; ``str()`` gives one per line."""

    def __init__(self, errors: Iterable[ConfigError]) -> None:
        self.errors: list[ConfigError] = list(errors)
        super().__init__("\n".join(str(e) for e in self.errors))

    def __str__(self) -> str:
        return "\n".join(str(e) for e in self.errors)


def go_value(value: Any) -> str:
    """A bad value as Go's ``field.Error`` prints it (``%v`` for numbers, ``%q`` for strings,
    ``%#v`` for string slices); maps are shown as compact JSON."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "[]string{" + ", ".join(json.dumps(v, ensure_ascii=False) for v in value) + "}"
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


@dataclass
class ErrorList:
    """Collects Kubernetes-style field errors for one object."""

    file: str = ""
    kind: str = ""
    name: str = ""
    errors: list[ConfigError] = field(default_factory=list)
    #: fields whose value had the wrong type and was replaced by its zero value while decoding
    replaced: list[str] = field(default_factory=list)

    def add(self, path: str, message: str) -> None:
        self.errors.append(ConfigError(self.file, self.kind, self.name, path, message))

    def invalid(self, path: str, value: Any, detail: str) -> None:
        self.add(path, f"Invalid value: {go_value(value)}: {detail}")

    def wrong_type(self, path: str, value: Any, detail: str) -> None:
        """An ``invalid`` error for a value of the wrong type, which decoding replaces by its
        zero value: later checks of that field (or of what contains it or lies under it) would
        only echo this error, see :meth:`drop_echoes`."""
        self.invalid(path, value, detail)
        self.replaced.append(path)

    def drop_echoes(self, start: int) -> None:
        """Drop the errors added since index ``start`` that concern a field replaced by
        :meth:`wrong_type`, one containing it, or one under it: they describe the zero value,
        not the user's text. Errors about other fields (an unknown field, a bad value next to
        it) all stay, so every problem of an object is reported at once.

        Args:
            start: ``len(self.errors)`` before the checks whose echoes are to go.
        """
        if not self.replaced:
            return
        self.errors[start:] = [e for e in self.errors[start:]
                               if not any(_related(e.field, p) for p in self.replaced)]

    def required(self, path: str, detail: str = "") -> None:
        self.add(path, f"Required value: {detail}" if detail else "Required value")

    def forbidden(self, path: str, detail: str) -> None:
        self.add(path, f"Forbidden: {detail}")

    def duplicate(self, path: str, value: Any) -> None:
        self.add(path, f"Duplicate value: {go_value(value)}")

    def not_supported(self, path: str, value: Any, supported: Iterable[str]) -> None:
        values = ", ".join(json.dumps(v) for v in supported)
        self.add(path, f"Unsupported value: {go_value(value)}: supported values: {values}")

    def __bool__(self) -> bool:
        return bool(self.errors)


def _related(a: str, b: str) -> bool:
    """Whether field path ``a`` is ``b``, lies under it or contains it (``spec`` and
    ``spec.rules[0]`` are related; ``spec.rules[0]`` and ``spec.rules[1]`` are not)."""
    short, long = sorted((a, b), key=len)
    return long == short or long.startswith((short + ".", short + "["))


# --------------------------------------------------------------------------------------------
# Names (k8s.io/apimachinery/pkg/util/validation)

_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = _DNS1123_LABEL + r"(\." + _DNS1123_LABEL + r")*"
_LABEL_RE = re.compile(_DNS1123_LABEL)
_SUBDOMAIN_RE = re.compile(_DNS1123_SUBDOMAIN)


def dns1123_subdomain_errors(value: str) -> list[str]:
    errs = []
    if len(value) > 253:
        errs.append("must be no more than 253 characters")
    if not _SUBDOMAIN_RE.fullmatch(value):
        errs.append(
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, "
            "'-' or '.', and must start and end with an alphanumeric character (e.g. "
            f"'example.com', regex used for validation is '{_DNS1123_SUBDOMAIN}')"
        )
    return errs


def dns1123_label_errors(value: str) -> list[str]:
    errs = []
    if len(value) > 63:
        errs.append("must be no more than 63 characters")
    if not _LABEL_RE.fullmatch(value):
        errs.append(
            "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or "
            "'-', and must start and end with an alphanumeric character (e.g. 'my-name',  or "
            f"'123-abc', regex used for validation is '{_DNS1123_LABEL}')"
        )
    return errs


def validate_object_name(name: str, errs: ErrorList) -> None:
    """``ValidateObjectMeta`` for a cluster-scoped object named by a DNS subdomain."""
    if not name:
        errs.required("metadata.name", "name or generateName is required")
        return
    for msg in dns1123_subdomain_errors(name):
        errs.invalid("metadata.name", name, msg)


# --------------------------------------------------------------------------------------------
# Decoding: raw YAML -> normalized spec, with type errors


class _Schema:
    def zero(self) -> Any:
        raise NotImplementedError

    def decode(self, value: Any, path: str, errs: ErrorList) -> Any:
        raise NotImplementedError


class _Str(_Schema):
    def zero(self) -> str:
        return ""

    def decode(self, value: Any, path: str, errs: ErrorList) -> Any:
        if value is None:
            return ""
        if not isinstance(value, str):
            errs.wrong_type(path, value, "must be a string")
            return ""
        return value


class _Int(_Schema):
    """An int32; ``pointer`` keeps an absent value as None (for defaulting)."""

    def __init__(self, pointer: bool = False) -> None:
        self.pointer = pointer

    def zero(self) -> int | None:
        return None if self.pointer else 0

    def decode(self, value: Any, path: str, errs: ErrorList) -> Any:
        if value is None:
            return self.zero()
        if isinstance(value, bool) or not isinstance(value, int):
            errs.wrong_type(path, value, "must be an integer")
            return self.zero()
        if not _INT32_MIN <= value <= _INT32_MAX:
            errs.wrong_type(path, value, "must fit in a 32-bit signed integer")
            return self.zero()
        return value


class _Bool(_Schema):
    def zero(self) -> bool:
        return False

    def decode(self, value: Any, path: str, errs: ErrorList) -> Any:
        if value is None:
            return False
        if not isinstance(value, bool):
            errs.wrong_type(path, value, "must be a boolean")
            return False
        return value


class _List(_Schema):
    def __init__(self, item: _Schema) -> None:
        self.item = item

    def zero(self) -> list:
        return []

    def decode(self, value: Any, path: str, errs: ErrorList) -> Any:
        if value is None:
            return []
        if not isinstance(value, list):
            errs.wrong_type(path, value, "must be a list")
            return []
        return [self.item.decode(v, f"{path}[{i}]", errs) for i, v in enumerate(value)]


class _Struct(_Schema):
    def __init__(
        self, fields: dict[str, _Schema], pointer: bool = False, strict: bool = True
    ) -> None:
        self.fields = fields
        self.pointer = pointer
        self.strict = strict

    def zero(self) -> dict | None:
        if self.pointer:
            return None
        return {k: s.zero() for k, s in self.fields.items()}

    def decode(self, value: Any, path: str, errs: ErrorList) -> Any:
        if value is None:
            return self.zero()
        if not isinstance(value, dict):
            errs.wrong_type(path, value, "must be a map")
            return self.zero()
        out = {}
        for key, schema in self.fields.items():
            out[key] = schema.decode(value.get(key), f"{path}.{key}", errs)
        if self.strict:
            for key in value:
                if key not in self.fields:
                    errs.add(f"{path}.{key}", unknown_field(str(key), self.fields))
        return out


_NAME = _Struct({"name": _Str()}, pointer=True)
_SUBJECT = _Struct(
    {
        "kind": _Str(),
        "user": _NAME,
        "group": _NAME,
        "serviceAccount": _Struct({"namespace": _Str(), "name": _Str()}, pointer=True),
    }
)
_RESOURCE_RULE = _Struct(
    {
        "verbs": _List(_Str()),
        "apiGroups": _List(_Str()),
        "resources": _List(_Str()),
        "clusterScope": _Bool(),
        "namespaces": _List(_Str()),
    }
)
_NON_RESOURCE_RULE = _Struct({"verbs": _List(_Str()), "nonResourceURLs": _List(_Str())})
_FLOW_SCHEMA_SPEC = _Struct(
    {
        "priorityLevelConfiguration": _Struct({"name": _Str()}),
        "matchingPrecedence": _Int(),
        "distinguisherMethod": _Struct({"type": _Str()}, pointer=True),
        "rules": _List(
            _Struct(
                {
                    "subjects": _List(_SUBJECT),
                    "resourceRules": _List(_RESOURCE_RULE),
                    "nonResourceRules": _List(_NON_RESOURCE_RULE),
                }
            )
        ),
    }
)


def _pl_spec_schema(v1beta3: bool) -> _Struct:
    # v1beta3's nominalConcurrencyShares is a plain int32 (0 means "default"); v1's is a pointer.
    return _Struct(
        {
            "type": _Str(),
            "limited": _Struct(
                {
                    "nominalConcurrencyShares": _Int(pointer=not v1beta3),
                    "limitResponse": _Struct(
                        {
                            "type": _Str(),
                            "queuing": _Struct(
                                {
                                    "queues": _Int(),
                                    "handSize": _Int(),
                                    "queueLengthLimit": _Int(),
                                },
                                pointer=True,
                            ),
                        }
                    ),
                    "lendablePercent": _Int(pointer=True),
                    "borrowingLimitPercent": _Int(pointer=True),
                },
                pointer=True,
            ),
            "exempt": _Struct(
                {
                    "nominalConcurrencyShares": _Int(pointer=True),
                    "lendablePercent": _Int(pointer=True),
                },
                pointer=True,
            ),
        }
    )


_PL_SPEC_V1 = _pl_spec_schema(v1beta3=False)
_PL_SPEC_V1BETA3 = _pl_spec_schema(v1beta3=True)
_STATUS = _Struct(
    {"conditions": _List(_Struct({"type": _Str()}, strict=False))},
    strict=False,
)


def decode_flow_schema_spec(raw: Any, errs: ErrorList) -> dict[str, Any]:
    return _FLOW_SCHEMA_SPEC.decode(raw, "spec", errs)


def decode_priority_level_spec(raw: Any, errs: ErrorList, v1beta3: bool = False) -> dict:
    return (_PL_SPEC_V1BETA3 if v1beta3 else _PL_SPEC_V1).decode(raw, "spec", errs)


def decode_status(raw: Any, errs: ErrorList) -> dict[str, Any]:
    return _STATUS.decode(raw, "status", errs)


# --------------------------------------------------------------------------------------------
# FlowSchema


def validate_flow_schema(name: str, spec: dict, status: dict, errs: ErrorList) -> None:
    """``ValidateFlowSchema`` on a defaulted normalized spec."""
    validate_object_name(name, errs)
    _validate_flow_schema_spec(name, spec, errs)
    mandatory = MANDATORY_FLOW_SCHEMA_SPECS.get(name)
    if mandatory is not None and spec != mandatory:
        errs.invalid("spec", spec, f"spec of '{name}' must equal the fixed value")
    _validate_status(status, errs)


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


def _validate_status(status: dict, errs: ErrorList) -> None:
    seen: set[str] = set()
    for i, cond in enumerate(status["conditions"]):
        ctype = cond["type"]
        if ctype in seen:
            errs.duplicate(f"status.conditions[{i}].type", ctype)
        seen.add(ctype)
        if not ctype:
            errs.required(f"status.conditions[{i}].type", "must not be empty")


# --------------------------------------------------------------------------------------------
# PriorityLevelConfiguration


def validate_priority_level(name: str, spec: dict, status: dict, errs: ErrorList) -> None:
    """``ValidatePriorityLevelConfiguration`` on a defaulted normalized spec."""
    validate_object_name(name, errs)
    _validate_priority_level_spec(name, spec, errs)
    mandatory = MANDATORY_PRIORITY_LEVEL_SPECS.get(name)
    if mandatory is not None:
        if name == EXEMPT:
            # Admins may tune the exempt level's spec.exempt (shares and lendable percent).
            if {**spec, "exempt": None} != {**mandatory, "exempt": None}:
                errs.invalid(
                    "spec",
                    spec,
                    "spec of 'exempt' except the 'spec.exempt' field must equal the fixed value",
                )
        elif spec != mandatory:
            errs.invalid("spec", spec, f"spec of '{name}' must equal the fixed value")
    _validate_status(status, errs)


def _validate_priority_level_spec(name: str, spec: dict, errs: ErrorList) -> None:
    ptype = spec["type"]
    if (name == EXEMPT) != (ptype == TYPE_EXEMPT):
        errs.invalid("spec.type", ptype, "type must be 'Exempt' if and only if name is 'exempt'")
    if ptype == TYPE_EXEMPT:
        if spec["limited"] is not None:
            errs.forbidden("spec.limited", "must be nil if the type is not Limited")
        if spec["exempt"] is not None:
            _validate_shares_and_lendable(spec["exempt"], "spec.exempt", errs)
    elif ptype == TYPE_LIMITED:
        if spec["exempt"] is not None:
            errs.forbidden("spec.exempt", "must be nil if the type is Limited")
        if spec["limited"] is None:
            errs.required("spec.limited", "must not be empty when type is Limited")
        else:
            _validate_limited(spec["limited"], "spec.limited", errs)
    else:
        errs.not_supported("spec.type", ptype, SUPPORTED_PL_TYPES)


def _validate_shares_and_lendable(cfg: dict, path: str, errs: ErrorList) -> None:
    ncs = cfg["nominalConcurrencyShares"]
    if ncs is not None and ncs < 0:
        errs.invalid(f"{path}.nominalConcurrencyShares", ncs, "must be a non-negative integer")
    lendable = cfg["lendablePercent"]
    if lendable is not None and not 0 <= lendable <= 100:
        errs.invalid(f"{path}.lendablePercent", lendable, "must be between 0 and 100, inclusive")


def _validate_limited(limited: dict, path: str, errs: ErrorList) -> None:
    _validate_shares_and_lendable(limited, path, errs)
    borrowing = limited["borrowingLimitPercent"]
    if borrowing is not None and borrowing < 0:
        errs.invalid(
            f"{path}.borrowingLimitPercent",
            borrowing,
            "if specified, must be a non-negative integer",
        )
    lr = limited["limitResponse"]
    lr_path = f"{path}.limitResponse"
    if lr["type"] == RESPONSE_REJECT:
        if lr["queuing"] is not None:
            errs.forbidden(
                f"{lr_path}.queuing", "must be nil if limited.limitResponse.type is not Limited"
            )
    elif lr["type"] == RESPONSE_QUEUE:
        if lr["queuing"] is None:
            errs.required(
                f"{lr_path}.queuing", "must not be empty if limited.limitResponse.type is Limited"
            )
        else:
            _validate_queuing(lr["queuing"], f"{lr_path}.queuing", errs)
    else:
        errs.not_supported(f"{lr_path}.type", lr["type"], SUPPORTED_LIMIT_RESPONSES)


def _validate_queuing(q: dict, path: str, errs: ErrorList) -> None:
    qll, queues, hand = q["queueLengthLimit"], q["queues"], q["handSize"]
    if qll <= 0:
        errs.invalid(f"{path}.queueLengthLimit", qll, "must be positive")
    if queues <= 0:
        errs.invalid(f"{path}.queues", queues, "must be positive")
    elif queues > MAX_QUEUES:
        errs.invalid(f"{path}.queues", queues, f"must not be greater than {MAX_QUEUES}")
    if hand <= 0:
        errs.invalid(f"{path}.handSize", hand, "must be positive")
    elif hand > queues:
        errs.invalid(f"{path}.handSize", hand, f"should not be greater than queues ({queues})")
    elif required_entropy_bits(queues, hand) > MAX_HASH_BITS:
        errs.invalid(
            f"{path}.handSize",
            hand,
            f"required entropy bits of deckSize {queues} and handSize {hand} "
            f"should not be greater than {MAX_HASH_BITS}",
        )


# --------------------------------------------------------------------------------------------
# apf_gunicorn's own annotations (metadata.annotations["apf-gunicorn.io/..."])


class Annotations(NamedTuple):
    """What apf_gunicorn's own annotations of an object ask for (None: nothing)."""

    fairness: str | None = None  # apf-gunicorn.io/fairness: the level's fairness
    max_seats: int | None = None  # apf-gunicorn.io/max-seats: the level's widest request


def validate_annotations(annotations: dict, kind: str, spec: dict,
                         errs: ErrorList) -> Annotations:
    """Check the ``apf-gunicorn.io/`` annotations of an object; other annotations are ignored
    as Kubernetes ignores them.

    Args:
        annotations: ``metadata.annotations`` (a dict).
        kind: ``FlowSchema`` or ``PriorityLevelConfiguration``.
        spec: the object's normalized spec (a priority level's ``type`` decides whether it may
            choose a fairness or a max seats).
        errs: where problems go, each on the field ``metadata.annotations[KEY]``.

    Returns:
        The fairness a PriorityLevelConfiguration's ``apf-gunicorn.io/fairness`` names and the
        seats its ``apf-gunicorn.io/max-seats`` gives; None for what it does not set (or sets
        badly, which is in ``errs``).
    """
    fairness = max_seats = None
    for key, value in annotations.items():
        if not isinstance(key, str) or not key.startswith(ANNOTATION_PREFIX):
            continue
        path = f"metadata.annotations[{key}]"
        if key not in KNOWN_ANNOTATIONS:
            errs.add(path, f"unknown annotation (known: {', '.join(KNOWN_ANNOTATIONS)})")
            continue
        what = ("fairness" if key == ANNOTATION
                else "the widest request (max seats)")
        if kind != KIND_PRIORITY_LEVEL:
            errs.forbidden(path, f"{what} is chosen per priority level: annotate the "
                                 "PriorityLevelConfiguration")
        elif not isinstance(value, str):
            errs.invalid(path, value, "must be a string")
        elif spec["type"] == TYPE_EXEMPT:
            errs.forbidden(path, "an exempt priority level never queues, so it has no "
                                 + ("fairness" if key == ANNOTATION else "max seats"))
        elif key == ANNOTATION:
            if value not in NAMES:
                errs.not_supported(path, value, NAMES)
            else:
                fairness = value
        else:
            seats = _positive_int(value)
            if seats is None:
                errs.invalid(path, value, f"must be a positive integer of seats, at most "
                                          f"{MAX_ANNOTATED_SEATS} (e.g. \"4\")")
            else:
                max_seats = seats
    return Annotations(fairness, max_seats)


#: Largest ``apf-gunicorn.io/max-seats`` accepted (the server's limit is at most 1000000).
MAX_ANNOTATED_SEATS = 1_000_000


def _positive_int(text: str) -> int | None:
    text = text.strip()
    if not text.isascii() or not text.isdigit():
        return None
    value = int(text)
    return value if 1 <= value <= MAX_ANNOTATED_SEATS else None


# --------------------------------------------------------------------------------------------
# Runtime sanity check (apf_controller.go queueSetCompleterForPL)


def broken_reason(name: str, spec: dict) -> str | None:
    """Why the controller would ignore this (valid) priority level as broken, or None."""
    ptype = spec["type"]
    if (ptype == TYPE_LIMITED) != (spec["limited"] is not None):
        return "broken union structure at the top, for Limited"
    if (ptype == TYPE_EXEMPT) != (spec["exempt"] is not None):
        return "broken union structure at the top, for Exempt"
    if (ptype == TYPE_EXEMPT) != (name == EXEMPT):
        return "non-alignment between name and type"
    limited = spec["limited"]
    if limited is not None:
        lr = limited["limitResponse"]
        if (lr["type"] == RESPONSE_REJECT) != (lr["queuing"] is None):
            return "broken union structure for limit response"
        q = lr["queuing"]
        if q is not None and q["queues"] > 0:
            hand, queues = q["handSize"], q["queues"]
            if hand <= 0 or hand > queues or queues > 1 << 26:
                return f"bad queuing config: queues {queues}, handSize {hand}"
            if required_entropy_bits(queues, hand) > MAX_HASH_BITS:
                return f"bad queuing config: queues {queues}, handSize {hand}"
    return None


__all__ = [
    "ConfigError",
    "ConfigErrors",
    "ErrorList",
    "KIND_FLOW_SCHEMA",
    "KIND_PRIORITY_LEVEL",
    "broken_reason",
    "decode_flow_schema_spec",
    "decode_priority_level_spec",
    "decode_status",
    "dns1123_label_errors",
    "dns1123_subdomain_errors",
    "go_value",
    "non_resource_url_error",
    "Annotations",
    "validate_annotations",
    "validate_flow_schema",
    "validate_priority_level",
]
