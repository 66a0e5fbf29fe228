"""On a real gunicorn: ``explain`` gives the server's answer, the PF uid headers are never
empty and survive a restart, the first ``X-Remote-User`` wins, and ``APF_USER_FROM`` makes
anonymous clients separate flows without ever making them somebody.

The live server reports the FlowSchema and priority level of each request in its
``X-Kubernetes-PF-*-UID`` headers; ``explain --json`` reports the same uids.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import threading
import time

import pytest

from apf_gunicorn.cli import main
from apf_gunicorn.flowcontrol.objects import derived_uid
from tests.conftest import free_port

pytestmark = pytest.mark.server

FS_UID = "X-Kubernetes-PF-FlowSchema-UID"
PL_UID = "X-Kubernetes-PF-PriorityLevel-UID"
DUMP = "/debug/api_priority_and_fairness/dump_requests?includeRequestDetails=1"


def send(port: int, method: str, path: str, headers=(), source: str | None = None,
         timeout: float = 30.0) -> tuple[int, dict]:
    """One request with ``headers`` as (name, value) pairs, repeats and empty values kept."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout,
                                      source_address=(source, 0) if source else None)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in headers:
            conn.putheader(name, value)
        conn.endheaders()
        resp = conn.getresponse()
        resp.read()
        return resp.status, dict(resp.getheaders())
    finally:
        conn.close()


def explain(capsys, argv: list[str]) -> dict:
    assert main(["explain", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def apf_env(monkeypatch):
    """The environment of explain: none of the caller's APF_* variables."""
    import os

    for name in list(os.environ):
        if name.startswith("APF_"):
            monkeypatch.delenv(name)
    return monkeypatch


# (method, path, user or None for no header, groups, extra headers)
CASES = [
    ("GET", "/api/v1/namespaces/default/pods", "bob", [], []),                  # resource
    ("GET", "/api/v1/namespaces/default/pods/p1", "bob", [], []),
    ("PUT", "/api/v1/nodes/n1/status", "system:node:n1", ["system:nodes"], []),
    ("GET", "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/kcm",
     "system:kube-controller-manager", [], []),
    ("GET", "/api/v1/namespaces/kube-system/configmaps",
     "system:serviceaccount:kube-system:job", [], []),
    ("DELETE", "/api/v1/namespaces/x/pods", "admin", ["system:masters"], []),   # a group
    ("GET", "/api/v1/pods?watch=1", "alice", ["dev", "ops"], []),
    ("GET", "/openapi/v2", "alice", [], []),                                    # non-resource
    ("POST", "/hello", "carol", [], []),
    ("GET", "/healthz", None, [], []),                                          # anonymous
    ("GET", "/api/v1/namespaces/default/pods", None, [], []),
    ("GET", "/version", "", [], []),                                            # empty user
    ("GET", "/api/v1/nodes", "", ["system:masters"], []),
]


def test_explain_agrees_with_the_live_server(server_factory, apf_env, capsys):
    apf_env.setenv("APF_TRUSTED_PROXIES", "127.0.0.1")  # as the server below (conftest)
    with server_factory(workers=1, threads=4, config="builtin:kubernetes") as srv:
        seen = set()
        for method, path, user, groups, extra in CASES:
            headers = list(extra)
            argv = ["--config", "builtin:kubernetes", "--request", f"{method} {path}"]
            if user is not None:
                headers += [("X-Remote-User", user)] + [("X-Remote-Group", g) for g in groups]
                argv += ["--user", user] + [a for g in groups for a in ("--group", g)]
            _, live = send(srv.port, method, path, headers)
            out = explain(capsys, argv)
            assert (live[FS_UID], live[PL_UID]) == (out["flowSchemaUID"],
                                                    out["priorityLevelUID"]), (method, path,
                                                                               user, out)
            seen.add(out["flowSchema"])
        # the cases reach many schemas, resource and non-resource, exempt and not
        assert {"global-default", "system-node-high", "exempt", "probes",
                "kube-system-service-accounts", "system-leader-election"} <= seen, seen

        # Repeated X-Remote-User: the first wins, in the server and in explain alike
        repeated = [("X-Remote-User", "system:kube-controller-manager"),
                    ("X-Remote-User", "bob")]
        path = "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/kcm"
        _, live = send(srv.port, "GET", path, repeated)
        out = explain(capsys, ["--config", "builtin:kubernetes", "--request", f"GET {path}",
                               "--header", "X-Remote-User: system:kube-controller-manager",
                               "--header", "X-Remote-User: bob"])
        assert out["user"] == "system:kube-controller-manager"
        assert out["flowSchema"] == "system-leader-election"
        assert live[FS_UID] == out["flowSchemaUID"]


def test_pf_uid_headers_never_empty_and_stable(server_factory):
    """The built-in configuration has no metadata.uid: the headers carry derived uids, the
    same after a restart."""
    got = []
    for _ in range(2):
        with server_factory(workers=1, threads=2, config="builtin:webapp") as srv:
            status, headers = send(srv.port, "GET", "/hello")
            assert status == 200
            got.append((headers[FS_UID], headers[PL_UID]))
    assert got[0] == got[1] == (derived_uid("FlowSchema", "anonymous"),
                                derived_uid("PriorityLevelConfiguration", "anonymous"))


ADDRESS_CONFIG = """
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata: {name: exempt}
spec: {type: Exempt, exempt: {}}
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata: {name: shared}
spec:
  type: Limited
  limited:
    nominalConcurrencyShares: 100
    limitResponse:
      type: Queue
      queuing: {queues: 16, handSize: 2, queueLengthLimit: 10}
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {name: admins}
spec:
  matchingPrecedence: 10
  priorityLevelConfiguration: {name: exempt}
  rules:
  - subjects: [{kind: User, user: {name: admin}}, {kind: Group, group: {name: ops}}]
    nonResourceRules: [{verbs: ["*"], nonResourceURLs: ["*"]}]
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {name: members}
spec:
  matchingPrecedence: 100
  priorityLevelConfiguration: {name: shared}
  distinguisherMethod: {type: ByUser}
  rules:
  - subjects: [{kind: Group, group: {name: system:authenticated}}]
    nonResourceRules: [{verbs: ["*"], nonResourceURLs: ["*"]}]
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {name: anonymous}
spec:
  matchingPrecedence: 200
  priorityLevelConfiguration: {name: shared}
  distinguisherMethod: {type: ByUser}
  rules:
  - subjects: [{kind: Group, group: {name: system:unauthenticated}}]
    nonResourceRules: [{verbs: ["*"], nonResourceURLs: ["*"]}]
"""


def _b64(data: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


def _rows(text: str) -> list[list[str]]:
    lines = text.splitlines()
    header = [c.strip() for c in lines[0].split(",")]
    return [dict(zip(header, (c.strip() for c in line.split(",")), strict=False))
            for line in lines[1:]]


def test_anonymous_clients_by_address_are_separate_flows(server_factory, tmp_path, apf_env,
                                                          capsys):
    """APF_USER_FROM=jwt-sub,address: two anonymous clients (127.0.0.2, 127.0.0.3) are two
    flows of the unauthenticated FlowSchema; a forged token naming the exempt user, or forged
    proxy headers, change nothing but the flow's name."""
    config = tmp_path / "apf.yaml"
    config.write_text(ADDRESS_CONFIG)
    aport = free_port()
    env = {"APF_USER_FROM": "jwt-sub,address", "APF_ADMIN_BIND": f"127.0.0.1:{aport}"}
    anon_uid = derived_uid("FlowSchema", "anonymous")
    with server_factory(workers=1, threads=8, config=str(config), env=env) as srv:
        # Two slow anonymous requests from two addresses, in flight together.
        results = {}

        def slow(source):
            results[source] = send(srv.port, "GET", "/work?ms=4000", source=source)

        threads = [threading.Thread(target=slow, args=(a,)) for a in ("127.0.0.2", "127.0.0.3")]
        for t in threads:
            t.start()
        rows = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            conn = http.client.HTTPConnection("127.0.0.1", aport, timeout=10)
            conn.request("GET", DUMP)
            rows = [r for r in _rows(conn.getresponse().read().decode())
                    if r.get("APIPath") == "/work"]
            conn.close()
            if len(rows) == 2:
                break
            time.sleep(0.05)
        for t in threads:
            t.join()
        assert len(rows) == 2, rows
        assert {r["FlowDistingsher"] for r in rows} == {"addr:127.0.0.2", "addr:127.0.0.3"}
        assert {r["UserName"] for r in rows} == {"addr:127.0.0.2", "addr:127.0.0.3"}
        assert {r["FlowSchemaName"] for r in rows} == {"anonymous"}
        assert all(status == 200 and h[FS_UID] == anon_uid for status, h in results.values())

        # explain names the same two flows, with different hashes
        apf_env.setenv("APF_USER_FROM", "jwt-sub,address")
        flows = [explain(capsys, ["--config", str(config), "--request", "GET /work?ms=4000",
                                  "--remote-addr", a]) for a in ("127.0.0.2", "127.0.0.3")]
        assert [f["distinguisher"] for f in flows] == ["addr:127.0.0.2", "addr:127.0.0.3"]
        assert flows[0]["flowHash"] != flows[1]["flowHash"]
        assert all(f["flowSchemaUID"] == anon_uid for f in flows)

        # Forged: a token for the exempt user, and proxy headers from an untrusted source
        token = f"{_b64({'alg': 'none'})}.{_b64({'sub': 'admin', 'groups': ['ops']})}."
        forged = [("Authorization", f"Bearer {token}"), ("X-Remote-User", "admin"),
                  ("X-Remote-Group", "ops")]
        status, headers = send(srv.port, "GET", "/hello", forged, source="127.0.0.2")
        assert status == 200 and headers[FS_UID] == anon_uid
        assert headers[FS_UID] != derived_uid("FlowSchema", "admins")
        out = explain(capsys, ["--config", str(config), "--request", "GET /hello",
                               "--remote-addr", "127.0.0.2",
                               *[a for n, v in forged for a in ("--header", f"{n}: {v}")]])
        assert (out["user"], out["groups"]) == ("jwt:admin", ["system:unauthenticated"])
        assert out["flowSchemaUID"] == headers[FS_UID]


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 30.0):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self):
        import socket

        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.unix_path)


def test_trusted_proxy_on_a_unix_socket(server_factory, tmp_path):
    """APF_TRUSTED_PROXIES=unix: identity headers count from a peer on the Unix socket (a proxy
    on the same host), not from a TCP peer."""
    config = tmp_path / "apf.yaml"
    config.write_text(ADDRESS_CONFIG)
    sock_path = str(tmp_path / "apf.sock")
    env = {"APF_TRUSTED_PROXIES": "unix"}
    with server_factory(workers=1, threads=2, config=str(config), env=env,
                        args=("-b", f"unix:{sock_path}")) as srv:
        conn = _UnixConnection(sock_path)
        try:
            conn.request("GET", "/hello", headers={"X-Remote-User": "alice"})
            resp = conn.getresponse()
            resp.read()
            via_unix = resp.getheader(FS_UID)
        finally:
            conn.close()
        _, via_tcp = send(srv.port, "GET", "/hello", [("X-Remote-User", "alice")])
    assert via_unix == derived_uid("FlowSchema", "members")
    assert via_tcp[FS_UID] == derived_uid("FlowSchema", "anonymous")


def test_dump_names_the_flow_on_a_single_queue_level(server_factory, tmp_path):
    """builtin:webapp with an anonymous level of one queue, where Kubernetes computes no
    distinguisher; the dump's FlowDistingsher column still names the flow."""
    from apf_gunicorn.flowcontrol.loader import builtin_path

    config = tmp_path / "webapp"
    config.mkdir()
    for f in builtin_path("webapp").glob("*.yaml"):
        (config / f.name).write_text(f.read_text().replace(
            "queues: 12\n        handSize: 3\n", "queues: 1\n        handSize: 1\n"))
    assert "queues: 1\n" in (config / "webapp.yaml").read_text()
    aport = free_port()
    env = {"APF_USER_FROM": "address", "APF_ADMIN_BIND": f"127.0.0.1:{aport}"}
    with server_factory(workers=1, threads=4, config=str(config), env=env) as srv:
        t = threading.Thread(target=send, args=(srv.port, "GET", "/work?ms=3000"),
                             kwargs={"source": "127.0.0.2"})
        t.start()
        rows = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not rows:
            conn = http.client.HTTPConnection("127.0.0.1", aport, timeout=10)
            conn.request("GET", DUMP)
            rows = [r for r in _rows(conn.getresponse().read().decode())
                    if r.get("APIPath") == "/work"]
            conn.close()
            time.sleep(0.05)
        t.join()
    assert [(r["PriorityLevelName"], r["FlowDistingsher"]) for r in rows] == [
        ("anonymous", "addr:127.0.0.2")]


def test_verified_token_matches_its_schema_and_a_forged_one_does_not(server_factory, tmp_path,
                                                                      apf_env, capsys):
    """APF_JWT_KEY: a token signed with the key is the user ``sub`` with its groups, so the
    group ``ops`` reaches the ``admins`` schema; the same claims unsigned (``alg: none``) or
    signed with another key name nobody, and the next source (``address``) answers."""
    import jwt

    secret = b"a-test-secret-of-more-than-32-bytes-0123456789"
    key_file = tmp_path / "jwt.key"
    key_file.write_bytes(secret + b"\n")
    config = tmp_path / "apf.yaml"
    config.write_text(ADDRESS_CONFIG)
    env = {"APF_USER_FROM": "jwt-sub,address", "APF_JWT_KEY": str(key_file),
           "APF_JWT_AUDIENCE": "shop"}
    exp = int(time.time()) + 3600
    claims = {"sub": "carol", "groups": ["ops"], "aud": "shop", "exp": exp}
    signed = jwt.encode(claims, secret, algorithm="HS256")
    member = jwt.encode({**claims, "sub": "dave", "groups": []}, secret, algorithm="HS256")
    forged = [jwt.encode(claims, None, algorithm="none"),
              jwt.encode(claims, b"another-secret-of-more-than-32-bytes-xx", algorithm="HS256"),
              jwt.encode({**claims, "exp": exp - 7200}, secret, algorithm="HS256")]
    admins = derived_uid("FlowSchema", "admins")
    with server_factory(workers=1, threads=4, config=str(config), env=env) as srv:
        def uid(token):
            status, headers = send(srv.port, "GET", "/hello",
                                   [("Authorization", f"Bearer {token}")])
            assert status == 200
            return headers[FS_UID]

        assert uid(signed) == admins
        assert uid(signed) == admins  # again, from the caches
        assert "APF_JWT_AUDIENCE" not in srv.log()
        assert uid(member) == derived_uid("FlowSchema", "members")
        for token in forged:
            assert uid(token) == derived_uid("FlowSchema", "anonymous")
    # explain verifies with the same code and settings
    for name, value in env.items():
        apf_env.setenv(name, value)
    out = explain(capsys, ["--config", str(config), "--request", "GET /hello",
                           "--header", f"Authorization: Bearer {signed}"])
    assert (out["user"], out["groups"], out["flowSchemaUID"]) == (
        "carol", ["ops", "system:authenticated"], admins)
    out = explain(capsys, ["--config", str(config), "--request", "GET /hello",
                           "--header", f"Authorization: Bearer {forged[0]}"])
    assert out["user"] == "addr:127.0.0.1"
    assert any("does not verify" in note for note in out["notes"]), out["notes"]


def test_a_token_cannot_make_its_holder_exempt(server_factory, tmp_path, apf_env, capsys):
    """Issue 25 item 1: under builtin:webapp a verified token with groups ["system:masters"]
    was classified exempt (the mandatory FlowSchema), never limited; its user "system:..."
    could reach Kubernetes' system schemas. The group is dropped, the user refused."""
    import jwt

    secret = b"a-test-secret-of-more-than-32-bytes-0123456789"
    key_file = tmp_path / "jwt.key"
    key_file.write_bytes(secret)
    env = {"APF_USER_FROM": "jwt-sub,address", "APF_JWT_KEY": str(key_file)}
    exp = int(time.time()) + 3600
    masters = jwt.encode({"sub": "mallory", "groups": ["system:masters"], "exp": exp}, secret,
                         algorithm="HS256")
    system_user = jwt.encode({"sub": "system:admin", "exp": exp}, secret, algorithm="HS256")
    with server_factory(workers=1, threads=4, config="builtin:webapp", env=env) as srv:
        def uid(token):
            status, headers = send(srv.port, "GET", "/hello",
                                   [("Authorization", f"Bearer {token}")])
            assert status == 200
            return headers[FS_UID]

        assert uid(masters) == derived_uid("FlowSchema", "users")
        assert uid(system_user) == derived_uid("FlowSchema", "anonymous")
        # no APF_JWT_AUDIENCE: tokens for any audience verify, which the start says
        assert re.search(r"\[WARNING\] apf: APF_JWT_KEY without APF_JWT_AUDIENCE: a token the key "
                         r"verifies names its sub whatever its aud", srv.log()), srv.log()
    for name, value in env.items():
        apf_env.setenv(name, value)
    out = explain(capsys, ["--config", "builtin:webapp", "--request", "GET /hello",
                           "--header", f"Authorization: Bearer {masters}"])
    assert (out["user"], out["groups"], out["flowSchema"]) == (
        "mallory", ["system:authenticated"], "users")
    out = explain(capsys, ["--config", "builtin:webapp", "--request", "GET /hello",
                           "--header", f"Authorization: Bearer {system_user}"])
    assert out["user"] == "addr:127.0.0.1"
    assert any("system: namespace" in note for note in out["notes"]), out["notes"]


UNTRUSTED = "identity header X-Remote-User from peer 127.0.0.1 ignored"


def test_identity_headers_from_an_untrusted_peer_are_logged(server_factory):
    """Issue 25 item 18: without APF_TRUSTED_PROXIES, X-Remote-User from 127.0.0.1 was
    ignored without a word (alice and a flooding bob became one anonymous flow). The server
    says so at start, and when such headers arrive: naming the peer and the setting, at most
    once a minute per worker."""
    env = {"APF_TRUSTED_PROXIES": ""}
    with server_factory(workers=1, threads=4, config="builtin:webapp", env=env) as srv:
        start = ("identity source proxy of APF_USER_FROM=proxy,remote_user (the default) never "
                 "names anybody: APF_TRUSTED_PROXIES is empty")
        assert start in srv.log()  # logged before the server answered its first request
        # a note, not a warning: REMOTE_USER still names users, and a default start is quiet
        assert f"[INFO] apf: {start}" in srv.log()
        assert UNTRUSTED not in srv.log()
        status, headers = send(srv.port, "GET", "/hello", [("X-Remote-User", "alice")])
        assert status == 200 and headers[FS_UID] == derived_uid("FlowSchema", "anonymous")
        # the warning is logged before the app runs, so it is in the log once answered
        log = srv.log()
        assert log.count(UNTRUSTED) == 1, log
        line = next(line for line in log.splitlines() if UNTRUSTED in line)
        assert "APF_TRUSTED_PROXIES (empty)" in line and "APF_TRUSTED_PROXIES=127.0.0.1" in line
        for i, user in enumerate(["bob", "alice", "carol"] * 3):  # new shapes: classified anew
            status, _ = send(srv.port, "GET", f"/hello?n={i}", [("X-Remote-User", user)])
            assert status == 200
        assert srv.log().count(UNTRUSTED) == 1  # rate-limited
        assert srv.log().count(start) == 1
