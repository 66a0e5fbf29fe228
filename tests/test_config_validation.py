"""Table-driven validation tests: each rule with Kubernetes' texts (validation_test.go cases)."""

from __future__ import annotations

import copy

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apf_gunicorn.flowcontrol.bootstrap import mandatory_manifests
from apf_gunicorn.flowcontrol.flowschema_validation import non_resource_url_error
from apf_gunicorn.flowcontrol.loader import V1BETA3_PRESERVE_ZERO, load_text, parse_object
from apf_gunicorn.flowcontrol.validation import ConfigError, ConfigErrors

SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
    "'.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used "
    "for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and "
    "must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex "
    "used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
VERBS = '"create", "delete", "deletecollection", "get", "list", "patch", "proxy", "update", "watch"'
ALL_RR = {"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"], "namespaces": ["*"]}
ALL_NR = {"verbs": ["*"], "nonResourceURLs": ["*"]}
NOXU = {"kind": "User", "user": {"name": "noxu"}}


def fs(spec=None, name="system-foo", **extra):
    base = {
        "matchingPrecedence": 50,
        "priorityLevelConfiguration": {"name": "system-bar"},
        "rules": [{"subjects": [NOXU], "resourceRules": [ALL_RR]}],
    }
    base.update(spec or {})
    doc = {"apiVersion": "flowcontrol.apiserver.k8s.io/v1", "kind": "FlowSchema",
           "metadata": {"name": name}, "spec": base}  # fmt: skip
    doc.update(extra)
    return doc


def rule(**kw):
    return {"rules": [{"subjects": [NOXU], **kw}]}


def pl(spec, name="system-foo", api="flowcontrol.apiserver.k8s.io/v1", **extra):
    doc = {"apiVersion": api, "kind": "PriorityLevelConfiguration",
           "metadata": {"name": name}, "spec": spec}  # fmt: skip
    doc.update(extra)
    return doc


def queue(queues=64, hand=8, qll=50, shares=100):
    return {"type": "Limited", "limited": {"nominalConcurrencyShares": shares, "limitResponse": {
        "type": "Queue", "queuing": {"queues": queues, "handSize": hand, "queueLengthLimit": qll}}}}  # fmt: skip


def errors_of(doc):
    obj, errs = parse_object(copy.deepcopy(doc), "x.yaml")
    assert (obj is None) == bool(errs)
    name = doc["metadata"]["name"]
    prefix = f'x.yaml: {doc["kind"]} "{name}": ' if name else f"x.yaml: {doc['kind']}: "
    out = []
    for e in errs:
        text = str(e)
        assert text.startswith(prefix), text
        out.append(text[len(prefix) :])
    return sorted(out)


RR0 = "spec.rules[0].resourceRules[0]"
NR0 = "spec.rules[0].nonResourceRules[0]"
S0 = "spec.rules[0].subjects[0]"

FLOW_SCHEMA_CASES = [
    ("valid", fs(), []),
    ("missing both rule kinds", fs(rule()),
     ["spec.rules[0]: Required value: at least one of resourceRules and nonResourceRules has to be non-empty"]),
    ("no subjects", fs({"rules": [{"subjects": [], "nonResourceRules": [ALL_NR]}]}),
     ["spec.rules[0].subjects: Required value: subjects must contain at least one value"]),
    ("ServiceAccount union malformed",
     fs({"rules": [{"subjects": [{"kind": "ServiceAccount", "user": {"name": "fred"}, "group": {"name": "fred"}}],
                    "nonResourceRules": [ALL_NR]}]}),
     [f"{S0}.group: Forbidden: group is forbidden when subject kind is not 'Group'",
      f"{S0}.serviceAccount: Required value: serviceAccount is required when subject kind is 'ServiceAccount'",
      f"{S0}.user: Forbidden: user is forbidden when subject kind is not 'User'"]),
    ("User union malformed",
     fs({"rules": [{"subjects": [{"kind": "User", "group": {"name": "fred"},
                                  "serviceAccount": {"namespace": "s", "name": "n"}}],
                    "nonResourceRules": [ALL_NR]}]}),
     [f"{S0}.group: Forbidden: group is forbidden when subject kind is not 'Group'",
      f"{S0}.serviceAccount: Forbidden: serviceAccount is forbidden when subject kind is not 'ServiceAccount'",
      f"{S0}.user: Required value: user is required when subject kind is 'User'"]),
    ("Group union malformed",
     fs({"rules": [{"subjects": [{"kind": "Group", "user": {"name": "fred"},
                                  "serviceAccount": {"namespace": "s", "name": "n"}}],
                    "nonResourceRules": [ALL_NR]}]}),
     [f"{S0}.group: Required value: group is required when subject kind is 'Group'",
      f"{S0}.serviceAccount: Forbidden: serviceAccount is forbidden when subject kind is not 'ServiceAccount'",
      f"{S0}.user: Forbidden: user is forbidden when subject kind is not 'User'"]),
    ("empty user name", fs({"rules": [{"subjects": [{"kind": "User", "user": {"name": ""}}],
                                       "nonResourceRules": [ALL_NR]}]}),
     [f"{S0}.user.name: Required value"]),
    ("invalid subject kind", fs({"rules": [{"subjects": [{"kind": "FooKind"}], "nonResourceRules": [ALL_NR]}]}),
     [f'{S0}.kind: Unsupported value: "FooKind": supported values: "Group", "ServiceAccount", "User"']),
    ("missing subject kind", fs({"rules": [{"subjects": [{}], "nonResourceRules": [ALL_NR]}]}),
     [f'{S0}.kind: Unsupported value: "": supported values: "Group", "ServiceAccount", "User"']),
    ("SA missing namespace",
     fs({"rules": [{"subjects": [{"kind": "ServiceAccount", "serviceAccount": {"name": "noxu"}}],
                    "resourceRules": [ALL_RR]}]}),
     [f"{S0}.serviceAccount.namespace: Required value: must specify namespace for service account"]),
    ("SA bad names",
     fs({"rules": [{"subjects": [{"kind": "ServiceAccount", "serviceAccount": {"name": "No_Good", "namespace": "a.b"}}],
                    "resourceRules": [ALL_RR]}]}),
     [f'{S0}.serviceAccount.name: Invalid value: "No_Good": {SUBDOMAIN_MSG}',
      f'{S0}.serviceAccount.namespace: Invalid value: "a.b": {LABEL_MSG}']),
    ("SA wildcard name", fs({"rules": [{"subjects": [{"kind": "ServiceAccount",
                                                      "serviceAccount": {"name": "*", "namespace": "kube-system"}}],
                                        "resourceRules": [ALL_RR]}]}), []),
    ("exempt schema valid", mandatory_manifests()[2], []),
    ("catch-all schema valid", mandatory_manifests()[3], []),
    ("bad exempt schema (URL / instead of *)",
     fs({"matchingPrecedence": 1, "priorityLevelConfiguration": {"name": "exempt"},
         "rules": [{"subjects": [{"kind": "Group", "group": {"name": "system:masters"}}],
                    "resourceRules": [{**ALL_RR, "clusterScope": True}],
                    "nonResourceRules": [{"verbs": ["*"], "nonResourceURLs": ["/"]}]}]}, name="exempt"),
     ["spec: Invalid value: {SPEC}: spec of 'exempt' must equal the fixed value"]),
    ("bad catch-all schema",
     fs({"matchingPrecedence": 10000, "priorityLevelConfiguration": {"name": "catch-all"}}, name="catch-all"),
     ["spec: Invalid value: {SPEC}: spec of 'catch-all' must equal the fixed value"]),
    ("precedence 1 for non-exempt",
     fs({"matchingPrecedence": 1, "priorityLevelConfiguration": {"name": "exempt"}}, name="fred"),
     ["spec.matchingPrecedence: Invalid value: 1: only the schema named 'exempt' may have matchingPrecedence 1"]),
    ("precedence > 10000", fs({"matchingPrecedence": 10001}),
     ["spec.matchingPrecedence: Invalid value: 10001: must not be greater than 10000"]),
    ("negative precedence", fs({"matchingPrecedence": -3}),
     ["spec.matchingPrecedence: Invalid value: -3: must be a positive value"]),
    ("zero precedence defaults to 1000", fs({"matchingPrecedence": 0}), []),
    ("mixed wildcards",
     fs(rule(resourceRules=[{"verbs": ["*", "create"], "apiGroups": ["*", "tak"],
                             "resources": ["*", "tok"], "namespaces": ["*"]}])),
     [f'{RR0}.apiGroups: Invalid value: []string{{"*", "tak"}}: if \'*\' is present, must not specify other api groups',
      f'{RR0}.resources: Invalid value: []string{{"*", "tok"}}: if \'*\' is present, must not specify other resources',
      f'{RR0}.verbs: Invalid value: []string{{"*", "create"}}: if \'*\' is present, must not specify other verbs']),
    ("mixed wildcard URLs", fs(rule(nonResourceRules=[{"verbs": ["*"], "nonResourceURLs": ["*", "tik"]}])),
     [f'{NR0}.nonResourceURLs: Invalid value: []string{{"*", "tik"}}: if \'*\' is present, must not specify other non-resource URLs']),
    ("invalid verb", fs(rule(resourceRules=[{**ALL_RR, "verbs": ["feed"]}])),
     [f'{RR0}.verbs: Unsupported value: []string{{"feed"}}: supported values: {VERBS}']),
    ("post is not a verb in non-resource rules either",
     fs(rule(nonResourceRules=[{"verbs": ["get", "post"], "nonResourceURLs": ["/x"]}])),
     [f'{NR0}.verbs: Unsupported value: []string{{"get", "post"}}: supported values: {VERBS}']),
    ("empty lists",
     fs(rule(resourceRules=[{"verbs": [], "apiGroups": [], "resources": [], "namespaces": []}],
             nonResourceRules=[{"verbs": [], "nonResourceURLs": []}])),
     [f"{NR0}.nonResourceURLs: Required value: nonResourceURLs must contain at least one value",
      f"{NR0}.verbs: Required value: verbs must contain at least one value",
      f"{RR0}.apiGroups: Required value: resource rules must supply at least one api group",
      f"{RR0}.namespaces: Required value: resource rules that are not cluster scoped must supply at least one namespace",
      f"{RR0}.resources: Required value: resource rules must supply at least one resource",
      f"{RR0}.verbs: Required value: verbs must contain at least one value"]),
    ("invalid priority level name", fs({"priorityLevelConfiguration": {"name": "system+++$$"}}),
     [f'spec.priorityLevelConfiguration.name: Invalid value: "system+++$$": {SUBDOMAIN_MSG}']),
    ("missing priority level name", fs({"priorityLevelConfiguration": {}}),
     ["spec.priorityLevelConfiguration.name: Required value: must reference a priority level"]),
    ("cluster scope without namespaces",
     fs(rule(resourceRules=[{"verbs": ["*"], "apiGroups": ["*"], "resources": ["*"], "clusterScope": True}])), []),
    ("namespace every mixed", fs(rule(resourceRules=[{**ALL_RR, "namespaces": ["foo", "*"]}])),
     [f'{RR0}.namespaces: Invalid value: []string{{"foo", "*"}}: if \'*\' is present, must not specify other namespaces']),
    ("namespace malformed", fs(rule(resourceRules=[{**ALL_RR, "namespaces": ["-foo"]}])),
     [f'{RR0}.namespaces[0]: Invalid value: "-foo": each member of this list must be \'*\' or a DNS-1123 label; {LABEL_MSG}']),
    ("unsupported distinguisher", fs({"distinguisherMethod": {"type": "ByFoo"}}),
     ['spec.distinguisherMethod.type: Unsupported value: "ByFoo": supported values: "ByNamespace", "ByUser"']),
    ("bad object name", fs(name="Foo_Bar"), [f'metadata.name: Invalid value: "Foo_Bar": {SUBDOMAIN_MSG}']),
    ("missing object name", fs(name=""), ["metadata.name: Required value: name or generateName is required"]),
    ("namespaced object", fs(metadata={"name": "system-foo", "namespace": "default"}),
     ["metadata.namespace: Forbidden: not allowed on this type"]),
    ("status conditions", fs(status={"conditions": [{"type": "Dangling"}, {"type": "Dangling"}, {"type": ""}]}),
     ['status.conditions[1].type: Duplicate value: "Dangling"',
      "status.conditions[2].type: Required value: must not be empty"]),
    ("bad URLs", fs(rule(nonResourceRules=[{"verbs": ["get"], "nonResourceURLs": [
        "", "healthz", "/a b", "//x", "/health*", "/healthz/*/foo", "/*/*", "/healthz/*", "/", "/apis/"]}])),
     [f'{NR0}.nonResourceURLs[0]: Invalid value: "": must not be empty',
      f'{NR0}.nonResourceURLs[1]: Invalid value: "healthz": must start with slash',
      f'{NR0}.nonResourceURLs[2]: Invalid value: "/a b": must not contain white-space',
      f'{NR0}.nonResourceURLs[3]: Invalid value: "//x": must not contain double slash',
      f'{NR0}.nonResourceURLs[4]: Invalid value: "/health*": wildcard can only do suffix matching',
      f'{NR0}.nonResourceURLs[5]: Invalid value: "/healthz/*/foo": wildcard can only do suffix matching',
      f'{NR0}.nonResourceURLs[6]: Invalid value: "/*/*": wildcard can only do suffix matching']),
]  # fmt: skip


@pytest.mark.parametrize(
    "name, doc, expected", FLOW_SCHEMA_CASES, ids=[c[0] for c in FLOW_SCHEMA_CASES]
)
def test_flow_schema_validation(name, doc, expected):
    got = errors_of(doc)
    if expected and "{SPEC}" in expected[0]:
        # The whole spec is echoed as the bad value; only its position and the detail matter.
        assert len(got) == 1 and got[0].startswith("spec: Invalid value: {")
        assert got[0].endswith(expected[0].split("{SPEC}")[1])
        return
    assert got == sorted(expected)


PL_CASES = [
    ("exempt valid", pl({"type": "Exempt", "exempt": {"nominalConcurrencyShares": 0, "lendablePercent": 0}},
                        name="exempt"), []),
    ("exempt may tune spec.exempt",
     pl({"type": "Exempt", "exempt": {"nominalConcurrencyShares": 10, "lendablePercent": 10}}, name="exempt"), []),
    ("wrong exempt spec",
     pl({"type": "Limited", "limited": {"nominalConcurrencyShares": 42, "limitResponse": {"type": "Reject"}}},
        name="exempt"),
     ['spec.type: Invalid value: "Limited": type must be \'Exempt\' if and only if name is \'exempt\'',
      "spec: {SPEC}: spec of 'exempt' except the 'spec.exempt' field must equal the fixed value"]),
    ("exempt values out of range",
     pl({"type": "Exempt", "exempt": {"nominalConcurrencyShares": -1, "lendablePercent": 101}}, name="exempt"),
     ["spec.exempt.lendablePercent: Invalid value: 101: must be between 0 and 100, inclusive",
      "spec.exempt.nominalConcurrencyShares: Invalid value: -1: must be a non-negative integer"]),
    ("exempt repurposed",
     pl({"type": "Limited", "exempt": {},
         "limited": {"nominalConcurrencyShares": 42, "limitResponse": {"type": "Reject"}}}, name="exempt"),
     ["spec.exempt: Forbidden: must be nil if the type is Limited",
      'spec.type: Invalid value: "Limited": type must be \'Exempt\' if and only if name is \'exempt\'',
      "spec: {SPEC}: spec of 'exempt' except the 'spec.exempt' field must equal the fixed value"]),
    ("exempt with limited",
     pl({"type": "Exempt", "exempt": {},
         "limited": {"nominalConcurrencyShares": 42, "limitResponse": {"type": "Reject"}}}, name="exempt"),
     ["spec.limited: Forbidden: must be nil if the type is not Limited",
      "spec: {SPEC}: spec of 'exempt' except the 'spec.exempt' field must equal the fixed value"]),
    ("limited with exempt", pl({"type": "Limited", "exempt": {}}, name="broken-limited"),
     ["spec.exempt: Forbidden: must be nil if the type is Limited",
      "spec.limited: Required value: must not be empty when type is Limited"]),
    ("limited requires details", pl({"type": "Limited"}, name="broken-limited"),
     ["spec.limited: Required value: must not be empty when type is Limited"]),
    ("non-exempt name with Exempt type", pl({"type": "Exempt", "exempt": {}}, name="fred"),
     ['spec.type: Invalid value: "Exempt": type must be \'Exempt\' if and only if name is \'exempt\'']),
    ("unknown type", pl({"type": "Unlimited"}),
     ['spec.type: Unsupported value: "Unlimited": supported values: "Exempt", "Limited"']),
    ("max-in-flight", pl({"type": "Limited", "limited": {"nominalConcurrencyShares": 42,
                                                          "limitResponse": {"type": "Reject"}}}), []),
    ("zero shares allowed (jail)", pl({"type": "Limited", "limited": {"nominalConcurrencyShares": 0,
                                                                       "limitResponse": {"type": "Reject"}}}), []),
    ("negative shares, percents",
     pl({"type": "Limited", "limited": {"nominalConcurrencyShares": -1, "lendablePercent": 101,
                                         "borrowingLimitPercent": -1, "limitResponse": {"type": "Reject"}}}),
     ["spec.limited.borrowingLimitPercent: Invalid value: -1: if specified, must be a non-negative integer",
      "spec.limited.lendablePercent: Invalid value: 101: must be between 0 and 100, inclusive",
      "spec.limited.nominalConcurrencyShares: Invalid value: -1: must be a non-negative integer"]),
    ("borrowing above 100 allowed",
     pl({"type": "Limited", "limited": {"borrowingLimitPercent": 300, "limitResponse": {"type": "Reject"}}}), []),
    ("queuing with Reject",
     pl({"type": "Limited", "limited": {"nominalConcurrencyShares": 100, "limitResponse": {
         "type": "Reject", "queuing": {"queues": 512, "handSize": 4, "queueLengthLimit": 100}}}}),
     ["spec.limited.limitResponse.queuing: Forbidden: must be nil if limited.limitResponse.type is not Limited"]),
    ("Queue without queuing",
     pl({"type": "Limited", "limited": {"nominalConcurrencyShares": 100, "limitResponse": {"type": "Queue"}}}),
     ["spec.limited.limitResponse.queuing: Required value: must not be empty if limited.limitResponse.type is Limited"]),
    ("unknown limit response",
     pl({"type": "Limited", "limited": {"limitResponse": {"type": "Drop"}}}),
     ['spec.limited.limitResponse.type: Unsupported value: "Drop": supported values: "Queue", "Reject"']),
    ("wrong catch-all spec",
     pl({"type": "Limited", "limited": {"nominalConcurrencyShares": 42, "limitResponse": {"type": "Reject"}}},
        name="catch-all"),
     ["spec: {SPEC}: spec of 'catch-all' must equal the fixed value"]),
    ("catch-all valid", pl({"type": "Limited", "limited": {"nominalConcurrencyShares": 5, "lendablePercent": 0,
                                                          "limitResponse": {"type": "Reject"}}}, name="catch-all"), []),
    ("normal queuing", pl(queue(512, 4, 100)), []),
    ("entropy 512x8", pl(queue(512, 8, 100)),
     ["spec.limited.limitResponse.queuing.handSize: Invalid value: 8: required entropy bits of deckSize 512 and handSize 8 should not be greater than 60"]),
    ("entropy 128x10", pl(queue(128, 10, 100)),
     ["spec.limited.limitResponse.queuing.handSize: Invalid value: 10: required entropy bits of deckSize 128 and handSize 10 should not be greater than 60"]),
    ("too many queues", pl(queue(2147483647, 3, 100)),
     ["spec.limited.limitResponse.queuing.handSize: Invalid value: 3: required entropy bits of deckSize 2147483647 and handSize 3 should not be greater than 60",
      "spec.limited.limitResponse.queuing.queues: Invalid value: 2147483647: must not be greater than 10000000"]),
    ("10^7 queues hand 2", pl(queue(10_000_000, 2, 100)), []),
    ("16 queues hand 15 (60 bits)", pl(queue(16, 15, 100)), []),
    ("hand greater than queues", pl(queue(7, 8, 100)),
     ["spec.limited.limitResponse.queuing.handSize: Invalid value: 8: should not be greater than queues (7)"]),
    ("negative queuing numbers", pl(queue(-1, -2, -3)),
     ["spec.limited.limitResponse.queuing.handSize: Invalid value: -2: must be positive",
      "spec.limited.limitResponse.queuing.queueLengthLimit: Invalid value: -3: must be positive",
      "spec.limited.limitResponse.queuing.queues: Invalid value: -1: must be positive"]),
    ("zero queuing numbers default", pl(queue(0, 0, 0)), []),
]  # fmt: skip


@pytest.mark.parametrize("name, doc, expected", PL_CASES, ids=[c[0] for c in PL_CASES])
def test_priority_level_validation(name, doc, expected):
    got = errors_of(doc)
    spec_expected = [e for e in expected if e.startswith("spec: {SPEC}")]
    plain_expected = sorted(e for e in expected if not e.startswith("spec: {SPEC}"))
    spec_got = [g for g in got if g.startswith("spec: Invalid value: {")]
    assert sorted(g for g in got if g not in spec_got) == plain_expected
    assert len(spec_got) == len(spec_expected)
    for g, e in zip(spec_got, spec_expected, strict=True):
        assert g.endswith(e.split("{SPEC}")[1])


TYPE_CASES = [
    ("string for int", fs({"matchingPrecedence": "high"}),
     ['spec.matchingPrecedence: Invalid value: "high": must be an integer']),
    ("bool for int", fs({"matchingPrecedence": True}),
     ["spec.matchingPrecedence: Invalid value: true: must be an integer"]),
    ("float for int", fs({"matchingPrecedence": 1.5}),
     ["spec.matchingPrecedence: Invalid value: 1.5: must be an integer"]),
    ("int32 overflow", fs({"matchingPrecedence": 2**40}),
     ["spec.matchingPrecedence: Invalid value: 1099511627776: must fit in a 32-bit signed integer"]),
    ("list for map", fs({"priorityLevelConfiguration": ["a"]}),
     ['spec.priorityLevelConfiguration: Invalid value: []string{"a"}: must be a map']),
    ("string for list", fs(rule(resourceRules=[{**ALL_RR, "verbs": "get"}])),
     [f'{RR0}.verbs: Invalid value: "get": must be a list']),
    ("int in string list", fs(rule(resourceRules=[{**ALL_RR, "apiGroups": [1]}])),
     [f"{RR0}.apiGroups[0]: Invalid value: 1: must be a string"]),
    ("string for bool", fs(rule(resourceRules=[{**ALL_RR, "clusterScope": "yes"}])),
     [f'{RR0}.clusterScope: Invalid value: "yes": must be a boolean']),
    ("spec not a map", fs(spec=None) | {"spec": "oops"}, ['spec: Invalid value: "oops": must be a map']),
    ("unknown spec field", fs({"matchingPrecidence": 5}), ["spec.matchingPrecidence: unknown field; did you mean matchingPrecedence?"]),
    ("unknown top-level field", fs(specs={}), ["specs: unknown field; did you mean spec?"]),
    ("misspelt queuing field: the closest is suggested",
     pl({"type": "Limited", "limited": {"limitResponse": {"type": "Queue", "queuing": {
         "queues": 64, "handSize": 8, "queueLenghtLimit": 50}}}}),
     ["spec.limited.limitResponse.queuing.queueLenghtLimit: unknown field; did you mean "
      "queueLengthLimit?"]),
    ("unknown field like no known one: no suggestion", fs({"xyzzy": 1}),
     ["spec.xyzzy: unknown field"]),
    ("string shares", pl({"type": "Limited", "limited": {"nominalConcurrencyShares": "10",
                                                          "limitResponse": {"type": "Reject"}}}),
     ['spec.limited.nominalConcurrencyShares: Invalid value: "10": must be an integer']),
    ("unsupported apiVersion", pl({"type": "Limited", "limited": {"limitResponse": {"type": "Reject"}}},
                                  api="flowcontrol.apiserver.k8s.io/v1beta2"),
     ['apiVersion: Unsupported value: "flowcontrol.apiserver.k8s.io/v1beta2": supported values: '
      '"flowcontrol.apiserver.k8s.io/v1", "flowcontrol.apiserver.k8s.io/v1beta3"']),
    ("missing apiVersion", pl({"type": "Limited", "limited": {"limitResponse": {"type": "Reject"}}}, api=None),
     ["apiVersion: Required value: must be flowcontrol.apiserver.k8s.io/v1"]),
    ("uid with a line break", {**pl({"type": "Limited", "limited": {"limitResponse": {"type": "Reject"}}}),
                               "metadata": {"name": "system-foo", "uid": "u1\r\nX-Evil: 1"}},
     ['metadata.uid: Invalid value: "u1\\r\\nX-Evil: 1": must be visible ASCII characters (no '
      'spaces or control characters), at most 128']),
    ("uid with a space", {**fs(), "metadata": {"name": "system-foo", "uid": "a b"}},
     ['metadata.uid: Invalid value: "a b": must be visible ASCII characters (no spaces or control '
      'characters), at most 128']),
]  # fmt: skip


@pytest.mark.parametrize("name, doc, expected", TYPE_CASES, ids=[c[0] for c in TYPE_CASES])
def test_wrong_types_are_errors_not_crashes(name, doc, expected):
    assert errors_of(doc) == sorted(expected)


ALL_AT_ONCE_CASES = [
    ("unknown field next to bad values",
     fs({"matchingPrecidence": 5, "matchingPrecedence": 20000,
         "distinguisherMethod": {"type": "ByIP"}}),
     ["spec.matchingPrecidence: unknown field; did you mean matchingPrecedence?",
      "spec.matchingPrecedence: Invalid value: 20000: must not be greater than 10000",
      'spec.distinguisherMethod.type: Unsupported value: "ByIP": supported values: '
      '"ByNamespace", "ByUser"']),
    ("misspelt spec: the missing spec is reported too", fs(specs={}) | {"spec": None},
     ["specs: unknown field; did you mean spec?",
      "spec.priorityLevelConfiguration.name: Required value: must reference a priority level"]),
    ("unknown field and a bad queuing", pl({**queue(queues=512, hand=8), "limted": {}}),
     ["spec.limted: unknown field; did you mean limited?",
      "spec.limited.limitResponse.queuing.handSize: Invalid value: 8: required entropy bits of "
      "deckSize 512 and handSize 8 should not be greater than 60"]),
    # a wrong type is not echoed by the checks of its zero value, but other fields still count
    ("wrong type next to a bad value",
     fs({"priorityLevelConfiguration": ["a"], "matchingPrecedence": -3}),
     ['spec.priorityLevelConfiguration: Invalid value: []string{"a"}: must be a map',
      "spec.matchingPrecedence: Invalid value: -3: must be a positive value"]),
]  # fmt: skip


@pytest.mark.parametrize("name, doc, expected", ALL_AT_ONCE_CASES,
                         ids=[c[0] for c in ALL_AT_ONCE_CASES])
def test_every_error_of_an_object_is_reported_at_once(name, doc, expected):
    assert errors_of(doc) == sorted(expected)


def test_unknown_kind():
    obj, errs = parse_object(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}, "f.yaml"
    )
    assert obj is None
    assert [str(e) for e in errs] == [
        'f.yaml: ConfigMap "x": kind: Unsupported value: "ConfigMap": supported values: '
        '"FlowSchema", "PriorityLevelConfiguration", "List", "FlowSchemaList", '
        '"PriorityLevelConfigurationList"'
    ]


def test_error_str_and_errors_str():
    e = ConfigError("config/x.yaml", "FlowSchema", "foo", "spec.matchingPrecedence",
                    "Invalid value: 0: must be a positive value")  # fmt: skip
    assert str(e) == (
        'config/x.yaml: FlowSchema "foo": spec.matchingPrecedence: Invalid value: 0: '
        "must be a positive value"
    )
    assert str(ConfigError("f.yaml", "", "", "", "invalid YAML")) == "f.yaml: invalid YAML"
    both = ConfigErrors([e, e])
    assert str(both) == f"{e}\n{e}" and isinstance(both, Exception) and len(both.errors) == 2


@pytest.mark.parametrize(
    "path, ok",
    [("/healthz/*", True), ("/health*", False), ("/healthz/*/foo", False), ("/*/*", False),
     ("/apis/", True), ("/", True), ("/*", True), ("*", False)],
)  # fmt: skip
def test_non_resource_url_examples(path, ok):
    assert (non_resource_url_error(path) is None) == ok


def test_defaulting_applied_before_conversion():
    obj, errs = parse_object(fs({"matchingPrecedence": 0}), "f")
    assert not errs and obj.obj.matching_precedence == 1000
    obj, _ = parse_object(pl({"type": "Limited", "limited": {"limitResponse": {
        "type": "Queue", "queuing": {}}}}), "f")  # fmt: skip
    level = obj.obj
    assert (
        level.nominal_concurrency_shares,
        level.lendable_percent,
        level.borrowing_limit_percent,
    ) == (30, 0, None)
    assert (level.queuing.queues, level.queuing.hand_size, level.queuing.queue_length_limit) == (
        64,
        8,
        50,
    )
    obj, _ = parse_object(pl({"type": "Exempt", "exempt": {}}, name="exempt"), "f")
    assert (obj.obj.nominal_concurrency_shares, obj.obj.lendable_percent) == (0, 0)
    assert obj.broken is None


def test_v1beta3_zero_shares_default_to_30_unless_preserved():
    spec = {
        "type": "Limited",
        "limited": {"nominalConcurrencyShares": 0, "limitResponse": {"type": "Reject"}},
    }
    v1 = parse_object(pl(spec), "f")[0].obj
    beta = parse_object(pl(spec, api="flowcontrol.apiserver.k8s.io/v1beta3"), "f")[0].obj
    meta = {"name": "system-foo", "annotations": {V1BETA3_PRESERVE_ZERO: ""}}
    kept = parse_object(pl(spec, api="flowcontrol.apiserver.k8s.io/v1beta3", metadata=meta), "f")[
        0
    ].obj
    assert (
        v1.nominal_concurrency_shares,
        beta.nominal_concurrency_shares,
        kept.nominal_concurrency_shares,
    ) == (0, 30, 0)


def test_exempt_without_exempt_struct_is_valid_but_broken():
    obj, errs = parse_object(pl({"type": "Exempt"}, name="exempt"), "f")
    assert errs == []
    assert obj.broken == "broken union structure at the top, for Exempt"


# --------------------------------------------------------------------------------------------
# Robustness: any YAML-shaped input yields errors, never an exception.


_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
)
_JSONISH = st.recursive(
    _SCALARS,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=10,
)  # fmt: skip


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*prefix, i))


def _replace(value, path, new):
    if not path:
        return new
    value = copy.deepcopy(value)
    target = value
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = new
    return value


_VALID = [
    fs(),
    mandatory_manifests()[3],
    pl(queue(128, 6, 50)),
    pl(
        {
            "type": "Limited",
            "limited": {
                "borrowingLimitPercent": 5,
                "lendablePercent": 3,
                "limitResponse": {"type": "Reject"},
            },
        }
    ),  # fmt: skip
    mandatory_manifests()[0],
]
_MUTATIONS = [(i, p) for i, doc in enumerate(_VALID) for p in _paths(doc)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(_MUTATIONS), _JSONISH)
def test_mutated_manifests_never_crash(mutation, new_value):
    index, path = mutation
    doc = _replace(_VALID[index], path, new_value)
    if not isinstance(doc, dict):
        return
    obj, errs = parse_object(doc, "h.yaml")
    assert (obj is None) == bool(errs)
    for e in errs:  # every error names the file and says what is wrong
        assert str(e).startswith("h.yaml: ") and len(str(e)) > len("h.yaml: ")


@settings(max_examples=200, deadline=None)
@given(_JSONISH)
def test_arbitrary_documents_never_crash(value):
    for doc in (value, {"kind": "List", "items": value}, {"kind": value, "metadata": value}):
        objs, errs = load_text(yaml.safe_dump(doc), "h.yaml")
        assert all(str(e).startswith("h.yaml: ") and len(str(e)) > len("h.yaml: ")
                   for e in errs)


# -- apf-gunicorn.io/fairness: a priority level's fairness -----------------------------------

FAIRNESS_KEY = "metadata.annotations[apf-gunicorn.io/fairness]"


def annotated(doc, annotations):
    doc = copy.deepcopy(doc)
    doc["metadata"]["annotations"] = annotations
    return doc


@pytest.mark.parametrize("value", ["maxmin", "kubernetes"])
def test_fairness_annotation_sets_the_level_fairness(value):
    obj, errs = parse_object(annotated(pl(queue()), {"apf-gunicorn.io/fairness": value}), "f")
    assert errs == [] and obj.obj.fairness == value
    reject = {"type": "Limited", "limited": {"limitResponse": {"type": "Reject"}}}
    obj, errs = parse_object(annotated(pl(reject), {"apf-gunicorn.io/fairness": value}), "f")
    assert errs == [] and obj.obj.fairness == value


def test_without_the_annotation_the_level_follows_the_server():
    obj, errs = parse_object(annotated(pl(queue()), {"other.io/x": "1", "note": 3}), "f")
    assert errs == [] and obj.obj.fairness is None


FAIRNESS_CASES = [
    ("unknown fairness", pl(queue()), {"apf-gunicorn.io/fairness": "fair"},
     [f'{FAIRNESS_KEY}: Unsupported value: "fair": supported values: "kubernetes", "maxmin"']),
    ("case matters", pl(queue()), {"apf-gunicorn.io/fairness": "MaxMin"},
     [f'{FAIRNESS_KEY}: Unsupported value: "MaxMin": supported values: "kubernetes", "maxmin"']),
    ("not a string", pl(queue()), {"apf-gunicorn.io/fairness": 1},
     [f"{FAIRNESS_KEY}: Invalid value: 1: must be a string"]),
    ("exempt level", pl({"type": "Exempt", "exempt": {}}, name="exempt"),
     {"apf-gunicorn.io/fairness": "maxmin"},
     [f"{FAIRNESS_KEY}: Forbidden: an exempt priority level never queues, so it has no "
      "fairness"]),
    ("on a FlowSchema", fs(), {"apf-gunicorn.io/fairness": "maxmin"},
     [f"{FAIRNESS_KEY}: Forbidden: fairness is chosen per priority level: annotate "
      "the PriorityLevelConfiguration"]),
    ("misspelt key", pl(queue()), {"apf-gunicorn.io/fairnes": "maxmin"},
     ["metadata.annotations[apf-gunicorn.io/fairnes]: unknown annotation (known: "
      "apf-gunicorn.io/fairness, apf-gunicorn.io/max-seats)"]),
]  # fmt: skip


@pytest.mark.parametrize("name, doc, annotations, expected", FAIRNESS_CASES,
                         ids=[c[0] for c in FAIRNESS_CASES])
def test_fairness_annotation_errors_name_file_object_and_field(name, doc, annotations, expected):
    assert errors_of(annotated(doc, annotations)) == expected


def test_fairness_annotation_error_in_a_file(tmp_path):
    """The loader's text names the file, the object and the annotation."""
    text = yaml.safe_dump(annotated(pl(queue(), name="tenants"),
                                    {"apf-gunicorn.io/fairness": "fifo"}))
    _objs, errs = load_text(text, "config/tenants.yaml")
    assert [str(e) for e in errs] == [
        'config/tenants.yaml: PriorityLevelConfiguration "tenants": '
        f'{FAIRNESS_KEY}: Unsupported value: "fifo": supported values: "kubernetes", "maxmin"']


def test_a_misspelt_field_in_a_file_gets_the_closest_known_field():
    """As a misspelt APF_* variable gets "did you mean": the line names file, object, field."""
    doc = pl(queue(), name="tenants")
    queuing = doc["spec"]["limited"]["limitResponse"]["queuing"]
    queuing["queueLenghtLimit"] = queuing.pop("queueLengthLimit")
    _objs, errs = load_text(yaml.safe_dump(doc), "config/tenants.yaml")
    assert [str(e) for e in errs] == [
        'config/tenants.yaml: PriorityLevelConfiguration "tenants": '
        "spec.limited.limitResponse.queuing.queueLenghtLimit: unknown field; did you mean "
        "queueLengthLimit?"]


# -- apf-gunicorn.io/max-seats: a priority level's widest request ----------------------------

MAX_SEATS_KEY = "metadata.annotations[apf-gunicorn.io/max-seats]"


def test_max_seats_annotation_sets_the_level_max_seats():
    obj, errs = parse_object(annotated(pl(queue()), {"apf-gunicorn.io/max-seats": "4"}), "f")
    assert errs == [] and obj.obj.max_seats == 4
    reject = {"type": "Limited", "limited": {"limitResponse": {"type": "Reject"}}}
    obj, errs = parse_object(annotated(pl(reject), {"apf-gunicorn.io/max-seats": " 12 "}), "f")
    assert errs == [] and obj.obj.max_seats == 12
    obj, errs = parse_object(pl(queue()), "f")
    assert errs == [] and obj.obj.max_seats is None


MAX_SEATS_CASES = [
    ("zero", pl(queue()), {"apf-gunicorn.io/max-seats": "0"},
     [f'{MAX_SEATS_KEY}: Invalid value: "0": must be a positive integer of seats, at most '
      '1000000 (e.g. "4")']),
    ("not a number", pl(queue()), {"apf-gunicorn.io/max-seats": "four"},
     [f'{MAX_SEATS_KEY}: Invalid value: "four": must be a positive integer of seats, at most '
      '1000000 (e.g. "4")']),
    ("negative", pl(queue()), {"apf-gunicorn.io/max-seats": "-2"},
     [f'{MAX_SEATS_KEY}: Invalid value: "-2": must be a positive integer of seats, at most '
      '1000000 (e.g. "4")']),
    ("unquoted", pl(queue()), {"apf-gunicorn.io/max-seats": 4},
     [f"{MAX_SEATS_KEY}: Invalid value: 4: must be a string"]),
    ("exempt level", pl({"type": "Exempt", "exempt": {}}, name="exempt"),
     {"apf-gunicorn.io/max-seats": "4"},
     [f"{MAX_SEATS_KEY}: Forbidden: an exempt priority level never queues, so it has no "
      "max seats"]),
    ("on a FlowSchema", fs(), {"apf-gunicorn.io/max-seats": "4"},
     [f"{MAX_SEATS_KEY}: Forbidden: the widest request (max seats) is chosen per priority "
      "level: annotate the PriorityLevelConfiguration"]),
]  # fmt: skip


@pytest.mark.parametrize("name, doc, annotations, expected", MAX_SEATS_CASES,
                         ids=[c[0] for c in MAX_SEATS_CASES])
def test_max_seats_annotation_errors_name_the_field(name, doc, annotations, expected):
    assert errors_of(annotated(doc, annotations)) == expected


def test_max_seats_annotation_error_in_a_file():
    """The loader's text names the file, the object and the annotation."""
    text = yaml.safe_dump(annotated(pl(queue(), name="tenants"),
                                    {"apf-gunicorn.io/max-seats": "1.5"}))
    _objs, errs = load_text(text, "config/tenants.yaml")
    assert [str(e) for e in errs] == [
        'config/tenants.yaml: PriorityLevelConfiguration "tenants": '
        f'{MAX_SEATS_KEY}: Invalid value: "1.5": must be a positive integer of seats, at most '
        '1000000 (e.g. "4")']
