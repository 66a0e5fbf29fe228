"""FlowSchema matching and request classification, with Kubernetes' semantics.

    classifier = Classifier(configuration)     # any object with .flow_schemas, .priority_levels
    c = classifier.classify(attrs)             # Classification(flow_schema, priority_level,
                                               #                distinguisher, flow_hash)
    hand(c)                                    # the queues the flow's requests may use

Semantics (``rule.go``): the first FlowSchema in (precedence, name) order with a rule whose
subjects match the user AND whose resource rules (resource request) or non-resource rules
(non-resource request) match the request wins; when none does, ``catch-all``. A ``"*"`` in a
list counts only when it is the list's sole element; ``clusterScope`` alone decides requests
without a namespace; a non-resource URL ``/x`` matches ``/x`` and ``/x/...``, and ``/x/*``
matches only ``/x/...``. The distinguisher (user for ByUser, namespace for ByNamespace) and the
flow hash exist only for levels that queue with more than one queue; elsewhere they are ``""``
and 0.

Speed: subjects are indexed (user names, groups, ServiceAccount namespaces, wildcards) and the
candidate rules for one (user, groups) pair are memoized in a bounded LRU, so a request only
looks at the few schemas that can apply to its user, however many schemas there are. The
first match itself is memoized per distinct request shape (identity, verb, and the resource
fields or the path: the object name never matters), so repeated traffic costs one lookup.
:func:`flow_schema_matches` is the plain, unindexed definition, kept for tests and tools.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .objects import (
    CATCH_ALL,
    DISTINGUISH_BY_NAMESPACE,
    DISTINGUISH_BY_USER,
    RESPONSE_QUEUE,
    SERVICE_ACCOUNT_PREFIX,
    SUBJECT_GROUP,
    SUBJECT_SERVICE_ACCOUNT,
    SUBJECT_USER,
    TYPE_LIMITED,
    WILDCARD,
    FlowSchema,
    NonResourceRule,
    PolicyRule,
    PriorityLevel,
    RequestAttributes,
    ResourceRule,
    Subject,
)
from .shufflesharding import deal, flow_hash

#: Distinct (user, groups) pairs whose candidate rules are remembered.
CANDIDATE_CACHE_SIZE = 4096
#: Distinct requests (as far as matching can tell them apart: identity, verb, and the resource
#: fields or the path) whose first matching schema is remembered.
MATCH_CACHE_SIZE = 8192
#: Distinct (FlowSchema, distinguisher) pairs whose flow hash is remembered.
HASH_CACHE_SIZE = 16384


# --- the definition (unindexed), straight from rule.go -------------------------------------------

def _contains(value: str, values: tuple[str, ...], wildcard: str = WILDCARD) -> bool:
    return (len(values) == 1 and values[0] == wildcard) or value in values


def subject_matches(subject: Subject, user: str, groups: Iterable[str]) -> bool:
    if subject.kind == SUBJECT_USER:
        return subject.name == WILDCARD or subject.name == user
    if subject.kind == SUBJECT_GROUP:
        return subject.name == WILDCARD or subject.name in groups
    if subject.kind == SUBJECT_SERVICE_ACCOUNT:
        if subject.name == WILDCARD:
            rest = user[len(SERVICE_ACCOUNT_PREFIX):]
            return (user.startswith(SERVICE_ACCOUNT_PREFIX) and rest.startswith(subject.namespace)
                    and rest[len(subject.namespace):len(subject.namespace) + 1] == ":")
        return user == f"{SERVICE_ACCOUNT_PREFIX}{subject.namespace}:{subject.name}"
    return False


def resource_rule_matches(rule: ResourceRule, attrs: RequestAttributes) -> bool:
    if not _contains(attrs.verb, rule.verbs):
        return False
    if not _contains(attrs.resource_with_subresource, rule.resources):
        return False
    if not _contains(attrs.api_group, rule.api_groups):
        return False
    if attrs.namespace == "":
        return rule.cluster_scope
    return _contains(attrs.namespace, rule.namespaces)


def url_matches(urls: Iterable[str], path: str) -> bool:
    for url in urls:
        if url == WILDCARD or url == path:
            return True
        prefix = url[:-1] if url.endswith(WILDCARD) else url
        if not prefix.endswith("/"):
            prefix += "/"
        if path.startswith(prefix):
            return True
    return False


def non_resource_rule_matches(rule: NonResourceRule, attrs: RequestAttributes) -> bool:
    return _contains(attrs.verb, rule.verbs) and url_matches(rule.non_resource_urls, attrs.path)


def _matches_every_resource(rule: ResourceRule) -> bool:
    return (rule.verbs == (WILDCARD,) and rule.api_groups == (WILDCARD,)
            and rule.resources == (WILDCARD,) and rule.cluster_scope
            and rule.namespaces == (WILDCARD,))


def _matches_every_path(rule: NonResourceRule) -> bool:
    return rule.verbs == (WILDCARD,) and url_matches(rule.non_resource_urls, "/any")


def resource_rules_schema(flow_schemas: Iterable[FlowSchema]) -> FlowSchema | None:
    """The first FlowSchema whose resource rules tell a Kubernetes API request apart from the
    same path taken as a non-resource request, or None.

    A rule whose resource rules all match every resource (``*`` verbs, groups, resources and
    namespaces, cluster scope) next to a non-resource rule matching every path (``*`` verbs,
    ``*`` or ``/``) matches a request of its subjects however its path is parsed, as the
    mandatory ``exempt`` and ``catch-all`` schemas do: such rules do not count.

    Args:
        flow_schemas: the configuration's FlowSchemas.

    Returns:
        The first schema with a resource rule that can change a request's FlowSchema.
    """
    for fs in flow_schemas:
        for rule in fs.rules:
            if not rule.resource_rules:
                continue
            if (all(_matches_every_resource(r) for r in rule.resource_rules)
                    and any(_matches_every_path(r) for r in rule.non_resource_rules)):
                continue
            return fs
    return None


def policy_rule_matches(rule: PolicyRule, attrs: RequestAttributes) -> bool:
    if not any(subject_matches(s, attrs.user, attrs.groups) for s in rule.subjects):
        return False
    if attrs.is_resource:
        return any(resource_rule_matches(r, attrs) for r in rule.resource_rules)
    return any(non_resource_rule_matches(r, attrs) for r in rule.non_resource_rules)


def flow_schema_matches(flow_schema: FlowSchema, attrs: RequestAttributes) -> bool:
    """Kubernetes ``matchesFlowSchema``: does any rule of the schema match the request?"""
    return any(policy_rule_matches(rule, attrs) for rule in flow_schema.rules)


# --- compiled rules ------------------------------------------------------------------------------

def _compile_list(values: tuple[str, ...]) -> frozenset[str] | None:
    """None stands for "everything" (a sole wildcard)."""
    if len(values) == 1 and values[0] == WILDCARD:
        return None
    return frozenset(values)


class _CompiledResourceRule:
    __slots__ = ("verbs", "resources", "api_groups", "cluster_scope", "namespaces")

    def __init__(self, rule: ResourceRule) -> None:
        self.verbs = _compile_list(rule.verbs)
        self.resources = _compile_list(rule.resources)
        self.api_groups = _compile_list(rule.api_groups)
        self.cluster_scope = rule.cluster_scope
        self.namespaces = _compile_list(rule.namespaces)

    def matches(self, verb: str, api_group: str, resource: str, namespace: str) -> bool:
        """``resource`` includes the subresource (``pods/status``)."""
        if self.verbs is not None and verb not in self.verbs:
            return False
        if self.resources is not None and resource not in self.resources:
            return False
        if self.api_groups is not None and api_group not in self.api_groups:
            return False
        if namespace == "":
            return self.cluster_scope
        return self.namespaces is None or namespace in self.namespaces


class _CompiledNonResourceRule:
    __slots__ = ("verbs", "all_urls", "exact", "prefixes")

    def __init__(self, rule: NonResourceRule) -> None:
        self.verbs = _compile_list(rule.verbs)
        self.all_urls = WILDCARD in rule.non_resource_urls
        self.exact = frozenset(rule.non_resource_urls)
        prefixes = []
        for url in rule.non_resource_urls:
            prefix = url[:-1] if url.endswith(WILDCARD) else url
            prefixes.append(prefix if prefix.endswith("/") else prefix + "/")
        self.prefixes = tuple(dict.fromkeys(prefixes))

    def matches(self, verb: str, path: str) -> bool:
        if self.verbs is not None and verb not in self.verbs:
            return False
        return self.all_urls or path in self.exact or path.startswith(self.prefixes)


class _CompiledPolicyRule:
    __slots__ = ("resource_rules", "non_resource_rules")

    def __init__(self, rule: PolicyRule) -> None:
        self.resource_rules = tuple(_CompiledResourceRule(r) for r in rule.resource_rules)
        self.non_resource_rules = tuple(_CompiledNonResourceRule(r) for r in rule.non_resource_rules)

    def matches(self, is_resource: bool, verb: str, a: str, b: str, c: str) -> bool:
        """The request part of the rule (the subjects were checked by the index): (api group,
        resource/subresource, namespace) for resource requests, (path, "", "") otherwise."""
        if is_resource:
            for rule in self.resource_rules:
                if rule.matches(verb, a, b, c):
                    return True
            return False
        for rule in self.non_resource_rules:
            if rule.matches(verb, a):
                return True
        return False


# --- classification ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Classification:
    flow_schema: FlowSchema
    priority_level: PriorityLevel
    distinguisher: str
    flow_hash: int


def flow_distinguisher(flow_schema: FlowSchema, attrs: RequestAttributes) -> str:
    """Who the flow is, by the schema's distinguisher method: the user (ByUser), the namespace
    (ByNamespace), or ``""`` for a schema without one (all its requests are one flow).

    Unlike :attr:`Classification.distinguisher` (Kubernetes': empty unless the level has more
    than one queue), this names the flow on every level; the debug dump shows it.
    """
    if flow_schema.distinguisher == DISTINGUISH_BY_USER:
        return attrs.user
    if flow_schema.distinguisher == DISTINGUISH_BY_NAMESPACE:
        return attrs.namespace
    return ""


def queues_flows(level: PriorityLevel) -> bool:
    """Whether requests at this level get a distinguisher and flow hash (Limited, Queue,
    more than one queue)."""
    return (level.type == TYPE_LIMITED and level.limit_response == RESPONSE_QUEUE
            and level.queuing is not None and level.queuing.queues > 1)


def hand(classification: Classification) -> tuple[int, ...]:
    """The queue indices the flow is dealt (empty for levels without queues)."""
    queuing = classification.priority_level.queuing
    if classification.priority_level.desired_queues <= 0 or queuing is None:
        return ()
    return deal(classification.flow_hash, queuing.queues, queuing.hand_size)


class Classifier:
    """Classifies requests against one configuration. Thread-safe; build a new one per
    configuration (it is cheap)."""

    def __init__(self, configuration: Any) -> None:
        levels: Mapping[str, PriorityLevel] = configuration.priority_levels
        self.priority_levels = levels
        # A schema whose level is unknown cannot be used (Kubernetes: dangling).
        self.flow_schemas: tuple[FlowSchema, ...] = tuple(
            fs for fs in configuration.flow_schemas if fs.priority_level in levels)
        self._catch_all = next((fs for fs in self.flow_schemas if fs.name == CATCH_ALL), None)
        self._entries = tuple(
            (fs, levels[fs.priority_level], queues_flows(levels[fs.priority_level]))
            for fs in self.flow_schemas)

        # Subject index: key -> list of (schema index, rule index).
        self._any_user: list[tuple[int, int]] = []
        self._by_user: dict[str, list[tuple[int, int]]] = {}
        self._by_group: dict[str, list[tuple[int, int]]] = {}
        self._by_sa_namespace: dict[str, list[tuple[int, int]]] = {}
        self._compiled: dict[tuple[int, int], _CompiledPolicyRule] = {}
        for si, fs in enumerate(self.flow_schemas):
            for ri, rule in enumerate(fs.rules):
                self._compiled[(si, ri)] = _CompiledPolicyRule(rule)
                for subject in rule.subjects:
                    self._index_subject(subject, (si, ri))
        self._candidates = lru_cache(maxsize=CANDIDATE_CACHE_SIZE)(self._find_candidates)
        self._first_cached = lru_cache(maxsize=MATCH_CACHE_SIZE)(self._find_first)
        self._hash = lru_cache(maxsize=HASH_CACHE_SIZE)(flow_hash)

    def _index_subject(self, subject: Subject, key: tuple[int, int]) -> None:
        if subject.kind in (SUBJECT_USER, SUBJECT_GROUP) and subject.name == WILDCARD:
            self._any_user.append(key)
        elif subject.kind == SUBJECT_USER:
            self._by_user.setdefault(subject.name, []).append(key)
        elif subject.kind == SUBJECT_GROUP:
            self._by_group.setdefault(subject.name, []).append(key)
        elif subject.kind == SUBJECT_SERVICE_ACCOUNT:
            if subject.name == WILDCARD:
                self._by_sa_namespace.setdefault(subject.namespace, []).append(key)
            else:
                user = f"{SERVICE_ACCOUNT_PREFIX}{subject.namespace}:{subject.name}"
                self._by_user.setdefault(user, []).append(key)

    def _find_candidates(self, user: str, groups: tuple[str, ...]
                         ) -> tuple[tuple[int, tuple[_CompiledPolicyRule, ...]], ...]:
        """(schema index, rules whose subjects match) for every schema that can match."""
        keys = set(self._any_user)
        keys.update(self._by_user.get(user, ()))
        for group in groups:
            keys.update(self._by_group.get(group, ()))
        if self._by_sa_namespace and user.startswith(SERVICE_ACCOUNT_PREFIX):
            rest = user[len(SERVICE_ACCOUNT_PREFIX):]
            for namespace, entries in self._by_sa_namespace.items():
                if rest.startswith(namespace) and rest[len(namespace):len(namespace) + 1] == ":":
                    keys.update(entries)
        by_schema: dict[int, list[_CompiledPolicyRule]] = {}
        for si, ri in sorted(keys):
            by_schema.setdefault(si, []).append(self._compiled[(si, ri)])
        return tuple((si, tuple(rules)) for si, rules in by_schema.items())

    def _find_first(self, user: str, groups: tuple[str, ...], is_resource: bool, verb: str,
                    a: str, b: str, c: str) -> int:
        """Index of the first matching schema, -1 for none (arguments as in ``matches``)."""
        for si, rules in self._candidates(user, groups):
            for rule in rules:
                if rule.matches(is_resource, verb, a, b, c):
                    return si
        return -1

    def _first(self, attrs: RequestAttributes) -> int:
        groups = attrs.groups if isinstance(attrs.groups, tuple) else tuple(attrs.groups)
        if attrs.is_resource:
            return self._first_cached(attrs.user, groups, True, attrs.verb, attrs.api_group,
                                      attrs.resource_with_subresource, attrs.namespace)
        return self._first_cached(attrs.user, groups, False, attrs.verb, attrs.path, "", "")

    def match(self, attrs: RequestAttributes) -> FlowSchema | None:
        """The first matching FlowSchema, or None (the caller then uses catch-all)."""
        si = self._first(attrs)
        return None if si < 0 else self.flow_schemas[si]

    def classify(self, attrs: RequestAttributes) -> Classification:
        si = self._first(attrs)
        if si >= 0:
            fs, level, flows = self._entries[si]
            return self._classification(fs, level, flows, attrs)
        fs = self._catch_all
        if fs is None:
            raise LookupError("no FlowSchema matched and the configuration has no catch-all")
        level = self.priority_levels[fs.priority_level]
        return self._classification(fs, level, queues_flows(level), attrs)

    def _classification(self, fs: FlowSchema, level: PriorityLevel, flows: bool,
                        attrs: RequestAttributes) -> Classification:
        if not flows:
            return Classification(fs, level, "", 0)
        distinguisher = flow_distinguisher(fs, attrs)
        return Classification(fs, level, distinguisher, self._hash(fs.name, distinguisher))
