"""How a configuration's problems are told, and the checks every kind of object shares.

Kubernetes' validation of FlowSchema and PriorityLevelConfiguration objects takes two steps, both
collecting every problem instead of stopping at the first:

1. :mod:`.spec_decoding` checks the *types* of a raw YAML ``spec`` and returns a normalized
   spec, which is what defaulting and validation work on;
2. :mod:`.flowschema_validation` and :mod:`.prioritylevel_validation` apply kube-apiserver's rules
   (``pkg/apis/flowcontrol/validation``) to a defaulted normalized spec, and
   :mod:`.apf_annotations` checks apf_gunicorn's own annotations.

This module holds what every step reports with and shares: an :class:`ErrorList` collects one
object's problems, each a :class:`ConfigError` that prints like Kubernetes' ``field.Error``,
prefixed by file, kind and name::

    config/x.yaml: FlowSchema "foo": spec.matchingPrecedence: Invalid value: 0: must be a positive value

and :class:`ConfigErrors` carries all of them at once (what the loader raises)::

    errs = ErrorList("config/x.yaml", "FlowSchema", "foo")
    validate_object_name("foo", errs)
    if errs:
        raise ConfigErrors(errs.errors)

Beside them, the object-name rules of ``k8s.io/apimachinery`` (DNS-1123) and the check of a
``status`` that both kinds share.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

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
# Status (both kinds)


def validate_status(status: dict, errs: ErrorList) -> None:
    """``ValidateFlowSchemaStatus`` / ``ValidatePriorityLevelConfigurationStatus``: the
    condition types of a decoded ``status`` are unique and not empty."""
    seen: set[str] = set()
    for i, cond in enumerate(status["conditions"]):
        ctype = cond["type"]
        if ctype in seen:
            errs.duplicate(f"status.conditions[{i}].type", ctype)
        seen.add(ctype)
        if not ctype:
            errs.required(f"status.conditions[{i}].type", "must not be empty")


__all__ = [
    "ConfigError",
    "ConfigErrors",
    "ErrorList",
    "dns1123_label_errors",
    "dns1123_subdomain_errors",
    "go_value",
    "validate_object_name",
    "validate_status",
]
