"""``apf-gunicorn explain`` end to end through the CLI dispatcher."""

from __future__ import annotations

import json

import pytest

from apf_gunicorn.cli import main
from apf_gunicorn.flowcontrol.shufflesharding import deal, flow_hash


def explain_json(capsys, *argv: str) -> dict:
    assert main(["explain", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_node_status_update_json(capsys):
    out = explain_json(capsys, "--config", "builtin:kubernetes", "--user", "system:node:n1",
                       "--group", "system:nodes", "--verb", "update", "--resource", "nodes",
                       "--subresource", "status", "--name", "n1")
    expected_hash = flow_hash("system-node-high", "system:node:n1")
    assert out == {"flowSchema": "system-node-high", "priorityLevel": "node-high",
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
    assert out == {"flowSchema": "probes", "priorityLevel": "exempt", "distinguisher": "",
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
    assert lines == ["user: admin", "groups: system:masters, system:authenticated",
                     "flowSchema: exempt", "priorityLevel: exempt", "distinguisher: ",
                     "flowHash: 0", "hand: (no queues)"]


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
    assert out == {"flowSchema": "tenants", "priorityLevel": "tenants", "distinguisher": "acme",
                   "flowHash": h, "hand": list(deal(h, 8, 2))}
    # Not in group shop: the mandatory catch-all (Reject, no queues) takes it.
    out = explain_json(capsys, "--config", str(path), "--user", "bob", "--verb", "create",
                       "--resource", "orders", "--api-group", "other", "--namespace", "acme")
    assert out == {"flowSchema": "catch-all", "priorityLevel": "catch-all", "distinguisher": "",
                   "flowHash": 0, "hand": []}


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
