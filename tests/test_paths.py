"""``/api/`` and ``/apis/`` paths: Kubernetes API requests only when the configuration asks
for them (``APF_PATHS=auto``: a FlowSchema with resource rules that can tell the two apart), or
``APF_PATHS`` says so. A web app's REST-style ``GET /api/v1/items/`` lands in the same
FlowSchema as ``GET /items/``: in the resolver, in ``explain`` and in a live server's
``X-Kubernetes-PF-*`` headers; ``builtin:kubernetes`` keeps Kubernetes' parsing."""

from __future__ import annotations

import json

import pytest

from apf_gunicorn.cli import main
from apf_gunicorn.flowcontrol.kube_paths import path_parsing
from apf_gunicorn.flowcontrol.loader import load_configuration
from apf_gunicorn.flowcontrol.requestinfo import RequestInfoResolver
from apf_gunicorn.server.resolver import build_resolver, path_parsing_note
from apf_gunicorn.server.settings import SettingsError, load_settings
from tests.conftest import APPS

REST = str(APPS / "rest.yaml")


@pytest.fixture(autouse=True)
def _no_apf_environment(monkeypatch):
    """explain reads APF_* as the server does: start every test from none."""
    import os

    for name in list(os.environ):
        if name.startswith("APF_"):
            monkeypatch.delenv(name)


def _environ(method: str, path: str) -> dict:
    return {"REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": "",
            "REMOTE_ADDR": "127.0.0.1"}


@pytest.mark.parametrize("config, kubernetes, schema", [
    (None, False, None),                       # built-in webapp: match-everything rules only
    ("builtin:mandatory", False, None),        # exempt and catch-all alone
    (REST, False, None),                       # nonResourceRules only
    ("builtin:kubernetes", True, "system-leader-election"),
])  # fmt: skip
def test_auto_parses_kubernetes_paths_only_for_resource_rules(config, kubernetes, schema):
    cfg = load_configuration(config)
    found, reason = path_parsing("auto", cfg.flow_schemas)
    assert found is kubernetes
    if schema:
        assert reason == f"APF_PATHS=auto: FlowSchema {schema!r} has resource rules"
    else:
        assert reason == "APF_PATHS=auto: no FlowSchema has resource rules"
    assert path_parsing("kubernetes", cfg.flow_schemas) == (True, "APF_PATHS=kubernetes")
    assert path_parsing("plain", cfg.flow_schemas) == (False, "APF_PATHS=plain")


def test_a_wildcard_resource_rule_without_its_path_twin_counts():
    """A match-every-resource rule counts when its PolicyRule does not also match every path:
    then the parsing decides whether the rule matches."""
    import dataclasses

    cfg = load_configuration("builtin:mandatory")
    catch_all = next(fs for fs in cfg.flow_schemas if fs.name == "catch-all")
    rule = dataclasses.replace(catch_all.rules[0], non_resource_rules=())
    only_resources = dataclasses.replace(catch_all, name="resources", rules=(rule,))
    assert path_parsing("auto", [only_resources]) == (
        True, "APF_PATHS=auto: FlowSchema 'resources' has resource rules")


def test_resolver_without_kubernetes_paths_reads_api_as_a_path():
    plain = RequestInfoResolver(kubernetes_paths=False)
    attrs = plain(_environ("GET", "/api/v1/items/"))
    assert (attrs.is_resource, attrs.verb, attrs.path) == (False, "get", "/api/v1/items/")
    attrs = RequestInfoResolver()(_environ("GET", "/api/v1/items/"))
    assert (attrs.is_resource, attrs.verb, attrs.resource) == (True, "list", "items")


@pytest.mark.parametrize("config, paths, kubernetes", [
    (REST, None, False), (REST, "kubernetes", True), ("builtin:kubernetes", None, True),
    ("builtin:kubernetes", "plain", False), ("builtin:kubernetes", "PLAIN", False),
])  # fmt: skip
def test_server_resolver_follows_apf_paths(config, paths, kubernetes):
    settings = load_settings({} if paths is None else {"APF_PATHS": paths})
    cfg = load_configuration(config)
    attrs = build_resolver(settings, cfg)(_environ("GET", "/api/v1/namespaces/default/pods"))
    assert attrs.is_resource is kubernetes
    assert path_parsing_note(settings, cfg).startswith(
        "Kubernetes API requests (" if kubernetes else "paths like any other (")


def test_apf_paths_setting_is_validated():
    assert load_settings({}).paths == "auto"
    with pytest.raises(SettingsError, match=r"invalid APF_PATHS='k8s': must be 'auto'"):
        load_settings({"APF_PATHS": "k8s"})


def _explain(capsys, *argv: str) -> dict:
    assert main(["explain", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("config", [REST, None])
def test_explain_classifies_rest_api_paths_like_other_paths(capsys, config):
    argv = ["--config", config] if config else []
    api = _explain(capsys, *argv, "--request", "GET /api/v1/items/")
    items = _explain(capsys, *argv, "--request", "GET /items/")
    assert api["flowSchema"] == items["flowSchema"] != "catch-all"
    assert api["attributes"] == {"verb": "get", "path": "/api/v1/items/", "isResource": False}
    assert api["paths"] == ("paths like any other (APF_PATHS=auto: no FlowSchema has resource "
                            "rules)")
    assert main(["explain", *argv, "--request", "GET /api/v1/items/"]) == 0
    assert ("paths: /api/ and /apis/ are paths like any other (APF_PATHS=auto: no FlowSchema "
            "has resource rules)") in capsys.readouterr().out.splitlines()


def test_explain_builtin_kubernetes_keeps_kubernetes_paths(capsys):
    out = _explain(capsys, "--config", "builtin:kubernetes", "--request",
                   "GET /api/v1/namespaces/default/pods")
    a = out["attributes"]
    assert (a["isResource"], a["verb"], a["resource"], a["namespace"]) == (
        True, "list", "pods", "default")
    assert out["paths"].startswith("Kubernetes API requests (APF_PATHS=auto: FlowSchema ")


def test_explain_attribute_form_notes_kubernetes_paths_only_when_parsed(capsys):
    argv = ["--user", "a", "--verb", "get", "--path", "/api/v1/items"]
    out = _explain(capsys, "--config", REST, *argv)
    assert out["notes"] == [] and out["paths"] is None
    out = _explain(capsys, "--config", "builtin:kubernetes", *argv)
    assert any("parses /api/v1/items as a resource request" in n for n in out["notes"])


@pytest.mark.server
@pytest.mark.parametrize("config", [REST, None])
def test_live_server_classifies_rest_api_paths_like_other_paths(server_factory, config):
    """The server's PF headers for /api/v1/items/ and /items/ name the same FlowSchema, and
    the start log says how /api/ paths are read."""
    from apf_gunicorn.flowcontrol.objects import derived_uid

    kw = {"config": config} if config else {"env": {"APF_CONFIG": ""}}
    with server_factory(workers=1, threads=4, **kw) as srv:
        _, api, _ = srv.request("/api/v1/items/")
        _, items, _ = srv.request("/items/")
        log = srv.log()
    header = "X-Kubernetes-PF-FlowSchema-UID"
    assert api[header] == items[header]
    assert api[header] not in ("", derived_uid("FlowSchema", "catch-all"))
    assert ("apf: /api/ and /apis/ paths are paths like any other (APF_PATHS=auto: no "
            "FlowSchema has resource rules)") in log


RESOURCE_SCHEMA = """
---
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: FlowSchema
metadata: {name: items-api, uid: uid-fs-items-api}
spec:
  matchingPrecedence: 200
  priorityLevelConfiguration: {name: web}
  rules:
  - subjects:
    - {kind: Group, group: {name: system:unauthenticated}}
    resourceRules:
    - {verbs: ["list"], apiGroups: [""], resources: ["items"], clusterScope: true}
"""


@pytest.mark.server
def test_reload_that_adds_resource_rules_turns_kubernetes_paths_on(server_factory, tmp_path):
    """APF_PATHS=auto follows the configuration across a HUP: the workers forked after a
    reload that brings a resource rule parse /api/v1/items/ as ``list items``."""
    import os
    import shutil
    import signal

    cfg = tmp_path / "apf.yaml"
    shutil.copy(REST, cfg)
    header = "X-Kubernetes-PF-FlowSchema-UID"
    # the HUP path alone (the file watcher would apply the file before the HUP)
    with server_factory(workers=1, threads=4, config=str(cfg),
                        env={"APF_CONFIG_WATCH": "off"}) as srv:
        old_workers = set(srv.workers())
        assert srv.request("/api/v1/items/")[1][header] == "uid-fs-web"
        with open(cfg, "a") as f:
            f.write(RESOURCE_SCHEMA)
        os.kill(srv.pid, signal.SIGHUP)
        assert srv.wait_for(lambda: "generation 2 applied" in srv.log(), timeout=20)
        assert srv.wait_for(lambda: srv.workers() and not (old_workers & set(srv.workers())),
                            timeout=30)
        assert srv.wait_for(
            lambda: srv.request("/api/v1/items/")[1][header] == "uid-fs-items-api", timeout=20)
        assert srv.request("/items/")[1][header] == "uid-fs-web"
        log = srv.log()
    assert ("/api/ and /apis/ paths are Kubernetes API requests (APF_PATHS=auto: FlowSchema "
            "'items-api' has resource rules)") in log
