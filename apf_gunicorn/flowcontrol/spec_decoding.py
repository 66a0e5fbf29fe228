"""Decoding a raw YAML ``spec`` or ``status`` into a normalized one, with Kubernetes' type errors.

The first step of validation (:mod:`.validation` describes both): the *types* of the user's text
are checked (a string where an int belongs, a list where a map belongs, unknown fields), every
problem is collected, and a *normalized* spec comes back: a plain dict with every v1 field
present, Go zero values for absent plain fields and ``None`` for absent pointer fields, which is
what defaulting and :mod:`.flowschema_validation` / :mod:`.prioritylevel_validation` work on::

    errs = ErrorList(file, kind, name)
    spec = decode_flow_schema_spec(doc.get("spec"), errs)
    status = decode_status(doc.get("status"), errs)

A value of the wrong type is reported once (:meth:`.validation.ErrorList.wrong_type`) and
replaced by its zero value, so later checks still run on the rest of the object.
"""

from __future__ import annotations

from typing import Any

from apf_gunicorn.flowcontrol.suggest import unknown_field
from apf_gunicorn.flowcontrol.validation import ErrorList

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


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
