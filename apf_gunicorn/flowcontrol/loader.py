"""Load APF configuration from YAML: files or directories -> defaulting -> validation -> digest.

    from apf_gunicorn.flowcontrol.loader import load_configuration, builtin_path
    cfg = load_configuration("apf/")           # a file, a directory, or None (built-in webapp)
    cfg = load_configuration(builtin_path("kubernetes"))

What is read:

* a YAML file, or every ``*.yaml`` / ``*.yml`` file directly inside a directory (sorted by name,
  not recursive, hidden files skipped; a directory without any is an error);
* several documents per file, and ``List`` / ``FlowSchemaList`` /
  ``PriorityLevelConfigurationList`` wrappers (``kubectl get flowschemas,prioritylevelconfigurations
  -o yaml`` output loads as is: metadata other than name and uid, and status other than
  condition types, are ignored);
* ``apiVersion: flowcontrol.apiserver.k8s.io/v1``, and ``v1beta3``, whose schema is the same except
  that ``nominalConcurrencyShares`` 0 means "default to 30" (Kubernetes' v1beta3 defaulting).
  Older versions (``v1beta2``, ``v1beta1``, ``v1alpha1``) are refused with a message.
* a path ``builtin:<name>`` names a shipped configuration (see :func:`builtin_path`).

Every problem in every file is collected and raised together as
:class:`~apf_gunicorn.flowcontrol.validation.ConfigErrors`; a missing or unreadable path raises
``OSError``.
"""

from __future__ import annotations

import importlib.resources
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from apf_gunicorn.flowcontrol.apf_annotations import validate_annotations
from apf_gunicorn.flowcontrol.configuration import (
    Configuration,
    digest,
    flow_schema_from_spec,
    priority_level_from_spec,
)
from apf_gunicorn.flowcontrol.flowschema_validation import validate_flow_schema
from apf_gunicorn.flowcontrol.objects import (
    KIND_FLOW_SCHEMA,
    KIND_PRIORITY_LEVEL,
    FlowSchema,
    PriorityLevel,
)
from apf_gunicorn.flowcontrol.prioritylevel_validation import broken_reason, validate_priority_level
from apf_gunicorn.flowcontrol.spec_decoding import (
    decode_flow_schema_spec,
    decode_priority_level_spec,
    decode_status,
)
from apf_gunicorn.flowcontrol.suggest import unknown_field
from apf_gunicorn.flowcontrol.validation import ConfigError, ConfigErrors, ErrorList

GROUP = "flowcontrol.apiserver.k8s.io"
API_V1 = f"{GROUP}/v1"
API_V1BETA3 = f"{GROUP}/v1beta3"
SUPPORTED_API_VERSIONS = (API_V1, API_V1BETA3)
LIST_KINDS = {
    "List": None,
    "FlowSchemaList": KIND_FLOW_SCHEMA,
    "PriorityLevelConfigurationList": KIND_PRIORITY_LEVEL,
}
OBJECT_KINDS = (KIND_FLOW_SCHEMA, KIND_PRIORITY_LEVEL)
_TOP_LEVEL_FIELDS = ("apiVersion", "kind", "metadata", "spec", "status")
BUILTIN_PREFIX = "builtin:"
DEFAULT_BUILTIN = "webapp"
#: Without APF_CONFIG when no request can carry a verified identity (server.settings).
PUBLIC_BUILTIN = "public"
# metadata.uid goes into a response header as is: visible ASCII only (Kubernetes: a UUID)
_UID_RE = re.compile(r"[!-~]{0,128}")
V1BETA3_PRESERVE_ZERO = "flowcontrol.k8s.io/v1beta3-preserve-zero-concurrency-shares"

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def builtin_path(name: str = DEFAULT_BUILTIN) -> Path:
    """The directory of a shipped configuration (``webapp``, ``public``, ``kubernetes``,
    ``mandatory``)."""
    root = Path(str(importlib.resources.files("apf_gunicorn.builtin_config")))
    path = root / name
    if not path.is_dir():
        available = sorted(
            p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("_")
        )
        raise ValueError(f"no built-in configuration {name!r}; available: {', '.join(available)}")
    return path


def load_configuration(path: str | Path | None,
                       contents: list[tuple[str, bytes]] | None = None) -> Configuration:
    """Read, default, validate and digest a configuration; ``None`` means the built-in webapp set.

    ``contents``: the files' bytes as :func:`read_config_files` returned them for ``path``
    (the master hashes the very bytes it applies); read here when None.

    Raises ``ConfigErrors`` listing every problem, or ``OSError`` if the path cannot be read.
    """
    if contents is None:
        contents = read_config_files(path)
    parsed: list[ParsedObject] = []
    errors: list[ConfigError] = []
    if not contents:
        # Almost always a wrong path or an empty mount; use builtin:mandatory to mean "nothing".
        errors.append(ConfigError(str(path), "", "", "", "no *.yaml or *.yml files in directory"))
    for source, data in contents:
        objs, errs = load_bytes(data, source)
        parsed.extend(objs)
        errors.extend(errs)
    errors.extend(duplicate_errors(parsed))
    if errors:
        raise ConfigErrors(errors)
    return digest_objects(parsed, sources=[source for source, _ in contents])


def read_config_files(path: str | Path | None) -> list[tuple[str, bytes]]:
    """``(file name, bytes)`` of every file :func:`config_files` names, in its order.

    Raises:
        OSError: the path or one of its files cannot be read.
    """
    return [(str(f), f.read_bytes()) for f in config_files(path)]


def config_files(path: str | Path | None) -> list[Path]:
    """The files a path stands for (see the module docstring)."""
    if path is None:
        path = builtin_path()
    elif isinstance(path, str) and path.startswith(BUILTIN_PREFIX):
        path = builtin_path(path[len(BUILTIN_PREFIX) :])
    path = Path(path)
    if path.is_dir():
        return sorted(
            p
            for p in path.iterdir()
            if p.suffix in (".yaml", ".yml") and not p.name.startswith(".") and p.is_file()
        )
    if not path.exists():
        raise FileNotFoundError(2, "No such file or directory", str(path))
    return [path]


@dataclass(frozen=True)
class ParsedObject:
    """One valid object read from a file, already converted to its typed form."""

    kind: str
    name: str
    source: str
    obj: FlowSchema | PriorityLevel
    broken: str | None = None  # why the controller would ignore this priority level


def load_file(file: str | Path) -> tuple[list[ParsedObject], list[ConfigError]]:
    """Parse one YAML file; returns its valid objects and every error found in it."""
    return load_bytes(Path(file).read_bytes(), str(file))


def load_bytes(data: bytes, source: str) -> tuple[list[ParsedObject], list[ConfigError]]:
    """Parse a file's bytes (UTF-8 YAML) as :func:`load_file` does."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return [], [ConfigError(source, "", "", "", f"not UTF-8 text: {exc}")]
    return load_text(text, source)


def load_text(text: str, source: str = "<string>") -> tuple[list[ParsedObject], list[ConfigError]]:
    """Parse YAML text (one or more documents) as :func:`load_file` does."""
    try:
        docs = list(yaml.load_all(text, Loader=_Loader))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        return [], [ConfigError(source, "", "", "", f"invalid YAML: {where}{problem}")]
    objects: list[ParsedObject] = []
    errors: list[ConfigError] = []
    for index, doc in enumerate(docs):
        if doc is None:
            continue
        for item, item_errors in _expand(doc, f"document {index + 1}", source):
            errors.extend(item_errors)
            if item is not None:
                obj, obj_errors = parse_object(item, source)
                objects.extend([obj] if obj is not None else [])
                errors.extend(obj_errors)
    return objects, errors


def _expand(
    doc: Any, where: str, source: str
) -> Iterator[tuple[dict[str, Any] | None, list[ConfigError]]]:
    """Yield ``(object dict or None, errors)`` for a document, unwrapping list kinds."""
    if not isinstance(doc, dict):
        yield None, [ConfigError(source, "", "", "", f"{where} is not a map but {_type_name(doc)}")]
        return
    kind = doc.get("kind")
    if not isinstance(kind, str) or kind not in LIST_KINDS:
        yield doc, []
        return
    items = doc.get("items")
    if items is None:
        return
    if not isinstance(items, list):
        yield None, [ConfigError(source, str(kind), "", "items", "must be a list")]
        return
    item_kind = LIST_KINDS[kind]
    list_version = doc.get("apiVersion")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            msg = f"Invalid value: must be a map, not {_type_name(item)}"
            yield None, [ConfigError(source, str(kind), "", f"items[{i}]", msg)]
            continue
        if item_kind is not None:
            # Typed lists from the API omit each item's kind and apiVersion.
            item = {"kind": item_kind, "apiVersion": list_version, **item}
        yield item, []


def _type_name(value: Any) -> str:
    return {
        list: "a list",
        str: "a string",
        int: "a number",
        float: "a number",
        bool: "a boolean",
    }.get(type(value), type(value).__name__)


def parse_object(
    doc: dict[str, Any], source: str = ""
) -> tuple[ParsedObject | None, list[ConfigError]]:
    """Check, default and validate one object manifest (a dict)."""
    kind = doc.get("kind")
    meta = doc.get("metadata")
    name = meta.get("name") if isinstance(meta, dict) else None
    errs = ErrorList(
        source, kind if isinstance(kind, str) else "", name if isinstance(name, str) else ""
    )
    if kind not in OBJECT_KINDS:
        errs.not_supported("kind", kind, OBJECT_KINDS + tuple(LIST_KINDS))
        return None, errs.errors
    api_version = doc.get("apiVersion")
    if not api_version:
        errs.required("apiVersion", f"must be {API_V1}")
    elif api_version not in SUPPORTED_API_VERSIONS:
        errs.not_supported("apiVersion", api_version, SUPPORTED_API_VERSIONS)
    for key in doc:
        if key not in _TOP_LEVEL_FIELDS:
            errs.add(str(key), unknown_field(str(key), _TOP_LEVEL_FIELDS))
    if meta is not None and not isinstance(meta, dict):
        errs.wrong_type("metadata", meta, "must be a map")
    if not isinstance(meta, dict):
        meta = {}
    if name is not None and not isinstance(name, str):
        errs.wrong_type("metadata.name", name, "must be a string")
        name = None
    uid = meta.get("uid") or ""
    if not isinstance(uid, str):
        errs.wrong_type("metadata.uid", uid, "must be a string")
        uid = ""
    elif not _UID_RE.fullmatch(uid):
        # it is sent as the value of an X-Kubernetes-PF-*-UID response header
        errs.invalid("metadata.uid", uid, "must be visible ASCII characters (no spaces or "
                     "control characters), at most 128")
        uid = ""
    if meta.get("namespace"):
        errs.forbidden("metadata.namespace", "not allowed on this type")
    annotations = meta.get("annotations") or {}
    if not isinstance(annotations, dict):
        errs.wrong_type("metadata.annotations", annotations, "must be a map")
        annotations = {}
    name = name or ""
    v1beta3 = api_version == API_V1BETA3
    if kind == KIND_FLOW_SCHEMA:
        spec = decode_flow_schema_spec(doc.get("spec"), errs)
    else:
        spec = decode_priority_level_spec(doc.get("spec"), errs, v1beta3=v1beta3)
    status = decode_status(doc.get("status"), errs)
    # Validate even after decoding errors, so that an unknown field or a wrong type does not
    # hide the object's other problems; what only echoes a wrong type is dropped.
    decoded = len(errs.errors)
    if kind == KIND_FLOW_SCHEMA:
        set_defaults_flow_schema(spec)
        validate_flow_schema(name, spec, status, errs)
        validate_annotations(annotations, kind, spec, errs)
        errs.drop_echoes(decoded)
        if errs:
            return None, errs.errors
        return ParsedObject(kind, name, source, flow_schema_from_spec(name, spec, uid, source)), []
    set_defaults_priority_level(
        spec, v1beta3=v1beta3, preserve_zero=V1BETA3_PRESERVE_ZERO in annotations
    )
    validate_priority_level(name, spec, status, errs)
    ours = validate_annotations(annotations, kind, spec, errs)
    errs.drop_echoes(decoded)
    if errs:
        return None, errs.errors
    pl = priority_level_from_spec(name, spec, uid, source, ours.fairness, ours.max_seats)
    return ParsedObject(kind, name, source, pl, broken_reason(name, spec)), []


# --------------------------------------------------------------------------------------------
# Defaulting (v1 SetDefaults_*), on normalized specs


def set_defaults_flow_schema(spec: dict[str, Any]) -> None:
    if spec["matchingPrecedence"] == 0:
        spec["matchingPrecedence"] = 1000


def set_defaults_priority_level(
    spec: dict[str, Any], v1beta3: bool = False, preserve_zero: bool = False
) -> None:
    limited = spec["limited"]
    if limited is not None:
        ncs = limited["nominalConcurrencyShares"]
        if ncs is None or (v1beta3 and ncs == 0 and not preserve_zero):
            limited["nominalConcurrencyShares"] = 30
        if limited["lendablePercent"] is None:
            limited["lendablePercent"] = 0
        queuing = limited["limitResponse"]["queuing"]
        if queuing is not None:
            for key, default in (("handSize", 8), ("queues", 64), ("queueLengthLimit", 50)):
                if queuing[key] == 0:
                    queuing[key] = default
    exempt = spec["exempt"]
    if exempt is not None:
        for key in ("nominalConcurrencyShares", "lendablePercent"):
            if exempt[key] is None:
                exempt[key] = 0


# --------------------------------------------------------------------------------------------
# Whole-configuration checks and digest


def duplicate_errors(objects: list[ParsedObject]) -> list[ConfigError]:
    seen: dict[tuple[str, str], str] = {}
    errors = []
    for o in objects:
        key = (o.kind, o.name)
        if key in seen:
            errors.append(
                ConfigError(
                    o.source,
                    o.kind,
                    o.name,
                    "metadata.name",
                    f'Duplicate value: "{o.name}" (already defined in {seen[key]})',
                )
            )
        else:
            seen[key] = o.source
    return errors


def digest_objects(objects: list[ParsedObject], sources: Iterable[str] = ()) -> Configuration:
    flow_schemas = [o.obj for o in objects if o.kind == KIND_FLOW_SCHEMA]
    levels = [o.obj for o in objects if o.kind == KIND_PRIORITY_LEVEL and o.broken is None]
    broken = [(o.obj, o.broken) for o in objects if o.kind == KIND_PRIORITY_LEVEL and o.broken]
    return digest(flow_schemas, levels, broken=broken, sources=sources)
