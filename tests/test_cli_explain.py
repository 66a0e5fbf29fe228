"""``apf-gunicorn explain`` end to end through the CLI dispatcher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apf_gunicorn.cli import main
from apf_gunicorn.flowcontrol.objects import derived_uid
from apf_gunicorn.flowcontrol.shufflesharding import deal, flow_hash

ROOT = Path(__file__).resolve().parent.parent
CORE = ("flowSchema", "priorityLevel", "distinguisher", "flowHash", "hand")


def explain_json(capsys, *argv: str) -> dict:
    assert main(["explain", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(autouse=True)
def _no_apf_environment(monkeypatch):
    """explain reads APF_* as the server does: start every test from none."""
    import os

    for name in list(os.environ):
        if name.startswith("APF_"):
            monkeypatch.delenv(name)


def core(out: dict) -> dict:
    """The classification keys (the others: identity, attributes, seats, fairness, notes)."""
    return {k: out[k] for k in CORE}


def test_node_status_update_json(capsys):
    out = explain_json(capsys, "--config", "builtin:kubernetes", "--user", "system:node:n1",
                       "--group", "system:nodes", "--verb", "update", "--resource", "nodes",
                       "--subresource", "status", "--name", "n1")
    expected_hash = flow_hash("system-node-high", "system:node:n1")
    assert core(out) == {"flowSchema": "system-node-high", "priorityLevel": "node-high",
                   "distinguisher": "system:node:n1", "flowHash": expected_hash,
                   "hand": list(deal(expected_hash, 64, 6))}


def test_leader_election_lease(capsys):
    out = explain_json(capsys, "--config", "builtin:kubernetes", "--user",
                       "system:kube-controller-manager", "--verb", "update", "--resource",
                       "leases", "--api-group", "coordination.k8s.io", "--namespace",
                       "kube-system", "--name", "kube-controller-manager")
    assert (out["flowSchema"], out["priorityLevel"]) == ("system-leader-election",
                                                         "leader-election")
    assert len(out["hand"]) == 4 and all(0 <= q < 16 for q in out["hand"])


def test_anonymous_probe_is_exempt(capsys):
    out = explain_json(capsys, "--config", "builtin:kubernetes", "--user", "system:anonymous",
                       "--verb", "GET", "--path", "/healthz")
    assert core(out) == {"flowSchema": "probes", "priorityLevel": "exempt", "distinguisher": "",
                   "flowHash": 0, "hand": []}


def test_user_gets_authenticated_group(capsys):
    # Without system:authenticated added, alice (no --group) would fall to catch-all.
    out = explain_json(capsys, "--config", "builtin:kubernetes", "--user", "alice", "--verb",
                       "list", "--resource", "pods", "--namespace", "default")
    assert out["flowSchema"] == "global-default"
    assert out["distinguisher"] == "alice"
    assert out["flowHash"] == 17644606172554983095
    assert len(out["hand"]) == 6


def test_default_config_is_builtin(capsys):
    out = explain_json(capsys, "--user", "alice", "--verb", "get", "--path", "/healthz")
    assert out["priorityLevel"] == "exempt"


def test_human_output(capsys):
    assert main(["explain", "--config", "builtin:kubernetes", "--user", "admin", "--group",
                 "system:masters", "--verb", "delete", "--resource", "pods", "--namespace", "x",
                 "--name", "y"]) == 0
    lines = capsys.readouterr().out.splitlines()
    uid_fs, uid_pl = derived_uid("FlowSchema", "exempt"), derived_uid(
        "PriorityLevelConfiguration", "exempt")
    assert lines == [
        "configuration: builtin:kubernetes (from --config)",
        "concurrency limit: 64 seats, the server's default for 2 workers x 64 threads: workers "
        "x threads / 2 unless APF_CONCURRENCY_LIMIT is set (check it with --concurrency-limit)",
        "user: admin", "groups: system:masters, system:authenticated",
        "request: resource request: verb=delete apiGroup='' apiVersion='' namespace='x' "
        "resource='pods' subresource='' name='y'",
        f"flowSchema: exempt (uid {uid_fs})", f"priorityLevel: exempt (uid {uid_pl})",
        "flow: (one flow for the whole FlowSchema)", "distinguisher: ", "flowHash: 0",
        "hand: (no queues)", "seats: 1 (default) (limit 64 seats)",
        "fairness: none (exempt: never queued)"]


CUSTOM = """
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata: {name: tenants}
spec:
  type: Limited
  limited:
    nominalConcurrencyShares: 10
    limitResponse:
      type: Queue
      queuing: {queues: 8, handSize: 2, queueLengthLimit: 5}
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {name: tenants}
spec:
  priorityLevelConfiguration: {name: tenants}
  matchingPrecedence: 500
  distinguisherMethod: {type: ByNamespace}
  rules:
  - subjects: [{kind: Group, group: {name: system:authenticated}}]
    resourceRules:
    - {verbs: ["*"], apiGroups: [shop], resources: [orders], namespaces: ["*"]}
"""


def test_custom_config_file(tmp_path, capsys):
    path = tmp_path / "apf.yaml"
    path.write_text(CUSTOM)
    out = explain_json(capsys, "--config", str(path), "--user", "bob", "--verb", "create",
                       "--resource", "orders", "--api-group", "shop", "--namespace", "acme")
    h = flow_hash("tenants", "acme")
    assert core(out) == {"flowSchema": "tenants", "priorityLevel": "tenants", "distinguisher": "acme",
                   "flowHash": h, "hand": list(deal(h, 8, 2))}
    # Not in group shop: the mandatory catch-all (Reject, no queues) takes it.
    out = explain_json(capsys, "--config", str(path), "--user", "bob", "--verb", "create",
                       "--resource", "orders", "--api-group", "other", "--namespace", "acme")
    assert core(out) == {"flowSchema": "catch-all", "priorityLevel": "catch-all", "distinguisher": "",
                   "flowHash": 0, "hand": []}


def test_fairness_of_the_level_and_where_it_comes_from(tmp_path, capsys, monkeypatch):
    """The level's annotation wins over APF_FAIRNESS; explain names the fairness and its
    source."""
    argv = ("--user", "bob", "--verb", "create", "--resource", "orders", "--api-group", "shop",
            "--namespace", "acme")
    path = tmp_path / "apf.yaml"
    path.write_text(CUSTOM)
    out = explain_json(capsys, "--config", str(path), *argv)
    assert (out["fairness"], out["fairnessSource"], out["notes"]) == ("maxmin", "default", [])
    monkeypatch.setenv("APF_FAIRNESS", "kubernetes")
    out = explain_json(capsys, "--config", str(path), *argv)
    assert (out["fairness"], out["fairnessSource"], out["notes"]) == ("kubernetes",
                                                                       "APF_FAIRNESS", [])
    path.write_text(CUSTOM.replace("metadata: {name: tenants}\nspec:\n  type: Limited",
                                   "metadata:\n  name: tenants\n  annotations: "
                                   "{apf-gunicorn.io/fairness: kubernetes}\nspec:\n"
                                   "  type: Limited", 1))
    assert main(["explain", "--config", str(path), *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "fairness: kubernetes (annotation apf-gunicorn.io/fairness)" in lines
    assert not [line for line in lines if line.startswith("note:")]
    out = explain_json(capsys, "--config", "builtin:kubernetes", "--user", "admin", "--group",
                       "system:masters", "--verb", "get", "--path", "/")
    assert (out["priorityLevel"], out["fairness"], out["fairnessSource"]) == ("exempt", None,
                                                                              "exempt")


def test_configuration_and_limit_and_where_they_come_from(tmp_path, capsys, monkeypatch):
    argv = ("--user", "alice", "--verb", "get", "--path", "/healthz")
    out = explain_json(capsys, *argv)
    assert (out["config"], out["configSource"]) == ("builtin:webapp",
                                                    "the default: APF_CONFIG is not set")
    assert out["concurrencyLimit"] == out["seats"]["concurrencyLimit"] == 64
    assert out["concurrencyLimitSource"].startswith("the server's default for 2 workers x 64")
    # --workers and --threads as check takes them
    out = explain_json(capsys, *argv, "--workers", "3", "--threads", "10")
    assert out["concurrencyLimit"] == 15
    assert out["concurrencyLimitSource"].startswith("the server's default for 3 workers x 10")
    monkeypatch.setenv("APF_CONCURRENCY_LIMIT", "40")
    monkeypatch.setenv("APF_CONFIG", "builtin:kubernetes")
    out = explain_json(capsys, *argv, "--workers", "3", "--threads", "10")
    assert (out["config"], out["configSource"]) == ("builtin:kubernetes", "from APF_CONFIG")
    assert (out["concurrencyLimit"], out["concurrencyLimitSource"]) == (
        40, "from APF_CONCURRENCY_LIMIT")
    out = explain_json(capsys, *argv, "--concurrency-limit", "7", "--config", "builtin:webapp")
    assert (out["config"], out["configSource"]) == ("builtin:webapp", "from --config")
    assert (out["concurrencyLimit"], out["concurrencyLimitSource"]) == (
        7, "from --concurrency-limit")
    assert main(["explain", *argv]) == 0
    first, second = capsys.readouterr().out.splitlines()[:2]
    assert first == "configuration: builtin:kubernetes (from APF_CONFIG)"
    assert second == "concurrency limit: 40 seats, from APF_CONCURRENCY_LIMIT"
    with pytest.raises(SystemExit) as exc:
        main(["explain", *argv, "--concurrency-limit", "0"])
    assert exc.value.code == 2 and "must be positive, got 0" in capsys.readouterr().err


# A probe schema sending GET /healthz to LEVEL, and a schema sending everything else to tenants.
HEALTH_SCHEMAS = """
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {name: health}
spec:
  priorityLevelConfiguration: {name: LEVEL}
  matchingPrecedence: 100
  rules:
  - subjects: [{kind: Group, group: {name: system:unauthenticated}}]
    nonResourceRules: [{verbs: [get], nonResourceURLs: [/healthz]}]
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {name: web}
spec:
  priorityLevelConfiguration: {name: tenants}
  matchingPrecedence: 500
  rules:
  - subjects: [{kind: Group, group: {name: system:unauthenticated}}]
    nonResourceRules: [{verbs: ["*"], nonResourceURLs: ["*"]}]
"""


def health_config(level: str) -> str:
    """CUSTOM plus HEALTH_SCHEMAS, the probe schema naming ``level``."""
    return CUSTOM + "---" + HEALTH_SCHEMAS.replace("LEVEL", level)


@pytest.mark.parametrize("level", ["exempt", "catch-all"])
def test_schema_naming_an_undefined_mandatory_level(tmp_path, capsys, level):
    path = tmp_path / "apf.yaml"
    path.write_text(health_config(level))
    out = explain_json(capsys, "--config", str(path), "--request", "GET /healthz")
    assert (out["flowSchema"], out["priorityLevel"], out["notes"]) == ("health", level, [])
    assert out["priorityLevelUID"] == derived_uid("PriorityLevelConfiguration", level)


def test_dangling_schema_that_would_have_matched_is_named(tmp_path, capsys):
    path = tmp_path / "apf.yaml"
    path.write_text(health_config("probes"))
    out = explain_json(capsys, "--config", str(path), "--request", "GET /healthz")
    assert (out["flowSchema"], out["priorityLevel"]) == ("web", "tenants")
    (note,) = out["notes"]
    assert note.startswith(f"FlowSchema 'health' ({path}, matchingPrecedence 100) matches this "
                           "request but was skipped: This FlowSchema references the "
                           'PriorityLevelConfiguration object named "probes" but there is no '
                           "such object")
    # a request the dangling schema would not match gets no note
    out = explain_json(capsys, "--config", str(path), "--request", "POST /healthz")
    assert out["notes"] == []


def test_invalid_config_exit_1(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(CUSTOM.replace("matchingPrecedence: 500", "matchingPrecedence: 20000"))
    assert main(["explain", "--config", str(path), "--user", "a", "--verb", "get", "--path",
                 "/"]) == 1
    err = capsys.readouterr().err
    assert "invalid configuration" in err and "must not be greater than 10000" in err


def test_unreadable_config_exit_2(tmp_path, capsys):
    assert main(["explain", "--config", str(tmp_path / "missing.yaml"), "--user", "a", "--verb",
                 "get", "--path", "/"]) == 2
    assert "cannot read" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--user", "a", "--verb", "get"],                                   # neither --path nor --resource
    ["--user", "a", "--verb", "get", "--path", "/", "--resource", "r"],  # both
    ["--verb", "get", "--path", "/"],                                   # no --user
])
def test_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["explain", *argv])
    assert exc.value.code == 2


# --- the request form: the server's resolver ---------------------------------------------------

K8S = ("--config", "builtin:kubernetes")


def test_request_resource_path_as_the_server(capsys, monkeypatch):
    # The example: --path made this non-resource and catch-all; the server says pods.
    monkeypatch.setenv("APF_TRUSTED_PROXIES", "10.0.0.0/8")
    out = explain_json(capsys, *K8S, "--request", "GET /api/v1/namespaces/default/pods",
                       "--user", "bob")
    assert (out["flowSchema"], out["priorityLevel"]) == ("global-default", "global-default")
    assert out["attributes"] == {"verb": "list", "path": "/api/v1/namespaces/default/pods",
                                 "isResource": True, "apiGroup": "", "apiVersion": "v1",
                                 "namespace": "default", "resource": "pods", "subresource": "",
                                 "name": ""}
    assert (out["user"], out["groups"]) == ("bob", ["system:authenticated"])
    assert out["notes"] == ["--user sent as X-Remote-User by a trusted proxy"]
    assert out["fairness"] == "maxmin"  # the server's default
    assert out["seats"]["initial"] == 1 and out["seats"]["source"] == "default"
    watch = explain_json(capsys, *K8S, "--request", "GET /api/v1/pods?watch=true", "--user", "b")
    assert watch["attributes"]["verb"] == "watch" and watch["seats"]["longRunning"] is True


def test_request_empty_user_is_anonymous(capsys, monkeypatch):
    monkeypatch.setenv("APF_TRUSTED_PROXIES", "127.0.0.1")
    out = explain_json(capsys, *K8S, "--request", "GET /version", "--user", "")
    assert (out["user"], out["groups"]) == ("system:anonymous", ["system:unauthenticated"])
    assert out["flowSchema"] == "global-default"
    old = explain_json(capsys, *K8S, "--user", "", "--verb", "get", "--path", "/version")
    assert (old["user"], old["flowSchema"]) == ("system:anonymous", "global-default")


def test_request_headers_count_only_from_a_trusted_peer(capsys, monkeypatch):
    monkeypatch.setenv("APF_TRUSTED_PROXIES", "10.0.0.0/8")
    argv = (*K8S, "--request", "GET /api/v1/nodes", "--header", "X-Remote-User: eve",
            "--header", "X-Remote-Group: system:masters", "--header", "X-Remote-User: mallory")
    out = explain_json(capsys, *argv, "--remote-addr", "10.1.2.3")
    assert (out["user"], out["flowSchema"]) == ("eve", "exempt")  # first user wins
    out = explain_json(capsys, *argv)  # from 127.0.0.1: untrusted
    assert (out["user"], out["flowSchema"]) == ("system:anonymous", "global-default")


def test_request_user_without_proxy_is_remote_user(capsys):
    out = explain_json(capsys, *K8S, "--request", "GET /api/v1/nodes", "--user", "carol")
    assert out["user"] == "carol"
    assert out["notes"] == ["--user set as REMOTE_USER (no trusted proxy is configured)"]
    assert main(["explain", *K8S, "--request", "GET /", "--user", "c", "--group", "g"]) == 2
    assert "set APF_TRUSTED_PROXIES" in capsys.readouterr().err


def test_request_address_flows(capsys, monkeypatch):
    monkeypatch.setenv("APF_USER_FROM", "address")
    config = str(ROOT / "tests" / "apps" / "apf.yaml")
    a = explain_json(capsys, "--config", config, "--request", "GET /work", "--remote-addr",
                     "127.0.0.2")
    b = explain_json(capsys, "--config", config, "--request", "GET /work", "--remote-addr",
                     "127.0.0.3")
    assert (a["user"], a["groups"]) == ("addr:127.0.0.2", ["system:unauthenticated"])
    assert a["flowSchema"] == b["flowSchema"] == "work"
    assert a["distinguisher"] == a["flow"] == "addr:127.0.0.2"
    assert a["flowHash"] != b["flowHash"]
    # --user is ignored when no source reads it, and explain says so
    c = explain_json(capsys, "--config", config, "--request", "GET /work", "--user", "x")
    assert c["user"] == "addr:127.0.0.1" and "--user ignored" in c["notes"][0]


def test_request_address_flows_with_the_builtin_configuration(capsys, monkeypatch):
    """The built-in anonymous level shuffle-shards clients: no one-queue note, a hand each."""
    monkeypatch.setenv("APF_USER_FROM", "address")
    a, b = (explain_json(capsys, "--request", "GET /work", "--remote-addr", addr)
            for addr in ("203.0.113.1", "203.0.113.2"))
    assert (a["flowSchema"], a["priorityLevel"], a["notes"]) == ("anonymous", "anonymous", [])
    assert a["config"] == "builtin:public"  # nobody can be signed in: the clients get the seats
    assert "APF_USER_FROM=address names no verified identity" in a["configSource"]
    assert a["distinguisher"] == "addr:203.0.113.1" and a["flowHash"] != b["flowHash"]
    assert len(a["hand"]) == len(b["hand"]) == 3 and a["hand"] != b["hand"]


def test_request_costs(capsys, monkeypatch):
    apps = ROOT / "tests" / "apps"
    monkeypatch.setenv("APF_ROUTES", str(apps / "seats_routes.yaml"))
    monkeypatch.setenv("APF_CONCURRENCY_LIMIT", "16")
    argv = ("--config", str(apps / "seats.yaml"), "--app", "tests.apps.seats_app:app")
    wide = explain_json(capsys, *argv, "--request", "GET /wide")
    assert (wide["seats"]["initial"], wide["seats"]["source"]) == (4, "APF_ROUTES")
    clamped = explain_json(capsys, *argv, "--request", "GET /clamped")
    assert clamped["seats"]["source"] == "@cost"
    assert clamped["seats"]["requested"]["initial"] == 4
    assert clamped["seats"]["initial"] == clamped["seats"]["maxSeats"] < 4
    linger = explain_json(capsys, *argv, "--request", "GET /linger")
    assert (linger["seats"]["final"], linger["seats"]["additionalLatency"]) == (2, "6s")
    assert main(["explain", *argv, "--request", "GET /clamped"]) == 0
    assert "clamped to the level's max" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["--request", "GET"], 'expected "METHOD PATH"'),
    (["--request", "GET nothing"], "must start with /"),
    (["--request", "GET /", "--header", "novalue"], 'expected "Name: value"'),
    (["--request", "GET /", "--remote-addr", "host"], "not an IP address"),
    (["--request", "GET /", "--app", "no_such_module:app"], "cannot import"),
])
def test_request_usage_errors(argv, words, capsys):
    assert main(["explain", *K8S, *argv]) == 2
    assert words in capsys.readouterr().err


def test_request_bad_setting_exit_2(capsys, monkeypatch):
    monkeypatch.setenv("APF_USER_FROM", "cookie")
    assert main(["explain", "--request", "GET /"]) == 2
    assert "invalid APF_USER_FROM='cookie'" in capsys.readouterr().err


def test_request_and_attribute_forms_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["explain", "--request", "GET /", "--verb", "get", "--path", "/"])
    assert exc.value.code == 2


def test_request_user_through_a_unix_socket_proxy(capsys, monkeypatch):
    monkeypatch.setenv("APF_TRUSTED_PROXIES", "unix")
    out = explain_json(capsys, *K8S, "--request", "GET /api/v1/nodes", "--user", "dora",
                       "--group", "system:masters")
    assert (out["user"], out["flowSchema"]) == ("dora", "exempt")


def test_request_cost_from_the_estimator_hook(capsys, monkeypatch, tmp_path):
    (tmp_path / "explain_estimator.py").write_text(
        "def estimate(environ, attrs, c):\n"
        "    return {'seats': 3} if environ['PATH_INFO'].startswith('/big') else None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("APF_WORK_ESTIMATOR", "explain_estimator:estimate")
    big = explain_json(capsys, *K8S, "--request", "GET /big/report", "--user", "x",
                       "--concurrency-limit", "2000")
    assert (big["seats"]["initial"], big["seats"]["source"]) == (3, "APF_WORK_ESTIMATOR")
    assert big["seats"]["maxSeats"] > 3 and big["seats"]["concurrencyLimit"] == 2000
    small = explain_json(capsys, *K8S, "--request", "GET /small", "--user", "x")
    assert (small["seats"]["initial"], small["seats"]["source"]) == (1, "default")


def test_attribute_form_points_to_the_request_form_for_api_paths(capsys):
    out = explain_json(capsys, *K8S, "--user", "bob", "--verb", "list", "--path",
                       "/api/v1/namespaces/default/pods")
    assert out["attributes"]["isResource"] is False
    assert out["notes"] == ["--path is a non-resource request here, but the server parses "
                            "/api/v1/namespaces/default/pods as a resource request: ask with "
                            '--request "GET /api/v1/namespaces/default/pods" for the server\'s '
                            "answer"]
    assert explain_json(capsys, *K8S, "--user", "bob", "--verb", "get", "--path",
                        "/healthz")["notes"] == []


def test_an_auto_limit_from_the_environment(capsys, monkeypatch):
    argv = ("--user", "alice", "--verb", "get", "--path", "/healthz", "--workers", "2",
            "--threads", "20")
    monkeypatch.setenv("APF_CONCURRENCY_LIMIT", "auto:2-4")
    out = explain_json(capsys, *argv)
    assert out["concurrencyLimit"] == out["seats"]["concurrencyLimit"] == 4  # the default 20, bounded
    assert out["concurrencyLimitAuto"] == {"start": 4, "min": 2, "max": 4}
    assert out["concurrencyLimitSource"] == "from APF_CONCURRENCY_LIMIT"
    assert main(["explain", *argv]) == 0
    second = capsys.readouterr().out.splitlines()[1]
    assert second == ("concurrency limit: auto (starts at 4 seats, bounds 2-4; experimental: "
                      "the server moves it), from APF_CONCURRENCY_LIMIT")
    out = explain_json(capsys, *argv, "--concurrency-limit", "9")  # the flag wins
    assert (out["concurrencyLimit"], out["concurrencyLimitAuto"]) == (9, None)
