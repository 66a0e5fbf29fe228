"""The digested configuration: what the classifier and the ledger run on.

:func:`digest` turns the valid objects of a configuration into a :class:`Configuration` the way
Kubernetes' controller does at every resync (``apf_controller.go`` digest order):

1. priority levels the controller would consider *broken* are skipped (and reported in
   ``broken``); the rest are accepted;
2. a FlowSchema is usable only if the level it references was accepted; the others are
   *dangling*: excluded from matching and reported with Kubernetes' condition message;
3. usable FlowSchemas are sorted by (matchingPrecedence, name); the built-in ``exempt`` schema is
   prepended and the built-in ``catch-all`` schema appended when no usable one has that name;
4. missing mandatory priority levels (``exempt``, ``catch-all``) are imagined from
   :mod:`apf_gunicorn.flowcontrol.bootstrap`.

Usually you get a Configuration from :func:`apf_gunicorn.flowcontrol.loader.load_configuration`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from apf_gunicorn.flowcontrol.bootstrap import MANDATORY_FLOW_SCHEMAS, MANDATORY_PRIORITY_LEVELS
from apf_gunicorn.flowcontrol.objects import (
    CATCH_ALL,
    EXEMPT,
    RESPONSE_QUEUE,
    SUBJECT_SERVICE_ACCOUNT,
    TYPE_EXEMPT,
    FlowSchema,
    NonResourceRule,
    PolicyRule,
    PriorityLevel,
    QueuingConfig,
    ResourceRule,
    Subject,
)


@dataclass(frozen=True)
class Configuration:
    """A digested configuration.

    ``flow_schemas``: usable schemas in matching order, mandatory ones included;
    ``priority_levels``: accepted levels in the order they were read, then imagined mandatory ones;
    ``dangling``: ``(FlowSchema, message)`` for schemas whose level is missing or broken;
    ``sources``: the files read; ``broken``: ``(level name, reason)`` for levels ignored as broken.
    """

    flow_schemas: tuple[FlowSchema, ...]
    priority_levels: dict[str, PriorityLevel]
    dangling: list[tuple[FlowSchema, str]] = field(default_factory=list)
    sources: tuple[str, ...] = ()
    broken: list[tuple[str, str]] = field(default_factory=list)

    def warnings(self) -> list[str]:
        """Human-readable notes on dangling schemas and broken levels."""
        out = [f'{fs.source}: FlowSchema "{fs.name}": {msg}' for fs, msg in self.dangling]
        out += [
            f'PriorityLevelConfiguration "{name}": ignored because its spec is broken: {reason}'
            for name, reason in self.broken
        ]
        return out


def dangling_message(pl_name: str) -> str:
    """The ``Dangling=True`` condition message Kubernetes writes on such a FlowSchema."""
    return (
        f'This FlowSchema references the PriorityLevelConfiguration object named "{pl_name}" '
        "but there is no such object"
    )


def digest(
    flow_schemas: Iterable[FlowSchema],
    priority_levels: Iterable[PriorityLevel],
    broken: Iterable[tuple[str, str]] = (),
    sources: Iterable[str] = (),
) -> Configuration:
    """Build a :class:`Configuration` from valid objects (see the module docstring).

    ``priority_levels`` are the accepted levels; ``broken`` names the levels that were read but
    failed the controller's sanity check, so schemas that reference them become dangling.
    """
    levels: dict[str, PriorityLevel] = {}
    for pl in priority_levels:
        levels[pl.name] = pl
    usable: list[FlowSchema] = []
    dangling: list[tuple[FlowSchema, str]] = []
    for fs in flow_schemas:
        if fs.priority_level in levels:
            usable.append(fs)
        else:
            dangling.append((fs, dangling_message(fs.priority_level)))
    usable.sort(key=lambda fs: (fs.matching_precedence, fs.name))
    names = {fs.name for fs in usable}
    if EXEMPT not in names:
        usable.insert(0, MANDATORY_FLOW_SCHEMAS[EXEMPT])
    if CATCH_ALL not in names:
        usable.append(MANDATORY_FLOW_SCHEMAS[CATCH_ALL])
    for name in (EXEMPT, CATCH_ALL):
        if name not in levels:
            levels[name] = MANDATORY_PRIORITY_LEVELS[name]
    return Configuration(
        flow_schemas=tuple(usable),
        priority_levels=levels,
        dangling=dangling,
        sources=tuple(sources),
        broken=list(broken),
    )


# --------------------------------------------------------------------------------------------
# Normalized, defaulted specs (see validation.py) -> typed objects


def flow_schema_from_spec(
    name: str, spec: dict[str, Any], uid: str = "", source: str = ""
) -> FlowSchema:
    dm = spec["distinguisherMethod"]
    return FlowSchema(
        name=name,
        priority_level=spec["priorityLevelConfiguration"]["name"],
        matching_precedence=spec["matchingPrecedence"],
        distinguisher=dm["type"] if dm is not None else None,
        rules=tuple(_policy_rule(r) for r in spec["rules"]),
        uid=uid,
        source=source,
    )


def _policy_rule(rule: dict[str, Any]) -> PolicyRule:
    return PolicyRule(
        subjects=tuple(_subject(s) for s in rule["subjects"]),
        resource_rules=tuple(
            ResourceRule(
                verbs=tuple(rr["verbs"]),
                api_groups=tuple(rr["apiGroups"]),
                resources=tuple(rr["resources"]),
                cluster_scope=rr["clusterScope"],
                namespaces=tuple(rr["namespaces"]),
            )
            for rr in rule["resourceRules"]
        ),
        non_resource_rules=tuple(
            NonResourceRule(
                verbs=tuple(nr["verbs"]), non_resource_urls=tuple(nr["nonResourceURLs"])
            )
            for nr in rule["nonResourceRules"]
        ),
    )


def _subject(s: dict[str, Any]) -> Subject:
    kind = s["kind"]
    if kind == SUBJECT_SERVICE_ACCOUNT:
        sa = s["serviceAccount"]
        return Subject(kind, sa["name"], sa["namespace"])
    member = s["user"] if kind == "User" else s["group"]
    return Subject(kind, member["name"])


def priority_level_from_spec(
    name: str, spec: dict[str, Any], uid: str = "", source: str = "", fairness: str | None = None,
    max_seats: int | None = None,
) -> PriorityLevel:
    if spec["type"] == TYPE_EXEMPT:
        exempt = spec["exempt"] or {}
        return PriorityLevel(
            name=name,
            type=TYPE_EXEMPT,
            nominal_concurrency_shares=exempt.get("nominalConcurrencyShares") or 0,
            lendable_percent=exempt.get("lendablePercent") or 0,
            borrowing_limit_percent=None,
            limit_response=None,
            queuing=None,
            uid=uid,
            source=source,
        )  # an exempt level has no dispatch policy (the loader refuses the annotation)
    limited = spec["limited"]
    lr = limited["limitResponse"]
    q = lr["queuing"]
    return PriorityLevel(
        name=name,
        type=spec["type"],
        nominal_concurrency_shares=limited["nominalConcurrencyShares"],
        lendable_percent=limited["lendablePercent"] or 0,
        borrowing_limit_percent=limited["borrowingLimitPercent"],
        limit_response=lr["type"],
        queuing=(
            QueuingConfig(q["queues"], q["handSize"], q["queueLengthLimit"])
            if q is not None and lr["type"] == RESPONSE_QUEUE
            else None
        ),
        uid=uid,
        source=source,
        fairness=fairness,
        max_seats=max_seats,
    )
