"""``apf-gunicorn check``: the 3.3 table in JSON, every error of an invalid configuration, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from apf_gunicorn.cli import main
from tests.test_cli_explain import health_config

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "config"


def run_check(capsys, *argv):
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_kubernetes_table_in_json(capsys):
    code, out, _ = run_check(
        capsys, str(ROOT / "apf_gunicorn" / "builtin_config" / "kubernetes"), "--concurrency-limit", "600", "--json"
    )
    assert code == 0
    report = json.loads(out)
    rows = {pl["name"]: pl for pl in report["priorityLevels"]}
    got = {
        n: (r["nominal"], r["lendable"], r["lower"], r["upper"], r["maxSeats"])
        for n, r in rows.items()
    }
    assert got == {
        "exempt": (0, 0, 0, 600, None),
        "catch-all": (13, 0, 13, 613, None),
        "system": (74, 24, 50, 674, 12),
        "node-high": (98, 25, 73, 698, 15),
        "leader-election": (25, 0, 25, 625, 4),
        "workload-high": (98, 49, 49, 698, 15),
        "workload-low": (245, 221, 24, 845, 37),
        "global-default": (49, 25, 24, 649, 8),
    }
    wl = rows["workload-low"]
    assert (wl["type"], wl["nominalConcurrencyShares"], wl["borrowing"]) == ("Limited", 100, 600)
    assert (wl["queues"], wl["handSize"], wl["queueLengthLimit"]) == (128, 6, 50)
    assert rows["exempt"]["queues"] is None
    assert report["nominalSum"] == 602 and report["dangling"] == []
    assert [fs["name"] for fs in report["flowSchemas"]][:3] == [
        "exempt",
        "probes",
        "system-leader-election",
    ]


def test_text_output_with_a_given_limit(capsys):
    code, out, err = run_check(capsys, "builtin:webapp", "--concurrency-limit", "600")
    assert code == 0 and err == ""
    assert out.startswith("Server concurrency limit 600 seats, from --concurrency-limit;")
    level_table = out.split("\n\n")[1]  # header line, level table, schema table
    lines = {line.split()[0]: line.split() for line in level_table.splitlines()}
    # PRIORITY LEVEL TYPE SHARES NOMINAL LENDABLE LOWER UPPER MAX-SEATS QUEUES HAND QLL
    assert lines["users"][1:] == [
        "Limited/Queue",
        "100",
        "480",
        "0",
        "480",
        "1080",
        "72",
        "16",
        "4",
        "3",
    ]
    assert lines["anonymous"][1:] == [
        "Limited/Queue",
        "20",
        "96",
        "0",
        "96",
        "96",
        "15",
        "12",
        "3",
        "1",
    ]


def test_default_limit_is_the_servers_and_says_so(capsys):
    # apf_gunicorn.conf: 2 workers x 64 threads; the server's default is workers x threads / 2
    code, out, _ = run_check(capsys, "builtin:webapp")
    assert code == 0
    assert out.startswith("Server concurrency limit 64 seats, the server's default for 2 workers "
                          "x 64 threads: workers x threads / 2 unless APF_CONCURRENCY_LIMIT")
    code, out, _ = run_check(capsys, "builtin:webapp", "--workers", "3", "--threads", "10",
                             "--json")
    doc = json.loads(out)
    assert code == 0 and doc["valid"] is True and doc["concurrencyLimit"] == 15
    assert doc["concurrencyLimitSource"].startswith("the server's default for 3 workers x 10")
    code, out, _ = run_check(capsys, "builtin:webapp", "--workers", "3", "--threads", "10",
                             "--concurrency-limit", "7", "--json")
    doc = json.loads(out)
    assert (doc["concurrencyLimit"], doc["concurrencyLimitSource"]) == (7, "from --concurrency-limit")


def test_invalid_configuration_as_json(capsys):
    code, out, err = run_check(capsys, str(DATA / "invalid"), "--json")
    assert code == 1 and err == ""
    doc = json.loads(out)
    assert doc["valid"] is False and len(doc["errors"]) == 14
    assert doc["errors"][0] == {
        "file": str(DATA / "invalid" / "a.yaml"), "kind": "FlowSchema", "name": "bad-precedence",
        "field": "spec.matchingPrecedence",
        "message": "Invalid value: 20000: must not be greater than 10000"}
    assert doc["errors"][-1]["kind"] == "Deployment"
    code, out, err = run_check(capsys, str(DATA / "missing.yaml"), "--json")
    doc = json.loads(out)
    assert code == 2 and doc["valid"] is False and err == ""
    (e,) = doc["errors"]
    assert e["file"] == str(DATA / "missing.yaml") and e["message"].startswith("cannot read ")


def test_dangling_schema_exits_1_naming_file_schema_and_field(capsys):
    path = DATA / "kubectl-list.yaml"
    code, out, err = run_check(capsys, str(path), "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["valid"] is True  # the server would start, without the schema
    (d,) = doc["dangling"]
    assert (d["name"], d["priorityLevel"], d["field"]) == (
        "batch-jobs", "batch", "spec.priorityLevelConfiguration.name")
    lines = err.splitlines()
    assert lines[0] == (f"{path}: 1 dangling FlowSchema (the server would start without it, "
                        "as Kubernetes does):")
    assert lines[1].startswith(f'  {path}: FlowSchema "batch-jobs": '
                               'spec.priorityLevelConfiguration.name: This FlowSchema references '
                               'the PriorityLevelConfiguration object named "batch"')
    assert "Define that PriorityLevelConfiguration or name an existing one" in lines[1]
    assert len(lines) == 2
    code, out, err = run_check(capsys, str(path))
    assert code == 1 and out.startswith("Server concurrency limit") and "batch-jobs" in err


@pytest.mark.parametrize("level", ["exempt", "catch-all"])
def test_schema_naming_an_undefined_mandatory_level_is_fine(capsys, tmp_path, level):
    path = tmp_path / "probes.yaml"
    path.write_text(health_config(level))
    code, out, err = run_check(capsys, str(path), "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert doc["dangling"] == []
    assert [(fs["name"], fs["priorityLevel"]) for fs in doc["flowSchemas"]] == [
        ("exempt", "exempt"), ("health", level), ("tenants", "tenants"), ("web", "tenants"),
        ("catch-all", "catch-all")]


def test_one_error_is_singular(capsys, tmp_path):
    path = tmp_path / "one.yaml"
    path.write_text(health_config("exempt").replace("matchingPrecedence: 100",
                                                    "matchingPrecedence: 0.5"))
    code, _, err = run_check(capsys, str(path))
    assert code == 1
    assert err.splitlines()[0] == f"{path}: invalid configuration (1 error):"


def test_invalid_configuration_lists_every_error(capsys):
    code, out, err = run_check(capsys, str(DATA / "invalid"))
    assert code == 1 and out == ""
    a, b = DATA / "invalid" / "a.yaml", DATA / "invalid" / "b.yaml"
    expected = [
        (a, 'FlowSchema "bad-precedence"', "spec.matchingPrecedence: Invalid value: 20000: must not be greater than 10000"),
        (a, 'FlowSchema "bad-precedence"', 'spec.distinguisherMethod.type: Unsupported value: "ByIP"'),
        (a, 'FlowSchema "bad-precedence"', 'spec.priorityLevelConfiguration.name: Invalid value: "Not_A_Name"'),
        (a, 'FlowSchema "bad-precedence"', 'spec.rules[0].subjects[0].kind: Unsupported value: "Robot"'),
        (a, 'FlowSchema "bad-precedence"', 'spec.rules[0].nonResourceRules[0].verbs: Unsupported value: []string{"post"}'),
        (a, 'FlowSchema "bad-precedence"', 'spec.rules[0].nonResourceRules[0].nonResourceURLs[0]: Invalid value: "/api*": wildcard can only do suffix matching'),
        (a, 'PriorityLevelConfiguration "too-wide"', "spec.limited.nominalConcurrencyShares: Invalid value: -4: must be a non-negative integer"),
        (a, 'PriorityLevelConfiguration "too-wide"', "spec.limited.lendablePercent: Invalid value: 150: must be between 0 and 100, inclusive"),
        (a, 'PriorityLevelConfiguration "too-wide"', "spec.limited.limitResponse.queuing.handSize: Invalid value: 8: required entropy bits of deckSize 512 and handSize 8 should not be greater than 60"),
        (b, 'FlowSchema "wrong-types"', 'spec.matchingPrecedence: Invalid value: "high": must be an integer'),
        (b, 'FlowSchema "wrong-types"', "spec.rules: Invalid value: {}: must be a list"),
        (b, 'PriorityLevelConfiguration "exempt"', "spec.type: Invalid value: \"Limited\": type must be 'Exempt' if and only if name is 'exempt'"),
        (b, 'PriorityLevelConfiguration "exempt"', "spec: Invalid value: {"),
        (b, 'Deployment "web"', 'kind: Unsupported value: "Deployment"'),
    ]  # fmt: skip
    lines = err.splitlines()
    assert lines[0] == f"{DATA / 'invalid'}: invalid configuration ({len(expected)} errors):"
    assert len(lines) == len(expected) + 1
    for line, (file, obj, text) in zip(lines[1:], expected, strict=True):
        assert line.startswith(f"  {file}: {obj}: {text}"), line


def test_unreadable_path_exits_2(capsys, tmp_path):
    code, out, err = run_check(capsys, str(tmp_path / "missing"))
    assert code == 2 and out == "" and "cannot read" in err
    code, _, err = run_check(capsys, "builtin:nope")
    assert code == 2 and "available:" in err


def test_module_entry_point_subprocess():
    proc = subprocess.run(
        [sys.executable, "-m", "apf_gunicorn", "check", "apf_gunicorn/builtin_config/kubernetes", "--concurrency-limit", "600", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = {pl["name"]: pl for pl in json.loads(proc.stdout)["priorityLevels"]}
    assert (rows["node-high"]["nominal"], rows["node-high"]["lendable"]) == (98, 25)
    assert (rows["global-default"]["nominal"], rows["global-default"]["lendable"]) == (49, 25)


def test_version_names_the_installed_package_gunicorn_python_and_fast_path():
    import importlib.metadata
    import platform
    import tomllib

    import gunicorn

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert importlib.metadata.version("apf_gunicorn") == declared
    proc = subprocess.run([sys.executable, "-m", "apf_gunicorn", "--version"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"apf-gunicorn {declared} (gunicorn {gunicorn.__version__}, "
                                  f"Python {platform.python_version()}, ")
    assert proc.stdout.rstrip().endswith(("C fast path)", "pure-Python fast path)"))


ANNOTATED = """\
apiVersion: flowcontrol.apiserver.k8s.io/v1
kind: PriorityLevelConfiguration
metadata:
  name: tenants
  annotations: {apf-gunicorn.io/fairness: maxmin}
spec:
  type: Limited
  limited:
    nominalConcurrencyShares: 10
    limitResponse: {type: Queue, queuing: {queues: 8, handSize: 2, queueLengthLimit: 5}}
"""


def test_fairness_annotation_shown(tmp_path, capsys):
    """Each level's fairness annotation is reported, in the JSON and in the text."""
    path = tmp_path / "apf.yaml"
    path.write_text(ANNOTATED)
    code, out, err = run_check(capsys, str(path), "--json")
    assert code == 0 and err == ""
    levels = {lv["name"]: lv["fairness"] for lv in json.loads(out)["priorityLevels"]}
    assert levels == {"tenants": "maxmin", "exempt": None, "catch-all": None}
    path.write_text(ANNOTATED.replace("maxmin", "kubernetes"))
    code, out, err = run_check(capsys, str(path))
    assert code == 0 and err == ""
    assert ("Fairness by annotation (apf-gunicorn.io/fairness): tenants kubernetes; "
            "other levels: APF_FAIRNESS (default maxmin).") in out.splitlines()


def test_max_seats_annotation_shown(tmp_path, capsys):
    """A level's apf-gunicorn.io/max-seats replaces Kubernetes' 15% in MAX SEATS, and check
    says which levels set it."""
    path = tmp_path / "apf.yaml"
    path.write_text(ANNOTATED.replace("{apf-gunicorn.io/fairness: maxmin}",
                                      '{apf-gunicorn.io/max-seats: "4"}'))
    code, out, err = run_check(capsys, str(path), "--concurrency-limit", "8", "--json")
    assert code == 0 and err == ""
    levels = {lv["name"]: (lv["maxSeats"], lv["maxSeatsAnnotation"])
              for lv in json.loads(out)["priorityLevels"]}
    assert levels["tenants"] == (4, 4)  # 15% of its 7 nominal seats would be 2
    assert levels["catch-all"] == (None, None)
    code, out, err = run_check(capsys, str(path), "--concurrency-limit", "8")
    assert code == 0 and err == ""
    assert ("Max seats by annotation (apf-gunicorn.io/max-seats): tenants 4; other queuing "
            "levels: Kubernetes' 15% of nominal.") in out.splitlines()


def test_an_auto_limit_says_where_it_starts_and_its_bounds(capsys):
    code, out, _ = run_check(capsys, "builtin:webapp", "--concurrency-limit", "auto:4-30",
                             "--workers", "2", "--threads", "20")
    assert code == 0
    assert out.startswith("Server concurrency limit auto (starts at 20 seats, bounds 4-30; "
                          "experimental: the server moves it), from --concurrency-limit;")
    code, out, _ = run_check(capsys, "builtin:webapp", "--concurrency-limit", "auto", "--json",
                             "--workers", "2", "--threads", "3")
    doc = json.loads(out)
    assert doc["concurrencyLimit"] == 3  # the default (2 x 3 / 2)
    assert doc["concurrencyLimitAuto"] == {"start": 3, "min": 1, "max": 3}  # plain auto: to the default
    with pytest.raises(SystemExit) as exc:
        main(["check", "builtin:webapp", "--concurrency-limit", "auto:9-3"])
    assert exc.value.code == 2 and "auto:MIN-MAX" in capsys.readouterr().err
