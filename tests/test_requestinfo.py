"""Request attributes: Kubernetes' RequestInfoFactory cases, identity from trusted proxies,
declarative routes, the APF_REQUEST_INFO hook, and hostile environs."""

from __future__ import annotations

import sys
import textwrap
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apf_gunicorn.flowcontrol.identity import MAX_GROUPS, MAX_NAME_LENGTH, identity_groups
from apf_gunicorn.flowcontrol.objects import RequestAttributes
from apf_gunicorn.flowcontrol.request_info_hook import HookError, load_request_info_hook
from apf_gunicorn.flowcontrol.requestinfo import RequestInfoResolver
from apf_gunicorn.flowcontrol.routes import RouteError, load_routes, parse_routes


def environ(method="GET", url="/", **extra):
    path, _, query = url.partition("?")
    env = {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": query,
           "REMOTE_ADDR": "192.0.2.1", "SCRIPT_NAME": ""}
    env.update(extra)
    return env


RESOLVER = RequestInfoResolver()

# --- TestGetAPIRequestInfo (requestinfo_test.go) -------------------------------------------------
# method, url, verb, group, version, namespace, resource, subresource, name
API_CASES = [
    ("GET", "/api/v1/namespaces", "list", "", "v1", "", "namespaces", "", ""),
    ("GET", "/api/v1/namespaces/other", "get", "", "v1", "other", "namespaces", "", "other"),
    ("GET", "/api/v1/namespaces/other/pods", "list", "", "v1", "other", "pods", "", ""),
    ("GET", "/api/v1/namespaces/other/pods/foo", "get", "", "v1", "other", "pods", "", "foo"),
    ("HEAD", "/api/v1/namespaces/other/pods/foo", "get", "", "v1", "other", "pods", "", "foo"),
    ("GET", "/api/v1/pods", "list", "", "v1", "", "pods", "", ""),
    ("HEAD", "/api/v1/pods", "list", "", "v1", "", "pods", "", ""),
    ("GET", "/api/v1/proxy/namespaces/other/pods/foo", "proxy", "", "v1", "other", "pods", "", "foo"),
    ("GET", "/api/v1/proxy/namespaces/other/pods/foo/subpath/not/a/subresource", "proxy", "", "v1",
     "other", "pods", "", "foo"),
    ("GET", "/api/v1/watch/pods", "watch", "", "v1", "", "pods", "", ""),
    ("GET", "/api/v1/pods?watch=true", "watch", "", "v1", "", "pods", "", ""),
    ("GET", "/api/v1/pods?watch=false", "list", "", "v1", "", "pods", "", ""),
    ("GET", "/api/v1/watch/namespaces/other/pods", "watch", "", "v1", "other", "pods", "", ""),
    ("GET", "/api/v1/namespaces/other/pods?watch=1", "watch", "", "v1", "other", "pods", "", ""),
    ("GET", "/api/v1/namespaces/other/pods?watch=0", "list", "", "v1", "other", "pods", "", ""),
    ("GET", "/api/v1/namespaces/other/pods/foo/status", "get", "", "v1", "other", "pods", "status",
     "foo"),
    ("GET", "/api/v1/namespaces/other/pods/foo/proxy/subpath", "get", "", "v1", "other", "pods",
     "proxy", "foo"),
    ("PUT", "/api/v1/namespaces/other/finalize", "update", "", "v1", "other", "namespaces",
     "finalize", "other"),
    ("PUT", "/api/v1/namespaces/other/status", "update", "", "v1", "other", "namespaces", "status",
     "other"),
    ("PATCH", "/api/v1/namespaces/other/pods/foo", "patch", "", "v1", "other", "pods", "", "foo"),
    ("DELETE", "/api/v1/namespaces/other/pods/foo", "delete", "", "v1", "other", "pods", "", "foo"),
    ("POST", "/api/v1/namespaces/other/pods", "create", "", "v1", "other", "pods", "", ""),
    ("DELETE", "/api/v1/nodes", "deletecollection", "", "v1", "", "nodes", "", ""),
    ("DELETE", "/api/v1/namespaces", "deletecollection", "", "v1", "", "namespaces", "", ""),
    ("DELETE", "/api/v1/namespaces/other/pods", "deletecollection", "", "v1", "other", "pods", "",
     ""),
    ("DELETE", "/apis/extensions/v1/namespaces/other/pods", "deletecollection", "extensions", "v1",
     "other", "pods", "", ""),
    ("POST", "/apis/extensions/v1/namespaces/other/pods", "create", "extensions", "v1", "other",
     "pods", "", ""),
    ("POST", "/apis/extensions/v1beta3/namespaces/other/pods", "create", "extensions", "v1beta3",
     "other", "pods", "", ""),
    # TestSelectorParsing
    ("GET", "/apis/group/version/resource", "list", "group", "version", "", "resource", "", ""),
    ("GET", "/apis/group/version/resource?fieldSelector=metadata.name=name1", "list", "group",
     "version", "", "resource", "", "name1"),
    ("GET", "/apis/group/version/resource?watch=true&fieldSelector=metadata.name=name1", "watch",
     "group", "version", "", "resource", "", "name1"),
    ("GET", "/apis/group/version/resource?fieldSelector=foo=bar&labelSelector=baz=qux", "list",
     "group", "version", "", "resource", "", ""),
    ("GET", "/apis/group/version/resource?fieldSelector=metadata.name=name1,foo", "list", "group",
     "version", "", "resource", "", ""),
    ("GET", "/apis/group/version/resource?fieldSelector=metadata.name=name1,foo&watch=true",
     "watch", "group", "version", "", "resource", "", ""),
    ("DELETE", "/apis/group/version/resource?fieldSelector=foo=bar", "deletecollection", "group",
     "version", "", "resource", "", ""),
    ("GET", "/apis/group/version/resource?fieldSelector=metadata.name=foo&fieldSelector="
     "metadata.name=bar", "list", "group", "version", "", "resource", "", "foo"),
    ("GET", "/apis/group/version/resource/name?fieldSelector=foo=bar", "get", "group", "version",
     "", "resource", "", "name"),
    ("GET", "/apis/group/version/watch/resource/name", "watch", "group", "version", "", "resource",
     "", "name"),
    # more of Kubernetes' parsing, followed literally
    ("GET", "/api/v1/pods?watch", "watch", "", "v1", "", "pods", "", ""),
    ("GET", "/api/v1/pods?watch=FALSE", "list", "", "v1", "", "pods", "", ""),
    ("GET", "/api/v1/watch/namespaces/ns/pods/p/status", "watch", "", "v1", "ns", "pods", "status",
     "p"),
    ("OPTIONS", "/api/v1/pods", "", "", "v1", "", "pods", "", ""),
    ("GET", "//api//v1/pods/", "get", "", "", "", "v1", "", "pods"),  # empty segments count
    ("GET", "/api/v1/namespaces/a%2Fb/pods", "list", "", "v1", "a%2Fb", "pods", "", ""),
]


@pytest.mark.parametrize("method, url, verb, group, version, ns, resource, sub, name", API_CASES,
                         ids=[f"{c[0]} {c[1]}" for c in API_CASES])
def test_kubernetes_paths(method, url, verb, group, version, ns, resource, sub, name):
    a = RESOLVER(environ(method, url))
    assert a.is_resource
    assert (a.verb, a.api_group, a.api_version, a.namespace, a.resource, a.subresource, a.name) == (
        verb, group, version, ns, resource, sub, name)
    assert a.path == url.partition("?")[0]


@pytest.mark.parametrize("url", [
    "/", "/api/version/", "/apis/group/version/", "/badprefix/version/resource",
    "/apis/version/resource", "/not-api/version/resource", "/apis/extensions/v1beta1",
    "/apis/extensions/v1beta1/", "/api/version", "/api", "", "/healthz", "/apix/v1/pods",
])
def test_non_resource_paths(url):
    a = RESOLVER(environ("POST", url))
    assert not a.is_resource
    assert a.verb == "post"
    assert a.path == (url or "/")


@pytest.mark.parametrize("url, resource", [
    ("/api/version/resource", True), ("/apis/group/version/resource/name/subresource", True),
    ("/api/version/resource/name/subresource", True), ("/apis/batch/v1/job", True),
    ("/apis/batch/v1/job/foo", True), ("/apis/batch/v1/job/foo/scale", True),
])
def test_get_non_api_request_info(url, resource):
    assert RESOLVER(environ("GET", url)).is_resource is resource


def test_special_verb_without_resource_does_not_raise():
    a = RESOLVER(environ("GET", "/api/v1/watch"))
    assert a.is_resource and a.resource == "" and a.api_version == "v1"


def test_utf8_path_and_query():
    raw = "/api/v1/namespaces/ünï/pods".encode().decode("latin-1")  # as WSGI carries it
    a = RESOLVER(environ("GET", raw))
    assert a.namespace == "ünï" and a.path == "/api/v1/namespaces/ünï/pods"
    bad = b"/api/v1/namespaces/\xff\xfe/pods".decode("latin-1")
    assert RESOLVER(environ("GET", bad)).namespace == "\ufffd\ufffd"


# --- identity ------------------------------------------------------------------------------------

TRUSTING = RequestInfoResolver(["10.0.0.0/8", "2001:db8::/32", "127.0.0.1"])


def test_trusted_proxy_headers():
    a = TRUSTING(environ(REMOTE_ADDR="10.1.2.3", HTTP_X_REMOTE_USER="alice",
                         HTTP_X_REMOTE_GROUP="dev,ops, dev ,,"))
    assert a.user == "alice"
    assert a.groups == ("dev", "ops", "system:authenticated")


@pytest.mark.parametrize("addr", ["2001:db8::5", "::ffff:10.0.0.1", "127.0.0.1",
                                  "2001:db8:1::1"])
def test_trusted_ipv6_and_mapped(addr):
    assert TRUSTING(environ(REMOTE_ADDR=addr, HTTP_X_REMOTE_USER="bob")).user == "bob"


@pytest.mark.parametrize("addr", ["192.0.2.1", "11.0.0.1", "2001:db9::1", "", "not-an-ip",
                                  None, "127.0.0.2", "unix:/tmp/sock"])
def test_untrusted_peers_headers_ignored(addr):
    env = environ(HTTP_X_REMOTE_USER="admin", HTTP_X_REMOTE_GROUP="system:masters")
    env["REMOTE_ADDR"] = addr
    a = TRUSTING(env)
    assert (a.user, a.groups) == ("system:anonymous", ("system:unauthenticated",))


def test_unix_socket_peer():
    env = environ(REMOTE_ADDR="", HTTP_X_REMOTE_USER="uma")
    assert TRUSTING(env).user == "system:anonymous"
    assert RequestInfoResolver(["unix"])(env).user == "uma"
    assert RequestInfoResolver(["UNIX", "10.0.0.0/8"])(env).user == "uma"
    assert RequestInfoResolver(["unix"])(environ(REMOTE_ADDR="10.0.0.1",
                                                 HTTP_X_REMOTE_USER="uma")).user == "system:anonymous"


def test_no_trusted_proxies_means_headers_ignored():
    a = RESOLVER(environ(REMOTE_ADDR="127.0.0.1", HTTP_X_REMOTE_USER="admin"))
    assert a.user == "system:anonymous"


def test_remote_user_from_upstream_layer():
    a = RESOLVER(environ(REMOTE_USER="carol", HTTP_X_REMOTE_USER="admin"))
    assert (a.user, a.groups) == ("carol", ("system:authenticated",))


def test_trusted_without_user_header_falls_back_to_remote_user():
    a = TRUSTING(environ(REMOTE_ADDR="10.0.0.1", HTTP_X_REMOTE_GROUP="system:masters",
                         REMOTE_USER="dave"))
    assert (a.user, a.groups) == ("dave", ("system:authenticated",))


def test_custom_header_names():
    r = RequestInfoResolver(["10.0.0.0/8"], user_header="X-Auth-User", group_header="x-auth-groups")
    a = r(environ(REMOTE_ADDR="10.0.0.1", HTTP_X_AUTH_USER="eve", HTTP_X_AUTH_GROUPS="g1"))
    assert (a.user, a.groups) == ("eve", ("g1", "system:authenticated"))


def test_identity_groups_rules():
    assert identity_groups("u", ["g"]) == ("g", "system:authenticated")
    assert identity_groups("u", ["system:authenticated"]) == ("system:authenticated",)
    assert identity_groups("system:anonymous", []) == ("system:unauthenticated",)
    assert identity_groups("u", ["system:unauthenticated"]) == ("system:unauthenticated",)


def test_bad_trusted_proxy_is_refused():
    with pytest.raises(ValueError, match="'10.0.0.300/8'"):
        RequestInfoResolver(["10.0.0.300/8"])


def test_pathological_identity_is_bounded():
    huge = "a" * 65536
    groups = ",".join(f"g{i}" for i in range(5000))
    a = TRUSTING(environ(REMOTE_ADDR="10.0.0.1", HTTP_X_REMOTE_USER=huge,
                         HTTP_X_REMOTE_GROUP=groups))
    assert len(a.user) == MAX_NAME_LENGTH
    assert len(a.groups) == MAX_GROUPS + 1  # plus system:authenticated


def test_non_utf8_user_header():
    raw = b"\xc3\xa9mile\xff".decode("latin-1")
    a = TRUSTING(environ(REMOTE_ADDR="10.0.0.1", HTTP_X_REMOTE_USER=raw))
    assert a.user == "émile\ufffd"


# --- hostile environs ----------------------------------------------------------------------------

WSGI_TEXT = st.one_of(st.text(max_size=300), st.binary(max_size=300).map(lambda b: b.decode("latin-1")))
KEYS = ["REQUEST_METHOD", "PATH_INFO", "QUERY_STRING", "REMOTE_ADDR", "REMOTE_USER",
        "HTTP_X_REMOTE_USER", "HTTP_X_REMOTE_GROUP", "SCRIPT_NAME"]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(KEYS), st.one_of(WSGI_TEXT, st.none(), st.integers(),
                                                      st.lists(st.text(max_size=3), max_size=2)),
                       max_size=len(KEYS)),
       st.sampled_from(["/api/v1/", "/apis/g/v/", "/tenants/", "", "//"]))
def test_hostile_environs_never_raise(env, prefix):
    if isinstance(env.get("PATH_INFO"), str):
        env["PATH_INFO"] = prefix + env["PATH_INFO"]
    env.setdefault("REMOTE_ADDR", "10.0.0.1")
    for resolver in (RESOLVER, TRUSTING, ROUTED):
        a = resolver._resolve(env)  # the real path, not the last-resort guard in __call__
        assert isinstance(a, RequestAttributes)
        assert isinstance(a.user, str) and a.user and all(isinstance(g, str) for g in a.groups)
        assert isinstance(a.verb, str) and isinstance(a.path, str)


def test_missing_keys():
    a = RESOLVER({})
    assert (a.user, a.verb, a.path, a.is_resource) == ("system:anonymous", "get", "/", False)


def test_odd_method_and_huge_path():
    a = RESOLVER(environ("M-SEARCH", "/x" * 40000))
    assert a.verb == "m-search" and len(a.path) == 8192


# --- routes --------------------------------------------------------------------------------------

ROUTES_YAML = """
routes:
  - path: /tenants/<namespace>/orders
    resource: orders
    apiGroup: shop
  - path: /tenants/<namespace>/orders/<int:name>
    resource: orders
    apiGroup: shop
    apiVersion: v2
    verbs: {POST: update}
  - path: /tenants/<namespace>/orders/<int:name>/refund
    resource: orders
    subresource: refund
    apiGroup: shop
    methods: [POST]
  - path: /reports/<path:name>
    resource: reports
  - path: /api/v1/special
    resource: specials
"""


@pytest.fixture(scope="module")
def routes_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("routes") / "routes.yaml"
    path.write_text(ROUTES_YAML)
    return str(path)


ROUTED = RequestInfoResolver(routes=parse_routes(__import__("yaml").safe_load(ROUTES_YAML)))


@pytest.mark.parametrize("method, url, verb, group, version, ns, resource, sub, name", [
    ("GET", "/tenants/acme/orders", "list", "shop", "", "acme", "orders", "", ""),
    ("POST", "/tenants/acme/orders", "create", "shop", "", "acme", "orders", "", ""),
    ("DELETE", "/tenants/acme/orders", "deletecollection", "shop", "", "acme", "orders", "", ""),
    ("GET", "/tenants/acme/orders/7", "get", "shop", "v2", "acme", "orders", "", "7"),
    ("HEAD", "/tenants/acme/orders/7", "get", "shop", "v2", "acme", "orders", "", "7"),
    ("PUT", "/tenants/acme/orders/7", "update", "shop", "v2", "acme", "orders", "", "7"),
    ("PATCH", "/tenants/acme/orders/7", "patch", "shop", "v2", "acme", "orders", "", "7"),
    ("POST", "/tenants/acme/orders/7", "update", "shop", "v2", "acme", "orders", "", "7"),
    ("DELETE", "/tenants/acme/orders/7", "delete", "shop", "v2", "acme", "orders", "", "7"),
    ("POST", "/tenants/acme/orders/7/refund", "create", "shop", "", "acme", "orders", "refund",
     "7"),
    ("GET", "/reports/2024/q1", "get", "", "", "", "reports", "", "2024/q1"),
    ("GET", "/api/v1/special", "list", "", "", "", "specials", "", ""),
])
def test_routes(routes_file, method, url, verb, group, version, ns, resource, sub, name):
    resolver = RequestInfoResolver(routes=load_routes(routes_file))
    a = resolver(environ(method, url))
    assert a.is_resource
    assert (a.verb, a.api_group, a.api_version, a.namespace, a.resource, a.subresource, a.name) == (
        verb, group, version, ns, resource, sub, name)


@pytest.mark.parametrize("method, url", [
    ("GET", "/tenants/acme/orders/seven"),   # int converter refuses
    ("GET", "/tenants/acme/orders/7/refund"),  # only POST is mapped
    ("GET", "/other"),
])
def test_unrouted_requests_are_non_resource(method, url):
    a = ROUTED(environ(method, url))
    assert not a.is_resource and a.verb == method.lower()


def test_kubernetes_paths_still_parsed_with_routes():
    a = ROUTED(environ("GET", "/api/v1/namespaces/x/pods"))
    assert (a.resource, a.namespace, a.verb) == ("pods", "x", "list")


@pytest.mark.parametrize("text, message", [
    ("routes: 3", "expected a list of routes"),
    ("other: []", "unknown top-level key(s) ['other']"),
    ("- 7", "routes[0]: each route must be a mapping"),
    ("- {path: /a, resource: r}\n- {path: b, resource: r}", "routes[1] (b): path is required"),
    ("- {path: /a}", "routes[0] (/a): resource is required"),
    ("- {path: /a, resource: r, verb: {GET: get}}", "routes[0] (/a): unknown key(s) ['verb']"),
    ("- {path: /a, resource: r, verbs: {GET: fetch}}", "verb 'fetch' for GET is not one of"),
    ("- {path: /a, resource: r, verbs: [get]}", "verbs must map HTTP methods to verbs"),
    ("- {path: /a, resource: r, methods: GET}", "methods must be a non-empty list"),
    ("- {path: /a, resource: r, apiGroup: 3}", "apiGroup must be a string"),
    ("- {path: '/a/<nope:x>', resource: r}", "routes[0] (/a/<nope:x>): bad path"),
    ("- {path: '/a/<x', resource: r}", "routes[0] (/a/<x): bad path"),
    ("routes: [", "not valid YAML"),
])
def test_bad_route_files(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(RouteError) as err:
        load_routes(str(path))
    assert str(err.value).startswith(str(path) + ":")
    assert message in str(err.value)


def test_missing_route_file(tmp_path):
    with pytest.raises(RouteError, match="cannot read"):
        load_routes(str(tmp_path / "nope.yaml"))


def test_empty_route_file(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_routes(str(path)).match("GET", "/x") is None


# --- the APF_REQUEST_INFO hook -------------------------------------------------------------------

@pytest.fixture
def hook_module(monkeypatch):
    module = types.ModuleType("apf_test_hooks")
    exec(textwrap.dedent("""
        from apf_gunicorn.flowcontrol.objects import RequestAttributes

        def full(environ):
            return RequestAttributes("hooked", ("g",), "get", environ.get("PATH_INFO", "/"))

        def partial(environ):
            return {"user": "tenant-" + environ["HTTP_X_TENANT"], "namespace": "t1"}

        def broken(environ):
            raise RuntimeError("boom")

        def wrong_type(environ):
            return ["nope"]

        def bad_field(environ):
            return {"usr": "x"}

        class Holder:
            @staticmethod
            def nested(environ):
                return {"verb": "watch"}

        not_callable = 3
    """), module.__dict__)
    monkeypatch.setitem(sys.modules, "apf_test_hooks", module)
    return module


def test_hook_full_result(hook_module):
    hook = load_request_info_hook("apf_test_hooks:full")
    attrs, failed = hook.resolve(environ("GET", "/x"))
    assert not failed and attrs == RequestAttributes("hooked", ("g",), "get", "/x")


def test_hook_partial_dict_fills_from_builtin(hook_module):
    hook = load_request_info_hook("apf_test_hooks:partial")
    attrs, failed = hook.resolve(environ("GET", "/api/v1/namespaces/a/pods", HTTP_X_TENANT="acme"))
    assert not failed
    assert (attrs.user, attrs.groups, attrs.namespace, attrs.resource, attrs.verb) == (
        "tenant-acme", ("system:authenticated",), "t1", "pods", "list")
    assert load_request_info_hook("apf_test_hooks:Holder.nested")(environ()).verb == "watch"


@pytest.mark.parametrize("name", ["broken", "wrong_type", "bad_field", "partial"])
def test_hook_failures_fall_back(hook_module, name):
    hook = load_request_info_hook(f"apf_test_hooks:{name}",
                                  RequestInfoResolver(["10.0.0.0/8"]))
    env = environ("GET", "/api/v1/pods", REMOTE_ADDR="10.0.0.1", HTTP_X_REMOTE_USER="zoe")
    attrs, failed = hook.resolve(env)  # "partial" fails too: no X-Tenant header
    assert failed and hook.failures == 1
    assert (attrs.user, attrs.resource, attrs.verb) == ("zoe", "pods", "list")


@pytest.mark.parametrize("spec, message", [
    ("nocolon", "expected 'module:callable'"),
    ("apf_no_such_module_xyz:f", "cannot import"),
    ("apf_test_hooks:missing", "has no 'missing'"),
    ("apf_test_hooks:not_callable", "is not callable"),
])
def test_hook_load_errors(hook_module, spec, message):
    with pytest.raises(HookError, match=message):
        load_request_info_hook(spec)
