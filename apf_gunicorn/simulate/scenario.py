"""Simulation scenarios: parse and validate the SPEC section 9 format into typed objects.

Two forms share the client and ``evaluate`` parts:

* ``queueSet:`` one fair-queuing set as Kubernetes' queueset tests build it; clients carry a
  flow ``hash``;
* ``config:`` (a path, relative to the scenario file) or inline ``objects:`` plus
  ``serverConcurrencyLimit``; clients carry request attributes (``user``, ``groups``,
  ``verb``, ``path`` or ``resource`` …) and are classified.

Durations are Go strings (``"1s"``, ``"-1ns"``, ``"2184h"``) or numbers of seconds; every
error names the offending field::

    >>> scenario = load_scenario("tests/scenarios/kubernetes/k8s-03-baseline.yaml")
    >>> scenario.queue_set.concurrency_limit, scenario.evaluate
    (1, (20000000000,))

Extensions beyond Kubernetes' harness: ``start`` delays all of a client's threads;
``count: N`` makes a client stand for N clients named ``name-0`` … ``name-(N-1)``, each its
own flow (hash ``flow_hash(name, str(k))``, or in the configuration form user ``user-k``),
copy ``k`` starting ``k * stagger`` later. That is how a 10,000-flow run stays a short file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from apf_gunicorn.flowcontrol.gomath import parse_duration
from apf_gunicorn.flowcontrol.objects import RequestAttributes
from apf_gunicorn.flowcontrol.shufflesharding import DealerError, check_dealer, flow_hash

_U64_MAX = (1 << 64) - 1


class ScenarioError(ValueError):
    """An invalid scenario; ``field`` is the path of the offending field (``clients[1].exec``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class QueueSetSpec:
    """One queue set: ``queues`` > 0 queues, 0 no queuing (reject at the limit), -1 exempt."""

    concurrency_limit: int
    queues: int
    hand_size: int
    queue_length_limit: int


@dataclass(frozen=True, slots=True)
class ConfigSpec:
    """The configuration form: a path to load, or raw objects, and the server limit."""

    server_concurrency_limit: int
    path: str | None = None
    objects: tuple[dict, ...] = ()


@dataclass(frozen=True, slots=True)
class ClientSpec:
    """One uniform client: ``threads`` threads each making ``calls`` calls."""

    name: str
    threads: int
    calls: int
    exec_ns: int
    think_ns: int
    seats: int = 1
    final_seats: int = 0
    additional_latency_ns: int = 0
    split: bool = False
    hash: int | None = None  # queueSet form
    attributes: RequestAttributes | None = None  # configuration form
    start_ns: int = 0  # extension: the client's threads start this much later

    @property
    def max_seats(self) -> int:
        return max(self.seats, self.final_seats)


@dataclass(frozen=True, slots=True)
class Scenario:
    clients: tuple[ClientSpec, ...]
    evaluate: tuple[int, ...]  # window ends, ns, strictly increasing
    queue_set: QueueSetSpec | None = None
    config: ConfigSpec | None = None
    source: str = ""
    extra: dict = field(default_factory=dict, compare=False)


_QUEUESET_KEYS = {"concurrencyLimit", "queues", "handSize", "queueLengthLimit"}
_CLIENT_KEYS = {
    "name", "hash", "threads", "calls", "exec", "think", "seats", "finalSeats",
    "additionalLatency", "split", "count", "start", "stagger",
}
_ATTRIBUTE_KEYS = {
    "user", "groups", "verb", "path", "apiGroup", "apiVersion", "resource", "subresource",
    "namespace", "resourceName",
}
_TOP_KEYS = {
    "queueSet", "config", "objects", "serverConcurrencyLimit", "clients", "evaluate",
    "description",
}


def load_scenario(path: str) -> Scenario:
    """Read a YAML or JSON scenario file; raises :class:`ScenarioError` (or ``OSError``)."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        data = json.loads(text) if path.endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ScenarioError("", f"{path}: not valid YAML/JSON: {exc}") from None
    return parse_scenario(data, base_dir=os.path.dirname(os.path.abspath(path)), source=path)


def parse_scenario(data: Any, base_dir: str = ".", source: str = "") -> Scenario:
    """Validate a decoded scenario document and return the typed :class:`Scenario`."""
    if not isinstance(data, dict):
        raise ScenarioError("", "a scenario must be a mapping")
    _no_unknown(data, _TOP_KEYS, "")
    has_qs = "queueSet" in data
    has_cfg = "config" in data or "objects" in data
    if has_qs == has_cfg:
        raise ScenarioError("", "give exactly one of queueSet, or config/objects")
    queue_set = _parse_queue_set(data["queueSet"]) if has_qs else None
    config = None if has_qs else _parse_config(data, base_dir)
    clients = _parse_clients(data.get("clients"), config_form=not has_qs)
    evaluate = _parse_evaluate(data.get("evaluate"))
    return Scenario(clients, evaluate, queue_set, config, source)


def _parse_queue_set(raw: Any) -> QueueSetSpec:
    if not isinstance(raw, dict):
        raise ScenarioError("queueSet", "must be a mapping")
    _no_unknown(raw, _QUEUESET_KEYS, "queueSet")
    limit = _int(raw, "concurrencyLimit", "queueSet", required=True, minimum=0)
    queues = _int(raw, "queues", "queueSet", required=True, minimum=-1)
    if queues > 0:
        hand = _int(raw, "handSize", "queueSet", required=True, minimum=1)
        qll = _int(raw, "queueLengthLimit", "queueSet", required=True, minimum=1)
        try:
            check_dealer(queues, hand)
        except DealerError as exc:
            raise ScenarioError("queueSet.handSize", str(exc)) from None
    else:  # Kubernetes ignores the queuing parameters of exempt and reject-type sets
        hand = _int(raw, "handSize", "queueSet", default=0, minimum=0)
        qll = _int(raw, "queueLengthLimit", "queueSet", default=0, minimum=0)
    return QueueSetSpec(limit, queues, hand, qll)


def _parse_config(data: dict, base_dir: str) -> ConfigSpec:
    if "config" in data and "objects" in data:
        raise ScenarioError("config", "give config (a path) or objects, not both")
    limit = _int(data, "serverConcurrencyLimit", "", required=True, minimum=1)
    if "config" in data:
        path = data["config"]
        if not isinstance(path, str) or not path:
            raise ScenarioError("config", "must be a path to a YAML file or directory")
        return ConfigSpec(limit, path=os.path.join(base_dir, path))
    objects = data["objects"]
    if not isinstance(objects, list) or not all(isinstance(o, dict) for o in objects):
        raise ScenarioError("objects", "must be a list of FlowSchema/PriorityLevelConfiguration objects")
    return ConfigSpec(limit, objects=tuple(objects))


def _parse_clients(raw: Any, config_form: bool) -> tuple[ClientSpec, ...]:
    if not isinstance(raw, list) or not raw:
        raise ScenarioError("clients", "must be a non-empty list")
    clients: list[ClientSpec] = []
    names: set[str] = set()
    for i, item in enumerate(raw):
        where = f"clients[{i}]"
        if not isinstance(item, dict):
            raise ScenarioError(where, "must be a mapping")
        _no_unknown(item, _CLIENT_KEYS | (_ATTRIBUTE_KEYS if config_form else set()), where)
        name = item.get("name", f"client{i}")
        if not isinstance(name, str) or not name:
            raise ScenarioError(f"{where}.name", "must be a non-empty string")
        count = _int(item, "count", where, default=0, minimum=1) if "count" in item else 0
        start = _duration(item, "start", where, default=0, minimum=0)
        stagger = _duration(item, "stagger", where, default=0, minimum=0)
        if stagger and not count:
            raise ScenarioError(f"{where}.stagger", "only meaningful with count")
        common = dict(
            threads=_int(item, "threads", where, default=1, minimum=1),
            calls=_int(item, "calls", where, required=True, minimum=0),
            exec_ns=_duration(item, "exec", where, required=True, minimum=0),
            think_ns=_duration(item, "think", where, default=0),
            seats=_int(item, "seats", where, default=1, minimum=1),
            final_seats=_int(item, "finalSeats", where, default=0, minimum=0),
            additional_latency_ns=_duration(item, "additionalLatency", where, default=0, minimum=0),
            split=_bool(item, "split", where),
        )
        if config_form:
            if "hash" in item:
                raise ScenarioError(f"{where}.hash", "not allowed with config: clients are classified")
            attrs = _attributes(item, where)
            expanded = [(name, attrs)] if not count else [
                (f"{name}-{k}", _with_user(attrs, f"{attrs.user}-{k}")) for k in range(count)]
            new = [ClientSpec(n, attributes=a, start_ns=start + k * stagger, **common)
                   for k, (n, a) in enumerate(expanded)]
        else:
            if count:
                if "hash" in item:
                    raise ScenarioError(f"{where}.hash", "not allowed with count (each copy is its own flow)")
                new = [ClientSpec(f"{name}-{k}", hash=flow_hash(name, str(k)),
                                  start_ns=start + k * stagger, **common)
                       for k in range(count)]
            else:
                new = [ClientSpec(name, hash=_int(item, "hash", where, required=True, minimum=0,
                                                  maximum=_U64_MAX), start_ns=start, **common)]
        for client in new:
            if client.name in names:
                raise ScenarioError(f"{where}.name", f"duplicate client name {client.name!r}")
            names.add(client.name)
        clients.extend(new)
    return tuple(clients)


def _attributes(item: dict, where: str) -> RequestAttributes:
    def text(key: str, default: str = "") -> str:
        value = item.get(key, default)
        if not isinstance(value, str):
            raise ScenarioError(f"{where}.{key}", "must be a string")
        return value

    user = text("user", "system:anonymous")
    groups = item.get("groups", [])
    if isinstance(groups, str):
        groups = [groups]
    if not isinstance(groups, list) or not all(isinstance(g, str) for g in groups):
        raise ScenarioError(f"{where}.groups", "must be a list of strings")
    if user == "system:anonymous" and "user" not in item:
        groups = groups or ["system:unauthenticated"]
    elif "system:authenticated" not in groups:
        groups = [*groups, "system:authenticated"]
    verb = text("verb", "get")
    is_resource = "resource" in item
    if is_resource == ("path" in item):
        raise ScenarioError(where, "give either path (non-resource) or resource")
    return RequestAttributes(
        user=user, groups=tuple(groups), verb=verb, path=text("path"), is_resource=is_resource,
        api_group=text("apiGroup"), api_version=text("apiVersion", "v1" if is_resource else ""),
        resource=text("resource"), subresource=text("subresource"),
        namespace=text("namespace"), name=text("resourceName"),
    )


def _with_user(attrs: RequestAttributes, user: str) -> RequestAttributes:
    return RequestAttributes(
        user=user, groups=attrs.groups, verb=attrs.verb, path=attrs.path,
        is_resource=attrs.is_resource, api_group=attrs.api_group,
        api_version=attrs.api_version, resource=attrs.resource, subresource=attrs.subresource,
        namespace=attrs.namespace, name=attrs.name,
    )


def _parse_evaluate(raw: Any) -> tuple[int, ...]:
    if raw is None:
        raise ScenarioError("evaluate", "required: a list of window end times")
    if not isinstance(raw, list):
        raw = [raw]
    if not raw:
        raise ScenarioError("evaluate", "must list at least one time")
    ends: list[int] = []
    for i, value in enumerate(raw):
        try:
            ns = parse_duration(value)
        except ValueError as exc:
            raise ScenarioError(f"evaluate[{i}]", str(exc)) from None
        if ns <= (ends[-1] if ends else 0):
            raise ScenarioError(f"evaluate[{i}]", "times must be positive and increasing")
        ends.append(ns)
    return tuple(ends)


def _no_unknown(raw: dict, allowed: set[str], where: str) -> None:
    for key in raw:
        if key not in allowed:
            path = f"{where}.{key}" if where else str(key)
            raise ScenarioError(path, f"unknown field (allowed: {', '.join(sorted(allowed))})")


def _int(raw: dict, key: str, where: str, *, required: bool = False, default: int = 0,
         minimum: int | None = None, maximum: int | None = None) -> int:
    path = f"{where}.{key}" if where else key
    if key not in raw:
        if required:
            raise ScenarioError(path, "required")
        return default
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScenarioError(path, f"must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ScenarioError(path, f"must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ScenarioError(path, f"must be at most {maximum}, got {value}")
    return value


def _duration(raw: dict, key: str, where: str, *, required: bool = False, default: int = 0,
              minimum: int | None = None) -> int:
    path = f"{where}.{key}"
    if key not in raw:
        if required:
            raise ScenarioError(path, "required")
        return default
    try:
        ns = parse_duration(raw[key])
    except ValueError as exc:
        raise ScenarioError(path, str(exc)) from None
    if minimum is not None and ns < minimum:
        raise ScenarioError(path, "must not be negative")
    return ns


def _bool(raw: dict, key: str, where: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise ScenarioError(f"{where}.{key}", f"must be true or false, got {value!r}")
    return value
