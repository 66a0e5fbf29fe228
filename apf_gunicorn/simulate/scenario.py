"""Simulation scenarios: parse and validate the SPEC section 9 format into typed objects.

Two forms share the client and ``evaluate`` parts:

* ``queueSet:`` one fair-queuing set as Kubernetes' queueset tests build it; clients carry a
  flow ``hash``;
* ``config:`` (a path, relative to the scenario file) or inline ``objects:`` plus
  ``serverConcurrencyLimit``; clients carry request attributes (``user``, ``groups``,
  ``verb``, ``path`` or ``resource`` …) and are classified.

Durations are Go strings (``"1s"``, ``"-1ns"``, ``"2184h"``) or numbers of seconds; every
error names the offending field, and every error of a file is reported at once
(:class:`ScenarioErrors`, a :class:`ScenarioError`)::

    >>> scenario = load_scenario("tests/scenarios/kubernetes/k8s-03-baseline.yaml")
    >>> scenario.queue_set.concurrency_limit, scenario.evaluate
    (1, (20000000000,))

Both forms may name the fairness: ``queueSet.fairness``, or the configuration form's
top-level ``fairness`` (for levels without an ``apf-gunicorn.io/fairness`` annotation); left
out it is ``kubernetes``, so Kubernetes' own scenarios run Kubernetes' fairness.

Extensions beyond Kubernetes' harness: ``start`` delays all of a client's threads;
``count: N`` makes a client stand for N clients named ``name-0`` … ``name-(N-1)``, each its
own flow (hash ``flow_hash(name, str(k))``, or in the configuration form user ``user-k``),
copy ``k`` starting ``k * stagger`` later. That is how a 10,000-flow run stays a short file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

import yaml

from apf_gunicorn.control.adaptive import parse_auto
from apf_gunicorn.flowcontrol import fairness
from apf_gunicorn.flowcontrol.gomath import parse_duration
from apf_gunicorn.flowcontrol.objects import RequestAttributes
from apf_gunicorn.flowcontrol.shufflesharding import DealerError, check_dealer, flow_hash
from apf_gunicorn.flowcontrol.suggest import unknown_field

_U64_MAX = (1 << 64) - 1


class ScenarioError(ValueError):
    """An invalid scenario; ``field`` is the path of the offending field (``clients[1].exec``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


class ScenarioErrors(ScenarioError):
    """Every error of a scenario, in file order; ``field`` and ``message`` are the first's,
    ``str()`` lists them all, one per line (just the one when there is one)."""

    def __init__(self, errors: list[ScenarioError]) -> None:
        self.errors = list(errors)
        first = self.errors[0]
        ValueError.__init__(self, "\n".join(str(e) for e in self.errors))
        self.field = first.field
        self.message = first.message


class _Errors:
    """Collects the errors of independent parts, so one run reports all of them."""

    def __init__(self) -> None:
        self.errors: list[ScenarioError] = []

    def get(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, or None after recording its ScenarioError(s)."""
        try:
            return fn(*args, **kwargs)
        except ScenarioErrors as exc:
            self.errors.extend(exc.errors)
        except ScenarioError as exc:
            self.errors.append(exc)
        return None

    def check(self) -> None:
        if self.errors:
            raise ScenarioErrors(self.errors)


@dataclass(frozen=True, slots=True)
class AutoSpec:
    """``concurrencyLimit: auto[:MIN-MAX]``: the adaptive controller sets the server limit,
    starting at ``start``, once every ``tick_ns`` of virtual time."""

    minimum: int
    maximum: int
    start: int
    tick_ns: int = 1_000_000_000


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """What executing requests share inside the app (``backend:``).

    ``kind`` ``pool``: ``capacity`` connections; a request holds one for its ``exec`` and waits
    for one (FIFO) when all are taken. ``cores``: ``capacity`` cores shared by the running
    requests (processor sharing, each progressing at ``min(1, cores / running)`` of its
    ``exec``); with ``workers`` > 0 each request runs in one of that many processes (chosen at
    random, seeded), each running Python one request at a time (the GIL), the processes
    sharing the cores. ``changes`` are ``(at ns, capacity)``; ``jitter`` multiplies each
    request's ``exec`` by a uniform factor in ``[1 - jitter, 1 + jitter]`` (seeded).
    ``busy_slowdown`` > 0 models a busy host (another process taking CPU from the app): every
    ``busy_period_ns`` the time requests spend in the app outside the backend (their
    ``overhead``) is stretched by a new factor drawn uniformly from ``[1, 1 + busy_slowdown]``
    (seeded), whatever the concurrency: latency that is not caused by our seats.
    """

    kind: str
    capacity: int
    workers: int = 0
    changes: tuple[tuple[int, int], ...] = ()
    jitter: float = 0.0
    seed: int = 1
    busy_slowdown: float = 0.0
    busy_period_ns: int = 500_000_000


@dataclass(frozen=True, slots=True)
class QueueSetSpec:
    """One queue set: ``queues`` > 0 queues, 0 no queuing (reject at the limit), -1 exempt."""

    concurrency_limit: int
    queues: int
    hand_size: int
    queue_length_limit: int
    fairness: str = fairness.SCENARIO_DEFAULT  # Kubernetes' scenarios leave it out
    auto: AutoSpec | None = None  # concurrencyLimit: auto (concurrency_limit is then the start)


@dataclass(frozen=True, slots=True)
class ConfigSpec:
    """The configuration form: a path to load, or raw objects, and the server limit."""

    server_concurrency_limit: int
    path: str | None = None
    objects: tuple[dict, ...] = ()
    # the fairness of levels without an apf-gunicorn.io/fairness annotation (the server's
    # APF_FAIRNESS)
    fairness: str = fairness.SCENARIO_DEFAULT
    auto: AutoSpec | None = None  # serverConcurrencyLimit: auto (the limit is then the start)


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
    overhead_ns: int = 0  # with a backend: time in the app outside it, after it
    kind: str = ""  # the kind of request the adaptive controller learns a baseline for

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
    backend: BackendSpec | None = None

    @property
    def auto(self) -> AutoSpec | None:
        """The adaptive limit's settings, if the scenario's limit is ``auto``."""
        spec = self.queue_set if self.queue_set is not None else self.config
        return spec.auto if spec is not None else None


_QUEUESET_KEYS = {"concurrencyLimit", "queues", "handSize", "queueLengthLimit", "fairness"}
_CLIENT_KEYS = {
    "name", "hash", "threads", "calls", "exec", "think", "seats", "finalSeats",
    "additionalLatency", "split", "count", "start", "stagger", "overhead", "kind",
}
_BACKEND_KINDS = ("pool", "cores")
_BACKEND_KEYS = {*_BACKEND_KINDS, "workers", "changes", "jitter", "seed", "busy"}
_BUSY_KEYS = {"slowdown", "period"}
_CONTROLLER_KEYS = {"start", "tick"}
_ATTRIBUTE_KEYS = {
    "user", "groups", "verb", "path", "apiGroup", "apiVersion", "resource", "subresource",
    "namespace", "resourceName",
}
_TOP_KEYS = {
    "queueSet", "config", "objects", "serverConcurrencyLimit", "clients", "evaluate",
    "description", "fairness", "backend", "controller",
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
    errs = _Errors()
    errs.get(_no_unknown, data, _TOP_KEYS, "")
    has_qs = "queueSet" in data
    has_cfg = "config" in data or "objects" in data
    if has_qs == has_cfg:
        errs.errors.append(ScenarioError("", "give exactly one of queueSet, or config/objects"))
    queue_set = errs.get(_parse_queue_set, data["queueSet"]) if has_qs else None
    config = None if has_qs or not has_cfg else errs.get(_parse_config, data, base_dir)
    if has_qs and "fairness" in data:
        errs.errors.append(ScenarioError("fairness", "in the queueSet form the fairness goes "
                                                     "under queueSet (queueSet.fairness)"))
    clients = errs.get(_parse_clients, data.get("clients"), config_form=not has_qs)
    evaluate = errs.get(_parse_evaluate, data.get("evaluate"))
    backend = errs.get(_parse_backend, data["backend"]) if "backend" in data else None
    if "backend" not in data and isinstance(data.get("clients"), list):
        errs.errors.extend(ScenarioError(f"clients[{i}].overhead", "only meaningful with a "
                                                                   "backend")
                           for i, c in enumerate(data["clients"])
                           if isinstance(c, dict) and "overhead" in c)
    spec = queue_set if has_qs else config
    auto = errs.get(_parse_controller, data.get("controller"), spec)
    if auto is not None and spec is not None:
        spec = replace(spec, auto=auto, **{"concurrency_limit" if has_qs else
                                           "server_concurrency_limit": auto.start})
        queue_set, config = (spec, None) if has_qs else (None, spec)
    errs.check()
    return Scenario(clients, evaluate, queue_set, config, source, backend=backend)


def _limit(raw: dict, key: str, where: str, minimum: int) -> tuple[int, tuple[int, int] | None]:
    """A concurrency limit: an integer, or ``auto`` / ``auto:MIN-MAX`` (then ``(0, bounds)``)."""
    path = f"{where}.{key}" if where else key
    value = raw.get(key)
    if isinstance(value, str):
        try:
            bounds = parse_auto(value)
        except ValueError as exc:
            raise ScenarioError(path, str(exc)) from None
        if bounds is None:
            raise ScenarioError(path, f"must be an integer, auto or auto:MIN-MAX, got {value!r}")
        return 0, bounds
    return _int(raw, key, where, required=True, minimum=minimum), None


def _parse_controller(raw: Any, spec: Any) -> AutoSpec | None:
    """``controller:`` (``start``, ``tick``) for an ``auto`` limit; the bounds come from the
    limit's ``auto:MIN-MAX``."""
    partial = spec.auto if spec is not None else None
    if partial is None:
        if raw is not None:
            raise ScenarioError("controller", "only meaningful with an auto concurrency limit")
        return None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ScenarioError("controller", "must be a mapping")
    errs = _Errors()
    errs.get(_no_unknown, raw, _CONTROLLER_KEYS, "controller")
    low, high = partial.minimum, partial.maximum
    default = min(high, max(low, round((low * high) ** 0.5)))
    start = errs.get(_int, raw, "start", "controller", default=default, minimum=low,
                     maximum=high)
    tick = errs.get(_duration, raw, "tick", "controller", default=1_000_000_000, minimum=1)
    if "tick" in raw and tick == 0:
        errs.errors.append(ScenarioError("controller.tick", "must be positive"))
    errs.check()
    return AutoSpec(low, high, start, tick)


def _parse_backend(raw: Any) -> BackendSpec:
    if not isinstance(raw, dict):
        raise ScenarioError("backend", "must be a mapping")
    errs = _Errors()
    errs.get(_no_unknown, raw, _BACKEND_KEYS, "backend")
    kinds = [k for k in _BACKEND_KINDS if k in raw]
    if len(kinds) != 1:
        errs.errors.append(ScenarioError("backend", "give exactly one of pool (connections) "
                                                    "or cores"))
        errs.check()
    kind = kinds[0]
    capacity = errs.get(_int, raw, kind, "backend", required=True, minimum=1)
    workers = errs.get(_int, raw, "workers", "backend", default=0, minimum=1)
    if "workers" in raw and kind != "cores":
        errs.errors.append(ScenarioError("backend.workers", "only meaningful with cores"))
    seed = errs.get(_int, raw, "seed", "backend", default=1, minimum=0, maximum=_U64_MAX)
    jitter = raw.get("jitter", 0.0)
    if isinstance(jitter, bool) or not isinstance(jitter, (int, float)) or not 0 <= jitter < 1:
        errs.errors.append(ScenarioError("backend.jitter",
                                         f"must be a number from 0 up to (not including) 1, "
                                         f"got {jitter!r}"))
    changes = errs.get(_parse_changes, raw.get("changes", []), kind)
    slowdown, period = 0.0, 500_000_000
    busy = raw.get("busy")
    if busy is not None:
        if not isinstance(busy, dict):
            errs.errors.append(ScenarioError("backend.busy", "must be a mapping: slowdown, "
                                                             "period"))
        else:
            errs.get(_no_unknown, busy, _BUSY_KEYS, "backend.busy")
            slowdown = busy.get("slowdown", 0.0)
            if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) \
                    or slowdown < 0:
                errs.errors.append(ScenarioError("backend.busy.slowdown",
                                                 f"must be a number >= 0, got {slowdown!r}"))
                slowdown = 0.0
            period = errs.get(_duration, busy, "period", "backend.busy", default=period,
                              minimum=0)
            if period == 0:
                errs.errors.append(ScenarioError("backend.busy.period", "must be positive"))
                period = 500_000_000
    errs.check()
    return BackendSpec(kind, capacity, workers, changes, float(jitter), seed, float(slowdown),
                       period)


def _parse_changes(raw: Any, kind: str) -> tuple[tuple[int, int], ...]:
    if not isinstance(raw, list):
        raise ScenarioError("backend.changes", f"must be a list of {{at: TIME, {kind}: N}}")
    out: list[tuple[int, int]] = []
    errs = _Errors()
    for i, item in enumerate(raw):
        where = f"backend.changes[{i}]"
        if not isinstance(item, dict):
            errs.errors.append(ScenarioError(where, f"must be a mapping {{at: TIME, {kind}: N}}"))
            continue
        errs.get(_no_unknown, item, {"at", kind}, where)
        if set(item) - {"at", kind}:
            continue
        at = errs.get(_duration, item, "at", where, required=True, minimum=0)
        value = errs.get(_int, item, kind, where, required=True, minimum=1)
        if at is None or value is None:
            continue
        if out and at <= out[-1][0]:
            errs.errors.append(ScenarioError(f"{where}.at", "times must be increasing"))
            continue
        out.append((at, value))
    errs.check()
    return tuple(out)


def _parse_queue_set(raw: Any) -> QueueSetSpec:
    if not isinstance(raw, dict):
        raise ScenarioError("queueSet", "must be a mapping")
    errs = _Errors()
    errs.get(_no_unknown, raw, _QUEUESET_KEYS, "queueSet")
    limit, bounds = errs.get(_limit, raw, "concurrencyLimit", "queueSet", 0) or (None, None)
    queues = errs.get(_int, raw, "queues", "queueSet", required=True, minimum=-1)
    if queues is None or queues > 0:
        hand = errs.get(_int, raw, "handSize", "queueSet", required=True, minimum=1)
        qll = errs.get(_int, raw, "queueLengthLimit", "queueSet", required=True, minimum=1)
        if queues is not None and hand is not None:
            try:
                check_dealer(queues, hand)
            except DealerError as exc:
                errs.errors.append(ScenarioError("queueSet.handSize", str(exc)))
    else:  # Kubernetes ignores the queuing parameters of exempt and reject-type sets
        hand = errs.get(_int, raw, "handSize", "queueSet", default=0, minimum=0)
        qll = errs.get(_int, raw, "queueLengthLimit", "queueSet", default=0, minimum=0)
    fairness_name = errs.get(_fairness_field, raw, "queueSet")
    if bounds is not None and queues is not None and queues < 0:
        errs.errors.append(ScenarioError("queueSet.concurrencyLimit",
                                         "an exempt set (queues -1) has no limit to adapt"))
    errs.check()
    return _with_bounds(QueueSetSpec(limit, queues, hand, qll, fairness_name), bounds)


def _with_bounds(spec: Any, bounds: tuple[int, int] | None) -> Any:
    """``spec`` with an ``auto`` limit of ``bounds`` (its start and tick are filled in once
    ``controller:`` has been read, by :func:`_parse_controller`)."""
    return spec if bounds is None else replace(spec, auto=AutoSpec(*bounds, start=0))


def _parse_config(data: dict, base_dir: str) -> ConfigSpec:
    if "config" in data and "objects" in data:
        raise ScenarioError("config", "give config (a path) or objects, not both")
    limit, bounds = _limit(data, "serverConcurrencyLimit", "", 1)
    fairness_name = _fairness_field(data, "")
    if "config" in data:
        path = data["config"]
        if not isinstance(path, str) or not path:
            raise ScenarioError("config", "must be a path to a YAML file or directory")
        return _with_bounds(ConfigSpec(limit, path=os.path.join(base_dir, path),
                                       fairness=fairness_name), bounds)
    objects = data["objects"]
    if not isinstance(objects, list) or not all(isinstance(o, dict) for o in objects):
        raise ScenarioError("objects", "must be a list of FlowSchema/PriorityLevelConfiguration objects")
    return _with_bounds(ConfigSpec(limit, objects=tuple(objects), fairness=fairness_name),
                        bounds)


def _fairness_field(raw: dict, where: str) -> str:
    """The ``fairness`` field: one of :data:`~apf_gunicorn.flowcontrol.fairness.NAMES`,
    ``kubernetes`` when absent."""
    path = f"{where}.fairness" if where else "fairness"
    value = raw.get("fairness", fairness.SCENARIO_DEFAULT)
    if value not in fairness.NAMES:
        raise ScenarioError(path, f"must be one of {', '.join(fairness.NAMES)}, got {value!r}")
    return value


def with_fairness(scenario: Scenario, fairness_name: str) -> Scenario:
    """``scenario`` with its ``fairness`` replaced (``simulate --fairness``): the queue set's
    fairness, or in the configuration form the fairness of levels without an
    ``apf-gunicorn.io/fairness`` annotation (annotations still win, as in the server).

    Raises:
        ScenarioError: ``fairness_name`` is not one of
            :data:`~apf_gunicorn.flowcontrol.fairness.NAMES`.
    """
    if fairness_name not in fairness.NAMES:
        raise ScenarioError("fairness", f"must be one of {', '.join(fairness.NAMES)}, "
                                        f"got {fairness_name!r}")
    if scenario.queue_set is not None:
        return replace(scenario, queue_set=replace(scenario.queue_set, fairness=fairness_name))
    assert scenario.config is not None
    return replace(scenario, config=replace(scenario.config, fairness=fairness_name))


def _parse_clients(raw: Any, config_form: bool) -> tuple[ClientSpec, ...]:
    if not isinstance(raw, list) or not raw:
        raise ScenarioError("clients", "must be a non-empty list")
    clients: list[ClientSpec] = []
    names: set[str] = set()
    errs = _Errors()
    for i, item in enumerate(raw):
        errs.get(_parse_client, i, item, config_form, names, clients)
    errs.check()
    return tuple(clients)


def _parse_client(i: int, item: Any, config_form: bool, names: set[str],
                  clients: list[ClientSpec]) -> None:
    """Append client ``i`` (or its ``count`` copies) to ``clients``; every error of its
    fields is raised together."""
    where = f"clients[{i}]"
    if not isinstance(item, dict):
        raise ScenarioError(where, "must be a mapping")
    errs = _Errors()
    errs.get(_no_unknown, item, _CLIENT_KEYS | (_ATTRIBUTE_KEYS if config_form else set()), where)
    name = item.get("name", f"client{i}")
    if not isinstance(name, str) or not name:
        errs.errors.append(ScenarioError(f"{where}.name", "must be a non-empty string"))
    count = errs.get(_int, item, "count", where, default=0, minimum=1) if "count" in item else 0
    start = errs.get(_duration, item, "start", where, default=0, minimum=0)
    stagger = errs.get(_duration, item, "stagger", where, default=0, minimum=0)
    if stagger and "count" not in item:
        errs.errors.append(ScenarioError(f"{where}.stagger", "only meaningful with count"))
    common = dict(
        threads=errs.get(_int, item, "threads", where, default=1, minimum=1),
        calls=errs.get(_int, item, "calls", where, required=True, minimum=0),
        exec_ns=errs.get(_duration, item, "exec", where, required=True, minimum=0),
        think_ns=errs.get(_duration, item, "think", where, default=0),
        seats=errs.get(_int, item, "seats", where, default=1, minimum=1),
        final_seats=errs.get(_int, item, "finalSeats", where, default=0, minimum=0),
        additional_latency_ns=errs.get(_duration, item, "additionalLatency", where, default=0,
                                       minimum=0),
        split=errs.get(_bool, item, "split", where),
        overhead_ns=errs.get(_duration, item, "overhead", where, default=0, minimum=0),
    )
    kind = item.get("kind", item.get("path", item.get("resource", name)))
    if not isinstance(kind, str) or not kind:
        errs.errors.append(ScenarioError(f"{where}.kind", "must be a non-empty string"))
    common["kind"] = kind
    if config_form:
        if "hash" in item:
            errs.errors.append(ScenarioError(f"{where}.hash",
                                             "not allowed with config: clients are classified"))
        attrs = errs.get(_attributes, item, where)
    elif count and "hash" in item:
        errs.errors.append(ScenarioError(f"{where}.hash",
                                         "not allowed with count (each copy is its own flow)"))
    elif not count:
        errs.get(_int, item, "hash", where, required=True, minimum=0, maximum=_U64_MAX)
    errs.check()
    if config_form:
        expanded = [(name, attrs)] if not count else [
            (f"{name}-{k}", _with_user(attrs, f"{attrs.user}-{k}")) for k in range(count)]
        new = [ClientSpec(n, attributes=a, start_ns=start + k * stagger, **common)
               for k, (n, a) in enumerate(expanded)]
    else:
        if count:
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
    errors = [ScenarioError(f"{where}.{key}" if where else str(key),
                            f"{unknown_field(str(key), allowed)} "
                            f"(allowed: {', '.join(sorted(allowed))})")
              for key in raw if key not in allowed]
    if errors:
        raise ScenarioErrors(errors)


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
