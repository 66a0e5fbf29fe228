"""Typed, validated Kubernetes ``flowcontrol.apiserver.k8s.io/v1`` objects and request attributes.

These are what the rest of the code works with *after* loading, defaulting and validation
(:mod:`apf_gunicorn.flowcontrol.loader` and ``validation``). Every instance here is valid; raw
YAML never reaches the classifier or the ledger. All classes are frozen so a configuration can be
shared between threads and inherited across ``fork`` without copying.

Wildcard conventions are Kubernetes': ``"*"`` in a list counts only when it is the sole element.

Every FlowSchema and priority level has a uid: its ``metadata.uid``, or else one derived from
its kind and name (:func:`derived_uid`, a UUIDv5), so the ``X-Kubernetes-PF-*-UID`` response
headers are never empty and stay the same across restarts and reloads.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

WILDCARD = "*"

EXEMPT = "exempt"  # mandatory priority level and FlowSchema name
CATCH_ALL = "catch-all"

SUBJECT_USER = "User"
SUBJECT_GROUP = "Group"
SUBJECT_SERVICE_ACCOUNT = "ServiceAccount"

DISTINGUISH_BY_USER = "ByUser"
DISTINGUISH_BY_NAMESPACE = "ByNamespace"

TYPE_EXEMPT = "Exempt"
TYPE_LIMITED = "Limited"

RESPONSE_QUEUE = "Queue"
RESPONSE_REJECT = "Reject"

SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"

KIND_FLOW_SCHEMA = "FlowSchema"
KIND_PRIORITY_LEVEL = "PriorityLevelConfiguration"

#: The UUIDv5 namespace of derived uids (itself uuid5(NAMESPACE_URL, the API group's URL)).
UID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://flowcontrol.apiserver.k8s.io/apf-gunicorn")


def derived_uid(kind: str, name: str) -> str:
    """The uid of an object that has no ``metadata.uid``: UUIDv5 of ``"<kind>/<name>"``.

    Args:
        kind: ``FlowSchema`` or ``PriorityLevelConfiguration``.
        name: the object's name.

    Returns:
        A UUID string, the same for the same kind and name on every machine and every run.
    """
    return str(uuid.uuid5(UID_NAMESPACE, f"{kind}/{name}"))


@dataclass(frozen=True, slots=True)
class Subject:
    """``kind`` is User, Group or ServiceAccount; ``name`` may be ``*``; ``namespace`` is set
    only for ServiceAccount."""

    kind: str
    name: str
    namespace: str = ""


@dataclass(frozen=True, slots=True)
class ResourceRule:
    verbs: tuple[str, ...]
    api_groups: tuple[str, ...]
    resources: tuple[str, ...]  # "resource" or "resource/subresource"
    cluster_scope: bool = False
    namespaces: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class NonResourceRule:
    verbs: tuple[str, ...]
    non_resource_urls: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PolicyRule:
    """One ``PolicyRulesWithSubjects`` entry."""

    subjects: tuple[Subject, ...]
    resource_rules: tuple[ResourceRule, ...] = ()
    non_resource_rules: tuple[NonResourceRule, ...] = ()


@dataclass(frozen=True, slots=True)
class FlowSchema:
    name: str
    priority_level: str  # spec.priorityLevelConfiguration.name
    matching_precedence: int = 1000
    distinguisher: str | None = None  # ByUser, ByNamespace or None
    rules: tuple[PolicyRule, ...] = ()
    uid: str = ""  # metadata.uid; when empty, derived_uid(FlowSchema, name)
    source: str = ""  # file the object came from ("<built-in>" for imagined ones)

    def __post_init__(self) -> None:
        if not self.uid:
            object.__setattr__(self, "uid", derived_uid(KIND_FLOW_SCHEMA, self.name))


@dataclass(frozen=True, slots=True)
class QueuingConfig:
    queues: int = 64
    hand_size: int = 8
    queue_length_limit: int = 50


@dataclass(frozen=True, slots=True)
class PriorityLevel:
    """A PriorityLevelConfiguration after defaulting.

    For ``Exempt`` levels ``nominal_concurrency_shares`` and ``lendable_percent`` come from
    ``spec.exempt`` (0 when absent) and ``borrowing_limit_percent`` is None. ``fairness`` is the
    ``apf-gunicorn.io/fairness`` annotation's value, or None when the level does not
    choose one (see :mod:`apf_gunicorn.flowcontrol.fairness`). ``max_seats`` is the
    ``apf-gunicorn.io/max-seats`` annotation's value (:mod:`apf_gunicorn.flowcontrol.limits`),
    or None.
    """

    name: str
    type: str  # Exempt or Limited
    nominal_concurrency_shares: int = 30
    lendable_percent: int = 0
    borrowing_limit_percent: int | None = None
    limit_response: str | None = None  # Queue or Reject (None for Exempt)
    queuing: QueuingConfig | None = None  # set iff limit_response == Queue
    uid: str = ""  # metadata.uid; when empty, derived_uid(PriorityLevelConfiguration, name)
    source: str = ""
    fairness: str | None = None  # annotation apf-gunicorn.io/fairness; None: the server's
    # annotation apf-gunicorn.io/max-seats: the widest request in seats; None: Kubernetes' rule
    max_seats: int | None = None

    def __post_init__(self) -> None:
        if not self.uid:
            object.__setattr__(self, "uid", derived_uid(KIND_PRIORITY_LEVEL, self.name))

    @property
    def is_exempt(self) -> bool:
        return self.type == TYPE_EXEMPT

    @property
    def desired_queues(self) -> int:
        """Kubernetes' DesiredNumQueues: -1 exempt, 0 Reject (no queues), else the queue count."""
        if self.type == TYPE_EXEMPT:
            return -1
        if self.queuing is None:
            return 0
        return self.queuing.queues


@dataclass(frozen=True, slots=True)
class RequestAttributes:
    """What the classifier sees of one request (Kubernetes' RequestInfo plus the user)."""

    user: str
    groups: tuple[str, ...]
    verb: str
    path: str
    is_resource: bool = False
    api_group: str = ""
    api_version: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str = ""
    name: str = ""
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def resource_with_subresource(self) -> str:
        return f"{self.resource}/{self.subresource}" if self.subresource else self.resource
