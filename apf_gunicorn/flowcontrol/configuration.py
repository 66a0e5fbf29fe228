"""The digested configuration: what the classifier and the ledger run on.

:func:`digest` turns the valid objects of a configuration into a :class:`Configuration` the way a
cluster ends up with them: kube-apiserver's bootstrap ensurer first makes the mandatory objects
exist, then its controller digests everything at every resync (``apf_controller.go``):

1. the mandatory priority levels (``exempt``, ``catch-all``) exist as objects: the ensurer
   creates them from :mod:`apf_gunicorn.flowcontrol.bootstrap` when the configuration lacks
   them, and rewrites a user's copy whose spec differs (validation already refuses every
   difference but one: an ``exempt`` level without ``spec.exempt``, which the controller would
   find *broken*; it gets the bootstrap spec and keeps its uid and file, see ``repaired``);
2. other priority levels the controller would consider broken are skipped (``broken``);
3. a FlowSchema is usable only if the level it references exists; the others are *dangling*:
   excluded from matching and reported with Kubernetes' condition message. So a schema may send
   requests to ``exempt`` or ``catch-all`` without the file defining them, as in a cluster;
4. usable FlowSchemas are sorted by (matchingPrecedence, name); the mandatory ``exempt`` schema is
   prepended and the mandatory ``catch-all`` schema appended when the file does not define them
   (the ensurer creates them too).

Usually you get a Configuration from :func:`apf_gunicorn.flowcontrol.loader.load_configuration`.
"""

from __future__ import annotations

import dataclasses
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
from apf_gunicorn.flowcontrol.validation import ConfigError


@dataclass(frozen=True)
class Configuration:
    """A digested configuration.

    ``flow_schemas``: usable schemas in matching order, mandatory ones included;
    ``priority_levels``: accepted levels in the order they were read, then the mandatory ones
    the configuration lacks;
    ``dangling``: ``(FlowSchema, message)`` for schemas whose level does not exist (or is broken);
    ``sources``: the files read; ``broken``: ``(level name, reason)`` for levels ignored as broken;
    ``repaired``: ``(level as read, reason)`` for mandatory levels the controller would find
    broken and that have their bootstrap spec instead, as the ensurer rewrites them.
    """

    flow_schemas: tuple[FlowSchema, ...]
    priority_levels: dict[str, PriorityLevel]
    dangling: list[tuple[FlowSchema, str]] = field(default_factory=list)
    sources: tuple[str, ...] = ()
    broken: list[tuple[str, str]] = field(default_factory=list)
    repaired: list[tuple[PriorityLevel, str]] = field(default_factory=list)

    def dangling_errors(self) -> list[ConfigError]:
        """Each dangling schema as an error on its ``spec.priorityLevelConfiguration.name``,
        saying what to do about it (``check`` refuses such a configuration; the server, like
        Kubernetes, runs without the schema).

        Returns:
            One :class:`ConfigError` per dangling schema, naming its file and the level.
        """
        known = ", ".join(f'"{name}"' for name in self.priority_levels)
        return [
            ConfigError(
                fs.source, "FlowSchema", fs.name, "spec.priorityLevelConfiguration.name",
                f"{msg}: the schema is dangling, so no request ever matches it. Define that "
                f"PriorityLevelConfiguration or name an existing one ({known})")
            for fs, msg in self.dangling
        ]

    def warnings(self) -> list[str]:
        """Human-readable notes on dangling schemas, broken levels and repaired mandatory
        levels."""
        out = [str(e) for e in self.dangling_errors()]
        out += [
            f'PriorityLevelConfiguration "{name}": ignored because its spec is broken: {reason}'
            for name, reason in self.broken
        ]
        out += [
            f'{pl.source}: PriorityLevelConfiguration "{pl.name}": {reason}: it has the '
            "bootstrap spec instead, as Kubernetes' ensurer rewrites it"
            for pl, reason in self.repaired
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
    broken: Iterable[tuple[PriorityLevel, str]] = (),
    sources: Iterable[str] = (),
) -> Configuration:
    """Build a :class:`Configuration` from valid objects (see the module docstring).

    Args:
        flow_schemas: the valid FlowSchemas.
        priority_levels: the valid levels the controller accepts.
        broken: ``(level, reason)`` for levels that were read but fail the controller's sanity
            check: schemas that reference them are dangling, unless the level is mandatory
            (then the ensurer's spec replaces it).
        sources: the files read.

    Returns:
        The digested configuration.
    """
    levels: dict[str, PriorityLevel] = {}
    for pl in priority_levels:
        levels[pl.name] = pl
    still_broken: list[tuple[str, str]] = []
    repaired: list[tuple[PriorityLevel, str]] = []
    for pl, reason in broken:
        if pl.name in MANDATORY_PRIORITY_LEVELS and pl.name not in levels:
            levels[pl.name] = dataclasses.replace(
                MANDATORY_PRIORITY_LEVELS[pl.name], uid=pl.uid, source=pl.source)
            repaired.append((pl, reason))
        else:
            still_broken.append((pl.name, reason))
    # The ensurer creates the mandatory levels before any schema is digested, so a schema
    # naming one is usable even when the file does not define it.
    for name in (EXEMPT, CATCH_ALL):
        if name not in levels:
            levels[name] = MANDATORY_PRIORITY_LEVELS[name]
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
    return Configuration(
        flow_schemas=tuple(usable),
        priority_levels=levels,
        dangling=dangling,
        sources=tuple(sources),
        broken=still_broken,
        repaired=repaired,
    )


# --------------------------------------------------------------------------------------------
# Normalized, defaulted specs (see spec_decoding.py) -> typed objects


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
        )  # an exempt level has no fairness (the loader refuses the annotation)
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
