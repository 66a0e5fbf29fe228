"""Classification against Kubernetes' bootstrap configuration (mandatory + suggested objects,
reference/k8s-apf-config.md §3), built from the dataclasses so it does not depend on the loader.

``suggested_configuration()`` is also used by the explain tests and the benchmark.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from apf_gunicorn.flowcontrol.matching import Classifier, flow_schema_matches, hand
from apf_gunicorn.flowcontrol.objects import (
    FlowSchema,
    NonResourceRule,
    PolicyRule,
    PriorityLevel,
    QueuingConfig,
    RequestAttributes,
    ResourceRule,
    Subject,
)
from apf_gunicorn.flowcontrol.shufflesharding import flow_hash

_ALL_RES = ResourceRule(("*",), ("*",), ("*",), True, ("*",))
_ALL_NONRES = NonResourceRule(("*",), ("*",))


def _queue(name: str, shares: int, lendable: int, queues: int, hand_size: int) -> PriorityLevel:
    return PriorityLevel(name, "Limited", shares, lendable, None, "Queue",
                         QueuingConfig(queues, hand_size, 50))


def _all(*subjects: Subject) -> tuple[PolicyRule, ...]:
    return (PolicyRule(subjects, (_ALL_RES,), (_ALL_NONRES,)),)


def _group(name: str) -> Subject:
    return Subject("Group", name)


def _user(name: str) -> Subject:
    return Subject("User", name)


def suggested_flow_schemas() -> list[FlowSchema]:
    both = (_group("system:unauthenticated"), _group("system:authenticated"))
    return [
        FlowSchema("exempt", "exempt", 1, None, _all(_group("system:masters"))),
        FlowSchema("probes", "exempt", 2, None, (PolicyRule(
            both, (), (NonResourceRule(("get",), ("/healthz", "/readyz", "/livez")),)),)),
        FlowSchema("system-leader-election", "leader-election", 100, "ByUser", (PolicyRule(
            (_user("system:kube-controller-manager"), _user("system:kube-scheduler"),
             Subject("ServiceAccount", "*", "kube-system")),
            (ResourceRule(("get", "create", "update"), ("coordination.k8s.io",), ("leases",),
                          False, ("*",)),)),)),
        FlowSchema("system-node-high", "node-high", 400, "ByUser", (PolicyRule(
            (_group("system:nodes"),),
            (ResourceRule(("*",), ("",), ("nodes", "nodes/status"), True, ("*",)),
             ResourceRule(("*",), ("coordination.k8s.io",), ("leases",), False, ("*",)))),)),
        FlowSchema("system-nodes", "system", 500, "ByUser", _all(_group("system:nodes"))),
        FlowSchema("kube-controller-manager", "workload-high", 800, "ByNamespace",
                   _all(_user("system:kube-controller-manager"))),
        FlowSchema("kube-scheduler", "workload-high", 800, "ByNamespace",
                   _all(_user("system:kube-scheduler"))),
        FlowSchema("kube-system-service-accounts", "workload-high", 900, "ByNamespace",
                   _all(Subject("ServiceAccount", "*", "kube-system"))),
        FlowSchema("service-accounts", "workload-low", 9000, "ByUser",
                   _all(_group("system:serviceaccounts"))),
        FlowSchema("global-default", "global-default", 9900, "ByUser", _all(*both)),
        FlowSchema("catch-all", "catch-all", 10000, "ByUser", _all(*both)),
    ]


def suggested_priority_levels() -> dict[str, PriorityLevel]:
    levels = [
        PriorityLevel("exempt", "Exempt", 0, 0),
        PriorityLevel("catch-all", "Limited", 5, 0, None, "Reject", None),
        _queue("system", 30, 33, 64, 6),
        _queue("node-high", 40, 25, 64, 6),
        _queue("leader-election", 10, 0, 16, 4),
        _queue("workload-high", 40, 50, 128, 6),
        _queue("workload-low", 100, 90, 128, 6),
        _queue("global-default", 20, 50, 128, 6),
    ]
    return {pl.name: pl for pl in levels}


def suggested_configuration(extra_schemas: list[FlowSchema] = ()) -> SimpleNamespace:
    schemas = sorted([*suggested_flow_schemas(), *extra_schemas],
                     key=lambda fs: (fs.matching_precedence, fs.name))
    return SimpleNamespace(flow_schemas=tuple(schemas), priority_levels=suggested_priority_levels())


@pytest.fixture(scope="module")
def classifier() -> Classifier:
    return Classifier(suggested_configuration())


def _res(user, groups, verb, resource, api_group="", namespace="", subresource="", name=""):
    return RequestAttributes(user, tuple(groups), verb, "/x", True, api_group, "v1", resource,
                             subresource, namespace, name)


def _nonres(user, groups, verb, path):
    return RequestAttributes(user, tuple(groups), verb, path)


AUTH = ("system:authenticated",)
ANON = ("system:unauthenticated",)
CASES = [
    # (description, attrs, flow schema, priority level, distinguisher)
    ("node updates its own status", _res("system:node:n1", ("system:nodes", *AUTH), "update",
     "nodes", subresource="status", name="n1"), "system-node-high", "node-high", "system:node:n1"),
    ("node renews its lease", _res("system:node:n1", ("system:nodes", *AUTH), "update", "leases",
     "coordination.k8s.io", "kube-node-lease", name="n1"), "system-node-high", "node-high",
     "system:node:n1"),
    ("node lists pods", _res("system:node:n1", ("system:nodes", *AUTH), "list", "pods"),
     "system-nodes", "system", "system:node:n1"),
    ("controller manager takes its lease", _res("system:kube-controller-manager", AUTH, "update",
     "leases", "coordination.k8s.io", "kube-system", name="kcm"), "system-leader-election",
     "leader-election", "system:kube-controller-manager"),
    ("controller manager lists leases cluster-wide", _res("system:kube-controller-manager", AUTH,
     "list", "leases", "coordination.k8s.io"), "kube-controller-manager", "workload-high", ""),
    ("controller manager patches a deployment", _res("system:kube-controller-manager", AUTH,
     "patch", "deployments", "apps", "web"), "kube-controller-manager", "workload-high", "web"),
    ("scheduler binds a pod", _res("system:kube-scheduler", AUTH, "create", "pods", "", "default",
     "binding", "p"), "kube-scheduler", "workload-high", "default"),
    ("kube-system SA takes a lease", _res("system:serviceaccount:kube-system:ctrl",
     ("system:serviceaccounts", "system:serviceaccounts:kube-system", *AUTH), "get", "leases",
     "coordination.k8s.io", "kube-system", name="l"), "system-leader-election", "leader-election",
     "system:serviceaccount:kube-system:ctrl"),
    ("kube-system SA watches pods", _res("system:serviceaccount:kube-system:ctrl",
     ("system:serviceaccounts", *AUTH), "watch", "pods", namespace="kube-system"),
     "kube-system-service-accounts", "workload-high", "kube-system"),
    ("kube-systemx SA is an ordinary SA", _res("system:serviceaccount:kube-systemx:ctrl",
     ("system:serviceaccounts", *AUTH), "get", "leases", "coordination.k8s.io", "kube-systemx",
     name="l"), "service-accounts", "workload-low", "system:serviceaccount:kube-systemx:ctrl"),
    ("default SA lists pods", _res("system:serviceaccount:default:foo",
     ("system:serviceaccounts", *AUTH), "list", "pods", namespace="default"),
     "service-accounts", "workload-low", "system:serviceaccount:default:foo"),
    ("admin in system:masters", _res("admin", ("system:masters", *AUTH), "delete", "pods",
     namespace="x", name="y"), "exempt", "exempt", ""),
    ("anonymous GET /healthz", _nonres("system:anonymous", ANON, "get", "/healthz"), "probes",
     "exempt", ""),
    ("anonymous GET /readyz/etcd", _nonres("system:anonymous", ANON, "get", "/readyz/etcd"),
     "probes", "exempt", ""),
    ("user GET /livez", _nonres("alice", AUTH, "get", "/livez"), "probes", "exempt", ""),
    ("POST /healthz is not a probe", _nonres("alice", AUTH, "post", "/healthz"), "global-default",
     "global-default", "alice"),
    ("/healthzx is not a probe", _nonres("alice", AUTH, "get", "/healthzx"), "global-default",
     "global-default", "alice"),
    ("ordinary user", _res("alice", AUTH, "get", "pods", namespace="default", name="p"),
     "global-default", "global-default", "alice"),
    ("anonymous user", _res("system:anonymous", ANON, "list", "pods"), "global-default",
     "global-default", "system:anonymous"),
    ("user without groups falls to catch-all", _res("nobody", (), "get", "pods", namespace="a"),
     "catch-all", "catch-all", ""),
]


@pytest.mark.parametrize("desc, attrs, fs, pl, distinguisher", CASES, ids=[c[0] for c in CASES])
def test_bootstrap_classification(classifier, desc, attrs, fs, pl, distinguisher):
    c = classifier.classify(attrs)
    assert (c.flow_schema.name, c.priority_level.name, c.distinguisher) == (fs, pl, distinguisher)
    if pl in ("exempt", "catch-all"):
        assert c.flow_hash == 0 and hand(c) == ()
    else:
        assert c.flow_hash == flow_hash(fs, distinguisher)
        queuing = c.priority_level.queuing
        h = hand(c)
        assert len(h) == queuing.hand_size and len(set(h)) == len(h)
        assert all(0 <= q < queuing.queues for q in h)


@pytest.mark.parametrize("desc, attrs, fs, pl, distinguisher", CASES, ids=[c[0] for c in CASES])
def test_bootstrap_agrees_with_plain_definition(classifier, desc, attrs, fs, pl, distinguisher):
    first = next((s.name for s in classifier.flow_schemas if flow_schema_matches(s, attrs)),
                 "catch-all")
    assert first == fs


def test_global_default_hash_vector(classifier):
    c = classifier.classify(_nonres("alice", AUTH, "get", "/anything"))
    assert c.flow_hash == 17644606172554983095  # reference/k8s-queueset.md §2.1


def test_ties_broken_by_name():
    # Same precedence as kube-controller-manager, same subjects, name sorts first: it wins.
    early = FlowSchema("a-early", "global-default", 800, None,
                       _all(_user("system:kube-controller-manager")))
    c = Classifier(suggested_configuration([early])).classify(
        _res("system:kube-controller-manager", AUTH, "get", "pods", namespace="n", name="p"))
    assert c.flow_schema.name == "a-early" and c.distinguisher == ""


def test_dangling_schema_is_skipped():
    dangling = FlowSchema("dangling", "no-such-level", 50, None, _all(_group("system:authenticated")))
    c = Classifier(suggested_configuration([dangling])).classify(
        _nonres("alice", AUTH, "get", "/x"))
    assert c.flow_schema.name == "global-default"


def test_no_catch_all_is_an_error():
    cfg = SimpleNamespace(flow_schemas=(), priority_levels=suggested_priority_levels())
    with pytest.raises(LookupError):
        Classifier(cfg).classify(_nonres("alice", AUTH, "get", "/x"))


@pytest.fixture(scope="module")
def loaded_classifier() -> Classifier:
    from apf_gunicorn.flowcontrol.loader import load_configuration
    return Classifier(load_configuration("builtin:kubernetes"))


@pytest.mark.parametrize("desc, attrs, fs, pl, distinguisher", CASES, ids=[c[0] for c in CASES])
def test_shipped_kubernetes_configuration(loaded_classifier, desc, attrs, fs, pl, distinguisher):
    """The same cases against builtin:kubernetes as the loader reads it."""
    c = loaded_classifier.classify(attrs)
    assert (c.flow_schema.name, c.priority_level.name, c.distinguisher) == (fs, pl, distinguisher)


def test_object_built_configuration_matches_shipped_one(loaded_classifier):
    ours = suggested_configuration()
    assert [fs.name for fs in loaded_classifier.flow_schemas] == [fs.name for fs in ours.flow_schemas]
    shipped = {fs.name: fs for fs in loaded_classifier.flow_schemas}
    for fs in ours.flow_schemas:
        other = shipped[fs.name]
        assert (fs.priority_level, fs.matching_precedence, fs.distinguisher) == (
            other.priority_level, other.matching_precedence, other.distinguisher)
        assert fs.rules == other.rules, fs.name
