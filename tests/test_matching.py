"""FlowSchema matching: ports of Kubernetes' match_test (TestLiterals), the URL-matching
consequences, and generated rules with requests that must / must not match (as gen_test does),
checked both on the plain definition and on the indexed Classifier."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apf_gunicorn.flowcontrol.matching import (
    Classifier,
    flow_schema_matches,
    hand,
    url_matches,
)
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

LEVELS = {
    "pl": PriorityLevel("pl", "Limited", 30, 0, None, "Queue", QueuingConfig(64, 8, 50)),
    "one-queue": PriorityLevel("one-queue", "Limited", 30, 0, None, "Queue", QueuingConfig(1, 1, 50)),
    "reject": PriorityLevel("reject", "Limited", 30, 0, None, "Reject", None),
    "catch-all": PriorityLevel("catch-all", "Limited", 5, 0, None, "Reject", None),
    "exempt": PriorityLevel("exempt", "Exempt", 0, 0),
}
NOTHING = FlowSchema("catch-all", "catch-all", 10000, "ByUser", ())


def config_of(*schemas: FlowSchema) -> SimpleNamespace:
    ordered = sorted([*schemas, NOTHING], key=lambda fs: (fs.matching_precedence, fs.name))
    return SimpleNamespace(flow_schemas=tuple(ordered), priority_levels=LEVELS)


def check(expected: bool, attrs: RequestAttributes, rules: tuple[PolicyRule, ...]) -> None:
    fs = FlowSchema("test", "pl", 500, "ByUser", rules)
    assert flow_schema_matches(fs, attrs) is expected
    got = Classifier(config_of(fs)).classify(attrs).flow_schema.name
    assert got == ("test" if expected else "catch-all")


# --- TestLiterals ---------------------------------------------------------------------------------

GROUPS = ("goodg1", "goodg2")
REQ_RN = RequestAttributes("goodu", GROUPS, "goodverb", "/apis/goodapig/v1/namespaces/goodns/goodrscs",
                           True, "goodapig", "v1", "goodrscs", "", "goodns", "eman")
REQ_RU = RequestAttributes("goodu", GROUPS, "goodverb", "/apis/goodapig/v1/goodrscs",
                           True, "goodapig", "v1", "goodrscs", "", "", "eman")
REQ_N = RequestAttributes("goodu", GROUPS, "goodverb", "/openapi/v2")


GOODU = Subject("User", "goodu")


def _rr(subject=GOODU, verbs=("goodverb",), groups=("goodapig",),
        resources=("goodrscs",), namespaces=("goodns",), cluster_scope=False):
    return (PolicyRule((subject,), (ResourceRule(verbs, groups, resources, cluster_scope,
                                                 namespaces),)),)


def _nr(subject=GOODU, verbs=("goodverb",), urls=("/openapi/v2",)):
    return (PolicyRule((subject,), (), (NonResourceRule(verbs, urls),)),)


LITERALS = [
    (True, REQ_RN, _rr()),
    (True, REQ_RN, _rr(subject=Subject("User", "*"))),
    (True, REQ_RN, _rr(subject=Subject("Group", "goodg1"))),
    (True, REQ_RN, _rr(subject=Subject("Group", "*"))),
    (True, REQ_RN, _rr(verbs=("*",))),
    (True, REQ_RN, _rr(groups=("*",))),
    (True, REQ_RN, _rr(resources=("*",))),
    (True, REQ_RN, _rr(namespaces=("*",))),
    (False, REQ_RN, _rr(subject=Subject("User", "badu"))),
    (False, REQ_RN, _rr(subject=Subject("Group", "badg"))),
    (False, REQ_RN, _rr(verbs=("badverb",))),
    (False, REQ_RN, _rr(groups=("badapig",))),
    (False, REQ_RN, _rr(resources=("badrscs",))),
    (False, REQ_RN, _rr(namespaces=("badns",))),
    # a wildcard counts only as the sole element
    (False, REQ_RN, _rr(verbs=("*", "badverb"))),
    (False, REQ_RN, _rr(namespaces=("badns", "*"))),
    # requests without a namespace: clusterScope alone decides
    (True, REQ_RU, _rr(namespaces=(), cluster_scope=True)),
    (True, REQ_RU, _rr(subject=Subject("User", "*"), verbs=("*",), groups=("*",),
                       resources=("*",), namespaces=("*",), cluster_scope=True)),
    (False, REQ_RU, _rr(cluster_scope=False)),
    (False, REQ_RU, _rr(namespaces=("*",), cluster_scope=False)),
    (True, REQ_RN, _rr(namespaces=("goodns",), cluster_scope=True)),
    (True, REQ_N, _nr()),
    (True, REQ_N, _nr(verbs=("*",))),
    (True, REQ_N, _nr(urls=("*",))),
    (False, REQ_N, _nr(verbs=("badverb",))),
    (False, REQ_N, _nr(urls=("/closedapi/v2",))),
    # resource rules never match non-resource requests and the other way round
    (False, REQ_N, _rr(verbs=("*",), groups=("*",), resources=("*",), namespaces=("*",),
                       cluster_scope=True)),
    (False, REQ_RN, _nr(verbs=("*",), urls=("*",))),
]


@pytest.mark.parametrize("expected, attrs, rules", LITERALS)
def test_literals(expected, attrs, rules):
    check(expected, attrs, rules)


def test_subresource_matching():
    attrs = RequestAttributes("goodu", GROUPS, "update", "/", True, "", "v1", "nodes", "status",
                              "", "n1")
    check(True, attrs, _rr(verbs=("*",), groups=("",), resources=("nodes/status",),
                           cluster_scope=True))
    check(False, attrs, _rr(verbs=("*",), groups=("",), resources=("nodes",), cluster_scope=True))


@pytest.mark.parametrize("user, namespace, name, expected", [
    ("system:serviceaccount:ns1:sa1", "ns1", "sa1", True),
    ("system:serviceaccount:ns1:sa1", "ns1", "*", True),
    ("system:serviceaccount:ns1:sa1", "ns1x", "*", False),
    ("system:serviceaccount:ns1x:sa1", "ns1", "*", False),
    ("system:serviceaccount:ns1:sa1x", "ns1", "sa1", False),
    ("system:serviceaccount:ns1", "ns1", "*", False),
    ("system:serviceaccounts:ns1:sa1", "ns1", "*", False),
])
def test_service_account_subjects(user, namespace, name, expected):
    attrs = RequestAttributes(user, (), "goodverb", "/openapi/v2")
    check(expected, attrs, _nr(subject=Subject("ServiceAccount", name, namespace)))


def test_group_wildcard_matches_users_without_groups():
    check(True, RequestAttributes("u", (), "goodverb", "/openapi/v2"), _nr(subject=Subject("Group", "*")))


# --- URL matching (k8s-apf-config.md §2.2) ---------------------------------------------------------

@pytest.mark.parametrize("urls, path, expected", [
    (("/healthz",), "/healthz", True),
    (("/healthz",), "/healthz/etcd", True),
    (("/healthz",), "/healthzx", False),
    (("/healthz/*",), "/healthz/etcd", True),
    (("/healthz/*",), "/healthz/a/b", True),
    (("/healthz/*",), "/healthz", False),
    (("/",), "/anything/at/all", True),
    (("/",), "/", True),
    (("/hea",), "/healthz", False),
    (("/hea",), "/healthz/x", False),
    (("*",), "/whatever", True),
    (("*",), "", True),
    (("/apis/",), "/apis/foo", True),
    (("/apis/",), "/apis", False),
    (("/a", "/b/*"), "/b/c", True),
    (("/a", "/b/*"), "/c", False),
])
def test_url_matching(urls, path, expected):
    assert url_matches(urls, path) is expected
    check(expected, RequestAttributes("goodu", GROUPS, "get", path),
          _nr(verbs=("get",), urls=urls))


# --- distinguisher and hash only for queuing levels with more than one queue ----------------------

@pytest.mark.parametrize("level, expect_flow", [("pl", True), ("one-queue", False),
                                                 ("reject", False), ("exempt", False)])
def test_distinguisher_only_when_queuing(level, expect_flow):
    fs = FlowSchema("test", level, 500, "ByNamespace", _rr(subject=Subject("User", "*"),
                                                           verbs=("*",), namespaces=("*",)))
    c = Classifier(config_of(fs)).classify(REQ_RN)
    assert c.flow_schema.name == "test"
    if expect_flow:
        assert c.distinguisher == "goodns" and c.flow_hash != 0 and len(hand(c)) == 8
    else:
        assert (c.distinguisher, c.flow_hash) == ("", 0)
        assert hand(c) == ((0,) if level == "one-queue" else ())


def test_no_distinguisher_method_hashes_empty_string():
    fs = FlowSchema("test", "pl", 500, None, _nr(subject=Subject("User", "*"), urls=("*",)))
    c = Classifier(config_of(fs)).classify(REQ_N)
    assert c.distinguisher == ""
    assert c.flow_hash == flow_hash("test", "")


def test_candidate_cache_does_not_leak_between_users():
    fs = FlowSchema("test", "pl", 500, "ByUser", _nr(subject=Subject("Group", "g")))
    classifier = Classifier(config_of(fs))
    a = RequestAttributes("u", ("g",), "goodverb", "/openapi/v2")
    b = RequestAttributes("u", ("h",), "goodverb", "/openapi/v2")
    assert classifier.classify(a).flow_schema.name == "test"
    assert classifier.classify(b).flow_schema.name == "catch-all"
    assert classifier.classify(a).flow_schema.name == "test"


# --- generated rules (as Kubernetes' gen_test) ---------------------------------------------------
# Names are drawn from "abc"; non-matching values carry an "x" or "z", which no generated name
# contains, so they cannot match anything but a wildcard.

NAMES = st.text(alphabet="abc", min_size=1, max_size=3)
VERBS = ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection", "proxy"]


def _wild_or(values_strategy):
    return st.one_of(st.just(("*",)), st.lists(values_strategy, min_size=1, max_size=3,
                                               unique=True).map(tuple))


@st.composite
def subjects_and_identities(draw):
    """(subjects, matching identities, whether a non-matching identity exists)."""
    subjects, matching = [], []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["User", "Group", "ServiceAccount"]))
        wild = draw(st.booleans()) and draw(st.booleans())  # 1 in 4
        name = "*" if wild else draw(NAMES)
        if kind == "User":
            subjects.append(Subject("User", name))
            matching.append(("u" + draw(NAMES) if wild else name, ()))
        elif kind == "Group":
            subjects.append(Subject("Group", name))
            matching.append(("someone", () if wild else ("other", name)))
        else:
            ns = draw(NAMES)
            subjects.append(Subject("ServiceAccount", name, ns))
            sa = draw(NAMES) if wild else name
            matching.append((f"system:serviceaccount:{ns}:{sa}", ("system:serviceaccounts",)))
    non_matching_possible = not any(s.kind in ("User", "Group") and s.name == "*" for s in subjects)
    return tuple(subjects), matching, non_matching_possible


def _resources():
    return st.one_of(NAMES, st.tuples(NAMES, NAMES).map("/".join))


@st.composite
def resource_rules(draw):
    cluster_scope = draw(st.booleans())
    namespaces = draw(st.one_of(st.just(("*",)), st.lists(NAMES, min_size=0 if cluster_scope else 1,
                                                          max_size=3, unique=True).map(tuple)))
    return ResourceRule(
        verbs=draw(_wild_or(st.sampled_from(VERBS))),
        api_groups=draw(_wild_or(st.one_of(st.just(""), NAMES))),
        resources=draw(_wild_or(_resources())),
        cluster_scope=cluster_scope,
        namespaces=namespaces,
    )


def _url():
    seg = st.lists(NAMES, min_size=1, max_size=3).map(lambda s: "/" + "/".join(s))
    return st.one_of(seg, seg.map(lambda u: u + "/*"), st.just("/"))


@st.composite
def non_resource_rules(draw):
    return NonResourceRule(verbs=draw(_wild_or(st.sampled_from(VERBS))),
                           non_resource_urls=draw(_wild_or(_url())))


@st.composite
def generated(draw):
    """A PolicyRule, requests it must match and requests it must not match."""
    subjects, identities, can_miss_subject = draw(subjects_and_identities())
    rrules = tuple(draw(st.lists(resource_rules(), max_size=3)))
    nrules = tuple(draw(st.lists(non_resource_rules(), min_size=0 if rrules else 1, max_size=3)))
    rule = PolicyRule(subjects, rrules, nrules)
    user, groups = draw(st.sampled_from(identities))
    must, must_not = [], []

    for rr in rrules:
        def pick(values, fresh, rr=rr):
            return fresh if values == ("*",) else draw(st.sampled_from(values))
        verb = pick(rr.verbs, draw(st.sampled_from(VERBS)))
        group = pick(rr.api_groups, draw(NAMES))
        res = pick(rr.resources, draw(_resources()))
        resource, _, sub = res.partition("/")
        if rr.namespaces and (not rr.cluster_scope or draw(st.booleans())):
            namespace = pick(rr.namespaces, draw(NAMES))
        else:
            namespace = ""
        ok = RequestAttributes(user, groups, verb, "/p", True, group, "v1", resource, sub,
                               namespace, "n")
        must.append(ok)
        # Break one dimension that no resource rule of this PolicyRule wildcards.
        breakable = []
        if all(r.verbs != ("*",) for r in rrules):
            breakable.append({"verb": "zverb"})
        if all(r.api_groups != ("*",) for r in rrules):
            breakable.append({"api_group": group + "x"})
        if all(r.resources != ("*",) for r in rrules):
            breakable.append({"resource": resource + "x"})
        if namespace and all(r.namespaces != ("*",) for r in rrules):
            breakable.append({"namespace": namespace + "x"})
        if namespace and all(not r.cluster_scope for r in rrules):
            breakable.append({"namespace": ""})  # clusterScope alone decides namespace-less requests
        if breakable:
            change = draw(st.sampled_from(breakable))
            must_not.append(RequestAttributes(**{**_fields(ok), **change}))
        # The same request shape as a non-resource request never matches a resource rule alone.
        if not nrules:
            must_not.append(RequestAttributes(user, groups, verb, "/p"))

    for nr in nrules:
        verb = draw(st.sampled_from(VERBS)) if nr.verbs == ("*",) else draw(st.sampled_from(nr.verbs))
        url = "/" + draw(NAMES) if nr.non_resource_urls == ("*",) else draw(
            st.sampled_from(nr.non_resource_urls))
        if url.endswith("*"):
            path = url[:-1] + draw(NAMES)
        elif draw(st.booleans()):
            path = url
        else:
            path = url.rstrip("/") + "/" + draw(NAMES)
        must.append(RequestAttributes(user, groups, verb, path))
        every_url = any(r.non_resource_urls == ("*",) or "/" in r.non_resource_urls for r in nrules)
        if all(r.verbs != ("*",) for r in nrules):
            must_not.append(RequestAttributes(user, groups, "zverb", path))
        if not every_url:
            must_not.append(RequestAttributes(user, groups, verb, "/z" + path))
            # "/ab" must not match "/abx": prefixes end at a segment boundary
            base = url.rstrip("*").rstrip("/")
            longer = base + "x"
            if base and not any(u == longer or longer.startswith(u.rstrip("*").rstrip("/") + "/")
                                for r in nrules for u in r.non_resource_urls):
                must_not.append(RequestAttributes(user, groups, verb, longer))
        if not rrules:
            must_not.append(RequestAttributes(user, groups, verb, path, True, "", "v1", "pods",
                                              "", "", ""))

    if can_miss_subject:
        for attrs in list(must):
            must_not.append(RequestAttributes(**{**_fields(attrs), "user": "zuser",
                                                 "groups": ("zgroup",)}))
            if user.startswith("system:serviceaccount:"):
                _, _, ns, sa = user.split(":", 3)
                for other in (f"system:serviceaccount:{ns}x:{sa}", f"system:serviceaccount:{ns}:{sa}x"):
                    if not any(s.kind == "ServiceAccount" and s.name == "*" and s.namespace == ns
                               for s in subjects) or other.startswith(f"system:serviceaccount:{ns}x"):
                        must_not.append(RequestAttributes(**{**_fields(attrs), "user": other,
                                                             "groups": ("zgroup",)}))
    return rule, must, must_not


def _fields(attrs: RequestAttributes) -> dict:
    return {name: getattr(attrs, name) for name in
            ("user", "groups", "verb", "path", "is_resource", "api_group", "api_version",
             "resource", "subresource", "namespace", "name")}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(generated())
def test_generated_rules(case):
    rule, must, must_not = case
    fs = FlowSchema("test", "pl", 500, "ByUser", (rule,))
    classifier = Classifier(config_of(fs))
    for attrs in must:
        assert flow_schema_matches(fs, attrs), attrs
        assert classifier.classify(attrs).flow_schema.name == "test", attrs
    for attrs in must_not:
        assert not flow_schema_matches(fs, attrs), attrs
        assert classifier.classify(attrs).flow_schema.name == "catch-all", attrs


# --- the index agrees with the definition on whole configurations --------------------------------

@st.composite
def schema_sets(draw):
    schemas = []
    for i in range(draw(st.integers(1, 6))):
        rules = tuple(
            PolicyRule(draw(subjects_and_identities())[0], tuple(draw(st.lists(resource_rules(),
                       max_size=2))), tuple(draw(st.lists(non_resource_rules(), max_size=2))))
            for _ in range(draw(st.integers(0, 2))))
        schemas.append(FlowSchema(f"fs{i}", draw(st.sampled_from(["pl", "reject", "exempt"])),
                                  draw(st.integers(2, 20)), "ByUser", rules))
    return schemas


@st.composite
def requests(draw):
    user = draw(st.one_of(NAMES, st.tuples(NAMES, NAMES).map(
        lambda t: f"system:serviceaccount:{t[0]}:{t[1]}")))
    groups = tuple(draw(st.lists(NAMES, max_size=3)))
    verb = draw(st.sampled_from(VERBS))
    if draw(st.booleans()):
        res = draw(_resources())
        resource, _, sub = res.partition("/")
        return RequestAttributes(user, groups, verb, "/p", True, draw(st.one_of(st.just(""), NAMES)),
                                 "v1", resource, sub, draw(st.one_of(st.just(""), NAMES)), "")
    path = "/" + "/".join(draw(st.lists(NAMES, max_size=3)))
    return RequestAttributes(user, groups, verb, path)


@settings(max_examples=150, deadline=None)
@given(schema_sets(), st.lists(requests(), min_size=1, max_size=10))
def test_index_agrees_with_definition(schemas, reqs):
    cfg = config_of(*schemas)
    classifier = Classifier(cfg)
    for attrs in reqs:
        expected = next((fs.name for fs in cfg.flow_schemas if flow_schema_matches(fs, attrs)),
                        "catch-all")
        assert classifier.classify(attrs).flow_schema.name == expected
